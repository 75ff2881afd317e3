"""Gathered expert weights contracted densely (``dense_experts``): equal to the gathered form on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc import Graph, optimize
from graphc.optimizer.experts import DENSE_EXPERTS_MAX
from graphc.tensor_ops import Gather
from lowering import run


def _experts(n_experts: int, out: int, inner: int, seed: int, spec: str = "soi,si->so") -> Graph:
    """``einsum(W[ids], x)``: transformers' batched_mm experts, one product per (token, expert) pair."""
    rng = np.random.default_rng(seed)
    g = Graph("experts")
    ids = g.input("ids", ["s"], "int64")
    x = g.input("x", ["s", inner], "float64")
    w = g.constant("experts.weight", rng.standard_normal((n_experts, out, inner)))
    g.output(g.einsum(spec, g.add_node(Gather(0), [w, ids]), x, name="y"))
    g.verify()
    return g


@settings(max_examples=25, deadline=None)
@given(
    n_experts=st.integers(1, DENSE_EXPERTS_MAX),
    out=st.integers(1, 6),
    inner=st.integers(1, 5),
    s=st.integers(0, 7),
    seed=st.integers(0, 99),
)
def test_dense_experts_equal_the_gathered_product(n_experts, out, inner, s, seed):
    """Every token's row of the dense product is the gathered one, negative expert ids (counted from the end) and no
    token at all included."""
    g = _experts(n_experts, out, inner, seed)
    opt, report = optimize(g, verify=True)
    assert [f.rule for f in report.trace.fired].count("dense_experts") == 1, report.explain()
    assert not [n for n in opt.nodes.values() if isinstance(n.op, Gather) and n.inputs[0] == "experts.weight"]
    rng = np.random.default_rng(seed)
    feeds = {"ids": rng.integers(-n_experts, n_experts, s).astype(np.int64), "x": rng.standard_normal((s, inner))}
    want = np.einsum("soi,si->so", g.initializers["experts.weight"][feeds["ids"]], feeds["x"])
    np.testing.assert_allclose(run(g, feeds, reference=True)["y"], want, rtol=1e-12, atol=1e-12)
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(opt, feeds, backend)["y"], want, rtol=1e-10, atol=1e-12, err_msg=backend)


def test_many_experts_stay_gathered():
    g = _experts(DENSE_EXPERTS_MAX + 1, 3, 2, 0)
    _, report = optimize(g)
    assert "dense_experts" not in [f.rule for f in report.trace.fired]
    assert "the gathered form moves less" in report.explain()


@pytest.mark.parametrize("spec", ["soi,si->os", "soi,ti->so"])
def test_a_gathered_axis_that_is_not_a_leading_batch_axis_is_left(spec):
    """The token axis must lead the output and be shared with the other operand (else the gathered form stays)."""
    rng = np.random.default_rng(0)
    g = Graph("experts")
    ids = g.input("ids", ["s"], "int64")
    x = g.input("x", ["t" if "t" in spec else "s", 2], "float64")
    w = g.constant("experts.weight", rng.standard_normal((3, 4, 2)))
    g.output(g.einsum(spec, g.add_node(Gather(0), [w, ids]), x, name="y"))
    _, report = optimize(g)
    assert "dense_experts" not in [f.rule for f in report.trace.fired]


@pytest.mark.parametrize("backend", ["numpy", "ort-cpu", "onnx-reference"])
def test_an_expert_id_past_the_table_is_refused_as_gather_refuses_it(backend):
    """A router that names more experts than the table holds: the unoptimized graph and onnxruntime refuse the id, and
    so must the dense form (it used to read another token's row: ``token * E + id`` lands in the next token)."""
    g = _experts(4, 3, 2, 0)
    opt, report = optimize(g)
    assert "dense_experts" in [f.rule for f in report.trace.fired]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2))
    for bad in (4, 5, -5):
        feeds = {"ids": np.array([0, bad, 1], np.int64), "x": x}
        with pytest.raises(Exception, match="(?i)out of (range|bounds)|indices element|index"):
            run(g, feeds, "numpy")
        with pytest.raises(Exception, match="(?i)out of (range|bounds)|indices element|index"):
            run(opt, feeds, backend)
