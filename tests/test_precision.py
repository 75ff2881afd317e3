"""float16/bfloat16 graphs: stored in low precision, computed in float32 by every backend."""

from __future__ import annotations

import numpy as np
import pytest
from reference import ref_sdpa

import graphc
from graphc import AttentionConfig, Graph
from graphc.optimizer import lower
from graphc.optimizer.precision import promote_low_precision, widen_interface
from lowering import compare, prepare, random_inputs
from lowering.compare import default_tolerance
from lowering.exporter.targets import NUMPY_TARGET

from conftest import INSTALLED

BACKENDS = INSTALLED


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scores_beyond_float16_range_stay_finite(dtype):
    """q.k of 8 x 100 x 100 = 80000 overflows float16 (max 65504); graphc's float32 compute does not."""
    cfg = AttentionConfig(16, 2, 1, head_dim=8, scale=1e-4)
    g = graphc.sdpa_graph(cfg, dtype=dtype)
    rng = np.random.default_rng(0)
    feeds = {k: (100 * np.sign(rng.standard_normal(v.shape))).astype(dtype) for k, v in random_inputs(g, batch=1, seq=4).items()}
    want = ref_sdpa(*(feeds[k].astype(np.float64) for k in ("q_BHSD", "k_BHkvTD", "v_BHkvTD")), causal=True, scale=1e-4)
    for graph in (g, graphc.optimize(g).graph):
        for backend in BACKENDS:
            got = prepare(graph, backend).run(feeds)["attn_BHSD"]
            assert str(got.dtype) == dtype
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=0.5, err_msg=backend)


def test_promotion_keeps_the_interface_and_computes_in_float32():
    g = graphc.kv_cache_graph(AttentionConfig(16, 2, 1, head_dim=8), dtype="bfloat16")
    p = promote_low_precision(g)
    assert p.inputs == g.inputs and p.outputs == g.outputs
    assert all(p.types[n] == g.types[n] for n in (*g.inputs, *g.outputs))
    inner = [n for n in p.types if n not in (*g.inputs, *g.outputs, *g.initializers)]
    assert {p.types[n].dtype for n in inner} == {"float32"}
    assert "Cast" in lower(g, NUMPY_TARGET).op_counts()


def test_widened_interface_is_exact():
    g = Graph("identity")
    x = g.input("x", [5], "bfloat16")
    g.output(g.neg(g.neg(x), name="y"))
    w = widen_interface(g)
    assert w.types["x"].dtype == "float32" and w.types["y"].dtype == "float32"
    x = np.array([1.0, -3.5, 1e30, 7e-30, 0.1], "bfloat16")
    got = prepare(g, "ort-cpu").run({"x": x})["y"]
    assert str(got.dtype) == "bfloat16" and np.array_equal(got.view(np.uint16), x.view(np.uint16))


def test_compare_tolerances_follow_the_output_dtype():
    for dtype, tol in (("float32", (1e-4, 1e-3)), ("float16", (1e-2, 1e-2)), ("bfloat16", (8e-2, 8e-2))):
        g = graphc.sdpa_graph(AttentionConfig(16, 2, 1, head_dim=8), dtype=dtype)
        assert default_tolerance(g) == tol
        report = compare(g, sizes={"batch": 1, "seq": 5}, backends=["numpy", "ort-cpu"], repeats=1)
        assert report.ok and (report.atol, report.rtol) == tol, str(report)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_fully_masked_row_gives_zeros_with_a_low_precision_minus_inf(dtype):
    """A ``-inf`` fill stored in bfloat16 (NumPy kind "V", not "f") must still get the exported softmax's NaN guard."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy

    g = Graph("masked_softmax")
    x = g.input("x", [2, 3], dtype)
    keep = g.input("keep", [2, 3], "bool")
    g.output(g.softmax(g.where(keep, x, g.constant("fill", np.array(-np.inf, dtype))), name="probs"))
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3).astype(dtype), "keep": np.array([[True, False, True], [False, False, False]])}
    e = np.exp(np.array([0.0, 2.0]) - 2.0)
    want = np.array([[e[0] / e.sum(), 0.0, e[1] / e.sum()], [0.0, 0.0, 0.0]])
    for backend in BACKENDS:
        got = prepare(g, backend).run(feeds)["probs"].astype(np.float64)
        np.testing.assert_allclose(got, want, atol=1e-2, err_msg=backend)


def test_a_bfloat16_minus_inf_constant_is_seen_by_the_nan_guard_analysis():
    """bfloat16's NumPy kind is "V": the analysis once took every bfloat16 constant as finite, and a left-padded causal LM
    then exported a softmax without its guard (NaN for the padding rows, spreading through the cache into real tokens)."""
    import ml_dtypes

    from lowering.exporter.onnx_builder import may_carry_neg_inf

    g = Graph("masked")
    x = g.input("x", [2, 3], "bfloat16")
    keep = g.input("keep", [2, 3], "bool")
    g.output(g.where(keep, x, g.constant("fill", np.array(-np.inf, ml_dtypes.bfloat16)), name="masked"))
    g.output(g.mul(x, g.constant("two", np.array(2.0, ml_dtypes.bfloat16)), name="scaled"))
    flags = may_carry_neg_inf(g)
    assert flags["masked"] and flags["scaled"]  # (a user input may carry -inf)
    h = Graph("constant_only")
    h.output(
        h.where(
            h.constant("k", np.array([True, False])),
            h.constant("v", np.ones(2, ml_dtypes.bfloat16)),
            h.constant("f", np.array(-np.inf, ml_dtypes.bfloat16)),
            name="out",
        )
    )
    assert may_carry_neg_inf(h)["out"] and may_carry_neg_inf(h)["f"] and not may_carry_neg_inf(h)["v"]
