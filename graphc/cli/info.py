"""``graphc info``: a config's parameters, KV-cache memory and FLOPs; or what an ONNX model or a saved graph holds and
which attention graphc recognises in it."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import numpy as np

from ..attention import PRESETS
from ..attention.encoder import ENCODER_FAMILIES
from ..attention.hf import HFConfig
from ..attention_op import Attention
from ..graph import Graph
from ..ops import FLOAT_DTYPES
from ..optimizer import KEEP_EVERY_ATTENTION, lower, optimize, unfused_softmaxes
from .common import at_least
from .source import GraphSource, add_graph_args

__all__ = ["add_command", "run"]


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc info``."""
    i = sub.add_parser("info", parents=[common], help="config, parameter count, KV-cache memory, FLOPs")
    add_graph_args(i)
    i.add_argument("--dtype", default=None, choices=FLOAT_DTYPES,
                   help="KV-cache dtype (default: a config's own dtype, else float16)")  # fmt: skip
    i.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print a config's parameters, KV-cache memory, savings and FLOPs; or, for an ONNX model or a saved graph, what it holds."""
    source = GraphSource.from_args(args, reads_weights=False)  # a checkpoint folder's config alone
    if source.model is not None or source.graph:
        print(describe_graph(source.imported(), source.model or str(source.graph)))
        return 0
    if source.hf is not None and source.hf.get("model_type") in ENCODER_FAMILIES:  # an encoder: the graph its checkpoint builds
        print(describe_graph(GraphSource.from_args(args).build()[0], str(source.checkpoint_folder or source.hf_config)))
        return 0
    cfg = source.config()
    seq = 4096 if source.seq is None else source.seq
    for flag, v in (("--seq", seq), ("--batch", source.batch), ("--layers", source.layers)):
        at_least(flag, v, 1)
    layers = source.layers or (PRESETS[source.preset].n_layers if source.preset else 1)
    if source.preset:
        print(f"{source.preset}: {PRESETS[source.preset].description}, {layers} layers")
    if source.hf is not None:
        layers = _describe_stack(source.hf, str(source.hf_config), source.layers)
    dtype = args.dtype or _config_dtype(source.hf) or "float16"
    print(cfg.summary(batch=source.batch, seq_len=seq, dtype=dtype, n_layers=layers))
    total = cfg.kv_cache_bytes(source.batch, seq, dtype, layers)
    mha_total = cfg.with_(n_kv_heads=cfg.n_heads).kv_cache_bytes(source.batch, seq, dtype, layers)
    print(f"  KV cache, all {layers} layers: {total / 2**30:.3f} GiB (MHA with the same heads: {mha_total / 2**30:.3f} GiB)")
    return 0


def _describe_stack(hf: HFConfig, hf_config: str, n_layers: int | None) -> int:
    """Print a transformers config's decoder stack (layers, parameters, MLP, windows); returns its layer count."""
    from ..attention.decoder import decoder_weight_shapes
    from ..attention.hf import decoder_configs_from_hf

    cfgs = decoder_configs_from_hf(hf, n_layers)
    params = sum(int(np.prod(s)) for c in cfgs for s in decoder_weight_shapes(c).values())
    windows = sorted({c.attention.sliding_window for c in cfgs}, key=lambda w: (w is None, w or 0))
    print(
        f"{hf_config}: {len(cfgs)} decoder layers, {params:,} parameters in them (no embeddings), MLP {cfgs[0].mlp} {cfgs[0].activation}, "
        f"intermediate {cfgs[0].intermediate_size}, windows {windows}"
    )
    return len(cfgs)


def _config_dtype(cfg: HFConfig | None) -> str | None:
    """The dtype a transformers config says its weights are in (``dtype``, or ``torch_dtype`` in older files), when it is a float one."""
    if cfg is None:
        return None
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return dtype if isinstance(dtype, str) and dtype in FLOAT_DTYPES else None


def describe_graph(g: Graph, source: str) -> str:
    """What ``graphc info`` prints for a graph: interface, ops, parameters, and what the optimizer recognises."""

    def shape(name: str) -> str:
        t = g.types[name]
        return f"{name} [{', '.join(str(d) for d in t.shape)}] {t.dtype}"

    params = sum(int(a.size) for a in g.initializers.values())
    weight_bytes = sum(int(a.nbytes) for a in g.initializers.values())
    opt = optimize(g).graph
    counts = ", ".join(f"{k} {v}" for k, v in g.op_counts().items())
    after = ", ".join(f"{k} {v}" for k, v in opt.op_counts().items())
    kept = lower(opt, KEEP_EVERY_ATTENTION)  # recognised, none decomposed
    kinds = Counter(_attention_kind(n.op) for n in kept.topological_order() if isinstance(n.op, Attention))
    left = unfused_softmaxes(kept, lowered=True)
    lines = [
        f"{source}: graph {g.name!r}, {len(g.nodes)} nodes, {params:,} parameters ({weight_bytes / 2**20:,.1f} MiB)",
        f"  inputs:  {'; '.join(shape(n) for n in g.inputs)}",
        f"  outputs: {'; '.join(shape(n) for n in g.outputs)}",
        f"  ops: {counts}",
        f"  optimized: {len(opt.nodes)} nodes; {after}",
        f"  attention recognised: {sum(kinds.values())}" + "".join(f"\n    {n} x {kind}" for kind, n in kinds.items()),
        f"  softmax left unfused: {len(left)}" + "".join(f"\n    {u}" for u in left),
    ]
    if g.assumptions:  # where an imported model is defined (every run checks it)
        lines.insert(3, f"  defined where: {'; '.join(f'{a} == {b}' for a, b in g.assumptions)} (checked on every run)")
    return "\n".join(lines)


def _attention_kind(op: Attention) -> str:
    """One line of what an ``Attention`` op computes: what the queries see, cache, softcap."""
    parts = [op.visibility.describe()] + (["KV cache"] if op.kv_cache else []) + ([f"softcap {op.softcap:g}"] if op.softcap is not None else [])
    return ", ".join(parts)
