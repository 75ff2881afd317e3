"""numba kernel behind :func:`lowering.kernels.compiled.bf16_matmul` (imported only when numba is installed).

:func:`bf16_rows` computes ``out[m, n] = sum_k x[m, k] * w[n, k]`` for rows
``n0 <= n < n1`` of a bfloat16 weight read as its raw ``uint16`` bits:
each weight element becomes float32 in a register (its bits shifted left by
16, :func:`bf16_bits`), so the weight is read once, in its own 2 bytes an
element, and no float32 copy of it exists anywhere.  Four weight rows share
each load of ``x``; LLVM vectorises the ``k`` loop (fast-math reassociation).
``nogil``: graphc's thread pool runs shares of the rows side by side.

Measured on 2 cores (AVX-512 Xeon), a 5632 x 2048 weight, cycling through
more weights than the cache holds: 1.95 ms at one row of ``x`` where
float32 BLAS takes 2.19 ms on the float32 copy (twice the bytes), and
2.94 ms against 8.02 ms at four rows (BLAS's GEMM path packs the weight).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["bf16_rows", "nbits_rows", "bytes_rows"]

FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}
"""Fast-math less ``nnan``/``ninf``, as in :mod:`lowering.kernels._numba_attention`: sums may be reordered, inf/NaN keep their meaning."""


@intrinsic
def bf16_bits(typingctx, bits):
    """The float32 whose upper 16 bits are ``bits`` (a bfloat16's bit pattern), lower bits zero: exact."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return sig, codegen


@njit(fastmath=FAST, nogil=True, cache=True)
def bf16_rows(x, w, n0, n1, out):
    """``out[:, n0:n1] = x @ float32(w[n0:n1]).T`` for ``x [M, K]`` float32, ``w [N, K]`` uint16 (bfloat16 bits), ``out [M, N]`` float32."""
    m_rows, k_len = x.shape
    n = n0
    while n + 4 <= n1:
        for m in range(m_rows):
            a0 = np.float32(0)
            a1 = np.float32(0)
            a2 = np.float32(0)
            a3 = np.float32(0)
            for k in range(k_len):
                xv = x[m, k]
                a0 += xv * bf16_bits(w[n, k])
                a1 += xv * bf16_bits(w[n + 1, k])
                a2 += xv * bf16_bits(w[n + 2, k])
                a3 += xv * bf16_bits(w[n + 3, k])
            out[m, n] = a0
            out[m, n + 1] = a1
            out[m, n + 2] = a2
            out[m, n + 3] = a3
        n += 4
    while n < n1:
        for m in range(m_rows):
            a0 = np.float32(0)
            for k in range(k_len):
                a0 += x[m, k] * bf16_bits(w[n, k])
            out[m, n] = a0
        n += 1


@njit(fastmath=FAST, nogil=True, cache=True)
def nbits_rows(x_lo, x_hi, xsum, packed, scales, zeros, n0, n1, out):
    """``out[:, n0:n1] = x @ W[n0:n1].T`` for a 4-bit ``W`` in ``MatMulNBits``' layout, read packed.

    ``packed [N, blocks * blob]`` uint8, ``scales [N, blocks]`` and ``zeros`` (each block's scale times its zero point)
    float32; ``xsum [M, blocks]`` the sums of ``x`` per block; ``x_lo``/``x_hi [M, blocks * blob]`` the values of ``x``
    that meet each byte's low and high nibble (``x``'s even and odd columns, ``K`` padded with zeros), so both stream
    contiguously beside the bytes.  Each block contributes ``scale * sum_j x_j q_j - scale * zero * sum_j x_j``, the
    values unpacked in registers.  A twin of :func:`bytes_rows` rather than one kernel with a branch on the bit width:
    a branch in the inner loop keeps LLVM from vectorising it (measured: 2.5 ms against 1.0 ms on a 4864 x 896 weight)."""
    m_rows = x_lo.shape[0]
    blocks = scales.shape[1]
    blob = packed.shape[1] // blocks
    for n in range(n0, n1):
        for m in range(m_rows):
            total = np.float32(0)
            for b in range(blocks):
                base = b * blob
                acc = np.float32(0)
                for j in range(blob):
                    byte = np.int32(packed[n, base + j])
                    acc += x_lo[m, base + j] * np.float32(byte & 15) + x_hi[m, base + j] * np.float32(byte >> 4)
                total += scales[n, b] * acc - zeros[n, b] * xsum[m, b]
            out[m, n] = total


@njit(fastmath=FAST, nogil=True, cache=True)
def bytes_rows(x, xsum, packed, scales, zeros, n0, n1, out):
    """:func:`nbits_rows` for an 8-bit ``W`` (``x [M, blocks * blob]`` padded, a byte a value)."""
    m_rows = x.shape[0]
    blocks = scales.shape[1]
    blob = packed.shape[1] // blocks
    for n in range(n0, n1):
        for m in range(m_rows):
            total = np.float32(0)
            for b in range(blocks):
                base = b * blob
                acc = np.float32(0)
                for j in range(blob):
                    acc += x[m, base + j] * np.float32(np.int32(packed[n, base + j]))
                total += scales[n, b] * acc - zeros[n, b] * xsum[m, b]
            out[m, n] = total
