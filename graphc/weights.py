"""Weights from transformers checkpoints: ``.safetensors`` files (memory-mapped) and ``state_dict`` objects.

``load_weights(source)`` returns ``{name: array}`` with transformers' tensor names:

- a ``.safetensors`` file, a list of them, or a directory holding them (with or
  without ``model.safetensors.index.json``): every tensor is a read-only
  ``numpy.memmap`` view of the file, so nothing is copied until a tensor is
  used; graphs keep the views (``Graph.add_initializer(..., copy=False)``), and
  so do the optimizer's untouched weights and the ONNX export's external data;
- a mapping of names to arrays or torch tensors (a model's ``state_dict()``).

The safetensors format is read directly (an 8-byte header length, a JSON header
of dtypes, shapes and byte offsets, then the raw little-endian data); bfloat16
uses ``ml_dtypes``.  ``dtype=`` converts every tensor (a copy).  Errors name the
file and the tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SerializationError, WeightError
from .ops import check_dtype

__all__ = ["load_weights", "read_safetensors", "SAFETENSORS_DTYPES", "bfloat16"]

try:  # ml_dtypes comes with onnx
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover
    bfloat16 = None

SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_, "BF16": bfloat16,
}
_MAX_HEADER = 100 * 2**20


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file as a read-only memory-mapped array."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SerializationError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise SerializationError(f"{path}: not a safetensors file (header length {n} bytes)")
            header = json.loads(f.read(n))
        size = path.stat().st_size
    except OSError as e:
        raise SerializationError(f"cannot read weights file {str(path)!r}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SerializationError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise SerializationError(f"{path}: not a safetensors file (its header is not a JSON object)")
    out: dict[str, np.ndarray] = {}
    base = 8 + n
    raw = np.memmap(path, dtype=np.uint8, mode="r") if size > base else np.zeros(0, np.uint8)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SerializationError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        np_dtype = SAFETENSORS_DTYPES.get(dtype)
        if np_dtype is None:
            raise SerializationError(f"{path}: tensor {name!r} has dtype {dtype!r}; graphc reads {', '.join(k for k, v in SAFETENSORS_DTYPES.items() if v is not None)}")
        itemsize = np.dtype(np_dtype).itemsize
        count = int(np.prod(shape)) if shape else 1
        if stop - start != count * itemsize or base + stop > size:
            raise SerializationError(f"{path}: tensor {name!r} ({dtype}{shape}) does not fit its bytes {start}..{stop} of a {size}-byte file")
        out[name] = raw[base + start : base + stop].view(np.dtype(np_dtype).newbyteorder("<")).reshape(shape)
    return out


def _files(source: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(source, (str, Path)):
        p = Path(source)
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.exists():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (OSError, ValueError, KeyError) as e:
                    raise SerializationError(f"{index}: not a safetensors index ({e})") from None
                return [p / f for f in sorted(set(weight_map.values()))]
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise SerializationError(f"{p}: no .safetensors files in this directory")
            return files
        return [p]
    return [Path(s) for s in source]


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


def load_weights(
    source: str | Path | Iterable[str | Path] | Mapping[str, Any], dtype: str | None = None, prefix: str = ""
) -> dict[str, np.ndarray]:
    """Tensors by name from safetensors file(s) or a directory of them, or from a ``state_dict``; see the module doc.

    ``dtype`` converts every floating tensor to that dtype (a copy); ``prefix`` keeps only names starting with it.
    """
    if isinstance(source, Mapping):
        out = {name: _as_array(name, value) for name, value in source.items()}
    else:
        out = {}
        for path in _files(source):
            for name, arr in read_safetensors(path).items():
                if name in out:
                    raise SerializationError(f"tensor {name!r} is in more than one file (again in {path})")
                out[name] = arr
    if prefix:
        out = {k: v for k, v in out.items() if k.startswith(prefix)}
    if dtype is not None:
        target = np.dtype(check_dtype(dtype))
        out = {k: (v.astype(target) if (v.dtype.kind == "f" or v.dtype == bfloat16) and v.dtype != target else v) for k, v in out.items()}
    return out
