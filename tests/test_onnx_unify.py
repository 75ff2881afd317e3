"""Dims that a model's ops prove equal are unified at import (and checked at run time); ONNX Range over dims no tensor
has as an axis, and Expand to a symbolic shape used as it is, import as their own ops and run on every backend."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import INSTALLED
from onnx import TensorProto, helper, numpy_helper

from graphc import Graph, optimize
from graphc.cli import main
from graphc.errors import InputError
from graphc.onnx_import import from_onnx
from graphc.tensor_ops import Arange, BroadcastTo
from lowering import run

F, I64 = TensorProto.FLOAT, TensorProto.INT64
BACKENDS = INSTALLED


def _model(nodes, inputs, outputs, inits=()):
    m = helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _check(model, feeds, backends=BACKENDS):
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    g = from_onnx(model)
    for backend in backends:
        got = run(optimize(g).graph, feeds, backend=backend)
        for name, w in zip(g.outputs, want):
            assert got[name].shape == w.shape, backend
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=backend)
    return g


def test_two_names_for_one_length_are_unified_and_checked_at_run_time():
    """scores [b, s, s] + mask [b, 1, total]: the exporter named the mask's length apart; it must equal s."""
    nodes = [helper.make_node("MatMul", ["x", "xt"], ["scores"]), helper.make_node("Add", ["scores", "mask"], ["y"])]
    model = _model(nodes, [_vi("x", F, ["b", "s", 4]), _vi("xt", F, ["b", 4, "s"]), _vi("mask", F, ["b", 1, "total"])], [_vi("y", F, None)])
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((2, 3, 4), np.float32),
        "xt": rng.standard_normal((2, 4, 3), np.float32),
        "mask": rng.standard_normal((2, 1, 3), np.float32),
    }
    g = _check(model, feeds)
    assert g.types["mask"].shape == ("b", 1, "s")  # the later name gave way
    with pytest.raises(InputError, match="mask"):
        run(g, {**feeds, "mask": np.zeros((2, 1, 5), np.float32)})


def test_a_fresh_dim_unifies_with_a_constant():
    """onnxruntime-genai names a cache head axis kv_cache_dim; it meets a weight of 4 columns."""
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "c"], ["y"])]
    model = _model(nodes, [_vi("x", F, ["b", 3]), _vi("c", F, ["b", "kv_cache_dim"])], [_vi("y", F, None)], [w])
    feeds = {"x": np.ones((2, 3), np.float32), "c": np.arange(8, dtype=np.float32).reshape(2, 4)}
    g = _check(model, feeds)
    assert g.types["c"].shape == ("b", 4)


def test_range_over_a_sum_of_dims_no_tensor_has():
    """Range(0, past + seq) built from two shapes: the positions of a length no axis of the graph has (yet)."""
    nodes = [
        helper.make_node("Shape", ["past"], ["sp"], start=1, end=2),
        helper.make_node("Shape", ["x"], ["sx"], start=1, end=2),
        helper.make_node("Add", ["sp", "sx"], ["total"]),
        helper.make_node("Squeeze", ["total", "zero"], ["t"]),
        helper.make_node("Range", ["start", "t", "one"], ["pos"]),
        helper.make_node("Cast", ["pos"], ["posf"], to=F),
        helper.make_node("Unsqueeze", ["posf", "zero"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array(0, np.int64), "start"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    model = _model(nodes, [_vi("past", F, [1, "p"]), _vi("x", F, [1, "s"])], [_vi("y", F, None)], inits)
    feeds = {"past": np.zeros((1, 5), np.float32), "x": np.zeros((1, 2), np.float32)}
    g = _check(model, feeds)
    assert "Arange" in g.op_counts()


def test_expand_to_a_symbolic_shape_used_as_it_is():
    """An Expand whose result is an output (not broadcast into another op): materialised as BroadcastTo."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Unsqueeze", ["v", "zero"], ["v1"]),
        helper.make_node("Expand", ["v1", "s"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero")]
    model = _model(nodes, [_vi("x", F, ["b", 3]), _vi("v", F, [3])], [_vi("y", F, None)], inits)
    g = _check(model, {"x": np.zeros((4, 3), np.float32), "v": np.arange(3, dtype=np.float32)})
    assert "BroadcastTo" in g.op_counts()


@pytest.mark.parametrize("backend", BACKENDS)
def test_arange_and_broadcast_to_ops_on_every_backend(backend):
    g = Graph("ops")
    x = g.input("x", ["b", "n"])
    pos = g.add_node(Arange(2, "n+2"), [], "pos")
    g.output(g.add_node(BroadcastTo(("b", "n")), [g.add(g.cast(pos, "float32"), x)], "y"))
    x = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(run(g, {"x": x}, backend=backend)["y"], np.arange(2, 6, dtype=np.float32)[None, :] + x)


def test_expand_proves_a_free_dim_equal_to_a_named_one():
    """BERT's ``token_type_ids[:, :seq].expand(batch, seq)``: a dim onnx's shape inference left unnamed meets ``seq``."""
    nodes = [helper.make_node("Shape", ["ids"], ["s"]), helper.make_node("Expand", ["t", "s"], ["y"])]
    model = _model(nodes, [_vi("ids", I64, ["batch", "seq"]), _vi("t", I64, [1, "unk__0"])], [_vi("y", I64, None)])
    ids, t = np.zeros((3, 5), np.int64), np.arange(5, dtype=np.int64)[None]
    g = _check(model, {"ids": ids, "t": t})
    assert g.types[g.inputs[1]].shape == (1, "seq")  # unified, so every run checks it
    with pytest.raises(InputError):
        run(g, {"ids": ids, "t": np.arange(4, dtype=np.int64)[None]})


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_elements_beyond_64_entries_on_every_backend(axis):
    """GatherElements is an op of graphc's (onnx's reference evaluator gives wrong shapes past 64 entries on an axis)."""
    nodes = [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=axis)]
    model = _model(nodes, [_vi("x", F, [70, 80]), _vi("i", I64, [3, 5])], [_vi("y", F, None)])
    rng = np.random.default_rng(0)
    idx = rng.integers(-70 if axis == 0 else -80, 70 if axis == 0 else 80, (3, 5)).astype(np.int64)
    # onnx's reference evaluator cannot run GatherElements past 64 entries on the axis (np.choose), nor with indices
    # smaller than the data off the axis, so that backend is left out
    g = _check(model, {"x": rng.standard_normal((70, 80)).astype(np.float32), "i": idx}, [b for b in BACKENDS if b != "onnx-reference"])
    assert "GatherElements" in g.op_counts() and "Opaque" not in g.op_counts()


def test_isnan_guards_import_and_run_everywhere():
    """sdpa's Where(IsNaN(p), 0, p) guard on a softmax folds away (graphc's fully masked rows are zeros); IsNaN of
    another tensor is x != x and runs on every backend."""
    nodes = [
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["p_nan"]),
        helper.make_node("Where", ["p_nan", "zero", "p"], ["p_safe"]),
        helper.make_node("IsNaN", ["x"], ["x_nan"]),
        helper.make_node("Where", ["x_nan", "zero", "x"], ["x_safe"]),
        helper.make_node("Add", ["p_safe", "x_safe"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.zeros((), np.float32), "zero")]
    model = _model(nodes, [_vi("s", F, ["b", 4]), _vi("x", F, ["b", 4])], [_vi("y", F, None)], inits)
    x = np.array([[1.0, np.nan, 2.0, 3.0], [np.nan, 0.5, np.nan, -1.0]], np.float32)
    g = _check(model, {"s": np.arange(8, dtype=np.float32).reshape(2, 4), "x": x})
    assert "Opaque" not in g.op_counts()
    softmax_guard = [n for n in optimize(g).graph.nodes.values() if n.op.kind == "Where" and "p" in n.inputs]
    assert softmax_guard == []  # folded: nothing guards the softmax


def test_a_negative_start_slice_keeps_at_most_k_rows():
    """``x[-4:]`` of a symbolic axis keeps ``s - max(0, s - 4)`` rows: all of a shorter axis, 4 of a longer one."""
    starts, ends = (numpy_helper.from_array(np.array([v], np.int64), n) for v, n in ((-4, "starts"), (2**62, "ends")))
    nodes = [helper.make_node("Slice", ["x", "starts", "ends"], ["y"])]
    model = _model(nodes, [_vi("x", F, ["s", 3])], [_vi("y", F, None)], [starts, ends])
    g = from_onnx(model)
    assert g.types[g.outputs[0]].shape == ("-max(0,s-4)+s", 3)
    rng = np.random.default_rng(0)
    for rows in (2, 4, 9):
        _check(model, {"x": rng.standard_normal((rows, 3), np.float32)})


def test_a_model_defined_only_below_a_window_is_assumed_so_and_checked(tmp_path, capsys):
    """``x[-4:] + y`` with x and y of one length ``s`` broadcasts only while ``s <= 4`` (onnxruntime fails past it): the
    graph assumes ``max(0, s - 4) == 0`` and every run checks it."""
    starts, ends = (numpy_helper.from_array(np.array([v], np.int64), n) for v, n in ((-4, "starts"), (2**62, "ends")))
    nodes = [helper.make_node("Slice", ["x", "starts", "ends"], ["cut"]), helper.make_node("Add", ["cut", "y"], ["z"])]
    model = _model(nodes, [_vi("x", F, ["s", 3]), _vi("y", F, ["s", 3])], [_vi("z", F, None)], [starts, ends])
    rng = np.random.default_rng(0)
    g = _check(model, {"x": rng.standard_normal((3, 3), np.float32), "y": rng.standard_normal((3, 3), np.float32)})
    assert g.assumptions == [("max(0,s-4)", 0)]
    assert "  assume max(0,s-4) == 0" in str(g)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert main(["info", str(path)]) == 0
    assert "  defined where: max(0,s-4) == 0 (checked on every run)" in capsys.readouterr().out
    too_long = {"x": np.zeros((6, 3), np.float32), "y": np.zeros((6, 3), np.float32)}
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, too_long)
    for backend in BACKENDS:
        with pytest.raises(InputError, match=r"defined only where max\(0,s-4\) == 0.*s=6"):
            run(optimize(g).graph, too_long, backend=backend)


def test_assumptions_survive_copies_pickles_and_json():
    import pickle

    from graphc.serialize import graph_from_dict, graph_to_dict

    g = Graph("g")
    x = g.add_input("x", ["s", 3])
    g.output(g.relu(x))
    g.assume("max(0,s-4)", 0)
    for h in (g.copy(), pickle.loads(pickle.dumps(g)), graph_from_dict(graph_to_dict(g)), optimize(g).graph):
        assert h.assumptions == [("max(0,s-4)", 0)]
    g.assume("t", 2)
    with pytest.raises(Exception, match=r"assumes t == 2, but its inputs do not size \['t'\]"):
        g.verify()


def _count_passes(monkeypatch):
    from graphc.onnx_import import context

    passes = []
    real = context.ImportContext.__init__

    def counting(self, *args, **kwargs):
        passes.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(context.ImportContext, "__init__", counting)
    return passes


def test_many_unifications_take_one_import_pass(monkeypatch):
    """Eight masks each name the length apart: all unify with ``s`` as the nodes meet them, in one pass."""
    n = 8
    nodes = [helper.make_node("MatMul", ["x", "xt"], ["y0"])]
    nodes += [helper.make_node("Add", [f"y{i}", f"mask{i}"], [f"y{i + 1}"]) for i in range(n)]
    masks = [_vi(f"mask{i}", F, ["b", 1, f"total{i}"]) for i in range(n)]
    model = _model(nodes, [_vi("x", F, ["b", "s", 4]), _vi("xt", F, ["b", 4, "s"]), *masks], [_vi(f"y{n}", F, None)])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 4), np.float32), "xt": rng.standard_normal((2, 4, 3), np.float32)}
    feeds |= {f"mask{i}": rng.standard_normal((2, 1, 3), np.float32) for i in range(n)}
    passes = _count_passes(monkeypatch)
    g = _check(model, feeds)
    assert len(passes) == 1
    assert all(g.types[f"mask{i}"].shape == ("b", 1, "s") for i in range(n))
    assert str(g).count("total") == 0  # no value, op attribute or input keeps a replaced name


def test_an_undecided_shape_division_is_converted_again_after_the_unification(monkeypatch):
    """``(b2 * t) / b`` cannot be folded until ``b2`` is known to be ``b``, which a later node proves: the import goes
    back to the division (in the same pass), and the Range over the quotient imports as positions."""
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Shape", ["m"], ["ms"]),
        helper.make_node("Gather", ["xs", "zero"], ["b"]),
        helper.make_node("Gather", ["ms", "zero"], ["b2"]),
        helper.make_node("Gather", ["ms", "one"], ["t"]),
        helper.make_node("Mul", ["b2", "t"], ["bt"]),
        helper.make_node("Div", ["bt", "b"], ["t_again"]),
        helper.make_node("Add", ["x", "m"], ["xm"]),  # proves b2 == b (and the lengths equal)
        helper.make_node("Range", ["zero", "t_again", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=F),
        helper.make_node("Add", ["xm", "rf"], ["y"]),
    ]
    model = _model(nodes, [_vi("x", F, ["b", "s"]), _vi("m", F, ["b2", "t"])], [_vi("y", F, None)], [i64("zero", 0), i64("one", 1)])
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 5), np.float32), "m": rng.standard_normal((2, 5), np.float32)}
    passes = _count_passes(monkeypatch)
    g = _check(model, feeds)
    assert len(passes) == 1
    assert not any(isinstance(n.op, Arange) for n in g.nodes.values())  # the quotient folded: positions over x's length


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_tile_by_a_count_known_only_at_run_time_matches_onnxruntime(axis):
    """``Tile`` whose repeat count is a dim (here the batch size): a size-1 axis broadcasts, any other axis is copied
    whole that many times, as onnxruntime tiles it."""
    reps = [1, 1, 1]
    nodes = [
        helper.make_node("Shape", ["n"], ["n_shape"]),
        helper.make_node("Gather", ["n_shape", "zero"], ["count"]),
        helper.make_node("Concat", [("count" if a == axis else f"one{a}") for a in range(3)], ["reps"], axis=0),
        helper.make_node("Tile", ["x", "reps"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero")]
    inits += [numpy_helper.from_array(np.array([r], np.int64), f"one{a}") for a, r in enumerate(reps)]
    model = _model(nodes, [_vi("x", F, [1, "s", 3]), _vi("n", F, ["k"])], [_vi("y", F, None)], inits)
    rng = np.random.default_rng(2)
    _check(model, {"x": rng.standard_normal((1, 4, 3), np.float32), "n": np.zeros(5, np.float32)})


def test_two_expressions_with_a_common_factor_unify():
    """A mixture-of-experts export's top-2 rows: ``2*unk`` (an opaque dim) meets ``2*batch*seq``; dividing out the 2
    unifies ``unk`` with ``batch*seq``."""
    from graphc.onnx_import.unify import choose

    assert choose("2*unk", "2*batch*seq", {"batch": 0, "seq": 1, "unk": 2}) == ("unk", "batch*seq")
