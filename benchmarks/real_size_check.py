"""A checkpoint at a real model's size: TinyLlama-1.1B's shape in float32 (22 layers, 4.4 GB of weights).

transformers writes it (``save_pretrained``, random weights: unit-scale embeddings and layers that each add a little to
the residual stream, so greedy tokens vary); graphc maps the folder and generates for a left-padded batch of two
prompts on NumPy and on onnxruntime (whose session reads the weights from the safetensors file: the model is past
protobuf's 2 GiB), and every backend's 16 greedy tokens must be transformers' ``generate(do_sample=False)`` tokens.
Two-layer models cannot show what this does: the 2 GiB limit, and the memory and time of a real load.

    python benchmarks/real_size_check.py [--work DIR]

needs ``pip install ".[parity]"`` (torch and transformers) and about 12 GiB of free disk; prints one line a backend
(PASS or FAIL, the seconds to prepare and to generate) and exits 1 when any backend's tokens differ.  The unit suite
keeps a small variant (``tests/test_real_size.py``: the same path, the weights read from the checkpoint files, at a
size that runs in seconds); this script is the check at the size users run, about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rope_theta": 10000.0,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
PROMPTS = [[5, 17, 33, 2001, 901], [7, 1, 90, 44, 12, 60, 311, 4, 18]]
NEW = 16


def write_checkpoint(folder: Path, config: dict, prompts: list[list[int]], new: int) -> np.ndarray:
    """Write a random-weight Llama of ``config`` with ``save_pretrained`` into ``folder``; return transformers' greedy
    tokens for the left-padded ``prompts``."""
    import torch
    import transformers

    from lowering import left_pad

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**config)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():  # unit-scale embeddings, each layer adding a little: the greedy tokens vary (the default init repeats one)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else (0.3 if "o_proj" in name or "down_proj" in name else 1.0) * p.shape[-1] ** -0.5)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # to_empty left its buffers uninitialised
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        out = model.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=new, do_sample=False, pad_token_id=0)
    want = out[:, ids.shape[1] :].numpy()
    del model, out
    gc.collect()
    return want


def check(folder: Path, want: np.ndarray, prompts: list[list[int]], new: int, backends: list[str], inline_max: int | None = None) -> dict[str, bool]:
    """Generate on each backend from the mapped checkpoint; ``{backend: tokens equal want}``, one line printed each."""
    import graphc
    from graphc.weights import load_weights
    from lowering import generate, prepare

    sizes = {"batch": len(prompts), "seq": 1, "past_seq": max(map(len, prompts)) + new}
    g = graphc.causal_lm_from_hf(folder / "config.json", load_weights(folder), logits="last")
    g = graphc.optimize(g, hints=sizes).graph
    results = {}
    for backend in backends:
        t0 = time.perf_counter()
        options = {"attention": "auto", "sizes": sizes} if backend == "ort-cpu" else {}
        if backend == "ort-cpu" and inline_max is not None:
            options["inline_weights_max_bytes"] = inline_max
        runner = prepare(g, backend, **options)
        ready = time.perf_counter() - t0
        if backend == "ort-cpu" and "read from the checkpoint files" not in runner.weights:
            raise AssertionError(f"ort-cpu did not read its weights from the checkpoint files: {runner.weights}")
        t0 = time.perf_counter()
        got = generate(g, prompts, new, runner=runner).new_tokens
        results[backend] = bool(np.array_equal(got, want))
        print(f"{backend:8s} {'PASS' if results[backend] else 'FAIL'}  prepare {ready:.1f} s, generate {time.perf_counter() - t0:.1f} s"
              + ("" if results[backend] else f"\n  got  {got.tolist()}\n  want {want.tolist()}"))  # fmt: skip
        del runner
        gc.collect()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="folder for the 4.4 GB checkpoint (default: a temporary one, removed after)")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="graphc_real_size_"))
    folder = work / "tinyllama-f32"
    if shutil.disk_usage(work).free < 12 * 2**30:
        print(f"under 12 GiB free in {work}: a 4.4 GB checkpoint and its copy in page cache need it", file=sys.stderr)
        return 2
    try:
        t0 = time.perf_counter()
        want = write_checkpoint(folder, TINYLLAMA, PROMPTS, NEW)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**30
        print(f"checkpoint written by transformers in {time.perf_counter() - t0:.1f} s ({size:.2f} GiB)")
        from lowering.backends.registry import unavailable_reason

        results = check(folder, want, PROMPTS, NEW, [b for b in ("numpy", "ort-cpu") if unavailable_reason(b) is None])
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
