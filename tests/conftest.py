"""Shared test helpers: which optional backends this machine has."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from lowering import unavailable_reason


def installed(*backends: str) -> list[str]:
    """The given backends that can run here (optional ones such as ``torch`` drop out when not installed)."""
    return [b for b in backends if unavailable_reason(b) is None]


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_pytest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Point ``tempfile`` (and every subprocess, through ``TMPDIR``) at this session's pytest folder, so the folders
    examples, README snippets and the ORT weight files make are removed with pytest's own (it keeps the last three runs)."""
    folder = str(tmp_path_factory.mktemp("tempfile"))
    before_env, before_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = folder, folder
    yield
    tempfile.tempdir = before_dir
    if before_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before_env


_EXPORTS_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """On the controlling process (before pytest-xdist starts its workers, who inherit the variable): a folder where the
    test processes share the models they export (``tests/real_exports.py``)."""
    if not hasattr(config, "workerinput") and "GRAPHC_TEST_EXPORTS" not in os.environ:
        folder = tempfile.mkdtemp(prefix="graphc-test-exports-")
        os.environ["GRAPHC_TEST_EXPORTS"] = folder
        config.stash[_EXPORTS_KEY] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the shared exports folder this process made."""
    folder = config.stash.get(_EXPORTS_KEY, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("GRAPHC_TEST_EXPORTS", None)
