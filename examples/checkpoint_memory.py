"""A checkpoint of any size on every backend, in about the memory of its weights.

    pip install .
    python examples/checkpoint_memory.py            # writes a small Llama-shaped checkpoint first
    python examples/checkpoint_memory.py DIR        # a transformers checkpoint folder (config.json + safetensors)

For each backend: where the weights live (onnxruntime reads them from the
checkpoint's own files past 64 MiB: no protobuf holds them), the seconds to
prepare, the peak resident memory against the weights' bytes, and the greedy
tokens (every backend the same).
"""

import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import graphc
from graphc.attention.hf_lm import causal_lm_config_from_hf
from graphc.mapped import distinct_nbytes, release_mapped_pages
from graphc.memory import format_bytes, reset_resident_peak, resident_peak_bytes
from graphc.weights import load_weights
from lowering import generate, prepare, unavailable_reason

CONFIG = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "vocab_size": 8000, "rope_theta": 10000.0, "tie_word_embeddings": False}  # fmt: skip


def small_checkpoint(folder: Path) -> Path:
    """Write into ``folder`` what save_pretrained writes: config.json and model.safetensors (seeded weights; a Llama
    graph's weights carry transformers' names)."""
    (folder / "config.json").write_text(json.dumps(CONFIG))
    seeded = graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0)
    tensors = {k: np.ascontiguousarray(v) for k, v in seeded.initializers.items() if k.endswith(".weight")}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def main(folder: Path) -> None:
    model = graphc.causal_lm_from_hf(folder / "config.json", load_weights(folder), logits="last")
    sizes = {"batch": 1, "seq": 1, "past_seq": 24}
    model = graphc.optimize(model, hints=sizes).graph
    print(f"{folder}: weights {format_bytes(distinct_nbytes(model.initializers.values()))}")
    for backend in ("numpy", "ort-cpu", "torch"):
        if unavailable_reason(backend):
            continue
        gc.collect()
        release_mapped_pages()  # pages an earlier backend read stop counting
        reset_resident_peak()
        start = time.perf_counter()
        runner = prepare(model, backend, **({"attention": "auto", "sizes": sizes} if backend == "ort-cpu" else {}))
        prepared = time.perf_counter() - start
        tokens = generate(model, [[5, 17, 33, 901]], 8, runner=runner).new_tokens[0].tolist()
        peak = resident_peak_bytes() or 0
        print(f"  {backend:8} prepared in {prepared:5.2f} s, peak RSS {format_bytes(peak)}, tokens {tokens}")
        print(f"  {'':8} weights: {runner.weights or 'the mapped arrays, in place'}")
        del runner


def on_the_folder_given(main: Callable[[Path], None]) -> None:
    """``main`` on the checkpoint folder named on the command line, or on a small one written for the run and removed after."""
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as work:
            main(small_checkpoint(Path(work)))


if __name__ == "__main__":
    on_the_folder_given(main)
