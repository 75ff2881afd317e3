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
still mapped.  With ``widen=True`` (the CPU provider)
graphc converts such weights itself instead, a chunk at a time on a few threads, into float32 files in
a cache folder (``GRAPHC_WEIGHT_CACHE`` or the system's temporary folder,
removed with the session; with ``GRAPHC_WEIGHT_CACHE`` set, a later session of the same graph loads the saved
session instead and converts nothing: :mod:`lowering.backends.ort_session_cache`), drops the ``Cast`` nodes, and points the session
there: onnxruntime then reads that float32 copy (or packs it), twice the
checkpoint's bytes (the float32 weights it computes with), and the conversion
(exact: every bfloat16 or float16 value is a float32 value) gives the same
numbers.

Below ``inline_max_bytes`` every weight is inlined, as before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphc.mapped import distinct_nbytes, mapped_location, release_pages
from graphc.memory import format_bytes
from graphc.numerics import contiguous

from ..exporter.onnx_builder import ONNX_DTYPES
from .ort_options import DEFAULT_INLINE_MAX_BYTES as _ORT_INLINE_DEFAULT

__all__ = ["DEFAULT_INLINE_MAX_BYTES", "SessionWeights", "plan_session_weights", "host_ortvalue"]

DEFAULT_INLINE_MAX_BYTES = _ORT_INLINE_DEFAULT
"""Weights up to this many bytes in all are serialized into the model; above it, :class:`SessionWeights` places them."""
_SMALL = 1024
_HANDED = "graphc-handed-initializer"  # the placeholder location of a handed weight: never read (the OrtValue replaces it)
_LOW = ("float16", "bfloat16")
_ALIGN = 4096
_CHUNK = 4 << 20  # elements converted at a time


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
    from a file), :attr:`handed` the arrays to hand over as ``OrtValue`` s, and the byte counts say how much went
    each way.
    """

    inline_max_bytes: int | None
    allow_handed: bool = True
    folder: str | None = None
    widen: bool = False
    handed: dict[str, np.ndarray] = field(default_factory=dict)
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
        """Store each low-precision weight read only through ``Cast`` to float32 as float32 data in the cache folder and drop
        those casts (their readers read the weight); any other low-precision weight is handed over as it is."""
        graph = model.graph
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for i in node.input:
                readers.setdefault(i, []).append(node)
        outputs = {o.name for o in graph.output}
        tensors = {t.name: t for t in graph.initializer}
        renames: dict[str, str] = {}
        placed: list[tuple[np.ndarray, int]] = []
        end = 0
        for name, arr in self.low.items():
            casts = readers.get(name, [])
            if not casts or any(n.op_type != "Cast" or _to(n) != onnx.TensorProto.FLOAT or n.output[0] in outputs for n in casts):
                if self.allow_handed:
                    self._hand(name, arr)
                else:  # a worker process's session: no OrtValue reaches it
                    tensors[name].CopyFrom(self._inline(name, arr))
                continue
            end += -end % _ALIGN
            placed.append((arr, end))
            tensors[name].CopyFrom(_external(name, np.empty(arr.shape, np.float32), "weights.f32", end))
            end += arr.size * 4
            self.widened_bytes += arr.nbytes * 2
            renames.update({n.output[0]: name for n in casts})
        _write_float32(os.path.join(str(self.folder), "weights.f32"), placed, end)
        keep = [n for n in graph.node if not (n.op_type == "Cast" and n.output[0] in renames)]
        for node in keep:
            node.input[:] = [renames.get(i, i) for i in node.input]
        del graph.node[:]
        graph.node.extend(keep)

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
        if not self.handed:
            return []
        values = [host_ortvalue(a) for a in self.handed.values()]
        so.add_external_initializers(list(self.handed), values)
        return values

    def describe(self) -> str:
        """One line: where the weights went."""
        parts = [f"{format_bytes(self.inline_bytes)} in the model"]
        if self.file_bytes:
            parts.append(f"{format_bytes(self.file_bytes)} read from the checkpoint files in {self.folder}")
        if self.widened_bytes:
            parts.append(f"{format_bytes(self.widened_bytes)} converted to float32 files in {self.folder}")
        if self.handed_bytes:
            parts.append(f"{format_bytes(self.handed_bytes)} handed over as OrtValues")
        return "; ".join(parts)


def _to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), -1)


def _write_float32(path: str, placed: list[tuple[np.ndarray, int]], size: int) -> None:
    """Write each array of ``placed`` as little-endian float32 at its byte offset of a new ``size``-byte file ``path``,
    a chunk at a time on up to 4 threads, each converting into a buffer of its own (a mapped source's pages are dropped
    after each chunk).  bfloat16 widens by a shift of its bits, exactly."""
    flats = [(contiguous(arr).reshape(-1), offset) for arr, offset in placed]
    chunks = [(flat[i : i + _CHUNK], offset + 4 * i) for flat, offset in flats for i in range(0, flat.size, _CHUNK)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        threads = max(1, min(4, os.cpu_count() or 1, len(chunks)))

        def write(share: list[tuple[np.ndarray, int]]) -> None:
            buffer = np.empty(_CHUNK, "<u4")
            for chunk, offset in share:
                out = buffer[: chunk.size]
                if str(chunk.dtype) == "bfloat16":
                    np.left_shift(chunk.view(np.uint16), 16, out=out, dtype=np.uint32)
                else:
                    out.view("<f4")[...] = chunk
                data = memoryview(out.view(np.uint8).data)
                while data:  # a write may take fewer bytes than it was given
                    done = os.pwrite(fd, data, offset)
                    data, offset = data[done:], offset + done
                release_pages(chunk)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, [chunks[k::threads] for k in range(threads)]))
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
    initializers: dict[str, np.ndarray], inline_max_bytes: int | None, allow_handed: bool = True, widen: bool = False
) -> SessionWeights:
    """The placement for a graph with these ``initializers`` (the lowered graph's, or the graph's: the mapped ones are the same arrays).

    ``inline_max_bytes=None`` or weights of at most that many bytes in all: everything inline.  Otherwise the
    checkpoint folder holding most of the mapped bytes is the model's external-data folder; weights in other folders,
    and arrays that are not mapped, are handed over (``allow_handed=False``, for a session in a worker process: inlined).
    ``widen=True`` with low-precision weights: a new cache folder is the external-data folder (see the module doc);
    call :meth:`SessionWeights.widen_casts` after the export.
    """
    total = distinct_nbytes(initializers.values())
    if inline_max_bytes is None or total <= inline_max_bytes:
        return SessionWeights(None, allow_handed)
    if widen and any(str(a.dtype) in _LOW and a.nbytes >= _SMALL for a in initializers.values()):
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
