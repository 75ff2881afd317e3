"""Multi-head latent attention read in its absorbed form (multi-query attention over the latent), and the in-place
tensor assembly its exports write (ScatterND slabs read as a Concat).

Checked differentially: a hand-built MLA layer, absorbed, against the same graph unoptimized in float64 (hypothesis
draws the sizes); DeepSeek-V3 exported by both torch.onnx exporters against onnxruntime on the file; scatters of
consecutive and of scattered rows against onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from graphc import Graph, optimize
from graphc.onnx_import import from_onnx
from graphc.optimizer import Target, lower
from graphc.optimizer.latent import latent_projection
from graphc.tensor_ops import Slice
from lowering import run


KEEP_ALL = Target("keep", lambda graph, node, ctx: None)


def _fired(report, rule: str) -> int:  # noqa: ANN001
    return sum(1 for f in report.trace.fired if f.rule == rule)


# ------------------------------------------------------------------------------------------ a hand-built MLA layer


def _mla_layer(heads: int, rank: int, nope: int, rot: int, value: int, seed: int) -> Graph:
    """DeepSeek's attention as transformers writes it: keys and values projected from a cached one-head latent, the
    rotary key shared by every head, a causal mask at the past's offset."""
    rng = np.random.default_rng(seed)
    g = Graph("mla")
    q = g.input("q", ["b", heads, "s", nope + rot], "float64")
    past_c, new_c = g.input("past_c", ["b", 1, "p", rank], "float64"), g.input("c", ["b", 1, "s", rank], "float64")
    past_r, new_r = g.input("past_r", ["b", 1, "p", rot], "float64"), g.input("r", ["b", 1, "s", rot], "float64")
    latent = g.concat([past_c, new_c], 2, name="present_c")
    rotary = g.concat([past_r, new_r], 2, name="present_r")
    w = g.constant("kv_b.weight", rng.standard_normal((rank, heads * (nope + value))) / np.sqrt(rank))
    kv = g.einsum("abcd,de->abce", latent, w)
    kv = g.transpose(g.reshape(kv, ["b", "p+s", heads, nope + value]), (0, 2, 1, 3))
    k_nope = g.add_node(Slice(3, 0, nope), [kv])
    v = g.add_node(Slice(3, nope, nope + value), [kv])
    k = g.concat([k_nope, g.repeat(rotary, heads, 1)], 3)
    scores = g.einsum("abcd,abed->abce", g.scale(q, (nope + rot) ** -0.5), k)
    probs = g.softmax(g.causal_mask(scores, "p"))
    g.output(g.einsum("abcd,abde->acbe", probs, v, name="out"), latent, rotary)
    g.verify()
    return g


@settings(max_examples=20, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    rank=st.sampled_from([4, 8, 16]),
    nope=st.sampled_from([2, 4]),
    rot=st.sampled_from([2, 4]),
    value=st.sampled_from([2, 6]),
    s=st.integers(1, 3),
    p=st.integers(0, 9),
    seed=st.integers(0, 99),
)
def test_an_absorbed_latent_layer_equals_the_projected_one(heads, rank, nope, rot, value, s, p, seed):
    g = _mla_layer(heads, rank, nope, rot, value, seed)
    opt, report = optimize(g, hints={"b": 2, "s": 1, "p": 4096}, verify=True)
    assert _fired(report, "absorb_latent_attention") == 1, report.explain()
    assert "kv_b.weight" not in opt.initializers  # the projection went into the queries and the output
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal([{"b": 2, "s": s, "p": p}.get(d, d) for d in g.types[n].shape]) for n in g.inputs}
    want = run(g, feeds, reference=True)
    got = run(opt, feeds)
    for name in g.outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)
    lowered = lower(opt, KEEP_ALL)
    attention = [n for n in lowered.topological_order() if n.op.kind == "Attention"]
    assert len(attention) == 1
    k_shape = lowered.types[attention[0].inputs[1]].shape
    assert k_shape[1] == 1 and k_shape[3] == rank + rot  # multi-query: one KV head, the latent and its rotary key


def test_a_long_prefill_keeps_the_projected_form():
    """With as many queries as keys the absorbed scores (width rank+rot per head) cost more than projecting K/V."""
    g = _mla_layer(4, 16, 4, 4, 4, 0)
    _, report = optimize(g, hints={"b": 1, "s": 1024, "p": 0})
    assert _fired(report, "absorb_latent_attention") == 0
    assert "projected form costs fewer" in report.explain()


def test_latent_projection_reads_the_heads_slice_of_the_weight():
    g = _mla_layer(2, 8, 4, 2, 6, 1)
    opt = optimize(g, level=0).graph
    key = next(n for n in opt.nodes.values() if isinstance(n.op, Slice) and n.op.start == 0)
    found = latent_projection(opt, key.output)
    assert found is not None and found.latent == "present_c" and (found.start, found.stop) == (0, 4)
    np.testing.assert_array_equal(found.weight, opt.initializers["kv_b.weight"].reshape(8, 2, 10))


# ------------------------------------------------------------------------------------- scatters as Concat of slabs


def _scatter_model(rows: list[int]) -> onnx.ModelProto:
    """dynamo's in-place assembly: zeros [8, n] with ``rows`` of axis 0 written by ScatterND (constant ``[k, 1]`` indices)."""
    k = len(rows)
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "one", "two"], ["n"]),
        helper.make_node("Concat", ["eight", "n"], ["full"], axis=0),
        helper.make_node("ConstantOfShape", ["full"], ["zeros"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("ScatterND", ["zeros", "idx", "x"], ["y"]),
    ]
    inits = [
        helper.make_tensor("idx", TensorProto.INT64, [k, 1], rows),
        helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        helper.make_tensor("two", TensorProto.INT64, [1], [2]),
        helper.make_tensor("eight", TensorProto.INT64, [1], [8]),
    ]
    graph = helper.make_graph(
        nodes,
        "slab",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, "n"])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("rows, concat", [([0, 1, 2], True), ([3, 4, 5, 6, 7], True), ([2, 3], True), ([1, 3], False), ([2, 1], False)])
def test_a_scatter_of_consecutive_rows_is_a_concat_of_slabs(rows, concat, tmp_path):
    model = _scatter_model(rows)
    path = tmp_path / "slab.onnx"
    onnx.save(model, str(path))
    opt, report = optimize(from_onnx(path), verify=True)
    assert ("Opaque" not in opt.op_counts()) == concat, str(opt)
    assert (_fired(report, "scatter_slab") == 1) == concat
    x = np.random.default_rng(0).standard_normal((len(rows), 5)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_array_equal(run(opt, {"x": x}, backend)[opt.outputs[0]], want, err_msg=backend)


# ----------------------------------------------------------------------------------------- DeepSeek-V3's exports

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from real_exports import export_model, feeds  # noqa: E402


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_deepseek_v3_decode_reads_its_latent_cache_as_one_kv_head(exporter, tmp_path):
    """transformers' DeepSeek-V3 caches its compressed latents.  Both exporters write its keys by two in-place slab
    writes (ScatterND); at decode sizes the optimizer reads them as a Concat, absorbs the key and value projections,
    and each layer is one causal multi-query ``Attention`` over the latent cache, equal to onnxruntime on the file."""
    path = export_model("deepseek_v3", exporter, "eager", True, tmp_path / "model.onnx")
    model = onnx.load(str(path), load_external_data=False)
    graph = from_onnx(path)
    dims = [d for d in graph.types[graph.inputs[2]].shape if isinstance(d, str)]  # past batch and length: their names
    seq = next(d for d in graph.types[graph.inputs[0]].shape[1:] if isinstance(d, str))
    hints = {dims[0]: 2, seq: 1, dims[1]: 512}
    optimized, report = optimize(graph, hints=hints)
    assert _fired(report, "absorb_latent_attention") == 2, report.explain()
    assert not [n for n in optimized.nodes.values() if n.op.kind == "Opaque" and n.op.op_type == "ScatterND"]  # the slabs are read
    lowered = lower(optimized, KEEP_ALL)
    attention = [n for n in lowered.topological_order() if n.op.kind == "Attention"]
    assert len(attention) == 2
    for node in attention:
        assert (node.op.visibility.causal_offset is not None, node.op.mask) == (True, "bool")
        assert lowered.types[node.inputs[1]].shape[1] == 1  # one KV head: the latent
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, new, past, pad in [(2, 1, 11, 3), (1, 1, 40, 0), (3, 4, 6, 2)]:
        f = feeds(model, batch, new, past, pad)
        want = session.run(None, f)
        got = run(optimized, {name: f[vi.name] for name, vi in zip(graph.inputs, model.graph.input)})
        for name, w in zip(optimized.outputs, want):
            np.testing.assert_allclose(got[name], w, rtol=1e-3, atol=1e-4, err_msg=f"{name} at {batch, new, past, pad}")
