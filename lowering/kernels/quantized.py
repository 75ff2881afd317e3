"""The NumPy backend's products with packed weights (:class:`graphc.quantized.QuantizedMatMul`), never widening the
whole weight.

- A few rows of activations (decode: at most :data:`COMPILED_MAX_ROWS`) with numba installed: the compiled kernel
  (:func:`lowering.kernels._numba_linear.nbits_rows`) reads the packed bytes, unpacking each value in a register, on
  graphc's threads; the weight is read in its own 4 or 8 bits a value.
- Otherwise (prefill, or no numba): blocks of weight rows are dequantized to float32 on graphc's threads, one
  cache-sized block per thread at a time, each multiplied by single-threaded BLAS; no float32 copy of the whole
  weight exists at any time.

Both equal the reference semantics (dequantize, then multiply) up to the order of the float32 sums.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from graphc.quantized import QuantizedMatMul, block_zero_points, dequantize_blocks, zero_point_rows

from .compiled import _loaded_kernels, use_compiled
from .softmax import default_threads, run_blocks

__all__ = ["quantized_matmul", "COMPILED_MAX_ROWS"]

COMPILED_MAX_ROWS = 16
"""Rows of activations up to which the compiled kernel runs; above, blocked dequantization + BLAS wins."""

BYTES_PER_THREAD = 1 << 20
"""Packed weight bytes per extra thread of the compiled kernel (it is bound by unpacking, not by memory)."""

_BLOCK_BYTES = 2 << 20
"""float32 bytes of one dequantized block of weight rows."""


def quantized_matmul(op: QuantizedMatMul, a: Sequence[np.ndarray], dims: Mapping[str, int], threads: int | None) -> tuple[np.ndarray, ...]:
    """The NumPy backend's kernel for ``QuantizedMatMul`` (see the module doc)."""
    x, packed, scales = a[0], np.ascontiguousarray(a[1]), np.asarray(a[2])
    zero_points = a[3] if len(a) == 4 else None
    n, blocks, _ = packed.shape
    rows = x.reshape(-1, op.k).astype(np.float32, copy=False)
    if rows.shape[0] <= COMPILED_MAX_ROWS and use_compiled():
        out = _compiled(rows, packed, scales, zero_points, op, threads)
    else:
        out = _blocked(rows, packed, scales, zero_points, op, threads)
    return (out.reshape(*x.shape[:-1], n).astype(x.dtype, copy=False),)


_PREPARED: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray, np.ndarray]] = {}
"""id(packed weight) -> (the weight, its scales as float32 [N, blocks], scale times zero point): made once a weight."""


def _prepared(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """A weight's float32 scales and scaled zero points ``[N, blocks]``, kept while the weight lives."""
    hit = _PREPARED.get(id(packed))
    if hit is not None and hit[0]() is packed:
        return hit[1], hit[2]
    n, blocks, _ = packed.shape
    scales32 = np.ascontiguousarray(np.asarray(scales, np.float32).reshape(n, blocks))
    scaled_zeros = np.ascontiguousarray(scales32 * block_zero_points(zero_points, n, blocks, bits))
    key = id(packed)

    def forget(_: object) -> None:
        _PREPARED.pop(key, None)

    try:
        ref = weakref.ref(packed, forget)
    except TypeError:  # a view that does not take weak references: prepared per call
        return scales32, scaled_zeros
    _PREPARED[key] = (ref, scales32, scaled_zeros)
    return scales32, scaled_zeros


def _compiled(
    x: np.ndarray, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, op: QuantizedMatMul, threads: int | None
) -> np.ndarray:
    n, blocks, blob = packed.shape
    m = x.shape[0]
    padded = np.zeros((m, blocks * op.block_size), np.float32)
    padded[:, : op.k] = x
    xsum = padded.reshape(m, blocks, op.block_size).sum(axis=-1)
    scales32, scaled_zeros = _prepared(packed, scales, zero_points, op.bits)
    flat = packed.reshape(n, blocks * blob)
    out = np.empty((m, n), np.float32)
    kern = _loaded_kernels()
    workers = min(threads or default_threads(), 1 + packed.nbytes // BYTES_PER_THREAD)
    step = max(4, -(-n // (4 * workers)))
    if op.bits == 4:  # each byte's low nibble meets x's even columns, its high nibble the odd ones
        pairs = padded.reshape(m, blocks * blob, 2)
        x_lo, x_hi = np.ascontiguousarray(pairs[..., 0]), np.ascontiguousarray(pairs[..., 1])

        def rows(n0: int) -> None:
            kern.nbits_rows(x_lo, x_hi, xsum, flat, scales32, scaled_zeros, n0, min(n, n0 + step), out)

    else:

        def rows(n0: int) -> None:
            kern.bytes_rows(padded, xsum, flat, scales32, scaled_zeros, n0, min(n, n0 + step), out)

    run_blocks(rows, range(0, n, step), workers)
    return out


def _blocked(
    x: np.ndarray, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, op: QuantizedMatMul, threads: int | None
) -> np.ndarray:
    n, blocks, _ = packed.shape
    scales2 = np.asarray(scales).reshape(n, blocks)
    zeros2 = None if zero_points is None else zero_point_rows(zero_points, n, blocks)
    out = np.empty((x.shape[0], n), np.float32)
    step = max(1, _BLOCK_BYTES // (4 * op.k))

    def block(n0: int) -> None:
        n1 = min(n, n0 + step)
        w = dequantize_blocks(packed[n0:n1], scales2[n0:n1], None if zeros2 is None else zeros2[n0:n1], op.bits, op.block_size, op.k)
        out[:, n0:n1] = x @ w.astype(np.float32, copy=False).T

    run_blocks(block, range(0, n, step), threads, pin_blas=True, key=("dequantized matmul", x.shape, packed.shape, x.dtype.str))
    return out
