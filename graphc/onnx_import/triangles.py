"""Causal masks written as triangles: what ``Equal``, ``Cast``, ``Not``, ``Where`` and ``Slice`` make of a ``Trilu`` mask.

Exporters spell a causal mask in many ways: ``torch.full(-inf).triu(1)`` added
to the scores, ``ones(bool).triu(1)`` in a ``masked_fill``, ``tril(ones) == 0``
(``F.scaled_dot_product_attention(is_causal=True)``), a registered ``tril``
buffer sliced to the run's length (nanoGPT).  A :class:`Triangle` holds
``value`` on one side of a diagonal and 0 elsewhere; these functions keep such
masks symbolic through the ops above, so that where one finally meets the
scores it becomes a ``CausalMask`` (the optimizer then recognises causal
attention), and only a mask used some other way is built from positions.
Each returns ``None`` when its operands are not such a mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..dims import Dim, dim_add, dim_sub, normalize_dim
from ..numerics import hides_keys
from .context import Filled, Imported, Triangle, simplify

__all__ = ["complement", "tri_equal", "tri_cast", "tri_not", "tri_where", "tri_from_buffer"]


def complement(t: Triangle, value: np.ndarray) -> Triangle:
    """``value`` where ``t`` is 0 (the other side of its diagonal): upper ``j - i >= k`` <-> lower ``j - i <= k - 1``."""
    return Triangle(value, t.shape, dim_sub(t.k, 1) if t.upper else dim_add(t.k, 1), not t.upper)


def _scalar(v: Imported | None) -> np.ndarray | None:
    v = simplify(v) if v is not None else None
    return v.reshape(()) if isinstance(v, np.ndarray) and v.size == 1 else None


def tri_equal(a: Imported, b: Imported) -> Imported | None:
    """``Triangle == c``: a bool triangle (or a constant fill) of where the values equal ``c``."""
    t, c = (a, _scalar(b)) if isinstance(a, Triangle) else (b, _scalar(a))
    if not isinstance(t, Triangle) or c is None:
        return None
    inside, outside = bool(t.value == c), bool(c == 0)
    true = np.array(True)
    if inside and not outside:
        return Triangle(true, t.shape, t.k, t.upper)
    if outside and not inside:
        return complement(t, true)
    return Filled(np.array(inside), t.shape)


def tri_cast(t: Imported, dtype: str) -> Triangle | None:
    """``Cast(Triangle)``: the value cast (0 stays 0)."""
    return Triangle(np.asarray(t.value).astype(dtype), t.shape, t.k, t.upper) if isinstance(t, Triangle) else None


def tri_not(t: Imported) -> Triangle | None:
    """``Not`` of a bool triangle that is True on its side: True on the other side."""
    if isinstance(t, Triangle) and t.value.dtype == np.bool_ and bool(t.value):
        return complement(t, np.array(True))
    return None


def tri_where(cond: Imported, x: Imported, y: Imported) -> tuple[str, Imported, Triangle] | Triangle | None:
    """``Where(bool Triangle, x, y)``.

    Two scalars, one of them 0, give a triangle; a scalar that hides keys (``-inf`` or ``finfo.min``) against a
    tensor gives ``("add", tensor, Triangle(-inf))``: the tensor plus a triangle of ``-inf`` where it is hidden.
    """
    if not (isinstance(cond, Triangle) and cond.value.dtype == np.bool_ and bool(cond.value)):
        return None
    sx, sy = _scalar(x), _scalar(y)
    if sx is not None and sy is not None:
        if sy == 0:
            return Triangle(sx, cond.shape, cond.k, cond.upper)
        if sx == 0:
            return complement(cond, sy)
        return None
    if sx is not None and isinstance(y, str) and hides_keys(sx):  # masked_fill(tri, -inf)
        return ("add", y, Triangle(np.asarray(-np.inf, sx.dtype), cond.shape, cond.k, cond.upper))
    if sy is not None and isinstance(x, str) and hides_keys(sy):  # keep x inside, hide the rest
        return ("add", x, complement(cond, np.asarray(-np.inf, sy.dtype)))
    return None


def tri_from_buffer(arr: np.ndarray, shape: Sequence[Dim]) -> Triangle | None:
    """A constant buffer of ``tril``/``triu`` form (``register_buffer("bias", torch.tril(ones))``), sliced from 0 to
    ``shape`` on its last two axes, as a :class:`Triangle` of that symbolic shape."""
    if arr.ndim < 2 or arr.shape[-1] != arr.shape[-2] or any(d != 1 for d in arr.shape[:-2]) or arr.shape[-1] < 2:
        return None
    square = arr.reshape(arr.shape[-2], arr.shape[-1])
    value = square.max() if square.dtype != np.bool_ else np.array(True)
    if not np.all((square == 0) | (square == value)) or value == 0:
        return None
    n = square.shape[0]
    for k in (0, -1, 1):
        for upper, tri in ((False, np.tril), (True, np.triu)):
            if np.array_equal(square, tri(np.full((n, n), value, square.dtype), k)):
                return Triangle(np.asarray(value), tuple(normalize_dim(d) for d in shape), k, upper)
    return None
