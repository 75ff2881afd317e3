"""Weights from transformers checkpoints: ``.safetensors`` files (memory-mapped) and ``state_dict`` objects.

``load_weights(source)`` returns ``{name: array}`` with transformers' tensor names:

- a ``.safetensors`` file, a list of them, or a directory holding them (with or
  without ``model.safetensors.index.json``): every tensor is a read-only
  ``numpy.memmap`` view of the file, so nothing is copied until a tensor is
  used; graphs keep the views (``Graph.add_initializer(..., copy=False)``), and
  so do the optimizer's untouched weights and the ONNX export's external data;
- a mapping of names to arrays or torch tensors (a model's ``state_dict()``).

The safetensors format is read directly (an 8-byte header length, a JSON header
of dtypes, shapes and byte offsets, then the raw little-endian data) under the
format's rules, and the ``safetensors`` library's parser must accept the file
too; bfloat16 uses ``ml_dtypes``.  A folder's ``model.safetensors.index.json``
may only name files inside the folder (links into a transformers cache's
``blobs`` folder are allowed, as the cache lays them out).  ``dtype=`` converts every tensor (a copy).  Errors name the
file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .dims import MAX_SIZE
from .errors import SerializationError, WeightError
from .folders import confined
from .mapped import check_mapped_files, register_map
from .ops import check_dtype

__all__ = ["load_weights", "read_safetensors", "check_mapped_files", "require_regular_file", "read_json_object", "SAFETENSORS_DTYPES", "bfloat16"]

try:  # ml_dtypes comes with onnx
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover
    bfloat16 = None

SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "BF16": bfloat16,
}
_MAX_HEADER = 100_000_000  # the safetensors library's limit
_U64 = 2**64
_INDEX = "model.safetensors.index.json"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _U64


def _header_entries(path: Path, header: dict[str, Any], data_bytes: int) -> list[tuple[str, Any, tuple[int, ...], int, int]]:
    """The tensors of a parsed header as ``(name, dtype, shape, start, stop)``, checked by the safetensors format's rules.

    As the ``safetensors`` library: shapes and offsets are unsigned integers, element counts do not overflow 64
    bits, each tensor's bytes are its element count times its item size, and the tensors, ordered by offset,
    tile the data section exactly (no gap, no overlap, nothing after the last one).
    """
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise SerializationError(f"{path}: __metadata__ must map names to strings, got {meta!r}")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise SerializationError(f"{path}: tensor {name!r} has a malformed header entry {info!r} (expected dtype, shape and data_offsets)")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise SerializationError(f"{path}: tensor {name!r} has shape {shape!r}; a shape is a list of non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise SerializationError(f"{path}: tensor {name!r} has data_offsets {offsets!r}; expected [begin, end], non-negative integers")
        if any(d > MAX_SIZE for d in shape):
            raise SerializationError(f"{path}: tensor {name!r} has shape {shape}; graphc reads axes up to {MAX_SIZE} (2**48)")
        if not isinstance(dtype, str) or SAFETENSORS_DTYPES.get(dtype) is None:
            readable = ", ".join(k for k, v in SAFETENSORS_DTYPES.items() if v is not None)
            raise SerializationError(f"{path}: tensor {name!r} has dtype {dtype!r}; graphc reads {readable}")
        nbytes = math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize  # Python ints: no overflow
        if nbytes >= _U64:
            raise SerializationError(f"{path}: tensor {name!r} shape {shape} overflows 64-bit byte counts")
        start, stop = offsets
        if stop - start != nbytes:
            raise SerializationError(f"{path}: tensor {name!r} ({dtype}{shape}) needs {nbytes} bytes, its data_offsets {offsets} span {stop - start}")
        entries.append((name, SAFETENSORS_DTYPES[dtype], tuple(shape), start, stop))
    end = 0
    for name, _, _, start, stop in sorted(entries, key=lambda e: (e[3], e[4])):
        if start != end:
            what = "overlaps the tensor before it" if start < end else f"leaves bytes {end}..{start} unused"
            raise SerializationError(f"{path}: tensor {name!r} at bytes {start}..{stop} {what}; tensors must tile the data section")
        end = stop
    if end != data_bytes:
        raise SerializationError(
            f"{path}: the tensors cover {end} bytes of a {data_bytes}-byte data section (truncated, or bytes after the last tensor)"
        )
    return entries


def _library_check(path: Path) -> None:
    """The ``safetensors`` library's own parser must accept the file too (it is the format's reference)."""
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - a core dependency
        return
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except Exception as e:  # noqa: BLE001 - SafetensorError and friends
        raise SerializationError(f"{path}: the safetensors library refuses this file: {e}") from None


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file as a read-only memory-mapped array.

    The header is checked by the format's rules (see :func:`_header_entries`) and by the ``safetensors``
    library's parser; any file it refuses, graphc refuses.  Raises :class:`SerializationError` naming the file
    and the tensor.
    """
    path = Path(path)
    require_regular_file(path, "weights file")
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise SerializationError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > st.st_size:
                raise SerializationError(f"{path}: not a safetensors file (header length {n} bytes in a {st.st_size}-byte file)")
            text = f.read(n).decode("utf-8")
            header = json.loads(text, object_pairs_hook=_no_duplicates)
    except OSError as e:
        raise SerializationError(f"cannot read weights file {str(path)!r}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SerializationError(f"{path}: not a safetensors file (its header is not valid JSON: {e})") from None
    if not isinstance(header, dict):
        raise SerializationError(f"{path}: not a safetensors file (its header is not a JSON object)")
    base = 8 + n
    entries = _header_entries(path, header, st.st_size - base)
    _library_check(path)
    out: dict[str, np.ndarray] = {}
    raw: np.ndarray
    if st.st_size > base:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        register_map(raw, str(path), st)
    else:
        raw = np.zeros(0, np.uint8)
    for name, np_dtype, shape, start, stop in entries:
        out[name] = raw[base + start : base + stop].view(np.dtype(np_dtype).newbyteorder("<")).reshape(shape)
    return out


def require_regular_file(path: str | Path, what: str) -> None:
    """Raise :class:`SerializationError` unless ``path`` is a regular file (links followed): opening a FIFO or a device
    to read it would block or never end."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise SerializationError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise SerializationError(f"{what} {str(path)!r} is {kind}, not a regular file; graphc reads regular files only")


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in the regular file ``path`` (``what`` names it in errors: "config", "generation config")."""
    require_regular_file(path, what)
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise SerializationError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SerializationError(f"{path}: not a JSON {what}: {e}") from None
    if not isinstance(doc, dict):
        raise SerializationError(f"{path}: a {Path(path).name} holds a JSON object, got {type(doc).__name__}")
    return doc


def _confined(folder: Path, entry: Any, where: str) -> Path:
    """``folder / entry`` confined to the checkpoint folder (see :func:`graphc.folders.confined`)."""
    return confined(folder, entry, where, "checkpoint folder")


def _read_index(index: Path) -> dict[str, str]:
    require_regular_file(index, "safetensors index")
    try:
        doc = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)
    except OSError as e:
        raise SerializationError(f"cannot read {str(index)!r}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SerializationError(f"{index}: not a safetensors index (not valid JSON: {e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise SerializationError(f'{index}: not a safetensors index (expected an object with a "weight_map" of tensor name -> file name)')
    return weight_map


def _files(source: str | Path | Iterable[str | Path]) -> tuple[list[Path], dict[str, str] | None]:
    """The files to read, and the index's weight map when the source is a folder with one."""
    if isinstance(source, (str, Path)):
        p = Path(source)
        if p.is_dir():
            index = p / _INDEX
            if index.exists():
                weight_map = _read_index(index)
                return [_confined(p, f, str(index)) for f in sorted(set(weight_map.values()))], weight_map
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise SerializationError(f"{p}: no .safetensors files in this directory")
            return [_confined(p, f.name, str(p)) for f in files], None
        return [p], None
    if isinstance(source, bytes) or not isinstance(source, Iterable):
        raise WeightError(f"weights must be a .safetensors path, a folder, a list of paths or a state dict, got {type(source).__name__}")
    paths = list(source)
    bad = [x for x in paths if not isinstance(x, (str, Path))]
    if bad:
        raise WeightError(f"a list of weight files holds {type(bad[0]).__name__} {bad[0]!r}; expected paths")
    return [Path(s) for s in paths], None


def _as_array(name: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            if bfloat16 is None:  # pragma: no cover
                raise WeightError(f"tensor {name!r} is bfloat16, which needs ml_dtypes")
            return t.view(dtype=__import__("torch").int16).numpy().view(bfloat16)
        return t.numpy()
    raise WeightError(f"tensor {name!r} is a {type(value).__name__}, expected a numpy array or a torch tensor")


def load_weights(source: str | Path | Iterable[str | Path] | Mapping[str, Any], dtype: str | None = None, prefix: str = "") -> dict[str, np.ndarray]:
    """Tensors by name from safetensors file(s) or a directory of them, or from a ``state_dict``; see the module doc.

    ``dtype`` converts every floating tensor to that dtype (a copy); ``prefix`` keeps only names starting with it.
    """
    if isinstance(source, Mapping):
        out = {name: _as_array(name, value) for name, value in source.items()}
    else:
        out = {}
        files, weight_map = _files(source)
        for path in files:
            for name, arr in read_safetensors(path).items():
                if name in out:
                    raise SerializationError(f"tensor {name!r} is in more than one file (again in {path})")
                out[name] = arr
        listed = weight_map or {}
        missing = sorted(set(listed) - set(out))
        if missing:
            raise SerializationError(f"{_INDEX} lists {len(missing)} tensor(s) no file holds, e.g. {missing[0]!r} (in {listed[missing[0]]!r})")
    if prefix:
        out = {k: v for k, v in out.items() if k.startswith(prefix)}
    if dtype is not None:
        target = np.dtype(check_dtype(dtype))
        out = {k: (v.astype(target) if (v.dtype.kind == "f" or v.dtype == bfloat16) and v.dtype != target else v) for k, v in out.items()}
    return out
