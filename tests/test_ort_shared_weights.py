"""Low-precision weights converted to float32 in memory and read there by onnxruntime's CPU session: no file written,
no second copy made by onnxruntime, the numbers of the weights serialized into the model.

Every test lowers ``inline_weights_max_bytes`` to 0, so a small layer takes the path a 1B bfloat16 checkpoint takes,
and compares with the weights inline (onnxruntime's own Cast: equal to the bit) and with the NumPy backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import graphc
from graphc.weights import load_weights
from lowering import prepare
from lowering.backends import ort_backend, ort_weights
from lowering.backends.ort_options import OrtOptions
from lowering.backends.registry import _export

from conftest import installed

pytestmark = pytest.mark.skipif(not installed("ort-cpu"), reason="onnxruntime is not installed")

CFG = graphc.gqa(64, 8, 2)


@pytest.fixture
def no_cache_folder(tmp_path, monkeypatch):
    """No ``GRAPHC_WEIGHT_CACHE``; the system's temporary folder is an empty folder the test reads afterwards."""
    import tempfile

    monkeypatch.delenv("GRAPHC_WEIGHT_CACHE", raising=False)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    return temporary


def _mapped_layer(folder: Path, dtype: str) -> graphc.Graph:
    built = graphc.attention_layer_graph(CFG, seed=0, dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in built.initializers.items()}, str(folder / "model.safetensors"))
    return graphc.attention_layer_graph(CFG, weights=load_weights(folder), dtype=dtype)


def _inputs(g: graphc.Graph, dtype: str) -> dict[str, np.ndarray]:
    x = np.random.default_rng(1).standard_normal((2, 5, CFG.d_model)).astype(np.float32)
    return {g.inputs[0]: x.astype(dtype)}


def _check_numbers(g: graphc.Graph, runner, inputs: dict[str, np.ndarray]) -> None:
    """The runner's outputs equal the inline session's to the bit and the NumPy backend's within rounding."""
    got = runner.run(inputs)
    inline = prepare(g, "ort-cpu", inline_weights_max_bytes=None).run(inputs)
    ref = prepare(g, "numpy").run(inputs)
    for name in ref:
        np.testing.assert_array_equal(got[name], inline[name])
        np.testing.assert_allclose(got[name].astype(np.float32), ref[name].astype(np.float32), atol=2e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_conversion_is_read_in_place_and_nothing_is_written(tmp_path, no_cache_folder, monkeypatch, dtype):
    g = _mapped_layer(tmp_path / "ckpt", dtype)
    inputs = _inputs(g, dtype)
    plans: list[ort_weights.SessionWeights] = []
    monkeypatch.setattr(ort_backend, "plan_session_weights", lambda *a, **k: plans.append(ort_weights.plan_session_weights(*a, **k)) or plans[-1])
    runner = prepare(g, "ort-cpu", inline_weights_max_bytes=0, prepack=False)  # packed, the session would read its own copy
    weight_bytes = sum(a.nbytes for a in g.initializers.values())
    assert f"{weight_bytes * 2 / 1024:.1f} KiB converted to float32 in memory" in runner.weights, runner.weights
    _check_numbers(g, runner, inputs)
    assert list(no_cache_folder.iterdir()) == []
    shared = plans[0].shared  # the runner's (the others are _check_numbers' sessions)
    assert set(shared) == set(g.initializers)
    for name, converted in shared.items():  # exact: every bfloat16 and float16 value is a float32 value
        np.testing.assert_array_equal(converted, g.initializers[name].astype(np.float32))
    before = runner.run(inputs)[g.outputs[0]]
    assert np.abs(before.astype(np.float32)).max() > 0
    shared["o_proj.weight"][...] = 0  # the session reads this memory, not a copy of it
    np.testing.assert_array_equal(runner.run(inputs)[g.outputs[0]].astype(np.float32), 0)


def test_past_the_memory_cap_the_conversion_goes_to_a_temporary_file(tmp_path, no_cache_folder, monkeypatch):
    g = _mapped_layer(tmp_path / "ckpt", "bfloat16")
    monkeypatch.setattr(ort_weights, "memory_cap", lambda: 1024)
    runner = prepare(g, "ort-cpu", inline_weights_max_bytes=0)
    assert f"converted to float32 files in {no_cache_folder}" in runner.weights, runner.weights
    _check_numbers(g, runner, _inputs(g, "bfloat16"))


def _standard_export(*args, fused_matmul: bool = False, **kwargs):
    """ort-cpu's export without FusedMatMul: each weight read through a Transpose, which onnxruntime folds."""
    return _export(*args, **kwargs)


def test_a_weight_onnxruntime_may_fold_is_handed_over(tmp_path, no_cache_folder):
    g = _mapped_layer(tmp_path / "ckpt", "bfloat16")
    runner = ort_backend.prepare_ort("CPUExecutionProvider", g, _standard_export, options=OrtOptions(inline_weights_max_bytes=0))
    weight_bytes = sum(a.nbytes for a in g.initializers.values())
    assert runner.weights.endswith(f"{weight_bytes * 2 / 1024:.1f} KiB handed over as OrtValues"), runner.weights
    assert "in memory" not in runner.weights
    _check_numbers(g, runner, _inputs(g, "bfloat16"))


def test_a_session_that_reads_a_placeholder_is_built_again_with_the_weights_handed_over(tmp_path, no_cache_folder, monkeypatch):
    """Were a rewrite of onnxruntime's to read a shared weight's bytes from the model, it reads the null device and
    fails; graphc then hands every conversion over, and the numbers are the same."""
    g = _mapped_layer(tmp_path / "ckpt", "bfloat16")
    monkeypatch.setattr(ort_weights, "_SHAREABLE_READERS", ort_weights._SHAREABLE_READERS | {"Transpose"})
    monkeypatch.setattr(ort_weights, "_constant_values", lambda graph: set())  # the Transposes look shareable: folding fails
    builds = []
    real = ort_weights.SessionWeights.hand_shared
    monkeypatch.setattr(ort_weights.SessionWeights, "hand_shared", lambda self: builds.append(bool(self.shared)) or real(self))
    runner = ort_backend.prepare_ort("CPUExecutionProvider", g, _standard_export, options=OrtOptions(inline_weights_max_bytes=0))
    assert builds == [True]
    assert "handed over as OrtValues" in runner.weights and "in memory" not in runner.weights
    _check_numbers(g, runner, _inputs(g, "bfloat16"))
