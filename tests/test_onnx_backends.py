"""ONNX export and the ONNX backends, against the NumPy interpreter and the independent reference."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from reference import ref_layer, ref_sdpa

import graphc
from graphc.optimizer import lower
from graphc import AttentionConfig, Graph, optimize
from graphc.errors import BackendError, BackendUnavailableError, ExportError, InputError, UnknownNameError
from lowering import onnx_target, export, random_inputs, run, run_numpy, unavailable_reason

F32 = dict(rtol=1e-4, atol=1e-5)
CFG = AttentionConfig(64, 8, 2, bias=True)

BUILDERS = {
    "core": (lambda: graphc.sdpa_graph(CFG), dict(batch=2, seq=5)),
    "layer": (lambda: graphc.attention_layer_graph(CFG, seed=0), dict(batch=2, seq=5)),
    "cross": (lambda: graphc.cross_attention_graph(CFG, seed=0), dict(batch=2, q_len=3, kv_len=7)),
    "decode": (lambda: graphc.kv_cache_graph(CFG, seed=0), dict(batch=2, seq=1, past_seq=6)),
    "mqa-decode": (lambda: graphc.kv_cache_graph(CFG.with_(n_kv_heads=1), seed=0), dict(batch=1, seq=2, past_seq=3)),
}


def _hand_graphs():
    rng = np.random.default_rng(0)
    ffn = Graph("ffn")
    x = ffn.input("x", ["batch", "seq", 8])
    h = ffn.relu(ffn.einsum("bsd,df->bsf", x, ffn.constant("w1", rng.standard_normal((8, 16)).astype(np.float32))))
    ffn.output(ffn.einsum("bsf,fd->bsd", h, ffn.constant("w2", rng.standard_normal((16, 8)).astype(np.float32)), name="y"))
    bil = Graph("bilinear")
    a, b = bil.input("a", ["n", 5]), bil.input("b", ["n", 6])
    bil.output(bil.einsum("ni,ij,nj->n", a, bil.constant("m", rng.standard_normal((5, 6)).astype(np.float32)), b, name="form"))
    three = Graph("three")
    p, q, r = three.input("p", [3, 4]), three.input("q", [4, "k"]), three.input("r", ["k", 2])
    three.output(three.einsum("ij,jk,kl->li", p, q, r, name="out"))
    odd = Graph("odd")  # summed-only labels, outer products, a transpose-needing output
    u, v = odd.input("u", [2, 3, 4]), odd.input("v", [4, 5])
    odd.output(odd.einsum("abc,cd->db", u, v, name="o1"), odd.einsum("abc,de->aebd", u, v, name="o2"))
    return {"ffn": (ffn, dict(batch=2, seq=3)), "bilinear": (bil, dict(n=4)), "three": (three, dict(k=3)), "odd": (odd, {})}


def _check(graph: Graph, sizes: dict, backends=("onnx-reference", "ort-cpu"), **options) -> None:
    feeds = random_inputs(graph, seed=1, **sizes)
    want = run_numpy(graph, feeds, compute_dtype="float64")
    for backend in backends:
        got = run(graph, feeds, backend, **options)
        assert list(got) == graph.outputs
        for name in want:
            np.testing.assert_allclose(got[name], want[name], **F32, err_msg=f"{backend} {name}")


@pytest.mark.parametrize("optimized", [False, True])
@pytest.mark.parametrize("kind", BUILDERS)
def test_builders_export_check_and_run_on_onnx_backends(kind, optimized):
    build, sizes = BUILDERS[kind]
    g = build()
    if optimized:
        g = optimize(g).graph
    model = export(g)
    onnx.checker.check_model(model, full_check=True)
    ops = {n.op_type for n in model.graph.node}
    assert "Einsum" not in ops and "MatMul" in ops
    if optimized:
        assert "Expand" not in ops  # the grouped form lowers to Reshape + MatMul, never back to a repeat
    _check(g, sizes)


@pytest.mark.parametrize("name", ["ffn", "bilinear", "three", "odd"])
def test_hand_written_einsum_graphs(name):
    g, sizes = _hand_graphs()[name]
    onnx.checker.check_model(export(g), full_check=True)
    _check(g, sizes)
    _check(optimize(g).graph, sizes)


def test_exported_model_loads_in_installed_onnxruntime():
    model = export(graphc.sdpa_graph(CFG))
    assert model.ir_version <= 13 < onnx.IR_VERSION  # onnxruntime 1.31 refuses onnx 1.23's default IR 14
    assert model.ir_version == onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", 23)])
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_dynamic_axes_and_shape_inference_agree_with_graphc(tmp_path):
    g = graphc.kv_cache_graph(CFG, seed=0)
    path = tmp_path / "kv.onnx"
    model = export(g, path)
    assert path.exists() and onnx.load(str(path)).graph.name == g.name
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["past_key"] == ["batch", 2, "past_seq", 8]
    outs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert outs["present_key"] == ["batch", 2, "past_seq+seq", 8]
    # dynamic: every dim ONNX can name agrees with graphc; expressions ONNX cannot name come back as unk__N
    assert _inferred_mismatches(_exported(g), model) == []
    # static: every value's inferred shape equals graphc's exactly, optimized or not
    static = graphc.kv_cache_graph(CFG, seed=0, batch=2, seq=3, past=5)
    for graph in (static, optimize(static).graph):
        assert _inferred_mismatches(_exported(graph), export(graph), allow_unknown=False) == []


def _exported(g: Graph) -> Graph:
    """The graph as export lowers it (attention recognised, then decomposed for MatMul export)."""
    return lower(g, onnx_target("decomposed", 23))


def _inferred_mismatches(g: Graph, model, allow_unknown: bool = True) -> list:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    infos = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)}
    bad = []
    for name, t in g.types.items():
        if name in g.initializers or name in g.inputs:
            continue
        if name not in infos:
            bad.append((name, "not inferred"))
            continue
        dims = [d.dim_param or d.dim_value for d in infos[name].type.tensor_type.shape.dim]
        ok = len(dims) == t.rank and all(theirs == ours or (allow_unknown and str(theirs).startswith("unk__")) for ours, theirs in zip(t.shape, dims))
        if not ok:
            bad.append((name, t.shape, dims))
    return bad


@pytest.mark.parametrize("kind", ["core", "layer", "cross", "decode", "mqa-decode"])
@pytest.mark.parametrize("mode", ["onnx-attention", "ort-gqa", "auto"])
def test_fused_modes_give_the_decomposed_numbers(kind, mode):
    build, sizes = BUILDERS[kind]
    g = build()
    if mode == "ort-gqa" and kind == "cross":
        with pytest.raises(ExportError, match="GroupQueryAttention needs a causal mask"):
            export(g, attention=mode)
        return
    model = export(g, attention=mode)
    ops = {n.op_type for n in model.graph.node}
    if mode == "onnx-attention":
        assert "Attention" in ops and "Softmax" not in ops
    if mode == "ort-gqa":
        assert "GroupQueryAttention" in ops and "Softmax" not in ops
    backends = ("ort-cpu",) if mode == "ort-gqa" else ("onnx-reference", "ort-cpu")
    _check(g, sizes, backends, attention=mode)


def test_fused_kv_cache_hands_the_cache_to_the_op():
    g = graphc.kv_cache_graph(CFG, seed=0)
    model = export(g, attention="onnx-attention")
    (att,) = [n for n in model.graph.node if n.op_type == "Attention"]
    assert list(att.input[3:]) == ["", "past_key", "past_value"]
    assert list(att.output) == ["attn_BHSD", "present_key", "present_value"]
    assert not [n for n in model.graph.node if n.op_type == "Concat" and "present_key" in n.output]


def test_auto_mode_picks_per_shape():
    decode = graphc.sdpa_graph(CFG, q_len=1, kv_len=4096)
    prefill = graphc.sdpa_graph(CFG, q_len=1024, kv_len=1024)
    bidirectional = graphc.sdpa_graph(CFG.with_(causal=False), q_len=1024, kv_len=1024)
    assert "Attention" not in {n.op_type for n in export(decode, attention="auto").graph.node}
    causal_ops = [n.op_type for n in export(prefill, attention="auto").graph.node]
    assert "Attention" not in causal_ops and causal_ops.count("Softmax") == 8  # query chunks over the visible keys
    assert "Attention" in {n.op_type for n in export(bidirectional, attention="auto").graph.node}


def test_decode_export_has_the_layout_onnxruntime_fuses(tmp_path):
    """Grouped decode: onnxruntime's optimized model keeps no Transpose and no K/V copy: K^T is folded into FusedMatMul."""
    import onnx
    import onnxruntime as ort

    g = graphc.optimize(graphc.sdpa_graph(CFG.with_(causal=False), q_len=1, kv_len=64)).graph
    export(g, tmp_path / "decode.onnx", attention="auto", sizes={"batch": 2, "q_len": 1, "kv_len": 64})
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "decode_ort.onnx")
    ort.InferenceSession(str(tmp_path / "decode.onnx"), opts, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "decode_ort.onnx")).graph.node]
    assert "Transpose" not in ops and "Expand" not in ops and "Tile" not in ops, ops
    assert ops.count("FusedMatMul") + ops.count("MatMul") == 2, ops


def test_auto_records_the_form_it_chose_in_the_trace():
    """What ``graphc optimize --target onnx-auto --explain`` prints: the form per attention and why."""
    from graphc.optimizer import lower
    from graphc.optimizer.infra import PassContext
    from lowering.exporter.targets import onnx_target

    cases = {
        (
            True,
            1024,
        ): "kept as ChunkedCausalAttention: query chunks over the visible keys: causal prefill skips the masked half"
        " (4096 query rows per KV head, 8 chunks)",
        (False, 1024): "kept as OnnxAttention: the standard ONNX Attention op (opset 23+) (4096 query rows per KV head)",
        (True, 1): "decomposed into grouped einsums: auto: 4 query row(s) per KV head, under 64",
    }
    for (causal, q_len), text in cases.items():
        ctx = PassContext()
        kv_len = q_len if q_len > 1 else 4096
        lowered = lower(graphc.sdpa_graph(CFG.with_(causal=causal), q_len=q_len, kv_len=kv_len), onnx_target("auto", 23), ctx=ctx)
        assert text in ctx.trace.explain(), (causal, q_len)
        form = text.split(":")[0].removeprefix("kept as ") if text.startswith("kept") else None
        assert [n.op.kind for n in lowered.topological_order() if n.op.kind.endswith("Attention")] == ([form] if form else [])


@pytest.mark.parametrize("kind", ["core", "layer", "decode", "mqa-decode"])
@pytest.mark.parametrize("seq", [1, 3, 13])
def test_chunked_causal_attention_gives_the_decomposed_numbers(kind, seq):
    """Query chunks against the visible keys: any length (chunk bounds computed at run time, empty chunks included), with a cache too."""
    build, sizes = BUILDERS[kind]
    g = build()
    model = export(g, attention="chunked")
    assert [n.op_type for n in model.graph.node].count("Softmax") == 8
    _check(g, {**sizes, "seq": seq}, ("onnx-reference", "ort-cpu"), attention="chunked")


@pytest.mark.parametrize(("q_len", "chunks"), [(100, 2), (256, 4), (300, 5), (4096, 8)])
def test_auto_splits_a_causal_prefill_into_chunks_of_at_least_64_rows(q_len, chunks):
    """The chunk count follows the known query length (one chunk per 64 rows, 2 to 8), and the chunks still give the
    decomposed numbers at other lengths than the one they were chosen for."""
    import onnxruntime as ort

    from lowering.exporter.forms import causal_chunks

    assert causal_chunks(q_len) == chunks and causal_chunks(None) == 8
    g = graphc.sdpa_graph(CFG, mask=True)
    model = export(g, attention="auto", sizes={"batch": 4, "seq": q_len})
    assert [n.op_type for n in model.graph.node].count("Softmax") == chunks
    read = {i for n in model.graph.node for i in n.input}
    assert [i.name for i in model.graph.initializer if i.name not in read] == []  # onnxruntime warns of each unread one
    feeds = random_inputs(g, seed=3, batch=2, seq=37)
    feeds["attn_mask"][1, :, :, :5] = False  # left padding: rows 0-4 of batch row 1 see no key
    want = run_numpy(g, feeds, compute_dtype="float64")["attn_BHSD"]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, **F32)


def test_chunked_refuses_what_it_cannot_carry():
    with pytest.raises(ExportError, match="chunked.*query chunks needs a causal mask"):
        export(graphc.cross_attention_graph(CFG, seed=0), attention="chunked")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inside the ONNX evaluator, before the NaN guard
def test_fully_masked_rows_are_zero_on_every_backend():
    g = graphc.sdpa_graph(CFG, causal=False, mask=True)
    feeds = random_inputs(g, seed=2, batch=2, seq=4)
    feeds["attn_mask"][1, 0, 2, :] = False
    for backend in ("numpy", "onnx-reference", "ort-cpu"):
        out = run(g, feeds, backend)["attn_BHSD"]
        assert not np.isnan(out).any(), backend
        np.testing.assert_array_equal(out[1, :, 2], 0.0)
        want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], mask=feeds["attn_mask"], scale=CFG.softmax_scale)
        np.testing.assert_allclose(out, want, **F32)


def test_optimized_layer_matches_independent_reference_on_ort():
    weights = graphc.init_weights(CFG, seed=5)
    g = optimize(graphc.attention_layer_graph(CFG, weights=weights)).graph
    feeds = random_inputs(g, seed=6, batch=1, seq=7)
    want, _, _ = ref_layer(CFG, weights, feeds["x_BSM"])
    np.testing.assert_allclose(run(g, feeds, "ort-cpu", threads=1)["out_BSM"], want, **F32)


def test_errors_are_clear():
    g = graphc.sdpa_graph(CFG)
    feeds = random_inputs(g, seed=0, batch=1, seq=2)
    with pytest.raises(UnknownNameError, match="unknown backend 'tpu'; valid backends: numpy, onnx-reference, ort-cpu, ort-cuda, torch"):
        run(g, feeds, "tpu")
    with pytest.raises(InputError, match=r"missing input\(s\) \['v_BHkvTD'\]"):
        run(g, {k: v for k, v in feeds.items() if k != "v_BHkvTD"}, "ort-cpu")
    with pytest.raises(BackendError, match=r"does not take option\(s\) \['compute_dtype'\]"):
        run(g, feeds, "ort-cpu", compute_dtype="float64")
    with pytest.raises(ExportError, match="opset must be an int in 18"):
        export(g, opset=11)
    with pytest.raises(ExportError, match="the Attention op needs opset 23 or later, got opset 21"):
        export(g, opset=21, attention="onnx-attention")
    with pytest.raises(UnknownNameError, match="unknown attention mode 'flash'"):
        export(g, attention="flash")
    ffn = _hand_graphs()["ffn"][0]
    with pytest.raises(ExportError, match="attention='onnx-attention': no attention recognised"):
        export(ffn, attention="onnx-attention")
    passthrough = Graph("passthrough")
    passthrough.output(passthrough.input("x", [2]))
    with pytest.raises(ExportError, match="graph output 'x' is a graph input"):
        export(passthrough)


def test_ort_cuda_refuses_to_run_without_cuda():
    reason = unavailable_reason("ort-cuda")
    if reason is None:
        pytest.skip("CUDAExecutionProvider is present here; covered by test_ort_cuda_matches_numpy")
    assert "CUDAExecutionProvider is not available" in reason and "onnxruntime-gpu" in reason
    g = graphc.sdpa_graph(CFG)
    with pytest.raises(BackendUnavailableError, match="backend 'ort-cuda' is unavailable"):
        run(g, random_inputs(g, batch=1, seq=2), "ort-cuda")


@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="CUDAExecutionProvider is not available (install onnxruntime-gpu on a machine with an NVIDIA GPU)",
)
@pytest.mark.parametrize("kind", ["core", "layer", "decode"])
@pytest.mark.parametrize("mode", ["decomposed", "onnx-attention"])
def test_ort_cuda_matches_numpy(kind, mode):
    build, sizes = BUILDERS[kind]
    g = build()
    _check(g, sizes, ("ort-cuda",), attention=mode)
    _check(optimize(g).graph, sizes, ("ort-cuda",))


def test_torch_backend_matches_numpy_or_skips():
    reason = unavailable_reason("torch")
    if reason:
        pytest.skip(reason)
    for kind in ("layer", "decode"):
        build, sizes = BUILDERS[kind]
        _check(build(), sizes, ("torch",))
        _check(optimize(build()).graph, sizes, ("torch",))


@pytest.mark.parametrize("spec", ["bsm,m->bsm", "bsm,bs->bsm", "ab,c->cab", "sm,bs->bms", "a,->a"])
def test_einsum_that_sums_nothing_exports_as_one_mul(spec):
    """A scale by a vector or an outer product is a broadcasting Mul in ONNX (a GEMM with K = 1 per element was 4096 tiny MatMuls)."""
    sizes = dict(zip("absmc", (2, 3, 4, 5, 6)))
    g = Graph("product")
    terms = spec.split("->")[0].split(",")
    ins = [g.input(f"x{i}", [sizes[ch] for ch in term]) for i, term in enumerate(terms)]
    g.output(g.einsum(spec, *ins, name="y"))
    model = export(g)
    assert [n.op_type for n in model.graph.node if n.op_type in ("Mul", "MatMul")] == ["Mul"]
    feeds = random_inputs(g, seed=0)
    want = np.einsum(spec, *(feeds[f"x{i}"].astype(np.float64) for i in range(len(terms))))
    for backend in ("ort-cpu", "onnx-reference"):
        np.testing.assert_allclose(run(g, feeds, backend=backend)["y"], want, rtol=1e-6, atol=1e-6, err_msg=backend)


@pytest.mark.parametrize("source", ["builder", "onnx Gelu", "torch spelling"])
def test_an_erf_gelu_exports_in_the_form_onnxruntime_fuses(source, tmp_path):
    """graphc's GELU, written by its MLP builder, imported from ONNX's ``Gelu`` or from torch's ``x / sqrt 2`` chain and
    optimized, exports as the chain onnxruntime fuses into one ``Gelu`` kernel (its ``x / sqrt 2`` a division): one
    kernel instead of five, the numbers of ``0.5 * x * (1 + erf(x / sqrt 2))``."""
    from math import erf, sqrt

    from onnx import TensorProto, helper

    from graphc.attention.blocks import activation
    from graphc.onnx_import import from_onnx

    g = Graph("mlp")
    x = g.input("x", ["b", 16])
    h = g.einsum("bi,oi->bo", x, g.constant("w", np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)))
    if source == "builder":
        g.output(activation(g, h, "gelu", name="y"))
    else:
        if source == "onnx Gelu":
            nodes = [helper.make_node("Gelu", ["x"], ["y"])]
        else:
            nodes = [helper.make_node(op, ins, [out]) for op, ins, out in (("Div", ["x", "r"], "a"), ("Erf", ["a"], "e"), ("Add", ["e", "one"], "p"),
                                                                          ("Mul", ["x", "p"], "xp"), ("Mul", ["xp", "half"], "y"))]  # fmt: skip
        inits = [helper.make_tensor(n, TensorProto.FLOAT, [], [v]) for n, v in (("r", sqrt(2)), ("one", 1.0), ("half", 0.5))]
        graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])], inits)  # fmt: skip
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(tmp_path / "gelu.onnx"))
        g = from_onnx(tmp_path / "gelu.onnx")
    exported = export(graphc.optimize(g).graph, tmp_path / "out.onnx", opset=20)
    options = ort.SessionOptions()
    options.optimized_model_filepath, options.log_severity_level = str(tmp_path / "ort.onnx"), 3
    session = ort.InferenceSession(exported.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert {"Gelu", "BiasGelu"} & {n.op_type for n in onnx.load(str(tmp_path / "ort.onnx")).graph.node}
    feeds = {g.inputs[0]: np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)}
    pre = feeds[g.inputs[0]].astype(np.float64)
    if source == "builder":
        pre = pre @ g.initializers["w"].astype(np.float64).T
    want = 0.5 * pre * (1 + np.vectorize(erf)(pre / sqrt(2)))
    np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)
