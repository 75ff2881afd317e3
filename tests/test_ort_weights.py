"""Weights reach onnxruntime without a protobuf holding them: read from the checkpoint's own files, or handed over.

Every test lowers ``inline_weights_max_bytes`` to 0, so small models take the path that
models past protobuf's 2 GiB limit take, and compares with the weights serialized
into the model (the same onnxruntime kernels: equal to the bit) and with the NumPy
backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.numpy import save_file

import graphc
from graphc.errors import BackendError, ExportError
from graphc.mapped import all_finite, mapped_location, release_mapped_pages
from graphc.weights import load_weights
from lowering import export, prepare
from lowering.backends.ort_weights import plan_session_weights

from conftest import installed

pytestmark = pytest.mark.skipif(not installed("ort-cpu"), reason="onnxruntime is not installed")

CFG = graphc.gqa(64, 8, 2)


def _mapped_layer(folder: Path, dtype: str = "float32", seed: int = 0, cfg: graphc.AttentionConfig = CFG) -> graphc.Graph:
    """An attention layer whose weights are views of a safetensors file in ``folder``."""
    built = graphc.attention_layer_graph(cfg, seed=seed, dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in built.initializers.items()}, str(folder / "model.safetensors"))
    return graphc.attention_layer_graph(cfg, weights=load_weights(folder), dtype=dtype)


def _inputs(g: graphc.Graph, dtype: str = "float32") -> dict[str, np.ndarray]:
    d_model = g.types[g.inputs[0]].shape[-1]
    x = np.random.default_rng(1).standard_normal((2, 5, d_model)).astype(np.float32)
    return {g.inputs[0]: x.astype(dtype)}


def _same_as_inline(g: graphc.Graph, inputs: dict[str, np.ndarray], **options) -> str:
    placed = prepare(g, "ort-cpu", inline_weights_max_bytes=0, **options)
    inline = prepare(g, "ort-cpu", inline_weights_max_bytes=None, **options)
    got, want = placed.run(inputs), inline.run(inputs)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    ref = prepare(g, "numpy").run(inputs)
    for name in ref:
        np.testing.assert_allclose(got[name].astype(np.float32), ref[name].astype(np.float32), atol=2e-2 if "16" in str(ref[name].dtype) else 1e-5)
    return placed.weights


def test_mapped_weights_are_read_from_the_checkpoint_file(tmp_path):
    g = _mapped_layer(tmp_path / "ckpt")
    assert all(mapped_location(a) is not None for a in g.initializers.values())
    where = _same_as_inline(g, _inputs(g))
    assert "read from the checkpoint files in " + str((tmp_path / "ckpt").resolve()) in where
    assert "handed" not in where


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d_model", [64, 48])  # 48: float32 tensors of 9216 and 3072 bytes, so later ones start at padded offsets
def test_low_precision_weights_reach_the_cpu_provider_as_float32_files(tmp_path, monkeypatch, dtype, d_model):
    """onnxruntime's CPU kernels compute in float32: graphc converts the weights into a cache folder (no Cast left for
    onnxruntime to fold), with the numbers of the weights serialized as they are, and removes the folder with the runner."""
    import gc

    import lowering.backends.ort_weights as ort_weights

    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ort_weights, "_CHUNK", 1000)  # each weight converted in several chunks, on several threads
    g = _mapped_layer(tmp_path / "ckpt", dtype, cfg=graphc.gqa(d_model, 8, 2))
    where = _same_as_inline(g, _inputs(g, dtype))
    weight_bytes = sum(a.nbytes for a in g.initializers.values())
    assert f"{weight_bytes * 2 / 1024:.1f} KiB converted to float32 files in {tmp_path / 'cache'}" in where, where
    plan = plan_session_weights(g.initializers, 0, widen=True)
    model = export(g, place_weights=plan)
    plan.widen_casts(model)
    assert not [n for n in model.graph.node if n.op_type == "Cast" and n.input[0] in g.initializers]
    assert {t.data_type for t in model.graph.initializer if t.name in g.initializers} == {1}  # float32
    folder = Path(plan.folder)
    assert (folder / "weights.f32").stat().st_size >= 2 * weight_bytes
    del plan
    gc.collect()
    assert not folder.exists()


def test_projections_read_their_weights_as_stored_on_the_cpu_provider(tmp_path):
    """ort-cpu's export writes ``x @ W.T`` over an ``[out, in]`` weight as ``FusedMatMul(transB=1)``: no ``Transpose``
    of a weight is left for onnxruntime to fold into a copy.  The default export keeps the standard ops, and the two
    compute the same numbers (onnxruntime on both, against NumPy), packed or not."""
    import onnxruntime as ort

    g = _mapped_layer(tmp_path / "ckpt")
    inputs = _inputs(g)
    weights = set(g.initializers)
    fused = export(g, fused_matmul=True)
    standard = export(g)
    assert not [n for n in fused.graph.node if n.op_type == "Transpose" and n.input[0] in weights]
    products = [n for n in fused.graph.node if n.op_type == "FusedMatMul"]
    assert {n.input[1] for n in products} == {n.input[0] for n in standard.graph.node if n.op_type == "Transpose" and n.input[0] in weights}
    assert all(n.domain == "com.microsoft" and {a.name: a.i for a in n.attribute}["transB"] == 1 for n in products)
    assert "com.microsoft" not in {o.domain for o in standard.opset_import} and "FusedMatMul" not in {n.op_type for n in standard.graph.node}
    ref = prepare(g, "numpy").run(inputs)
    runs = {}
    for name, model in (("fused", fused), ("standard", standard)):
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        runs[name] = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, inputs)))
    for packed in (False, True, None):
        runs[f"prepack={packed}"] = prepare(g, "ort-cpu", inline_weights_max_bytes=0, prepack=packed).run(inputs)
    for got in runs.values():
        for name, want in ref.items():
            np.testing.assert_allclose(got[name], want, atol=1e-5)


def test_weights_are_packed_by_default_only_while_packing_is_cheap(tmp_path, monkeypatch):
    """``prepack=None`` packs weights of up to ``PREPACK_AUTO_MAX_BYTES`` in float32 and leaves larger ones as stored
    (a bfloat16 weight counted at its float32 size); the session's config says which; a bad value is named."""
    import lowering.backends.ort_backend as ort_backend
    from lowering.backends import ort_options

    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(ort_backend, "packing_entry", lambda prepack: seen.append(ort_options.packing_entry(prepack)) or seen[-1])
    for dtype in ("float32", "bfloat16"):
        g = _mapped_layer(tmp_path / dtype, dtype)
        float32_bytes = sum(a.size * 4 for a in g.initializers.values())
        for limit, packed in ((float32_bytes, True), (float32_bytes - 1, False)):
            monkeypatch.setattr(ort_backend, "PREPACK_AUTO_MAX_BYTES", limit)
            seen.clear()
            prepare(g, "ort-cpu", inline_weights_max_bytes=0)
            assert seen == [ort_options.packing_entry(packed)], (dtype, limit)
    with pytest.raises(BackendError, match=r"prepack must be True, False or None"):
        prepare(g, "ort-cpu", prepack="yes")


def test_the_model_carries_no_weight_bytes(tmp_path):
    g = _mapped_layer(tmp_path / "ckpt")
    plan = plan_session_weights(g.initializers, 0)
    model = export(g, place_weights=plan)
    weight_bytes = sum(a.nbytes for a in g.initializers.values())
    assert plan.file_bytes == weight_bytes and plan.inline_bytes == 0
    assert model.ByteSize() < weight_bytes / 4
    external = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data}
    where = mapped_location(g.initializers["q_proj.weight"])
    assert external["q_proj.weight"] == {"location": "model.safetensors", "offset": str(where.offset), "length": str(64 * 64 * 4)}


def test_weights_not_in_any_file_are_handed_over(tmp_path):
    g = graphc.attention_layer_graph(CFG, seed=3)  # seeded weights: in memory, not mapped
    where = _same_as_inline(g, _inputs(g))
    assert "handed over as OrtValues" in where and "checkpoint files" not in where


def test_weights_of_a_second_folder_are_handed_over(tmp_path):
    first = _mapped_layer(tmp_path / "a")
    second = _mapped_layer(tmp_path / "b", seed=5)
    g = graphc.attention_layer_graph(CFG, weights={**first.initializers, "o_proj.weight": second.initializers["o_proj.weight"]})
    plan = plan_session_weights(g.initializers, 0)
    assert plan.folder == str((tmp_path / "a").resolve())
    where = _same_as_inline(g, _inputs(g))
    assert "handed over" in where and "checkpoint files" in where


def test_a_worker_process_session_reads_the_files_and_inlines_the_rest(tmp_path):
    g = _mapped_layer(tmp_path / "ckpt")
    where = _same_as_inline(g, _inputs(g), isolate=True)
    assert "checkpoint files" in where
    computed = graphc.attention_layer_graph(CFG, seed=3)
    assert "handed" not in _same_as_inline(computed, _inputs(computed), isolate=True)


def test_below_the_threshold_everything_is_inline(tmp_path):
    g = _mapped_layer(tmp_path / "ckpt")
    runner = prepare(g, "ort-cpu", inline_weights_max_bytes=1 << 20)
    assert runner.weights.endswith("in the model")


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_threshold_is_named(tmp_path, bad):
    g = graphc.attention_layer_graph(CFG)
    with pytest.raises(BackendError, match="inline_weights_max_bytes must be a non-negative int or None"):
        prepare(g, "ort-cpu", inline_weights_max_bytes=bad)


def test_export_takes_one_placement(tmp_path):
    g = graphc.attention_layer_graph(CFG)
    with pytest.raises(ExportError, match="pass one"):
        export(g, tmp_path / "m.onnx", external_data=True, place_weights=plan_session_weights(g.initializers, 0))


def test_finiteness_of_mapped_weights_is_read_in_chunks_and_remembered(tmp_path, monkeypatch):
    import graphc.mapped as mapped

    w = np.ones((300, 100), np.float32)
    w[299, 99] = -np.inf
    save_file({"w": w, "ok": np.ones((300, 100), np.float32)}, str(tmp_path / "m.safetensors"))
    arrays = load_weights(tmp_path)
    monkeypatch.setattr(mapped, "_CHUNK", 4096)  # many chunks: the last one holds the -inf
    assert not all_finite(arrays["w"]) and all_finite(arrays["ok"])
    assert all_finite(np.ones(3, np.float32)) and not all_finite(np.array([np.nan], np.float32))
    calls = []
    monkeypatch.setattr(mapped, "_finite_chunk", lambda chunk, found: calls.append(1) or True)
    assert not all_finite(arrays["w"])  # remembered, not read again
    assert calls == []
    assert release_mapped_pages() >= 2 * w.nbytes
    np.testing.assert_array_equal(arrays["w"], w)  # released pages read back from the file


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_finiteness_of_many_weights_is_read_on_threads_with_the_same_answers(tmp_path, monkeypatch, threads):
    import graphc.mapped as mapped

    rng = np.random.default_rng(0)
    stored = {f"w{i}": rng.standard_normal((64, 50)).astype(np.float32) for i in range(6)}
    stored["w2"][63, 49], stored["w4"][0, 0] = np.nan, np.inf
    save_file(stored, str(tmp_path / "m.safetensors"))
    monkeypatch.setattr(mapped, "_CHUNK", 1024)  # several chunks each
    arrays = [*load_weights(tmp_path).values(), np.array([1.0, -np.inf], np.float32), np.ones(4, "bfloat16")]
    want = [bool(np.isfinite(np.asarray(a, np.float32)).all()) for a in arrays]
    assert want.count(False) == 3
    assert mapped.all_finite_each(arrays, threads=threads) == want


@settings(max_examples=60, deadline=None)
@given(bits=hnp.arrays(np.uint16, st.integers(0, 300)), dtype=st.sampled_from(["bfloat16", "float16"]))
def test_a_two_byte_float_is_finite_as_its_float32_value_is(bits, dtype):
    """The exponent-bit test for bfloat16 and float16 against NumPy's ``isfinite`` of the widened values (every bit
    pattern: infinities, NaNs, subnormals, signed zeros)."""
    values = bits.view(dtype)
    assert all_finite(values) == bool(np.isfinite(values.astype(np.float32)).all())


def test_a_causal_lm_checkpoint_generates_the_same_tokens_from_its_files(tmp_path):
    """A save_pretrained folder: ort-cpu with the weights read from the folder gives the NumPy backend's tokens."""
    from lowering import generate

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    g = graphc.causal_lm_from_hf(tmp_path / "config.json", load_weights(tmp_path))
    prompts = [[5, 17, 33], [7, 1, 90, 44, 12, 60]]
    runner = prepare(g, "ort-cpu", inline_weights_max_bytes=0)
    assert "checkpoint files" in runner.weights
    got = generate(g, prompts, 6, runner=runner).new_tokens
    np.testing.assert_array_equal(got, generate(g, prompts, 6).new_tokens)
    from lowering import left_pad

    ids, mask = left_pad(prompts)
    with torch.no_grad():
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        out = model.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=6, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(got, out[:, ids.shape[1] :].numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_torch_backend_shares_the_mapped_weights(tmp_path, dtype):
    """On the CPU the torch backend's weight tensors are the mapped file's bytes (no copy), and compute as the NumPy backend."""
    torch = pytest.importorskip("torch")
    from lowering.backends.torch_backend import _weight

    g = _mapped_layer(tmp_path / "ckpt", dtype)
    w = g.initializers["q_proj.weight"]
    t = _weight(torch, w, torch.device("cpu"))
    assert t.data_ptr() == w.__array_interface__["data"][0]
    inputs = _inputs(g, dtype)
    got, want = prepare(g, "torch", device="cpu").run(inputs), prepare(g, "numpy").run(inputs)
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), atol=2e-2 if dtype == "bfloat16" else 1e-5)


def test_an_export_past_protobufs_limit_writes_external_data(tmp_path, monkeypatch):
    """A model too large for one protobuf (the limit lowered to a few KiB here) goes to <path>.data; in memory it is refused."""
    import onnxruntime as ort

    import lowering.exporter.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "INLINE_LIMIT", 4096)
    g = graphc.attention_layer_graph(CFG, seed=2)
    with pytest.raises(ExportError, match=r"past what one protobuf holds \(2 GiB\); export to a path"):
        export(g)
    path = tmp_path / "layer.onnx"
    export(g, path)
    assert (tmp_path / "layer.onnx.data").stat().st_size >= sum(a.nbytes for a in g.initializers.values())
    inputs = _inputs(g)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)
    want = prepare(g, "numpy").run(inputs)
    np.testing.assert_allclose(got[0], want[g.outputs[0]], atol=1e-5)


def test_optimizing_a_mapped_checkpoint_copies_no_weight(tmp_path):
    """The attention scale is not folded into a mapped projection weight (a copy of it): it goes onto the projection's input."""
    g = _mapped_layer(tmp_path / "ckpt")
    seeded = graphc.attention_layer_graph(CFG, seed=0)
    opt, report = graphc.optimize(g, hints={"batch": 2, "seq": 5})
    assert all(mapped_location(a) is not None for a in opt.initializers.values() if a.nbytes >= 1024)
    assert any(n.endswith("_scaled") for n in graphc.optimize(seeded, hints={"batch": 2, "seq": 5}).graph.initializers)  # in memory: folded
    assert not any(n.endswith("_scaled") for n in opt.initializers)
    assert "scale moved onto operand" in report.explain()
    inputs = _inputs(g)
    got, want = prepare(opt, "numpy").run(inputs), prepare(g, "numpy", reference=True).run(inputs)
    np.testing.assert_allclose(got[g.outputs[0]], want[g.outputs[0]], atol=1e-5, rtol=1e-4)


def test_a_worker_process_session_reads_the_float32_cache_of_low_precision_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHC_WEIGHT_CACHE", str(tmp_path / "cache"))
    g = _mapped_layer(tmp_path / "ckpt", "bfloat16")
    where = _same_as_inline(g, _inputs(g, "bfloat16"), isolate=True)
    assert "converted to float32 files" in where and "handed" not in where
