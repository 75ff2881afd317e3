"""Read an ONNX model safely: every way a file can be wrong becomes an :class:`OnnxImportError` naming the culprit.

Checks, before any conversion: the file exists and parses as an ONNX
``ModelProto`` with a graph; external data lives inside the model's folder
(an absolute path or ``..`` that leaves it is refused), exists and is long
enough (it is then memory-mapped, not read, by :func:`read_model`); the standard opset is one the installed ``onnx`` knows; no declared
dim exceeds :data:`MAX_DIM`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from ..errors import OnnxImportError, SerializationError
from ..folders import confined
from ..memory import check_allocation

__all__ = ["load_model", "read_model", "MAX_DIM", "MIN_IMPORT_OPSET", "MAX_PROTO_BYTES"]

MAX_DIM = 1 << 32
"""The largest size graphc accepts for one axis of a declared tensor (no attention model comes near it)."""
MIN_IMPORT_OPSET = 7
MAX_PROTO_BYTES = 2**31
"""The largest ONNX protobuf file graphc reads (protobuf's own limit); weights beyond it live in external data."""


def load_model(source: onnx.ModelProto | str | os.PathLike[str]) -> onnx.ModelProto:
    """Return the checked model of ``source`` (a ``ModelProto`` or a path), with external data loaded into it.

    The external data's total size is checked against graphc's memory cap before anything is read.
    """
    model, folder = _read(source)
    if folder is not None:
        refs = _external_refs(model, folder)
        check_allocation(sum(length for _, _, _, length in refs), "loading the model's external data")
        if refs:
            from onnx.external_data_helper import load_external_data_for_model

            try:
                load_external_data_for_model(model, str(folder))
            except (OSError, ValueError) as e:
                raise OnnxImportError(f"cannot load the model's external data from {str(folder)!r}: {e}") from None
    return model


def read_model(source: onnx.ModelProto | str | os.PathLike[str]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The checked model of ``source`` and its external initializers as read-only memory maps (nothing is copied)."""
    model, folder = _read(source)
    mapped: dict[str, np.ndarray] = {}
    if folder is not None:
        for t, path, offset, length in _external_refs(model, folder):
            mapped[t.name] = _map_tensor(t, path, offset, length)
    return model, mapped


def _read(source: onnx.ModelProto | str | os.PathLike[str]) -> tuple[onnx.ModelProto, Path | None]:
    if isinstance(source, onnx.ModelProto):
        model, folder = source, None
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise OnnxImportError(f"ONNX model {str(path)!r} does not exist")
        if not path.is_file():
            raise OnnxImportError(f"ONNX model {str(path)!r} is not a file")
        size = path.stat().st_size
        if size > MAX_PROTO_BYTES:
            raise OnnxImportError(
                f"ONNX model {str(path)!r} is {size} bytes; a protobuf file holds at most 2 GiB (larger weights go in external data)"
            )
        try:
            data = path.read_bytes()
        except OSError as e:
            raise OnnxImportError(f"cannot read ONNX model {str(path)!r}: {e.strerror}") from None
        model = _parse(data, str(path))
        folder = path.resolve().parent
    else:
        raise OnnxImportError(f"from_onnx takes an onnx.ModelProto or a path, got {type(source).__name__}")
    _check_opsets(model)
    _check_dims(model)
    _inline_nested_external(model, folder)
    if folder is None and any(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data for t in model.graph.initializer):
        missing = next(t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data)
        raise OnnxImportError(
            f"initializer {missing!r} keeps its data in an external file; pass the model's path, not a ModelProto, so graphc can find it"
        )
    return model, folder


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise OnnxImportError(f"{where!r} is not an ONNX model (protobuf parse failed: {e}); is it truncated?") from None
    if not model.HasField("graph") or model.ir_version <= 0 or not (model.graph.node or model.graph.output):
        raise OnnxImportError(f"{where!r} is not an ONNX model (no graph, IR version or outputs); is it truncated or another format?")
    return model


def _check_opsets(model: onnx.ModelProto) -> None:
    known = onnx.defs.onnx_opset_version()
    versions = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    std = versions.get("ai.onnx")
    if std is None:
        raise OnnxImportError("the model imports no standard ONNX opset (opset_import has no entry for the default domain)")
    if not MIN_IMPORT_OPSET <= std <= known:
        raise OnnxImportError(
            f"the model uses ONNX opset {std}; graphc imports opsets {MIN_IMPORT_OPSET}..{known} (the installed onnx {onnx.__version__})"
        )


def _check_dims(model: onnx.ModelProto) -> None:
    g = model.graph
    for kind, infos in (("input", g.input), ("output", g.output)):
        for info in infos:
            for axis, d in enumerate(info.type.tensor_type.shape.dim):
                if d.HasField("dim_value") and not 0 <= d.dim_value <= MAX_DIM:
                    raise OnnxImportError(f"graph {kind} {info.name!r} axis {axis} has size {d.dim_value}; graphc accepts sizes 0..{MAX_DIM}")
    for t in g.initializer:
        for axis, d in enumerate(t.dims):
            if not 0 <= d <= MAX_DIM:
                raise OnnxImportError(f"initializer {t.name!r} axis {axis} has size {d}; graphc accepts sizes 0..{MAX_DIM}")


def _nbytes(t: onnx.TensorProto) -> int | None:
    """The bytes a tensor's data takes, for fixed-size element types."""
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None
    n = 1
    for d in t.dims:
        n *= d
    return n * itemsize


def _external_refs(model: onnx.ModelProto, folder: Path) -> list[tuple[onnx.TensorProto, Path, int, int]]:
    """Every external-data reference of the main graph's initializers as ``(tensor, file, offset, length)``, checked:
    inside ``folder``, present, long enough."""
    return [_external_ref(t, folder) for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def _external_ref(t: onnx.TensorProto, folder: Path, where: str = "initializer") -> tuple[onnx.TensorProto, Path, int, int]:
    """One tensor's external data as ``(tensor, file, offset, length)``, checked (the file named by its entry must lie in
    ``folder``, a link included; an absent length means the tensor's own size)."""
    from onnx.external_data_helper import ExternalDataInfo

    try:
        info = ExternalDataInfo(t)
        location = info.location
        offset = int(info.offset or 0)
        length = int(info.length) if info.length else None
    except (ValueError, TypeError, AttributeError) as e:
        raise OnnxImportError(f"{where} {t.name!r}: malformed external data entry ({e})") from None
    if not location:
        raise OnnxImportError(f"{where} {t.name!r} is marked external but names no file")
    try:
        target = confined(folder, location, f"{where} {t.name!r}: external data", "model's folder").resolve()
    except SerializationError as e:
        raise OnnxImportError(str(e)) from None
    if not target.is_file():
        raise OnnxImportError(f"{where} {t.name!r}: external data file {location!r} is missing (looked in {str(folder)!r})")
    size = target.stat().st_size
    need = _nbytes(t)
    if need is None:
        raise OnnxImportError(f"{where} {t.name!r}: external data of element type {t.data_type} is not supported")
    if length is None:
        length = need
    if offset < 0 or length < 0:
        raise OnnxImportError(f"{where} {t.name!r}: external data offset {offset} and length {length} must be >= 0")
    if length != need:
        raise OnnxImportError(f"{where} {t.name!r}: external data length {length} bytes, but its shape {list(t.dims)} needs {need}")
    if offset + length > size:
        raise OnnxImportError(
            f"{where} {t.name!r}: external data {location!r} holds {size} bytes, but the tensor needs bytes {offset}..{offset + length}"
        )
    return t, target, offset, length


def _nested_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Tensors held by the nodes of ``graph``: attribute tensors, and every tensor of a subgraph (an ``If`` branch, a
    ``Loop`` body), its initializers included."""
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t
            elif a.type == onnx.AttributeProto.TENSORS:
                yield from a.tensors
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []:
                yield from sub.initializer
                yield from _nested_tensors(sub)


def _inline_nested_external(model: onnx.ModelProto, folder: Path | None) -> None:
    """Nested tensors (subgraph initializers, attribute tensors) that keep their data in a file: checked as the main
    graph's are and read into the model (they travel inside the node graphc carries; a re-export elsewhere would
    point them at another folder)."""
    for t in _nested_tensors(model.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if folder is None:
            raise OnnxImportError(f"tensor {t.name!r} inside a node keeps its data in an external file; pass the model's path, not a ModelProto")
        _, target, offset, length = _external_ref(t, folder, "tensor inside a node")
        with open(target, "rb") as f:
            f.seek(offset)
            t.raw_data = f.read(length)
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT


def _map_tensor(t: onnx.TensorProto, path: Path, offset: int, length: int) -> np.ndarray:
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
    shape = tuple(int(d) for d in t.dims)
    if length == 0:
        return np.zeros(shape, dtype)
    try:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
    except (OSError, ValueError) as e:
        raise OnnxImportError(f"initializer {t.name!r}: cannot map its external data from {str(path)!r}: {e}") from None
