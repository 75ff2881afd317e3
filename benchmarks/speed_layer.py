"""The decoder-layer part of ``bench_speed.py``: a Mistral-7B-shaped transformers layer against graphc's build of it.

One ``MistralDecoderLayer`` (d_model 4096, 32/8 heads, head_dim 128, MLP 14336,
RMSNorm, RoPE; float32, random weights) in its ``attn_implementation``
"eager" and "sdpa" forms, the same layer exported by ``torch.onnx.export``
(dynamo) and run on onnxruntime, graphc's ``decoder_stack_graph`` built from
the layer's own config and state dict (optimized with no hints, run on NumPy
and on onnxruntime with ``attention="auto"``), and graphc's import of the
torch export re-exported (``from_onnx`` -> ``optimize`` -> ``export``).  Cases:
causal prefill of 1024 tokens, and one token decoded over a 4096-token cache
(the cache given as ``past_key``/``past_value``; every variant returns the new
present K/V).  Every variant's output is checked against the eager module's.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

import graphc
from lowering import prepare

__all__ = ["LAYER_CASES", "layer_variants", "layer_feeds", "layer_work"]

LAYER_CASES = {"layer causal prefill 1024": dict(seq=1024, past=0), "layer decode 4096": dict(seq=1, past=4096)}
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
PEERS = ("transformers eager", "transformers sdpa", "torch.onnx export on ORT")


def _hf_layer():  # type: ignore[no-untyped-def]
    import torch
    import transformers
    from transformers.models.mistral import modeling_mistral

    config = transformers.MistralConfig(**SHAPE, num_hidden_layers=1, sliding_window=None, attn_implementation="eager")
    torch.manual_seed(0)
    layer = modeling_mistral.MistralDecoderLayer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    return config, layer, modeling_mistral.MistralRotaryEmbedding(config)


def _step_module(layer, rope):  # type: ignore[no-untyped-def]
    """``(x, past_key, past_value) -> (out, present_key, present_value)`` around the transformers layer: what a user exports."""
    import torch
    from transformers import DynamicCache

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.rope = layer, rope

        def forward(self, x, past_key, past_value):  # type: ignore[no-untyped-def]
            s, past = x.shape[1], past_key.shape[2]
            positions = torch.arange(past, past + s).unsqueeze(0)
            cache = DynamicCache()
            if past:
                cache.update(past_key, past_value, 0)
            mask = torch.full((s, past + s), float("-inf")).triu(past + 1)[None, None]
            out = self.layer(x, attention_mask=mask, past_key_values=cache, position_embeddings=self.rope(x, positions), position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
            return out, cache.layers[0].keys, cache.layers[0].values

    return Step().eval()


def layer_feeds(case: str, seed: int = 0) -> dict[str, np.ndarray]:
    """``x_BSM`` and the past cache (empty for prefill) of one case."""
    c = LAYER_CASES[case]
    rng = np.random.default_rng(seed)
    kv = (1, SHAPE["num_key_value_heads"], c["past"], SHAPE["head_dim"])
    return {
        "x_BSM": rng.standard_normal((1, c["seq"], SHAPE["hidden_size"]), dtype=np.float32),
        "past_key": rng.standard_normal(kv, dtype=np.float32),
        "past_value": rng.standard_normal(kv, dtype=np.float32),
    }


def layer_work(case: str) -> tuple[float, float]:
    """(FLOPs, bytes read) of one call: projections, MLP and the visible attention scores; weights, cache and activations."""
    c = LAYER_CASES[case]
    d, f, hq, hkv, hd = (SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    params = d * (hq + 2 * hkv) * hd + hq * hd * d + 3 * d * f
    s, t = c["seq"], c["past"] + c["seq"]
    visible = s * t - s * (s - 1) / 2
    flops = 2 * s * params + 4 * hq * hd * visible
    return flops, 4 * (params + 2 * hkv * t * hd + 2 * s * d)


def _torch_runner(step) -> Callable[[dict], np.ndarray]:  # type: ignore[no-untyped-def]
    import torch

    tensors: dict[int, tuple] = {}

    def run(feeds: dict) -> np.ndarray:
        if id(feeds) not in tensors:  # once per feeds dict, outside the timed calls that follow
            tensors[id(feeds)] = tuple(torch.from_numpy(feeds[k]) for k in ("x_BSM", "past_key", "past_value"))
        t = tensors[id(feeds)]
        with torch.no_grad():
            return step(*t)[0].numpy()

    return run


def _ort_runner(path: Path, threads: int) -> Callable[[dict], np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return lambda feeds: sess.run(None, {n: feeds[k] for n, k in zip(names, ("x_BSM", "past_key", "past_value"))})[0]


def _graphc_runner(prepared, decode: bool) -> Callable[[dict], np.ndarray]:  # type: ignore[no-untyped-def]
    names = {"x_BSM": "x_BSM", "past_key": "past_key.0", "past_value": "past_value.0"} if decode else {"x_BSM": "x_BSM"}
    return lambda feeds: prepared.run({g: feeds[k] for k, g in names.items()})["out_BSM"]


def layer_variants(case: str, threads: int, workdir: Path | None = None) -> dict[str, Callable[[dict], np.ndarray] | str]:
    """Every variant's run function for ``case`` (or the reason it cannot run); the eager module first (the reference)."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return {name: "torch and transformers are not installed" for name in PEERS}
    import torch

    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf
    from graphc.onnx_import import from_onnx
    from lowering.onnx_export import export

    torch.set_num_threads(threads)
    c = LAYER_CASES[case]
    decode = c["past"] > 0
    sizes = {"batch": 1, "seq": c["seq"], **({"past_seq": c["past"]} if decode else {})}
    config, layer, rope = _hf_layer()
    step = _step_module(layer, rope)
    out: dict[str, Callable[[dict], np.ndarray] | str] = {"transformers eager": _torch_runner(step)}
    sdpa_config = type(config)(**{**config.to_dict(), "attn_implementation": "sdpa"})
    sdpa_layer = type(layer)(sdpa_config, layer_idx=0).eval()
    sdpa_layer.load_state_dict(layer.state_dict())
    out["transformers sdpa"] = _torch_runner(_step_module(sdpa_layer, rope))
    work = Path(workdir or tempfile.mkdtemp(prefix="graphc_layer_"))
    feeds = layer_feeds(case)
    path = work / "torch_export.onnx"
    try:
        args = tuple(torch.from_numpy(feeds[k]) for k in ("x_BSM", "past_key", "past_value"))
        torch.onnx.export(
            step,
            args,
            str(path),
            dynamo=True,
            input_names=["x", "past_key", "past_value"],
            output_names=["out", "present_key", "present_value"],
            external_data=True,
            verbose=False,
        )
        out["torch.onnx export on ORT"] = _ort_runner(path, threads)
    except Exception as e:  # noqa: BLE001 - a peer that cannot be exported is reported, not fatal
        out["torch.onnx export on ORT"] = f"n/a: torch.onnx.export failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    weights = {f"model.layers.0.{k}": v.detach().numpy().copy() for k, v in layer.state_dict().items()}
    g = graphc.optimize(decoder_stack_graph(decoder_configs_from_hf(config, 1), weights=weights, kv_cache=decode)).graph
    out["graphc numpy"] = _graphc_runner(prepare(g, "numpy", threads=threads, sizes=sizes), decode)
    out["graphc ort-cpu"] = _graphc_runner(prepare(g, "ort-cpu", attention="auto", threads=threads, sizes=sizes), decode)
    if path.exists():
        imported = graphc.optimize(from_onnx(path), hints=sizes).graph
        export(imported, work / "graphc_reexport.onnx", opset=23, attention="auto", sizes=sizes, external_data=True)
        out["graphc import of the torch export, ORT"] = _ort_runner(work / "graphc_reexport.onnx", threads)
    return out
