"""Read an ONNX model safely: every way a file can be wrong becomes an :class:`OnnxImportError` naming the culprit.

Checks, before any conversion: the file exists and parses as an ONNX
``ModelProto`` with a graph; external data lives inside the model's folder
(an absolute path or ``..`` that leaves it is refused), exists and is long
enough; the standard opset is one the installed ``onnx`` knows; no declared
dim exceeds :data:`MAX_DIM`.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from ..errors import OnnxImportError

__all__ = ["load_model", "MAX_DIM", "MIN_IMPORT_OPSET"]

MAX_DIM = 1 << 32
"""The largest size graphc accepts for one axis of a declared tensor (no attention model comes near it)."""
MIN_IMPORT_OPSET = 7


def load_model(source: onnx.ModelProto | str | os.PathLike[str]) -> onnx.ModelProto:
    """Return the checked model of ``source`` (a ``ModelProto`` or a path), with external data loaded."""
    if isinstance(source, onnx.ModelProto):
        model, folder = source, None
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise OnnxImportError(f"ONNX model {str(path)!r} does not exist")
        if not path.is_file():
            raise OnnxImportError(f"ONNX model {str(path)!r} is not a file")
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
    if folder is not None:
        _load_external(model, folder)
    elif any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        missing = next(t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data)
        raise OnnxImportError(f"initializer {missing!r} keeps its data in an external file; pass the model's path, not a ModelProto, so graphc can find it")
    return model


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
        raise OnnxImportError(f"the model uses ONNX opset {std}; graphc imports opsets {MIN_IMPORT_OPSET}..{known} (the installed onnx {onnx.__version__})")


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


def _load_external(model: onnx.ModelProto, folder: Path) -> None:
    """Check every external-data reference, then load the data (refusing paths outside ``folder``)."""
    from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_model

    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return
    for t in external:
        info = ExternalDataInfo(t)
        location = info.location
        if not location:
            raise OnnxImportError(f"initializer {t.name!r} is marked external but names no file")
        target = (folder / location).resolve()
        if os.path.isabs(location) or os.path.commonpath([str(target), str(folder)]) != str(folder):
            raise OnnxImportError(f"initializer {t.name!r}: external data path {location!r} leaves the model's folder {str(folder)!r}; refused")
        if not target.is_file():
            raise OnnxImportError(f"initializer {t.name!r}: external data file {location!r} is missing (looked in {str(folder)!r})")
        size = target.stat().st_size
        offset = int(info.offset or 0)
        length = int(info.length) if info.length else _nbytes(t)
        if length is None:
            length = size - offset
        if offset < 0 or offset + length > size:
            raise OnnxImportError(f"initializer {t.name!r}: external data {location!r} holds {size} bytes, but the tensor needs bytes {offset}..{offset + length}")
    try:
        load_external_data_for_model(model, str(folder))
    except (OSError, ValueError) as e:
        raise OnnxImportError(f"cannot load the model's external data from {str(folder)!r}: {e}") from None
