"""Inputs onnxruntime refuses are refused by graphc too, by name: the scatter ops' shape rules (ONNX's reference
evaluator is lenient), opaque nodes' input slots, and the refusals that named the wrong thing."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from graphc.errors import GraphcError, OnnxImportError, OpError
from graphc.onnx_import import from_onnx
from graphc.opaque import Opaque
from lowering import run


def _scatter(indices: list, updates: list, axis: int = 0, data: list | None = None, op: str = "ScatterElements") -> onnx.ModelProto:
    node = helper.make_node(op, ["d", "i", "u"], ["y"], **({"axis": axis} if op != "ScatterND" else {}))
    g = helper.make_graph(
        [node],
        "scatter",
        [
            helper.make_tensor_value_info("d", TensorProto.FLOAT, data or ["n", 3]),
            helper.make_tensor_value_info("i", TensorProto.INT64, indices),
            helper.make_tensor_value_info("u", TensorProto.FLOAT, updates),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    "indices, updates, axis, words",
    [
        ([2, 1], [2, 2], 0, r"indices \[2, 1\] and updates \[2, 2\] must have one shape"),
        ([2], [2], 0, "of the data's rank 2"),
        ([2, 1], [2, 1], 5, "axis 5 is out of range for data of rank 2"),
    ],
)
def test_scatter_elements_that_onnxruntime_refuses_is_refused_at_import(indices, updates, axis, words):
    with pytest.raises(OnnxImportError, match=words):
        from_onnx(_scatter(indices, updates, axis))


def test_scatter_shapes_known_only_at_run_time_are_checked_before_the_reference_evaluator_runs():
    g = from_onnx(_scatter(["a", 1], ["b", 1]))
    feeds = {"d": np.zeros((3, 3), np.float32), "i": np.zeros((2, 1), np.int64), "u": np.ones((3, 1), np.float32)}
    with pytest.raises(Exception):  # what onnxruntime does with the same file
        ort.InferenceSession(_scatter(["a", 1], ["b", 1]).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.raises(GraphcError, match=r"indices \[2, 1\] and updates \[3, 1\] must have one shape"):
        run(g, feeds, "numpy")
    feeds["u"] = np.ones((2, 1), np.float32)
    feeds["i"] = np.array([[0], [7]], np.int64)
    with pytest.raises(GraphcError, match=r"indices span 0..7, outside \[-3, 3\)"):
        run(g, feeds, "numpy")
    feeds["i"] = np.array([[0], [-1]], np.int64)
    want = ort.InferenceSession(_scatter(["a", 1], ["b", 1]).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(run(g, feeds, "numpy")["y"], want)


def test_scatter_nd_updates_must_fit_the_indices():
    with pytest.raises(OnnxImportError, match=r"updates \[2, 5\] must be indices\[:-1\] \+ data\[1:\]"):
        from_onnx(_scatter([2, 1], [2, 5], data=[4, 3], op="ScatterND"))


@pytest.mark.parametrize("slots, words", [((0, 3 * 10**8), "input slot 300000000"), ((-1,), "input slot -1"), ((1, 1), "input slot 1")])
def test_opaque_input_slots_are_bounded_and_named(slots, words):
    proto = helper.make_node("TopK", ["x", "k"], ["v", "i"]).SerializeToString()
    import base64

    with pytest.raises(OpError, match=words):
        Opaque("TopK", "", 18, base64.b64encode(proto).decode(), (("n",), ("n",)), ("float32", "int64"), slots)


def test_a_backend_that_cannot_run_a_contrib_op_is_skipped_not_a_disagreement(tmp_path):
    """An imported file with an onnxruntime contrib op: ONNX's reference evaluator has no kernel for it, which is no
    disagreement (the row is skipped with the reason); onnxruntime runs it and agrees with the original file."""
    from lowering import compare

    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Gelu", ["h"], ["y"], domain="com.microsoft")]
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.linspace(-1, 1, 16, dtype=np.float32))
    g = helper.make_graph(nodes, "bert_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])], [w])  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    report = compare(from_onnx(tmp_path / "m.onnx"), backends=["ort-cpu", "onnx-reference"], repeats=1, sizes={"b": 3},
                     reference_model=tmp_path / "m.onnx")  # fmt: skip
    rows = {r.backend: r for r in report.results}
    assert rows["ort-cpu"].status == "ok" and rows["onnx-reference"].status == "skipped", report
    assert "Gelu" in rows["onnx-reference"].reason and report.ok


def test_a_reference_that_fails_on_defaulted_sizes_says_how_the_inputs_were_sized(tmp_path):
    """Random inputs sized by defaults the original file does not take: the error says which sizes were used and how to
    give others, instead of only what failed inside the reference."""
    from graphc.errors import BackendError
    from lowering import compare

    def model(width):
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", width])])  # fmt: skip
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])

    onnx.save(model(8), str(tmp_path / "fixed.onnx"))  # the file the reference runs takes 8 columns only
    graph = from_onnx(model("total_seq"))
    with pytest.raises(BackendError, match=r"sized b=1, total_seq=512: give each dim its size.*--dim NAME=INT"):
        compare(graph, backends=["numpy"], repeats=1, sizes={"b": 1, "total_seq": 512}, reference_model=tmp_path / "fixed.onnx")
    report = compare(graph, backends=["numpy"], repeats=1, sizes={"b": 1, "total_seq": 8}, reference_model=tmp_path / "fixed.onnx")
    assert report.ok


def test_an_operating_system_error_reaches_the_user_as_path_and_reason(tmp_path, capsys):
    from graphc.cli import main

    (tmp_path / "file").write_text("x")
    assert main(["show", "--preset", "mistral-7b", "-o", str(tmp_path / "file" / "g.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("graphc: error: ") and "Errno" not in err and "PosixPath" not in err and "Not a directory" in err


def _one_node(node, inputs, outputs, initializers=()):
    g = helper.make_graph([node], "g", inputs, outputs, list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    "model, words",
    [
        (
            _one_node(
                helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1),
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                [helper.make_tensor_value_info("v", TensorProto.FLOAT, None), helper.make_tensor_value_info("i", TensorProto.INT64, None)],
                [onnx.numpy_helper.from_array(np.array([5], np.int64), "k")],
            ),
            "TopK does not fit its inputs, as ONNX's schema says: Axis has less than the requested k elements",
        ),
        (
            _one_node(
                helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=3),
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]), helper.make_tensor_value_info("i", TensorProto.INT64, [2, 1])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            ),
            "GatherND does not fit its inputs, as ONNX's schema says",
        ),
    ],
    ids=["topk-k-past-axis", "gathernd-batch-dims"],
)
def test_an_opaque_node_its_schema_refuses_is_named_with_the_schemas_reason(model, words):
    with pytest.raises(OnnxImportError, match=words):
        from_onnx(model)
    with pytest.raises(Exception):  # onnxruntime refuses the same file
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_scale_past_the_float_range_is_inf_without_a_warning():
    import warnings

    from graphc import Graph
    from graphc.ops import Scale

    g = Graph("scale")
    g.output(g.add_node(Scale(4.0), [g.input("x", [2])], "y"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(g, {"x": np.array([-3e38, 1.0], np.float32)}, "numpy")["y"]
    assert got.tolist() == [-np.inf, 4.0]


def test_an_ortvalue_of_another_dtype_fed_to_a_cache_names_the_input():
    import graphc
    from graphc.attention.hf_lm import causal_lm_config_from_hf
    from graphc.errors import InputError
    from lowering import prepare

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 97}  # fmt: skip
    lm = graphc.causal_lm_graph(causal_lm_config_from_hf(config), seed=0, dtype="bfloat16")
    runner = prepare(lm, "ort-cpu")
    feeds = {"input_ids": np.array([[1, 2]]), "attention_mask": np.ones((1, 2), np.int64), "position_ids": np.array([[0, 1]])}
    feeds |= {n: ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 2, 0, 16), np.float32)) for n in lm.inputs if n.startswith("past")}
    with pytest.raises(InputError, match=r"input 'past_key_values.0.key': an OrtValue of tensor\(float\) where the model takes tensor\(bfloat16\)"):
        runner.step(feeds)


def test_a_float16_constant_is_read_without_an_overflow_warning():
    import warnings

    from graphc.onnx_import.shapes import as_dims

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_dims(np.array([-np.inf], np.float16)) is None
        assert as_dims(np.array([3.0, 4.0], np.float16)).values == (3, 4)
