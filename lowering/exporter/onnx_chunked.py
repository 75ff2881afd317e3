"""Causal attention in ONNX as query chunks against the visible key prefix only.

A decomposed causal prefill (MatMul, mask, Softmax, MatMul) computes the full
``S x T`` scores and masks the upper half away; onnxruntime's fused kernels
skip that half.  This lowering splits the queries into ``n`` chunks (bounds
computed from the run-time shapes, so dynamic sequence lengths work): chunk
``i`` holds queries ``[lo_i, hi_i)`` and attends keys ``[0, hi_i + P)`` only,
where ``P = T - S`` is the past length.  The work is ``(n + 1) / 2n`` of the
square (62.5% for 4 chunks, 56% for 8).  With several query heads per KV head the
heads stay grouped within a chunk (``[B, Hkv, group x rows, D]`` against
``[B, Hkv, keys, D]``), so K/V are never repeated; with one (MHA) a chunk is
plain ``[B, H, rows, D]``.

What does not depend on the layer is emitted once per graph and read by every
attention with the same query and key lengths (:meth:`OnnxBuilder.once`): the
chunk bounds, each chunk's causal bias, and each chunk's bias from a user mask
(an ALiBi bias, a padding mask) with the rows that see no key.  A layer then
costs one Split of its queries, a K and a V slice per chunk but the last (which
sees every key), and per chunk two MatMuls, an Add and a Softmax; rows that see
no key take the op's empty-row value in one Where over the layer's output.
What the form can carry is what :class:`lowering.exporter.forms.ChunkedCausalAttention` declares (:func:`lowering.exporter.forms.unsupported`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from graphc.attention_op import Attention
from graphc.dims import Dim, normalize_dim
from graphc.graph import Node
from graphc.numerics import lowest

from .forms import CAUSAL_CHUNKS, ChunkedCausalAttention
from .onnx_builder import OnnxBuilder

__all__ = ["emit_chunked_attention"]


def emit_chunked_attention(b: OnnxBuilder, node: Node, chunks: int | None = None) -> None:
    """Emit ``node`` (a causal :class:`~graphc.Attention`) as ``chunks`` query chunks over the visible keys (default: the
    node's own count if it is a :class:`~lowering.exporter.forms.ChunkedCausalAttention`, else :data:`~lowering.exporter.forms.CAUSAL_CHUNKS`)."""
    op = node.op_as(Attention)
    if chunks is None:
        chunks = op.chunks if isinstance(op, ChunkedCausalAttention) else CAUSAL_CHUNKS
    g = b.graph
    q, k, v = node.inputs[:3]
    dtype = g.types[q].dtype
    batch, n_heads, sq, head = g.types[q].shape
    n_kv = g.types[k].shape[1]
    group = int(n_heads) // int(n_kv)
    e_dim = g.types[v].shape[3]
    keys_dim = g.types[node.outputs[1] if op.kv_cache else k].shape[2]
    if op.kv_cache:  # present = past ++ new, as the op defines
        k = b.op("Concat", [node.inputs[3 + op.has_mask], k], node.outputs[1], axis=2)
        v = b.op("Concat", [node.inputs[4 + op.has_mask], v], node.outputs[2], axis=2)
    plan = _ChunkPlan.of(b, q, k, (sq, keys_dim), chunks)
    layout = _Layout(b, plan, (batch, int(n_kv), group, int(head), int(e_dim)))
    scalar = _scalars(b, dtype)
    if op.scale != 1.0:
        q = b.op("Mul", [q, b.const(np.array(op.scale, dtype), "scale")], base=f"{q}_scaled")
    q = layout.queries(q, sq)
    masks = _ChunkMask.of(b, op.mask, node.inputs[3], layout, dtype, scalar) if op.has_mask else None
    kt = b.op("Transpose", [k], base=f"{node.name}_keys_t", perm=[0, 1, 3, 2])  # [B, Hkv, D, T], sliced per chunk
    parts = []
    for c, qc in zip(plan.chunks, layout.chunk_queries(q, plan)):
        i, last = c.index, c.index == len(plan.chunks) - 1  # the last chunk sees every key: nothing to slice
        kc = kt if last else b.op("Slice", [kt, b.dim(0), c.keys, b.dim(3)], base=f"chunk{i}_k")
        vc = v if last else b.op("Slice", [v, b.dim(0), c.keys, b.dim(2)], base=f"chunk{i}_v")
        s = b.op("MatMul", [qc, kc], base=f"chunk{i}_scores")  # [B, Hkv, G*C, L]
        bias = masks.biases[i] if masks is not None else plan.causal_bias(c, scalar)
        p = b.op("Softmax", [b.op("Add", [layout.split_rows(s, c, "scores"), bias], base=f"chunk{i}_masked")], base=f"chunk{i}_probs", axis=-1)
        o = layout.split_rows(b.op("MatMul", [layout.merge_rows(p, c), vc], base=f"chunk{i}_out"), c, "out")
        parts.append(o)
    out = node.name if masks is None and not layout.grouped else None
    merged = b.op("Concat", parts, out, base=f"{node.name}_chunks", axis=layout.rows_axis)  # [B, H, S, E] or [B, Hkv, G, S, E]
    if masks is not None:  # rows with no visible key take the op's empty-row value
        out = None if layout.grouped else node.name
        merged = b.op("Where", [masks.empty, _empty_row_fill(b, node, v, layout, scalar), merged], out, base=f"{node.name}_rows")
    if layout.grouped:
        b.reshape(merged, [batch, n_heads, sq, e_dim], node.name)


@dataclass(frozen=True)
class _Chunk:
    """Chunk ``index``: query rows ``[lo, hi)`` as the 1-element ``starts``/``ends`` of a Slice, their count
    ``rows`` (``[hi - lo]``), ``keys`` (``[hi + past]``, the visible prefix) and ``hidden``, the bool ``[C, L]`` that is true above the diagonal."""

    index: int
    starts: str
    ends: str
    rows: str
    keys: str
    hidden: str


@dataclass
class _ChunkPlan:
    """The chunks of every attention whose queries and keys have the given lengths, emitted once per graph."""

    b: OnnxBuilder
    key: tuple[object, ...]
    past: str
    origin: str  # 0
    one: str  # 1
    s_len: str  # the query length
    sizes: str  # every chunk's rows, for a Split
    chunks: list[_Chunk]

    @classmethod
    def of(cls, b: OnnxBuilder, q: str, k: str, lengths: tuple[Dim, Dim], count: int) -> _ChunkPlan:
        """The plan for ``count`` chunks of queries ``q`` over keys ``k`` (made from the first caller's shapes)."""
        key = ("causal_chunks", normalize_dim(lengths[0]), normalize_dim(lengths[1]), count)
        return b.once(key, lambda: cls._make(b, key, q, k, count))

    @classmethod
    def _make(cls, b: OnnxBuilder, key: tuple[object, ...], q: str, k: str, count: int) -> _ChunkPlan:
        i64 = lambda x: b.const(np.array(x, np.int64), "i")  # noqa: E731
        scalar = lambda vec: b.op("Squeeze", [vec, b.dim(0)], base="n")  # noqa: E731
        unsq = lambda x: b.op("Unsqueeze", [x, b.dim(0)])  # noqa: E731
        s_len = scalar(b.op("Shape", [q], base="q_len", start=2, end=3))
        t_len = scalar(b.op("Shape", [k], base="k_len", start=2, end=3))
        past = b.op("Sub", [t_len, s_len], base="past_len")
        step = b.op("Div", [b.op("Add", [s_len, i64(count - 1)]), i64(count)], base="chunk_rows")
        origin, one, chunks = i64(0), i64(1), []
        for i in range(count):
            lo = b.op("Min", [b.op("Mul", [step, i64(i)]), s_len], base=f"chunk{i}_lo")
            hi = b.op("Min", [b.op("Mul", [step, i64(i + 1)]), s_len], base=f"chunk{i}_hi")
            keys = b.op("Add", [hi, past], base=f"chunk{i}_keys")
            qpos = b.op("Unsqueeze", [b.op("Range", [lo, hi, one]), b.dim(1)], base=f"chunk{i}_rows_pos")  # [C, 1]
            kpos = b.op("Range", [origin, keys, one], base=f"chunk{i}_key_pos")  # [L]
            hidden = b.op("Greater", [kpos, b.op("Add", [qpos, past])], base=f"chunk{i}_hidden")
            starts, ends = unsq(lo), unsq(hi)
            chunks.append(_Chunk(i, starts, ends, b.op("Sub", [ends, starts], base=f"chunk{i}_rows"), unsq(keys), hidden))
        sizes = b.op("Concat", [c.rows for c in chunks], base="chunk_sizes", axis=0)
        return cls(b, key, past, origin, one, s_len, sizes, chunks)

    def causal_bias(self, c: _Chunk, scalar: Callable[[str], str]) -> str:
        """Chunk ``c``'s causal bias ``[C, L]`` in the dtype of ``scalar``'s constants: ``-inf`` above the diagonal, 0 elsewhere."""
        make = lambda: self.b.op("Where", [c.hidden, scalar("neg_inf"), scalar("zero")], base=f"chunk{c.index}_causal")  # noqa: E731
        return self.b.once((self.key, "causal_bias", c.index, scalar("zero")), make)


@dataclass
class _Layout:
    """How one attention's query rows sit in a chunk: plain ``[B, H, C, D]`` with one query head per KV head, else
    grouped ``[B, Hkv, G*C, D]`` for the MatMuls and ``[B, Hkv, G, C, .]`` (``grouped``) where the mask is added."""

    b: OnnxBuilder
    plan: _ChunkPlan
    dims: tuple[Dim, int, int, int, int]  # batch, KV heads, group, head dim, value dim

    @property
    def grouped(self) -> bool:
        return self.dims[2] > 1

    @property
    def rows_axis(self) -> int:
        """The axis of query rows in the layout where the mask is added."""
        return 3 if self.grouped else 2

    def queries(self, q: str, sq: Dim) -> str:
        """``q`` ``[B, H, S, D]`` (``S`` = ``sq``) in this layout (``[B, Hkv, G, S, D]`` when grouped)."""
        batch, n_kv, group, head, _ = self.dims
        return self.b.reshape(q, [batch, n_kv, group, sq, head], source=[batch, n_kv * group, sq, head]) if self.grouped else q

    def chunk_queries(self, q: str, plan: _ChunkPlan) -> list[str]:
        """Every chunk's query rows (one Split of ``q``), ready for the scores MatMul."""
        parts = self.b.op_outputs("Split", [q, plan.sizes], len(plan.chunks), base="chunk_q", axis=self.rows_axis)
        return [self.merge_rows(qc, c, "queries") for qc, c in zip(parts, plan.chunks)]

    def merge_rows(self, x: str, c: _Chunk, what: str = "probs") -> str:
        """``x`` ``[B, Hkv, G, C, N]`` as ``[B, Hkv, G*C, N]`` (nothing to do when not grouped)."""
        if not self.grouped:
            return x
        return self.b.op("Reshape", [x, self._shape(c, what)], base=f"chunk{c.index}_{what}_rows", allowzero=1)

    def split_rows(self, x: str, c: _Chunk, what: str) -> str:
        """``x`` ``[B, Hkv, G*C, N]`` as ``[B, Hkv, G, C, N]`` (nothing to do when not grouped)."""
        if not self.grouped:
            return x
        return self.b.op("Reshape", [x, self._shape(c, what)], base=f"chunk{c.index}_{what}5", allowzero=1)

    def _shape(self, c: _Chunk, what: str) -> str:
        """A shape tensor of chunk ``c`` for ``what`` (queries and probs merged, scores and out split), made once per graph."""
        b, (batch, n_kv, group, head, e_dim) = self.b, self.dims

        def make() -> str:
            rows = c.rows
            lead = [b.dim(batch), b.dim(n_kv)]
            if what in ("queries", "probs"):
                tail = [b.op("Mul", [rows, b.dim(group)]), b.dim(head) if what == "queries" else c.keys]
            else:
                tail = [b.dim(group), rows, c.keys if what == "scores" else b.dim(e_dim)]
            return b.op("Concat", [*lead, *tail], base="shape", axis=0)

        return b.once((self.plan.key, "shape", c.index, what, self.dims), make)


def _scalars(b: OnnxBuilder, dtype: str) -> Callable[[str], str]:
    """The scalar constants of chunked attention in ``dtype`` (``"neg_inf"``, ``"zero"`` and the finite ``"fill"``), each
    made once per graph and only if used: an initializer no node reads is one onnxruntime warns about when it loads the model."""
    values = {"neg_inf": np.array(-np.inf, dtype), "zero": np.zeros((), dtype), "fill": lowest(dtype)}
    return lambda name: b.once(("attention_scalar", name, dtype), lambda: b.const(values[name], name))


def _empty_row_fill(b: OnnxBuilder, node: Node, v: str, layout: _Layout, scalar: Callable[[str], str]) -> str:
    """What a row with no visible key gives: zeros, or (``empty_rows="mean"``) the mean of V over every key, in the
    layout's shape."""
    if "mean_rows" not in node.op_as(Attention).features():
        return scalar("zero")
    mean = b.op("ReduceMean", [v, b.dim(2)], base=f"{node.name}_v_mean")  # [B, Hkv, 1, E]
    return b.op("Unsqueeze", [mean, b.dim(2)], base=f"{node.name}_v_mean5") if layout.grouped else mean


@dataclass
class _ChunkMask:
    """A user mask ``[B?, H?, S?, T]`` in a layout's shape (``[B?, Hkv|1, G|1, S?, T]`` when grouped): each chunk's
    additive bias and the rows that see no key, made once per graph for every attention that reads the same mask."""

    biases: list[str]  # per chunk [.., C, L]: the mask (a bool one as 0 / -inf) plus -inf above the diagonal
    empty: str  # [.., S, 1]: the rows whose every key is hidden (the op's empty-row value replaces what their softmax gives)

    @classmethod
    def of(cls, b: OnnxBuilder, kind: str, mask: str, layout: _Layout, dtype: str, scalar: Callable[[str], str]) -> _ChunkMask:
        """The chunked ``mask`` (``kind`` ``"bool"`` or ``"additive"``) of an attention in ``layout`` whose scores are ``dtype``."""
        mshape = (1,) * (4 - b.graph.types[mask].rank) + b.graph.types[mask].shape
        _, n_kv, group, _, _ = layout.dims
        heads = [1] if mshape[1] == 1 else [n_kv]
        if layout.grouped:
            heads = [1, 1] if mshape[1] == 1 else [n_kv, group]
        target = (mshape[0], *heads, *mshape[2:])
        view = lambda: mask if tuple(b.graph.types[mask].shape) == target else b.reshape(mask, list(target))  # noqa: E731
        return b.once((layout.plan.key, "mask", mask, target, dtype), lambda: cls._make(b, kind, view(), layout, mshape, scalar))

    @classmethod
    def _make(cls, b: OnnxBuilder, kind: str, view: str, layout: _Layout, mshape: tuple[Dim, ...], scalar: Callable[[str], str]) -> _ChunkMask:
        ra, plan = layout.rows_axis, layout.plan
        if mshape[2] == 1 and mshape[3] != 1:
            return cls._of_keys(b, kind, view, ra, plan, scalar)
        biases, empties = [], []
        for c in plan.chunks:  # a mask per query row: each chunk's bias says which of its rows see no key
            i = c.index
            mc = b.op("Slice", [view, c.starts, c.ends, b.dim(ra)], base=f"chunk{i}_mask_rows") if mshape[2] != 1 else view
            mc = b.op("Slice", [mc, b.dim(0), c.keys, b.dim(ra + 1)], base=f"chunk{i}_mask") if mshape[3] != 1 else mc
            if kind == "bool":
                mc = b.op("Where", [mc, scalar("zero"), scalar("neg_inf")], base=f"chunk{i}_mask_bias")
            raw = b.op("Add", [mc, plan.causal_bias(c, scalar)], base=f"chunk{i}_mask_causal")
            empty = b.op("Equal", [b.op("ReduceMax", [raw, b.dim(-1)], base=f"chunk{i}_row_max"), scalar("neg_inf")], base=f"chunk{i}_empty")
            biases.append(b.op("Where", [empty, scalar("zero"), raw], base=f"chunk{i}_bias"))  # no row of -inf: no NaN
            empties.append(empty)
        return cls(biases, b.op("Concat", empties, base="empty_rows", axis=ra))

    @classmethod
    def _of_keys(cls, b: OnnxBuilder, kind: str, view: str, ra: int, plan: _ChunkPlan, scalar: Callable[[str], str]) -> _ChunkMask:
        """A key mask ``[.., 1, T]`` (padding; ALiBi's bias): hidden keys raised to the finite fill on the small mask, so
        no chunk row is all ``-inf``, and a row is empty when no key up to its causal limit is kept: the running count of
        kept keys read at each row's limit (small tensors, no pass over a chunk's scores).  The one row this is not exact
        for sees no key above the fill but some at ``-inf`` and some at the fill itself (``finfo.min``): the op gives the
        mean over the fill keys, the chunk over both."""
        if kind == "bool":
            kept, mask_bias = view, b.op("Where", [view, scalar("zero"), scalar("fill")], base="mask_bias")
        else:
            kept, mask_bias = b.op("Greater", [view, scalar("neg_inf")], base="mask_kept"), b.op("Max", [view, scalar("fill")], base="mask_bias")
        seen = b.op(
            "CumSum", [b.op("Cast", [kept], to=TensorProto.INT64), b.const(np.array(ra + 1, np.int64), "axis")], base="mask_keys_seen"
        )  # [.., 1, T]
        limits = b.op("Add", [b.op("Range", [plan.origin, plan.s_len, plan.one]), plan.past], base="row_limits")  # [S]
        read = b.op("Gather", [seen, limits], base="keys_seen", axis=ra + 1)  # [.., 1, S]
        none_seen = b.op("Equal", [read, b.const(np.array(0, np.int64), "no_keys")])
        empty = b.op("Transpose", [none_seen], base="empty_rows", perm=[*range(ra), ra + 1, ra])
        biases = []
        for c in plan.chunks:
            mc = b.op("Slice", [mask_bias, b.dim(0), c.keys, b.dim(ra + 1)], base=f"chunk{c.index}_mask")
            biases.append(b.op("Add", [mc, plan.causal_bias(c, scalar)], base=f"chunk{c.index}_bias"))
        return cls(biases, empty)
