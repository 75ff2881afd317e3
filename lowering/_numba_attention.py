"""numba kernels behind :mod:`lowering.compiled` (imported only when numba is installed).

Two kernels:

- :func:`attend_rows` (``parallel``: numba's threads over KV heads and key
  slices; graphc's Python pool cost 0.1 ms a call in thread wake-ups here):
  attention of a few query rows per KV head (decode, short chunks), in two
  streaming passes per head: ``K`` once for all the
  rows of a KV head (scores kept in a small buffer), then ``V`` once.  Keys are
  taken four at a time so each query value feeds four FMAs, and the next rows
  of ``K``/``V`` are prefetched a fixed distance ahead (without it the
  hardware prefetcher left the loop at 60-70% of the read bandwidth).  The
  softmax is left unnormalised: each slice returns its row maxima, sums and
  ``V`` accumulators, and the caller merges slices (split keys) and divides.
- :func:`exp_rows` (``nogil``, called from the prefill blocks' threads):
  ``s <- exp(s - rowmax)`` in place with the row sums, in one
  pass after the max (NumPy takes five: max, isfinite, subtract, exp, sum).

``exp`` is :func:`_exp_neg`, a range-reduced polynomial (Cephes' ``expf``
coefficients) that LLVM vectorises: relative error below 3e-7 on [-87, 0]
(tested against float64), exactly 0 below -87.3 and for ``-inf``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

__all__ = ["attend_rows", "exp_rows"]

FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}
"""LLVM's fast-math flags less ``nnan`` and ``ninf``: sums may be reordered (vectorised), but ``-inf`` (masked keys) stays meaningful."""

PREFETCH_ROWS = 32
"""Key rows prefetched ahead of the one being read (16 KiB at head_dim 128: measured best of 16-128)."""


@intrinsic
def _prefetch(typingctx, arr, index):  # type: ignore[no-untyped-def]
    """``llvm.prefetch`` (read, keep in all cache levels) of ``arr.ravel()[index]``; never faults."""
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array = context.make_array(signature.args[0])(context, builder, args[0])
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]))
        ptr = builder.bitcast(builder.gep(array.data, [args[1]]), byte_ptr)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=FAST, inline="always", cache=True)
def _exp_neg(x):  # type: ignore[no-untyped-def]
    """``exp(x)`` for ``x <= 0`` in float32: ``2**n * p(r)``, ``r = x - n ln 2``; 0 below -87.3 (and for -inf)."""
    xc = max(x, np.float32(-87.0))
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693145751953125) - n * np.float32(1.428606765330187e-06)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    scale = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    return p * scale if x > np.float32(-87.3) else np.float32(0.0)


@njit(fastmath=FAST, nogil=True, cache=True)
def exp_rows(s, totals):  # type: ignore[no-untyped-def]
    """``s[r] <- exp(s[r] - max(s[r]))`` in place for every row of the 2-D ``s``; ``totals[r]`` the row sum (rows all ``-inf``: zeros, sum 1)."""
    for r in range(s.shape[0]):
        row = s[r]
        m = np.float32(-np.inf)
        for j in range(row.size):
            m = max(m, row[j])
        if m == np.float32(-np.inf):
            row[:] = 0
            totals[r] = 1
            continue
        t = np.float32(0.0)
        for j in range(row.size):
            e = _exp_neg(row[j] - m)
            row[j] = e
            t += e
        totals[r] = t


@njit(fastmath=FAST, inline="always", cache=True)
def _scores(q, k, kf, s, j0, j1):  # type: ignore[no-untyped-def]
    """``s[r, j - j0] = q[r] . k[j]`` for keys j0..j1-1, four keys per step, prefetching ahead in ``kf`` (``k`` flat)."""
    rows, d_len = q.shape
    j4 = j0 + (j1 - j0) // 4 * 4
    ahead = PREFETCH_ROWS * d_len
    for j in range(j0, j4, 4):
        base = j * d_len + ahead
        if base + 4 * d_len <= kf.size:
            for c in range(0, 4 * d_len, 16):
                _prefetch(kf, base + c)
        for r in range(rows):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for d in range(d_len):
                qv = q[r, d]
                a0 += qv * k[j, d]
                a1 += qv * k[j + 1, d]
                a2 += qv * k[j + 2, d]
                a3 += qv * k[j + 3, d]
            s[r, j - j0] = a0
            s[r, j - j0 + 1] = a1
            s[r, j - j0 + 2] = a2
            s[r, j - j0 + 3] = a3
    for j in range(j4, j1):
        for r in range(rows):
            a0 = np.float32(0.0)
            for d in range(d_len):
                a0 += q[r, d] * k[j, d]
            s[r, j - j0] = a0


@njit(fastmath=FAST, inline="always", cache=True)
def _weighted_values(p, v, vf, acc, j0, j1):  # type: ignore[no-untyped-def]
    """``acc[r] += sum_j p[r, j - j0] v[j]`` for keys j0..j1-1, four keys per step, prefetching ahead in ``vf``."""
    rows, e_len = acc.shape
    j4 = j0 + (j1 - j0) // 4 * 4
    ahead = PREFETCH_ROWS * e_len
    for j in range(j0, j4, 4):
        base = j * e_len + ahead
        if base + 4 * e_len <= vf.size:
            for c in range(0, 4 * e_len, 16):
                _prefetch(vf, base + c)
        for r in range(rows):
            p0 = p[r, j - j0]
            p1 = p[r, j - j0 + 1]
            p2 = p[r, j - j0 + 2]
            p3 = p[r, j - j0 + 3]
            for e in range(e_len):
                acc[r, e] += (p0 * v[j, e] + p1 * v[j + 1, e]) + (p2 * v[j + 2, e] + p3 * v[j + 3, e])
    for j in range(j4, j1):
        for r in range(rows):
            p0 = p[r, j - j0]
            for e in range(e_len):
                acc[r, e] += p0 * v[j, e]


@njit(fastmath=FAST, inline="always", cache=True)
def _attend_head(q, k, v, sq, causal, offset, window, key_start, key_stop, s, acc, row_max, row_sum):  # type: ignore[no-untyped-def]
    """One KV head's slice of :func:`attend_rows`: ``q [R, D]``, ``k [T, D]``, ``v [T, E]`` into ``acc [R, E]``, ``row_max``/``row_sum [R]``."""
    rows = q.shape[0]
    width = key_stop - key_start
    _scores(q, k, k.ravel(), s, key_start, key_stop)
    for r in range(rows):
        lo = key_start
        hi = key_stop
        if causal:
            last = r % sq + offset
            hi = min(hi, last + 1)
            if window > 0:
                lo = max(lo, last - window + 1)
        row = s[r]
        a = min(max(lo - key_start, 0), width)
        b = max(min(hi - key_start, width), a)
        row[:a] = 0
        row[b:] = 0
        m = np.float32(-np.inf)
        for j in range(a, b):
            m = max(m, row[j])
        row_max[r] = m
        t = np.float32(0.0)
        for j in range(a, b):
            e = _exp_neg(row[j] - m)
            row[j] = e
            t += e
        row_sum[r] = t
    local = np.zeros(acc.shape, np.float32)  # a fresh array: LLVM sees it aliases neither V nor the scores, so it vectorises freely
    _weighted_values(s, v, v.ravel(), local, key_start, key_stop)
    acc[:] = local


@njit(fastmath=FAST, parallel=True, cache=True)
def attend_rows(q, k, v, sq, causal, offset, window, bounds, acc, row_max, row_sum):  # type: ignore[no-untyped-def]
    """Unnormalised attention of ``q [L, R, D]`` over ``k [L, T, D]``, ``v [L, T, E]``: one task per KV head and key slice.

    ``bounds [C + 1]`` splits the keys into ``C`` slices (flash-decoding).  Row
    ``r`` is query ``i = r % sq``; with ``causal`` it sees keys
    ``j <= i + offset`` and, when ``window > 0``, ``j > i + offset - window``.
    Writes ``acc[c, l] = sum_j exp(s_rj - m_r) v_j`` over slice ``c``,
    ``row_max[c, l, r] = m_r`` (``-inf`` for a row that sees none of its keys)
    and ``row_sum[c, l, r]``.
    """
    lead, rows = q.shape[0], q.shape[1]
    slices = bounds.size - 1
    widest = 1
    for c in range(slices):
        widest = max(widest, bounds[c + 1] - bounds[c])
    for task in prange(lead * slices):
        head = task // slices
        c = task % slices
        s = np.empty((rows, widest), np.float32)
        lo, hi = bounds[c], bounds[c + 1]
        _attend_head(q[head], k[head], v[head], sq, causal, offset, window, lo, hi, s, acc[c, head], row_max[c, head], row_sum[c, head])
