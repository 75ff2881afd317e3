"""The compiled kernel tier of the NumPy backend (numba), with NumPy as the fallback.

``pip install "graphc[fast]"`` adds numba; the NumPy backend then runs

- attention over a few query rows per KV head (decode, short chunks: at most
  :data:`MAX_ROWS` rows of ``group x query`` per KV head) with
  :func:`decode_attention`: ``K`` and ``V`` streamed once each per KV head,
  near the machine's read bandwidth, where NumPy's GEMV + exp + GEMV reach
  about 60% of it;
- the softmax rows of prefill with :func:`exp_rows_compiled` (one pass after
  the row max instead of five);
- linear layers over bfloat16 weights with :func:`bf16_matmul` (a few rows
  of activations: decode), widening each weight element in a register, so
  the weight is read in its own 2 bytes and never copied to float32
  (:mod:`lowering.kernels.low_precision`).

numba is an extra, not a core dependency, because each numba release supports
a bounded range of NumPy versions: a core dependency would hold back the NumPy
a user may install.  Without numba, or with ``GRAPHC_KERNELS=numpy`` in the
environment, or when the kernel module cannot be loaded (a broken numba or
llvmlite install, no writable cache directory), every kernel is the NumPy one;
:func:`compiled_reason` says why the compiled tier is off.  Compiled code is cached on disk (numba's
``cache=True``: beside the installed package, or numba's user cache directory
where that is read-only), so only the first process compiles (a few seconds).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np

from graphc.errors import ExecutionError, GraphcError
from graphc.visibility import Visibility

from .crew import use_spin
from .softmax import default_threads, run_blocks

__all__ = [
    "DECODE_BYTES_PER_THREAD",
    "MAX_ROWS",
    "compiled_reason",
    "kernels_description",
    "use_compiled",
    "decode_attention",
    "exp_rows_compiled",
    "bf16_matmul",
    "spin_until",
    "warm_up",
]

MAX_ROWS = 64
"""Query rows per KV head up to which attention runs in the compiled streaming kernel (above it, GEMMs win)."""

DECODE_BYTES_PER_THREAD = 4 << 20
"""K/V bytes (times query rows / 4) per extra thread in :func:`decode_attention`.

Below it, waking a second thread costs more than it saves (2 MiB at 4 rows:
45 us on one thread, 68 us on two).
"""

_MODULE: list[ModuleType] = []
_LOAD_ERROR: list[str] = []


def compiled_reason() -> str | None:
    """Why the compiled tier is off (``None`` when it is on); an unknown ``GRAPHC_KERNELS`` value raises :class:`~graphc.errors.GraphcError`."""
    choice = os.environ.get("GRAPHC_KERNELS", "auto").strip().lower()
    if choice not in ("auto", "numpy"):
        raise GraphcError(f"GRAPHC_KERNELS must be 'auto' (compiled kernels where numba is installed) or 'numpy', got {choice!r}")
    if choice == "numpy":
        return "GRAPHC_KERNELS=numpy"
    if not _numba_installed():
        return 'numba is not installed (pip install "graphc[fast]")'
    if _LOAD_ERROR:
        return f"the numba kernels could not be loaded ({_LOAD_ERROR[0]})"
    return None


@functools.cache
def _numba_installed() -> bool:
    """Looked up once: ``find_spec`` of a missing module scans ``sys.path`` (~20 us), and every attention call asks."""
    return importlib.util.find_spec("numba") is not None


def kernels_description() -> str:
    """One line for a backend's provider column: which kernel tier the NumPy backend uses."""
    reason = compiled_reason()
    if reason is not None:
        return f"NumPy kernels ({reason})"
    from importlib.metadata import version

    return f"numba {version('numba')} kernels"


def use_compiled() -> bool:
    """True when the compiled kernels are used: numba installed and loading, not turned off by ``GRAPHC_KERNELS=numpy``."""
    return compiled_reason() is None and _kernels() is not None


_KERNEL_MODULES = ("lowering.kernels._numba_attention", "lowering.kernels._numba_linear")


def _kernels() -> ModuleType | None:
    """The kernel modules' public functions as one module, imported once.

    None (with the reason kept for :func:`compiled_reason`) when one cannot be imported.
    """
    if not _MODULE and not _LOAD_ERROR:
        try:
            merged = ModuleType("lowering._numba_kernels")
            for name in _KERNEL_MODULES:
                module = importlib.import_module(name)
                for attr in module.__all__:
                    setattr(merged, attr, getattr(module, attr))
            _MODULE.append(merged)
        except Exception as e:  # noqa: BLE001 - a broken numba/llvmlite install or no writable cache: NumPy kernels, and say why
            _LOAD_ERROR.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return _MODULE[0] if _MODULE else None


def _loaded_kernels() -> ModuleType:
    """The kernel module, for callers that asked :func:`use_compiled` first."""
    kern = _kernels()
    if kern is None:
        raise GraphcError(f"the compiled kernels are off: {compiled_reason()}")
    return kern


def warm_up() -> float:
    """Compile (or load from numba's cache) every kernel now; returns the seconds it took (0 without numba)."""
    if not use_compiled():
        return 0.0
    t0 = time.perf_counter()
    q = np.zeros((1, 2, 16), np.float32)
    decode_attention(q, np.zeros((1, 5, 16), np.float32), np.zeros((1, 5, 8), np.float32), 1, Visibility.causal(0), 1)
    exp_rows_compiled(np.zeros((2, 3), np.float32))
    bf16_matmul(np.zeros((1, 4), np.float32), np.zeros((5, 4), np.uint16), 1)
    kern = _loaded_kernels()
    x, one, zero, out = np.zeros((1, 16), np.float32), np.ones((4, 1), np.float32), np.zeros((4, 1), np.float32), np.empty((1, 4), np.float32)
    kern.nbits_rows(x[:, :8], x[:, :8], np.zeros((1, 1), np.float32), np.zeros((4, 8), np.uint8), one, zero, 0, 4, out)
    kern.bytes_rows(x, np.zeros((1, 1), np.float32), np.zeros((4, 16), np.uint8), one, zero, 0, 4, out)
    return time.perf_counter() - t0


def spin_until() -> Callable[[np.ndarray, int, int, int], int] | None:
    """The compiled bounded busy wait on a shared counter (:mod:`lowering.kernels.crew`'s helpers), or None when the compiled tier is off."""
    return _loaded_kernels().spin_until if use_compiled() else None


use_spin(spin_until)


def exp_rows_compiled(s: np.ndarray) -> np.ndarray:
    """:func:`lowering.kernels.softmax.exp_rows_` in one compiled pass: ``s <- exp(s - rowmax)`` in place; returns the row sums ``[..., 1]``.

    ``s`` must be a C-contiguous float32 array (as ``np.matmul`` returns the scores): a reshape of any other would be a copy.
    """
    flat = s.reshape(-1, s.shape[-1])
    totals = np.empty(flat.shape[0], np.float32)
    kern = _loaded_kernels()
    kern.exp_rows(flat, totals)
    return totals.reshape(*s.shape[:-1], 1)


def bf16_matmul(x: np.ndarray, w_bits: np.ndarray, threads: int | None) -> np.ndarray:
    """``x @ float32(w).T`` for ``x [M, K]`` float32 and a bfloat16 weight ``w [N, K]`` given as its ``uint16`` bits, without a float32 copy of ``w``.

    Each element of ``w`` is widened in a register as it is read
    (:mod:`lowering.kernels._numba_linear`), so a decode step reads the weight's own 2 bytes an element.
    Rows of ``w`` are shared among ``threads`` threads.
    """
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous):
        raise ExecutionError(f"bf16_matmul: x must be a C-contiguous float32 array [M, K], got {_describe(x)}")
    if not (isinstance(w_bits, np.ndarray) and w_bits.dtype == np.uint16 and w_bits.ndim == 2 and w_bits.flags.c_contiguous):
        raise ExecutionError(f"bf16_matmul: w must be the C-contiguous uint16 bits of a bfloat16 array [N, K], got {_describe(w_bits)}")
    if x.shape[1] != w_bits.shape[1]:
        raise ExecutionError(f"bf16_matmul: x {list(x.shape)} and w {list(w_bits.shape)} do not fit (x [M, K], w [N, K])")
    kern = _loaded_kernels()
    rows = w_bits.shape[0]
    out = np.empty((x.shape[0], rows), np.float32)
    n = min(threads or default_threads(), 1 + w_bits.nbytes // DECODE_BYTES_PER_THREAD)
    step = max(4, -(-rows // (4 * n)) // 4 * 4)  # about four shares a thread, whole groups of four rows
    run_blocks(lambda n0: kern.bf16_rows(x, w_bits, n0, min(rows, n0 + step), out), range(0, rows, step), n)
    return out


def _describe(a: object) -> str:
    if not isinstance(a, np.ndarray):
        return type(a).__name__
    return f"{a.dtype}{list(a.shape)}{'' if a.flags.c_contiguous else ' strided'}"


def _check_operands(q: np.ndarray, k: np.ndarray, v: np.ndarray, keys: int | None) -> None:
    """The compiled kernel's contract, checked before it runs (it reads raw float32 memory)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 3 or not a.flags.c_contiguous:
            got = f"{a.dtype}{list(a.shape)}{'' if a.flags.c_contiguous else ' strided'}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ExecutionError(f"decode_attention: {name} must be a C-contiguous float32 array [L, rows or keys, D], got {got}")
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[2] == k.shape[2] and k.shape[1] == v.shape[1]):
        raise ExecutionError(
            f"decode_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit "
            "(q [L, R, D], k [L, T, D], v [L, T, E])"
        )
    if keys is not None and not 0 <= keys <= k.shape[1]:
        raise ExecutionError(f"decode_attention: keys must be in 0..{k.shape[1]} (the buffer's length), got {keys}")


def decode_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, sq: int, visibility: Visibility, threads: int | None, keys: int | None = None
) -> np.ndarray:
    """``softmax(masked(q k^T)) v`` for ``q [L, R, D]`` (already scaled), ``k [L, T, D]``, ``v [L, T, E]``, float32, C-contiguous.

    Row ``r`` is query ``r % sq``, seeing the keys of its :meth:`~graphc.visibility.Visibility.key_ranges` (as in
    :func:`lowering.kernels.attention_kernel.blocked_attention`); rows that see no key
    are zeros.  ``keys``: only the first ``keys`` of ``k``/``v`` are the cache (a buffer with room to grow; default all).
    Work is split over batch x KV heads, and over keys as well
    when there are fewer heads than threads (flash-decoding: each key slice
    returns its row maxima, sums and accumulators, merged here).
    """
    _check_operands(q, k, v, keys)
    kern = _loaded_kernels()
    lead, rows, _ = q.shape
    t_len, e_len = k.shape[1] if keys is None else keys, v.shape[2]
    kv_bytes = lead * t_len * (q.shape[2] + e_len) * 4
    n = min(threads or default_threads(), 1 + kv_bytes * max(1, rows // 4) // DECODE_BYTES_PER_THREAD)
    splits = max(1, min(-(-n // max(lead, 1)), t_len // 256 or 1))
    bounds = np.array([c * t_len // splits for c in range(splits + 1)], np.int64)
    acc = np.empty((splits, lead, rows, e_len), np.float32)
    row_max = np.empty((splits, lead, rows), np.float32)
    row_sum = np.empty((splits, lead, rows), np.float32)
    key_lo, key_hi = visibility.key_ranges(sq, t_len)
    tasks = np.arange(lead * splits, dtype=np.int64)
    shares = [part for part in np.array_split(tasks, min(4 * n, tasks.size)) if part.size]  # a helper that starts late takes fewer
    run_blocks(lambda part: kern.attend_rows(q, k, v, sq, key_lo, key_hi, bounds, part, acc, row_max, row_sum), shares, n)
    if splits == 1:  # a row that sees a key sums to >= 1 (its max gives exp(0)); one that sees none has acc 0
        return np.divide(acc[0], np.maximum(row_sum[0][..., None], 1), out=acc[0])
    best = row_max.max(axis=0)
    weight = np.exp(row_max - np.where(np.isfinite(best), best, 0), where=np.isfinite(row_max), out=np.zeros_like(row_max))
    total = (weight * row_sum).sum(axis=0)[..., None]
    return np.einsum("clr,clre->lre", weight, acc) / np.maximum(total, 1)
