"""How an onnxruntime session receives a graph's weights: in the model, from the checkpoint's own files, or handed over.

A protobuf cannot exceed 2 GiB, and serializing weights into one costs two
copies of them, so a model whose weights pass ``inline_max_bytes`` (default
64 MiB) is exported with placeholders instead:

- a weight that is a view of a memory-mapped checkpoint file
  (:func:`graphc.mapped.mapped_location`) becomes ONNX *external data* pointing
  at that file, at the tensor's own byte offset; the session reads the file
  itself (the folder is given by the session option
  ``session.model_external_initializers_file_folder_path``), so no byte of the
  weights passes through graphc: its products read the map as it is (with
  ``prepack=True``, onnxruntime keeps its own packed copy of each matrix and
  drops the map once a weight is packed);
- any other large array (one the optimizer computed, or a conversion the user
  asked for) is handed to the session as an ``OrtValue``
  (``SessionOptions.add_external_initializers``), which onnxruntime copies
  once while the session is built;
- small arrays (under 1 KiB: scalars, norms' epsilons, shape constants) stay in
  the model.

onnxruntime's CPU kernels have no bfloat16 (nor, on most CPUs, float16) MatMul,
so a low-precision graph reads each weight through a ``Cast`` to float32, which
onnxruntime would fold into float32 copies while the low-precision ones are
still mapped.  With ``widen=True`` (the CPU provider) graphc converts such
weights itself instead, a chunk at a time on a few threads (exact: every
bfloat16 or float16 value is a float32 value), drops the ``Cast`` nodes, and
gives the session the float32 copy, twice the checkpoint's bytes (the float32
weights it computes with):

- in this process's memory, shared with the session (``SessionOptions.add_initializer``:
  onnxruntime reads the arrays as they are, copying nothing), when no cache folder
  is named, the session is in this process and the copy fits graphc's memory cap
  (:func:`graphc.memory.memory_cap`; with ``prepack=True`` the packed copy counts
  too).  The model names each such weight as external data in the null device, a
  placeholder no read can succeed on, so a rewrite of onnxruntime's that would
  read the weight's bytes from the model fails loudly instead of reading other
  bytes; a weight some node reads in a form onnxruntime might fold (its readers
  are not all products, gathers or elementwise ops with a computed operand) is
  handed over instead, and a session that still fails on a placeholder is built
  again with every converted weight handed over;
- otherwise into float32 files in a cache folder (``GRAPHC_WEIGHT_CACHE`` or the
  system's temporary folder, removed with the session; with ``GRAPHC_WEIGHT_CACHE``
  set, a later session of the same graph loads the saved session instead and
  converts nothing: :mod:`lowering.backends.ort_session_cache`), which onnxruntime
  maps (or packs).

Below ``inline_max_bytes`` every weight is inlined, as before.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphc.mapped import distinct_nbytes, mapped_location, release_pages
from graphc.memory import format_bytes, memory_cap
from graphc.numerics import contiguous

from ..exporter.onnx_builder import ONNX_DTYPES
from .ort_options import DEFAULT_INLINE_MAX_BYTES as _ORT_INLINE_DEFAULT

__all__ = ["DEFAULT_INLINE_MAX_BYTES", "SessionWeights", "plan_session_weights", "host_ortvalue", "aligned_offsets", "write_at"]

DEFAULT_INLINE_MAX_BYTES = _ORT_INLINE_DEFAULT
"""Weights up to this many bytes in all are serialized into the model; above it, :class:`SessionWeights` places them."""
_SMALL = 1024
_HANDED = "graphc-handed-initializer"  # the placeholder location of a handed weight: never read (the OrtValue replaces it)
_LOW = ("float16", "bfloat16")
_ALIGN = 4096
_CHUNK = 4 << 20  # elements converted at a time
_NULL_FOLDER, _NULL_NAME = os.path.split(os.devnull)  # the placeholder file of a weight shared from memory: unreadable
_SHAREABLE_READERS = frozenset({"MatMul", "FusedMatMul", "Gemm", "Gather", "Mul", "Add", "Sub", "Div"})


def _external(name: str, arr: np.ndarray, location: str, offset: int) -> onnx.TensorProto:
    t = onnx.TensorProto(name=name, data_type=ONNX_DTYPES[str(arr.dtype)], dims=list(arr.shape))
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(arr.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


@dataclass
class SessionWeights:
    """The placement of one model's weights; call it as the export's ``place_weights`` (name, array -> TensorProto).

    After the export: :attr:`folder` is the folder the model's external data lies in (None when no weight is read
    from a file), :attr:`handed` the arrays to hand over as ``OrtValue`` s (onnxruntime copies them), :attr:`shared`
    the float32 conversions the session reads in place (``in_memory``; they live as long as this object), and the
    byte counts say how much went each way.
    """

    inline_max_bytes: int | None
    allow_handed: bool = True
    folder: str | None = None
    widen: bool = False
    in_memory: bool = False
    handed: dict[str, np.ndarray] = field(default_factory=dict)
    shared: dict[str, np.ndarray] = field(default_factory=dict)
    shared_values: dict[str, Any] = field(default_factory=dict, repr=False)
    low: dict[str, np.ndarray] = field(default_factory=dict)
    inline_bytes: int = 0
    file_bytes: int = 0
    handed_bytes: int = 0
    widened_bytes: int = 0

    def __call__(self, name: str, arr: np.ndarray) -> onnx.TensorProto:
        """The initializer ``name`` as the model will carry it."""
        if self.inline_max_bytes is None or arr.nbytes < _SMALL:
            return self._inline(name, arr)
        if self.widen and str(arr.dtype) in _LOW:
            self.low[name] = arr  # placed by widen_casts once the model's nodes are known
            return _external(name, arr, _HANDED, 0)
        where = mapped_location(arr)
        if where is not None and os.path.dirname(where.path) == self.folder:
            self.file_bytes += arr.nbytes
            return _external(name, arr, os.path.basename(where.path), where.offset)
        if not self.allow_handed:
            return self._inline(name, arr)
        self._hand(name, arr)
        return _external(name, arr, _HANDED, 0)

    def widen_casts(self, model: onnx.ModelProto) -> None:
        """Give the session each low-precision weight read only through ``Cast`` to float32 as float32 data (in memory or
        in the cache folder: see the module doc) and drop those casts (their readers read the weight); any other
        low-precision weight is handed over as it is."""
        graph = model.graph
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for i in node.input:
                readers.setdefault(i, []).append(node)
        outputs = {o.name for o in graph.output}
        tensors = {t.name: t for t in graph.initializer}
        constant = _constant_values(graph) if self.in_memory else set()
        renames: dict[str, str] = {}
        into: list[tuple[str, np.ndarray, bool]] = []
        for name, arr in self.low.items():
            casts = readers.get(name, [])
            if not casts or any(n.op_type != "Cast" or _to(n) != onnx.TensorProto.FLOAT or n.output[0] in outputs for n in casts):
                if self.allow_handed:
                    self._hand(name, arr)
                else:  # a worker process's session: no OrtValue reaches it
                    tensors[name].CopyFrom(self._inline(name, arr))
                continue
            renames.update({n.output[0]: name for n in casts})
            later = [r for n in casts for r in readers.get(n.output[0], [])]
            into.append((name, arr, all(r.op_type in _SHAREABLE_READERS and any(i and i not in constant for i in r.input) for r in later)))
        if self.in_memory:
            self._share(into, tensors)
        else:
            self._write(into, tensors)
        keep = [n for n in graph.node if not (n.op_type == "Cast" and n.output[0] in renames)]
        for node in keep:
            node.input[:] = [renames.get(i, i) for i in node.input]
        del graph.node[:]
        graph.node.extend(keep)

    def _share(self, into: list[tuple[str, np.ndarray, bool]], tensors: dict[str, onnx.TensorProto]) -> None:
        """Convert each ``(name, weight, shareable)`` of ``into`` into float32 in memory: shared with the session, or (not
        ``shareable``: onnxruntime may fold a reader of it) handed over."""
        converted = _float32_arrays([arr.shape for _, arr, _ in into])
        for (name, arr, shareable), target in zip(into, converted):
            if shareable:
                self.shared[name] = target
                self.widened_bytes += target.nbytes
                tensors[name].CopyFrom(_external(name, target, _NULL_NAME, 0))
            else:  # a rewrite of onnxruntime's needs the bytes in the model's own initializer
                self._hand(name, target)
                tensors[name].CopyFrom(_external(name, target, _HANDED, 0))
        _widen_into([(arr, target) for (_, arr, _), target in zip(into, converted)])

    def _write(self, into: list[tuple[str, np.ndarray, bool]], tensors: dict[str, onnx.TensorProto]) -> None:
        """Convert each weight of ``into`` into one float32 file in the cache folder, each at a page boundary."""
        offsets, end = aligned_offsets([arr.size * 4 for _, arr, _ in into])
        for (name, arr, _), offset in zip(into, offsets):
            tensors[name].CopyFrom(_external(name, np.empty(arr.shape, np.float32), "weights.f32", offset))
            self.widened_bytes += arr.nbytes * 2
        _write_float32(os.path.join(str(self.folder), "weights.f32"), [(arr, offset) for (_, arr, _), offset in zip(into, offsets)], end)

    def hand_shared(self) -> bool:
        """Hand every shared conversion over instead (onnxruntime copies it into the session), for a session that failed
        on a placeholder; False when none was shared."""
        if not self.shared:
            return False
        for name, arr in self.shared.items():
            self._hand(name, arr)
            self.widened_bytes -= arr.nbytes
        self.shared.clear()
        self.shared_values.clear()
        return True

    def _hand(self, name: str, arr: np.ndarray) -> None:
        self.handed[name] = arr
        self.handed_bytes += arr.nbytes

    def _inline(self, name: str, arr: np.ndarray) -> onnx.TensorProto:
        self.inline_bytes += arr.nbytes
        return numpy_helper.from_array(contiguous(arr), name)

    def session_options(self, so: Any) -> list[Any]:
        """Point ``so`` (an ``onnxruntime.SessionOptions``) at the weights; returns the ``OrtValue`` s to keep alive
        until the session is built."""
        if self.folder is not None:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", self.folder)
        for name, arr in self.shared.items():
            so.add_initializer(name, self._shared_value(name, arr))
        if not self.handed:
            return []
        values = [host_ortvalue(a) for a in self.handed.values()]
        so.add_external_initializers(list(self.handed), values)
        return values

    def _shared_value(self, name: str, arr: np.ndarray) -> Any:
        """The ``OrtValue`` over a shared conversion, made once and kept with it (onnxruntime reads its memory)."""
        if name not in self.shared_values:
            self.shared_values[name] = host_ortvalue(arr)
        return self.shared_values[name]

    def describe(self) -> str:
        """One line: where the weights went."""
        parts = [f"{format_bytes(self.inline_bytes)} in the model"]
        if self.file_bytes:
            parts.append(f"{format_bytes(self.file_bytes)} read from the checkpoint files in {self.folder}")
        if self.widened_bytes and self.in_memory:
            parts.append(f"{format_bytes(self.widened_bytes)} converted to float32 in memory, read there by the session")
        elif self.widened_bytes:
            parts.append(f"{format_bytes(self.widened_bytes)} converted to float32 files in {self.folder}")
        if self.handed_bytes:
            parts.append(f"{format_bytes(self.handed_bytes)} handed over as OrtValues")
        return "; ".join(parts)


def _to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), -1)


def _constant_values(graph: onnx.GraphProto) -> set[str]:
    """The values of ``graph`` computed from its initializers alone (what onnxruntime's constant folding may compute)."""
    constant = {t.name for t in graph.initializer}
    for node in graph.node:  # in topological order
        if all(i in constant for i in node.input if i):
            constant.update(o for o in node.output if o)
    return constant


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets that lay out blocks of ``sizes`` bytes one after another, each at a page boundary (onnxruntime
    maps external data that starts at one), and the end of the last."""
    offsets, end = [], 0
    for size in sizes:
        end += -end % _ALIGN
        offsets.append(end)
        end += size
    return offsets, end


def write_at(fd: int, array: np.ndarray, offset: int) -> None:
    """The bytes of ``array`` (C-contiguous) written at ``offset`` of the open file ``fd``, however many calls it takes."""
    data = memoryview(array.reshape(-1).view(np.uint8).data)
    while data:  # a write may take fewer bytes than it was given
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _widen_chunk(chunk: np.ndarray, out: np.ndarray) -> None:
    """``chunk`` (bfloat16 or float16) as float32 bits in ``out`` (uint32 of its size); bfloat16 by a shift of its bits, exactly."""
    if str(chunk.dtype) == "bfloat16":
        np.left_shift(chunk.view(np.uint16), 16, out=out, dtype=np.uint32)
    else:
        out.view("<f4")[...] = chunk


def _on_threads(chunks: list[Any], work: Callable[[list[Any]], None]) -> None:
    """``work`` over ``chunks`` dealt round-robin to up to 4 threads."""
    threads = max(1, min(4, os.cpu_count() or 1, len(chunks)))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, [chunks[k::threads] for k in range(threads)]))


def _float32_arrays(shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Float32 arrays of ``shapes`` in one private anonymous mapping: the kernel gives it small pages as they are
    written (NumPy asks for huge pages for a large array, and on a machine whose free memory is fragmented by the page
    cache each huge page can stall on compaction: 3-7 s against 1-2 s for 4 GiB)."""
    offsets, end = aligned_offsets([4 * math.prod(shape) for shape in shapes])
    if not end:
        return [np.empty(shape, np.float32) for shape in shapes]
    memory = mmap.mmap(-1, end, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return [np.frombuffer(memory, np.float32, math.prod(shape), offset).reshape(shape) for shape, offset in zip(shapes, offsets)]


def _widen_into(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Each source of ``pairs`` converted into its float32 array, a chunk at a time on up to 4 threads (a mapped
    source's pages are dropped after each chunk)."""
    flats = [(contiguous(src).reshape(-1), dst.reshape(-1).view(np.uint32)) for src, dst in pairs]
    chunks = [(src[i : i + _CHUNK], dst[i : i + _CHUNK]) for src, dst in flats for i in range(0, src.size, _CHUNK)]

    def convert(share: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for chunk, out in share:
            _widen_chunk(chunk, out)
            release_pages(chunk)

    _on_threads(chunks, convert)


def _write_float32(path: str, placed: list[tuple[np.ndarray, int]], size: int) -> None:
    """Write each array of ``placed`` as little-endian float32 at its byte offset of a new ``size``-byte file ``path``,
    a chunk at a time on up to 4 threads, each converting into a buffer of its own (a mapped source's pages are dropped
    after each chunk)."""
    flats = [(contiguous(arr).reshape(-1), offset) for arr, offset in placed]
    chunks = [(flat[i : i + _CHUNK], offset + 4 * i) for flat, offset in flats for i in range(0, flat.size, _CHUNK)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)

        def write(share: list[tuple[np.ndarray, int]]) -> None:
            buffer = np.empty(_CHUNK, "<u4")
            for chunk, offset in share:
                out = buffer[: chunk.size]
                _widen_chunk(chunk, out)
                write_at(fd, out, offset)
                release_pages(chunk)

        _on_threads(chunks, write)
    finally:
        os.close(fd)


def _cache_folder() -> str:
    root = os.environ.get("GRAPHC_WEIGHT_CACHE") or None
    if root is not None:
        os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix="graphc-weights-", dir=root)


def host_ortvalue(array: np.ndarray) -> Any:
    """``array`` as a host ``OrtValue`` over its (C-contiguous) memory; bfloat16 through its bits, typed by ONNX element
    type (onnxruntime's NumPy bridge has no bfloat16)."""
    import onnxruntime as ort

    array = contiguous(array)
    if str(array.dtype) == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def plan_session_weights(
    initializers: dict[str, np.ndarray],
    inline_max_bytes: int | None,
    allow_handed: bool = True,
    widen: bool = False,
    in_memory: bool = False,
    packed: bool = False,
) -> SessionWeights:
    """The placement for a graph with these ``initializers`` (the lowered graph's, or the graph's: the mapped ones are the same arrays).

    ``inline_max_bytes=None`` or weights of at most that many bytes in all: everything inline.  Otherwise the
    checkpoint folder holding most of the mapped bytes is the model's external-data folder; weights in other folders,
    and arrays that are not mapped, are handed over (``allow_handed=False``, for a session in a worker process: inlined).
    ``widen=True`` with low-precision weights: their float32 conversion is shared from memory (``in_memory=True``, a
    session in this process, the conversion (and with ``packed``, the packed copy) within graphc's memory cap), or a new
    cache folder is the external-data folder (see the module doc); call :meth:`SessionWeights.widen_casts` after the export.
    """
    total = distinct_nbytes(initializers.values())
    if inline_max_bytes is None or total <= inline_max_bytes:
        return SessionWeights(None, allow_handed)
    low = [a for a in initializers.values() if str(a.dtype) in _LOW and a.nbytes >= _SMALL]
    if widen and low:
        cap = memory_cap()
        needed = distinct_nbytes(low, min_itemsize=4) * (2 if packed else 1)  # the float32 copy, and the packed one
        if in_memory and allow_handed and os.path.isabs(os.devnull) and (cap is None or needed <= cap):
            return SessionWeights(inline_max_bytes, allow_handed, _NULL_FOLDER, widen=True, in_memory=True)
        cache = _cache_folder()
        plan = SessionWeights(inline_max_bytes, allow_handed, cache, widen=True)
        weakref.finalize(plan, shutil.rmtree, cache, True)
        return plan
    by_folder: dict[str, int] = {}
    for arr in initializers.values():
        where = mapped_location(arr)
        if where is not None:
            holder = os.path.dirname(where.path)
            by_folder[holder] = by_folder.get(holder, 0) + where.length
    folder = max(by_folder, key=lambda f: by_folder[f]) if by_folder else None
    return SessionWeights(inline_max_bytes, allow_handed, folder)
