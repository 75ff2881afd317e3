"""Causal attention in ONNX as query chunks against the visible key prefix only.

A decomposed causal prefill (MatMul, mask, Softmax, MatMul) computes the full
``S x T`` scores and masks the upper half away; onnxruntime's fused kernels
skip that half.  This lowering splits the queries into ``n`` chunks (bounds
computed from the run-time shapes, so dynamic sequence lengths work): chunk
``i`` holds queries ``[lo_i, hi_i)`` and attends keys ``[0, hi_i + P)`` only,
where ``P = T - S`` is the past length.  The work is ``(n + 1) / 2n`` of the
square (62.5% for 4 chunks, 56% for 8).  Within a chunk the heads stay grouped
(``[B, Hkv, group x rows, D]`` against ``[B, Hkv, keys, D]``), so K/V are never
repeated.  What the form can carry is :func:`lowering.exporter.forms.chunked_unsupported`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from graphc.attention_op import Attention
from graphc.dims import Dim
from graphc.graph import Node
from graphc.numerics import lowest

from .forms import CAUSAL_CHUNKS, ChunkedCausalAttention
from .onnx_builder import ONNX_DTYPES, OnnxBuilder

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
    mask = node.inputs[3] if op.has_mask else None
    if op.kv_cache:  # present = past ++ new, as the op defines
        k = b.op("Concat", [node.inputs[3 + op.has_mask], k], node.outputs[1], axis=2)
        v = b.op("Concat", [node.inputs[4 + op.has_mask], v], node.outputs[2], axis=2)
    i64 = lambda x: b.const(np.array(x, np.int64), "i")  # noqa: E731
    scalar = lambda vec: b.op("Squeeze", [vec, i64([0])], base="n")  # noqa: E731
    s_len = scalar(b.op("Shape", [q], base="q_len", start=2, end=3))
    t_len = scalar(b.op("Shape", [k], base="k_len", start=2, end=3))
    past = b.op("Sub", [t_len, s_len], base="past_len")
    step = b.op("Div", [b.op("Add", [s_len, i64(chunks - 1)]), i64(chunks)], base="chunk_rows")
    scale = b.const(np.array(op.scale, dtype), "scale")
    q5 = b.reshape(b.op("Mul", [q, scale], base=f"{q}_scaled"), [batch, n_kv, group, sq, head])  # [B, Hkv, G, S, D]
    scalar = _scalars(b, dtype)
    one = i64(1)
    prepared = _ChunkMask.of(b, node, mask, v, (n_kv, group), scalar) if mask is not None else None
    parts = []
    for i in range(chunks):
        lo = b.op("Min", [b.op("Mul", [step, i64(i)]), s_len], base=f"chunk{i}_lo")
        hi = b.op("Min", [b.op("Mul", [step, i64(i + 1)]), s_len], base=f"chunk{i}_hi")
        keys = b.op("Add", [hi, past], base=f"chunk{i}_keys")
        unsq = lambda x: b.op("Unsqueeze", [x, i64([0])])  # noqa: E731
        qc = b.op("Slice", [q5, unsq(lo), unsq(hi), i64([3])], base=f"chunk{i}_q")  # [B, Hkv, G, C, D]
        rows = b.op("Sub", [hi, lo], base=f"chunk{i}_rows")
        rows_shape = b.op("Concat", [b.op("Shape", [qc], end=2), b.op("Mul", [unsq(rows), i64([group])]), i64([int(head)])], base="shape", axis=0)
        qf = b.op("Reshape", [qc, rows_shape], base=f"chunk{i}_q_rows", allowzero=1)  # [B, Hkv, G*C, D]
        kc = b.op("Slice", [k, i64([0]), unsq(keys), i64([2])], base=f"chunk{i}_k")
        vc = b.op("Slice", [v, i64([0]), unsq(keys), i64([2])], base=f"chunk{i}_v")
        s = b.op("MatMul", [qf, b.op("Transpose", [kc], perm=[0, 1, 3, 2])], base=f"chunk{i}_scores")  # [B, Hkv, G*C, L]
        score_shape = b.op("Concat", [b.op("Shape", [qc], end=4), unsq(keys)], base="shape", axis=0)
        s5 = b.op("Reshape", [s, score_shape], base=f"chunk{i}_scores5", allowzero=1)  # [B, Hkv, G, C, L]
        qpos = b.op("Unsqueeze", [b.op("Range", [lo, hi, one]), i64([1])], base=f"chunk{i}_rows_pos")  # [C, 1]
        kpos = b.op("Range", [i64(0), keys, one], base=f"chunk{i}_key_pos")  # [L]
        hidden = b.op("Greater", [kpos, b.op("Add", [qpos, past])], base=f"chunk{i}_hidden")
        if prepared is None:
            bias = b.op("Where", [hidden, scalar("neg_inf"), scalar("zero")], base=f"chunk{i}_bias")  # [C, L]
        else:
            bias, empty = prepared.bias(i, lo, hi, keys, past, hidden)
        p = b.op("Softmax", [b.op("Add", [s5, bias], base=f"chunk{i}_masked")], base=f"chunk{i}_probs", axis=-1)
        p_rows = b.op("Reshape", [p, b.op("Shape", [s])], base=f"chunk{i}_probs_rows", allowzero=1)
        o = b.op("MatMul", [p_rows, vc], base=f"chunk{i}_out")  # [B, Hkv, G*C, E]
        out_shape = b.op("Concat", [b.op("Shape", [qc], end=4), i64([int(e_dim)])], base="shape", axis=0)
        o5 = b.op("Reshape", [o, out_shape], base=f"chunk{i}_out5", allowzero=1)
        if prepared is not None:  # rows with no visible key take the op's empty-row value
            o5 = b.op("Where", [empty, prepared.fill, o5], base=f"chunk{i}_out5_rows")
        parts.append(o5)
    merged = b.op("Concat", parts, base=f"{node.name}_chunks", axis=3)  # [B, Hkv, G, S, E]
    b.reshape(merged, [batch, n_heads, sq, e_dim], node.name)


def _scalars(b: OnnxBuilder, dtype: str) -> Callable[[str], str]:
    """The scalar constants of one attention (``"neg_inf"``, ``"zero"`` and the finite ``"fill"``), each made once and
    only if used: an initializer no node reads is one onnxruntime warns about when it loads the model."""
    values = {"neg_inf": np.array(-np.inf, dtype), "zero": np.zeros((), dtype), "fill": lowest(dtype)}
    made: dict[str, str] = {}

    def scalar(name: str) -> str:
        if name not in made:
            made[name] = b.const(values[name], name)
        return made[name]

    return scalar


@dataclass
class _ChunkMask:
    """A user mask ``[B?, H?, S?, T]`` viewed as ``[B?, Hkv|1, G|1, S?, T]`` (``m5``), and what every chunk reads of it."""

    b: OnnxBuilder
    kind: str  # "bool" or "additive"
    m5: str
    rows_masked: bool
    keys_masked: bool
    fill: str  # the value of a row with no visible key: zeros, or the mean of V over every key
    scalar: Callable[[str], str]  # the attention's scalar constants (:func:`_scalars`)
    lifted: str | None = None  # a key mask raised to the finite fill (additive)
    key_counts: str | None = None  # the running count of its finite keys [B?, Hkv|1, G|1, 1, T] (additive)

    @classmethod
    def of(cls, b: OnnxBuilder, node: Node, mask: str, v: str, heads: tuple[Dim, int], scalar: Callable[[str], str]) -> _ChunkMask:
        op, g = node.op_as(Attention), b.graph
        mshape = (1,) * (4 - g.types[mask].rank) + g.types[mask].shape
        m5 = b.reshape(mask, [mshape[0], *((1, 1) if mshape[1] == 1 else heads), *mshape[2:]])
        if op.empty_rows == "mean":  # over every key
            axes = b.const(np.array([2], np.int64), "i")
            fill = b.op("Unsqueeze", [b.op("ReduceMean", [v, axes], base=f"{node.name}_v_mean"), axes], base=f"{node.name}_v_mean5")
        else:
            fill = scalar("zero")
        cm = cls(b, op.mask, m5, mshape[2] != 1, mshape[3] != 1, fill, scalar)
        if op.mask == "additive" and not cm.rows_masked and cm.keys_masked:  # a key mask (ALiBi: a bias, padding at -inf)
            # raised to the finite fill once; a query row is empty when no key up to its causal limit is finite: the
            # running count of finite keys, read at each row's limit (small tensors, no pass over the chunk's scores)
            cm.lifted = b.op("Max", [m5, scalar("fill")], base=f"{node.name}_mask_lifted")
            finite = b.op("Greater", [m5, scalar("neg_inf")], base=f"{node.name}_mask_finite")
            counts = b.op("Cast", [finite], to=ONNX_DTYPES[g.types[v].dtype])
            cm.key_counts = b.op("CumSum", [counts, b.const(np.array(4, np.int64), "i")], base=f"{node.name}_keys_seen")
        return cm

    def bias(self, i: int, lo: str, hi: str, keys: str, past: str, hidden: str) -> tuple[str, str]:
        """Chunk ``i``'s additive bias ``[B?, Hkv|1, G|1, C, L]`` (the mask where visible, finfo.min where hidden: finite,
        so no NaN rows) and its bool ``[.., C, 1]`` of rows that see no key."""
        b = self.b
        i64 = lambda x: b.const(np.array(x, np.int64), "i")  # noqa: E731
        unsq = lambda x: b.op("Unsqueeze", [x, i64([0])])  # noqa: E731
        if self.key_counts is not None and self.lifted is not None:
            lc = b.op("Slice", [self.lifted, i64([0]), unsq(keys), i64([4])], base=f"chunk{i}_mask_keys")
            bias = b.op("Where", [hidden, self.scalar("fill"), lc], base=f"chunk{i}_bias")
            limits = b.op("Add", [b.op("Range", [lo, hi, i64(1)]), past], base=f"chunk{i}_row_limits")  # [C]
            seen = b.op("Gather", [self.key_counts, limits], base=f"chunk{i}_keys_seen", axis=4)  # [B?, Hkv|1, G|1, 1, C]
            return bias, b.op("Transpose", [b.op("Equal", [seen, self.scalar("zero")])], base=f"chunk{i}_empty", perm=[0, 1, 2, 4, 3])
        mc = b.op("Slice", [self.m5, unsq(lo), unsq(hi), i64([3])], base=f"chunk{i}_mask_rows") if self.rows_masked else self.m5
        mc = b.op("Slice", [mc, i64([0]), unsq(keys), i64([4])], base=f"chunk{i}_mask") if self.keys_masked else mc
        if self.kind == "additive":  # hidden: above the diagonal, or -inf in the mask; a row of them all is empty
            raw = b.op("Where", [hidden, self.scalar("neg_inf"), mc], base=f"chunk{i}_mask_causal")
            bias = b.op("Max", [raw, self.scalar("fill")], base=f"chunk{i}_bias")
            row_max = b.op("ReduceMax", [raw, i64([-1])], base=f"chunk{i}_row_max")
            return bias, b.op("Equal", [row_max, self.scalar("neg_inf")], base=f"chunk{i}_empty")
        visible = b.op("And", [mc, b.op("Not", [hidden])], base=f"chunk{i}_visible")  # a row of the bias all < 0 is empty
        bias = b.op("Where", [visible, self.scalar("zero"), self.scalar("fill")], base=f"chunk{i}_bias")
        return bias, b.op("Less", [b.op("ReduceMax", [bias, i64([-1])], base=f"chunk{i}_row_max"), self.scalar("zero")], base=f"chunk{i}_empty")
