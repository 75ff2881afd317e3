"""The decoder-layer part of ``bench_speed.py``: Mistral-7B-shaped transformers layers against graphc's build of them.

One ``MistralDecoderLayer``, and a stack of two (d_model 4096, 32/8 heads,
head_dim 128, MLP 14336, RMSNorm, RoPE; float32, random weights) in their
``attn_implementation`` "eager" and "sdpa" forms (sharing one set of
weights), the same layers exported by ``torch.onnx.export`` (dynamo) and run
on onnxruntime, graphc's ``decoder_stack_graph`` built from the layers' own
config and state dict (optimized with no hints, run on NumPy
and on onnxruntime with ``attention="auto"``), and graphc's import of the
torch export re-exported (``from_onnx`` -> ``optimize`` -> ``export``).  Cases:
causal prefill of 1024 tokens, and one token decoded over a 4096-token cache
(the cache of each layer given as ``past_key.i``/``past_value.i``; every
variant returns the new present K/V).  Every variant's output is checked against the eager module's.
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

LAYER_CASES = {
    "layer causal prefill 1024": dict(seq=1024, past=0, layers=1),
    "layer decode 4096": dict(seq=1, past=4096, layers=1),
    "2-layer stack causal prefill 1024": dict(seq=1024, past=0, layers=2),
    "2-layer stack decode 4096": dict(seq=1, past=4096, layers=2),
}
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
PEERS = ("transformers eager", "transformers sdpa", "torch.onnx export on ORT")


def _hf_layers(n: int):  # type: ignore[no-untyped-def]
    import torch
    import transformers
    from transformers.models.mistral import modeling_mistral

    config = transformers.MistralConfig(**SHAPE, num_hidden_layers=n, sliding_window=None, attn_implementation="eager")
    torch.manual_seed(0)
    layers = [modeling_mistral.MistralDecoderLayer(config, layer_idx=i).eval() for i in range(n)]
    with torch.no_grad():
        for layer in layers:
            for name, p in layer.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.02)
    return config, layers, modeling_mistral.MistralRotaryEmbedding(config)


def _step_module(layers, rope):  # type: ignore[no-untyped-def]
    """``(x, past_key.0, past_value.0, ...) -> (out, present_key.0, present_value.0, ...)`` around the transformers layers: what a user exports."""
    import torch
    from transformers import DynamicCache

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers, self.rope = torch.nn.ModuleList(layers), rope

        def forward(self, x, *past):  # type: ignore[no-untyped-def]
            s, p = x.shape[1], past[0].shape[2]
            positions = torch.arange(p, p + s).unsqueeze(0)
            cache = DynamicCache()
            if p:
                for i in range(len(self.layers)):
                    cache.update(past[2 * i], past[2 * i + 1], i)
            mask = torch.full((s, p + s), float("-inf")).triu(p + 1)[None, None]
            embeddings = self.rope(x, positions)
            for layer in self.layers:
                x = layer(x, attention_mask=mask, past_key_values=cache, position_embeddings=embeddings, position_ids=positions)
                x = x[0] if isinstance(x, tuple) else x
            return (x, *[t for i in range(len(self.layers)) for t in (cache.layers[i].keys, cache.layers[i].values)])

    return Step().eval()


def _past_names(n: int) -> list[str]:
    return [f"past_{kv}.{i}" for i in range(n) for kv in ("key", "value")]


def layer_feeds(case: str, seed: int = 0) -> dict[str, np.ndarray]:
    """``x_BSM`` and each layer's past cache (empty for prefill) of one case."""
    c = LAYER_CASES[case]
    rng = np.random.default_rng(seed)
    kv = (1, SHAPE["num_key_value_heads"], c["past"], SHAPE["head_dim"])
    feeds = {"x_BSM": rng.standard_normal((1, c["seq"], SHAPE["hidden_size"]), dtype=np.float32)}
    feeds.update({name: rng.standard_normal(kv, dtype=np.float32) for name in _past_names(c["layers"])})
    return feeds


def layer_work(case: str) -> tuple[float, float]:
    """(FLOPs, bytes read) of one call: projections, MLP and the visible attention scores; weights, cache and activations."""
    c = LAYER_CASES[case]
    d, f, hq, hkv, hd = (SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    params = d * (hq + 2 * hkv) * hd + hq * hd * d + 3 * d * f
    s, t, n = c["seq"], c["past"] + c["seq"], c["layers"]
    visible = s * t - s * (s - 1) / 2
    flops = n * (2 * s * params + 4 * hq * hd * visible)
    return flops, 4 * n * (params + 2 * hkv * t * hd + 2 * s * d)


def _torch_runner(step) -> Callable[[dict], np.ndarray]:  # type: ignore[no-untyped-def]
    import torch

    tensors: dict[int, tuple] = {}

    def run(feeds: dict) -> np.ndarray:
        if id(feeds) not in tensors:  # once per feeds dict, outside the timed calls that follow
            tensors[id(feeds)] = tuple(torch.from_numpy(v) for v in feeds.values())
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
    return lambda feeds: sess.run(None, dict(zip(names, feeds.values())))[0]


def _graphc_runner(prepared, decode: bool) -> Callable[[dict], np.ndarray]:  # type: ignore[no-untyped-def]
    if not decode:
        return lambda feeds: prepared.run({"x_BSM": feeds["x_BSM"]})["out_BSM"]
    return lambda feeds: prepared.run(feeds)["out_BSM"]


def layer_variants(case: str, threads: int, workdir: Path | None = None) -> dict[str, Callable[[dict], np.ndarray] | str]:
    """Every variant's run function for ``case`` (or the reason it cannot run); the eager module first (the reference)."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return {name: "torch and transformers are not installed" for name in PEERS}
    import torch

    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf
    from graphc.onnx_import import from_onnx
    from lowering.exporter.onnx_export import export

    torch.set_num_threads(threads)
    c = LAYER_CASES[case]
    decode = c["past"] > 0
    sizes = {"batch": 1, "seq": c["seq"], **({"past_seq": c["past"]} if decode else {})}
    config, layers, rope = _hf_layers(c["layers"])
    step = _step_module(layers, rope)
    out: dict[str, Callable[[dict], np.ndarray] | str] = {"transformers eager": _torch_runner(step)}
    sdpa_config = type(config)(**{**config.to_dict(), "attn_implementation": "sdpa"})
    sdpa_layers = [type(layer)(sdpa_config, layer_idx=i).eval() for i, layer in enumerate(layers)]
    for sdpa_layer, layer in zip(sdpa_layers, layers):
        sdpa_layer.load_state_dict(layer.state_dict(), assign=True)  # the same tensors: one copy of the weights
    out["transformers sdpa"] = _torch_runner(_step_module(sdpa_layers, rope))
    work = Path(workdir or tempfile.mkdtemp(prefix="graphc_layer_"))
    feeds = layer_feeds(case)
    past_names = _past_names(c["layers"])
    path = work / "torch_export.onnx"
    try:
        torch.onnx.export(
            step,
            tuple(torch.from_numpy(v) for v in feeds.values()),
            str(path),
            dynamo=True,
            input_names=["x", *past_names],
            output_names=["out", *[n.replace("past_", "present_") for n in past_names]],
            external_data=True,
            verbose=False,
        )
        out["torch.onnx export on ORT"] = _ort_runner(path, threads)
    except Exception as e:  # noqa: BLE001 - a peer that cannot be exported is reported, not fatal
        out["torch.onnx export on ORT"] = f"n/a: torch.onnx.export failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    weights = {f"model.layers.{i}.{k}": v.detach().numpy().copy() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    g = graphc.optimize(decoder_stack_graph(decoder_configs_from_hf(config, c["layers"]), weights=weights, kv_cache=decode)).graph
    del weights
    out["graphc numpy"] = _graphc_runner(prepare(g, "numpy", threads=threads, sizes=sizes), decode)
    out["graphc ort-cpu"] = _graphc_runner(prepare(g, "ort-cpu", attention="auto", threads=threads, sizes=sizes), decode)
    if path.exists():
        imported = graphc.optimize(from_onnx(path), hints=sizes).graph
        export(imported, work / "graphc_reexport.onnx", opset=23, attention="auto", sizes=sizes, external_data=True)
        out["graphc import of the torch export, ORT"] = _ort_runner(work / "graphc_reexport.onnx", threads)
    return out
