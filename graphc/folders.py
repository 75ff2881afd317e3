"""Files inside a folder the user named: reads that never leave it, writes that replace names instead of following them.

A name inside a folder can be a symbolic link to anywhere.  graphc reads a checkpoint's files, an ONNX model's
external data and an export's output folder only through :func:`confined` (a link whose target leaves the folder
is refused by name; a transformers cache snapshot's links into its own ``blobs`` stay allowed), and writes only
through :func:`replacing` (a temporary file in the same folder, then ``os.replace``: an existing name, a link
included, is replaced, never written through).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from .errors import SerializationError

__all__ = ["confined", "confined_if_present", "replacing", "write_replacing", "copy_replacing", "inside"]


def inside(root: Path, path: Path) -> bool:
    """Whether ``path`` is ``root`` or lies under it (both absolute, compared as written)."""
    return os.path.commonpath([str(root), str(path)]) == str(root)


def confined(folder: str | Path, entry: Any, where: str, what: str = "folder") -> Path:
    """``folder / entry``, refused unless it stays inside ``folder``.

    ``entry`` must be a relative path that does not climb out of the folder; where it is (or passes through) a
    symbolic link, the link's target must lie in the folder too, or in the ``blobs`` folder of a transformers cache
    repo when ``folder`` is one of its ``snapshots``.  ``where`` names what asked for the file in errors, ``what``
    the kind of folder ("checkpoint folder", "export folder").
    """
    folder = Path(folder)
    if not isinstance(entry, str) or not entry or "\0" in entry:
        raise SerializationError(f"{where}: file name {entry!r} is not a relative path")
    if os.path.isabs(entry) or Path(entry).is_absolute():
        raise SerializationError(f"{where}: file {entry!r} is an absolute path; a {what} names files inside itself ({str(folder)!r})")
    root = folder.resolve()
    lexical = Path(os.path.normpath(root / entry))
    if not inside(root, lexical):
        raise SerializationError(f"{where}: file {entry!r} leaves the {what} {str(folder)!r}; refused")
    real = lexical.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    if not any(inside(a, real) for a in allowed):
        raise SerializationError(f"{where}: file {entry!r} is a link to {str(real)!r}, outside the {what} {str(folder)!r}; refused")
    return lexical


def confined_if_present(folder: str | Path, entry: str, what: str = "checkpoint folder") -> Path | None:
    """``folder / entry`` checked as :func:`confined` when that name exists (a dangling link counts), else None."""
    path = Path(folder) / entry
    if not os.path.lexists(path):
        return None
    return confined(folder, entry, str(path), what)


@contextmanager
def replacing(path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file opened for writing whose content becomes ``path`` when the block ends without an error.

    The data goes to a temporary file in ``path``'s folder, which then replaces the name ``path``: an existing
    file or link there is replaced, never written through, and a failed write leaves ``path`` as it was."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def write_replacing(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` by replacing the name (see :func:`replacing`)."""
    with replacing(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def copy_replacing(source: str | Path, dest: str | Path) -> None:
    """Copy the regular file ``source`` (already confined by the caller) to ``dest`` by replacing the name."""
    with open(source, "rb") as src, replacing(dest) as out:
        shutil.copyfileobj(src, out)
