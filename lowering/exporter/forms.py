"""Attention forms: the ``Attention`` op as an ONNX target writes it, one op type per form, its capability check beside it.

An ONNX target's policy picks the form of each kept ``Attention`` once (:func:`lowering.exporter.targets.onnx_target`);
legalisation then turns the node into that form's op, the trace records it (``--explain``), and the ONNX emitter is
chosen by the op's type (``lowering.exporter.onnx_export.ONNX_EMITTERS``).  A form computes exactly what ``Attention`` computes
(same fields, same reference semantics): only the ONNX it becomes differs (a form may add a field that says how it is
written, such as :class:`ChunkedCausalAttention`'s chunk count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphc.attention_op import Attention
from graphc.dims import Dim, dim_add, dim_is_nonnegative, normalize_dim
from graphc.errors import OpError
from graphc.graph import Graph, Node
from graphc.ops import payload_fields, register_op
from graphc.optimizer import PassContext


__all__ = [
    "OnnxAttention",
    "OrtGroupQueryAttention",
    "ChunkedCausalAttention",
    "FORMS",
    "CAUSAL_CHUNKS",
    "CHUNK_ROWS",
    "causal_chunks",
    "onnx_attention_unsupported",
    "gqa_unsupported",
    "chunked_unsupported",
    "past_length",
    "unsupported",
    "as_form",
]


CAUSAL_CHUNKS = 8
"""The most query chunks (and the count when the query length is unknown): 56% of the full square's work.  On 2 cores
(mistral-7b core, causal prefill 1024, onnxruntime 1.32): 2 chunks 139 ms, 4 chunks 114 ms, 8 chunks 105 ms, the
Attention op 159 ms."""

CHUNK_ROWS = 64
"""Query rows a chunk should hold at least: a shorter prefill gets fewer chunks (:func:`causal_chunks`)."""


@register_op
@dataclass(frozen=True)
class OnnxAttention(Attention):
    """the standard ONNX Attention op (opset 23+)"""


@register_op
@dataclass(frozen=True)
class OrtGroupQueryAttention(Attention):
    """onnxruntime's com.microsoft.GroupQueryAttention"""


@register_op
@dataclass(frozen=True)
class ChunkedCausalAttention(Attention):
    """query chunks over the visible keys: causal prefill skips the masked half"""

    chunks: int = CAUSAL_CHUNKS

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise OpError(f"ChunkedCausalAttention: chunks must be an int >= 1, got {self.chunks!r}")


def causal_chunks(queries: int | None) -> int:
    """How many query chunks a causal prefill of ``queries`` tokens (``None``: unknown) is split into: one per
    :data:`CHUNK_ROWS` rows, at least 2 and at most :data:`CAUSAL_CHUNKS`.

    From an A/B of chunk counts on the hidden-256 exports ``benchmarks/bench_real_exports.py`` times (2 cores, onnxruntime
    1.32, graphc / export, one run): at 512 tokens 2/4/8 chunks gave Llama 0.57/0.50/0.48 and OLMo 0.93/0.89/0.90; at 256
    tokens Llama 0.72/0.71 (2/4 chunks)."""
    if queries is None:
        return CAUSAL_CHUNKS
    return min(CAUSAL_CHUNKS, max(2, math.ceil(queries / CHUNK_ROWS)))


FORMS = (OnnxAttention, OrtGroupQueryAttention, ChunkedCausalAttention)
"""Every attention form an ONNX target can choose."""


def past_length(graph: Graph, node: Node) -> Dim:
    """The KV-cache length of an ``Attention`` node (0 without a cache)."""
    op = node.op_as(Attention)
    return normalize_dim(graph.types[node.inputs[3 + op.has_mask]].shape[2]) if op.kv_cache else 0


def onnx_attention_unsupported(graph: Graph, node: Node, opset: int) -> str | None:
    """Why the standard ``Attention`` op cannot carry this node (``None`` when it can)."""
    op = node.op_as(Attention)
    if opset < 23:
        return f"the Attention op needs opset 23 or later, got opset {opset}"
    if op.window is not None:
        return f"the Attention op has no sliding window (window={op.window}); it is kept decomposed, never dropped"
    if op.may_mask_whole_rows:
        return "rows can be fully masked, and runtimes disagree on what the fused op returns for them"
    if op.causal_offset is not None and normalize_dim(op.causal_offset) != past_length(graph, node):
        return f"causal offset {op.causal_offset!r} is not the past length; the op aligns its causal mask to the cache"
    return None


def gqa_unsupported(graph: Graph, node: Node, ctx: PassContext | None = None) -> str | None:
    """Why ``com.microsoft.GroupQueryAttention`` cannot carry this node (``None`` when it can)."""
    op = node.op_as(Attention)
    if op.causal_offset is None:
        return "GroupQueryAttention is causal only, and this attention has no causal mask"
    if op.has_mask:
        return "GroupQueryAttention takes no user mask"
    if normalize_dim(op.causal_offset) != past_length(graph, node):
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


def chunked_unsupported(graph: Graph, node: Node) -> str | None:
    """Why query chunks (:mod:`lowering.exporter.onnx_chunked`) cannot carry ``node`` (``None`` when it can)."""
    op = node.op_as(Attention)
    if op.causal_offset is None:
        return "not causal: every query sees every key, so there is no masked half to skip"
    if op.window is not None or op.softcap is not None:
        return "chunking is implemented for causal attention without a sliding window or softcap"
    if not dim_is_nonnegative(op.causal_offset):
        return "the causal offset may be negative"
    q, k = graph.types[node.inputs[0]].shape, graph.types[node.inputs[1]].shape
    if not (isinstance(q[1], int) and isinstance(k[1], int) and isinstance(q[3], int) and isinstance(graph.types[node.inputs[2]].shape[3], int)):
        return "head counts and head dims must be static"
    keys = graph.types[node.outputs[1] if op.kv_cache else node.inputs[1]].shape[2]
    if normalize_dim(keys) != normalize_dim(dim_add(q[2], op.causal_offset)):
        return f"the keys ({keys}) are not the queries plus the causal offset ({q[2]} + {op.causal_offset}): chunks read the offset as keys - queries"
    return None


def as_form(form: type[Attention], graph: Graph, node: Node, ctx: PassContext) -> Attention:
    """``node``'s attention as ``form``: its fields, and what the form adds decided under ``ctx``'s known sizes (the
    chunk count of :class:`ChunkedCausalAttention` from the query length, :func:`causal_chunks`)."""
    op = node.op_as(Attention)
    fields = {f.name: getattr(op, f.name) for f in payload_fields(op)}
    if form is ChunkedCausalAttention:
        fields["chunks"] = causal_chunks(ctx.known_size(graph.types[node.inputs[0]].shape[2]))
    return form(**fields)


def unsupported(form: type[Attention], graph: Graph, node: Node, ctx: PassContext, opset: int) -> str | None:
    """Why ``form`` cannot carry ``node`` (``None`` when it can)."""
    if form is ChunkedCausalAttention:
        return chunked_unsupported(graph, node)
    if form is OrtGroupQueryAttention:
        return gqa_unsupported(graph, node, ctx)
    return onnx_attention_unsupported(graph, node, opset)
