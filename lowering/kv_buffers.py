"""KV caches that grow in place on the NumPy backend: a decode step appends its keys and values, it does not copy the past.

:func:`allocate` makes a buffer ``[B, H, capacity, D]`` and returns its empty prefix
``buffer[:, :, :0]`` to feed as ``past_key``; the NumPy attention kernel's
:func:`append` then writes a step's new keys into the buffer right after the past
and returns the longer prefix as ``present_key``, which the next step feeds back.
A full buffer moves to one twice its size (so a cache costs the positions it
holds, not the ones a caller said it might need).  Only buffers made here grow in place, and only at their frontier: appending twice
to the same past (a caller re-running a step, or branching) copies, as a plain
``concatenate`` would, so no step ever overwrites keys another step still sees.
:func:`prefix_buffer` lets a kernel read such a prefix through its C-contiguous
buffer instead of copying it to a contiguous array.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from graphc.memory import check_allocation

__all__ = ["allocate", "append", "prefix_buffer"]

_frontier: dict[int, int] = {}
"""``id(buffer)`` -> how many slots along axis 2 hold keys (a buffer leaves this table when it is freed)."""
_lock = threading.Lock()


def allocate(batch: int, heads: int, capacity: int, head_dim: int, dtype: np.dtype | str) -> np.ndarray:
    """An empty KV cache ``[batch, heads, 0, head_dim]`` with room for ``capacity`` positions, appended to in place.

    Raises :class:`~graphc.errors.ResourceLimitError` past graphc's memory cap (:mod:`graphc.memory`)."""
    return _buffer(batch, heads, capacity, head_dim, np.dtype(dtype), 0)[:, :, :0]


def _buffer(batch: int, heads: int, capacity: int, head_dim: int, dtype: np.dtype, frontier: int) -> np.ndarray:
    check_allocation(batch * heads * capacity * head_dim * dtype.itemsize, f"a KV cache buffer [{batch}, {heads}, {capacity}, {head_dim}]")
    buffer = np.empty((batch, heads, capacity, head_dim), dtype)
    _frontier[id(buffer)] = frontier
    weakref.finalize(buffer, _frontier.pop, id(buffer), None)
    return buffer


def prefix_buffer(a: np.ndarray) -> np.ndarray | None:
    """The C-contiguous buffer of which ``a`` is the prefix ``buffer[..., :T, :]`` along axis -2, or None."""
    base = a.base
    if not isinstance(base, np.ndarray) or base.ndim != a.ndim or a.ndim < 2 or not base.flags.c_contiguous:
        return None
    if base.shape[:-2] != a.shape[:-2] or base.shape[-1] != a.shape[-1] or base.strides != a.strides:
        return None
    if a.__array_interface__["data"][0] != base.__array_interface__["data"][0]:
        return None
    return base


def append(past: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``concatenate([past, new], axis=2)``, written into ``past``'s buffer when it was made by :func:`allocate`, has room,
    and ``past`` ends at its frontier; otherwise a new array."""
    buffer = prefix_buffer(past)
    if buffer is not None and buffer.dtype == new.dtype and new.shape[:2] == past.shape[:2] and new.shape[3:] == past.shape[3:]:
        start, stop = past.shape[2], past.shape[2] + new.shape[2]
        with _lock:
            at_frontier = _frontier.get(id(buffer)) == start
            grows = at_frontier and stop <= buffer.shape[2]
            if grows:
                _frontier[id(buffer)] = stop
            elif at_frontier:  # full: the frontier moves to a buffer twice the size (each position copied once on average)
                _frontier[id(buffer)] = -1  # no later append writes into the old one
        if grows:
            buffer[:, :, start:stop] = new
            return buffer[:, :, :stop]
        if at_frontier:
            b, h, cap, d = buffer.shape
            bigger = _buffer(b, h, max(stop, 2 * cap), d, buffer.dtype, stop)
            bigger[:, :, :start] = buffer[:, :, :start]
            bigger[:, :, start:stop] = new
            return bigger[:, :, :stop]
    return np.concatenate([past, new], axis=2)
