"""KV caches that grow in place on the NumPy backend: a decode step appends its keys and values, it does not copy the past.

A :class:`KVBuffer` is one layer's key (or value) storage ``[B, H, capacity, D]`` and its
*frontier*, the number of positions that hold keys.  What a step is fed as ``past_key`` is a
:class:`KVPrefix`: the view ``buffer[:, :, :frontier]``, an ndarray that knows its buffer.
The NumPy attention kernel's :func:`append` writes a step's new keys right after the past
and returns the longer prefix as ``present_key``, which the next step feeds back.
A full buffer moves to one twice its size (so a cache costs the positions it holds, not the
ones a caller said it might need).  Only a prefix that ends at its buffer's frontier grows in
place: appending twice to the same past (a caller re-running a step, or branching) copies,
as a plain ``concatenate`` would, so no step ever overwrites keys another step still sees.
:func:`prefix_buffer` lets a kernel read such a prefix through its C-contiguous buffer
instead of copying it to a contiguous array.

:func:`numpy_cache` is the NumPy backend's :class:`~lowering.decode.kv_cache.KVCache`: an
:class:`~lowering.decode.kv_cache.ArrayKVCache` whose first pasts are empty prefixes of new buffers.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from graphc.memory import check_allocation

from .kv_cache import ArrayKVCache, LMInterface

__all__ = ["KVBuffer", "KVPrefix", "allocate", "append", "prefix_buffer", "numpy_cache"]


class KVPrefix(np.ndarray):
    """A view ``buffer.data[:, :, :T]`` of a :class:`KVBuffer` (views of it keep ``owner``; :func:`append` checks they are still the prefix)."""

    owner: KVBuffer | None

    def __array_finalize__(self, obj: Any) -> None:
        self.owner = getattr(obj, "owner", None)

    @property
    def room(self) -> int | None:
        """Positions its buffer holds in all (None when it is not a prefix of its buffer's storage)."""
        return self.owner.capacity if self.owner is not None and self.owner.holds(self) else None


class KVBuffer:
    """One layer's keys or values with room to grow: ``data [B, H, capacity, D]``, positions ``:frontier`` in use."""

    def __init__(self, batch: int, heads: int, capacity: int, head_dim: int, dtype: np.dtype | str, frontier: int = 0) -> None:
        dtype = np.dtype(dtype)
        check_allocation(batch * heads * capacity * head_dim * dtype.itemsize, f"a KV cache buffer [{batch}, {heads}, {capacity}, {head_dim}]")
        self.data = np.empty((batch, heads, capacity, head_dim), dtype)
        self.frontier = frontier
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Positions the storage has room for."""
        return int(self.data.shape[2])

    def prefix(self, length: int) -> KVPrefix:
        """``data[:, :, :length]`` as a :class:`KVPrefix` of this buffer."""
        d = self.data
        view = KVPrefix((d.shape[0], d.shape[1], length, d.shape[3]), d.dtype, buffer=d, strides=d.strides)  # its base is the buffer itself
        view.owner = self
        return view

    def holds(self, a: np.ndarray) -> bool:
        """True when ``a`` is ``data[:, :, :T]`` for some ``T`` (:func:`prefix_buffer` of ``a`` is this storage)."""
        return a.dtype == self.data.dtype and prefix_buffer(a) is self.data

    def append(self, start: int, new: np.ndarray) -> np.ndarray | None:
        """Write ``new`` at positions ``start:`` and return the longer prefix, when ``start`` is the frontier; else None (the caller copies)."""
        stop = start + new.shape[2]
        with self._lock:
            if self.frontier != start:
                return None
            self.frontier = stop
            if stop > self.capacity:  # full: the storage moves to twice the size (each position copied once on average)
                b, h, cap, d = self.data.shape
                room = max(stop, 2 * cap)
                check_allocation(b * h * room * d * self.data.dtype.itemsize, f"a KV cache buffer [{b}, {h}, {room}, {d}]")
                bigger = np.empty((b, h, room, d), self.data.dtype)
                bigger[:, :, :start] = self.data[:, :, :start]
                self.data = bigger  # earlier prefixes keep the old storage alive as long as they are read
        self.data[:, :, start:stop] = new
        return self.prefix(stop)


def allocate(batch: int, heads: int, capacity: int, head_dim: int, dtype: np.dtype | str) -> KVPrefix:
    """An empty KV cache ``[batch, heads, 0, head_dim]`` with room for ``capacity`` positions, appended to in place.

    Raises :class:`~graphc.errors.ResourceLimitError` past graphc's memory cap (:mod:`graphc.memory`)."""
    return KVBuffer(batch, heads, capacity, head_dim, dtype).prefix(0)


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
    """``concatenate([past, new], axis=2)``, written into ``past``'s buffer when ``past`` is a :class:`KVPrefix` that ends at its
    buffer's frontier (growing the buffer when full); otherwise a new array."""
    owner = getattr(past, "owner", None)
    fits = new.dtype == past.dtype and new.shape[:2] == past.shape[:2] and new.shape[3:] == past.shape[3:]
    if isinstance(owner, KVBuffer) and fits and owner.holds(past):
        grown = owner.append(past.shape[2], new)
        if grown is not None:
            return grown
    return np.asarray(np.concatenate([past, new], axis=2))


def numpy_cache(lm: LMInterface, batch: int, capacity: int) -> ArrayKVCache:
    """The NumPy backend's decode cache: per layer, an empty prefix of a buffer with room for ``capacity`` positions
    (a fixed-capacity cache, ``lm.static``: ``capacity`` slots of zeros, which each step returns anew)."""
    if lm.static:
        return ArrayKVCache(lm, batch, capacity=capacity)
    return ArrayKVCache(lm, batch, lambda b, h, n, d, dtype: allocate(b, h, capacity, d, dtype))
