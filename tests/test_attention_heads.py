"""Attention written over a ``[batch*heads]`` view with its KV cache concatenated outside (Bloom's layout), read back
as the op over ``[batch, heads]`` with its cache (``graphc.optimizer.heads``).

Checked differentially: hypothesis draws the heads, the past and the lengths; the lowered graph (one causal
``Attention`` with static heads and ``kv_cache=True``) on numpy, onnxruntime (grouped MatMuls and query chunks) and the
ONNX reference against the graph as written, run by the reference interpreter in float64.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc import Graph
from graphc.optimizer import Target, lower
from graphc.optimizer.infra import PassContext
from lowering import run

KEEP_ALL = Target("keep", lambda graph, node, ctx: None)


def _flat_heads_layer(heads: int, d: int, with_mask: bool) -> Graph:
    """``softmax(q k^T / sqrt(d) + causal (+ bias)) v`` on ``[batch*heads, S, D]`` views of ``[batch, heads, ...]``
    tensors, K and V the concatenation of a cache and the new keys (as Bloom's eager attention writes it)."""
    g = Graph("flat_heads")
    q = g.input("q", ["b", heads, "s", d])
    k, v = g.input("k", ["b", heads, "s", d]), g.input("v", ["b", heads, "s", d])
    pk, pv = g.input("past_k", ["b", heads, "p", d]), g.input("past_v", ["b", heads, "p", d])
    kk, vv = g.concat([pk, k], axis=2, name="present_k"), g.concat([pv, v], axis=2, name="present_v")
    qf = g.reshape(q, [1, f"{heads}*b", "s", d])
    kf, vf = g.reshape(kk, [1, f"{heads}*b", "p+s", d]), g.reshape(vv, [1, f"{heads}*b", "p+s", d])
    s = g.scale(g.einsum("xhqd,xhkd->xhqk", qf, kf), 1 / np.sqrt(d))
    if with_mask:  # a per-head bias on the keys (ALiBi-like), added in the [batch, heads] view and viewed as the scores'
        bias = g.input("bias", ["b", heads, 1, "p+s"])
        s = g.add(s, g.reshape(bias, [1, f"{heads}*b", 1, "p+s"]))
    p = g.softmax(g.causal_mask(s, "p"))
    out = g.reshape(g.einsum("xhqk,xhkd->xhqd", p, vf), ["b", heads, "s", d], name="out")
    g.output(out, kk, vv)
    return g


@settings(max_examples=15, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    s=st.integers(1, 6),
    past=st.integers(0, 5),
    batch=st.integers(1, 3),
    with_mask=st.booleans(),
    seed=st.integers(0, 99),
)
def test_attention_over_batch_times_heads_is_read_with_its_heads_and_cache(heads, s, past, batch, with_mask, seed):
    g = _flat_heads_layer(heads, 8, with_mask)
    ctx = PassContext()
    lowered = lower(g, KEEP_ALL, ctx=ctx)
    [node] = [n for n in lowered.topological_order() if n.op.kind == "Attention"]
    assert lowered.types[node.inputs[0]].shape[:2] == ("b", heads), node
    assert node.op.kv_cache and node.op.visibility.causal_offset == "p", node
    fired = {f.rule for f in ctx.trace.fired}
    assert {"unflatten_heads", "absorb_kv_cache"} <= fired, ctx.trace.explain()
    rng = np.random.default_rng(seed)
    feeds = {
        name: rng.standard_normal([{"b": batch, "s": s, "p": past, "p+s": past + s}.get(x, x) for x in g.types[name].shape]).astype(np.float32)
        for name in g.inputs
    }
    want = run(g, feeds, reference=True, compute_dtype="float64")
    results = {
        "numpy": run(g, feeds),
        "ort grouped": run(g, feeds, "ort-cpu", attention="decomposed"),
        "ort chunked": run(g, feeds, "ort-cpu", attention="chunked"),
        "onnx reference": run(g, feeds, "onnx-reference"),
    }
    for backend, got in results.items():
        for name in g.outputs:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{backend} {name}")


def test_a_cache_read_before_the_attention_is_left_to_the_graph():
    """The op produces its present where it runs: a cache Concat read earlier (its value needed before the attention)
    stays a Concat, with the reason recorded."""
    g = _flat_heads_layer(2, 8, False)
    early = g.scale("present_k", 2.0, name="early_reader")
    g.output(early)
    g.move_before("early_reader", next(n.name for n in g.topological_order() if n.op.kind == "Einsum"))
    ctx = PassContext()
    lowered = lower(g, KEEP_ALL, ctx=ctx)
    [node] = [n for n in lowered.topological_order() if n.op.kind == "Attention"]
    assert not node.op.kv_cache
    assert "is read before attention" in ctx.trace.explain()
