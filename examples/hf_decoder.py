"""From a transformers config.json and .safetensors weights to an optimized ONNX decoder stack, compared on every backend.

    pip install .                                    # graphc (safetensors comes with it)
    python examples/hf_decoder.py CONFIG.json WEIGHTS   # WEIGHTS: a .safetensors file or a checkpoint folder

    pip install torch==2.13.0 transformers           # only for the next line
    python examples/hf_decoder.py                    # writes a small random Mistral checkpoint first

Nothing is downloaded: the config and weights are local files.  Any family
graphc reads works (llama, mistral, qwen2, qwen3, gemma2, falcon); Falcon's
fused query_key_value is split into q/k/v by ``decoder_weights_from_hf``.
"""

import sys
import tempfile
from pathlib import Path

import graphc
from graphc.attention.decoder import decoder_stack_graph
from graphc.attention.hf import decoder_configs_from_hf, decoder_weights_from_hf
from graphc.weights import load_weights
from lowering import compare, export, unavailable_reason


def small_checkpoint(folder: Path) -> tuple[Path, Path]:
    """A 2-layer random Mistral (sliding window 4) saved as config.json + model.safetensors."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.MistralConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_hidden_layers=2,
        sliding_window=4,
        vocab_size=32,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config)
    (folder / "config.json").write_text(config.to_json_string())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    return folder / "config.json", folder / "model.safetensors"


def main(config_path: Path, weights_path: Path, out: Path) -> None:
    """Build, optimize, export and compare the decoder stack of ``config_path`` with ``weights_path``."""
    configs = decoder_configs_from_hf(config_path)  # one per layer: windows may alternate
    weights = load_weights(weights_path, dtype="float32")  # memory-mapped (a copy only when converting)
    weights = decoder_weights_from_hf(weights, config_path)  # graphc's names (Falcon's fused QKV split; others pass through)
    stack = decoder_stack_graph(configs, weights=weights, kv_cache=True, final_norm="model.norm.weight" in weights)
    print(
        f"{len(configs)} layers: {configs[0].attention.kind}, window {configs[0].attention.sliding_window}, rope base "
        f"{configs[0].attention.rope.base:g}"
    )
    sizes = {"batch": 1, "seq": 1, "past_seq": 16}
    optimized, report = graphc.optimize(stack, hints=sizes)
    print(report)
    model = export(optimized, out, attention="auto", sizes=sizes, external_data=True)
    print(f"wrote {out} ({len(model.graph.node)} nodes) and {out}.data")
    backends = [b for b in ("numpy", "onnx-reference", "ort-cpu", "torch") if unavailable_reason(b) is None]
    print(compare(stack, sizes=sizes, backends=backends, repeats=3))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # what is written here is removed afterwards; name an output to keep it
        work = Path(tmp)
        if len(sys.argv) >= 3:
            cfg, wts = Path(sys.argv[1]), Path(sys.argv[2])
        else:
            cfg, wts = small_checkpoint(work)
        main(cfg, wts, Path(sys.argv[3]) if len(sys.argv) > 3 else work / "decoder.onnx")
