"""Attention builders against the independent float64 reference in tests/reference.py."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_layer, ref_sdpa, tiled

import graphc
from graphc import AttentionConfig
from graphc.errors import WeightError
from lowering import random_inputs, run_numpy

F32 = dict(rtol=2e-4, atol=2e-5)  # float32 graph vs float64 reference
F64 = dict(rtol=1e-10, atol=1e-12)

SMALL = {
    "mha": AttentionConfig(32, 4, 4),
    "mqa": AttentionConfig(32, 4, 1),
    "gqa": AttentionConfig(48, 6, 2),
}


@pytest.mark.parametrize("kind", SMALL)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_core_matches_reference(kind, causal):
    cfg = SMALL[kind]
    g = graphc.sdpa_graph(cfg, causal=causal)
    feeds = random_inputs(g, seed=1, batch=2, seq=5)
    got = run_numpy(g, feeds)["attn_BHSD"]
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=causal, scale=cfg.softmax_scale)
    np.testing.assert_allclose(got, want, **F32)


def test_sdpa_float64_is_exact_to_reference():
    cfg = SMALL["gqa"]
    g = graphc.sdpa_graph(cfg, dtype="float64", causal=True)
    feeds = random_inputs(g, seed=2, batch=1, seq=7)
    got = run_numpy(g, feeds)["attn_BHSD"]
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, scale=cfg.softmax_scale)
    np.testing.assert_allclose(got, want, **F64)


def test_tile_head_order_gives_a_different_answer():
    """Pins the mapping: query head h reads KV head h // group, not h % n_kv."""
    cfg = AttentionConfig(64, 8, 2)
    g = graphc.sdpa_graph(cfg, causal=False, dtype="float64")
    feeds = random_inputs(g, seed=3, batch=1, seq=4)
    got = run_numpy(g, feeds)["attn_BHSD"]
    q, k, v = feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"]
    np.testing.assert_allclose(got, ref_sdpa(q, k, v, scale=cfg.softmax_scale), **F64)
    wrong = ref_sdpa(q, k, v, scale=cfg.softmax_scale, kv_head_of=tiled)
    assert not np.allclose(got, wrong, atol=1e-3)
    # head 1 reads KV head 0 (consecutive), which the tile order would give to head 2
    assert cfg.kv_head_of(1) == 0 and cfg.kv_head_of(4) == 1 and cfg.kv_head_of(7) == 1


def test_cross_length_causal_core_is_bottom_right_aligned():
    cfg = SMALL["gqa"]
    g = graphc.sdpa_graph(cfg, q_len="sq", kv_len="sk", causal=True, dtype="float64")
    feeds = random_inputs(g, seed=4, batch=2, sq=3, sk=7)
    got = run_numpy(g, feeds)["attn_BHSD"]
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, offset=4, scale=cfg.softmax_scale)
    np.testing.assert_allclose(got, want, **F64)


def test_fully_masked_rows_give_zeros_not_nan():
    cfg = SMALL["gqa"]
    g = graphc.sdpa_graph(cfg, causal=False, mask=True, dtype="float64")
    feeds = random_inputs(g, seed=5, batch=2, seq=4)
    feeds["attn_mask"][0, 0, 1, :] = False  # batch 0, query 1 sees nothing
    got = run_numpy(g, feeds)["attn_BHSD"]
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[0, :, 1], 0.0)
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], mask=feeds["attn_mask"], scale=cfg.softmax_scale)
    np.testing.assert_allclose(got, want, **F64)


def test_negative_causal_offset_masks_whole_rows_to_zero():
    cfg = SMALL["mha"]
    g = graphc.sdpa_graph(cfg, q_len=5, kv_len=3, causal=True, dtype="float64")  # offset -2
    feeds = random_inputs(g, seed=6, batch=1)
    got = run_numpy(g, feeds)["attn_BHSD"]
    np.testing.assert_array_equal(got[:, :, :2], 0.0)
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, offset=-2, scale=cfg.softmax_scale)
    np.testing.assert_allclose(got, want, **F64)


@pytest.mark.parametrize("kind", SMALL)
@pytest.mark.parametrize("bias", [False, True])
def test_full_layer_matches_reference(kind, bias):
    cfg = SMALL[kind].with_(bias=bias)
    weights = graphc.init_weights(cfg, seed=7)
    g = graphc.attention_layer_graph(cfg, weights=weights)
    feeds = random_inputs(g, seed=8, batch=3, seq=6)
    got = run_numpy(g, feeds)["out_BSM"]
    want, _, _ = ref_layer(cfg, weights, feeds["x_BSM"])
    np.testing.assert_allclose(got, want, **F32)


def test_symbolic_dims_bind_to_different_sizes_per_call():
    cfg = SMALL["gqa"]
    weights = graphc.init_weights(cfg, seed=9)
    g = graphc.attention_layer_graph(cfg, weights=weights)
    for batch, seq in [(1, 1), (2, 9), (4, 3)]:
        feeds = random_inputs(g, seed=batch, batch=batch, seq=seq)
        got = run_numpy(g, feeds)["out_BSM"]
        want, _, _ = ref_layer(cfg, weights, feeds["x_BSM"])
        assert got.shape == (batch, seq, cfg.d_model)
        np.testing.assert_allclose(got, want, **F32)


def test_cross_attention_matches_reference():
    cfg = AttentionConfig(48, 6, 3, bias=True, causal=True)  # cross-attention ignores causal
    weights = graphc.init_weights(cfg, seed=10)
    g = graphc.cross_attention_graph(cfg, weights=weights)
    feeds = random_inputs(g, seed=11, batch=2, q_len=3, kv_len=8)
    got = run_numpy(g, feeds)["out_BSM"]
    want, _, _ = ref_layer(cfg, weights, feeds["x_BSM"], memory=feeds["memory_BTM"], causal=False)
    np.testing.assert_allclose(got, want, **F32)


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_cross_attention_with_an_encoder_padding_mask_and_keys_values_computed_once(mask):
    """An encoder's padding mask on cross-attention, and the decoder step that reads keys and values projected once
    (``cross_kv_graph``): both equal the float64 reference, on NumPy and onnxruntime, and each is one recognised
    attention with the mask's kind."""
    from reference import ref_linear

    from graphc.optimizer import KEEP_EVERY_ATTENTION, lower
    from lowering import run

    cfg = AttentionConfig(48, 6, 3, bias=True)
    weights = graphc.init_weights(cfg, seed=20)
    full = graphc.cross_attention_graph(cfg, weights=weights, mask=mask)
    kv, step = graphc.cross_kv_graph(cfg, weights=weights), graphc.cross_attention_graph(cfg, weights=weights, mask=mask, cached_kv=True)
    rng = np.random.default_rng(21)
    x, memory = rng.standard_normal((2, 3, 48)).astype(np.float32), rng.standard_normal((2, 8, 48)).astype(np.float32)
    keep = np.ones((2, 1, 1, 8), bool)
    keep[0, ..., :3] = False  # the first encoder row padded
    m = keep if mask == "bool" else np.where(keep, 0, -np.inf).astype(np.float32)
    project = lambda a, n, heads: ref_linear(a, weights[f"{n}.weight"], weights[f"{n}.bias"]).reshape(2, -1, heads, cfg.hd).transpose(0, 2, 1, 3)  # noqa: E731
    o = ref_sdpa(project(x, "q_proj", 6), project(memory, "k_proj", 3), project(memory, "v_proj", 3), mask=keep, scale=cfg.softmax_scale)
    want = ref_linear(o.transpose(0, 2, 1, 3).reshape(2, 3, 48), weights["o_proj.weight"], weights["o_proj.bias"])
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(full, {"x_BSM": x, "memory_BTM": memory, "memory_mask": m}, backend)["out_BSM"], want, **F32)
        cache = run(kv, {"memory_BTM": memory}, backend)
        got = run(step, {"x_BSM": x, "cross_key": cache["cross_key"], "cross_value": cache["cross_value"], "memory_mask": m}, backend)["out_BSM"]
        np.testing.assert_allclose(got, want, **F32, err_msg=backend)
    for g in (full, step):
        ops = [n.op for n in lower(graphc.optimize(g).graph, KEEP_EVERY_ATTENTION).nodes.values() if n.op.kind == "Attention"]
        assert [op.visibility for op in ops] == [graphc.Visibility(mask=mask)]
    assert "k_proj.weight" not in step.initializers and "q_proj.weight" not in kv.initializers  # each graph holds its own weights


@pytest.mark.parametrize("kind", SMALL)
def test_kv_cache_prefill_then_decode_equals_one_causal_prefill(kind):
    cfg = SMALL[kind]
    weights = graphc.init_weights(cfg, seed=12, dtype="float64")
    step = graphc.kv_cache_graph(cfg, weights=weights, dtype="float64")
    full = graphc.attention_layer_graph(cfg, weights=weights, dtype="float64")
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 7, cfg.d_model))
    want = run_numpy(full, {"x_BSM": x})["out_BSM"]

    empty = np.zeros((2, cfg.n_kv_heads, 0, cfg.hd))
    out = run_numpy(step, {"x_BSM": x[:, :3], "past_key": empty, "past_value": empty})
    pieces, k, v = [out["out_BSM"]], out["present_key"], out["present_value"]
    for t in range(3, 7):
        out = run_numpy(step, {"x_BSM": x[:, t : t + 1], "past_key": k, "past_value": v})
        pieces.append(out["out_BSM"])
        k, v = out["present_key"], out["present_value"]
    assert k.shape == (2, cfg.n_kv_heads, 7, cfg.hd)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), want, **F64)
    ref, ref_k, _ = ref_layer(cfg, weights, x)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), ref, **F64)
    np.testing.assert_allclose(k, ref_k, **F64)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(SMALL)),
    capacity=st.integers(1, 9),
    written=st.integers(0, 8),
    seq=st.integers(1, 4),
    window=st.sampled_from([None, 2]),
    seed=st.integers(0, 99),
)
def test_a_fixed_capacity_step_writes_its_slots_and_attends_as_the_growing_cache(kind, capacity, written, seq, window, seed):
    """cache_position: the new keys land in slots P..P+S-1 of a C-slot cache, the other slots untouched, and the output
    is the growing cache's over the first P+S slots (query i at slot P+i sees slots j <= P+i, inside the window)."""
    written, seq = min(written, capacity - 1), min(seq, capacity - min(written, capacity - 1))
    cfg = dataclasses.replace(SMALL[kind], sliding_window=window)
    weights = graphc.init_weights(cfg, seed=seed, dtype="float64")
    fixed = graphc.kv_cache_graph(cfg, weights=weights, dtype="float64", cache_position=True)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, seq, cfg.d_model))
    past_k, past_v = (rng.standard_normal((2, cfg.n_kv_heads, capacity, cfg.hd)) for _ in range(2))
    got = run_numpy(fixed, {"x_BSM": x, "past_key": past_k, "past_value": past_v, "cache_position": np.arange(written, written + seq)})
    growing = graphc.kv_cache_graph(cfg, weights=weights, dtype="float64")
    same = run_numpy(growing, {"x_BSM": x, "past_key": past_k[:, :, :written], "past_value": past_v[:, :, :written]})
    want, k, v = same["out_BSM"], same["present_key"], same["present_value"]
    if window is None:  # the reference has no window
        np.testing.assert_allclose(want, ref_layer(cfg, weights, x, past_k=past_k[:, :, :written], past_v=past_v[:, :, :written])[0], **F64)
    np.testing.assert_allclose(got["out_BSM"], want, **F64)
    np.testing.assert_allclose(got["present_key"][:, :, : written + seq], k, **F64)
    np.testing.assert_allclose(got["present_value"][:, :, : written + seq], v, **F64)
    np.testing.assert_array_equal(got["present_key"][:, :, written + seq :], past_k[:, :, written + seq :])  # untouched slots


def test_kv_cache_decode_step_sees_all_past_keys():
    """Offset-aware mask: a 2-token step over a 5-token cache; query i sees keys j <= i + 5."""
    cfg = SMALL["gqa"]
    weights = graphc.init_weights(cfg, seed=14)
    g = graphc.kv_cache_graph(cfg, weights=weights)
    feeds = random_inputs(g, seed=15, batch=1, seq=2, past_seq=5)
    got = run_numpy(g, feeds)
    want, k, _ = ref_layer(cfg, weights, feeds["x_BSM"], past_k=feeds["past_key"], past_v=feeds["past_value"])
    np.testing.assert_allclose(got["out_BSM"], want, **F32)
    np.testing.assert_allclose(got["present_key"], k, **F32)


def test_user_weights_are_checked():
    cfg = SMALL["gqa"]
    w = graphc.init_weights(cfg)
    with pytest.raises(WeightError, match=r"missing \['v_proj.weight'\]"):
        graphc.attention_layer_graph(cfg, weights={k: a for k, a in w.items() if k != "v_proj.weight"})
    bad = dict(w, **{"k_proj.weight": np.zeros((48, 16), np.float32)})
    with pytest.raises(WeightError, match=r"'k_proj.weight' has shape \(48, 16\), expected \(16, 48\)"):
        graphc.attention_layer_graph(cfg, weights=bad)
    with pytest.raises(WeightError, match=r"unexpected weights \['q_proj.bias'\]"):
        graphc.attention_layer_graph(cfg, weights=dict(w, **{"q_proj.bias": np.zeros(48, np.float32)}))
    with pytest.raises(WeightError, match="dtype float64, expected float32"):
        graphc.attention_layer_graph(cfg, weights={k: a.astype(np.float64) for k, a in w.items()})
    with pytest.raises(WeightError, match="float dtype"):
        graphc.sdpa_graph(cfg, dtype="int64")


def test_graph_names_carry_layouts():
    g = graphc.kv_cache_graph(SMALL["gqa"])
    assert {"q_BHSD", "k_BHkvSD", "present_key", "k_rep_BHTD", "scores_BHST", "probs_BHST"} <= set(g.types)
    assert g.outputs == ["out_BSM", "present_key", "present_value"]
    assert g.types["present_key"].shape == ("batch", 2, "past_seq+seq", 8)


@st.composite
def head_configs(draw):
    n_kv = draw(st.integers(1, 4))
    group = draw(st.integers(1, 4))
    hd = draw(st.sampled_from([2, 4, 8]))
    d_model = draw(st.integers(1, 3)) * 8
    return AttentionConfig(d_model, n_kv * group, n_kv, head_dim=hd, causal=draw(st.booleans()), bias=draw(st.booleans()))


@settings(max_examples=25, deadline=None)
@given(cfg=head_configs(), batch=st.integers(1, 3), seq=st.integers(1, 6), past=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_random_head_configs_match_reference(cfg, batch, seq, past, seed):
    weights = graphc.init_weights(cfg, seed=seed, dtype="float64")
    g = graphc.kv_cache_graph(cfg, weights=weights, dtype="float64")
    feeds = random_inputs(g, seed=seed, batch=batch, seq=seq, past_seq=past)
    got = run_numpy(g, feeds)
    want, k, v = ref_layer(cfg, weights, feeds["x_BSM"], past_k=feeds["past_key"], past_v=feeds["past_value"])
    np.testing.assert_allclose(got["out_BSM"], want, **F64)
    np.testing.assert_allclose(got["present_value"], v, **F64)
