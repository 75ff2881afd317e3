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
from typing import ClassVar

from graphc.attention_op import Attention
from graphc.dims import Dim, normalize_dim
from graphc.errors import OpError
from graphc.graph import Graph, Node
from graphc.ops import payload_fields, register_op
from graphc.optimizer import PassContext
from graphc.visibility import FEATURES


__all__ = [
    "OnnxAttention",
    "OrtGroupQueryAttention",
    "ChunkedCausalAttention",
    "FORMS",
    "CAUSAL_CHUNKS",
    "CHUNK_ROWS",
    "causal_chunks",
    "past_length",
    "attention_features",
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

    NAME: ClassVar[str] = "the ONNX Attention op"
    SUPPORTS: ClassVar[frozenset[str]] = frozenset({"causal", "softcap"})
    NEEDS: ClassVar[frozenset[str]] = frozenset()
    WHY: ClassVar[str] = "rows with no visible key differ between runtimes, and the op has no window: kept decomposed, never dropped"

    @classmethod
    def layout_unsupported(cls, graph: Graph, node: Node, ctx: PassContext | None, opset: int) -> str | None:
        """Why the node's shapes or opset do not fit the op (``None`` when they do)."""
        if opset < 23:
            return f"the Attention op needs opset 23 or later, got opset {opset}"
        vis = node.op_as(Attention).visibility
        if vis.is_causal and not vis.aligned_to(past_length(graph, node)):
            return f"{vis.describe()} is not offset by the past length; the op aligns its causal mask to the cache"
        return None


@register_op
@dataclass(frozen=True)
class OrtGroupQueryAttention(Attention):
    """onnxruntime's com.microsoft.GroupQueryAttention"""

    NAME: ClassVar[str] = "GroupQueryAttention"
    SUPPORTS: ClassVar[frozenset[str]] = frozenset({"causal", "window", "softcap"})
    NEEDS: ClassVar[frozenset[str]] = frozenset({"causal"})
    WHY: ClassVar[str] = "it is causal only and takes no user mask"

    @classmethod
    def layout_unsupported(cls, graph: Graph, node: Node, ctx: PassContext | None, opset: int) -> str | None:
        """Why the node's shapes do not fit the op (``None`` when they do)."""
        op = node.op_as(Attention)
        if not op.visibility.aligned_to(past_length(graph, node)):
            return f"{op.visibility.describe()} is not offset by the past length"
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


@register_op
@dataclass(frozen=True)
class ChunkedCausalAttention(Attention):
    """query chunks over the visible keys: causal prefill skips the masked half"""

    chunks: int = CAUSAL_CHUNKS
    NAME: ClassVar[str] = "query chunks"
    SUPPORTS: ClassVar[frozenset[str]] = frozenset({"causal", "bool_mask", "additive_mask", "query_mask", "mean_rows"})
    NEEDS: ClassVar[frozenset[str]] = frozenset({"causal"})
    WHY: ClassVar[str] = "chunks read the causal offset as keys - queries, with no window or softcap"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise OpError(f"ChunkedCausalAttention: chunks must be an int >= 1, got {self.chunks!r}")

    @classmethod
    def decided_fields(cls, graph: Graph, node: Node, ctx: PassContext) -> dict[str, int]:
        """The chunk count for the node's query length under ``ctx``'s known sizes (:func:`causal_chunks`)."""
        return {"chunks": causal_chunks(ctx.known_size(graph.types[node.inputs[0]].shape[2]))}

    @classmethod
    def layout_unsupported(cls, graph: Graph, node: Node, ctx: PassContext | None, opset: int) -> str | None:
        """Why the node's shapes do not fit query chunks (``None`` when they do)."""
        op = node.op_as(Attention)
        q, k = graph.types[node.inputs[0]].shape, graph.types[node.inputs[1]].shape
        if not (isinstance(q[1], int) and isinstance(k[1], int) and isinstance(q[3], int) and isinstance(graph.types[node.inputs[2]].shape[3], int)):
            return "head counts and head dims must be static"
        keys = graph.types[node.outputs[1] if op.kv_cache else node.inputs[1]].shape[2]
        if not op.visibility.keys_are(keys, q[2]):
            return f"the keys ({keys}) are not the queries ({q[2]}) plus the causal offset ({op.visibility.describe()})"
        return None


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


def attention_features(graph: Graph, node: Node) -> frozenset[str]:
    """What an ``Attention`` node uses (:data:`graphc.visibility.FEATURES`), its mask's shape included."""
    op = node.op_as(Attention)
    keys = graph.types[node.outputs[1] if op.kv_cache else node.inputs[1]].shape[2]
    return op.features(graph.types[node.inputs[3]].shape if op.has_mask else None, graph.types[node.inputs[0]].shape[2], keys)


def as_form(form: type[Attention], graph: Graph, node: Node, ctx: PassContext) -> Attention:
    """``node``'s attention as ``form``: its fields, and what the form adds decided under ``ctx``'s known sizes (the
    chunk count of :class:`ChunkedCausalAttention` from the query length, :func:`causal_chunks`)."""
    op = node.op_as(Attention)
    fields = {f.name: getattr(op, f.name) for f in payload_fields(op)}
    decide = getattr(form, "decided_fields", None)  # what the form adds, decided for this node
    return form(**fields, **(decide(graph, node, ctx) if decide is not None else {}))


def unsupported(form: type[Attention], graph: Graph, node: Node, ctx: PassContext | None, opset: int) -> str | None:
    """Why ``form`` cannot carry ``node`` (``None`` when it can): a feature the node uses that the form does not support
    (or one it needs that the node lacks), else the form's own check of shapes and opset."""
    features = attention_features(graph, node)
    needed = sorted(getattr(form, "NEEDS", frozenset()) - features)
    name, why = getattr(form, "NAME", form.__name__), getattr(form, "WHY", "")
    if needed:
        return f"{name} needs {FEATURES[needed[0]]} ({why})"
    extra = sorted(features - getattr(form, "SUPPORTS", frozenset()))
    if extra:
        return f"{name} cannot carry {FEATURES[extra[0]]} ({why})"
    check = getattr(form, "layout_unsupported", None)
    return check(graph, node, ctx, opset) if check is not None else None
