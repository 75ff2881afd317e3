"""Memory-mapped weight files: which file an array's bytes live in, whether that file changed, and releasing its pages.

:func:`graphc.weights.read_safetensors` maps each file once and registers the
map here.  Every tensor of the file is a view of that map, so for any array
graphc can tell which file holds its bytes and at which offset
(:func:`mapped_location`): the onnxruntime backends hand such weights to
onnxruntime as external data that points into the checkpoint's own files, so
the weights are neither serialized into a protobuf nor copied by graphc.

This module is a leaf (it imports nothing of graphc but the error types), so
the IR, the optimizer and the backends can all use it.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import WeightError

__all__ = [
    "register_map",
    "check_mapped_files",
    "mapped_location",
    "MappedLocation",
    "release_mapped_pages",
    "release_pages",
    "distinct_nbytes",
    "all_finite",
    "all_finite_each",
]


@dataclass(frozen=True)
class _Map:
    end: int
    path: str
    size: int
    inode: int
    mtime_ns: int
    owner: Any  # weakref to the np.memmap


@dataclass(frozen=True)
class MappedLocation:
    """Where an array's bytes lie: ``path`` (a real path, links resolved) at byte ``offset``, ``length`` bytes."""

    path: str
    offset: int
    length: int


_MAPPED: dict[int, _Map] = {}  # map start address -> the mapping, while mapped


def register_map(raw: np.memmap, path: str, st: os.stat_result) -> None:
    """Record ``raw``, the whole-file map of ``path`` (stat ``st``), until it is garbage-collected."""
    addr = raw.__array_interface__["data"][0]
    _MAPPED[addr] = _Map(addr + raw.size, os.path.realpath(path), st.st_size, st.st_ino, st.st_mtime_ns, weakref.ref(raw))
    weakref.finalize(raw, _MAPPED.pop, addr, None)  # views keep `raw` alive; the entry goes with the map


def _find(addr: int) -> tuple[int, _Map] | None:
    for start, m in list(_MAPPED.items()):
        if start <= addr < m.end:
            return start, m
    return None


def check_mapped_files(arrays: Iterable[Any]) -> None:
    """Raise :class:`WeightError` if a file that ``arrays`` are memory-mapped from changed since it was read.

    A memory map of a file that shrinks afterwards kills the process with SIGBUS on the first read past the new
    end; graphc calls this where it starts reading weights in bulk (a graph copying an initializer, ``optimize``,
    ``lower`` and so every backend and export), so such a checkpoint is an error instead.
    """
    if not _MAPPED:
        return
    seen: set[int] = set()
    for arr in arrays:
        if not isinstance(arr, np.ndarray) or not arr.size:
            continue
        found = _find(arr.__array_interface__["data"][0])
        if found is None or found[0] in seen:
            continue
        seen.add(found[0])
        m = found[1]
        try:
            st = os.stat(m.path)
        except OSError as e:
            raise WeightError(f"weights file {m.path!r} is gone since it was loaded ({e.strerror or e}); load the checkpoint again") from None
        if st.st_size != m.size or st.st_ino != m.inode or st.st_mtime_ns != m.mtime_ns:
            raise WeightError(
                f"weights file {m.path!r} changed since it was loaded ({m.size} bytes then, {st.st_size} now); load the checkpoint again"
            )


def mapped_location(arr: np.ndarray) -> MappedLocation | None:
    """The file and byte range holding ``arr``, when ``arr`` is a C-contiguous little-endian view of a mapped file; else None."""
    if not isinstance(arr, np.ndarray) or not arr.size or not arr.flags.c_contiguous or arr.dtype.byteorder == ">":
        return None
    addr = arr.__array_interface__["data"][0]
    found = _find(addr)
    if found is None or addr + arr.nbytes > found[1].end:
        return None
    start, m = found
    return MappedLocation(m.path, addr - start, arr.nbytes)


def distinct_nbytes(arrays: Iterable[np.ndarray], min_itemsize: int = 1) -> int:
    """Bytes of the distinct arrays among ``arrays`` (tied weights once): what a model's weights occupy; with
    ``min_itemsize=4``, what they occupy once each narrower one is widened to 4 bytes (float32)."""
    seen: dict[tuple[int, int], int] = {}
    for a in arrays:
        if isinstance(a, np.ndarray):
            seen[(a.__array_interface__["data"][0], a.nbytes)] = a.size * max(a.itemsize, min_itemsize)
    return sum(seen.values())


def release_mapped_pages() -> int:
    """Drop every mapped weight file's pages from this process's resident set; returns the bytes of the maps advised.

    The data stays in the operating system's page cache and is read back on the next touch, so this changes no
    number: it only stops pages one backend read from counting in the resident memory of the next (Linux
    ``MADV_DONTNEED`` on a read-only file map).  A no-op where the platform has no ``madvise``.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    total = 0
    for m in list(_MAPPED.values()):
        raw = m.owner()
        handle = getattr(raw, "_mmap", None)
        if advice is None or handle is None:
            continue
        try:
            handle.madvise(advice)
        except (OSError, ValueError):  # pragma: no cover - a closed map
            continue
        total += m.size
    return total


_FINITE: dict[tuple[str, int, int, int], bool] = {}  # (file, offset, length, mtime_ns) -> all finite
_CHUNK = 64 << 20


def all_finite(arr: np.ndarray) -> bool:
    """True when every element of the floating array ``arr`` is finite (bfloat16 included).

    A view of a mapped checkpoint file is read in 64 MiB chunks whose pages are dropped from the resident set
    after each (as :func:`release_mapped_pages`), and the answer is kept per file range, so scanning a model's
    weights neither doubles its resident memory nor repeats for each backend.
    """
    where = mapped_location(arr)
    if where is None:
        return _chunk_finite(np.ascontiguousarray(arr))
    found = _find(arr.__array_interface__["data"][0])
    assert found is not None
    key = (where.path, where.offset, where.length, found[1].mtime_ns)
    if key not in _FINITE:
        flat = arr.reshape(-1)
        step = max(1, _CHUNK // arr.itemsize)
        _FINITE[key] = all(_finite_chunk(flat[i : i + step], found) for i in range(0, flat.size, step))
    return _FINITE[key]


def all_finite_each(arrays: Sequence[np.ndarray], threads: int | None = None) -> list[bool]:
    """:func:`all_finite` of each of ``arrays``, read on up to ``threads`` threads (default: up to 4, one a core): a
    model's weights are read at the memory's speed, not one core's (NumPy's reductions release the GIL)."""
    workers = max(1, min(threads or 4, os.cpu_count() or 1, len(arrays)))
    if workers == 1:
        return [all_finite(a) for a in arrays]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(all_finite, arrays))


_EXPONENT_BITS = {"bfloat16": 0x7F80, "float16": 0x7C00}
"""A 2-byte float whose exponent bits are all set is an infinity or a NaN."""


def _chunk_finite(chunk: np.ndarray) -> bool:
    """Every element finite; a 2-byte float read by its exponent bits (no float32 copy)."""
    exponent = _EXPONENT_BITS.get(str(chunk.dtype))
    if exponent is None:
        return bool(np.isfinite(chunk).all())
    return chunk.size == 0 or int(np.bitwise_and(chunk.view(np.uint16), exponent).max()) != exponent


def _finite_chunk(chunk: np.ndarray, found: tuple[int, _Map]) -> bool:
    ok = _chunk_finite(chunk)
    _release(chunk, found)
    return ok


def release_pages(arr: np.ndarray) -> None:
    """Drop the pages holding ``arr`` from the resident set when it is a view of a mapped file (see
    :func:`release_mapped_pages`); a no-op otherwise."""
    if isinstance(arr, np.ndarray) and arr.size:
        found = _find(arr.__array_interface__["data"][0])
        if found is not None:
            _release(arr, found)


def _release(chunk: np.ndarray, found: tuple[int, _Map]) -> None:
    start, m = found
    handle = getattr(m.owner(), "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if handle is not None and advice is not None:
        first = (chunk.__array_interface__["data"][0] - start) // mmap.PAGESIZE * mmap.PAGESIZE
        last = min(m.size, chunk.__array_interface__["data"][0] - start + chunk.nbytes)
        try:
            handle.madvise(advice, first, last - first)
        except (OSError, ValueError):  # pragma: no cover - a closed map
            pass
