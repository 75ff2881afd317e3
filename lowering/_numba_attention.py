"""numba kernels behind :mod:`lowering.compiled` (imported only when numba is installed).

Two kernels:

- :func:`attend_rows` (``nogil``, called on graphc's thread pool with a share
  of the KV heads and key slices each: numba's own threading layers spun
  against OpenBLAS's threads, and decode calls made after a GEMM took 4-15 ms
  instead of 1): attention of a few query rows per KV head (decode, short chunks), in two
  streaming passes per head: ``K`` once for all the
  rows of a KV head (scores kept in a small buffer), then ``V`` once.  Four
  query rows x four keys per step, and the next rows of ``K``/``V`` are
  prefetched a fixed distance ahead (on 128 MiB of K, cache-cold, the ``K``
  pass read 29 GB/s without the prefetch and 47 GB/s with it).  The
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
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["attend_rows", "exp_rows"]

FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}
"""LLVM's fast-math flags less ``nnan`` and ``ninf``: sums may be reordered (vectorised), but ``-inf`` (masked keys) stays meaningful."""

PREFETCH_ROWS = 32
"""Key rows prefetched ahead of the one being read (16 KiB at head_dim 128; 16 to 128 measured alike, within noise)."""


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
def _prefetch_ahead(flat, row, row_len):  # type: ignore[no-untyped-def]
    """Prefetch the four rows :data:`PREFETCH_ROWS` after ``row`` (rows of ``row_len`` in ``flat``), one 64-byte line at a time."""
    base = (row + PREFETCH_ROWS) * row_len
    if base + 4 * row_len <= flat.size:
        for c in range(0, 4 * row_len, 16):
            _prefetch(flat, base + c)


@njit(fastmath=FAST, inline="always", cache=True)
def _exp_neg(x):  # type: ignore[no-untyped-def]
    """``exp(x)`` for ``x <= 0`` in float32: ``2**n * p(r)``, ``r = x - n ln 2``; 0 below -87.3 (and for -inf); NaN for NaN."""
    xc = np.float32(-87.0) if x < np.float32(-87.0) else x  # NaN stays NaN
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
    return np.float32(0.0) if x < np.float32(-87.3) else p * scale


@njit(fastmath=FAST, inline="always", cache=True)
def _scores(q, k, s):  # type: ignore[no-untyped-def]
    """``s[r, j] = q[r] . k[j]`` for every key of ``k``, prefetching ahead.

    ``k`` is the task's slice of the cache, indexed from 0: with a runtime
    start offset in the indices the loops ran 1.4x slower.

    Four keys per step; rows four at a time with sixteen scalar accumulators,
    which LLVM keeps in vector registers (each K load feeds four rows' FMAs:
    1.8x the rows-one-at-a-time loop on one core), then the leftover rows.
    """
    rows, d_len = q.shape
    kf = k.ravel()
    j4 = k.shape[0] // 4 * 4
    r4 = rows // 4 * 4
    for j in range(0, j4, 4):
        _prefetch_ahead(kf, j, d_len)
        k0 = k[j]
        k1 = k[j + 1]
        k2 = k[j + 2]
        k3 = k[j + 3]
        c = j
        for r in range(0, r4, 4):
            _scores_4x4(q[r], q[r + 1], q[r + 2], q[r + 3], k0, k1, k2, k3, s[r : r + 4, c : c + 4])
        for r in range(r4, rows):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for d in range(d_len):
                qv = q[r, d]
                a0 += qv * k0[d]
                a1 += qv * k1[d]
                a2 += qv * k2[d]
                a3 += qv * k3[d]
            s[r, c] = a0
            s[r, c + 1] = a1
            s[r, c + 2] = a2
            s[r, c + 3] = a3
    for j in range(j4, k.shape[0]):
        for r in range(rows):
            a0 = np.float32(0.0)
            for d in range(d_len):
                a0 += q[r, d] * k[j, d]
            s[r, j] = a0


@njit(fastmath=FAST, inline="always", cache=True)
def _scores_4x4(q0, q1, q2, q3, k0, k1, k2, k3, out):  # type: ignore[no-untyped-def]
    """``out[a, b] = q_a . k_b`` for four query rows and four keys: sixteen accumulators over the head dimension."""
    a00 = a01 = a02 = a03 = np.float32(0.0)
    a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = np.float32(0.0)
    a30 = a31 = a32 = a33 = np.float32(0.0)
    for d in range(q0.size):
        x0 = k0[d]
        x1 = k1[d]
        x2 = k2[d]
        x3 = k3[d]
        y = q0[d]
        a00 += y * x0
        a01 += y * x1
        a02 += y * x2
        a03 += y * x3
        y = q1[d]
        a10 += y * x0
        a11 += y * x1
        a12 += y * x2
        a13 += y * x3
        y = q2[d]
        a20 += y * x0
        a21 += y * x1
        a22 += y * x2
        a23 += y * x3
        y = q3[d]
        a30 += y * x0
        a31 += y * x1
        a32 += y * x2
        a33 += y * x3
    out[0, 0], out[0, 1], out[0, 2], out[0, 3] = a00, a01, a02, a03
    out[1, 0], out[1, 1], out[1, 2], out[1, 3] = a10, a11, a12, a13
    out[2, 0], out[2, 1], out[2, 2], out[2, 3] = a20, a21, a22, a23
    out[3, 0], out[3, 1], out[3, 2], out[3, 3] = a30, a31, a32, a33


@njit(fastmath=FAST, inline="always", cache=True)
def _weighted_values(p, v, acc):  # type: ignore[no-untyped-def]
    """``acc[r] = sum_j p[r, j] v[j]`` over every key of ``v`` (a slice starting at 0, as in :func:`_scores`), prefetching ahead.

    Rows four at a time into fresh accumulators (LLVM then sees they alias
    neither ``V`` nor ``p``), each ``V`` load feeding four rows; then the
    leftover rows; four keys per step throughout.
    """
    rows, e_len = acc.shape
    vf = v.ravel()
    r4 = rows // 4 * 4
    for r in range(0, r4, 4):
        c0 = np.zeros(e_len, np.float32)
        c1 = np.zeros(e_len, np.float32)
        c2 = np.zeros(e_len, np.float32)
        c3 = np.zeros(e_len, np.float32)
        _values_4_rows(p[r : r + 4], v, vf, c0, c1, c2, c3)
        acc[r] = c0
        acc[r + 1] = c1
        acc[r + 2] = c2
        acc[r + 3] = c3
    for r in range(r4, rows):
        c0 = np.zeros(e_len, np.float32)
        _values_1_row(p[r], v, vf, c0)
        acc[r] = c0


@njit(fastmath=FAST, inline="always", cache=True)
def _values_4_rows(p, v, vf, c0, c1, c2, c3):  # type: ignore[no-untyped-def]
    """``c_a += sum_j p[a, j] v[j]`` for four rows ``a``, four keys per step, prefetching ahead in ``vf`` (``v`` flat)."""
    e_len = c0.size
    j4 = v.shape[0] // 4 * 4
    for j in range(0, j4, 4):
        _prefetch_ahead(vf, j, e_len)
        i = j
        v0 = v[j]
        v1 = v[j + 1]
        v2 = v[j + 2]
        v3 = v[j + 3]
        p00, p01, p02, p03 = p[0, i], p[0, i + 1], p[0, i + 2], p[0, i + 3]
        p10, p11, p12, p13 = p[1, i], p[1, i + 1], p[1, i + 2], p[1, i + 3]
        p20, p21, p22, p23 = p[2, i], p[2, i + 1], p[2, i + 2], p[2, i + 3]
        p30, p31, p32, p33 = p[3, i], p[3, i + 1], p[3, i + 2], p[3, i + 3]
        for e in range(e_len):
            x0 = v0[e]
            x1 = v1[e]
            x2 = v2[e]
            x3 = v3[e]
            c0[e] += (p00 * x0 + p01 * x1) + (p02 * x2 + p03 * x3)
            c1[e] += (p10 * x0 + p11 * x1) + (p12 * x2 + p13 * x3)
            c2[e] += (p20 * x0 + p21 * x1) + (p22 * x2 + p23 * x3)
            c3[e] += (p30 * x0 + p31 * x1) + (p32 * x2 + p33 * x3)
    for j in range(j4, v.shape[0]):
        i = j
        for e in range(e_len):
            x0 = v[j, e]
            c0[e] += p[0, i] * x0
            c1[e] += p[1, i] * x0
            c2[e] += p[2, i] * x0
            c3[e] += p[3, i] * x0


@njit(fastmath=FAST, inline="always", cache=True)
def _values_1_row(p, v, vf, c0):  # type: ignore[no-untyped-def]
    """``c0 += sum_j p[j] v[j]``, four keys per step, prefetching ahead in ``vf`` (``v`` flat)."""
    e_len = c0.size
    j4 = v.shape[0] // 4 * 4
    for j in range(0, j4, 4):
        _prefetch_ahead(vf, j, e_len)
        i = j
        p0, p1, p2, p3 = p[i], p[i + 1], p[i + 2], p[i + 3]
        for e in range(e_len):
            c0[e] += (p0 * v[j, e] + p1 * v[j + 1, e]) + (p2 * v[j + 2, e] + p3 * v[j + 3, e])
    for j in range(j4, v.shape[0]):
        pj = p[j]
        for e in range(e_len):
            c0[e] += pj * v[j, e]


@njit(fastmath=FAST, inline="always", cache=True)
def _row_max(x):  # type: ignore[no-untyped-def]
    """The maximum of the 1-D ``x`` (``-inf`` when empty), sixteen running maxima at a time so that LLVM vectorises it."""
    lanes = np.full(16, -np.inf, np.float32)
    n16 = x.size // 16 * 16
    for j in range(0, n16, 16):
        for i in range(16):
            y = x[j + i]
            lanes[i] = y if y > lanes[i] else lanes[i]
    m = np.float32(-np.inf)
    for i in range(16):
        m = lanes[i] if lanes[i] > m else m
    for j in range(n16, x.size):
        m = x[j] if x[j] > m else m
    return m


@njit(fastmath=FAST, inline="always", cache=True)
def _softmax_unnormalised(x):  # type: ignore[no-untyped-def]
    """``x <- exp(x - max(x))`` in place; returns ``(max, sum)`` (``-inf`` and 0, with ``x`` zeroed, when every entry is ``-inf``)."""
    m = _row_max(x)
    if m == np.float32(-np.inf):
        x[:] = 0
        return m, np.float32(0.0)
    t = np.float32(0.0)
    for j in range(x.size):
        e = _exp_neg(x[j] - m)
        x[j] = e
        t += e
    return m, t


@njit(fastmath=FAST, nogil=True, cache=True)
def exp_rows(s, totals):  # type: ignore[no-untyped-def]
    """``s[r] <- exp(s[r] - max(s[r]))`` in place for every row of the 2-D ``s``; ``totals[r]`` the row sum (rows all ``-inf``: zeros, sum 1)."""
    for r in range(s.shape[0]):
        m, t = _softmax_unnormalised(s[r])
        totals[r] = t if m != np.float32(-np.inf) else np.float32(1.0)


@njit(fastmath=FAST, inline="always", cache=True)
def _attend_head(q, k, v, sq, causal, offset, window, key_start, key_stop, s, acc, row_max, row_sum):  # type: ignore[no-untyped-def]
    """One KV head's slice of :func:`attend_rows`: ``q [R, D]``, ``k [T, D]``, ``v [T, E]`` into ``acc [R, E]``, ``row_max``/``row_sum [R]``."""
    rows = q.shape[0]
    width = key_stop - key_start
    ks = k[key_start:key_stop]
    vs = v[key_start:key_stop]
    _scores(q, ks, s)
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
        row_max[r], row_sum[r] = _softmax_unnormalised(row[a:b])
    _weighted_values(s, vs, acc)


@njit(fastmath=FAST, nogil=True, cache=True)
def attend_rows(q, k, v, sq, causal, offset, window, bounds, tasks, acc, row_max, row_sum):  # type: ignore[no-untyped-def]
    """Unnormalised attention of ``q [L, R, D]`` over ``k [L, T, D]``, ``v [L, T, E]`` for the given ``tasks`` (``head * C + slice``).

    ``bounds [C + 1]`` splits the keys into ``C`` slices (flash-decoding).  Row
    ``r`` is query ``i = r % sq``; with ``causal`` it sees keys
    ``j <= i + offset`` and, when ``window > 0``, ``j > i + offset - window``.
    Writes ``acc[c, l] = sum_j exp(s_rj - m_r) v_j`` over slice ``c``,
    ``row_max[c, l, r] = m_r`` (``-inf`` for a row that sees none of its keys)
    and ``row_sum[c, l, r]``.  ``nogil``: the caller runs disjoint task lists
    on its own threads.
    """
    rows = q.shape[1]
    slices = bounds.size - 1
    widest = 1
    for c in range(slices):
        widest = max(widest, bounds[c + 1] - bounds[c])
    s = np.empty((rows, widest), np.float32)
    for task in tasks:
        head = task // slices
        c = task % slices
        lo, hi = bounds[c], bounds[c + 1]
        _attend_head(q[head], k[head], v[head], sq, causal, offset, window, lo, hi, s, acc[c, head], row_max[c, head], row_sum[c, head])
