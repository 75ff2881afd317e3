"""The optimizer: differential tests on every graph kind, and focused tests per pass."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_layer, ref_sdpa

import graphc
from graphc import AttentionConfig, Graph, optimize
from graphc.ops import Scale
from graphc.errors import OptimizerError, UnknownNameError
from graphc.optimizer import Pass, PassContext, PassManager, RewritePass, Rule
from lowering import random_inputs, run, run_numpy

F64 = dict(rtol=1e-9, atol=1e-11)
F32 = dict(rtol=2e-4, atol=2e-5)  # optimized float32 vs unoptimized float32: reassociation and scale placement


def _small(cfg: AttentionConfig, hd: int = 4) -> AttentionConfig:
    """A preset's head layout (query and KV heads) with a tiny head_dim, so weights stay small."""
    return cfg.with_(d_model=cfg.n_heads * hd, head_dim=hd)


GRAPH_KINDS = {
    "prefill": (lambda c, dt: graphc.attention_layer_graph(c, seed=1, dtype=dt), dict(batch=2, seq=5)),
    "core": (lambda c, dt: graphc.sdpa_graph(c, dtype=dt), dict(batch=2, seq=4)),
    "cross": (lambda c, dt: graphc.cross_attention_graph(c, seed=1, dtype=dt), dict(batch=1, q_len=3, kv_len=6)),
    "decode": (lambda c, dt: graphc.kv_cache_graph(c, seed=1, dtype=dt), dict(batch=2, seq=1, past_seq=6)),
    "chunk": (lambda c, dt: graphc.kv_cache_graph(c, seed=1, dtype=dt), dict(batch=1, seq=3, past_seq=4)),
}


def _assert_same(g: Graph, h: Graph, sizes: dict, tol: dict, seed: int = 0) -> None:
    feeds = random_inputs(g, seed=seed, **sizes)
    want, got = run_numpy(g, feeds), run_numpy(h, feeds)
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **tol, err_msg=name)


@pytest.mark.parametrize("preset", graphc.preset_names())
@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_every_preset_and_graph_kind_optimizes_to_the_same_numbers(preset, kind):
    cfg = _small(graphc.preset(preset))
    build, sizes = GRAPH_KINDS[kind]
    g = build(cfg, "float64")
    h, report = optimize(g, verify=True)
    _assert_same(g, h, sizes, F64)
    counts = h.op_counts()
    assert counts.get("Repeat", 0) == 0
    assert report.after.repeat_bytes == 0
    if cfg.is_mha:
        assert report.before.repeat_bytes == 0
        assert not [f for f in report.trace.fired if f.pass_name == "fuse_repeat_kv"]
    else:
        assert report.before.repeat_bytes > 0
        assert len([f for f in report.trace.fired if f.rule == "fuse_repeat_kv"]) == 2


@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_float32_optimized_graphs_match_within_float32_tolerance(kind):
    cfg = _small(graphc.preset("llama3-8b"), hd=8)
    build, sizes = GRAPH_KINDS[kind]
    g = build(cfg, "float32")
    _assert_same(g, optimize(g).graph, sizes, F32)


def test_optimized_core_matches_independent_reference():
    cfg = AttentionConfig(64, 8, 2)
    g = graphc.sdpa_graph(cfg, dtype="float64")
    h = optimize(g).graph
    feeds = random_inputs(g, seed=3, batch=2, seq=6)
    want = ref_sdpa(feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"], causal=True, scale=cfg.softmax_scale)
    np.testing.assert_allclose(run_numpy(h, feeds)["attn_BHSD"], want, **F64)


@st.composite
def configs(draw):
    n_kv, group, hd = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 4]))
    return AttentionConfig(n_kv * group * hd, n_kv * group, n_kv, causal=draw(st.booleans()), bias=draw(st.booleans()))


@settings(max_examples=30, deadline=None)
@given(cfg=configs(), kind=st.sampled_from(sorted(GRAPH_KINDS)), seed=st.integers(0, 999))
def test_random_configs_optimize_to_the_same_numbers(cfg, kind, seed):
    build, sizes = GRAPH_KINDS[kind]
    g = build(cfg, "float64")
    h, report = optimize(g, verify=True)
    _assert_same(g, h, sizes, F64, seed)
    assert h.op_counts().get("Repeat", 0) == 0
    assert str(optimize(h).graph) == str(h)  # idempotent


@pytest.mark.parametrize("preset", ["mistral-7b", "falcon-7b", "llama2-7b"])
def test_optimize_is_idempotent_and_leaves_its_input_alone(preset):
    g = graphc.kv_cache_graph(_small(graphc.preset(preset)), seed=0)
    text = str(g)
    once = optimize(g).graph
    assert str(g) == text
    twice, report = optimize(once)
    assert str(twice) == str(once)
    assert report.trace.fired == []


def test_grouped_core_golden_text():
    h = optimize(graphc.sdpa_graph(AttentionConfig(16, 4, 2), causal=True)).graph
    assert str(h).splitlines()[5:16] == [
        "  q_BHkvMD: float32[batch,2,2*seq,4] = Reshape[shape=[batch,2,2*seq,4]](q_BHSD)",
        "  k_BHkvTD_scaled: float32[batch,2,seq,4] = Scale[factor=0.5](k_BHkvTD)",
        '  scores_BHkvMT: float32[batch,2,2*seq,seq] = Einsum[spec="bacd,bakd->back"](q_BHkvMD, k_BHkvTD_scaled)',
        "  scaled_BHST: float32[batch,4,seq,seq] = Reshape[shape=[batch,4,seq,seq]](scores_BHkvMT)",
        "  causal_BHST: float32[batch,4,seq,seq] = CausalMask[offset=0](scaled_BHST)",
        "  probs_BHST: float32[batch,4,seq,seq] = Softmax[axis=-1](causal_BHST)",
        "  probs_BHkvMT: float32[batch,2,2*seq,seq] = Reshape[shape=[batch,2,2*seq,seq]](probs_BHST)",
        '  attn_BHkvMD: float32[batch,2,2*seq,4] = Einsum[spec="back,bakd->bacd"](probs_BHkvMT, v_BHkvTD)',
        "  attn_BHSD: float32[batch,4,seq,4] = Reshape[shape=[batch,4,seq,4]](attn_BHkvMD)",
        "  return attn_BHSD",
        "}",
    ]


# ------------------------------------------------------------ focused: fusion


def _repeat_graph(axis: int = 1, as_output: bool = False, extra_reader: bool = False) -> Graph:
    g = Graph("rep")
    q = g.input("q", [1, 4, 3, 2], "float64")
    k = g.input("k", [1, 2, 3, 2], "float64")
    kr = g.repeat(k, 2, axis=axis, name="k_rep")
    term = "bhkd" if axis == 1 else "bhkd"
    s = g.einsum(f"bhqd,{term}->bhqk", q, kr, name="s") if axis == 1 else g.einsum("bhqd,bhkd->bhqd", q, kr, name="s")
    g.output(s)
    if as_output:
        g.output(kr)
    if extra_reader:
        g.output(g.add(kr, kr, name="twice"))
    return g


def _near_misses(report) -> dict:
    return {(m.rule, m.node): m.reason for m in report.trace.near_misses.values()}


def test_fusion_does_not_fire_when_the_repeat_is_a_graph_output():
    g = _repeat_graph(as_output=True)
    h, report = optimize(g)
    assert h.op_counts()["Repeat"] == 1
    assert "graph output" in _near_misses(report)[("fuse_repeat_kv", "k_rep")]
    _assert_same(g, h, {}, F64)


def test_fusion_does_not_fire_on_a_non_einsum_reader():
    g = _repeat_graph(extra_reader=True)
    h, report = optimize(g)
    assert h.op_counts()["Repeat"] == 1
    assert "reader 'twice' is a Binary, not an einsum" in _near_misses(report)[("fuse_repeat_kv", "k_rep")]


def test_fusion_does_not_fire_on_a_repeat_along_an_axis_the_other_operand_lacks():
    g = Graph("seqrep")
    q = g.input("q", [1, 2, 6, 2], "float64")
    k = g.input("k", [1, 2, 3, 2], "float64")
    kr = g.repeat(k, 2, axis=2, name="k_rep")  # along the key axis: label k is not in q
    g.output(g.einsum("bhqd,bhkd->bhqk", q, kr, name="s"))
    h, report = optimize(g)
    assert h.op_counts()["Repeat"] == 1
    assert "label 'k'" in _near_misses(report)[("fuse_repeat_kv", "k_rep")]
    _assert_same(g, h, {}, F64)


def test_fusion_handles_a_repeat_with_several_einsum_readers():
    g = Graph("multi")
    q = g.input("q", [1, 6, 3, 4], "float64")
    k = g.input("k", [1, 2, 5, 4], "float64")
    kr = g.repeat(k, 3, axis=1, name="k_rep")
    s1 = g.einsum("bhqd,bhkd->bhqk", q, kr, name="s1")
    s2 = g.einsum("bhkd,bhqd->bhkq", kr, q, name="s2")  # repeated operand first
    s3 = g.einsum("bhqd,bhkd->bqk", q, kr, name="s3")  # head label summed away
    g.output(s1, s2, s3)
    h, report = optimize(g, level=2, verify=True)
    assert "Repeat" not in h.op_counts()
    _assert_same(g, h, {}, F64)


# ---------------------------------------------------------- focused: clean-ups


def test_layout_rules_remove_identities_and_fold_chains():
    g = Graph("layout")
    x = g.input("x", [2, 3, 4], "float64")
    a = g.reshape(x, [2, 3, 4], name="same")
    b = g.transpose(a, [1, 0, 2], name="t1")
    c = g.transpose(b, [1, 0, 2], name="t2")  # composes to identity
    d = g.reshape(g.reshape(c, [6, 4], name="r1"), [3, 8], name="r2")
    w = g.constant("w", np.arange(24.0).reshape(8, 3))
    y = g.einsum("ij,jk->ik", d, w, name="y")
    g.output(g.exp(y, name="out"))
    h, report = optimize(g, level=1, verify=True)
    assert h.op_counts() == {"Einsum": 1, "Reshape": 1, "Unary": 1}
    assert h.nodes["r2"].inputs == ("x",)
    _assert_same(g, h, {}, F64)


def test_transposes_fold_into_einsum_specs():
    g = Graph("tfold")
    x = g.input("x", [2, 3, 4], "float64")
    y = g.input("y", [4, 5], "float64")
    xt = g.transpose(x, [0, 2, 1], name="xt")  # [2,4,3]
    e = g.einsum("bdi,dk->bik", xt, y, name="e")
    g.output(g.transpose(e, [0, 2, 1], name="et"))
    h, _ = optimize(g, level=1)
    assert h.op_counts() == {"Einsum": 1}
    assert h.nodes["et"].op.spec == "bid,dk->bki"
    _assert_same(g, h, {}, F64)


def test_identity_on_a_graph_output_is_kept_by_name():
    g = Graph("keep")
    x = g.input("x", [2, 2])
    g.output(g.transpose(x, [0, 1], name="y"))
    h, report = optimize(g)
    assert h.outputs == ["y"] and "graph output" in _near_misses(report)[("remove_identity_transpose", "y")]


def test_cse_dce_and_constant_folding():
    g = Graph("classic")
    x = g.input("x", [3, 4], "float64")
    w = g.constant("w", np.full((4, 2), 2.0))
    a = g.einsum("ij,jk->ik", x, w, name="a")
    b = g.einsum("ij,jk->ik", x, w, name="b")  # same as a
    g.exp(x, name="unused")
    ws = g.scale(g.constant("c", np.ones((2,))), 3.0, name="c3")  # constant subgraph
    g.output(g.add(g.add(a, b, name="ab"), ws, name="out"))
    h, report = optimize(g, level=1, verify=True)
    assert "b" not in h.nodes and "unused" not in h.nodes and "c3" in h.initializers
    np.testing.assert_array_equal(h.initializers["c3"], [3.0, 3.0])
    assert {f.rule for f in report.trace.fired} >= {"cse", "dce", "constant_fold"}
    _assert_same(g, h, {}, F64)


def test_scale_is_folded_into_the_query_projection_weight():
    cfg = AttentionConfig(32, 4, 4, bias=True)  # MHA: q and k equally sized, q is scaled
    g = graphc.attention_layer_graph(cfg, seed=2, dtype="float64")
    h, report = optimize(g, verify=True)
    assert "Scale" not in h.op_counts()
    assert "Repeat" not in h.op_counts() and not [f for f in report.trace.fired if f.rule == "fuse_repeat_kv"]
    weights = graphc.init_weights(cfg, seed=2, dtype="float64")
    feeds = random_inputs(g, seed=4, batch=2, seq=3)
    want, _, _ = ref_layer(cfg, weights, feeds["x_BSM"])
    np.testing.assert_allclose(run_numpy(h, feeds)["out_BSM"], want, **F64)


# -------------------------------------------------------- focused: planning


def test_chain_is_reassociated_and_the_weight_product_folded():
    rng = np.random.default_rng(0)
    g = Graph("chain")
    x = g.input("x", ["n", 64], "float64")
    h1 = g.einsum("ij,jk->ik", x, g.constant("w1", rng.standard_normal((64, 64))), name="h1")
    g.output(g.einsum("ik,kl->il", h1, g.constant("w2", rng.standard_normal((64, 2))), name="y"))
    h, report = optimize(g, hints={"n": 4096}, verify=True)
    assert h.op_counts() == {"Einsum": 1}
    (w,) = h.initializers.values()
    assert sorted(w.shape) == [2, 64]  # W1 @ W2 computed ahead of time (opt_einsum picks the layout)
    assert any(f.rule == "merge_einsum_chain" for f in report.trace.fired)
    _assert_same(g, h, {"n": 5}, F64)
    assert report.after.flops < report.before.flops / 20


def test_chain_is_kept_when_merging_costs_more():
    g = Graph("keepchain")
    x = g.input("x", [4, 64], "float64")
    h1 = g.einsum("ij,jk->ik", x, g.input("w1", [64, 64], "float64"), name="h1")
    g.output(g.einsum("ik,kl->il", h1, g.input("w2", [64, 64], "float64"), name="y"))
    h, report = optimize(g)
    assert h.op_counts() == {"Einsum": 2}
    assert "would cost" in _near_misses(report)[("merge_einsum_chain", "y")]


@pytest.mark.parametrize("optimizer", ["greedy", "optimal", "dp"])
def test_multi_operand_einsum_is_split_pairwise(optimizer):
    g = Graph("bilinear")
    a = g.input("a", [8, 5], "float64")
    m = g.input("m", [5, 6], "float64")
    b = g.input("b", [8, 6], "float64")
    g.output(g.einsum("bi,ij,bj->b", a, m, b, name="form"))
    h, report = optimize(g, optimizer=optimizer, verify=True)
    assert h.op_counts() == {"Einsum": 2}
    assert all(len(n.op.parsed.inputs) == 2 for n in h.nodes.values())
    _assert_same(g, h, {}, F64)


def test_unknown_optimizer_and_level_list_valid_names():
    g = graphc.sdpa_graph(AttentionConfig(8, 2, 1))
    with pytest.raises(UnknownNameError, match="unknown contraction optimizer 'fastest'; valid .*: auto, auto-hq, greedy"):
        optimize(g, optimizer="fastest")
    with pytest.raises(UnknownNameError, match="unknown optimization level '7'; valid .*: 0, 1, 2"):
        optimize(g, level=7)


# -------------------------------------------------------------- infrastructure


def test_pass_manager_verify_mode_names_the_broken_pass():
    def breaks(graph, ctx):
        first = next(iter(graph.nodes))
        graph.value(first).type = graphc.TensorType((1,), "float32")
        return True

    g = graphc.sdpa_graph(AttentionConfig(8, 2, 1))
    with pytest.raises(OptimizerError, match="pass 'breaks' produced an invalid graph: ShapeMismatchError"):
        PassManager([Pass("breaks", "", breaks)], verify=True).run(g, PassContext())


def test_rewrite_driver_is_bounded():
    """Two rules that undo each other forever stop with an error naming the stage, not a hang."""
    g = graphc.sdpa_graph(AttentionConfig(8, 2, 1))

    def flip(graph, node, ctx):
        return node

    def to_neg(graph, node, ctx):
        graph.redefine(node.name, Scale(-node.op.factor), node.inputs)
        return "flipped"

    restless = RewritePass("restless", "", [Rule("flip", (Scale,), flip, to_neg)])
    with pytest.raises(OptimizerError, match="stage 'restless' did not settle after"):
        PassManager([restless]).run(g, PassContext())


def test_report_shows_repeat_bytes_gone():
    cfg = graphc.preset("llama2-70b")
    g = graphc.sdpa_graph(cfg, batch=1, q_len=1, kv_len=4096)
    _, report = optimize(g)
    # K and V repeated from 8 to 64 heads: 2 x 64 x 4096 x 128 x 4 bytes = 256 MiB
    assert report.before.repeat_bytes == 2 * 64 * 4096 * 128 * 4 and report.after.repeat_bytes == 0
    text = str(report)
    assert "repeated K/V bytes" in text and "256.00 MiB" in text
    d = report.to_dict()
    assert d["before"]["repeats"] == 2 and d["after"]["repeats"] == 0 and d["trace"]["fired"]
    assert "group_kv/fuse_repeat_kv on k_rep_BHTD" in report.explain()


def test_a_causal_mask_that_hides_nothing_is_removed():
    cfg = AttentionConfig(16, 4, 2)
    g = graphc.sdpa_graph(cfg, q_len=1, kv_len=9, dtype="float64")  # one query over the whole cache: offset 8
    h, report = optimize(g, verify=True)
    assert "CausalMask" not in h.op_counts()
    assert any(f.rule == "remove_vacuous_causal_mask" for f in report.trace.fired)
    _assert_same(g, h, {"batch": 2}, F64)
    kept = optimize(graphc.sdpa_graph(cfg, q_len=2, kv_len=9)).graph  # offset 7 hides key 8 from query 0
    assert "CausalMask" in kept.op_counts()


def test_transpose_between_a_merge_and_its_split_is_one_transpose():
    """dynamo's K^T: [b,h,s,d] -> [b*h,s,d] -> [b*h,d,s] -> [b,h,d,s] is Transpose(0,1,3,2) of the original."""
    g = Graph("kt")
    x = g.input("x", ["b", 4, "s", 8])
    merged = g.reshape(x, ["4*b", "s", 8])
    t = g.transpose(merged, (0, 2, 1))
    g.output(g.reshape(t, ["b", 4, 8, "s"]))
    opt = optimize(g).graph
    assert opt.op_counts() == {"Transpose": 1}
    xs = np.random.default_rng(0).standard_normal((2, 4, 5, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(opt, {"x": xs})[opt.outputs[0]], xs.transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(run(g, {"x": xs})[g.outputs[0]], xs.transpose(0, 1, 3, 2))


def test_only_the_identity_grid_of_indices_reads_as_a_whole_scatter():
    """``is_identity_grid``: one ``arange`` per axis, each along its own axis; swapped components, or a position vector
    moved to another axis on the way, are not the grid (a scatter with them permutes what it writes)."""
    from graphc.ops import Concat, Reshape
    from graphc.optimizer.scatter import is_identity_grid
    from graphc.rotary import Positions
    from graphc.tensor_ops import BroadcastTo

    g = Graph("grid")
    x = g.input("x", ["b", 1, "s", "s"])
    full = ("b", 1, "s", "s")

    def along(axis: int, placed: tuple, moved: tuple | None = None) -> str:
        v = g.add_node(Reshape(placed), [g.add_node(Positions(axis), [x])]).name
        if moved is not None:
            v = g.add_node(Reshape(moved), [v]).name
        return g.add_node(Reshape((*full, 1)), [g.add_node(BroadcastTo(full), [v])]).name

    batch, rows, cols = along(0, ("b", 1, 1, 1)), along(2, (1, 1, "s", 1)), along(3, (1, 1, 1, "s"))
    heads = g.add_node(BroadcastTo((*full, 1)), [g.constant("zero", np.zeros((), np.int64))]).name
    moved = along(2, (1, 1, "s", 1), moved=(1, 1, 1, "s"))  # positions placed along the rows, then moved to the columns
    grid = lambda parts: g.add_node(Concat(4), parts).name  # noqa: E731
    assert is_identity_grid(g, grid([batch, heads, rows, cols]), full)
    assert not is_identity_grid(g, grid([batch, heads, cols, rows]), full)
    assert not is_identity_grid(g, grid([batch, heads, moved, cols]), full)


def test_a_constant_grid_component_must_lie_along_its_own_axis():
    """A constant ``arange`` placed along the heads, broadcast to the grid, is no column index even where the two
    axes have one length; placed along the columns it is, with its start (the slab a legacy export writes)."""
    from graphc.ops import Concat, Reshape
    from graphc.optimizer.scatter import grid_starts
    from graphc.tensor_ops import BroadcastTo

    g = Graph("grid")
    full = (1, 4, 1, 4)

    def component(name: str, values: np.ndarray) -> str:
        return g.add_node(Reshape((*full, 1)), [g.add_node(BroadcastTo(full), [g.constant(name, values)])]).name

    zero = component("zero", np.zeros((1, 1, 1, 1), np.int64))
    heads = component("heads", np.arange(4, dtype=np.int64).reshape(1, 4, 1, 1))
    cols = component("cols", np.arange(8, 12, dtype=np.int64).reshape(1, 1, 1, 4))
    across = component("across", np.arange(4, dtype=np.int64).reshape(1, 4, 1, 1))  # the heads' positions again
    assert grid_starts(g, g.add_node(Concat(4), [zero, heads, zero, cols]).name, full) == [0, 0, 0, 8]
    assert grid_starts(g, g.add_node(Concat(4), [zero, heads, zero, across]).name, full) is None
