"""``Attention``: scaled dot-product attention as one typed op, and its one decomposition.

Builders emit attention as a DAG of einsum and elementwise nodes; the
optimizer's ``fuse_attention`` rule recognises that DAG once and replaces it by
this op, so each backend can run its best kernel.  A backend without a kernel
gets :func:`graphc.optimizer.decompose.decompose_attention`'s grouped einsum
chain (no K/V copy).

Layout is the ONNX ``Attention`` op's 4-D form: ``q [B, Hq, Sq, D]``,
``k [B, Hkv, Sk, D]``, ``v [B, Hkv, Sk, Dv]``; query head ``h`` reads KV head
``h // (Hq // Hkv)`` (consecutive groups).  Inputs after q, k, v: the user mask
(when the visibility's ``mask`` is ``"bool"`` or ``"additive"``; broadcastable to
``[B, Hq, Sq, P+Sk]``), then ``past_key``/``past_value [B, Hkv, P, D|Dv]``
(when ``kv_cache``).  Outputs: ``out [B, Hq, Sq, Dv]``, then
``present_key``/``present_value [B, Hkv, P+Sk, D|Dv]`` (when ``kv_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .dims import Dim, dim_add, dim_div, format_shape, normalize_dim
from .errors import DTypeMismatchError, OpError, ShapeMismatchError
from .numerics import safe_softmax, softcap
from .ops import FLOAT_DTYPES, Dims, Op, TensorType, broadcast_shapes, register_op
from .visibility import Visibility

__all__ = ["Attention", "Visibility", "attention_group_size"]


@register_op
@dataclass(frozen=True)
class Attention(Op):
    """``softmax(masks(softcap(scale * q k^T))) v`` over grouped heads.

    ``visibility``: which keys each query sees (:class:`~graphc.visibility.Visibility`: the causal offset and
    window, the kind of user mask the op takes, and what a row with no visible key gives).  ``softcap``: ``c * tanh(s
    / c)`` on the scaled scores, before any mask (Gemma 2's order, and ONNX's since opset 23).  ``kv_cache``: the op
    appends ``k``/``v`` to ``past_key``/``past_value`` and also returns the results (the causal offset then counts
    the past keys: it is the past length for a cache that precedes the new tokens).
    """

    scale: float
    visibility: Visibility = Visibility()
    kv_cache: bool = False
    softcap: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not np.isfinite(self.scale):
            raise OpError(f"Attention: scale must be a finite float, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))
        if isinstance(self.visibility, dict):  # read back from a serialized graph
            object.__setattr__(self, "visibility", Visibility(**self.visibility))
        if not isinstance(self.visibility, Visibility):
            raise OpError(f"Attention: visibility must be a Visibility, got {self.visibility!r}")
        if not isinstance(self.kv_cache, bool):
            raise OpError(f"Attention: kv_cache must be a bool, got {self.kv_cache!r}")
        if self.softcap is not None:
            if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) or not 0 < self.softcap < float("inf"):
                raise OpError(f"Attention: softcap must be a finite number > 0 or None, got {self.softcap!r}")
            object.__setattr__(self, "softcap", float(self.softcap))

    def features(self, mask_shape: Sequence[Dim] | None = None, queries: Dim | None = None, keys: Dim | None = None) -> frozenset[str]:
        """What this attention uses (:data:`graphc.visibility.FEATURES`): its visibility's features (see
        :meth:`Visibility.features` for the arguments), and ``softcap``."""
        return self.visibility.features(mask_shape, queries, keys) | ({"softcap"} if self.softcap is not None else set())

    @property
    def num_outputs(self) -> int:  # type: ignore[override]
        """1, or 3 with a KV cache (out, present_key, present_value)."""
        return 3 if self.kv_cache else 1

    @property
    def has_mask(self) -> bool:
        """True when a user mask is an input."""
        return self.visibility.has_mask

    @property
    def mask(self) -> str:
        """The kind of user mask the op takes (:data:`graphc.visibility.MASK_KINDS`)."""
        return self.visibility.mask

    def check_arity(self, n: int) -> None:
        want = 3 + self.has_mask + 2 * self.kv_cache
        if n != want:
            raise OpError(f"Attention({self.visibility.describe()}, kv_cache={self.kv_cache}) takes {want} inputs, got {n}")

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
        hidden = self.visibility.hidden(s.shape[2], s.shape[3], dims, mask)
        if self.mask == "additive" and mask is not None:
            s = s + mask
        s = np.where(hidden, np.array(-np.inf, s.dtype), s)
        out = np.einsum("bhqk,bhkd->bhqd", safe_softmax(s, -1), vr).astype(q.dtype)
        out = self.visibility.rows_with_no_key(out, np.broadcast_to(hidden, s.shape), vr)
        return (out, k, v) if self.kv_cache else (out,)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """QK^T and PV (two per multiply-add) and the softmax (five per score), over every key (past included)."""
        b, hq, sq, d = in_shapes[0]
        sk = out_shapes[1][2] if self.kv_cache else in_shapes[1][2]
        dv = in_shapes[2][3]
        return 2 * b * hq * sq * sk * (d + dv) + 5 * b * hq * sq * sk

    def neg_inf_rows(self, ins: Sequence[TensorType]) -> str:
        """The op's result never holds a row of ``-inf`` (zeros or the mean of V)."""
        return "clear"



def attention_group_size(n_heads: Dim, n_kv_heads: Dim) -> int | None:
    """Query heads per KV head, or ``None`` when ``n_heads`` is not a multiple of ``n_kv_heads``."""
    if normalize_dim(n_heads) == normalize_dim(n_kv_heads):
        return 1
    return dim_div(n_heads, n_kv_heads)
