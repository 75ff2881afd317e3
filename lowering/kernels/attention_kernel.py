"""Row-blocked attention: the NumPy backend's kernel for the ``Attention`` op.

The optimizer recognises attention once (``fuse_attention``); the interpreter
runs each ``Attention`` node with :func:`attention_kernel`, which views the
queries of one KV head as ``M = group * Sq`` GEMM rows and goes block by block
over the queries: one GEMM over the visible keys only,
the masked exponentials while the block is in cache, then the PV GEMM, whose
``[rows, head_dim]`` result is divided by the row sums (not the scores).  Decode
(one row block) splits the batch x KV-head axis over the threads instead, so
each thread makes one pass over its share of K and V.  The S x S
scores are never materialised, and a causal prefill skips the masked half of
both GEMMs.  Blocks run on a thread pool with BLAS pinned to one thread per
block (threadpoolctl), since BLAS threads inside pool threads oversubscribe the
cores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from graphc.attention_op import Attention
from graphc.visibility import Visibility

from . import compiled
from .softmax import default_threads, exp_rows_, run_blocks
from .torch_attention import attention_on_the_faster_kernel
from ..decode.kv_buffers import append, prefix_buffer

__all__ = ["attention_kernel", "blocked_attention", "key_runs", "is_key_mask_shape", "GEMM_ROWS"]

GEMM_ROWS = 256
"""Target GEMM rows (group x query rows) per block: measured best on 2 cores for head_dim 128."""


def attention_kernel(op: Attention, args: Sequence[np.ndarray], dims: Mapping[str, int], threads: int | None) -> tuple[np.ndarray, ...]:
    """The interpreter's kernel for :class:`~graphc.Attention`: the KV cache appended, then :func:`blocked_attention`.

    A bool key mask (``[B, 1, 1, T]``, a padding mask; the NumPy target keeps no other user mask) whose visible
    keys form one run per batch row (left or right padding) runs as that row's keys only, the causal offset
    shifted to match; any other mask takes the op's reference semantics.
    """
    q, k, v = args[:3]
    rest = list(args[3:])
    mask = rest.pop(0) if op.has_mask else None
    present: tuple[np.ndarray, ...] = ()
    if op.kv_cache:  # in place when the past is a growing buffer (lowering.decode.kv_buffers), else a new array
        present = (append(rest[0], k), append(rest[1], v))
        k, v = (p.view(np.ndarray) for p in present)  # read as plain arrays; the prefixes (which know their buffers) are the outputs
    vis = op.visibility.at(dims)
    q_scale = op.scale / op.softcap if op.softcap is not None else op.scale
    if q_scale != 1.0:  # on the query side: one pass over Q, never over the scores or the KV cache
        q = q * np.array(q_scale, q.dtype)
    runs = None if mask is None else key_runs(mask, q.shape[0], k.shape[2])
    if mask is not None and runs is None:
        return op.evaluate_all(args, dims)
    if runs is None or all(run == (0, k.shape[2]) for run in runs):
        out = _attend(op, q, k, v, vis, threads)
    else:  # key j of row b is key j - lo of its run
        runs_of = [(q[b : b + 1], k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi], vis.shifted(-lo)) for b, (lo, hi) in enumerate(runs)]
        out = np.concatenate([_attend(op, *run, threads) for run in runs_of])
    return (out, *present)


def _attend(op: Attention, q: np.ndarray, k: np.ndarray, v: np.ndarray, vis: Visibility, threads: int | None) -> np.ndarray:
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv if hkv else 1

    def graphcs() -> np.ndarray:
        out = blocked_attention(q.reshape(b, hkv, group * sq, d), k, v, sq, vis, None, threads, softcap=op.softcap)
        return out.reshape(b, hq, sq, v.shape[-1])

    return attention_on_the_faster_kernel(q, k, v, vis, op.softcap, threads, graphcs)  # a plain prefill: torch's SDPA where faster here


def is_key_mask_shape(shape: Sequence[object]) -> bool:
    """A mask of this shape (broadcast to ``[B, H, Sq, T]``) varies over batch and keys only: ``[B, 1, 1, T]``, a padding mask.
    The NumPy target keeps an ``Attention`` with such a bool mask for this kernel (:func:`key_runs`)."""
    return len(shape) <= 4 and all(d == 1 for d in shape[-3:-1])


def key_runs(mask: np.ndarray, batch: int, total: int) -> list[tuple[int, int]] | None:
    """Per batch row, the one run ``[lo, hi)`` of keys a per-key bool mask keeps (``(0, 0)`` for none); None when a row's kept keys
    are not one run or the mask varies over heads or queries."""
    if mask.dtype != np.bool_ or not is_key_mask_shape(mask.shape):
        return None
    rows = np.broadcast_to(mask.reshape(*mask.shape[:-3], mask.shape[-1]) if mask.ndim >= 3 else mask, (batch, total))
    runs = []
    for row in rows:
        kept = np.flatnonzero(row)
        if kept.size and kept[-1] - kept[0] + 1 != kept.size:
            return None
        runs.append((int(kept[0]), int(kept[-1]) + 1) if kept.size else (0, 0))
    return runs


def _rows(a: np.ndarray, batch: list[int], lead: int) -> np.ndarray:
    """``a [*batch, N, D]`` as a C-contiguous ``[lead, N', D]``: the growing KV-cache buffer it is a prefix of (``N' >= N``, no copy), else a
    contiguous copy."""
    buffer = prefix_buffer(a) if list(a.shape[:-2]) == batch else None
    if buffer is not None:
        return buffer.reshape(lead, *buffer.shape[-2:])
    return np.ascontiguousarray(np.broadcast_to(a, (*batch, *a.shape[-2:])).reshape(lead, *a.shape[-2:]))


def _tasks(lead: int, row_starts: range, threads: int | None) -> list[tuple[int, int, int]]:
    """Work items ``(b0, b1, i0)``: batch x KV-head slices times query-row blocks.

    Row blocks alone when there are enough of them for every thread (prefill);
    otherwise (decode: one row block) the batch x KV-head axis is split too, so
    each thread reads its own share of the KV cache, once.
    """
    n = threads or default_threads()
    if n == 1 or len(row_starts) >= n or lead == 1:
        return [(0, lead, i0) for i0 in row_starts]
    per = -(-lead // max(1, n // len(row_starts)))
    return [(b0, min(lead, b0 + per), i0) for b0 in range(0, lead, per) for i0 in row_starts]


def blocked_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    sq: int,
    visibility: Visibility,
    scale: float | None,
    threads: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """``softmax(masked(softcap(scale * q k^T))) v`` for ``q [.., G*sq, D]``, ``k [.., T, D]``, ``v [.., T, E]``.

    Row ``m`` of ``q`` is query ``m % sq``; it sees the keys ``visibility`` lets query ``m % sq`` see by position
    (:meth:`~graphc.visibility.Visibility.key_ranges`; its offset a number, its mask not read here: key blocks
    outside a row block's ranges are skipped); ``softcap`` is ``c`` of ``c * tanh(s / c)``, where the caller has
    already divided ``q`` by ``c``.  Rows that see no key are zeros.
    """
    *batch, rows_total, dim = q.shape
    t_len, e_dim = k.shape[-2], v.shape[-1]
    if sq == 0 or rows_total == 0 or 0 in batch:  # no query rows: nothing to compute
        return np.zeros((*batch, rows_total, e_dim), np.result_type(q, v))
    if rows_total % sq:
        raise ValueError(f"query rows {rows_total} are not a multiple of the query length {sq}")
    groups = rows_total // sq
    lead = int(np.prod(batch, dtype=np.int64))
    fast = compiled.use_compiled() and q.dtype == k.dtype == v.dtype == np.float32
    if fast and rows_total <= compiled.MAX_ROWS and scale is None and softcap is None:  # decode: stream K and V once per KV head
        fq, fk, fv = (_rows(a, batch, lead) for a in (q, k, v))
        return compiled.decode_attention(fq, fk, fv, sq, visibility, threads, keys=t_len).reshape(*batch, rows_total, e_dim)
    exp_rows = compiled.exp_rows_compiled if fast else exp_rows_
    k = np.broadcast_to(k, (*batch, t_len, dim))
    v = np.broadcast_to(v, (*batch, t_len, e_dim))
    q5 = q.reshape(lead, groups, sq, dim)
    k_t = np.swapaxes(k.reshape(lead, t_len, dim), -1, -2)
    v3 = v.reshape(lead, t_len, e_dim)
    out = np.empty((lead, groups, sq, e_dim), np.result_type(q, v))
    rows = max(1, min(sq, GEMM_ROWS // groups))
    neg_inf = np.array(-np.inf, out.dtype)

    def block(task: tuple[int, int, int]) -> None:
        b0, b1, i0 = task
        i1 = min(sq, i0 + rows)
        r = i1 - i0
        first, last = visibility.key_ranges(range(i0, i1), t_len)
        c0, c = int(first.min()), int(last.max())
        ob = out[b0:b1, :, i0:i1, :]
        if c <= c0:
            ob[...] = 0
            return
        qb = q5[b0:b1, :, i0:i1, :].reshape(b1 - b0, groups * r, dim)
        s = np.matmul(qb, k_t[b0:b1, :, c0:c])
        if scale is not None:
            s *= scale
        if softcap is not None:
            np.tanh(s, out=s)
            s *= np.array(softcap, s.dtype)
        if visibility.is_causal:
            # only keys after the block's first query's last key (the diagonal band), or before a window's edge, can be hidden
            lo = c0 if int(first.max()) > c0 else max(c0, min(c, int(last.min())))
            hidden = visibility.hidden(range(i0, i1), range(lo, c))
            if hidden.any():
                np.copyto(s.reshape(b1 - b0, groups, r, c - c0)[..., lo - c0 :], neg_inf, where=hidden)
        total = exp_rows(s)
        pv = np.matmul(s, v3[b0:b1, c0:c, :])
        pv /= total
        ob[...] = pv.reshape(b1 - b0, groups, r, e_dim)

    key = ("attention", q.shape, k.shape, q.dtype.str, visibility.is_causal)
    run_blocks(block, _tasks(lead, range(0, sq, rows), threads), threads, pin_blas=True, key=key)
    return out.reshape(*batch, rows_total, e_dim)
