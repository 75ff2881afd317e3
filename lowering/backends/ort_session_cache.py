"""onnxruntime CPU sessions built once and loaded from then on: the optimized model and its weights (float32
conversions, packed forms), kept in the folder ``GRAPHC_WEIGHT_CACHE`` names.

A session that packs its weights (``prepack=True``) or reads a bfloat16 or float16 checkpoint through a float32
conversion has an entry; one that reads a float32 checkpoint's files as they are has none (a saved copy would only be
read back).  With ``GRAPHC_WEIGHT_CACHE`` set, the first such session of a graph is built as usual and also saved
there, and every later session of the same graph loads the entry, its weights memory-mapped, and converts nothing:

- a packed session is saved by onnxruntime itself (``optimized_model_filepath``, the weights in one external file, the
  packed ones too: ``session.save_external_prepacked_constant_initializers``) and loaded with its rewrites off.
  onnxruntime 1.32 still packs each weight again while it loads a saved session (the key it finds the saved form by
  is a hash of the packed bytes), so a packed session's warm load saves the rewrites and the conversion, not the
  packing; the saved forms spare the memory of a second packed copy;
- an unpacked session of a converted checkpoint reads its float32 weights from memory
  (:mod:`lowering.backends.ort_weights`), and graphc writes the entry itself (:func:`write_entry`): the exported model
  with those weights in one external file, written once (onnxruntime's own save would read them back and write them
  again); onnxruntime runs its rewrites when it loads it, a fraction of a second for a model whose projections read
  their weights as stored.

The entry's key (:func:`entry_for`) covers what the session is built from: the exported model's bytes, the bytes of
every weight handed over or converted (or, for a weight mapped from a file, the file's path, size and modification
time), and the onnxruntime and graphc versions, the CPU's model and flags.  Anything else gives another entry; an
entry is written to a temporary folder beside it and renamed into place when complete, so a run that stops half way
leaves no entry behind.  Reads and writes stay inside the cache folder: a ``sessions`` entry there that is a link is
refused, and an entry (or its files) that is a link is not loaded from.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from graphc.errors import BackendError
from graphc.mapped import mapped_location

from .ort_weights import aligned_offsets, write_at

__all__ = ["CACHE_ENV", "cache_root", "entry_for", "ready", "save_into", "write_entry", "load_options", "commit"]

CACHE_ENV = "GRAPHC_WEIGHT_CACHE"
_MODEL, _DATA = "model.onnx", "weights.bin"
_EXPORTED = "exported.onnx"  # an entry graphc wrote: the export itself, onnxruntime's rewrites still to run


def _cpu() -> bytes:
    """The CPU's model name and flags (packed weights are laid out for the kernels this CPU runs)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor().encode()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))})).encode()


def _array_identity(arr: np.ndarray) -> bytes:
    """A weight as the key sees it: a mapped file's path, offset, size and modification time, else its bytes' digest."""
    where = mapped_location(arr)
    if where is not None:
        st = os.stat(where.path)
        return f"file:{os.path.realpath(where.path)}:{where.offset}:{where.length}:{st.st_size}:{st.st_mtime_ns}:{arr.dtype}:{arr.shape}".encode()
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return b"bytes:" + hashlib.sha256(raw.data).digest() + f"{arr.dtype}{arr.shape}".encode()


def _folder_files(folder: str | None, model: bytes) -> Iterable[bytes]:
    """The identity of each file of the model's external-data folder that the model names."""
    if folder is None:
        return []
    out = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if os.path.isfile(path) and entry.encode() in model:
            st = os.stat(path)
            out.append(f"{entry}:{st.st_size}:{st.st_mtime_ns}".encode())
    return out


def cache_root(provider: str) -> Path | None:
    """``GRAPHC_WEIGHT_CACHE/sessions`` (made on first use); None when the variable is unset or the provider is not the
    CPU's."""
    root = os.environ.get(CACHE_ENV)
    if not root or provider != "CPUExecutionProvider":
        return None
    sessions = Path(root) / "sessions"
    if sessions.is_symlink():
        raise BackendError(f"{sessions} is a link; graphc writes its session cache only inside {root} itself: remove the link")
    sessions.mkdir(parents=True, exist_ok=True)
    return sessions


def entry_for(root: Path, model: bytes, arrays: Iterable[np.ndarray], folder: str | None, settings: Iterable[str]) -> Path:
    """The entry under ``root`` (:func:`cache_root`) of a session built from ``model`` (the exported bytes), ``arrays``
    (the weights handed over or converted), the files of ``folder`` and the session's ``settings`` that change what it
    saves (its optimizers turned off, whether it packs)."""
    import onnxruntime as ort

    import graphc

    h = hashlib.sha256()
    for part in (model, _cpu(), ort.__version__.encode(), graphc.__version__.encode(), ",".join(sorted(settings)).encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    for part in [*(_array_identity(a) for a in arrays), *_folder_files(folder, model)]:
        h.update(len(part).to_bytes(8, "little") + part)
    return root / h.hexdigest()[:32]


def ready(entry: Path | None) -> bool:
    """Whether ``entry`` holds a complete saved session, read inside the cache folder only: neither the entry nor its
    files may be links (one planted there is not followed; the session is then built again, and the entry kept as it is)."""
    if entry is None or entry.is_symlink() or any((entry / f).is_symlink() for f in (_MODEL, _EXPORTED, _DATA)):
        return False
    return (entry / _MODEL).is_file() or (entry / _EXPORTED).is_file()


def save_into(so: Any, entry: Path) -> Path:
    """Ask onnxruntime to save the session it builds with ``so`` into a new temporary folder beside ``entry``
    (returned; :func:`commit` renames it into place)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    so.optimized_model_filepath = str(staging / _MODEL)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", _DATA)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    return staging


def commit(staging: Path, entry: Path) -> None:
    """The saved session in ``staging`` becomes ``entry`` (another process's entry, if it came first, is kept)."""
    try:
        os.rename(staging, entry)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def write_entry(entry: Path, model: bytes, arrays: Mapping[str, np.ndarray]) -> None:
    """Save a session built from ``model`` (an export whose weights are placeholders) and ``arrays`` (each placeholder's
    data) as ``entry``: the model, each array external data at a page boundary of one weights file.  Written in a
    temporary folder beside the entry and renamed into place when complete."""
    import onnx

    saved = onnx.load_from_string(model)
    tensors = {t.name: t for t in saved.graph.initializer}
    missing = [t.name for t in saved.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL and t.name not in arrays]
    if missing:
        raise BackendError(f"cannot save the session of {entry.name}: weights {missing[:3]} are read from files outside the cache")
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        fd = os.open(staging / _DATA, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            offsets, _ = aligned_offsets([arr.nbytes for arr in arrays.values()])
            for (name, arr), offset in zip(arrays.items(), offsets):
                tensor = tensors[name]
                del tensor.external_data[:]
                for key, value in (("location", _DATA), ("offset", str(offset)), ("length", str(arr.nbytes))):
                    item = tensor.external_data.add()
                    item.key, item.value = key, value
                write_at(fd, np.ascontiguousarray(arr), offset)
        finally:
            os.close(fd)
        (staging / _EXPORTED).write_bytes(saved.SerializeToString())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    commit(staging, entry)


def load_options(so: Any, entry: Path) -> str:
    """Options and path to load the saved session of ``entry``: onnxruntime's saved model has its rewrites done, so
    onnxruntime runs none; graphc's export gets them (its weights file lies beside it)."""
    import onnxruntime as ort

    if (entry / _EXPORTED).is_file():
        return str(entry / _EXPORTED)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return str(entry / _MODEL)
