"""Reference numerics shared by the ops' semantics and the backends' kernels.

These are the definitions, written for clarity: a softmax whose fully masked rows are zeros (not NaN), softcapping,
and which additive fills hide a key.  Which keys a query sees is :class:`graphc.visibility.Visibility`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["softcap", "safe_softmax", "contiguous", "lowest", "hides_keys", "FILL_LIMIT"]


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """Logit soft-capping ``cap * tanh(x / cap)`` (Gemma 2), in ``x``'s dtype."""
    c = np.array(cap, x.dtype)
    return c * np.tanh(x / c)


def safe_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax along ``axis``; a row of all ``-inf`` (or an empty row) gives zeros instead of NaN."""
    if x.size == 0:
        return np.zeros_like(x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, np.zeros((), x.dtype))
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s == 0, np.ones((), x.dtype), s)


def contiguous(a: np.ndarray, dtype: np.dtype | str | None = None) -> np.ndarray:
    """``a`` as a C-contiguous array of its own rank (``np.ascontiguousarray`` turns rank 0 into shape ``(1,)``)."""
    return np.asarray(a, dtype=dtype, order="C")


def lowest(dtype: str | np.dtype) -> np.ndarray:
    """The most negative finite value of the float ``dtype`` (bfloat16 included), as a 0-d array of that dtype."""
    return np.array(ml_dtypes.finfo(dtype).min, dtype)


FILL_LIMIT = -1e30
"""A finite additive fill at most this hides a key: ``s + fill == fill`` for ``|s|`` under half its ulp (1e31 for
``finfo(float32).min``)."""


def hides_keys(value: object) -> bool:
    """Whether an additive mask value hides the key it is added to: ``-inf``, a finite fill at most :data:`FILL_LIMIT`
    (float32's and bfloat16's ``finfo.min``), or float16's own ``finfo.min`` (-65504) in a float16 tensor (what a
    float16 model masks with: its sum with any score under 16 in size is the fill again)."""
    arr = np.asarray(value)
    if str(arr.dtype) not in ("float16", "bfloat16", "float32", "float64") or arr.size != 1:
        return False
    v = float(arr.reshape(()))
    return v <= FILL_LIMIT or (str(arr.dtype) == "float16" and v <= float(np.finfo(np.float16).min))
