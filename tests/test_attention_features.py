"""Sliding windows and logit softcap: in the builders' DAG, in the Attention op and on every backend.

Checked against the plain NumPy reference in ``reference.py`` (a per-head loop),
against torch SDPA with an explicit mask where torch is installed, and between
every export mode: a window is never dropped.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_sdpa

import graphc
from graphc import AttentionConfig, optimize
from graphc.errors import AttentionConfigError, ExportError, OpError
from graphc.optimizer import lower
from lowering import prepare, random_inputs
from lowering.exporter.onnx_export import export
from lowering.exporter.targets import NUMPY_TARGET, onnx_target

BACKENDS = ("numpy", "onnx-reference", "ort-cpu", "torch")
TOL = {"atol": 2e-5, "rtol": 1e-4}


def _cfg(window=None, softcap=None, hq=4, hkv=2):
    return AttentionConfig(hq * 8, hq, hkv, head_dim=8, sliding_window=window, softcap=softcap)


def _available(backend: str) -> bool:
    from lowering.backends.registry import unavailable_reason

    return unavailable_reason(backend) is None


def _check_all(g, feeds, want, sizes, name="attn_BHSD", **modes):
    for graph in (g, optimize(g, hints=sizes).graph):
        for backend in BACKENDS:
            if not _available(backend):
                continue
            for attention in ("decomposed", "auto") if backend in ("onnx-reference", "ort-cpu") else (None,):
                opts = {"sizes": sizes} | ({"attention": attention} if attention else {})
                got = prepare(graph, backend, **opts).run(feeds)[name]
                np.testing.assert_allclose(got, want, **TOL, err_msg=f"{backend} {attention or ''}")


@pytest.mark.parametrize("window, softcap", [(3, None), (None, 5.0), (2, 1.5), (1, None)])
@pytest.mark.parametrize("seq", [1, 7])
def test_window_and_softcap_prefill_match_the_reference_everywhere(window, softcap, seq):
    cfg = _cfg(window, softcap)
    g = graphc.sdpa_graph(cfg)
    feeds = random_inputs(g, seed=1, batch=2, seq=seq)
    for k in feeds:
        feeds[k] *= 3  # large logits, so the softcap matters
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, window=window, softcap=softcap)
    _check_all(g, feeds, want, {"batch": 2, "seq": seq})


@pytest.mark.parametrize("past", [0, 2, 9])
def test_window_over_a_kv_cache_decode(past):
    cfg = _cfg(window=4, softcap=3.0)
    g = graphc.sdpa_graph(cfg, q_len="seq", kv_len="past_seq+seq")
    sizes = {"batch": 1, "seq": 2, "past_seq": past}
    feeds = random_inputs(g, seed=2, **sizes)
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, window=4, softcap=3.0)
    _check_all(g, feeds, want, sizes)


def test_the_optimizer_recognises_window_and_softcap_as_one_attention():
    g = graphc.sdpa_graph(_cfg(window=3, softcap=2.0))
    lowered = lower(optimize(g).graph, NUMPY_TARGET)
    [node] = [n for n in lowered.nodes.values() if n.op.kind == "Attention"]
    assert node.op.visibility.window == 3 and node.op.softcap == 2.0 and node.op.scale == pytest.approx(8**-0.5)


def test_a_mask_before_the_softcap_is_not_fused_as_softcap_then_mask():
    g = graphc.Graph("mask_then_cap")
    q, k, v = (g.input(n, [1, 2, 4, 8]) for n in "qkv")
    s = g.causal_mask(g.scale(g.einsum("bhqd,bhkd->bhqk", q, k), 0.125), 0)
    s = g.scale(g.tanh(g.scale(s, 0.5)), 2.0)  # tanh(-inf) = -1: not a mask any more
    g.output(g.einsum("bhqk,bhkd->bhqd", g.softmax(s), v, name="o"))
    res = optimize(g)
    assert "Attention" not in lower(res.graph, NUMPY_TARGET).op_counts()
    feeds = random_inputs(g, seed=0)
    ref = prepare(g, "numpy", reference=True, compute_dtype="float64").run(feeds)["o"]
    np.testing.assert_allclose(prepare(res.graph, "numpy").run(feeds)["o"], ref, **TOL)


def test_a_sliding_window_survives_every_export_mode():
    """Exporters that drop sliding windows give wrong numbers silently: graphc keeps it or refuses."""
    cfg = _cfg(window=2)
    g = optimize(graphc.sdpa_graph(cfg), hints={"batch": 1, "seq": 128}).graph
    sizes = {"batch": 1, "seq": 128}
    feeds = random_inputs(g, seed=3, **sizes)
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, window=2)
    full = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True)
    assert np.abs(want - full).max() > 0.1  # the window matters here
    for mode in ("decomposed", "auto"):
        got = prepare(g, "ort-cpu", attention=mode, sizes=sizes).run(feeds)["attn_BHSD"]
        np.testing.assert_allclose(got, want, **TOL, err_msg=mode)
        ops = {n.op_type for n in export(g, attention=mode, sizes=sizes).graph.node}
        assert "Attention" not in ops and "GroupQueryAttention" not in ops
    with pytest.raises(ExportError, match="window"):
        export(g, attention="onnx-attention", sizes=sizes)
    gqa = export(g, attention="ort-gqa", sizes=sizes)  # onnxruntime's GroupQueryAttention carries it as local_window_size
    [node] = [n for n in gqa.graph.node if n.op_type == "GroupQueryAttention"]
    assert [a.i for a in node.attribute if a.name == "local_window_size"] == [2]
    got = prepare(g, "ort-cpu", attention="ort-gqa", sizes=sizes).run(feeds)["attn_BHSD"]
    np.testing.assert_allclose(got, want, **TOL, err_msg="ort-gqa")
    assert onnx_target("auto", 23).attention is not None


def test_window_and_softcap_are_validated():
    with pytest.raises(AttentionConfigError, match="sliding_window"):
        _cfg(window=0)
    with pytest.raises(AttentionConfigError, match="softcap"):
        _cfg(softcap=-1.0)
    with pytest.raises(AttentionConfigError, match="causal"):
        AttentionConfig(32, 4, 2, head_dim=8, causal=False, sliding_window=4)
    with pytest.raises(OpError, match="window"):
        graphc.Visibility(None, window=3)
    with pytest.raises(OpError, match="softcap"):
        graphc.Attention(0.1, graphc.Visibility.causal(0), softcap=0.0)


@settings(max_examples=25, deadline=None)
@given(
    window=st.one_of(st.none(), st.integers(1, 6)),
    softcap=st.one_of(st.none(), st.sampled_from([0.5, 2.0, 30.0])),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    seq=st.integers(1, 9),
    past=st.integers(0, 5),
)
def test_random_windows_and_caps_on_the_numpy_kernel(window, softcap, hkv, group, seq, past):
    cfg = _cfg(window, softcap, hq=hkv * group, hkv=hkv)
    g = graphc.sdpa_graph(cfg, q_len="seq", kv_len="past_seq+seq")
    sizes = {"batch": 1, "seq": seq, "past_seq": past}
    feeds = random_inputs(g, seed=seq, **sizes)
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, window=window, softcap=softcap)
    lowered = lower(optimize(g, hints=sizes).graph, NUMPY_TARGET, sizes)
    assert "Attention" in lowered.op_counts()
    np.testing.assert_allclose(prepare(g, "numpy", sizes=sizes).run(feeds)["attn_BHSD"], want, **TOL)


def test_alibi_slopes_match_bloom():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from graphc.attention.config import alibi_slopes

    for heads in (4, 6, 12, 16):
        alibi = build_alibi_tensor(torch.ones(1, 5), heads, torch.float32).reshape(heads, 5)  # slope_h * j
        np.testing.assert_allclose(alibi_slopes(heads)[:, None] * np.arange(5), alibi.numpy(), rtol=1e-6)


@pytest.mark.parametrize("past", [0, 3])
def test_alibi_matches_a_plain_reference_everywhere(past):
    from graphc.attention.config import alibi_slopes

    cfg = AttentionConfig(48, 6, 2, head_dim=8, alibi=True)
    g = graphc.sdpa_graph(cfg, q_len="seq", kv_len="past_seq+seq")
    sizes = {"batch": 2, "seq": 4, "past_seq": past}
    feeds = random_inputs(g, seed=5, **sizes)
    q, k, v = (feeds[n].astype(np.float64) for n in ("q_BHSD", "k_BHkvTD", "v_BHkvTD"))
    sk = k.shape[2]
    bias = alibi_slopes(6)[:, None, None] * np.arange(sk)[None, None, :]  # [H, 1, Sk]
    kr, vr = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, kr) * 8**-0.5 + bias
    s = np.where(np.arange(sk)[None, :] > np.arange(4)[:, None] + past, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), vr)
    _check_all(g, feeds, want, sizes)


@pytest.mark.parametrize("kind", ["core", "cache"])
def test_softcap_rides_on_the_fused_onnx_attention_op(kind):
    """ONNX's Attention op (opset 23) caps before masking, as graphc does: auto fuses it (prefill sizes) and the numbers hold."""
    cfg = _cfg(softcap=2.0)
    if kind == "core":
        g, sizes, out = graphc.sdpa_graph(cfg), {"batch": 1, "seq": 128}, "attn_BHSD"
    else:
        g, sizes, out = graphc.kv_cache_graph(cfg), {"batch": 1, "seq": 64, "past_seq": 5}, "out_BSM"
    opt = optimize(g, hints=sizes).graph
    model = export(opt, attention="auto", sizes=sizes)
    [att] = [n for n in model.graph.node if n.op_type == "Attention"]
    assert any(a.name == "softcap" and a.f == 2.0 for a in att.attribute)
    feeds = random_inputs(g, seed=6, **sizes)
    for k in feeds:
        feeds[k] *= 3
    want = prepare(g, "numpy", reference=True, compute_dtype="float64", sizes=sizes).run(feeds)[out]
    for backend in ("onnx-reference", "ort-cpu"):
        got = prepare(opt, backend, attention="onnx-attention", sizes=sizes).run(feeds)[out]
        np.testing.assert_allclose(got, want, **TOL, err_msg=backend)


@pytest.mark.parametrize("left, right", [(2, 1), (1, 0), (3, 4)])
def test_a_band_for_non_causal_attention(left, right):
    """Non-causal, query i sees keys i - left < j <= i + right: a reference written from that definition."""
    cfg = AttentionConfig(32, 4, 2, head_dim=8, causal=False, sliding_window=left, right_window=right)
    g = graphc.sdpa_graph(cfg)
    feeds = random_inputs(g, seed=9, batch=1, seq=7)
    q, k, v = (feeds[n].astype(np.float64) for n in ("q_BHSD", "k_BHkvTD", "v_BHkvTD"))
    i, j = np.arange(7)[:, None], np.arange(7)[None, :]
    visible = (j > i - left) & (j <= i + right)
    s = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, 2, axis=1)) * 8**-0.5
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), np.repeat(v, 2, axis=1))
    _check_all(g, feeds, want, {"batch": 1, "seq": 7})
    with pytest.raises(AttentionConfigError, match="right_window"):
        AttentionConfig(32, 4, 2, head_dim=8, causal=True, sliding_window=2, right_window=1)
    with pytest.raises(AttentionConfigError, match="needs right_window"):
        AttentionConfig(32, 4, 2, head_dim=8, causal=False, sliding_window=2)


@pytest.mark.parametrize("past", [0, 6])
def test_window_and_softcap_ride_on_onnxruntime_gqa(past):
    """GroupQueryAttention's local_window_size is graphc's window and its softcap caps before masking: fused, same numbers."""
    cfg = _cfg(window=3, softcap=2.0)
    g = graphc.kv_cache_graph(cfg)
    sizes = {"batch": 1, "seq": 1 if past else 5, "past_seq": past}
    opt = optimize(g, hints=sizes).graph
    feeds = random_inputs(g, seed=8, **sizes)
    for k in feeds:
        feeds[k] *= 3
    want = prepare(g, "numpy", reference=True, compute_dtype="float64", sizes=sizes).run(feeds)
    got = prepare(opt, "ort-cpu", attention="ort-gqa", sizes=sizes).run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=name)


@pytest.mark.parametrize("mask_shape", [(1, 6, 4, 5), (2, 6, 4, 5), (2, 1, 1, 5), (4, 5)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_broadcast_from_batch_and_head_axes(mask_shape, kind):
    """A mask of [B or 1, H or 1, Sq, Sk] (or [Sq, Sk]) on grouped heads: per-head masks must reach the right query head."""
    g = graphc.Graph("masked")
    q, k, v = g.input("q", [2, 6, 4, 8]), g.input("k", [2, 2, 5, 8]), g.input("v", [2, 2, 5, 8])
    m = g.input("m", list(mask_shape), "bool" if kind == "bool" else "float32")
    g.output(g.attention(q, k, v, 0.25, graphc.Visibility(mask=kind), m, names=["o"]))
    rng = np.random.default_rng(4)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("q", (2, 6, 4, 8)), ("k", (2, 2, 5, 8)), ("v", (2, 2, 5, 8)))}
    keep = rng.random(mask_shape) < 0.6
    keep[..., 0] = True  # every row keeps a key
    feeds["m"] = keep if kind == "bool" else np.where(keep, rng.standard_normal(mask_shape), -np.inf).astype(np.float32)
    s = np.einsum("bhqd,bhkd->bhqk", feeds["q"].astype(np.float64), np.repeat(feeds["k"], 3, axis=1)) * 0.25
    s = np.where(np.broadcast_to(keep, s.shape), s, -np.inf) if kind == "bool" else s + feeds["m"]
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), np.repeat(feeds["v"], 3, axis=1))
    for backend in BACKENDS:
        if not _available(backend):
            continue
        np.testing.assert_allclose(prepare(g, backend).run(feeds)["o"], want, **TOL, err_msg=backend)
