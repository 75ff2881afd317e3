"""graphc.from_onnx: shape folding, op decompositions against onnxruntime, opaque pass-through, bad ONNX.

References are independent of graphc: onnxruntime running the original model
(its own kernels, including the ``com.microsoft`` contrib ops) and ONNX's
reference evaluator.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import installed
from graphc import optimize
from graphc.optimizer import Target, lower
from graphc.cli import main
from graphc.errors import ExecutionError, GraphcError, InputError, OnnxImportError
from graphc.onnx_import import MAX_DIM, from_onnx, supported_ops
from lowering import run
from lowering.exporter.onnx_export import export

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, initializers=(), opset=18, ms=False, value_info=()):
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(initializers), value_info=list(value_info))
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 10
    return model


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- shapes fold into symbolic dims
def test_shape_chain_becomes_a_symbolic_reshape() -> None:
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape with -1: a head split on symbolic dims, no run-time shape ops."""
    c = lambda name, v: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v, np.int64)))  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        c("i0", 0),
        c("i1", 1),
        c("ax", [0]),
        c("tail", [-1, 4]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        helper.make_node("Concat", ["b1", "n1", "tail"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", "seq", 32])], [helper.make_tensor_value_info("y", F, None)])
    g = from_onnx(model)
    assert g.op_counts() == {"Reshape": 1}
    assert g.types["y"].shape == ("batch", "seq", 8, 4)
    x = _w(2, 3, 32)
    np.testing.assert_array_equal(run(g, {"x": x}, backend="numpy")["y"], x.reshape(2, 3, 8, 4))


def test_value_names_and_dims_are_kept() -> None:
    model = _model(
        [
            helper.make_node("MatMul", ["x", "w"], ["/model/layers.0/self_attn/q_proj/MatMul_output_0"]),
            helper.make_node("Relu", ["/model/layers.0/self_attn/q_proj/MatMul_output_0"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", F, ["batch", "seq + past", 8])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(_w(8, 4), "w")],
    )
    g = from_onnx(model)
    assert "/model/layers.0/self_attn/q_proj/MatMul_output_0" in g.types
    assert g.types["x"].shape == ("batch", "past+seq", 8)
    assert g.outputs == ["y"]


# ---------------------------------------------------------------- decompositions vs onnxruntime's kernels
def test_gemm_split_slice_gather_softmax_match_onnxruntime() -> None:
    nodes = [
        helper.make_node("Gemm", ["x", "w", "bias"], ["h"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Split", ["h", "sizes"], ["a", "b"], axis=1),
        helper.make_node("Slice", ["a", "st", "en", "axs", "stp"], ["a2"]),
        helper.make_node("Gather", ["b", "idx"], ["b2"], axis=1),
        helper.make_node("Softmax", ["a2"], ["y1"], axis=-1),
        helper.make_node("ReduceMean", ["b2", "rax"], ["y2"], keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(_w(12, 6), "w"),
        numpy_helper.from_array(_w(12), "bias"),
        numpy_helper.from_array(np.array([8, 4], np.int64), "sizes"),
        numpy_helper.from_array(np.array([1], np.int64), "st"),
        numpy_helper.from_array(np.array([7], np.int64), "en"),
        numpy_helper.from_array(np.array([1], np.int64), "axs"),
        numpy_helper.from_array(np.array([2], np.int64), "stp"),
        numpy_helper.from_array(np.array([3, 0, 3], np.int64), "idx"),
        numpy_helper.from_array(np.array([1], np.int64), "rax"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [5, 6])],
        [helper.make_tensor_value_info("y1", F, None), helper.make_tensor_value_info("y2", F, None)],
        inits,
    )
    x = _w(5, 6)
    want = _ort(model, {"x": x})
    g = from_onnx(model, strict=True)
    for backend in installed("numpy", "ort-cpu", "torch"):
        got = run(optimize(g).graph, {"x": x}, backend=backend)
        np.testing.assert_allclose(got["y1"], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["y2"], want[1], rtol=1e-5, atol=1e-6)


def test_contrib_norms_and_rotary_match_onnxruntime() -> None:
    """com.microsoft SkipSimplifiedLayerNormalization, SimplifiedLayerNormalization and RotaryEmbedding, against onnxruntime's contrib kernels."""
    b, s, heads, d = 2, 5, 2, 8
    hidden = heads * d
    nodes = [
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["n1", "", "", "sum"], domain="com.microsoft", epsilon=1e-5),
        helper.make_node("SimplifiedLayerNormalization", ["sum", "gamma"], ["n2"], axis=-1, epsilon=1e-6),
        helper.make_node("RotaryEmbedding", ["n1", "pos", "cos", "sin"], ["r"], domain="com.microsoft", num_heads=heads),
        helper.make_node("Add", ["r", "n2"], ["y"]),
    ]
    angles = np.arange(32)[:, None] * (10000.0 ** (-np.arange(0, d, 2) / d))[None, :]
    inits = [
        numpy_helper.from_array(_w(hidden), "gamma"),
        numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
        numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", F, ["batch", "seq", hidden]),
        helper.make_tensor_value_info("skip", F, ["batch", "seq", hidden]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, ["batch", "seq"]),
    ]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("sum", F, None)], inits, ms=True)
    feeds = {"x": _w(b, s, hidden), "skip": _w(b, s, hidden), "pos": np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]], np.int64)}
    want = _ort(model, feeds)
    g = from_onnx(model, strict=True)
    for backend in ("numpy", "ort-cpu"):
        got = run(optimize(g).graph, feeds, backend=backend)
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["sum"], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_normalization_matches_onnxruntime(with_bias) -> None:
    """com.microsoft SkipLayerNormalization (onnxruntime-genai's and the transformers optimizer's GPT-2/BERT files):
    LayerNorm of input + skip (+ bias) with gamma and beta, and the sum as the fourth output."""
    hidden = 16
    ins = ["x", "skip", "gamma", "beta"] + (["bias"] if with_bias else [])
    nodes = [helper.make_node("SkipLayerNormalization", ins, ["y", "", "", "sum"], domain="com.microsoft", epsilon=1e-5)]
    inits = [numpy_helper.from_array(_w(hidden), n) for n in ("gamma", "beta")] + ([numpy_helper.from_array(_w(hidden), "bias")] if with_bias else [])
    inputs = [helper.make_tensor_value_info(n, F, ["batch", "seq", hidden]) for n in ("x", "skip")]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("sum", F, None)], inits, ms=True)
    feeds = {"x": _w(2, 5, hidden), "skip": _w(2, 5, hidden)}
    want = _ort(model, feeds)
    g = from_onnx(model, strict=True)
    for backend in ("numpy", "ort-cpu"):
        got = run(optimize(g).graph, feeds, backend=backend)
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["sum"], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hidden, eps, opset", [(16, 1e-5, 18), (48, 1e-12, 23)])
def test_layer_normalization_round_trips_as_one_op(hidden, eps, opset) -> None:
    """ONNX LayerNormalization (Bloom, GPT-2, MPT ...) imports as its pieces and exports again as one op (the pieces cost
    onnxruntime ten kernels), equal to onnxruntime on the original."""
    norm = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], axis=-1, epsilon=eps)
    nodes = [norm, helper.make_node("MatMul", ["n", "w"], ["y"])]
    inits = [numpy_helper.from_array(_w(hidden), "gamma"), numpy_helper.from_array(_w(hidden), "beta"), numpy_helper.from_array(_w(hidden, 8), "w")]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", "seq", hidden])], [helper.make_tensor_value_info("y", F, None)], inits)
    feeds = {"x": 3 + _w(2, 5, hidden)}
    want = _ort(model, feeds)[0]
    g = optimize(from_onnx(model, strict=True)).graph
    out = export(g, opset=opset)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("LayerNormalization") == 1 and "ReduceMean" not in ops, ops
    np.testing.assert_allclose(_ort(out, feeds)[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run(g, feeds, backend="ort-cpu")["y"], want, rtol=1e-4, atol=1e-4)


def test_a_layer_norm_whose_mean_is_read_elsewhere_stays_in_pieces() -> None:
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y", "mean"], axis=-1, epsilon=1e-5)]
    inits = [numpy_helper.from_array(_w(16), "gamma"), numpy_helper.from_array(_w(16), "beta")]
    outputs = [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("mean", F, None)]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", 16])], outputs, inits)
    feeds = {"x": _w(3, 16)}
    out = export(optimize(from_onnx(model, strict=True)).graph)
    assert "LayerNormalization" not in [n.op_type for n in out.graph.node]
    for got, want in zip(_ort(out, feeds), _ort(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_scatter_has_its_data_shape_whatever_the_file_declares() -> None:
    """optimum's files write part of a mask with ScatterND and declare its output with the heads of what it later meets
    (``[batch, 4, seq, seq]`` for a ``[batch, 1, seq, seq]`` mask): graphc carries ScatterND as an opaque node whose
    output is its data input's shape, as ONNX defines it, and runs the file as onnxruntime does."""
    nodes = [helper.make_node("ScatterND", ["data", "idx", "upd"], ["y"]), helper.make_node("Add", ["y", "x"], ["z"])]
    idx = numpy_helper.from_array(np.array([[0, 0, 1], [0, 0, 3]], np.int64), "idx")
    inputs = [helper.make_tensor_value_info("data", F, ["b", 1, 5, 5]), helper.make_tensor_value_info("upd", F, [2, 5]),
              helper.make_tensor_value_info("x", F, ["b", 4, 5, 5])]  # fmt: skip
    wrong = [helper.make_tensor_value_info("y", F, ["b", 4, 5, 5])]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("z", F, None)], [idx], value_info=wrong)
    feeds = {"data": _w(1, 1, 5, 5), "upd": _w(2, 5), "x": _w(1, 4, 5, 5)}
    g = from_onnx(model)
    assert g.types[g.producer("z").inputs[0]].shape == ("b", 1, 5, 5)
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(g, feeds, backend=backend)["z"], _ort(model, feeds)[0], rtol=1e-6, err_msg=backend)


def _expert_model() -> onnx.ModelProto:
    """One expert of a mixture as transformers before 5 wrote it: the tokens routed to it found with NonZero (a count
    only the data gives), gathered, projected by the expert's MatMul, viewed through that count, added back in place."""
    nodes = [
        helper.make_node("Greater", ["route", "zero"], ["mine"]),
        helper.make_node("NonZero", ["mine"], ["nz"]),  # [1, k]
        helper.make_node("Transpose", ["nz"], ["nzt"], perm=[1, 0]),  # [k, 1]
        helper.make_node("Squeeze", ["nzt", "one"], ["tokens"]),  # [k]
        helper.make_node("Gather", ["x", "tokens"], ["picked"], axis=0),  # [k, 6]
        helper.make_node("MatMul", ["picked", "w"], ["h"]),  # [k, 4]: empty when no token picks the expert
        helper.make_node("Shape", ["tokens"], ["k"]),
        helper.make_node("Concat", ["k", "two", "two"], ["split"], axis=0),
        helper.make_node("Reshape", ["h", "split"], ["h3"]),  # [k, 2, 2]
        helper.make_node("ReduceSum", ["h3", "last"], ["y"], keepdims=0),  # [k, 2]
    ]
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([2], np.int64), "two"), numpy_helper.from_array(np.array([2], np.int64), "last"),
             numpy_helper.from_array(_w(6, 4), "w")]  # fmt: skip
    inputs = [helper.make_tensor_value_info("x", F, ["n", 6]), helper.make_tensor_value_info("route", F, ["n"])]
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", F, None)], inits)


@pytest.mark.parametrize("picked", [3, 1, 0])
def test_a_count_only_the_data_gives_is_bound_as_computed(picked: int, tmp_path: Path) -> None:
    """A NonZero's count (``unk``) sizes a Reshape and a MatMul downstream: the NumPy interpreter binds it when the
    NonZero runs, the ONNX export reads it off the first value that carries it, and onnxruntime runs such a graph's
    contractions in the session that survives an empty one (no token for this expert)."""
    model = _expert_model()
    graph = optimize(from_onnx(model)).graph
    route = np.where(np.arange(5) < picked, 1.0, -1.0).astype(np.float32)
    feeds = {"x": _w(5, 6), "route": route}
    want = _ort(model, feeds)[0]
    assert want.shape == (picked, 2)
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(graph, feeds, backend=backend)["y"], want, rtol=1e-5, atol=1e-6, err_msg=backend)
    path = tmp_path / "expert.onnx"
    export(graph, path)
    np.testing.assert_allclose(_ort(onnx.load(str(path)), feeds)[0], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- ops graphc does not model
def _cumsum_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("CumSum", ["h", "axis"], ["c"], reverse=1),
        helper.make_node("Softmax", ["c"], ["y"], axis=-1),
    ]
    inits = [numpy_helper.from_array(_w(6, 4), "w"), numpy_helper.from_array(np.array(1, np.int64), "axis")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", 6])], [helper.make_tensor_value_info("y", F, ["batch", 4])], inits)


def test_unknown_op_passes_through_as_opaque_node(tmp_path: Path) -> None:
    model = _cumsum_model()
    x = _w(3, 6)
    (want,) = _ort(model, {"x": x})
    g = from_onnx(model)
    assert g.op_counts().get("Opaque") == 1
    assert "ai.onnx::CumSum" in str(g)
    opt = optimize(g).graph
    for backend in installed("numpy", "onnx-reference", "ort-cpu", "torch"):  # numpy/torch run it through ONNX's reference evaluator
        np.testing.assert_allclose(run(opt, {"x": x}, backend=backend)["y"], want, rtol=1e-5, atol=1e-6)
    exported = export(opt, tmp_path / "m.onnx")
    cumsum = [n for n in exported.graph.node if n.op_type == "CumSum"]
    assert len(cumsum) == 1 and helper.get_attribute_value(cumsum[0].attribute[0]) == 1  # written back with its attribute
    np.testing.assert_allclose(_ort(exported, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


def test_strict_import_names_op_domain_and_node() -> None:
    with pytest.raises(OnnxImportError, match=r"node 'c' \(CumSum\).*ai.onnx::CumSum.*strict"):
        from_onnx(_cumsum_model(), strict=True)


def test_contrib_op_graphc_does_not_model_runs_on_onnxruntime_only() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Gelu", ["h"], ["y"], domain="com.microsoft")]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 6])],
        [helper.make_tensor_value_info("y", F, [2, 4])],
        [numpy_helper.from_array(_w(6, 4), "w")],
        ms=True,
    )
    x = _w(2, 6)
    g = from_onnx(model)
    np.testing.assert_allclose(run(g, {"x": x}, backend="ort-cpu")["y"], _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"'y'.*com\.microsoft::Gelu.*no NumPy semantics"):
        run(g, {"x": x}, backend="numpy")


def test_opaque_node_without_a_type_asks_for_value_info() -> None:
    nodes = [helper.make_node("Gelu", ["x"], ["h"], domain="com.microsoft"), helper.make_node("Relu", ["h"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 6])], [helper.make_tensor_value_info("y", F, None)], ms=True)
    with pytest.raises(OnnxImportError, match=r"Gelu.*no type for its output 'h'.*value_info"):
        from_onnx(model)


def test_supported_ops_lists_the_converters() -> None:
    ops = supported_ops()
    for op in ("MatMul", "Attention", "RotaryEmbedding", "RMSNormalization", "Expand", "Trilu", "Range", "Split"):
        assert op in ops["ai.onnx"]
    assert {"SkipSimplifiedLayerNormalization", "GroupQueryAttention", "MultiHeadAttention", "RotaryEmbedding"} <= set(ops["com.microsoft"])


# ---------------------------------------------------------------- bad ONNX
def _small_model() -> onnx.ModelProto:
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", F, [2, 64])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(_w(64, 64), "w")],
    )


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    data = _small_model().SerializeToString()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxImportError, match=r"m\.onnx.*is not an ONNX model.*truncated"):
        from_onnx(path)


def test_not_onnx_file(tmp_path: Path) -> None:
    path = tmp_path / "config.onnx"
    path.write_text('{"hidden_size": 4096}')
    with pytest.raises(OnnxImportError, match="is not an ONNX model"):
        from_onnx(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(OnnxImportError, match="does not exist"):
        from_onnx(tmp_path / "nope.onnx")
    with pytest.raises(OnnxImportError, match="is not a file"):
        from_onnx(tmp_path)


def _external(tmp_path: Path, location: str) -> Path:
    model = _small_model()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.ClearField("float_data")
    w.data_location = TensorProto.EXTERNAL
    entry = w.external_data.add()
    entry.key, entry.value = "location", location
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_missing_external_data(tmp_path: Path) -> None:
    with pytest.raises(OnnxImportError, match=r"initializer 'w'.*external data file 'weights.bin' is missing"):
        from_onnx(_external(tmp_path, "weights.bin"))


def test_external_data_outside_the_model_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64 * 64 * 4)
    sub = tmp_path / "model"
    sub.mkdir()
    with pytest.raises(OnnxImportError, match=r"external data: file '\.\./secret\.bin' leaves the model's folder.*refused"):
        from_onnx(_external(sub, "../secret.bin"))
    with pytest.raises(OnnxImportError, match="is an absolute path; a model's folder names files inside itself"):
        from_onnx(_external(sub, str(tmp_path / "secret.bin")))


def test_short_external_data(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 100)
    with pytest.raises(OnnxImportError, match=r"holds 100 bytes"):
        from_onnx(_external(tmp_path, "weights.bin"))


def test_external_data_loads_from_the_model_folder(tmp_path: Path) -> None:
    model = _small_model()
    want = numpy_helper.to_array(model.graph.initializer[0])
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    assert (tmp_path / "m.data").stat().st_size == want.nbytes
    g = from_onnx(tmp_path / "m.onnx")
    np.testing.assert_array_equal(g.initializers["w"], want)


def test_unknown_opset() -> None:
    model = _small_model()
    model.opset_import[0].version = 99
    with pytest.raises(OnnxImportError, match=r"opset 99; graphc imports opsets 7\.\.\d+"):
        from_onnx(model)


def test_huge_dim() -> None:
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", F, [10**12, 4])], [helper.make_tensor_value_info("y", F, None)]
    )
    with pytest.raises(OnnxImportError, match=rf"graph input 'x' axis 0 has size 1000000000000; graphc accepts sizes 0\.\.{MAX_DIM}"):
        from_onnx(model)


def test_unsupported_input_dtype() -> None:
    model = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=F)],
        [helper.make_tensor_value_info("x", TensorProto.UINT16, [4])],
        [helper.make_tensor_value_info("y", F, None)],
    )
    with pytest.raises(OnnxImportError, match=r"graph input 'x' has a type graphc does not support \(UINT16"):
        from_onnx(model)


def test_bad_node_is_named() -> None:
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", F, [2, 5])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(_w(6, 4), "w")],
    )
    with pytest.raises(OnnxImportError, match=r"node 'y' \(MatMul\).*label 'b' has size 5 in operand 0 but 6 in operand 1"):
        from_onnx(model)


def test_errors_are_graphc_errors() -> None:
    assert issubclass(OnnxImportError, GraphcError) and issubclass(OnnxImportError, ValueError)


def test_cli_bad_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07garbage")
    assert main(["optimize", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.onnx" in err[0] and "not an ONNX model" in err[0]


def test_cli_dim_names_must_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_cumsum_model(), str(path))
    assert main(["compare", str(path), "--dim", "seq=4", "--quiet"]) == 2
    assert "--dim names seq" in capsys.readouterr().err and "batch"


# ---------------------------------------------------------------- onnxruntime's contrib attention ops
GQA_CASES = {
    "decode": dict(B=2, S=1),
    "decode-softcap": dict(B=2, S=1, softcap=2.0),
    "decode-window": dict(B=2, S=1, local_window_size=3),
    "decode-rotary": dict(B=2, S=1, do_rotary=1),
    "decode-rotary-interleaved": dict(B=2, S=1, do_rotary=1, rotary_interleaved=1),
    "chunk-after-past": dict(B=1, S=3, do_rotary=1),
    "prefill": dict(B=2, S=3, prefill=True),
    "packed-qkv": dict(B=2, S=1, packed=True),
    "decode-ragged": dict(B=3, S=1, ragged=True),  # onnxruntime-genai's left-padded batch: rows of different lengths
    "decode-ragged-rotary": dict(B=3, S=1, ragged=True, do_rotary=1),
}


def _gqa_against_onnxruntime(feeds: dict[str, np.ndarray], ins: list[str], attrs: dict, head_dim: int) -> tuple[list[np.ndarray], object]:
    """A model of one GroupQueryAttention over ``feeds`` (rotary tables appended when ``attrs`` ask for them): what
    onnxruntime gives, and graphc's optimized import of it."""
    inits = []
    if attrs.get("do_rotary"):
        angles = np.arange(64)[:, None] * (10000.0 ** (-np.arange(0, head_dim, 2) / head_dim))[None]
        inits = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"), numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
        ins = [*ins, "cos", "sin"]
    node = helper.make_node("GroupQueryAttention", ins, ["y", "present_key", "present_value"], domain="com.microsoft", **attrs)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n in ("seqlens", "total") else F, list(a.shape)) for n, a in feeds.items()]
    model = _model([node], inputs, [helper.make_tensor_value_info(n, F, None) for n in ("y", "present_key", "present_value")], inits, ms=True)
    return _ort(model, feeds), optimize(from_onnx(model, strict=True)).graph


def _assert_gqa_equal(want: list[np.ndarray], g, feeds: dict[str, np.ndarray]) -> None:  # noqa: ANN001 - a Graph
    for backend in ("numpy", "ort-cpu"):
        got = run(g, feeds, backend=backend)
        for name, ref in zip(("y", "present_key", "present_value"), want):
            np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-6, err_msg=f"{backend} {name}")


@pytest.mark.parametrize("case", sorted(GQA_CASES))
def test_group_query_attention_matches_onnxruntime(case: str) -> None:
    cfg = dict(GQA_CASES[case])
    b, s, prefill, packed, ragged = cfg.pop("B"), cfg.pop("S"), cfg.pop("prefill", False), cfg.pop("packed", False), cfg.pop("ragged", False)
    heads, kv, d, past = 4, 2, 16, 0 if prefill else 5
    feeds: dict[str, np.ndarray] = {}
    if packed:
        feeds["qkv"] = _w(b, s, (heads + 2 * kv) * d)
    else:
        feeds.update(q=_w(b, s, heads * d), k=_w(b, s, kv * d), v=_w(b, s, kv * d))
    if not prefill:
        feeds.update(pk=_w(b, kv, past, d), pv=_w(b, kv, past, d))
    feeds["seqlens"] = np.full((b,), past + s - 1, np.int32)  # every row's past fills the cache
    if ragged:  # row 1 holds 2 past tokens, row 2 none: new keys go after each row's own past, the slots after are zeros
        feeds["seqlens"] = np.array([past + s - 1, 2 + s - 1, s - 1], np.int32)
    feeds["total"] = np.array(past + s, np.int32)
    ins = ["qkv", "", ""] if packed else ["q", "k", "v"]
    ins += ["", ""] if prefill else ["pk", "pv"]
    ins += ["seqlens", "total"]
    _assert_gqa_equal(*_gqa_against_onnxruntime(feeds, ins, dict(num_heads=heads, kv_num_heads=kv, **cfg), d), feeds)


@pytest.mark.parametrize("empty_past", [False, True], ids=["no-past", "empty-past"])
@pytest.mark.parametrize("extra", [{}, {"do_rotary": 1}, {"local_window_size": 3}], ids=["plain", "rotary", "window"])
def test_group_query_attention_ragged_prompt_matches_onnxruntime(empty_past: bool, extra: dict) -> None:
    """A prompt batch of rows of different lengths (seqlens_k < S - 1): onnxruntime reads the rows right-padded (query
    i sees keys j <= i of the row's own L_b).  graphc read them bottom-right aligned until this test, silently wrong."""
    heads, kv, d, s, lengths = 4, 2, 16, 6, [6, 4, 1]
    b = len(lengths)
    feeds = dict(q=_w(b, s, heads * d), k=_w(b, s, kv * d), v=_w(b, s, kv * d))
    ins = ["q", "k", "v", "pk", "pv"] if empty_past else ["q", "k", "v", "", ""]
    if empty_past:
        feeds.update(pk=_w(b, kv, 0, d), pv=_w(b, kv, 0, d))
    feeds.update(seqlens=np.array(lengths, np.int32) - 1, total=np.array(s, np.int32))
    ins += ["seqlens", "total"]
    _assert_gqa_equal(*_gqa_against_onnxruntime(feeds, ins, dict(num_heads=heads, kv_num_heads=kv, **extra), d), feeds)


def test_group_query_attention_is_one_causal_attention_with_its_cache() -> None:
    """GroupQueryAttention over a cache is read as what it is: causal at the cache length, the KV cache, and a bool
    mask for what differs per row (a ragged batch's rows, the window)."""
    heads, kv, d = 4, 2, 16
    node = helper.make_node(
        "GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["y", "present_key", "present_value"], domain="com.microsoft",
        num_heads=heads, kv_num_heads=kv, local_window_size=8,
    )  # fmt: skip
    shapes = {"q": ["b", "s", heads * d], "k": ["b", "s", kv * d], "v": ["b", "s", kv * d], "pk": ["b", kv, "p", d], "pv": ["b", kv, "p", d]}
    inputs = [helper.make_tensor_value_info(n, F, sh) for n, sh in shapes.items()]
    inputs += [helper.make_tensor_value_info("seqlens", TensorProto.INT32, ["b"]), helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    model = _model([node], inputs, [helper.make_tensor_value_info(n, F, None) for n in ("y", "present_key", "present_value")], ms=True)
    lowered = lower(optimize(from_onnx(model)).graph, Target("keep", lambda graph, n, ctx: None))
    (op,) = [n.op for n in lowered.topological_order() if n.op.kind == "Attention"]
    assert (op.visibility.causal_offset, op.kv_cache, op.mask) == ("p", True, "bool")


ROLLING_CASES = {  # (new tokens, each row's past tokens, rotary): a rolling cache of W = 4 slots
    "filling": (1, [2], False),
    "just-full": (1, [4], False),
    "rolling": (1, [9], False),
    "rolling-chunk": (2, [10], True),
    "prefill-past-the-window": (6, [0], False),
    "ragged-decode": (1, [9, 2], True),
}


@pytest.mark.parametrize("case", sorted(ROLLING_CASES))
def test_group_query_attention_rolling_cache_matches_onnxruntime(case: str) -> None:
    """onnxruntime-genai's sliding-window layers (``sliding_window_cache=1``): the cache holds each row's last
    ``min(past, W)`` tokens in its first slots and the present is the last ``W`` keys.  onnxruntime leaves present slots
    past a row's keys unspecified, so those are not compared."""
    s, pasts, rotary = ROLLING_CASES[case]
    heads, kv, d, w = 4, 2, 16, 4
    b = len(pasts)
    feeds = dict(q=_w(b, s, heads * d), k=_w(b, s, kv * d), v=_w(b, s, kv * d), pk=_w(b, kv, w, d), pv=_w(b, kv, w, d))
    feeds["seqlens"] = np.array([p + s - 1 for p in pasts], np.int32)
    feeds["total"] = np.array(max(pasts) + s, np.int32)
    attrs = dict(num_heads=heads, kv_num_heads=kv, local_window_size=w, sliding_window_cache=1, do_rotary=int(rotary))
    want, g = _gqa_against_onnxruntime(feeds, ["q", "k", "v", "pk", "pv", "seqlens", "total"], attrs, d)
    kept = [min(min(p, w) + s, w) for p in pasts]  # the present slots onnxruntime defines, per row
    for backend in ("numpy", "ort-cpu"):
        got = run(g, feeds, backend=backend)
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-6, err_msg=backend)
        for name, ref in zip(("present_key", "present_value"), want[1:]):
            for row, n in enumerate(kept):
                np.testing.assert_allclose(got[name][row, :, :n], ref[row, :, :n], rtol=1e-5, atol=1e-6, err_msg=f"{backend} {name} row {row}")
                assert not got[name][row, :, n:].any()  # graphc writes zeros there
    with pytest.raises(InputError, match="'pk': axis 2 must be 4"):  # a cache of another length than the window
        run(g, {**feeds, "pk": _w(b, kv, 6, d), "pv": _w(b, kv, 6, d)})


@pytest.mark.parametrize("attr", [{"sliding_window_cache": 1}, {"qk_output": 1}, {"future_attribute": 3}])
def test_group_query_attention_attributes_graphc_does_not_model_are_refused(attr) -> None:
    """Attributes graphc does not model are refused by name, never ignored; a rolling cache (``sliding_window_cache=1``)
    with fewer slots than its window (onnxruntime refuses it too) is refused at import."""
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seqlens", "total"],
        ["y", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=2,
        kv_num_heads=1,
        local_window_size=4,
        **attr,
    )
    shapes = {"q": [1, 1, 32], "k": [1, 1, 16], "v": [1, 1, 16], "pk": [1, 1, 3, 16], "pv": [1, 1, 3, 16], "seqlens": [1], "total": []}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n in ("seqlens", "total") else F, sh) for n, sh in shapes.items()]
    model = _model([node], inputs, [helper.make_tensor_value_info(n, F, None) for n in ("y", "present_key", "present_value")], ms=True)
    with pytest.raises(OnnxImportError, match=next(iter(attr))):
        from_onnx(model)


MHA_CASES = {
    "cross": dict(),
    "causal-self": dict(unidirectional=1, self=True),
    "attention-bias": dict(bias=True),
    "causal-with-past": dict(past=True, unidirectional=1, self=True),
    "scaled": dict(scale=0.3),
}


@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_multi_head_attention_matches_onnxruntime(case: str) -> None:
    cfg = dict(MHA_CASES[case])
    bias, past, self_attention = cfg.pop("bias", False), cfg.pop("past", False), cfg.pop("self", False)
    b, s, heads, d = 2, 3, 4, 8
    keys = s if self_attention else 4
    feeds = {"q": _w(b, s, heads * d), "k": _w(b, keys, heads * d), "v": _w(b, keys, heads * d)}
    ins = ["q", "k", "v", "", "", "ab" if bias else ""]
    if bias:
        feeds["ab"] = _w(b, 1, s, keys)
    if past:
        feeds.update(pk=_w(b, heads, 5, d), pv=_w(b, heads, 5, d))
        ins += ["pk", "pv"]
    outs = ["y", "present_key", "present_value"] if past else ["y"]
    node = helper.make_node("MultiHeadAttention", ins, outs, domain="com.microsoft", num_heads=heads, **cfg)
    model = _model(
        [node],
        [helper.make_tensor_value_info(n, F, list(a.shape)) for n, a in feeds.items()],
        [helper.make_tensor_value_info(o, F, None) for o in outs],
        ms=True,
    )
    want = _ort(model, feeds)
    g = optimize(from_onnx(model, strict=True)).graph
    for backend in ("numpy", "ort-cpu"):
        got = run(g, feeds, backend=backend)
        for name, ref in zip(outs, want):
            np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-6, err_msg=f"{backend} {name}")


def test_multi_head_attention_key_padding_mask_is_refused() -> None:
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "mask"], ["y"], domain="com.microsoft", num_heads=2)
    inputs = [helper.make_tensor_value_info(n, F, [1, 3, 8]) for n in "qkv"] + [helper.make_tensor_value_info("mask", TensorProto.INT32, [1, 3])]
    model = _model([node], inputs, [helper.make_tensor_value_info("y", F, None)], ms=True)
    with pytest.raises(OnnxImportError, match="key_padding_mask is not supported.*attention_bias"):
        from_onnx(model)


def test_example_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "onnx_import.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "Expand nodes: 2 before, 0 after" in out and "'Repeat'" not in out.split("optimized:")[1].splitlines()[0]


def test_cli_compare_imported_model_on_given_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, arrays = tmp_path / "m.onnx", tmp_path / "inputs.npz"
    onnx.save(_cumsum_model(), str(path))
    np.savez(arrays, x=_w(5, 6))
    assert main(["compare", str(path), "--inputs", str(arrays), "--backends", "numpy,ort-cpu", "--quiet", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "inputs x[5, 6]" in out and out.count("PASS") == 2
    assert main(["compare", str(path), "--inputs", str(tmp_path / "missing.npz"), "--quiet"]) == 2
    assert "--inputs" in capsys.readouterr().err


def test_group_query_attention_with_a_float_seqlens_k_is_refused_as_onnxruntime_refuses_it() -> None:
    b, heads, kv, d = 1, 4, 2, 16
    ins = ["q", "k", "v", "", "", "seqlens", "total"]
    node = helper.make_node("GroupQueryAttention", ins, ["y", "pk", "pv"], domain="com.microsoft", num_heads=heads, kv_num_heads=kv)
    inputs = [helper.make_tensor_value_info("q", F, [b, 3, heads * d]), helper.make_tensor_value_info("k", F, [b, 3, kv * d]),
              helper.make_tensor_value_info("v", F, [b, 3, kv * d]), helper.make_tensor_value_info("seqlens", F, [b]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]  # fmt: skip
    model = _model([node], inputs, [helper.make_tensor_value_info(n, F, None) for n in ("y", "pk", "pv")], ms=True)
    with pytest.raises(OnnxImportError, match="seqlens_k must be int32 .* got float32"):
        from_onnx(model, strict=True)


def _opaque_doc() -> dict:
    from graphc.serialize import graph_to_dict

    return graph_to_dict(from_onnx(_cumsum_model()))


def _opaque_entry(doc: dict) -> dict:
    return next(n["op"] for n in doc["nodes"] if n["op"]["kind"] == "Opaque")


def test_a_graph_json_whose_opaque_node_names_one_op_and_holds_another_is_refused() -> None:
    """``str(graph)`` prints the op_type; the proto is what runs and is exported: they must agree."""
    import base64

    from graphc.serialize import graph_from_dict

    doc = _opaque_doc()
    entry = _opaque_entry(doc)
    neg = helper.make_node("Neg", ["a"], ["b"])
    entry["attrs"]["proto"] = base64.b64encode(neg.SerializeToString()).decode()
    with pytest.raises(GraphcError, match=r"ai.onnx::CumSum: attribute 'proto' holds a ai.onnx::Neg node"):
        graph_from_dict(doc)
    entry["attrs"]["proto"] = "not base64!"
    with pytest.raises(GraphcError, match=r"attribute 'proto' is not a base64 ONNX NodeProto"):
        graph_from_dict(doc)


def test_an_opaque_node_that_returns_another_shape_than_it_declares_is_an_error() -> None:
    from graphc.serialize import graph_from_dict

    doc = _opaque_doc()
    _opaque_entry(doc)["attrs"]["output_shapes"] = [["batch", 7]]  # CumSum returns [batch, 4]
    for node in doc["nodes"][1:]:  # the opaque node and the softmax after it, consistently
        node["type"]["shape"] = ["batch", 7]
    g = graph_from_dict(doc)
    with pytest.raises(ExecutionError, match=r"output 0 is declared \['batch', 7\].*returned \[3, 4\]"):
        run(g, {"x": _w(3, 6)}, backend="numpy")
