"""What each backend runs natively: the :class:`~graphc.optimizer.Target` of every backend and ONNX mode.

A target's attention policy looks at one ``Attention`` node (and the sizes
known for the run) and keeps it for the backend's kernel or says why it is
decomposed.  Adding a backend means adding its target here.
"""

from __future__ import annotations


import numpy as np

from graphc.attention_op import Attention
from graphc.dims import dim_add
from graphc.errors import ExportError, UnknownNameError
from graphc.graph import Graph, Node
from graphc.optimizer import REFERENCE_TARGET, PassContext, Target

from ..kernels.attention_kernel import is_key_mask_shape
from .forms import (
    ChunkedCausalAttention,
    OnnxAttention,
    OrtGroupQueryAttention,
    gqa_unsupported,
    onnx_attention_unsupported,
    past_length,
    unsupported,
)

__all__ = [
    "ATTENTION_MODES",
    "AUTO_MIN_QUERY_ROWS",
    "AUTO_MIN_CHUNKED_SCORES",
    "NUMPY_TARGET",
    "TORCH_TARGET",
    "onnx_target",
    "onnx_attention_unsupported",
    "gqa_unsupported",
    "REFERENCE_TARGET",
    "target_named",
    "TARGET_NAMES",
]

ATTENTION_MODES = ("decomposed", "onnx-attention", "ort-gqa", "chunked", "auto")
AUTO_MIN_QUERY_ROWS = 64
AUTO_MIN_CHUNKED_SCORES = 2**22
"""``auto`` chunks a causal prefill whose scores (batch x query heads x queries x keys) hold at least this many
elements; a smaller one runs as grouped MatMuls (each chunk costs some twenty small ops).

From ``benchmarks/bench_real_exports.py`` and the mistral-7b layer on 2 cores: grouped MatMuls win at 1-2M score
elements (hidden-256 Llama/GPT-2 exports at 512 tokens by 4-16%, the mistral-7b layer at 256 ties), query chunks
win from 4M (the exports at 1024 tokens by 12-30%, the mistral-7b layer at 512 by 7%)."""


def _numpy_policy(graph: Graph, node: Node, ctx: PassContext) -> str | None:
    op = node.op_as(Attention)
    if op.has_mask:
        if op.mask != "bool" or not is_key_mask_shape(graph.types[node.inputs[3]].shape):
            return "the blocked kernel takes a bool key mask [B, 1, 1, T] (padding) only, not a per-query or additive mask"
    return f"the blocked kernel gives empty rows zeros, not the {op.empty_rows} of V" if op.empty_rows != "zero" else None


NUMPY_TARGET = Target("numpy", _numpy_policy, description="row-blocked attention kernel, GEMM contractions")


def _torch_policy(graph: Graph, node: Node, ctx: PassContext) -> str | None:
    op = node.op_as(Attention)
    if op.window is not None or op.softcap is not None:
        return "scaled_dot_product_attention has no sliding window or softcap"
    if op.empty_rows != "zero":
        return f"scaled_dot_product_attention gives a row with no visible key zeros, not the {op.empty_rows} of V"
    return None


TORCH_TARGET = Target("torch", _torch_policy, description="torch scaled_dot_product_attention")


def _rows_per_kv_head(graph: Graph, node: Node, ctx: PassContext) -> int | None:
    q, k = graph.types[node.inputs[0]].shape, graph.types[node.inputs[1]].shape
    sq = ctx.known_size(q[2])
    if sq is None or not isinstance(q[1], int) or not isinstance(k[1], int):
        return None
    return sq * (q[1] // max(k[1], 1))


def _score_elements(graph: Graph, node: Node, ctx: PassContext) -> int:
    """Batch x query heads x queries x keys (past included) under the known sizes (an unknown batch counts 1);
    0 when the heads, queries or keys are unknown."""
    q, k = graph.types[node.inputs[0]].shape, graph.types[node.inputs[1]].shape
    keys = dim_add(past_length(graph, node), k[2])
    sizes = [ctx.known_size(q[0]) or 1] + [ctx.known_size(d) for d in (q[1], q[2], keys)]
    known = [x for x in sizes if x is not None]
    return int(np.prod(known)) if len(known) == len(sizes) else 0


_NAMED_FORMS = {"onnx-attention": OnnxAttention, "ort-gqa": OrtGroupQueryAttention, "chunked": ChunkedCausalAttention}


def onnx_target(mode: str, opset: int) -> Target:
    """The target of ONNX export in ``mode`` (one of :data:`ATTENTION_MODES`) at ``opset``: its policy gives each kept
    ``Attention`` its form (:mod:`lowering.exporter.forms`), or the reason it is decomposed."""
    if mode not in ATTENTION_MODES:
        raise UnknownNameError("attention mode", mode, ATTENTION_MODES)
    if mode == "decomposed":
        return Target("onnx-decomposed", description="MatMul/Softmax nodes")
    if mode in _NAMED_FORMS:  # asked for by name: an attention it cannot carry is an error
        form = _NAMED_FORMS[mode]

        def policy(graph: Graph, node: Node, ctx: PassContext) -> str | type[Attention] | None:
            reason = unsupported(form, graph, node, ctx, opset)
            if reason:
                raise ExportError(f"attention={mode!r} cannot carry {node.name!r}: {reason}; use attention='auto' to fall back")
            return form

    else:

        def policy(graph: Graph, node: Node, ctx: PassContext) -> str | type[Attention] | None:
            rows = _rows_per_kv_head(graph, node, ctx)
            if rows is None:
                return "auto: the query length is not known (give sizes), so the grouped MatMul form is kept"
            if rows < AUTO_MIN_QUERY_ROWS:
                return f"auto: {rows} query row(s) per KV head, under {AUTO_MIN_QUERY_ROWS}: grouped MatMuls are faster"
            if unsupported(ChunkedCausalAttention, graph, node, ctx, opset) is None:
                scores = _score_elements(graph, node, ctx)
                if scores < AUTO_MIN_CHUNKED_SCORES:
                    return f"auto: {scores} score elements, under {AUTO_MIN_CHUNKED_SCORES}: one grouped MatMul pass beats query chunks"
                return ChunkedCausalAttention  # faster than the fused op on causal prefill
            return unsupported(OnnxAttention, graph, node, ctx, opset) or OnnxAttention

    def kernel(graph: Graph, node: Node, ctx: PassContext) -> str:
        rows = _rows_per_kv_head(graph, node, ctx)
        return "" if rows is None else f"{rows} query rows per KV head"

    return Target(f"onnx-{mode}", policy, description=f"ONNX export, attention={mode}", kernel=kernel)


TARGET_NAMES = ("numpy", "reference", "torch", *(f"onnx-{m}" for m in ATTENTION_MODES))


def target_named(name: str, opset: int = 23) -> Target:
    """The target called ``name`` (one of :data:`TARGET_NAMES`); an unknown name lists the valid ones."""
    fixed = {"numpy": NUMPY_TARGET, "reference": REFERENCE_TARGET, "torch": TORCH_TARGET}
    if name in fixed:
        return fixed[name]
    if name.startswith("onnx-") and name[5:] in ATTENTION_MODES:
        return onnx_target(name[5:], opset)
    raise UnknownNameError("target", name, TARGET_NAMES)
