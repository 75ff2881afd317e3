"""numba kernels behind :mod:`lowering.kernels.compiled` (imported only when numba is installed).

Three compiled functions:

- :func:`attend_rows` (``nogil``, called on graphc's thread pool with a share
  of the KV heads and key slices each: numba's own threading layers spun
  against OpenBLAS's threads, and decode calls made after a GEMM took 4-15 ms
  instead of 1): attention of a few query rows per KV head (decode, short
  chunks), streaming ``K`` and ``V`` once for all the rows of a KV head, in
  blocks of :data:`KEY_BLOCK` keys with an online softmax (one block's
  scores stay in L1, and the scratch does not grow with the cache).  Scores
  four query rows x four keys at a time (:func:`_scores_4x4_simd`), values
  four rows x 64 columns (:func:`_values_4x64_simd`); the next rows of
  ``K``/``V`` are prefetched a fixed distance ahead.  The
  softmax is left unnormalised: each slice returns its row maxima, sums and
  ``V`` accumulators, and the caller merges slices (split keys) and divides.
- :func:`spin_until` (``nogil``): a bounded busy wait on a shared counter,
  with which graphc's helper threads (:mod:`lowering.kernels.crew`) pick up the next
  call's blocks without being woken by the kernel.
- :func:`exp_rows` (``nogil``, called from the prefill blocks' threads):
  ``s <- exp(s - rowmax)`` in place with the row sums, in one
  pass after the max (NumPy takes five: max, isfinite, subtract, exp, sum).

``exp`` is :func:`_exp_neg`, a range-reduced polynomial (Cephes' ``expf``
coefficients) that LLVM vectorises: relative error below 3e-7 on [-87, 0]
(tested against float64), exactly 0 below -87.3 and for ``-inf``, NaN for NaN.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["attend_rows", "exp_rows", "spin_until"]

FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}
"""LLVM's fast-math flags less ``nnan`` and ``ninf``: sums may be reordered (vectorised), but ``-inf`` (masked keys) stays meaningful."""

PREFETCH_ROWS = 16
"""Key rows prefetched ahead of the one being read (8 KiB at head_dim 128).

Cache-cold, in one process, 8, 16 and 24 rows read alike, and without the
prefetch 8 query rows per KV head read 18% slower.  (Such comparisons load
each variant as its own module, and at batch 1 the module loaded last read
up to 25% faster whatever it held: only differences that hold in both load
orders count.)
"""

KEY_BLOCK = 1024
"""Keys per block of the online softmax in :func:`attend_rows`: the block's scores stay in L1 at up to 8 query rows."""


_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_V16 = ir.VectorType(_F32, 16)


def _emit_prefetch(builder, ptr):
    """``llvm.prefetch`` (read, keep in all cache levels) of the line holding ``ptr``; never faults."""
    byte_ptr = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, _I32, _I32, _I32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, byte_ptr), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _emit_fma(builder, a, b, acc_ptr):
    """``*acc_ptr = a * b + *acc_ptr`` on ``<16 x float>`` (``llvm.fma``)."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3), "llvm.fma.v16f32")
    builder.store(builder.call(fma, [a, b, builder.load(acc_ptr)]), acc_ptr)


def _zeroed_accumulators(builder, count):
    """``count`` stack slots of ``<16 x float>`` zeros (promoted to registers by LLVM)."""
    zero = ir.Constant(_V16, [ir.Constant(_F32, 0.0)] * 16)
    return [cgutils.alloca_once_value(builder, zero) for _ in range(count)]


def _load16(builder, ptr):
    """A ``<16 x float>`` load from a ``float*`` (4-byte aligned)."""
    return builder.load(builder.bitcast(ptr, _V16.as_pointer()), align=4)


@intrinsic
def _prefetch(typingctx, arr, index):
    """``llvm.prefetch`` (read, keep in all cache levels) of ``arr.ravel()[index]``; never faults."""
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        _emit_prefetch(builder, builder.gep(array.data, [args[1]]))
        return context.get_dummy_value()

    return sig, codegen


def _pairwise_sums(builder, x, y, lo, hi):
    """``shuffle(x, y, lo) + shuffle(x, y, hi)``: one level of the transposing reduction tree."""
    pick = [builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 16), [ir.Constant(_I32, m) for m in mask])) for mask in (lo, hi)]
    return builder.fadd(pick[0], pick[1])


_TREE = (
    (list(range(0, 8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))),
    ([a + b for a in (0, 8, 16, 24) for b in range(4)], [a + b for a in (4, 12, 20, 28) for b in range(4)]),
    ([a + b for a in range(0, 32, 4) for b in (0, 1)], [a + b for a in range(0, 32, 4) for b in (2, 3)]),
    (list(range(0, 32, 2)), list(range(1, 32, 2))),
)
"""Shuffle masks of the four levels that turn 16 vectors of partial sums into one vector of their 16 totals, in order."""


@intrinsic
def _scores_4x4_simd(typingctx, q, k, s, r, j, c, prefetch):
    """``s[r + a, c + b] = q[r + a] . k[j + b]`` for ``a, b`` in 0..3, written in LLVM vector IR (head_dim a multiple of 16).

    Sixteen ``<16 x float>`` accumulators over the head dimension, then one
    transposing reduction tree (four levels of shuffles and adds, 45
    instructions) instead of sixteen separate horizontal sums (eight
    instructions each, as LLVM vectorises the scalar loop).  With
    ``prefetch``, each step over the head dimension also prefetches the same
    columns of the four keys :data:`PREFETCH_ROWS` ahead: the prefetches are
    spread over the block's arithmetic instead of issued as one burst.
    """
    if q.layout != "C" or k.layout != "C":  # rows are addressed as row * head_dim
        return None
    sig = types.void(q, k, s, types.intp, types.intp, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        qa, ka, sa = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3]))
        r, j, c, prefetch = args[3:]
        intp = context.get_value_type(types.intp)
        d_len = cgutils.unpack_tuple(builder, qa.shape, 2)[1]
        ahead = builder.add(j, ir.Constant(intp, PREFETCH_ROWS + 3))
        prefetch = builder.and_(prefetch, builder.icmp_signed("<", ahead, cgutils.unpack_tuple(builder, ka.shape, 2)[0]))
        far = [builder.gep(ka.data, [builder.mul(builder.add(j, ir.Constant(intp, PREFETCH_ROWS + b)), d_len)]) for b in range(4)]
        s_row = builder.sdiv(cgutils.unpack_tuple(builder, sa.strides, 2)[0], ir.Constant(intp, 4))
        q_rows = [builder.gep(qa.data, [builder.mul(builder.add(r, ir.Constant(intp, a)), d_len)]) for a in range(4)]
        k_rows = [builder.gep(ka.data, [builder.mul(builder.add(j, ir.Constant(intp, b)), d_len)]) for b in range(4)]
        accs = _zeroed_accumulators(builder, 16)
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), d_len, ir.Constant(intp, 16), intp=intp) as (d, _):
            with builder.if_then(prefetch, likely=True):
                for p in far:
                    _emit_prefetch(builder, builder.gep(p, [d]))
            kv = [_load16(builder, builder.gep(p, [d])) for p in k_rows]
            for a in range(4):
                qv = _load16(builder, builder.gep(q_rows[a], [d]))
                for b in range(4):
                    _emit_fma(builder, qv, kv[b], accs[4 * a + b])
        level = [builder.load(p) for p in accs]
        for lo, hi in _TREE:
            level = [_pairwise_sums(builder, level[i], level[i + 1], lo, hi) for i in range(0, len(level), 2)]
        totals = level[0]
        v4p = ir.VectorType(_F32, 4).as_pointer()
        for a in range(4):
            row = builder.shuffle_vector(totals, totals, ir.Constant(ir.VectorType(_I32, 4), [ir.Constant(_I32, 4 * a + b) for b in range(4)]))
            at = builder.add(builder.mul(builder.add(r, ir.Constant(intp, a)), s_row), c)
            builder.store(row, builder.bitcast(builder.gep(sa.data, [at]), v4p), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _values_4x64_simd(typingctx, p, v, out, r, e0, prefetch):
    """``out[r + a, e0 : e0 + 64] = sum_j p[r + a, j] v[j, e0 : e0 + 64]`` for ``a`` in 0..3 over all keys of ``v``, in LLVM vector IR.

    Sixteen ``<16 x float>`` accumulators stay in registers over the keys (the
    NumPy-level loop kept its accumulator rows in memory: a load and a store
    per four FMAs); each key's four ``V`` vectors feed four rows.  With
    ``prefetch``, the ``V`` row :data:`PREFETCH_ROWS` ahead is prefetched
    (the first column block of a pass; later ones read it from cache).
    """
    if v.layout != "C":  # rows are addressed as key * value width
        return None
    sig = types.void(p, v, out, types.intp, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        pa, va, oa = (context.make_array(t)(context, builder, x) for t, x in zip(signature.args[:3], args[:3]))
        r, e0, prefetch = args[3:]
        intp = context.get_value_type(types.intp)
        p_row = builder.sdiv(cgutils.unpack_tuple(builder, pa.strides, 2)[0], ir.Constant(intp, 4))
        o_row = builder.sdiv(cgutils.unpack_tuple(builder, oa.strides, 2)[0], ir.Constant(intp, 4))
        keys, e_len = cgutils.unpack_tuple(builder, va.shape, 2)
        p_rows = [builder.gep(pa.data, [builder.mul(builder.add(r, ir.Constant(intp, a)), p_row)]) for a in range(4)]
        accs = _zeroed_accumulators(builder, 16)
        splat = ir.Constant(ir.VectorType(_I32, 16), [ir.Constant(_I32, 0)] * 16)
        undef = ir.Constant(_V16, ir.Undefined)
        with cgutils.for_range(builder, keys, intp=intp) as loop:
            j = loop.index
            row = builder.gep(va.data, [builder.add(builder.mul(j, e_len), e0)])
            ahead = builder.add(j, ir.Constant(intp, PREFETCH_ROWS))
            with builder.if_then(builder.and_(prefetch, builder.icmp_signed("<", ahead, keys)), likely=True):
                base = builder.gep(va.data, [builder.mul(ahead, e_len)])
                with cgutils.for_range_slice(builder, ir.Constant(intp, 0), e_len, ir.Constant(intp, 16), intp=intp) as (c, _):
                    _emit_prefetch(builder, builder.gep(base, [c]))
            vv = [_load16(builder, builder.gep(row, [ir.Constant(intp, 16 * c)])) for c in range(4)]
            for a in range(4):
                weight = builder.load(builder.gep(p_rows[a], [j]))
                wv = builder.shuffle_vector(builder.insert_element(undef, weight, ir.Constant(_I32, 0)), undef, splat)
                for c in range(4):
                    _emit_fma(builder, wv, vv[c], accs[4 * a + c])
        for a in range(4):
            dst = builder.gep(oa.data, [builder.add(builder.mul(builder.add(r, ir.Constant(intp, a)), o_row), e0)])
            for c in range(4):
                column = builder.bitcast(builder.gep(dst, [ir.Constant(intp, 16 * c)]), _V16.as_pointer())
                builder.store(builder.load(accs[4 * a + c]), column, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=FAST, inline="always", cache=True)
def _prefetch_ahead(flat, row, row_len):
    """Prefetch the four rows :data:`PREFETCH_ROWS` after ``row`` (rows of ``row_len`` in ``flat``), one 64-byte line at a time."""
    base = (row + PREFETCH_ROWS) * row_len
    if base + 4 * row_len <= flat.size:
        for c in range(0, 4 * row_len, 16):
            _prefetch(flat, base + c)


@njit(fastmath=FAST, inline="always", cache=True)
def _exp_neg(x):
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
def _scores(q, k, s):
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
    simd = d_len % 16 == 0
    spread = simd and r4 > 0  # the first 4x4 block of each step prefetches, spread over its arithmetic
    for j in range(0, j4, 4):
        if not spread:
            _prefetch_ahead(kf, j, d_len)
        k0 = k[j]
        k1 = k[j + 1]
        k2 = k[j + 2]
        k3 = k[j + 3]
        c = j
        for r in range(0, r4, 4):
            if simd:
                _scores_4x4_simd(q, k, s, r, j, c, r == 0)
            else:
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
def _scores_4x4(q0, q1, q2, q3, k0, k1, k2, k3, out):
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
def _weighted_values(p, v, acc):
    """``acc[r] = sum_j p[r, j] v[j]`` over every key of ``v`` (a slice indexed from 0, as in :func:`_scores`), prefetching ahead.

    Rows four at a time: with the value width a multiple of 64, in 64-column
    blocks held in registers (:func:`_values_4x64_simd`); otherwise into
    fresh accumulator rows (LLVM then sees they alias neither ``V`` nor ``p``),
    each ``V`` load feeding four rows.  Then the leftover rows.
    """
    rows, e_len = acc.shape
    vf = v.ravel()
    r4 = rows // 4 * 4
    if e_len % 64 == 0:
        for r in range(0, r4, 4):
            for e0 in range(0, e_len, 64):
                _values_4x64_simd(p, v, acc, r, e0, r == 0 and e0 == 0)
    else:
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
def _values_4_rows(p, v, vf, c0, c1, c2, c3):
    """``c_a += sum_j p[a, j] v[j]`` for four rows ``a``, four keys per step, prefetching ahead in ``vf`` (``v`` flat)."""
    e_len = c0.size
    j4 = v.shape[0] // 4 * 4
    for j in range(0, j4, 4):
        _prefetch_ahead(vf, j, e_len)
        v0 = v[j]
        v1 = v[j + 1]
        v2 = v[j + 2]
        v3 = v[j + 3]
        p00, p01, p02, p03 = p[0, j], p[0, j + 1], p[0, j + 2], p[0, j + 3]
        p10, p11, p12, p13 = p[1, j], p[1, j + 1], p[1, j + 2], p[1, j + 3]
        p20, p21, p22, p23 = p[2, j], p[2, j + 1], p[2, j + 2], p[2, j + 3]
        p30, p31, p32, p33 = p[3, j], p[3, j + 1], p[3, j + 2], p[3, j + 3]
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
        for e in range(e_len):
            x0 = v[j, e]
            c0[e] += p[0, j] * x0
            c1[e] += p[1, j] * x0
            c2[e] += p[2, j] * x0
            c3[e] += p[3, j] * x0


@njit(fastmath=FAST, inline="always", cache=True)
def _values_1_row(p, v, vf, c0):
    """``c0 += sum_j p[j] v[j]``, four keys per step, prefetching ahead in ``vf`` (``v`` flat)."""
    e_len = c0.size
    j4 = v.shape[0] // 4 * 4
    for j in range(0, j4, 4):
        _prefetch_ahead(vf, j, e_len)
        p0, p1, p2, p3 = p[j], p[j + 1], p[j + 2], p[j + 3]
        for e in range(e_len):
            c0[e] += (p0 * v[j, e] + p1 * v[j + 1, e]) + (p2 * v[j + 2, e] + p3 * v[j + 3, e])
    for j in range(j4, v.shape[0]):
        pj = p[j]
        for e in range(e_len):
            c0[e] += pj * v[j, e]


@njit(fastmath=FAST, inline="always", cache=True)
def _row_max(x):
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
def _softmax_unnormalised(x):
    """``x <- exp(x - max(x))`` in place; returns ``(max, sum)``.

    When no entry is above ``-inf`` the max is ``-inf``, the ``-inf`` entries
    become 0 and NaN ones stay NaN: the sum is 0, or NaN when ``x`` has a NaN.
    """
    m = _row_max(x)
    if m == np.float32(-np.inf):
        t = np.float32(0.0)
        for j in range(x.size):
            y = np.float32(0.0) if x[j] == np.float32(-np.inf) else x[j]
            x[j] = y
            t += y
        return m, t
    t = np.float32(0.0)
    for j in range(x.size):
        e = _exp_neg(x[j] - m)
        x[j] = e
        t += e
    return m, t


@njit(fastmath=FAST, nogil=True, cache=True)
def exp_rows(s, totals):
    """``s[r] <- exp(s[r] - max(s[r]))`` in place for every row of the 2-D ``s``; ``totals[r]`` the row sum (rows all ``-inf``: zeros, sum 1)."""
    for r in range(s.shape[0]):
        m, t = _softmax_unnormalised(s[r])
        totals[r] = t if m != np.float32(-np.inf) or t != t else np.float32(1.0)


@njit(fastmath=FAST, inline="always", cache=True)
def _attend_head(q, k, v, sq, key_lo, key_hi, key_start, key_stop, s, part, acc, row_max, row_sum):
    """One KV head's slice of :func:`attend_rows`: ``q [R, D]``, ``k [T, D]``, ``v [T, E]`` into ``acc [R, E]``, ``row_max``/``row_sum [R]``.

    Keys in blocks of :data:`KEY_BLOCK` (``s [R, >= block]`` and ``part [R, E]``
    are scratch): each block's scores, their exp against the block's row
    maxima, then the running maxima, sums and ``acc`` rescaled to whichever
    maximum is larger, and the block's ``P V`` added.
    """
    rows, e_len = acc.shape
    acc[:] = 0
    row_max[:] = -np.inf
    row_sum[:] = 0
    for b0 in range(key_start, key_stop, KEY_BLOCK):
        b1 = min(b0 + KEY_BLOCK, key_stop)
        width = b1 - b0
        _scores(q, k[b0:b1], s)  # a slice indexed from 0: with a runtime start offset the loops ran 1.4x slower
        for r in range(rows):
            lo = max(b0, key_lo[r % sq])
            hi = min(b1, key_hi[r % sq])
            row = s[r, :width]
            a = min(max(lo - b0, 0), width)
            b = max(min(hi - b0, width), a)
            row[:a] = 0
            row[b:] = 0
            m, t = _softmax_unnormalised(row[a:b])
            _merge_block_row(acc[r], row[a:b], row_max, row_sum, r, m, t)
        _weighted_values(s[:, :width], v[b0:b1], part)
        acc += part


@njit(fastmath=FAST, inline="always", cache=True)
def _merge_block_row(acc_row, p, row_max, row_sum, r, m, t):
    """Fold a block's row (``p = exp(s - m)``, sum ``t``) into row ``r``'s running max and sum, rescaling ``acc_row`` or ``p`` to the larger max."""
    old = row_max[r]
    if m == np.float32(-np.inf):  # no key of this block is visible (t is 0, or NaN from a NaN score)
        row_sum[r] += t
    elif m > old:
        scale = _exp_neg(old - m)
        acc_row *= scale
        row_sum[r] = row_sum[r] * scale + t
        row_max[r] = m
    else:
        scale = _exp_neg(m - old)
        p *= scale
        row_sum[r] += t * scale


@njit(fastmath=FAST, nogil=True, cache=True)
def attend_rows(q, k, v, sq, key_lo, key_hi, bounds, tasks, acc, row_max, row_sum):
    """Unnormalised attention of ``q [L, R, D]`` over ``k [L, T, D]``, ``v [L, T, E]`` for the given ``tasks`` (``head * C + slice``).

    ``bounds [C + 1]`` splits the keys into ``C`` slices (flash-decoding).  Row
    ``r`` is query ``i = r % sq``; it sees keys ``key_lo[i] <= j < key_hi[i]`` (int64 ``[sq]``, the
    visibility's key ranges).
    Writes ``acc[c, l] = sum_j exp(s_rj - m_r) v_j`` over slice ``c``,
    ``row_max[c, l, r] = m_r`` (``-inf`` for a row that sees none of its keys)
    and ``row_sum[c, l, r]``.  ``nogil``: the caller runs disjoint task lists
    on its own threads.
    """
    rows = q.shape[1]
    slices = bounds.size - 1
    s = np.empty((rows, KEY_BLOCK), np.float32)
    part = np.empty((rows, v.shape[2]), np.float32)
    for task in tasks:
        head = task // slices
        c = task % slices
        lo, hi = bounds[c], bounds[c + 1]
        _attend_head(q[head], k[head], v[head], sq, key_lo, key_hi, lo, hi, s, part, acc[c, head], row_max[c, head], row_sum[c, head])


@intrinsic
def _load_acquire(typingctx, counters, index):
    """``counters[index]`` (int64) read with acquire ordering: re-read on every call, never hoisted out of a loop."""
    sig = types.int64(counters, index)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(array.data, [args[1]]), "acquire", 8)

    return sig, codegen


@njit(nogil=True, cache=True)
def spin_until(counters, index, target, reads):
    """Read ``counters[index]`` until it reaches ``target`` or ``reads`` reads were made (about 0.2 ns each); returns the last value read."""
    value = _load_acquire(counters, index)
    n = 0
    while value < target and n < reads:
        value = _load_acquire(counters, index)
        n += 1
    return value
