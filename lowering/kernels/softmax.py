"""Fast NumPy kernels for the interpreter's elementwise hot spot: (causal-masked) softmax.

On attention shapes, mask + softmax written as separate whole-array NumPy
expressions cost more than both GEMMs together (each is several passes over the
S x S scores on one thread).  :func:`masked_softmax` does the mask and the
softmax in one pass per block of query rows, in place in its output buffer, on
a thread pool (NumPy's ufuncs release the GIL).  For a causal mask, key columns
past the last visible key of a row block are written as zeros without being
computed, which skips about half the work of a causal prefill.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import numpy as np
from threadpoolctl import ThreadpoolController

from graphc.visibility import Visibility

from .crew import crew
from .thread_choice import shared_choice

__all__ = ["masked_softmax", "softmax_rows_", "exp_rows_", "run_blocks", "default_threads", "blas_description", "blas_threads"]

T = TypeVar("T")

_BLAS: list[ThreadpoolController] = []  # one controller, made on first use: threadpool_limits() rescans the libraries each call (0.3 ms)
_TASK_BYTES = 1 << 20  # about 1 MiB of scores per task: cache-sized, many tasks to balance triangles


def default_threads() -> int:
    """Threads used when none are given: the cores available to this process."""
    try:
        return len(os.sched_getaffinity(0)) or 1  # the cores this process may run on
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def blas_description() -> str:
    """The BLAS behind NumPy's GEMMs and the kernels it picked (``openblas 0.3.31 SkylakeX kernels``), for provider columns and benchmark headers.

    OpenBLAS picks its kernels when it loads, from the CPU or from
    ``OPENBLAS_CORETYPE``: AVX2 ("Haswell") kernels run a float32 GEMM at about
    half the speed of AVX-512 ("SkylakeX") ones on a CPU that has both.
    """
    for info in _blas_controller().info():
        if info.get("user_api") == "blas":
            arch = info.get("architecture")
            return f"{info.get('internal_api', 'BLAS')} {info.get('version', '')}" + (f" {arch} kernels" if arch else "")
    return "no BLAS found"


def blas_threads(threads: int | None) -> AbstractContextManager[object]:
    """BLAS held to ``threads`` threads inside the ``with`` (nothing changed for ``None``): a backend told its thread
    count passes it on to the GEMMs it does not split itself."""
    return _blas_controller().limit(limits=threads, user_api="blas") if threads else nullcontext()


def _blas_controller() -> ThreadpoolController:
    if not _BLAS:
        _BLAS.append(ThreadpoolController())
    return _BLAS[0]


def exp_rows_(s: np.ndarray) -> np.ndarray:
    """``s <- exp(s - rowmax)`` in place over the last axis; returns the row sums (1 for rows that are all ``-inf``, which become zeros).

    Dividing by the sums is left to the caller: after the PV product it is a
    pass over ``[rows, head_dim]`` instead of over ``[rows, keys]``.
    """
    m = s.max(axis=-1, keepdims=True)
    np.copyto(m, 0, where=~np.isfinite(m))  # fully masked rows: exp(-inf) = 0, not NaN
    s -= m
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    total[total == 0] = 1
    return total


def softmax_rows_(s: np.ndarray) -> None:
    """In-place softmax over the last axis of ``s``; rows that are all ``-inf`` become zeros."""
    s /= exp_rows_(s)


def run_blocks(block: Callable[[T], None], starts: Sequence[T], threads: int | None, pin_blas: bool = False, key: Hashable | None = None) -> None:
    """Call ``block(start)`` for every start, on ``threads`` threads (the caller's and a pool's) when there is more than one block.

    With a ``key`` naming the work (the kernel and its operands' shapes), the blocks run on ``threads`` threads or on
    the caller alone, whichever ran work of that key faster lately (:func:`~lowering.kernels.thread_choice.shared_choice`):
    with another process busy on a core, a helper that takes a block and is then put off its core holds the call up
    for the scheduler's time slice, and one thread is faster (``GRAPHC_ADAPTIVE_THREADS=0``: always ``threads``).

    The calling thread works through the blocks beside its helpers, which
    stay awake for a moment between calls (:mod:`lowering.kernels.crew`: handing
    every block to a pool of sleeping threads cost 50-100 us a call, more
    than half of a 2 MiB decode).  ``pin_blas`` limits BLAS to one
    thread per block while the blocks run, so that BLAS's own threads do not
    oversubscribe the cores.
    """
    n = threads or default_threads()
    if n == 1 or len(starts) <= 1:
        for i0 in starts:
            block(i0)
        return
    if key is not None:
        shared_choice(n).timed(key, lambda t: run_blocks(block, starts, t, pin_blas))
        return
    if pin_blas:
        with _blas_controller().limit(limits=1, user_api="blas"):
            _share_blocks(block, starts, n)
    else:
        _share_blocks(block, starts, n)


def _share_blocks(block: Callable[[T], None], starts: Sequence[T], n: int) -> None:
    """Blocks taken in order from one counter by the caller and ``n - 1`` helpers (:mod:`lowering.kernels.crew`); the first
    error is raised after all stop.

    The crew is the one for ``n`` threads whatever the number of blocks (a
    helper that finds none left returns at once), so a process keeps one
    crew per thread count asked for, as it kept one pool.
    """
    counter = itertools.count()

    def work() -> None:
        while (i := next(counter)) < len(starts):  # next() on a count is atomic under the GIL
            block(starts[i])

    if not crew(n).run(work):  # the crew serves another call (another thread, or a block asking for helpers): this one runs here
        work()


def masked_softmax(x: np.ndarray, visibility: Visibility = Visibility(), threads: int | None = None) -> np.ndarray:
    """Softmax over the last axis of ``x [..., Sq, Sk]``, over the keys ``visibility`` lets each row see by position (its
    offset a number).

    Rows with no visible key give zeros.  Returns a new array; ``x`` is not modified.
    """
    sq, sk = x.shape[-2], x.shape[-1]
    if x.size == 0:  # no rows, or rows with no keys: a row that sees no key is zeros
        return np.zeros(x.shape, x.dtype)
    x3 = x.reshape((-1, sq, sk))
    out = np.empty(x3.shape, x.dtype)
    lead = max(1, x3.shape[0])
    rows = max(1, min(sq, _TASK_BYTES // max(1, lead * sk * x.itemsize)))
    neg_inf = np.array(-np.inf, x.dtype)

    def block(i0: int) -> None:
        i1 = min(sq, i0 + rows)
        ob = out[:, i0:i1]
        c = visibility.key_span(range(i0, i1), sk)[1]
        if c < sk:
            ob[..., c:] = 0
        if c == 0:
            return
        v = ob[..., :c]
        np.copyto(v, x3[:, i0:i1, :c])
        if visibility.is_causal:
            hidden = visibility.hidden(range(i0, i1), c)
            if hidden.any():
                np.copyto(v, neg_inf, where=hidden)
        softmax_rows_(v)

    run_blocks(block, range(0, sq, rows), threads, key=("softmax", x3.shape, x3.dtype.str, visibility.is_causal))
    return out.reshape(x.shape)
