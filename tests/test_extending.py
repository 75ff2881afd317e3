"""Extending graphc in one place: a new unary function and a new rewrite rule, each registered once, reach every backend.

``register_unary`` gives the ``Unary`` op, its NumPy semantics, the ONNX emitter and importer and the torch kernel the
new function; ``register_rule`` adds a rule to a rewrite stage, traced like the built-in ones.  The numbers are checked
against NumPy written here, on every installed backend.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import INSTALLED
from onnx import TensorProto, helper

from graphc import Graph, optimize
from graphc.errors import OptimizerError, UnknownNameError
from graphc.onnx_import import from_onnx
from graphc.ops import UNARY_FUNCTIONS, Binary, Unary, register_unary
from graphc.optimizer import Rule, register_rule, unregister_rule
from graphc.optimizer.cleanup import remove_if_dead
from graphc.optimizer.patterns import Pat, pattern_rule
from lowering import run

BACKENDS = INSTALLED


@pytest.fixture
def softplus():
    """``log(1 + e^x)``: NumPy, ONNX's ``Softplus`` and torch's ``nn.functional.softplus``, registered once."""
    register_unary("softplus", lambda x: np.logaddexp(np.zeros((), x.dtype), x), onnx="Softplus", torch="nn.functional.softplus")
    yield
    del UNARY_FUNCTIONS["softplus"]


def _is_neg(op) -> bool:  # noqa: ANN001
    return op.fn == "neg"


DOUBLE_NEGATION = Pat.op(
    Unary, where=_is_neg, name="outer", inputs=(Pat.op(Unary, where=_is_neg, name="inner", single_use=True, inputs=(Pat.var("x"),)),)
)
"""``-(-x)``, the inner negation read only by the outer one."""


def _drop_double_negation(graph, b, ctx) -> str:  # noqa: ANN001
    graph.replace_uses(b["outer"].name, b["x"])
    remove_if_dead(graph, b["outer"].name)
    return f"-(-x) is {b['x']!r}"


@pytest.fixture
def double_negation():
    register_rule("simplify", pattern_rule("double_negation", DOUBLE_NEGATION, _drop_double_negation))
    yield
    unregister_rule("simplify", "double_negation")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_unary_function_registered_once_runs_on_every_backend(softplus, backend):
    g = Graph("softplus")
    x = g.input("x", ["b", 8])
    g.output(g.add(g.unary("softplus", x, name="sp"), x, name="y"))
    xs = np.linspace(-30, 30, 24, dtype=np.float32).reshape(3, 8)
    want = np.log1p(np.exp(xs.astype(np.float64))) + xs
    np.testing.assert_allclose(run(optimize(g).graph, {"x": xs}, backend=backend)["y"], want, rtol=1e-5, atol=1e-5)


def test_a_registered_unary_function_imports_from_onnx(softplus):
    node = helper.make_node("Softplus", ["x"], ["y"])
    model = helper.make_model(
        helper.make_graph(
            [node],
            "m",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    g = from_onnx(model)
    assert g.op_counts() == {"Unary": 1}  # not carried as an opaque node
    xs = np.array([[-2.0, 0.0, 2.0], [5.0, -5.0, 0.5]], np.float32)
    for backend in BACKENDS:
        np.testing.assert_allclose(run(g, {"x": xs}, backend=backend)["y"], np.log1p(np.exp(xs)), rtol=1e-5, err_msg=backend)


def test_an_unregistered_unary_function_is_named():
    with pytest.raises(UnknownNameError, match="softplus"):
        Unary("softplus")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rule_registered_once_rewrites_and_every_backend_agrees(double_negation, backend):
    g = Graph("negations")
    x = g.input("x", ["b", 4])
    g.output(g.add(g.unary("neg", g.unary("neg", x)), x, name="y"))
    out, report = optimize(g)
    assert "Unary" not in out.op_counts()
    assert [f.rule for f in report.trace.fired if f.rule == "double_negation"] == ["double_negation"]
    xs = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(run(out, {"x": xs}, backend=backend)["y"], 2 * xs)


def test_a_rule_that_raises_is_reported_with_the_rule_and_the_node():
    def broken(graph, node, ctx):  # noqa: ANN001, ANN202
        raise KeyError("a bug")

    register_rule("simplify", Rule("broken_rule", (Unary,), broken, _drop_double_negation))
    try:
        g = Graph("g")
        g.output(g.unary("exp", g.input("x", [2]), name="e"))
        with pytest.raises(OptimizerError, match=r"rule 'broken_rule' failed in match on node 'e' \(Unary\[fn=\"exp\"\]\): KeyError"):
            optimize(g)
    finally:
        unregister_rule("simplify", "broken_rule")


def test_register_rule_names_the_stages():
    with pytest.raises(UnknownNameError, match="simplify"):
        register_rule("no_such_stage", pattern_rule("r", DOUBLE_NEGATION, _drop_double_negation))


def test_a_pattern_binds_names_and_reports_a_near_miss():
    g = Graph("p")
    x = g.input("x", [3])
    inner = g.unary("neg", x, name="inner")
    g.output(g.unary("neg", inner, name="outer"), g.add(inner, x, name="other"))  # inner has a second reader
    assert DOUBLE_NEGATION.match(g, "outer").reason == "'inner' is read outside the pattern"
    h = Graph("q")
    y = h.input("y", [3])
    h.output(h.unary("neg", h.unary("neg", y, name="a"), name="b"))
    b = DOUBLE_NEGATION.match(h, "b")
    assert (b["outer"].name, b["inner"].name, b["x"]) == ("b", "a", "y")
    assert DOUBLE_NEGATION.match(h, "a") is None  # -y alone is not -(-x)
    same = Pat.op(Binary, inputs=(Pat.var("v"), Pat.var("v")))  # one name twice: one value
    k = Graph("k")
    z, w = k.input("z", [2]), k.input("w", [2])
    k.output(k.add(z, z, name="zz"), k.add(z, w, name="zw"))
    assert same.match(k, "zz") == {"v": "z"} and same.match(k, "zw") is None
