"""Linear layers and embeddings over bfloat16/float16 weights, without a float32 copy of the weights.

A low-precision graph reads each weight through a ``Cast`` to float32.  Run
once at build time, those casts would hold a float32 copy of every weight:
twice a bfloat16 checkpoint's bytes resident, and twice its bytes read per
decoded token.  The NumPy interpreter instead keeps such a weight as a
:class:`StoredWeight` (the checkpoint's own array, memory-mapped) when every
reader of the cast is

- an einsum that uses it as a linear layer's matrix (``bsm,nm->bsn``: a 2-D
  weight whose first label is kept and whose second is contracted), run by
  :func:`contract_stored`, or
- a ``Gather`` of its rows (an embedding table), run by :meth:`StoredWeight.take`.

:func:`contract_stored` widens the weight as it reads it: for a few rows of
activations (decode), bfloat16 goes through the compiled kernel
(:func:`lowering.kernels.compiled.bf16_matmul`), which reads the weight's own 2 bytes
an element; otherwise (prefill, float16, or without numba) blocks of weight
rows are converted to float32 on graphc's threads, one cache-sized block per
thread at a time, each multiplied with single-threaded BLAS.  The results are
those of the float32 copy up to the order of the float32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from graphc.einsum_spec import EinsumSpec
from graphc.ops import Einsum
from graphc.tensor_ops import Gather

from .compiled import bf16_matmul, use_compiled
from .bf16_gemm import MIN_ROWS, bf16_gemm_description, bf16_linear
from .softmax import default_threads, run_blocks

__all__ = ["StoredWeight", "LOW_PRECISION", "MIN_STORED_BYTES", "COMPILED_MAX_ROWS", "stored_operand", "contract_stored", "keeps_stored"]

LOW_PRECISION = ("bfloat16", "float16")
"""Stored dtypes kept as they are (computed in float32)."""

MIN_STORED_BYTES = 1 << 20
"""Smaller weights are converted once at build time (their float32 copy costs little, and a GEMM on it less)."""

COMPILED_MAX_ROWS = 16
"""Rows of activations up to which a bfloat16 linear layer runs in the compiled kernel; above, blocked conversion + BLAS wins."""

_BLOCK_BYTES = 2 << 20
"""float32 bytes of one converted block of weight rows (fits a core's share of the cache beside its GEMM)."""


@dataclass(frozen=True, eq=False)
class StoredWeight:
    """A 2-D weight kept in its stored low precision (``[N, K]``, C-contiguous), read as float32."""

    stored: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape."""
        return tuple(self.stored.shape)

    def rows(self, n0: int, n1: int) -> np.ndarray:
        """Rows ``n0:n1`` as a new float32 array."""
        block = self.stored[n0:n1]
        if block.dtype.name == "bfloat16":  # its bits shifted into a float32's upper half: exact, and 2x faster than ml_dtypes' cast
            return np.left_shift(block.view(np.uint16).astype(np.uint32), 16).view(np.float32)
        return block.astype(np.float32)

    def take(self, gather: Gather, indices: np.ndarray) -> np.ndarray:
        """``float32(stored)[indices]``: an embedding lookup by ``gather``'s own semantics on the stored rows, then widened."""
        return gather.evaluate([self.stored, indices], {}).astype(np.float32)


def stored_operand(spec: EinsumSpec, position: int) -> bool:
    """True when operand ``position`` of the two-operand ``spec`` is a linear layer's ``[kept, contracted]`` matrix."""
    if len(spec.inputs) != 2 or len(spec.inputs[position]) != 2:
        return False
    kept, summed = spec.inputs[position][0], spec.inputs[position][1]
    other = spec.inputs[1 - position]
    if kept == summed or kept not in spec.output or kept in other:
        return False
    return summed in other and summed not in spec.output and set(other) <= set(spec.output) | {summed}


def keeps_stored(reader: Any, value: str) -> bool:
    """True when ``reader`` (a node) can read ``value`` as a :class:`StoredWeight`: a linear einsum's matrix or a Gather's table."""
    op = reader.op
    if isinstance(op, Gather):
        return op.axis == 0 and reader.inputs[0] == value and reader.inputs[1] != value
    if not isinstance(op, Einsum) or len(reader.inputs) != 2 or reader.inputs[0] == reader.inputs[1]:
        return False
    return stored_operand(op.parsed, reader.inputs.index(value))


def contract_stored(spec: EinsumSpec, operands: list[Any], threads: int | None) -> np.ndarray:
    """The two-operand einsum ``spec`` where one operand is a :class:`StoredWeight` used as a linear layer's matrix."""
    p = 0 if isinstance(operands[0], StoredWeight) else 1
    weight: StoredWeight = operands[p]
    x = np.asarray(operands[1 - p], np.float32)
    kept, summed = spec.inputs[p][0], spec.inputs[p][1]
    labels = spec.inputs[1 - p]
    others = [c for c in labels if c != summed]
    xt = x.transpose([labels.index(c) for c in others] + [labels.index(summed)])
    lead = xt.shape[:-1]
    x2 = np.ascontiguousarray(xt.reshape(-1, xt.shape[-1]))
    y = stored_matmul(x2, weight, threads).reshape(*lead, weight.shape[0])
    order = others + [kept]
    return y.transpose([order.index(c) for c in spec.output])


def stored_matmul(x: np.ndarray, weight: StoredWeight, threads: int | None) -> np.ndarray:
    """``x [M, K] @ float32(weight [N, K]).T`` without a float32 copy of the whole weight."""
    w = weight.stored
    if w.dtype.name == "bfloat16" and x.shape[0] <= COMPILED_MAX_ROWS and use_compiled():
        return bf16_matmul(x, w.view(np.uint16), threads)
    if w.dtype.name == "bfloat16" and x.shape[0] >= MIN_ROWS and bf16_gemm_description() is not None:
        return bf16_linear(x, w, threads)
    rows, k = w.shape
    out = np.empty((rows, x.shape[0]), np.float32)  # transposed: each block writes whole rows
    step = max(16, _BLOCK_BYTES // max(1, 4 * k))
    n = threads or default_threads()

    def block(n0: int) -> None:
        n1 = min(rows, n0 + step)
        np.matmul(weight.rows(n0, n1), x.T, out=out[n0:n1])

    run_blocks(block, range(0, rows, step), n, pin_blas=True, key=("stored matmul", x.shape, w.shape, x.dtype.str, w.dtype.str))
    return out.T
