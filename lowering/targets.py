"""What each backend runs natively: the :class:`~graphc.optimizer.Target` of every backend and ONNX mode.

A target's attention policy looks at one ``Attention`` node (and the sizes
known for the run) and keeps it for the backend's kernel or says why it is
decomposed.  Adding a backend means adding its target here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from graphc import Attention
from graphc.dims import dim_add, normalize_dim
from graphc.errors import ExportError, UnknownNameError
from graphc.graph import Graph, Node
from graphc.optimizer import REFERENCE_TARGET, PassContext, Target

from .onnx_chunked import chunked_unsupported

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
    op: Attention = node.op  # type: ignore[assignment]
    if op.has_mask:
        return "the blocked kernel takes no user mask"
    return f"the blocked kernel gives empty rows zeros, not the {op.empty_rows} of V" if op.empty_rows != "zero" else None


NUMPY_TARGET = Target("numpy", _numpy_policy, description="row-blocked attention kernel, GEMM contractions")


def _torch_policy(graph: Graph, node: Node, ctx: PassContext) -> str | None:
    op: Attention = node.op  # type: ignore[assignment]
    if op.window is not None or op.softcap is not None:
        return "scaled_dot_product_attention has no sliding window or softcap"
    if op.empty_rows != "zero":
        return f"scaled_dot_product_attention gives a row with no visible key zeros, not the {op.empty_rows} of V"
    return None


TORCH_TARGET = Target("torch", _torch_policy, description="torch scaled_dot_product_attention")


def _past_len(graph: Graph, node: Node) -> object:
    op: Attention = node.op  # type: ignore[assignment]
    return normalize_dim(graph.types[node.inputs[3 + op.has_mask]].shape[2]) if op.kv_cache else 0


def onnx_attention_unsupported(graph: Graph, node: Node, opset: int) -> str | None:
    """Why the standard ``Attention`` op cannot carry this node (``None`` when it can)."""
    op: Attention = node.op  # type: ignore[assignment]
    if opset < 23:
        return f"the Attention op needs opset 23 or later, got opset {opset}"
    if op.window is not None:
        return f"the Attention op has no sliding window (window={op.window}); it is kept decomposed, never dropped"
    if op.may_mask_whole_rows:
        return "rows can be fully masked, and runtimes disagree on what the fused op returns for them"
    if op.causal_offset is not None and normalize_dim(op.causal_offset) != _past_len(graph, node):
        return f"causal offset {op.causal_offset!r} is not the past length; the op aligns its causal mask to the cache"
    return None


def gqa_unsupported(graph: Graph, node: Node, ctx: PassContext | None = None) -> str | None:
    """Why ``com.microsoft.GroupQueryAttention`` cannot carry this node (``None`` when it can)."""
    op: Attention = node.op  # type: ignore[assignment]
    if op.causal_offset is None:
        return "GroupQueryAttention is causal only, and this attention has no causal mask"
    if op.has_mask:
        return "GroupQueryAttention takes no user mask"
    if normalize_dim(op.causal_offset) != _past_len(graph, node):
        return f"causal offset {op.causal_offset!r} is not the past length"
    q, k = graph.types[node.inputs[0]].shape, graph.types[node.inputs[1]].shape
    if not op.kv_cache and normalize_dim(q[2]) != normalize_dim(k[2]):
        return "GroupQueryAttention without a past cache needs as many keys as queries"
    if not all(isinstance(d, int) for d in (q[1], k[1], q[3])):
        return "head counts and head dim must be static"
    if op.kv_cache and ctx is not None:
        batch, sq = ctx.known_size(q[0]), ctx.known_size(q[2])
        if batch is not None and sq is not None and batch > 1 and sq > 1:
            return "onnxruntime's GroupQueryAttention rejects batch > 1 when a past and several new tokens are given"
    return None


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
    keys = dim_add(_past_len(graph, node), k[2])
    sizes = [ctx.known_size(q[0]) or 1] + [ctx.known_size(d) for d in (q[1], q[2], keys)]
    return 0 if any(x is None for x in sizes) else int(np.prod(sizes))


def onnx_target(mode: str, opset: int) -> Target:
    """The target of ONNX export in ``mode`` (one of :data:`ATTENTION_MODES`) at ``opset``."""
    if mode not in ATTENTION_MODES:
        raise UnknownNameError("attention mode", mode, ATTENTION_MODES)
    policy: Callable[[Graph, Node, PassContext], str | None]
    if mode == "decomposed":
        return Target("onnx-decomposed", description="MatMul/Softmax nodes")
    if mode in ("onnx-attention", "ort-gqa", "chunked"):  # asked for by name: an attention it cannot carry is an error

        def policy(graph: Graph, node: Node, ctx: PassContext) -> str | None:
            if mode == "chunked":
                reason = chunked_unsupported(graph, node)
            else:
                reason = onnx_attention_unsupported(graph, node, opset) if mode == "onnx-attention" else gqa_unsupported(graph, node, ctx)
            if reason:
                raise ExportError(f"attention={mode!r} cannot carry {node.name!r}: {reason}; use attention='auto' to fall back")
            return None

    else:

        def policy(graph: Graph, node: Node, ctx: PassContext) -> str | None:
            rows = _rows_per_kv_head(graph, node, ctx)
            if rows is None:
                return "auto: the query length is not known (give sizes), so the grouped MatMul form is kept"
            if rows < AUTO_MIN_QUERY_ROWS:
                return f"auto: {rows} query row(s) per KV head, under {AUTO_MIN_QUERY_ROWS}: grouped MatMuls are faster"
            if chunked_unsupported(graph, node) is None:
                scores = _score_elements(graph, node, ctx)
                if scores < AUTO_MIN_CHUNKED_SCORES:
                    return f"auto: {scores} score elements, under {AUTO_MIN_CHUNKED_SCORES}: one grouped MatMul pass beats query chunks"
                return None  # emitted as query chunks over the visible keys (faster than the fused op on causal prefill)
            return onnx_attention_unsupported(graph, node, opset)

    def kernel(graph: Graph, node: Node, ctx: PassContext) -> str:
        rows = _rows_per_kv_head(graph, node, ctx)
        per_head = "" if rows is None else f" ({rows} query rows per KV head)"
        if mode == "chunked" or (mode == "auto" and chunked_unsupported(graph, node) is None):
            return f"query chunks over the visible keys{per_head}: causal prefill skips the masked half"
        if mode == "ort-gqa":
            return f"com.microsoft.GroupQueryAttention{per_head}"
        return f"ONNX Attention op (opset {opset}){per_head}"

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
