"""Hostile and tricky ONNX files: every one is imported with outputs equal to onnxruntime's, or refused with an
:class:`OnnxImportError` naming the node; never a raw traceback, a wrong number or a large allocation first."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphc import optimize
from graphc.onnx_import import from_onnx
from graphc.cli import main
from graphc.errors import GraphcError, OnnxImportError, ResourceLimitError
from graphc.memory import set_memory_cap
from graphc.onnx_import import load_model
from lowering import run

F, D, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64
RNG = np.random.default_rng(7)


def _model(nodes, inputs, outputs, initializers=(), opset=18, ms=False):
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    model = helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, list(initializers)), opset_imports=imports)
    model.ir_version = 10
    return model


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _same_as_onnxruntime(model, feeds, backends=("numpy", "ort-cpu")):
    want = _ort(model, feeds)
    g = from_onnx(model)
    names = [o.name for o in model.graph.output]
    for backend in backends:
        got = run(optimize(g).graph, feeds, backend=backend)
        for name, w in zip(names, want):
            assert got[name].shape == w.shape, (backend, name, got[name].shape, w.shape)
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=f"{backend} {name}")


# ---------------------------------------------------------------- valid models that imported wrongly
def test_flatten_with_a_negative_axis_counts_from_the_rank():
    model = _model([helper.make_node("Flatten", ["x"], ["y"], axis=-1)], [_vi("x", F, [2, 3, 4])], [_vi("y", F, None)])
    _same_as_onnxruntime(model, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)})  # [6, 4], was [24, 1]


def test_where_with_a_constant_condition_still_broadcasts():
    nodes = [helper.make_node("Where", ["c", "x", "y"], ["z"])]
    model = _model(nodes, [_vi("x", F, [3]), _vi("y", F, [2, 3])], [_vi("z", F, None)], [numpy_helper.from_array(np.array(True), "c")])
    _same_as_onnxruntime(model, {"x": np.arange(3, dtype=np.float32), "y": np.ones((2, 3), np.float32)})  # [2, 3], was [3]


def test_max_of_a_size_and_one_is_not_assumed_to_be_the_size():
    """Reshape(x, [Max(n, 1), -1]) at n = 0 is [1, 0]; graphc folded Max(n, 1) to n."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Max", ["n", "one"], ["m"]),
        helper.make_node("Unsqueeze", ["m", "zero1"], ["m1"]),
        helper.make_node("Concat", ["m1", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [_i64("zero", 0), _i64("one", 1), _i64("zero1", [0]), _i64("minus1", [-1])]
    model = _model(nodes, [_vi("x", F, ["n", 4])], [_vi("y", F, None)], inits)
    try:
        g = from_onnx(model)
    except OnnxImportError as e:
        assert "Reshape" in str(e)
        return
    for n in (0, 3):
        x = np.ones((n, 4), np.float32)
        got = run(g, {"x": x})["y"]
        assert got.shape == _ort(model, {"x": x})[0].shape


def test_a_numeric_dim_param_is_a_symbol_not_a_size():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", F, ["2", 3])], [_vi("y", F, ["2", 3])])
    _same_as_onnxruntime(model, {"x": RNG.standard_normal((5, 3)).astype(np.float32)})


def test_dropout_in_training_mode_is_refused():
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "r"), numpy_helper.from_array(np.array(True), "t")]
    model = _model([helper.make_node("Dropout", ["x", "r", "t"], ["y"])], [_vi("x", F, [4])], [_vi("y", F, [4])], inits)
    with pytest.raises(OnnxImportError, match=r"Dropout.*training mode"):
        from_onnx(model)
    inits[1] = numpy_helper.from_array(np.array(False), "t")  # inference mode is the identity
    model = _model([helper.make_node("Dropout", ["x", "r", "t"], ["y"])], [_vi("x", F, [4])], [_vi("y", F, [4])], inits)
    _same_as_onnxruntime(model, {"x": np.arange(4, dtype=np.float32)})


@pytest.mark.parametrize("n", [1, 3])
def test_variadic_max_and_min(n):
    names = [f"x{k}" for k in range(n)]
    nodes = [helper.make_node("Max", names, ["hi"]), helper.make_node("Min", names, ["lo"])]
    model = _model(nodes, [_vi(x, F, [2, 3]) for x in names], [_vi("hi", F, None), _vi("lo", F, None)])
    _same_as_onnxruntime(model, {x: RNG.standard_normal((2, 3)).astype(np.float32) for x in names})


# ---------------------------------------------------------------- invalid models that were accepted
def _shape_gather(index):
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["df"], to=F),
        helper.make_node("Mul", ["x", "df"], ["y"]),
    ]
    return _model(nodes, [_vi("x", F, ["b", 3])], [_vi("y", F, None)], [_i64("i", index)])


def _node_model(node, inputs, inits=(), opset=18, ms=False):
    return _model([node], inputs, [_vi(node.output[0], F, None)], inits, opset, ms)


X23 = [_vi("x", F, [2, 3])]
BAD = {
    "gather index past a shape": (_shape_gather(5), r"Gather indices \[5\] are out of range"),
    "gather negative index past a shape": (_shape_gather(-3), "out of range"),
    "squeeze axis past the rank": (
        _node_model(helper.make_node("Squeeze", ["x", "a"], ["y"]), X23, [_i64("a", [3])]),
        "Squeeze axis 3 is out of range for rank 2",
    ),
    "unsqueeze axis past the rank": (
        _node_model(helper.make_node("Unsqueeze", ["x", "a"], ["y"]), X23, [_i64("a", [5])]),
        "Unsqueeze axis 5 is out of range",
    ),
    "slice axis past the rank": (
        _node_model(helper.make_node("Slice", ["x", "s", "e", "a"], ["y"]), X23, [_i64("s", [0]), _i64("e", [1]), _i64("a", [4])]),
        "Slice axis 4 is out of range",
    ),
    "split axis past the rank": (
        _model([helper.make_node("Split", ["x", "sp"], ["y", "z"], axis=3)], X23, [_vi("y", F, None), _vi("z", F, None)], [_i64("sp", [1, 1])]),
        "Split axis 3 is out of range",
    ),
    "flatten axis past the rank": (_node_model(helper.make_node("Flatten", ["x"], ["y"], axis=5), X23), "Flatten axis 5 is out of range"),
    "concat of shape values on axis 1": (
        _model(
            [
                helper.make_node("Shape", ["x"], ["s"]),
                helper.make_node("Concat", ["s", "s"], ["c"], axis=1),
                helper.make_node("Reshape", ["x", "c"], ["y"]),
            ],
            X23,
            [_vi("y", F, None)],
        ),
        "Concat axis 1 is out of range for rank 1",
    ),
    "relu with two inputs": (_node_model(helper.make_node("Relu", ["x", "x"], ["y"]), X23), "input size 2 not in range"),
    "float32 plus float64": (
        _model([helper.make_node("Add", ["x", "d"], ["y"])], [_vi("x", F, [2]), _vi("d", D, [2])], [_vi("y", F, None)]),
        "input 1 .* is tensor\\(double\\) but input 0 is tensor\\(float\\)",
    ),
    "float32 times a float64 scalar": (
        _model([helper.make_node("Mul", ["x", "d"], ["y"])], [_vi("x", F, [2])], [_vi("y", F, None)], [numpy_helper.from_array(np.array(2.0), "d")]),
        "needs one type",
    ),
    "domain not imported": (
        _node_model(helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft"), X23),
        "domain 'com.microsoft' is not in the model's opset_import",
    ),
    "cast without to": (_node_model(helper.make_node("Cast", ["x"], ["y"]), X23), "Required attribute 'to' is missing"),
    "concat without axis": (_node_model(helper.make_node("Concat", ["x", "x"], ["y"]), X23), "Required attribute 'axis' is missing"),
    "einsum without equation": (_node_model(helper.make_node("Einsum", ["x"], ["y"]), X23), "Required attribute 'equation' is missing"),
    "matmul with one input": (_node_model(helper.make_node("MatMul", ["x"], ["y"]), X23), "input size 1 not in range"),
    "attribute of the wrong type": (_node_model(helper.make_node("Softmax", ["x"], ["y"], axis="last"), X23), "Mismatched attribute type"),
    "unknown attribute": (_node_model(helper.make_node("Relu", ["x"], ["y"], alpha=1.0), X23), "Unrecognized attribute: alpha"),
    "transpose perm not a permutation": (_node_model(helper.make_node("Transpose", ["x"], ["y"], perm=[0, 0]), X23), "not a permutation"),
    "gather index past a static axis": (
        _node_model(helper.make_node("Gather", ["x", "i"], ["y"], axis=1), X23, [_i64("i", [0, 3])]),
        "out of range for axis 1 of size 3",
    ),
    "attention with zero heads": (
        _model(
            [helper.make_node("Attention", ["q", "k", "v"], ["y"], q_num_heads=0, kv_num_heads=0)],
            [_vi(n, F, [1, 4, 8]) for n in "qkv"],
            [_vi("y", F, None)],
            opset=23,
        ),
        "q_num_heads=0; head counts must be >= 1",
    ),
    "unknown standard op": (_node_model(helper.make_node("NoSuchOp", ["x"], ["y"]), X23), "No Op registered for NoSuchOp"),
    "keepdims that is not a flag": (
        _node_model(helper.make_node("ReduceSum", ["x", "a"], ["y"], keepdims=-1), X23, [_i64("a", [1])]),
        "keepdims=-1; it is a flag",
    ),
    "transpose of Gemm not a flag": (_node_model(helper.make_node("Gemm", ["x", "x"], ["y"], transB=2), X23), "transB=2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_onnx_is_refused_naming_the_node(case):
    model, words = BAD[case]
    with pytest.raises(OnnxImportError, match=words) as info:
        from_onnx(model)
    assert "node " in str(info.value) or "domain" in str(info.value)


@pytest.mark.parametrize("case", ["float32 plus float64", "cast without to", "relu with two inputs"])
def test_cli_prints_one_line_and_exits_2_on_invalid_onnx(tmp_path, capsys, case):
    path = tmp_path / "bad.onnx"
    path.write_bytes(BAD[case][0].SerializeToString())
    assert main(["optimize", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graphc: error:"), err


# ---------------------------------------------------------------- memory before refusal
@pytest.mark.parametrize(
    "nodes, inits",
    [
        (
            [helper.make_node("ConstantOfShape", ["s"], ["c"], value=numpy_helper.from_array(np.array([1.0], np.float32)))],
            [_i64("s", [1 << 15, 1 << 15])],
        ),
        (
            [helper.make_node("Expand", ["one", "s"], ["c"])],
            [numpy_helper.from_array(np.array(1.0, np.float32), "one"), _i64("s", [1 << 15, 1 << 15])],
        ),
        (
            [helper.make_node("Range", ["a", "b", "d"], ["c"])],
            [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("a", 0), ("b", 3e9), ("d", 1))],
        ),
    ],
    ids=["ConstantOfShape", "Expand", "Range"],
)
def test_constant_folding_checks_the_size_before_allocating(nodes, inits):
    nodes = nodes + [helper.make_node("Add", ["x", "c"], ["y"])]
    model = _model(nodes, [_vi("x", F, [1])], [_vi("y", F, None)], inits)
    tracemalloc.start()
    try:
        from_onnx(model)
    except GraphcError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB"


def _external_model(tmp_path: Path, nbytes: int) -> Path:
    """A MatMul whose weight lives in a sparse external file of ``nbytes`` bytes."""
    cols = 1024
    rows = nbytes // 4 // cols
    (tmp_path / "w.bin").touch()
    with open(tmp_path / "w.bin", "r+b") as f:
        f.truncate(rows * cols * 4)
    w = TensorProto(name="w", data_type=F, dims=[rows, cols])
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(rows * cols * 4))):
        w.external_data.add(key=k, value=v)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", F, ["b", rows])], [_vi("y", F, ["b", cols])], [w])
    path = tmp_path / "big.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_external_data_is_memory_mapped_not_read(tmp_path):
    """An 8 GiB external weight imports with no allocation of its size (onnx's loader raised MemoryError)."""
    path = _external_model(tmp_path, 8 * 2**30)
    tracemalloc.start()
    g = from_onnx(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20
    (w,) = g.initializers.values()
    assert isinstance(w, np.memmap) or isinstance(w.base, np.memmap) and w.nbytes == 8 * 2**30


def test_loading_external_data_checks_the_memory_cap_first(tmp_path):
    path = _external_model(tmp_path, 64 * 2**20)
    set_memory_cap("16MiB")
    try:
        with pytest.raises(ResourceLimitError, match="external data"):
            load_model(path)
    finally:
        set_memory_cap(None)


@pytest.mark.parametrize(
    "field, value, words", [("offset", "-5", "non-negative|must be >= 0"), ("length", "12", "needs"), ("offset", "abc", "malformed")]
)
def test_bad_external_data_entries_are_named(tmp_path, field, value, words):
    path = _external_model(tmp_path, 4096 * 4)
    model = onnx.load_model(str(path), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == field:
            e.value = value
    path.write_bytes(model.SerializeToString())
    with pytest.raises(OnnxImportError, match=words):
        from_onnx(path)


# ---------------------------------------------------------------- mutants of valid models
def _seed_models():
    w = numpy_helper.from_array(RNG.standard_normal((6, 4)).astype(np.float32), "w")
    yield _model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Softmax", ["h"], ["y"], axis=-1)],
        [_vi("x", F, ["b", 6])],
        [_vi("y", F, None)],
        [w],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "a0"], ["b1"]),
        helper.make_node("Concat", ["b1", "tail"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
        helper.make_node("ReduceSum", ["t", "ax"], ["y"], keepdims=1),
    ]
    inits = [_i64("i0", 0), _i64("a0", [0]), _i64("tail", [2, 3]), _i64("ax", [1])]
    yield _model(nodes, [_vi("x", F, ["b", 6])], [_vi("y", F, None)], inits)
    nodes = [
        helper.make_node("Split", ["x", "sp"], ["p", "q"], axis=1),
        helper.make_node("Mul", ["p", "q"], ["m"]),
        helper.make_node("Squeeze", ["m", "ax"], ["y"]),
    ]
    yield _model(nodes, [_vi("x", F, [1, 6])], [_vi("y", F, None)], [_i64("sp", [3, 3]), _i64("ax", [0])])


SEEDS = [m.SerializeToString() for m in _seed_models()]


@st.composite
def _mutants(draw):
    model = onnx.ModelProto()
    model.ParseFromString(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["attr", "init", "input", "drop_attr", "dim"]))
        g = model.graph
        if kind == "attr" and any(n.attribute for n in g.node):
            node = draw(st.sampled_from([n for n in g.node if n.attribute]))
            a = draw(st.sampled_from(list(node.attribute)))
            if a.type == onnx.AttributeProto.INT:
                a.i = draw(st.integers(-5, 5))
            elif a.type == onnx.AttributeProto.INTS and a.ints:
                a.ints[draw(st.integers(0, len(a.ints) - 1))] = draw(st.integers(-4, 4))
        elif kind == "drop_attr" and any(n.attribute for n in g.node):
            node = draw(st.sampled_from([n for n in g.node if n.attribute]))
            del node.attribute[0]
        elif kind == "init":
            t = draw(st.sampled_from([t for t in g.initializer if t.data_type == I64] or list(g.initializer)))
            arr = numpy_helper.to_array(t).copy()
            if arr.size and arr.dtype == np.int64:
                arr.reshape(-1)[draw(st.integers(0, arr.size - 1))] = draw(st.integers(-8, 8))
                t.CopyFrom(numpy_helper.from_array(arr, t.name))
        elif kind == "input":
            node = draw(st.sampled_from(list(g.node)))
            if node.input and draw(st.booleans()):
                del node.input[-1]
            else:
                node.input.append(draw(st.sampled_from(["x", node.input[0] if node.input else "x"])))
        elif kind == "dim":
            d = g.input[0].type.tensor_type.shape.dim[draw(st.integers(0, len(g.input[0].type.tensor_type.shape.dim) - 1))]
            if d.HasField("dim_value"):
                d.dim_value = draw(st.integers(1, 7))
    return model


MUTANTS = 3000 if os.environ.get("GRAPHC_FUZZ") == "nightly" else 300


@settings(max_examples=MUTANTS, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutants())
def test_mutants_import_equal_to_onnxruntime_or_are_refused(model):
    try:
        g = from_onnx(model)
    except GraphcError:
        return
    dims = {"b": 2}
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else dims[d.dim_param] for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = RNG.standard_normal(shape).astype(np.float32)
    try:
        want = _ort(model, feeds)
    except Exception:  # noqa: BLE001 - onnxruntime refuses the model too; graphc accepted what it could read
        return
    got = run(g, feeds)
    for vi, w in zip(model.graph.output, want):
        assert got[vi.name].shape == w.shape
        np.testing.assert_allclose(got[vi.name], w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- compare's reference is the original model
def _relu_model():
    w = numpy_helper.from_array(RNG.standard_normal((6, 4)).astype(np.float32), "w")
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [_vi("x", F, ["batch", 6])],
        [_vi("y", F, ["batch", 4])],
        [w],
    )


def test_compare_of_an_imported_graph_checks_against_the_original_model(tmp_path, monkeypatch):
    """A wrong conversion must show as FAIL: the reference is onnxruntime on the file, not graphc's own import."""
    from graphc.onnx_import import convert_core
    from lowering import compare
    from graphc.ops import Unary

    model = _relu_model()
    good = compare(from_onnx(model), sizes={"batch": 3}, backends=["numpy", "ort-cpu"], repeats=1, reference_model=model)
    assert good.ok and "onnxruntime" in good.reference and "original ONNX model" in good.reference
    wrong = lambda ctx, ins, attrs: [ctx.add(Unary("neg"), [ctx.tensor(ins[0])], "relu")]  # noqa: E731 - a broken converter
    monkeypatch.setitem(convert_core.CORE_CONVERTERS, "Relu", wrong)
    bad = compare(from_onnx(model), sizes={"batch": 3}, backends=["numpy", "ort-cpu"], repeats=1, reference_model=model)
    assert not bad.ok and bad.failed == ["numpy", "ort-cpu"]
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["compare", str(path), "--backends", "numpy", "--repeats", "1", "--quiet"]) == 1  # the CLI uses the file too


def test_compare_cli_names_the_onnx_reference(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    path.write_bytes(_relu_model().SerializeToString())
    assert main(["compare", str(path), "--backends", "numpy,ort-cpu", "--repeats", "1", "--quiet"]) == 0
    assert "reference: onnxruntime" in capsys.readouterr().out


def test_a_hostile_min_max_dim_param_is_a_plain_symbol():
    """A dim_param of 300 min arguments or nested 40 deep (graphc's dims read min/max) is bounded: it becomes a symbol of
    its own, and the import does not spend quadratic time ordering the arguments."""
    deep = "a"
    for i in range(40):
        deep = f"min({deep},s{i})"
    for dim_param in ("min(" + ",".join(f"s{i}" for i in range(300)) + ")", deep):
        model = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", F, [dim_param, 3])], [_vi("y", F, None)])
        g = from_onnx(model)
        (d, _) = g.types[g.inputs[0]].shape
        assert isinstance(d, str) and "(" not in d
        _same_as_onnxruntime(model, {"x": RNG.standard_normal((4, 3)).astype(np.float32)})
