"""Projections of one value merged into one contraction (``graphc.optimizer.merging``): the same numbers on every
backend, one ``MatMul`` where there were several, and only in the CUDA export."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphc
from graphc.attention.hf_lm import causal_lm_config_from_hf
from graphc.optimizer import PassContext
from graphc.optimizer.merging import merge_projections, projection_groups
from lowering import export, random_inputs, run

from conftest import installed

TINY_LM = dict(
    model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=50, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
)  # fmt: skip


def _projections(widths: list[int], layouts: list[bool], dtype: str = "float32") -> graphc.Graph:
    """``x`` read by one projection per width (weight ``[out, in]`` when its layout flag is set, else ``[in, out]``),
    each result then used (a sum, so a Slice that took the wrong columns shows)."""
    rng = np.random.default_rng(len(widths))
    g = graphc.Graph("projections")
    x = g.input("x", ["batch", "seq", 12], dtype)
    sums = []
    for i, (n, out_in) in enumerate(zip(widths, layouts)):
        w = g.constant(f"layer.p{i}.weight", rng.standard_normal((n, 12) if out_in else (12, n)).astype(dtype))
        y = g.einsum("bsm,nm->bsn" if out_in else "bsm,mn->bsn", x, w, name=f"y{i}")
        sums.append(g.einsum("bsn->bs", y, name=f"s{i}"))
    total = sums[0]
    for s in sums[1:-1]:
        total = g.add(total, s)
    g.output(g.add(total, sums[-1], name="out"))
    return g


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    layouts=st.lists(st.booleans(), min_size=4, max_size=4),
    seq=st.integers(1, 4),
)
def test_merged_projections_give_the_same_numbers(widths, layouts, seq):
    g = _projections(widths, layouts[: len(widths)])
    merged = g.copy()
    assert merge_projections(merged, PassContext()).modified == (len(set(layouts[: len(widths)])) < len(widths))
    merged.verify()
    feeds = {"x": np.random.default_rng(seq).standard_normal((2, seq, 12)).astype(np.float32)}
    want = run(g, feeds, "numpy", compute_dtype="float64")["out"]
    np.testing.assert_allclose(run(merged, feeds, "numpy")["out"], want, rtol=1e-5, atol=1e-5)
    kinds = Counter(n.op.kind for n in merged.nodes.values())
    assert kinds["Slice"] == sum(c for c in Counter(layouts[: len(widths)]).values() if c > 1)  # one group per layout


def test_a_projection_that_is_a_graph_output_or_of_another_dtype_stays():
    g = _projections([3, 4, 5], [True, True, True])
    g.output("y2")
    groups = projection_groups(g)
    assert [[n.name for n in grp] for grp in groups] == [["y0", "y1"]]


@pytest.mark.skipif(not installed("ort-cpu"), reason="onnxruntime is not installed")
def test_a_cuda_lm_step_exports_q_k_v_and_gate_up_as_one_matmul_each_with_the_same_logits():
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=0, logits="last")
    sizes = {"batch": 2, "seq": 3, "past_seq": 4}
    opt = graphc.optimize(g, hints=sizes).graph
    assert not [n for n in export(opt, attention="auto", sizes=sizes).graph.node if "merged_" in "".join(n.input)]  # the CPU export: apart
    model = export(opt, device="cuda", attention="auto", sizes=sizes)
    weights = {t.name: t for t in model.graph.initializer}
    merged = [n for n in model.graph.node if n.op_type == "MatMul" and "merged_" in n.input[1]]
    layers = TINY_LM["num_hidden_layers"]
    assert Counter(n.input[1].split(".")[-2] for n in merged) == {"merged_q_proj_k_proj_v_proj": layers, "merged_gate_proj_up_proj": layers}
    q, kv = TINY_LM["num_attention_heads"] * 16, TINY_LM["num_key_value_heads"] * 16
    widths = sorted(int(weights[n.input[1]].dims[1]) for n in merged)
    assert widths == [q + 2 * kv] * layers + [2 * TINY_LM["intermediate_size"]] * layers
    assert not [n for n in model.graph.node if n.op_type == "Transpose" and "merged_" in n.input[0]]  # laid out [in, out]
    feeds = random_inputs(g, seed=1, **sizes)  # float32: the CUDA export runs on the CPU provider as it is
    want = run(g, feeds, "numpy", compute_dtype="float64")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)
