"""onnxruntime sessions saved once into ``GRAPHC_WEIGHT_CACHE`` and loaded from then on: the same numbers as a session
built anew, one entry per graph and weights, nothing written without the variable, nothing written through a link."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import installed
from safetensors.numpy import save_file

import graphc
from graphc.errors import BackendError
from graphc.weights import load_weights
from lowering import prepare

pytestmark = [pytest.mark.core, pytest.mark.skipif(not installed("ort-cpu"), reason="onnxruntime is not installed")]

CFG = graphc.gqa(64, 8, 2)
PACKED = {"inline_weights_max_bytes": 0, "prepack": True}
"""Weights read from files or handed over, packed: a session the cache saves whatever the weights' dtype."""


def _inputs(g: graphc.Graph) -> dict[str, np.ndarray]:
    x = np.random.default_rng(1).standard_normal((2, 5, 64)).astype(np.float32)
    return {g.inputs[0]: x.astype(g.types[g.inputs[0]].dtype)}


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "sessions").iterdir() if not p.name.startswith(".")) if (root / "sessions").exists() else []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_second_session_loads_what_the_first_saved_and_computes_the_same(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    g = graphc.optimize(graphc.attention_layer_graph(CFG, seed=3, dtype=dtype)).graph
    first = prepare(g, "ort-cpu", **PACKED)
    assert "the session saved to the cache" in first.provider
    second = prepare(g, "ort-cpu", **PACKED)
    assert "the session loaded from the cache" in second.provider
    assert len(_entries(tmp_path / "cache")) == 1
    inputs = _inputs(g)
    want = prepare(g, "numpy").run(inputs)
    for name, ref in want.items():
        np.testing.assert_array_equal(second.run(inputs)[name], first.run(inputs)[name])
        np.testing.assert_allclose(second.run(inputs)[name].astype(np.float32), ref.astype(np.float32), atol=2e-2 if dtype != "float32" else 1e-5)


def test_other_weights_and_a_changed_checkpoint_file_are_other_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    for seed in (0, 1):  # handed-over weights: keyed by their bytes
        prepare(graphc.attention_layer_graph(CFG, seed=seed), "ort-cpu", **PACKED)
    assert len(_entries(tmp_path / "cache")) == 2
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for seed in (5, 6):  # weights read from the checkpoint file: keyed by the file (the same name, new contents)
        built = graphc.attention_layer_graph(CFG, seed=seed)
        save_file({k: np.ascontiguousarray(v) for k, v in built.initializers.items()}, str(folder / "model.safetensors"))
        g = graphc.attention_layer_graph(CFG, weights=load_weights(folder))
        runner = prepare(g, "ort-cpu", **PACKED)
        assert "saved to the cache" in runner.provider
        np.testing.assert_allclose(runner.run(_inputs(g))["out_BSM"], prepare(g, "numpy").run(_inputs(g))["out_BSM"], atol=1e-5)
    assert len(_entries(tmp_path / "cache")) == 4


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.delenv("GRAPHC_WEIGHT_CACHE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where any temporary folder would go
    runner = prepare(graphc.attention_layer_graph(CFG), "ort-cpu", **PACKED)
    assert "cache" not in runner.provider
    assert list(tmp_path.iterdir()) == []


def test_a_sessions_link_is_refused(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "sessions").symlink_to(elsewhere)
    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(BackendError, match=r"sessions is a link; graphc writes its session cache only inside"):
        prepare(graphc.attention_layer_graph(CFG), "ort-cpu", **PACKED)
    assert list(elsewhere.iterdir()) == []


def test_a_link_planted_in_the_cache_is_never_followed(tmp_path, monkeypatch):
    """An entry, or its model or weights file, that is a link to a folder outside the cache: not loaded from, not
    written through; the session is built from the graph (its numbers), and the outside files stay as they were."""
    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    g = graphc.attention_layer_graph(CFG, seed=7)
    first = prepare(g, "ort-cpu", **PACKED)
    (entry,) = _entries(tmp_path / "cache")
    outside = tmp_path / "outside"
    entry.rename(outside)  # a complete saved session, now outside the cache
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    entry.symlink_to(outside)
    linked = prepare(g, "ort-cpu", **PACKED)
    assert "loaded from the cache" not in linked.provider
    entry.unlink()
    entry.mkdir()
    (entry / "model.onnx").symlink_to(outside / "model.onnx")
    assert "loaded from the cache" not in prepare(g, "ort-cpu", **PACKED).provider
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    inputs = _inputs(g)
    np.testing.assert_array_equal(linked.run(inputs)["out_BSM"], first.run(inputs)["out_BSM"])


@pytest.mark.parametrize("planted", ["entry", "exported.onnx", "weights.bin"])
def test_a_link_planted_in_graphcs_own_entry_is_never_followed(tmp_path, monkeypatch, planted):
    """The entry graphc writes for a converted checkpoint (its export and float32 weights): the entry, or one of its
    files, a link to files outside the cache is not loaded from and not written through; the session is built from
    the graph again, with its numbers."""
    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    g = graphc.optimize(graphc.attention_layer_graph(CFG, seed=8, dtype="bfloat16")).graph
    options = {"inline_weights_max_bytes": 0, "prepack": False}
    first = prepare(g, "ort-cpu", **options)
    (entry,) = _entries(tmp_path / "cache")
    outside = tmp_path / "outside"
    entry.rename(outside)  # a complete entry, now outside the cache
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    if planted == "entry":
        entry.symlink_to(outside)
    else:
        entry.mkdir()
        for name in ("exported.onnx", "weights.bin"):
            (entry / name).symlink_to(outside / name) if name == planted else (entry / name).write_bytes(before[name])
    again = prepare(g, "ort-cpu", **options)
    assert "loaded from the cache" not in again.provider
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    inputs = _inputs(g)
    np.testing.assert_array_equal(again.run(inputs)["out_BSM"], first.run(inputs)["out_BSM"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_unpacked_session_is_saved_only_when_it_converts_weights(tmp_path, monkeypatch, dtype):
    """Unpacked, a float32 session reads the weights as they are (a saved copy would only be read back): no entry; a
    bfloat16 one converts them to float32 in memory, graphc writes the export and that conversion once as the entry
    (nothing else is written, in the cache folder or the temporary one), the next session loads it, and both compute
    the numbers of the weights serialized into the model."""
    import tempfile

    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    g = graphc.optimize(graphc.attention_layer_graph(CFG, seed=4, dtype=dtype)).graph
    first = prepare(g, "ort-cpu", inline_weights_max_bytes=0, prepack=False)
    second = prepare(g, "ort-cpu", inline_weights_max_bytes=0, prepack=False)
    saved = dtype == "bfloat16"
    assert ("the session saved to the cache" in first.provider) == saved
    assert ("the session loaded from the cache" in second.provider) == saved
    assert len(_entries(tmp_path / "cache")) == int(saved)
    assert list((tmp_path / "tmp").iterdir()) == []
    if saved:
        (entry,) = _entries(tmp_path / "cache")
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["sessions"]
        assert sorted(p.name for p in entry.iterdir()) == ["exported.onnx", "weights.bin"]
        float32_bytes = sum(a.size * 4 for a in g.initializers.values() if a.nbytes >= 1024)
        assert float32_bytes <= (entry / "weights.bin").stat().st_size < float32_bytes + 4096 * len(g.initializers)
    inputs = _inputs(g)
    inline = prepare(g, "ort-cpu", inline_weights_max_bytes=None).run(inputs)
    for name, got in first.run(inputs).items():
        np.testing.assert_array_equal(second.run(inputs)[name], got)
        np.testing.assert_array_equal(got, inline[name])
