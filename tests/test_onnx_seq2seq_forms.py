"""The forms optimum's encoder, vision and seq2seq files are written in, each in a small hand-built model checked
against onnxruntime on the same file: a merged decoder's ``If`` whose branches read the enclosing graph
(``fixed_inputs``), T5's ``bias[:, :, -seq:]`` (a ``Slice`` from ``Neg`` of a shape), a zero fill broadcast larger than
the mask it is added to, BART's positions expanded to ``[batch, seq]``, a ``Conv`` over a symbolic image size that
meets a position table (``dims``), and ``Log``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import INSTALLED
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphc.cli import main
from graphc.errors import OnnxImportError
from graphc.onnx_import import from_onnx
from graphc.optimizer import optimize
from lowering import run

pytestmark = pytest.mark.core

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _model(nodes, inputs, outputs, inits=()):
    m = helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return m


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _equal_everywhere(graph, feeds, want):
    optimized = optimize(graph).graph
    for backend in INSTALLED:
        got = run(optimized, feeds, backend=backend)
        for name, w in zip(graph.outputs, want):
            assert got[name].shape == w.shape, backend
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=backend)


def _merged_decoder() -> onnx.ModelProto:
    """optimum's merged-decoder shape: ``If(use_cache_branch)``; the cache branch appends the new rows to ``past`` and
    multiplies by the outer weight ``w``; the first-step branch ignores ``past`` and scales by its own initializer."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "w")
    then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Concat", ["past", "xw"], ["then_out"], axis=1)],
        "with_past",
        [],
        [helper.make_tensor_value_info("then_out", F, ["b", "t", 4])],
    )
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    other = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw2"]), helper.make_node("Mul", ["xw2", "two"], ["else_out"])],
        "first_step",
        [],
        [helper.make_tensor_value_info("else_out", F, ["b", "s", 4])],
        [two],
    )
    node = helper.make_node("If", ["use_cache_branch"], ["present"], name="optimum::if", then_branch=then, else_branch=other)
    inputs = [
        helper.make_tensor_value_info("x", F, ["b", "s", 4]),
        helper.make_tensor_value_info("past", F, ["b", "p", 4]),
        helper.make_tensor_value_info("use_cache_branch", BOOL, [1]),
    ]
    return _model([node], inputs, [helper.make_tensor_value_info("present", F, None)], [w])


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_merged_decoder_imports_the_branch_its_fixed_input_takes(use_cache):
    model = _merged_decoder()
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32), "past": rng.standard_normal((2, 5, 4)).astype(np.float32)}
    want = _ort(model, {**feeds, "use_cache_branch": np.array([use_cache])})
    graph = from_onnx(model, fixed_inputs={"use_cache_branch": use_cache})
    assert "use_cache_branch" not in graph.inputs  # a constant of the graph now
    assert [n.op.kind for n in graph.topological_order()].count("Concat") == int(use_cache)
    _equal_everywhere(graph, feeds, want)
    assert model.graph.node[0].op_type == "If"  # the caller's model is untouched


def test_an_if_on_a_run_time_condition_names_the_input_to_fix():
    with pytest.raises(OnnxImportError, match=r"If on condition 'use_cache_branch'.*fixed_inputs=\{'use_cache_branch': True\}"):
        from_onnx(_merged_decoder())


@pytest.mark.parametrize(
    "fixed, message",
    [
        ({"use_cache": True}, r"fixed input\(s\) 'use_cache' are not graph inputs of the model \(its inputs: x, past, use_cache_branch\)"),
        ({"use_cache_branch": [True, False]}, r"fixed input 'use_cache_branch' has shape \[2\]; the model declares \[1\]"),
        ({"use_cache_branch": 0.5}, r"fixed input 'use_cache_branch': 0.5 is not a bool value"),
    ],
)
def test_bad_fixed_inputs_are_named(fixed, message):
    with pytest.raises(OnnxImportError, match=message):
        from_onnx(_merged_decoder(), fixed_inputs=fixed)


def _t5_bias_slice() -> onnx.ModelProto:
    """T5 with a past: the relative bias computed for all ``[keys, keys]`` pairs, then ``bias[:, :, -seq:, :]``: the
    start is ``Neg`` of the query length read from a shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Neg", ["seq"], ["minus_seq"]),
        helper.make_node("Unsqueeze", ["minus_seq", "zero_axis"], ["starts"]),
        helper.make_node("Slice", ["bias", "starts", "big", "two_axis"], ["rows"]),
        helper.make_node("Add", ["rows", "scores"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
        numpy_helper.from_array(np.array([2**62], np.int64), "big"),
        numpy_helper.from_array(np.array([2], np.int64), "two_axis"),
    ]
    inputs = [_vi("x", F, ["b", "s", 8]), _vi("bias", F, [1, 2, "k", "k"]), _vi("scores", F, ["b", 2, "s", "k"])]
    return _model(nodes, inputs, [_vi("y", F, None)], inits)


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


@settings(max_examples=8, deadline=None)
@given(seq=st.integers(1, 6), past=st.integers(0, 5))
def test_a_slice_from_the_negated_query_length_keeps_the_last_rows(seq, past):
    model = _t5_bias_slice()
    rng = np.random.default_rng(seq * 7 + past)
    keys = seq + past
    feeds = {
        "x": rng.standard_normal((2, seq, 8)).astype(np.float32),
        "bias": rng.standard_normal((1, 2, keys, keys)).astype(np.float32),
        "scores": rng.standard_normal((2, 2, seq, keys)).astype(np.float32),
    }
    _equal_everywhere(from_onnx(model), feeds, _ort(model, feeds))


def test_a_zero_fill_larger_than_the_mask_it_meets_keeps_its_shape():
    """T5's cross-attention: ``zeros([1, heads, q, k]) + mask[b, 1, 1, k]``, the fill's shape from the scores' shape."""
    nodes = [
        helper.make_node("Shape", ["scores"], ["full"]),
        helper.make_node("Slice", ["full", "one", "four"], ["qk"]),
        helper.make_node("Concat", ["one_head", "qk"], ["fill_shape"], axis=0),
        helper.make_node("ConstantOfShape", ["fill_shape"], ["zeros"], value=numpy_helper.from_array(np.zeros(1, np.float32))),
        helper.make_node("Add", ["zeros", "mask"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["y"]),
        helper.make_node("Softmax", ["y"], ["p"], axis=-1),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([4], np.int64), "four"),
        numpy_helper.from_array(np.array([1], np.int64), "one_head"),
    ]
    model = _model(nodes, [_vi("scores", F, ["b", 3, "q", "k"]), _vi("mask", F, ["b", 1, 1, "k"])], [_vi("p", F, None), _vi("bias", F, None)], inits)
    rng = np.random.default_rng(2)
    mask = np.where(rng.random((2, 1, 1, 5)) < 0.3, -1e4, 0).astype(np.float32)
    feeds = {"scores": rng.standard_normal((2, 3, 4, 5)).astype(np.float32), "mask": mask}
    _equal_everywhere(from_onnx(model), feeds, _ort(model, feeds))


def test_positions_expanded_to_batch_and_sequence_then_offset():
    """BART's learned positions: ``Expand(arange(seq), [batch, seq]) + 2``, gathered from the table."""
    nodes = [
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
        helper.make_node("Expand", ["positions", "shape"], ["grid"]),
        helper.make_node("Add", ["grid", "two"], ["offset"]),
        helper.make_node("Gather", ["table", "offset"], ["y"], axis=0),
    ]
    table = np.random.default_rng(3).standard_normal((20, 4)).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0), ("one", 1), ("two", 2))]
    model = _model(nodes, [_vi("ids", I64, ["b", "s"])], [_vi("y", F, None)], [*inits, numpy_helper.from_array(table, "table")])
    feeds = {"ids": np.zeros((3, 6), np.int64)}
    _equal_everywhere(from_onnx(model), feeds, _ort(model, feeds))


def _patch_embedding() -> onnx.ModelProto:
    """ViT's embeddings as optimum writes them: a patch Conv over ``[batch, channels, height, width]``, flattened, a
    class token in front, plus a position table of ``(8/2)**2 + 1`` rows."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Conv", ["pixels", "kernel"], ["patches"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Shape", ["patches"], ["pshape"]),
        helper.make_node("Slice", ["pshape", "zero1", "two1"], ["bc"]),
        helper.make_node("Concat", ["bc", "minus1"], ["to3"], axis=0),
        helper.make_node("Reshape", ["patches", "to3"], ["flat"]),
        helper.make_node("Transpose", ["flat"], ["tokens"], perm=[0, 2, 1]),
        helper.make_node("Shape", ["pixels"], ["ishape"]),
        helper.make_node("Slice", ["ishape", "zero1", "one1"], ["batch"]),
        helper.make_node("Concat", ["batch", "one1", "one1"], ["cls_shape"], axis=0),
        helper.make_node("Expand", ["cls", "cls_shape"], ["cls_rows"]),
        helper.make_node("Concat", ["cls_rows", "tokens"], ["with_cls"], axis=1),
        helper.make_node("Add", ["with_cls", "table"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((6, 3, 2, 2)).astype(np.float32), "kernel"),
        numpy_helper.from_array(rng.standard_normal((1, 1, 6)).astype(np.float32), "cls"),
        numpy_helper.from_array(rng.standard_normal((1, 17, 6)).astype(np.float32), "table"),
        *(numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("zero1", 0), ("one1", 1), ("two1", 2), ("minus1", -1))),
    ]
    return _model(nodes, [_vi("pixels", F, ["batch", "channels", "height", "width"])], [_vi("y", F, None)], inits)


def test_a_conv_over_a_symbolic_image_size_asks_for_the_size():
    with pytest.raises(OnnxImportError, match=r"are dims of an op graphc carries opaquely.*\(batch, channels, height, width\).*dims=\{'height'"):
        from_onnx(_patch_embedding())
    with pytest.raises(OnnxImportError, match=r"dims names 'heigth', which no graph input declares \(their symbolic dims: batch, chann"):
        from_onnx(_patch_embedding(), dims={"heigth": 8})


def test_a_conv_over_an_image_size_given_at_import_meets_the_position_table():
    model = _patch_embedding()
    graph = from_onnx(model, dims={"height": 8, "width": 8})
    assert graph.types["pixels"].shape == ("batch", "channels", 8, 8)
    assert model.graph.input[0].type.tensor_type.shape.dim[2].dim_param == "height"  # the caller's model is untouched
    feeds = {"pixels": np.random.default_rng(5).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    _equal_everywhere(graph, feeds, _ort(model, feeds))


def test_log_of_zero_is_minus_infinity_quietly(recwarn):
    model = _model([helper.make_node("Log", ["x"], ["y"])], [_vi("x", F, ["n"])], [_vi("y", F, None)])
    feeds = {"x": np.array([0.0, 0.5, 1.0, 7.0], np.float32)}
    want = _ort(model, feeds)
    got = run(optimize(from_onnx(model)).graph, feeds, backend="numpy")["y"]
    np.testing.assert_allclose(got, want[0], rtol=1e-6)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_cli_imports_with_static_dims_and_fixed_inputs(tmp_path, capsys):
    vit, merged = tmp_path / "vit.onnx", tmp_path / "merged.onnx"
    onnx.save(_patch_embedding(), vit)
    onnx.save(_merged_decoder(), merged)
    assert main(["info", str(vit), "--static-dim", "height=8", "--static-dim", "width=8"]) == 0
    assert "pixels [batch, channels, 8, 8]" in capsys.readouterr().out
    assert main(["compare", str(merged), "--fix-input", "use_cache_branch=1", "--backends", "numpy", "--dim", "p=3", "--quiet"]) == 0
    assert "all backends agree" in capsys.readouterr().out
    assert main(["info", str(merged), "--fix-input", "use_cache_branch"]) == 2
    assert "--fix-input takes NAME=VALUE" in capsys.readouterr().err
