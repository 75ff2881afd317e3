"""Pairwise contractions as batched GEMMs (transpose-transpose-GEMM-transpose).

:func:`plan_matmul` classifies the labels of a two-operand einsum into batch,
free and contracted groups; the NumPy interpreter and the ONNX exporter both
lower a pairwise einsum through that plan to one batched ``matmul``.  On
attention shapes this is 8-17x faster than unoptimized ``np.einsum`` or plain
``opt_einsum.contract`` on 2 cores.  A grouped einsum such as
``bngqd,bnkd->bngqk`` puts ``g`` and ``q`` side by side as free labels, so the
group axis folds into the GEMM's M dimension without a copy.

With ``threads``, a large unbatched GEMM (a prefill's projections and MLP) is cut into one block of output columns
per thread (the weight's rows, each packed by one block only), BLAS held to one thread inside each
(:func:`~lowering.kernels.softmax.run_blocks`).  Every block packs the activation rows again, so more blocks than
threads cost more than they balance (``benchmarks/profile_model_prefill.py`` times the products; docs/export.md has
its figures with 4 blocks a thread and with one).  A thread slowed by another process on its core is met by the
thread choice instead (the product whole on one thread where that ran faster lately).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import opt_einsum

from graphc.einsum_spec import EinsumSpec, parse_einsum

from .softmax import blas_threads, default_threads, run_blocks
from .thread_choice import shared_choice

__all__ = ["MatmulPlan", "plan_matmul", "contract_pair", "contract", "contraction_order"]


@dataclass(frozen=True)
class MatmulPlan:
    """How ``a,b->out`` runs as ``matmul(A[batch, M, K], B[batch, K, N])``.

    ``swap`` means the einsum's second operand plays the role of A.  Labels only
    in one operand and not in the output (``a_sum``/``b_sum``) are summed first.
    """

    swap: bool
    a_sum: str
    b_sum: str
    batch: str
    a_free: str
    contract: str
    b_free: str
    a_perm: tuple[int, ...]
    b_perm: tuple[int, ...]
    out_perm: tuple[int, ...]

    @property
    def needs_out_transpose(self) -> bool:
        """True when the GEMM result must be permuted to the output order."""
        return self.out_perm != tuple(range(len(self.out_perm)))


def _plan(a: str, b: str, out: str, swap: bool) -> MatmulPlan:
    a_sum = "".join(c for c in a if c not in b and c not in out)
    b_sum = "".join(c for c in b if c not in a and c not in out)
    a_kept = "".join(c for c in a if c not in a_sum)
    b_kept = "".join(c for c in b if c not in b_sum)
    batch = "".join(c for c in out if c in a and c in b)
    a_free = "".join(c for c in out if c in a and c not in b)
    b_free = "".join(c for c in out if c in b and c not in a)
    contract = "".join(c for c in a_kept if c in b and c not in out)
    a_perm = tuple(a_kept.index(c) for c in batch + a_free + contract)
    b_perm = tuple(b_kept.index(c) for c in batch + contract + b_free)
    gemm_out = batch + a_free + b_free
    out_perm = tuple(gemm_out.index(c) for c in out)
    return MatmulPlan(swap, a_sum, b_sum, batch, a_free, contract, b_free, a_perm, b_perm, out_perm)


def plan_matmul(spec: EinsumSpec | str) -> MatmulPlan:
    """Plan a two-operand einsum as one batched GEMM, preferring the order that needs no output transpose."""
    s = parse_einsum(spec) if isinstance(spec, str) else spec
    if len(s.inputs) != 2:
        raise ValueError(f"plan_matmul takes a two-operand einsum, got {s}")
    first = _plan(s.inputs[0], s.inputs[1], s.output, swap=False)
    if not first.needs_out_transpose:
        return first
    second = _plan(s.inputs[1], s.inputs[0], s.output, swap=True)
    return first if second.needs_out_transpose else second


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


BLOCKED_MIN_FLOPS = 1 << 24
"""Multiply-adds from which a GEMM is cut into blocks for graphc's threads (smaller ones run whole on the caller)."""
FEW_ROWS = 16
"""Products of fewer rows (a decode step's) are bound by reading the weight: BLAS's own threads split them best, so
they run on ``threads`` BLAS threads, not in graphc's blocks."""
_BLOCK_COLUMNS = 64
"""The narrowest column block (a k/v projection of 256 columns is still split over the threads)."""


def _matmul(a2: np.ndarray, b2: np.ndarray, threads: int | None) -> np.ndarray:
    """``a2 @ b2`` (2-D, or batched over a leading axis) on ``threads`` threads: column blocks of a 2-D product, batch
    entries of a batched one, wherever the work is large enough (:data:`BLOCKED_MIN_FLOPS`); a product of
    :data:`FEW_ROWS` rows or fewer on ``threads`` BLAS threads.

    A product cut into blocks runs on ``threads`` threads or on the caller alone, whichever ran products of its shape
    faster lately (:func:`~lowering.kernels.thread_choice.shared_choice`, as ``run_blocks`` does with a ``key``)."""
    n = threads or default_threads()
    m, k, cols = a2.shape[-2], a2.shape[-1], b2.shape[-1]
    flops = m * k * cols * (a2.shape[0] if a2.ndim == 3 else 1)
    if a2.ndim == 2 and m <= FEW_ROWS:
        with blas_threads(n):
            return np.matmul(a2, b2)
    if n == 1 or a2.ndim != b2.ndim or a2.ndim not in (2, 3) or flops < BLOCKED_MIN_FLOPS:
        return np.matmul(a2, b2)
    if a2.ndim == 3 and (a2.shape[0] < 2 or a2.shape[0] != b2.shape[0]):
        return np.matmul(a2, b2)
    if a2.ndim == 2 and cols < 2 * _BLOCK_COLUMNS:
        return np.matmul(a2, b2)
    # on one thread, the product whole: BLAS packs the rows once, not once per column block
    key = ("matmul", a2.shape, b2.shape, a2.dtype.str, b2.dtype.str)  # float64 reference products are another kind
    return shared_choice(n).timed(key, lambda t: _blocked_matmul(a2, b2, t) if t > 1 else np.matmul(a2, b2))


def _blocked_matmul(a2: np.ndarray, b2: np.ndarray, n: int) -> np.ndarray:
    """``a2 @ b2`` in blocks on ``n`` threads, BLAS held to one thread in each: batch entries of a 3-D product, blocks
    of output columns of a 2-D one, each written in place in the result."""
    out = np.empty((*a2.shape[:-1], b2.shape[-1]), np.result_type(a2, b2))
    if a2.ndim == 3:

        def entry(i: int) -> None:
            np.matmul(a2[i], b2[i], out=out[i])

        run_blocks(entry, list(range(a2.shape[0])), n, pin_blas=True)
        return out
    cols = b2.shape[-1]
    width = max(_BLOCK_COLUMNS, -(-cols // n))
    starts = list(range(0, cols, width))

    def block(j: int) -> None:
        np.matmul(a2, b2[:, j : j + width], out=out[:, j : j + width])

    run_blocks(block, starts, n, pin_blas=True)
    return out


def contract_pair(spec: EinsumSpec | str, a: np.ndarray, b: np.ndarray, threads: int | None = 1) -> np.ndarray:
    """Evaluate a two-operand einsum with one batched ``np.matmul`` (row blocks on ``threads`` threads where large)."""
    s = parse_einsum(spec) if isinstance(spec, str) else spec
    p = plan_matmul(s)
    ta, tb = s.inputs
    if not p.contract and not p.a_sum and not p.b_sum:
        return _broadcast_product(ta, tb, s.output, a, b)
    if p.swap:
        a, b, ta, tb = b, a, tb, ta
    if p.a_sum:
        a = a.sum(axis=tuple(ta.index(c) for c in p.a_sum))
    if p.b_sum:
        b = b.sum(axis=tuple(tb.index(c) for c in p.b_sum))
    nb, nfa, nc = len(p.batch), len(p.a_free), len(p.contract)
    at = a.transpose(p.a_perm)
    bt = b.transpose(p.b_perm)
    batch_shape = at.shape[:nb]
    a_free_shape = at.shape[nb : nb + nfa]
    b_free_shape = bt.shape[nb + nc :]
    k = _prod(at.shape[nb + nfa :])
    a2 = at.reshape(batch_shape + (_prod(a_free_shape), k))
    b2 = bt.reshape(batch_shape + (k, _prod(b_free_shape)))
    if len(batch_shape) <= 1:
        c = _matmul(a2, b2, threads)
    else:
        entries = _prod(batch_shape)
        c = _matmul(a2.reshape((entries,) + a2.shape[-2:]), b2.reshape((entries,) + b2.shape[-2:]), threads)
    c = c.reshape(batch_shape + a_free_shape + b_free_shape)
    return c.transpose(p.out_perm) if p.needs_out_transpose else c


def _broadcast_product(ta: str, tb: str, out: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a * b`` for an einsum that sums no label (every label of each operand is in the output, none shared by a GEMM's
    inner dimension): a norm's weight or a row's scale, ``abc,c->abc``.  As a GEMM it would be one product of an inner
    dimension 1 per entry of the batch: thousands of tiny products for one elementwise pass."""

    def aligned(x: np.ndarray, labels: str) -> np.ndarray:
        order = [labels.index(c) for c in out if c in labels]
        shape = [x.shape[labels.index(c)] if c in labels else 1 for c in out]
        return x.transpose(order).reshape(shape)

    return np.multiply(aligned(a, ta), aligned(b, tb))


def contraction_order(spec: EinsumSpec | str, shapes: list[tuple[int, ...]], optimize: str = "auto") -> list[tuple[tuple[int, ...], str]]:
    """The pairwise steps opt_einsum picks for ``spec``: ``[(operand positions, step spec), ...]``."""
    s = parse_einsum(spec) if isinstance(spec, str) else spec
    _, info = opt_einsum.contract_path(str(s), *shapes, shapes=True, optimize=optimize)
    return [(tuple(step[0]), step[2]) for step in info.contraction_list]


def contract(spec: EinsumSpec | str, *operands: np.ndarray, optimize: str = "auto", threads: int | None = 1) -> np.ndarray:
    """Evaluate any einsum: one operand with ``np.einsum``, two as a GEMM, more in opt_einsum's order.  ``threads``:
    graphc's threads for a large GEMM's row blocks (``None``: the cores; 1: BLAS's own threads)."""
    s = parse_einsum(spec) if isinstance(spec, str) else spec
    if len(operands) == 1:
        return np.einsum(str(s), operands[0])
    if len(operands) == 2:
        return contract_pair(s, *operands, threads=threads)
    ops = list(operands)
    for positions, step in contraction_order(s, [o.shape for o in ops], optimize):
        args = [ops[i] for i in positions]
        for i in sorted(positions, reverse=True):
            del ops[i]
        ops.append(contract(step, *args, threads=threads))
    (result,) = ops
    return result
