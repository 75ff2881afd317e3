"""How an onnxruntime session receives a graph's weights: in the model, from the checkpoint's own files, or handed over.

A protobuf cannot exceed 2 GiB, and serializing weights into one costs two
copies of them, so a model whose weights pass ``inline_max_bytes`` (default
64 MiB) is exported with placeholders instead:

- a weight that is a view of a memory-mapped checkpoint file
  (:func:`graphc.mapped.mapped_location`) becomes ONNX *external data* pointing
  at that file, at the tensor's own byte offset; the session reads the file
  itself (the folder is given by the session option
  ``session.model_external_initializers_file_folder_path``), so no byte of the
  weights passes through graphc, and onnxruntime keeps only its own packed copy
  of each matrix (the map is dropped once a weight is packed);
- any other large array (one the optimizer computed, or a conversion the user
  asked for) is handed to the session as an ``OrtValue``
  (``SessionOptions.add_external_initializers``), which onnxruntime copies
  once while the session is built;
- small arrays (under 1 KiB: scalars, norms' epsilons, shape constants) stay in
  the model.

Below ``inline_max_bytes`` every weight is inlined, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphc.mapped import distinct_nbytes, mapped_location
from graphc.memory import format_bytes
from graphc.numerics import contiguous

from .onnx_builder import ONNX_DTYPES

__all__ = ["DEFAULT_INLINE_MAX_BYTES", "SessionWeights", "plan_session_weights"]

DEFAULT_INLINE_MAX_BYTES = 64 << 20
"""Weights up to this many bytes in all are serialized into the model; above it, :class:`SessionWeights` places them."""
_SMALL = 1024
_HANDED = "graphc-handed-initializer"  # the placeholder location of a handed weight: never read (the OrtValue replaces it)


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
    handed: dict[str, np.ndarray] = field(default_factory=dict)
    inline_bytes: int = 0
    file_bytes: int = 0
    handed_bytes: int = 0

    def __call__(self, name: str, arr: np.ndarray) -> onnx.TensorProto:
        """The initializer ``name`` as the model will carry it."""
        if self.inline_max_bytes is None or arr.nbytes < _SMALL:
            return self._inline(name, arr)
        where = mapped_location(arr)
        if where is not None and os.path.dirname(where.path) == self.folder:
            self.file_bytes += arr.nbytes
            return _external(name, arr, os.path.basename(where.path), where.offset)
        if not self.allow_handed:
            return self._inline(name, arr)
        self.handed[name] = arr
        self.handed_bytes += arr.nbytes
        return _external(name, arr, _HANDED, 0)

    def _inline(self, name: str, arr: np.ndarray) -> onnx.TensorProto:
        self.inline_bytes += arr.nbytes
        return numpy_helper.from_array(contiguous(arr), name)

    def session_options(self, so: Any) -> list[Any]:
        """Point ``so`` (an ``onnxruntime.SessionOptions``) at the weights; returns the ``OrtValue`` s to keep alive
        until the session is built."""
        import onnxruntime as ort

        if self.folder is not None:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", self.folder)
        if not self.handed:
            return []
        values = [_ortvalue(ort, contiguous(a)) for a in self.handed.values()]
        so.add_external_initializers(list(self.handed), values)
        return values

    def describe(self) -> str:
        """One line: where the weights went."""
        parts = [f"{format_bytes(self.inline_bytes)} in the model"]
        if self.file_bytes:
            parts.append(f"{format_bytes(self.file_bytes)} read from the checkpoint files in {self.folder}")
        if self.handed_bytes:
            parts.append(f"{format_bytes(self.handed_bytes)} handed over as OrtValues")
        return "; ".join(parts)



def _ortvalue(ort: Any, arr: np.ndarray) -> Any:
    if str(arr.dtype) == "bfloat16":  # onnxruntime's NumPy bridge has no bfloat16: the same bits, typed by ONNX element type
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint16), onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(arr)


def plan_session_weights(initializers: dict[str, np.ndarray], inline_max_bytes: int | None, allow_handed: bool = True) -> SessionWeights:
    """The placement for a graph with these ``initializers`` (the lowered graph's, or the graph's: the mapped ones are the same arrays).

    ``inline_max_bytes=None`` or weights of at most that many bytes in all: everything inline.  Otherwise the
    checkpoint folder holding most of the mapped bytes is the model's external-data folder; weights in other folders,
    and arrays that are not mapped, are handed over (``allow_handed=False``, for a session in a worker process: inlined).
    """
    total = distinct_nbytes(initializers.values())
    if inline_max_bytes is None or total <= inline_max_bytes:
        return SessionWeights(None, allow_handed)
    by_folder: dict[str, int] = {}
    for arr in initializers.values():
        where = mapped_location(arr)
        if where is not None:
            folder = os.path.dirname(where.path)
            by_folder[folder] = by_folder.get(folder, 0) + where.length
    folder = max(by_folder, key=lambda f: by_folder[f]) if by_folder else None
    return SessionWeights(inline_max_bytes, allow_handed, folder)
