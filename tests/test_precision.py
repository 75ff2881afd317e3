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
from lowering.backends import unavailable_reason
from lowering.compare import default_tolerance
from lowering.targets import NUMPY_TARGET

BACKENDS = [b for b in ("numpy", "onnx-reference", "ort-cpu", "torch") if unavailable_reason(b) is None]


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
    for dtype, tol in (("float32", (1e-4, 1e-3)), ("float16", (1e-3, 4e-3)), ("bfloat16", (1e-2, 3e-2))):
        g = graphc.sdpa_graph(AttentionConfig(16, 2, 1, head_dim=8), dtype=dtype)
        assert default_tolerance(g) == tol
        report = compare(g, sizes={"batch": 1, "seq": 5}, backends=["numpy", "ort-cpu"], repeats=1)
        assert report.ok and (report.atol, report.rtol) == tol, str(report)
