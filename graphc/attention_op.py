"""``Attention``: scaled dot-product attention as one typed op, and its one decomposition.

Builders emit attention as a DAG of einsum and elementwise nodes; the
optimizer's ``fuse_attention`` rule recognises that DAG once and replaces it by
this op, so each backend can run its best kernel.  A backend without a kernel
gets :func:`graphc.optimizer.decompose.decompose_attention`'s grouped einsum
chain (no K/V copy).

Layout is the ONNX ``Attention`` op's 4-D form: ``q [B, Hq, Sq, D]``,
``k [B, Hkv, Sk, D]``, ``v [B, Hkv, Sk, Dv]``; query head ``h`` reads KV head
``h // (Hq // Hkv)`` (consecutive groups).  Inputs after q, k, v: the user mask
(when ``mask`` is ``"bool"`` or ``"additive"``; broadcastable to
``[B, Hq, Sq, P+Sk]``), then ``past_key``/``past_value [B, Hkv, P, D|Dv]``
(when ``kv_cache``).  Outputs: ``out [B, Hq, Sq, Dv]``, then
``present_key``/``present_value [B, Hkv, P+Sk, D|Dv]`` (when ``kv_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .dims import Dim, dim_add, dim_div, dim_is_nonnegative, eval_dim, format_shape, normalize_dim
from .errors import DTypeMismatchError, OpError, ShapeMismatchError
from .numerics import hidden_keys, safe_softmax, softcap
from .ops import FLOAT_DTYPES, Dims, Op, TensorType, broadcast_shapes, register_op

__all__ = ["Attention", "MASK_KINDS", "EMPTY_ROWS", "attention_group_size"]

MASK_KINDS = ("none", "bool", "additive")
EMPTY_ROWS = ("zero", "mean")


@register_op
@dataclass(frozen=True)
class Attention(Op):
    """``softmax(masks(softcap(scale * q k^T))) v`` over grouped heads.

    ``causal_offset``: ``None`` for no causal mask, else key ``j`` (counted over
    past and new keys) is hidden from query ``i`` when ``j > i + offset``; with a
    KV cache of past length P the offset is P.  ``window`` (with a causal mask):
    a sliding window that also hides ``j <= i + offset - window``.  ``softcap``:
    ``c * tanh(s / c)`` on the scaled scores, before any mask (Gemma 2's order,
    and ONNX's since opset 23).  ``mask``: ``"none"``, ``"bool"``
    (True keeps a key) or ``"additive"`` (added to the scores).  ``kv_cache``:
    the op appends ``k``/``v`` to ``past_key``/``past_value`` and also returns
    the results.  ``empty_rows``: what a query row with no visible key gives:
    ``"zero"`` (ONNX's convention) or ``"mean"``, the mean of V over every key,
    which is what an additive mask filled with a huge finite negative
    (transformers' ``finfo(dtype).min``) gives: every score of such a row
    becomes the fill, so its softmax is uniform.
    """

    scale: float
    causal_offset: Dim | None = None
    mask: str = "none"
    kv_cache: bool = False
    window: int | None = None
    softcap: float | None = None
    empty_rows: str = "zero"

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not np.isfinite(self.scale):
            raise OpError(f"Attention: scale must be a finite float, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))
        if self.causal_offset is not None:
            object.__setattr__(self, "causal_offset", normalize_dim(self.causal_offset))
        if self.mask not in MASK_KINDS:
            raise OpError(f"Attention: mask must be one of {MASK_KINDS}, got {self.mask!r}")
        if not isinstance(self.kv_cache, bool):
            raise OpError(f"Attention: kv_cache must be a bool, got {self.kv_cache!r}")
        if self.window is not None:
            if isinstance(self.window, bool) or not isinstance(self.window, (int, np.integer)) or self.window < 1:
                raise OpError(f"Attention: window must be an int >= 1 or None, got {self.window!r}")
            if self.causal_offset is None:
                raise OpError("Attention: a sliding window needs a causal mask (causal_offset)")
            object.__setattr__(self, "window", int(self.window))
        if self.softcap is not None:
            if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) or not 0 < self.softcap < float("inf"):
                raise OpError(f"Attention: softcap must be a finite number > 0 or None, got {self.softcap!r}")
            object.__setattr__(self, "softcap", float(self.softcap))
        if self.empty_rows not in EMPTY_ROWS:
            raise OpError(f"Attention: empty_rows must be one of {EMPTY_ROWS}, got {self.empty_rows!r}")

    @property
    def num_outputs(self) -> int:  # type: ignore[override]
        """1, or 3 with a KV cache (out, present_key, present_value)."""
        return 3 if self.kv_cache else 1

    @property
    def has_mask(self) -> bool:
        """True when a user mask is an input."""
        return self.mask != "none"

    def check_arity(self, n: int) -> None:
        want = 3 + self.has_mask + 2 * self.kv_cache
        if n != want:
            raise OpError(f"Attention(mask={self.mask!r}, kv_cache={self.kv_cache}) takes {want} inputs, got {n}")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return self.infer_all(ins)[0]

    def infer_all(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        q, k, v = ins[:3]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.rank != 4:
                raise ShapeMismatchError(f"Attention: {name} must be 4-D [batch, heads, seq, dim], got {format_shape(t.shape)}")
        if q.dtype not in FLOAT_DTYPES or {k.dtype, v.dtype} != {q.dtype}:
            raise DTypeMismatchError(f"Attention: q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        b, hq, sq, d = q.shape
        if k.shape[0] != b or v.shape[0] != b:
            raise ShapeMismatchError(f"Attention: batch differs: q {format_shape(q.shape)}, k {format_shape(k.shape)}, v {format_shape(v.shape)}")
        hkv, sk = k.shape[1], k.shape[2]
        if v.shape[1] != hkv or v.shape[2] != sk:
            raise ShapeMismatchError(f"Attention: k {format_shape(k.shape)} and v {format_shape(v.shape)} must share heads and length")
        if k.shape[3] != d:
            raise ShapeMismatchError(f"Attention: q head dim {d!r} differs from k head dim {k.shape[3]!r}")
        if attention_group_size(hq, hkv) is None:
            raise ShapeMismatchError(f"Attention: query heads {hq!r} are not a multiple of KV heads {hkv!r}")
        dv = v.shape[3]
        total = sk
        rest = list(ins[3:])
        mask = rest.pop(0) if self.has_mask else None
        outs = [TensorType((b, hq, sq, dv), q.dtype)]
        if self.kv_cache:
            pk, pv = rest
            if pk.rank != 4 or pk.shape[:2] != (b, hkv) or pk.shape[3] != d or pv.shape != (*pk.shape[:3], dv) or {pk.dtype, pv.dtype} != {q.dtype}:
                raise ShapeMismatchError(f"Attention: past_key {pk} / past_value {pv} must be [{b},{hkv},P,{d}] / [{b},{hkv},P,{dv}] of {q.dtype}")
            total = dim_add(pk.shape[2], sk)
            outs += [TensorType((b, hkv, total, d), q.dtype), TensorType((b, hkv, total, dv), q.dtype)]
        if mask is not None:
            want = "bool" if self.mask == "bool" else q.dtype
            if mask.dtype != want:
                raise DTypeMismatchError(f"Attention: a {self.mask} mask must be {want}, got {mask.dtype}")
            if mask.rank > 4 or broadcast_shapes(mask.shape, (b, hq, sq, total), "Attention mask") != (b, hq, sq, total):
                raise ShapeMismatchError(f"Attention: mask {format_shape(mask.shape)} does not broadcast to [{b},{hq},{sq},{total}]")
        return tuple(outs)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return self.evaluate_all(args, dims)[0]

    def evaluate_all(self, args: Sequence[np.ndarray], dims: Dims) -> tuple[np.ndarray, ...]:
        """Reference semantics, written plainly: repeat K/V to the query heads, then the textbook formula."""
        q, k, v = args[:3]
        rest = list(args[3:])
        mask = rest.pop(0) if self.has_mask else None
        if self.kv_cache:
            k, v = np.concatenate([rest[0], k], axis=2), np.concatenate([rest[1], v], axis=2)
        group = q.shape[1] // k.shape[1] if k.shape[1] else 1
        kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("bhqd,bhkd->bhqk", q, kr) * np.array(self.scale, q.dtype)
        if self.softcap is not None:
            s = softcap(s, self.softcap)
        hidden = np.zeros(s.shape, bool)
        if self.causal_offset is not None:
            hidden |= hidden_keys(0, s.shape[2], s.shape[3], eval_dim(self.causal_offset, dims), self.window)
        if mask is None:
            pass
        elif self.mask == "bool":
            hidden |= ~mask
        elif self.mask == "additive":
            s = s + mask
            hidden |= np.isneginf(mask)
        s = np.where(hidden, np.array(-np.inf, s.dtype), s)
        out = np.einsum("bhqk,bhkd->bhqd", safe_softmax(s, -1), vr).astype(q.dtype)
        if self.empty_rows == "mean" and s.shape[3]:
            out = np.where(hidden.all(axis=-1, keepdims=True), vr.mean(axis=2, keepdims=True, dtype=np.float64).astype(q.dtype), out)
        return (out, k, v) if self.kv_cache else (out,)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """QK^T and PV (two per multiply-add) and the softmax (five per score), over every key (past included)."""
        b, hq, sq, d = in_shapes[0]
        sk = out_shapes[1][2] if self.kv_cache else in_shapes[1][2]
        dv = in_shapes[2][3]
        return 2 * b * hq * sq * sk * (d + dv) + 5 * b * hq * sq * sk

    def neg_inf_rows(self, n_inputs: int) -> str:
        """The op's result never holds a row of ``-inf`` (zeros or the mean of V)."""
        return "clear"

    @property
    def may_mask_whole_rows(self) -> bool:
        """True when some query row can see no key (a user mask, or a causal offset that may be negative)."""
        return self.empty_rows != "zero" or self.has_mask or (self.causal_offset is not None and not dim_is_nonnegative(self.causal_offset))


def attention_group_size(n_heads: Dim, n_kv_heads: Dim) -> int | None:
    """Query heads per KV head, or ``None`` when ``n_heads`` is not a multiple of ``n_kv_heads``."""
    if normalize_dim(n_heads) == normalize_dim(n_kv_heads):
        return 1
    return dim_div(n_heads, n_kv_heads)
