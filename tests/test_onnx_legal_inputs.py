"""Legal ONNX that graphc refused, now imported and equal to onnxruntime on the same file (NumPy and onnxruntime on
graphc's export): Einsum diagonals, Slice with a negative step, opset-11 Softmax (which flattens from its axis),
Dropout whose ratio is 0 with a run-time training mode, sparse initializers, external data longer than its tensor,
onnxruntime's FusedMatMul and QuickGelu; and the nested tensors' external data held to the model's folder."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphc.errors import OnnxImportError
from graphc.onnx_import import from_onnx
from lowering import run


def _model(nodes, inputs, outputs, initializers=(), opset=18, sparse=()):
    g = helper.make_graph(nodes, "legal", inputs, outputs, list(initializers), sparse_initializer=list(sparse))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _equal_to_onnxruntime(model, feeds, source=None):
    want = ort.InferenceSession(source or model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    g = from_onnx(source or model)
    for backend in ("numpy", "ort-cpu"):
        got = run(g, feeds, backend)
        for name, w in zip(g.outputs, want):
            np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6, err_msg=backend)


@pytest.mark.parametrize("equation, shapes", [("ii->i", [(4, 4)]), ("bii->bi", [(2, 3, 3)]), ("iij,jk->ik", [(3, 3, 2), (2, 5)]), ("ii", [(3, 3)])])
def test_einsum_diagonals_and_traces(equation, shapes):
    names = [f"x{k}" for k in range(len(shapes))]
    model = _model([helper.make_node("Einsum", names, ["y"], equation=equation)], [_vi(n, list(s)) for n, s in zip(names, shapes)], [_vi("y", None)])
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in zip(names, shapes)}
    _equal_to_onnxruntime(model, feeds)


@settings(max_examples=15, deadline=None)
@given(size=st.integers(1, 6), start=st.integers(-9, 9), stop=st.integers(-9, 9), step=st.integers(-3, -1))
def test_slice_with_a_negative_step(size, start, stop, step):
    model = _model(
        [helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])],
        [_vi("x", [2, size])],
        [_vi("y", None)],
        [_i64("s", [start]), _i64("e", [stop]), _i64("a", [1]), _i64("st", [step])],
    )
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": np.ones((2, size), np.float32)})[0]
    if want.size == 0:
        return  # an empty slice: graphc's dims are >= 1 along a gathered axis only where rows are kept
    _equal_to_onnxruntime(model, {"x": np.arange(2 * size, dtype=np.float32).reshape(2, size)})


def test_a_reversing_slice_to_int64_min():
    model = _model([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])], [_vi("x", [5])], [_vi("y", None)],
                   [_i64("s", [-1]), _i64("e", [-(2**63)]), _i64("a", [0]), _i64("st", [-1])])  # fmt: skip
    _equal_to_onnxruntime(model, {"x": np.arange(5, dtype=np.float32)})


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_opset_11_softmax_flattens_from_its_axis(axis):
    model = _model([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], [_vi("x", [2, 3, 4])], [_vi("y", [2, 3, 4])], opset=11)
    _equal_to_onnxruntime(model, {"x": np.random.default_rng(axis).standard_normal((2, 3, 4)).astype(np.float32)})


def test_dropout_with_ratio_0_is_the_identity_whatever_its_training_mode():
    """torch.onnx's dynamo GPT-2 exports: Dropout(x, 0.0, training) with training a run-time input."""
    model = _model(
        [helper.make_node("Dropout", ["x", "r", "t"], ["y"])],
        [_vi("x", [2, 3]), _vi("t", [], TensorProto.BOOL)],
        [_vi("y", [2, 3])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "r")],
    )
    _equal_to_onnxruntime(model, {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "t": np.array(False)})
    with pytest.raises(OnnxImportError, match="training_mode is a run-time input and its ratio is not a constant 0"):
        model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(0.1, np.float32), "r"))
        from_onnx(model)


@pytest.mark.parametrize("coordinates", [False, True])
def test_sparse_initializers(coordinates):
    values = numpy_helper.from_array(np.array([5.0, -2.0], np.float32), "w")
    idx = np.array([[0, 1], [1, 2]], np.int64) if coordinates else np.array([1, 5], np.int64)
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(idx, "w_indices"), [2, 3])
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [2, 3])], [_vi("y", [2, 3])], sparse=[sparse])
    _equal_to_onnxruntime(model, {"x": np.ones((2, 3), np.float32)})


def _external(t: onnx.TensorProto, location: str) -> onnx.TensorProto:
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    entry = t.external_data.add()
    entry.key, entry.value = "location", location
    return t


def test_external_data_longer_than_its_tensor_without_offset_or_length(tmp_path):
    (tmp_path / "w.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes() + b"\0" * 100)
    w = _external(numpy_helper.from_array(np.arange(4, dtype=np.float32), "w"), "w.bin")
    onnx.save(_model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [4])], [_vi("y", [4])], [w]), str(tmp_path / "m.onnx"))
    _equal_to_onnxruntime(None, {"x": np.ones(4, np.float32)}, source=str(tmp_path / "m.onnx"))


def _if_model(location: str) -> onnx.ModelProto:
    """``x + If(c, then: w, else: 0)``, the then-branch's ``w`` an initializer kept in an external file."""
    w = _external(numpy_helper.from_array(np.full(3, 2.0, np.float32), "w"), location)
    then = helper.make_graph([helper.make_node("Identity", ["w"], ["t"])], "then", [], [_vi("t", [3])], [w])
    zero = helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(np.zeros(3, np.float32)))
    other = helper.make_graph([zero], "else", [], [_vi("e", [3])])
    nodes = [helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other), helper.make_node("Add", ["x", "b"], ["y"])]
    return _model(nodes, [_vi("x", [3]), _vi("c", [], TensorProto.BOOL)], [_vi("y", [3])])


def test_a_branch_initializer_whose_external_data_leaves_the_folder_is_refused(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "w.bin").write_bytes(np.full(3, 7.0, np.float32).tobytes())
    (tmp_path / "model").mkdir()
    onnx.save(_if_model("../outside/w.bin"), str(tmp_path / "model" / "m.onnx"))
    with pytest.raises(OnnxImportError, match=r"tensor inside a node 'w'.*leaves the model's folder"):
        from_onnx(tmp_path / "model" / "m.onnx")
    (tmp_path / "model" / "w.bin").symlink_to(tmp_path / "outside" / "w.bin")
    onnx.save(_if_model("w.bin"), str(tmp_path / "model" / "m.onnx"))
    with pytest.raises(OnnxImportError, match=r"'w'.*is a link to .*outside the model's folder"):
        from_onnx(tmp_path / "model" / "m.onnx")


def test_a_branch_initializer_inside_the_folder_is_read_into_the_model(tmp_path):
    (tmp_path / "w.bin").write_bytes(np.full(3, 2.0, np.float32).tobytes())
    onnx.save(_if_model("w.bin"), str(tmp_path / "m.onnx"))
    g = from_onnx(tmp_path / "m.onnx")
    (tmp_path / "w.bin").unlink()  # the graph holds the data now
    feeds = {"x": np.arange(3, dtype=np.float32), "c": np.array(True)}
    np.testing.assert_array_equal(run(g, feeds, "numpy")["y"], feeds["x"] + 2.0)
    np.testing.assert_array_equal(run(g, feeds, "ort-cpu")["y"], feeds["x"] + 2.0)


@pytest.mark.parametrize("trans_a, trans_b, alpha", [(0, 0, 1.0), (1, 0, 0.5), (0, 1, 0.125), (1, 1, -2.0)])
def test_onnxruntimes_fused_matmul_is_alpha_times_the_product(trans_a, trans_b, alpha):
    """``com.microsoft.FusedMatMul`` (what onnxruntime's optimizer makes of a scaled, transposed MatMul): the product
    written here in NumPy and onnxruntime's numbers; the batch-transposing forms are refused by name."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 3) + ((4, 5) if trans_a else (5, 4))).astype(np.float32)
    b = rng.standard_normal((2, 3) + ((6, 4) if trans_b else (4, 6))).astype(np.float32)
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", alpha=alpha, transA=trans_a, transB=trans_b)
    model = _model([node], [_vi("a", list(a.shape)), _vi("b", list(b.shape))], [_vi("y", None)])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    want = alpha * (np.swapaxes(a, -1, -2) if trans_a else a) @ (np.swapaxes(b, -1, -2) if trans_b else b)
    np.testing.assert_allclose(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a, "b": b})[0],
                               want, rtol=1e-5, atol=1e-5)  # fmt: skip
    _equal_to_onnxruntime(model, {"a": a, "b": b})
    model.graph.node[0].attribute.append(helper.make_attribute("transBatchA", 1))
    with pytest.raises(OnnxImportError, match="transBatchA/transBatchB"):
        from_onnx(model)


@pytest.mark.parametrize("alpha", [1.0, 1.702])
def test_onnxruntimes_quick_gelu_is_x_times_sigmoid_of_alpha_x(alpha):
    x = np.linspace(-6, 6, 25, dtype=np.float32).reshape(5, 5)
    node = helper.make_node("QuickGelu", ["x"], ["y"], domain="com.microsoft", alpha=alpha)
    model = _model([node], [_vi("x", [5, 5])], [_vi("y", None)])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    want = x / (1 + np.exp(-alpha * x))
    np.testing.assert_allclose(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0],
                               want, rtol=1e-5, atol=1e-6)  # fmt: skip
    _equal_to_onnxruntime(model, {"x": x})


def test_nodes_out_of_order_are_read_in_an_order_that_defines_each_input_first():
    """onnxruntime runs a file whose nodes are not sorted (its float16 converter appends the input Casts last): the
    import reads such a graph in dependency order, equal to onnxruntime; a name nothing defines is still named."""
    nodes = [helper.make_node("Mul", ["xc", "xc"], ["sq"]), helper.make_node("Add", ["sq", "one"], ["y"])]
    nodes.append(helper.make_node("Cast", ["x"], ["xc"], to=TensorProto.FLOAT))
    model = _model(nodes, [_vi("x", [3], TensorProto.DOUBLE)], [_vi("y", [3])], [numpy_helper.from_array(np.ones(3, np.float32), "one")])
    x = np.array([1.5, -2.0, 3.0])
    np.testing.assert_allclose(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0],
                               x * x + 1, rtol=1e-6)  # fmt: skip
    _equal_to_onnxruntime(model, {"x": x})
    model.graph.node[0].input[1] = "nowhere"
    with pytest.raises(OnnxImportError, match="'nowhere' is not defined before this node"):
        from_onnx(model)


def test_onnxruntimes_fast_gelu_is_the_tanh_gelu_of_x_plus_bias():
    x = np.linspace(-5, 5, 24, dtype=np.float32).reshape(4, 6)
    bias = np.linspace(-0.5, 0.5, 6, dtype=np.float32)
    node = helper.make_node("FastGelu", ["x", "bias"], ["y"], domain="com.microsoft")
    model = _model([node], [_vi("x", [4, 6])], [_vi("y", None)], [numpy_helper.from_array(bias, "bias")])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    u = x + bias
    want = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
    np.testing.assert_allclose(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0],
                               want, rtol=1e-4, atol=1e-5)  # fmt: skip
    _equal_to_onnxruntime(model, {"x": x})
