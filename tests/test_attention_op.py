"""The Attention op: its semantics, its one decomposition, its recognition, and every backend's kernel for it."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_layer, ref_sdpa, tiled

import graphc
from graphc import AttentionConfig, Graph, decompose_attention, optimize
from graphc.errors import OpError, ShapeMismatchError
from graphc.optimizer import REFERENCE_TARGET, lower
from lowering import NUMPY_TARGET, TORCH_TARGET, export, onnx_target, random_inputs, run, unavailable_reason

F32 = dict(rtol=2e-4, atol=2e-5)
F64 = dict(rtol=1e-10, atol=1e-12)
CFG = AttentionConfig(64, 8, 2, bias=True)

BUILDERS = {
    "core": (lambda: graphc.sdpa_graph(CFG), dict(batch=2, seq=5)),
    "layer": (lambda: graphc.attention_layer_graph(CFG, seed=1), dict(batch=2, seq=6)),
    "cross": (lambda: graphc.cross_attention_graph(CFG, seed=1), dict(batch=1, q_len=3, kv_len=7)),
    "kv-cache": (lambda: graphc.kv_cache_graph(CFG, seed=1), dict(batch=2, seq=3, past_seq=4)),
}


def _attention_graph(hq=4, hkv=2, causal_offset=None, mask=None, kv_cache=False, dtype="float64"):
    g = Graph("att")
    q = g.input("q", ["b", hq, "s", 8], dtype)
    k = g.input("k", ["b", hkv, "t", 8], dtype)
    v = g.input("v", ["b", hkv, "t", 6], dtype)
    m = g.input("m", ["b", 1, "s", "p+t" if kv_cache else "t"], "bool" if mask == "bool" else dtype) if mask else None
    past = (g.input("pk", ["b", hkv, "p", 8], dtype), g.input("pv", ["b", hkv, "p", 6], dtype)) if kv_cache else (None, None)
    vis = graphc.Visibility(causal_offset, mask=mask or "none")
    outs = g.attention(q, k, v, 0.3, vis, m, *past, names=["o", "pres_k", "pres_v"] if kv_cache else ["o"])
    g.output(*(outs if kv_cache else [outs]))
    return g


@settings(max_examples=30, deadline=None)
@given(
    hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4]),
    s=st.integers(1, 5),
    t=st.integers(1, 6),
    causal=st.sampled_from([None, 0, 2, -1]),
    mask=st.sampled_from([None, "bool", "additive"]),
    seed=st.integers(0, 99),
)
def test_op_and_its_decomposition_match_an_independent_reference(hkv, group, s, t, causal, mask, seed):
    g = _attention_graph(hkv * group, hkv, causal, mask)
    feeds = random_inputs(g, seed=seed, b=2, s=s, t=t)
    if mask == "additive":
        feeds["m"] = np.where(np.random.default_rng(seed).random(feeds["m"].shape) < 0.3, -np.inf, feeds["m"])
    keep = feeds["m"] if mask == "bool" else None
    want = ref_sdpa(feeds["q"], feeds["k"], feeds["v"], causal=causal is not None, offset=causal, mask=keep, scale=0.3)
    if mask == "additive":  # the reference takes a bool mask: add the float mask by hand
        want = _ref_additive(feeds, causal)
    op = g.nodes["o"].op
    np.testing.assert_allclose(op.evaluate([feeds[n] for n in ("q", "k", "v", "m") if n in feeds], {"b": 2, "s": s, "t": t}), want, **F64)
    d = g.copy()
    decompose_attention(d, "o")
    d.verify()
    assert "Attention" not in d.op_counts() and "Repeat" not in d.op_counts()  # grouped: no K/V copy
    np.testing.assert_allclose(run(d, feeds, reference=True)["o"], want, **F64)


def _ref_additive(feeds, causal):
    q, k, v, m = (feeds[n].astype(np.float64) for n in ("q", "k", "v", "m"))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
    s = q @ k.transpose(0, 1, 3, 2) * 0.3 + m
    if causal is not None:
        i, j = np.arange(s.shape[2])[:, None], np.arange(s.shape[3])[None]
        s = np.where(j > i + causal, -np.inf, s)
    mx = np.max(s, -1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(mx), mx, 0))
    tot = e.sum(-1, keepdims=True)
    return (e / np.where(tot == 0, 1, tot)) @ v


def test_kv_cache_op_appends_and_offsets_the_causal_mask():
    g = _attention_graph(4, 2, "p", kv_cache=True)
    feeds = random_inputs(g, seed=3, b=1, s=2, t=2, p=3)
    out = run(g, feeds, reference=True)
    k = np.concatenate([feeds["pk"], feeds["k"]], 2)
    v = np.concatenate([feeds["pv"], feeds["v"]], 2)
    np.testing.assert_array_equal(out["pres_k"], k)
    np.testing.assert_allclose(out["o"], ref_sdpa(feeds["q"], k, v, causal=True, offset=3, scale=0.3), **F64)
    for backend in ("numpy", "torch"):
        if backend == "torch" and unavailable_reason("torch"):
            continue
        got = run(g, feeds, backend)
        for name in out:
            np.testing.assert_allclose(got[name], out[name], **F64, err_msg=f"{backend} {name}")


def test_query_head_h_reads_kv_head_h_over_group_not_the_tile_order():
    g = _attention_graph(4, 2)
    feeds = random_inputs(g, seed=4, b=1, s=3, t=3)
    got = run(g, feeds)["o"]
    np.testing.assert_allclose(got, ref_sdpa(feeds["q"], feeds["k"], feeds["v"], scale=0.3), **F64)
    assert not np.allclose(got, ref_sdpa(feeds["q"], feeds["k"], feeds["v"], scale=0.3, kv_head_of=tiled))


def test_op_attributes_and_shapes_are_checked():
    with pytest.raises(OpError, match="mask must be one of"):
        graphc.Attention(0.5, graphc.Visibility(mask="float"))
    with pytest.raises(OpError, match="scale must be a finite float"):
        graphc.Attention(float("nan"))
    g = Graph("bad")
    q, k = g.input("q", [1, 3, 2, 4]), g.input("k", [1, 2, 2, 4])
    with pytest.raises(ShapeMismatchError, match=r"query heads 3 are not a multiple of KV heads 2"):
        g.attention(q, k, k, 0.5)


# ------------------------------------------------------------- recognition


@pytest.mark.parametrize("optimized", [False, True])
@pytest.mark.parametrize("kind", BUILDERS)
def test_every_builder_is_recognised_once_and_each_backend_agrees(kind, optimized):
    """Per backend, the Attention op (its kernel) and its decomposition give the same numbers."""
    build, sizes = BUILDERS[kind]
    g = build()
    if optimized:
        g = optimize(g).graph
    assert lower(g, NUMPY_TARGET).op_counts().get("Attention") == 1
    assert "Attention" not in lower(g, REFERENCE_TARGET).op_counts()
    feeds = random_inputs(g, seed=5, **sizes)
    want = run(g, feeds, reference=True, compute_dtype="float64")
    results = {
        "numpy kernel": run(g, feeds, "numpy"),
        "onnx Attention op": run(g, feeds, "ort-cpu", attention="onnx-attention"),
        "onnx decomposed": run(g, feeds, "ort-cpu", attention="decomposed"),
        "onnx reference, Attention op": run(g, feeds, "onnx-reference", attention="onnx-attention"),
    }
    if kind not in ("cross", "kv-cache"):  # causal only; batch 1 only with a past and several new tokens
        results["ort GroupQueryAttention"] = run(g, feeds, "ort-cpu", attention="ort-gqa")
    if not unavailable_reason("torch"):
        results["torch SDPA"] = run(g, feeds, "torch")
    for label, got in results.items():
        for name in want:
            np.testing.assert_allclose(got[name], want[name], **F32, err_msg=f"{label}: {name}")


def test_the_reference_is_independent_of_the_kernel_it_checks(monkeypatch):
    """compare's reference runs decomposed: a broken blocked kernel (wrong scale) is reported as FAIL."""
    import lowering.kernels.attention_kernel as ak
    from lowering import compare

    g = graphc.attention_layer_graph(CFG, seed=0)
    ok = compare(g, sizes={"batch": 1, "seq": 8}, backends=["numpy"], repeats=1)
    assert ok.ok and "attention decomposed" in ok.reference
    real = ak.blocked_attention
    monkeypatch.setattr(
        ak, "blocked_attention", lambda q, k, v, sq, off, scale, threads=None, **kw: real(q, k, v, sq, off, (scale or 1.0) * 1.5, threads, **kw)
    )
    bad = compare(g, sizes={"batch": 1, "seq": 8}, backends=["numpy"], repeats=1)
    assert not bad.ok and bad.results[0].status == "mismatch" and "FAIL" in str(bad)


def _hand(spec_qk, spec_pv, q_shape, k_shape, v_shape, scale_on="scores", mask=None):
    g = Graph("hand")
    q, k, v = g.input("q", q_shape, "float64"), g.input("k", k_shape, "float64"), g.input("v", v_shape, "float64")
    if scale_on == "k":
        k = g.scale(k, 0.25)
    s = g.einsum(spec_qk, q, k, name="s")
    if scale_on == "scores":
        s = g.scale(s, 0.25)
    if mask == "additive":
        s = g.add(s, g.input("bias", [s.shape[-2], s.shape[-1]], "float64"))
    p = g.softmax(s, name="p")
    g.output(g.einsum(spec_pv, p, v, name="o"))
    return g


@pytest.mark.parametrize(
    "case",
    [
        ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", [2, 4, 3, 8], [2, 4, 5, 8], [2, 4, 5, 6], "scores", None),
        ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd", [2, 3, 4, 8], [2, 5, 4, 8], [2, 5, 4, 6], "k", None),  # BSHD layout, scale on K
        ("qd,kd->qk", "qk,kd->qd", [3, 8], [5, 8], [5, 6], "scores", "additive"),  # no batch or heads, an additive mask
        ("hqd,hkd->hqk", "hqk,hkd->hqd", [4, 3, 8], [4, 5, 8], [4, 5, 6], "scores", None),  # no batch axis
    ],
)
def test_recognition_reads_einsum_semantics_not_spec_text(case):
    qk, pv, qs, ks, vs, scale_on, mask = case
    g = _hand(qk, pv, qs, ks, vs, scale_on, mask)
    low, report = optimize(g, target=TORCH_TARGET if mask else NUMPY_TARGET)
    assert low.op_counts().get("Attention") == 1, report.explain()
    sizes = {}
    feeds = random_inputs(g, seed=6, **sizes)
    want = run(g, feeds, reference=True)
    np.testing.assert_allclose(run(low, feeds, reference=True)["o"], want["o"], **F64)
    if not mask:
        np.testing.assert_allclose(run(g, feeds, "numpy")["o"], want["o"], **F64)


def test_near_misses_say_why_attention_was_not_recognised():
    g = _hand("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", [1, 2, 3, 8], [1, 2, 4, 8], [1, 2, 4, 6])
    g.output("p")  # the probabilities are wanted too
    low, report = optimize(g, target=NUMPY_TARGET)
    assert "Attention" not in low.op_counts()
    assert "the probabilities are not read by one einsum alone" in report.explain()


# ------------------------------------------------------------- export with sizes


def test_auto_export_of_an_optimized_layer_chunks_causal_prefill_and_keeps_decode_grouped():
    cfg = graphc.preset("mistral-7b").with_(d_model=256, head_dim=8)
    layer = optimize(graphc.attention_layer_graph(cfg, seed=0)).graph
    prefill = [n.op_type for n in export(layer, attention="auto", sizes={"batch": 1, "seq": 1024}).graph.node]
    assert "Attention" not in prefill and prefill.count("Softmax") == 8  # causal: query chunks over the visible keys
    bidirectional = optimize(graphc.attention_layer_graph(cfg.with_(causal=False), seed=0)).graph
    fused = {n.op_type for n in export(bidirectional, attention="auto", sizes={"batch": 1, "seq": 1024}).graph.node}
    assert "Attention" in fused and "Softmax" not in fused
    step = optimize(graphc.kv_cache_graph(cfg, seed=0)).graph
    decode = {n.op_type for n in export(step, attention="auto", sizes={"batch": 1, "seq": 1, "past_seq": 4096}).graph.node}
    assert "Attention" not in decode and "Softmax" in decode
    unknown = {n.op_type for n in export(layer, attention="auto").graph.node}  # no sizes: never guess
    assert "Attention" not in unknown


def test_reference_evaluator_cannot_run_contrib_ops_and_says_so():
    from lowering import compare

    g = graphc.sdpa_graph(CFG)
    report = compare(
        g,
        sizes={"batch": 1, "seq": 4},
        backends=["onnx-reference", "ort-cpu"],
        options={"onnx-reference": {"attention": "ort-gqa"}, "ort-cpu": {"attention": "ort-gqa"}},
        repeats=1,
    )
    (ref, ort) = report.results
    assert ref.status == "skipped" and "GroupQueryAttention" in ref.reason
    assert ort.status == "ok" and report.ok


def test_core_decode_binds_a_symbol_seen_only_inside_an_expression():
    g = graphc.sdpa_graph(CFG, q_len="seq", kv_len="past_seq+seq")
    feeds = random_inputs(g, seed=1, batch=1, seq=1, past_seq=6)
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, offset=6, scale=CFG.softmax_scale)
    for backend in ("numpy", "onnx-reference", "ort-cpu"):
        np.testing.assert_allclose(run(g, feeds, backend)["attn_BHSD"], want, **F32, err_msg=backend)


def test_an_export_keeps_the_interface_names():
    g = optimize(graphc.kv_cache_graph(CFG, seed=0)).graph
    model = export(g, attention="onnx-attention")
    assert [i.name for i in model.graph.input] == g.inputs and [o.name for o in model.graph.output] == g.outputs
    (att,) = [n for n in model.graph.node if n.op_type == "Attention"]
    assert list(att.output)[1:] == ["present_key", "present_value"]
    assert onnx_target("auto", 23).name == "onnx-auto"


def test_layer_stack_from_one_layer_matches_layers_run_in_turn():
    cfg = AttentionConfig(32, 4, 2)
    ws = [graphc.init_weights(cfg, seed=s) for s in (1, 2)]
    stack = graphc.attention_stack_graph(cfg, 2, weights=ws)
    stack.verify()
    assert stack.outputs == ["out_BSM"] and "layers.1.q_proj.weight" in stack.initializers
    x = np.random.default_rng(0).standard_normal((1, 5, 32)).astype(np.float32)
    want = ref_layer(cfg, ws[1], ref_layer(cfg, ws[0], x)[0])[0]
    for g in (stack, optimize(stack).graph):
        np.testing.assert_allclose(run(g, {"x_BSM": x})["out_BSM"], want, **F32)


# ------------------------------------------------------------- rows with no visible key: zeros or the mean of V


def _ref_min_filled(q, k, v, keep, offset, scale=0.3, bias=0.0):
    """softmax(scale q k^T + bias + where(keep & causal, 0, finfo(float32).min)) v, float64, written as transformers' eager
    path does (``bias``: MPT's and Bloom's ALiBi)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
    i, j = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None]
    visible = np.broadcast_to(keep, (q.shape[0], q.shape[1], q.shape[2], k.shape[2])) & (j <= i + offset)
    s = q @ k.transpose(0, 1, 3, 2) * scale + bias + np.where(visible, 0.0, float(np.finfo(np.float32).min))
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def _padded_rows_agree(hkv, group, s, past, pad, seed, alibi):  # noqa: ANN001, ANN202
    """A causal GQA attention over a cache with ``empty_rows="mean"``, row 0 left-padded by ``pad`` keys: a bool padding
    mask, or (``alibi``) an additive key mask of a per-head bias with the padded keys at -inf.  The reference semantics,
    the decomposition, numpy and onnxruntime (grouped MatMuls and query chunks) against :func:`_ref_min_filled`."""
    g = Graph("att")
    heads = hkv * group
    q = g.input("q", ["b", heads, "s", 8])
    k, v = g.input("k", ["b", hkv, "s", 8]), g.input("v", ["b", hkv, "s", 6])
    m = g.input("m", ["b", heads, 1, "p+s"]) if alibi else g.input("m", ["b", 1, 1, "p+s"], "bool")
    pk, pv = g.input("pk", ["b", hkv, "p", 8]), g.input("pv", ["b", hkv, "p", 6])
    kind = "additive" if alibi else "bool"
    g.output(*g.attention(q, k, v, 0.3, graphc.Visibility.causal("p", mask=kind, empty_rows="mean"), m, pk, pv, names=["o", "pres_k", "pres_v"]))
    feeds = random_inputs(g, seed=seed, b=2, s=s, p=past)
    keep = np.ones((2, 1, 1, past + s), bool)
    keep[0, ..., :pad] = False  # row 0 left-padded: its first queries see no key
    bias = 0.0
    if alibi:
        slopes = 2.0 ** -np.arange(1, heads + 1, dtype=np.float32)
        bias = (slopes[:, None, None] * np.arange(-(past + s) + 1, 1, dtype=np.float32))[None]  # [1, H, 1, T]
    feeds["m"] = np.where(keep, bias, np.float32(-np.inf)).astype(np.float32) if alibi else keep
    kk, vv = np.concatenate([feeds["pk"], feeds["k"]], 2), np.concatenate([feeds["pv"], feeds["v"]], 2)
    want = _ref_min_filled(feeds["q"], kk, vv, keep, past, bias=bias)
    np.testing.assert_allclose(run(g, feeds, reference=True)["o"], want, rtol=2e-5, atol=2e-6)
    d = g.copy()
    decompose_attention(d, "o")
    results = {
        "decomposed": run(d, feeds, reference=True),
        "numpy": run(g, feeds),
        "onnx decomposed": run(g, feeds, "ort-cpu", attention="decomposed"),
        "onnx chunked": run(g, feeds, "ort-cpu", attention="chunked"),
    }
    if alibi:
        results["onnx reference chunked"] = run(g, feeds, "onnx-reference", attention="chunked")
    elif not unavailable_reason("torch"):
        results["torch"] = run(g, feeds, "torch")
    for name, got in results.items():
        np.testing.assert_allclose(got["o"], want, rtol=2e-4, atol=2e-5, err_msg=name)


PADDED = dict(
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    s=st.integers(1, 9),
    past=st.integers(0, 5),
    pad=st.integers(0, 6),
    seed=st.integers(0, 99),
)


@settings(max_examples=25, deadline=None)
@given(**PADDED)
def test_empty_rows_mean_is_what_a_min_filled_additive_mask_gives(hkv, group, s, past, pad, seed):
    """Left padding hides every key a padded query may see: transformers' finfo.min fill gives that row the mean of V."""
    _padded_rows_agree(hkv, group, s, past, pad, seed, alibi=False)


@settings(max_examples=25, deadline=None)
@given(**PADDED)
def test_a_bias_with_padding_at_minus_inf_and_a_causal_offset_is_what_alibi_files_give(hkv, group, s, past, pad, seed):
    """An ALiBi layer as graphc reads it: an additive key mask (a per-head bias, the padded keys at -inf), the causal
    offset and ``empty_rows="mean"``.  A row that sees no key gives the mean of V over every key, as the file's finfo.min
    fill does; every backend and form (decomposed, query chunks) gives the file's numbers."""
    _padded_rows_agree(hkv, group, s, past, pad, seed, alibi=True)


def test_empty_rows_zero_and_mean_differ_only_on_rows_with_no_visible_key():
    g = _attention_graph(4, 2, 0, "bool", dtype="float32")
    feeds = random_inputs(g, seed=7, b=1, s=4, t=4)
    feeds["m"] = np.array([False, False, True, True]).reshape(1, 1, 1, 4) & np.ones((1, 1, 4, 4), bool)
    zero = run(g, feeds, reference=True)["o"]
    node = g.nodes["o"]
    mean_op = replace(node.op, visibility=replace(node.op.visibility, empty_rows="mean"))
    got = mean_op.evaluate([feeds[n] for n in ("q", "k", "v", "m")], {"b": 1, "s": 4, "t": 4})
    np.testing.assert_array_equal(zero[:, :, :2], 0.0)  # queries 0, 1 see only hidden keys
    np.testing.assert_allclose(got[:, :, :2], np.repeat(feeds["v"].mean(2, keepdims=True), 2, 1).repeat(2, 2), rtol=1e-6)
    np.testing.assert_allclose(got[:, :, 2:], zero[:, :, 2:], rtol=1e-5, atol=1e-6)
    with pytest.raises(OpError, match="empty_rows must be one of"):
        graphc.Attention(0.5, graphc.Visibility(empty_rows="nan"))
