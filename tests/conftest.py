"""Shared test helpers: which optional backends this machine has, a ``backend`` fixture over them, and markers for what a
test module needs, so a developer runs the part they touch::

    python -m pytest -m core               # graphc alone: NumPy, onnxruntime, ONNX's reference evaluator
    python -m pytest -m "not corpus"       # everything but the torch.onnx exports of whole transformers models
    python -m pytest -m gpu                # onnxruntime's CUDA provider (skipped without a GPU)
"""

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


BACKENDS = ("numpy", "ort-cpu", "onnx-reference", "torch")
"""The CPU backends a differential test runs on."""
INSTALLED = installed(*BACKENDS)
"""Those of :data:`BACKENDS` installed here: the list a test module runs over (``from conftest import INSTALLED``)."""


@pytest.fixture(params=INSTALLED)
def backend(request: pytest.FixtureRequest) -> str:
    """Each CPU backend installed here, one test case each."""
    return str(request.param)


NEEDS = {
    "transformers": {"test_hf_parity", "test_causal_lm", "test_generate_text", "test_chat_templates", "test_prequantized",
                     "test_rotary", "test_attention_features", "test_examples", "test_sharding", "test_onnx_torch_export",
                     "test_encoder_exports", "test_torch_attention"},
    "corpus": {"test_real_exports", "test_latent_attention", "test_sharding", "test_encoder_exports"},
    "real_size": {"test_real_size"},
    "gpu": {"test_cuda"},
}  # fmt: skip
"""What each test module needs beyond graphc's own dependencies (torch and transformers, the torch.onnx exports of whole
models, a checkpoint at a real shape, a GPU); every other module is ``core``."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with what its module needs (:data:`NEEDS`), or ``core``."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        needs = [need for need, modules in NEEDS.items() if module in modules]
        for need in needs or ["core"]:
            item.add_marker(getattr(pytest.mark, need))


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
