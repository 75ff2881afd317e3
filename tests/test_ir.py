"""Dims, einsum specs, graph construction, verification, text form and JSON."""

import json

import numpy as np
import pytest

import graphc
from graphc import Graph
from graphc.dims import bind_shape, dim_add, dim_mul, dim_sub, eval_dim, normalize_dim
from graphc.errors import (
    CycleError,
    DimError,
    DTypeMismatchError,
    DuplicateNameError,
    EinsumSpecError,
    GraphError,
    OpError,
    SerializationError,
    ShapeMismatchError,
    UndefinedValueError,
    UnknownNameError,
)
from graphc.ops import Einsum, Reshape, TensorType, Transpose
from graphc.serialize import graph_from_dict, graph_to_dict, load_graph, save_graph
from lowering import random_inputs, run_numpy

# ------------------------------------------------------------------ dims


def test_dim_algebra_is_canonical():
    assert dim_add("seq", "past_seq") == "past_seq+seq" == dim_add("past_seq", "seq")
    assert dim_mul("seq", 4) == "4*seq"
    assert dim_mul(dim_add("a", 1), 2) == "2*a+2"
    assert dim_sub("sk", "sq") == "sk-sq"
    assert dim_sub("seq", "seq") == 0
    assert normalize_dim("2 * seq") == "2*seq"
    assert eval_dim("past_seq+seq", {"past_seq": 4, "seq": 2}) == 6


def test_dim_errors():
    with pytest.raises(DimError, match="bad factor"):
        normalize_dim("seq/2")
    with pytest.raises(DimError, match="'seq' .* is not bound"):
        eval_dim("seq", {})
    env = {}
    bind_shape(["batch", "seq"], (2, 3), env, "x")
    with pytest.raises(DimError, match="'seq' is 4 here but was bound to 3"):
        bind_shape(["batch", "seq"], (2, 4), env, "y")
    with pytest.raises(DimError, match="axis 0 must be 'past\\+seq' = 5, got 6"):
        bind_shape(["past+seq"], (6,), {"past": 2, "seq": 3}, "z")


def test_min_max_dims():
    from graphc.dims import bind_shapes, dim_is_nonnegative, dim_max, dim_min, dim_substitute, dim_symbols, min_max_args

    cut = dim_sub("s", dim_max(dim_sub("s", 15), 0))  # x[-15:] of an axis of s
    assert cut == "-max(0,s-15)+s" and dim_is_nonnegative(cut)
    assert [eval_dim(cut, {"s": n}) for n in (3, 15, 40)] == [3, 15, 15]
    assert dim_max(cut, 0) == cut  # decided: the cut is never negative
    assert dim_min("s+15", 15) == 15 and dim_max("s", 0) == "s" and dim_min(3, 7) == 3
    assert dim_min("b", "a") == dim_min("a", "b") == "min(a,b)"  # canonical argument order
    assert dim_min(dim_min("a", "b"), "c") == "min(a,b,c)" == normalize_dim("min( c , min(b,a) )")
    assert not dim_is_nonnegative("min(a-3,b)") and dim_is_nonnegative("max(a-3,b)")
    assert dim_symbols("2*max(a,b+c)-d") == {"a", "b", "c", "d"}
    assert min_max_args("min(a,b)") == ("min", ("a", "b")) and min_max_args("min(a,b)+1") is None
    assert dim_substitute("max(0,s-15)+t", {"s": 10}) == "t" and dim_substitute("max(0,s-15)+t", {"max(0,s-15)": 0}) == "t"
    env = {"t": 1}  # s is solved from the plain dim; the min/max dim is then checked
    bind_shapes([(["s+t"], [21], "x"), ([dim_min("s+t", 15)], [15], "y")], env)
    assert env == {"t": 1, "s": 20}
    with pytest.raises(DimError, match="axis 0 must be 'min\\(15,s\\+t\\)' = 15, got 16"):
        bind_shapes([(["s+t"], [21], "x"), ([dim_min("s+t", 15)], [16], "y")], {"t": 1})
    deep = "a"
    for i in range(20):
        deep = f"min({deep},s{i})"
    many = "max(" + ",".join(f"s{i}" for i in range(300)) + ")"
    bounded = ((deep, "nested more than 16 deep"), (many, "max of 300 arguments"), ("s" * 5000, "5000 characters"))
    for bad, why in (("min(a)", "bad factor"), ("min(a,b", "unbalanced"), ("max(a,b))", "unbalanced"), ("mean(a,b)", "bad factor"), *bounded):
        with pytest.raises(DimError, match=why):
            normalize_dim(bad)


def _dim_exprs():
    """Random dims over s, t built with graphc's +, -, *, min and max, each with a plain Python function of the sizes."""
    from hypothesis import strategies as st

    from graphc.dims import dim_max, dim_min

    leaf = st.one_of(
        st.sampled_from([("s", lambda e: e["s"]), ("t", lambda e: e["t"])]),
        st.integers(0, 20).map(lambda k: (k, lambda e, k=k: k)),
    )
    ops = {
        "+": (dim_add, lambda x, y: x + y),
        "-": (dim_sub, lambda x, y: x - y),
        "*": (dim_mul, lambda x, y: x * y),
        "min": (dim_min, min),
        "max": (dim_max, max),
    }

    def make(args):  # noqa: ANN001, ANN202
        op, (da, fa), (db, fb) = args
        dim_op, py_op = ops[op]
        return dim_op(da, db), lambda e: py_op(fa(e), fb(e))

    return st.recursive(leaf, lambda children: st.tuples(st.sampled_from(sorted(ops)), children, children).map(make), max_leaves=8)


def test_min_max_dims_agree_with_python_on_random_expressions():
    """Canonical forms, simplification and the non-negativity proof are checked against plain Python arithmetic."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from graphc.dims import dim_is_nonnegative, dim_max, dim_min

    @settings(max_examples=300, deadline=None)
    @given(_dim_exprs(), _dim_exprs(), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=6, max_size=6))
    def check(a, b, sizes):
        (da, fa), (db, fb) = a, b
        for s, t in sizes + [(0, 0), (15, 1), (16, 0)]:
            env = {"s": s, "t": t}
            assert eval_dim(da, env) == fa(env), (da, env)
            assert eval_dim(dim_sub(da, db), env) == fa(env) - fb(env)
            assert eval_dim(dim_min(da, db), env) == min(fa(env), fb(env))
            assert eval_dim(dim_max(dim_sub(da, db), 0), env) == max(fa(env) - fb(env), 0)
            if dim_is_nonnegative(dim_sub(da, db)):  # a proof must hold for every size
                assert fa(env) >= fb(env), (da, db, env)
        assert normalize_dim(str(da)) == da  # the canonical text parses back to itself

    check()


# ---------------------------------------------------------------- einsum


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ab,bc", "exactly one '->'"),
        ("ab->b->a", "exactly one '->'"),
        ("a1,bc->ac", "operand 0 .* has '1'"),
        ("...a,ab->b", "operand 0 .* has '.'"),
        ("ab,bc->aa", "output label 'a' appears more than once"),
        ("ab,bc->az", "output label 'z' does not appear in any input"),
        ("aa->a", "label 'a' repeats in operand 0"),
    ],
)
def test_invalid_einsum_specs(spec, message):
    with pytest.raises(EinsumSpecError, match=message):
        graphc.parse_einsum(spec)


def test_einsum_size_mismatch_names_operand_label_and_sizes():
    g = Graph()
    a = g.input("a", [2, 3])
    b = g.input("b", [4, 5])
    with pytest.raises(EinsumSpecError, match=r"node 'c'.*label 'j' has size 3 in operand 0 but 4 in operand 1"):
        g.einsum("ij,jk->ik", a, b, name="c")
    with pytest.raises(EinsumSpecError, match=r"operand 1 \('k'\) has 1 labels but rank 2"):
        g.einsum("ij,k->ik", a, b)
    with pytest.raises(OpError, match="has 2 operand"):
        g.einsum("ij,jk->ik", a)


# ------------------------------------------------------------ construction


def test_builder_errors_are_typed():
    g = Graph()
    x = g.input("x", ["batch", 4])
    with pytest.raises(DuplicateNameError, match="'x' is already defined"):
        g.input("x", [1])
    with pytest.raises(ShapeMismatchError, match=r"cannot reshape \[batch,4\] .* to \[batch,3\]"):
        g.reshape(x, ["batch", 3])
    with pytest.raises(ShapeMismatchError, match="do not broadcast"):
        g.add(x, g.input("y", [3]))
    with pytest.raises(DTypeMismatchError, match="operand 0: float32, operand 1: float64"):
        g.add(x, g.input("z", [4], "float64"))
    with pytest.raises(DTypeMismatchError, match="condition\\) must be bool"):
        g.where(x, x, x)
    with pytest.raises(OpError, match="axis 5 is out of range"):
        g.softmax(x, axis=5)
    with pytest.raises(OpError, match="not a permutation"):
        g.transpose(x, [0, 0])
    with pytest.raises(UndefinedValueError, match="'nope' is not defined"):
        g.relu("nope")
    with pytest.raises(UnknownNameError, match="valid unary functions: exp, neg"):
        g.unary("gelu", x)
    with pytest.raises(UnknownNameError, match="unknown dtype 'float8'"):
        g.input("w", [1], "float8")


def test_hand_written_ffn_and_bilinear_graphs_run():
    rng = np.random.default_rng(0)
    w1, w2, m = rng.standard_normal((8, 16)), rng.standard_normal((16, 8)), rng.standard_normal((8, 8))
    g = Graph("ffn")
    x = g.input("x", ["batch", "seq", 8], "float64")
    h = g.relu(g.einsum("bsd,df->bsf", x, g.constant("w1", w1)))
    y = g.einsum("bsf,fd->bsd", h, g.constant("w2", w2), name="y")
    form = g.einsum("bsi,ij,bsj->bs", x, g.constant("m", m), y, name="form")
    g.output(y, form)
    xs = rng.standard_normal((2, 3, 8))
    out = run_numpy(g, {"x": xs})
    want_y = np.maximum(xs @ w1, 0) @ w2
    np.testing.assert_allclose(out["y"], want_y, rtol=1e-12)
    np.testing.assert_allclose(out["form"], np.einsum("bsi,ij,bsj->bs", xs, m, want_y), rtol=1e-10)


# ------------------------------------------------------------ verification


def _small_graph() -> Graph:
    g = Graph("small")
    a = g.input("a", ["n", 4])
    b = g.constant("b", np.ones((4, 2), np.float32))
    c = g.einsum("nk,km->nm", a, b, name="c")
    g.output(g.softmax(c, name="d"))
    return g


def test_verify_detects_cycle():
    g = _small_graph()
    g.set_inputs("c", ["d", "b"])
    with pytest.raises(CycleError, match="cycle: c -> d -> c|cycle: d -> c -> d"):
        g.verify()


def test_verify_detects_undefined_value():
    g = _small_graph()
    g.set_inputs("d", ["ghost"])
    with pytest.raises(UndefinedValueError, match="node 'd' \\(Softmax\\): operand 0 'ghost' is used but never defined"):
        g.verify()


def test_verify_detects_shape_and_dtype_mismatch():
    g = _small_graph()
    g.value("d").type = TensorType(("n", 3), "float32")
    with pytest.raises(ShapeMismatchError, match=r"node 'd' .* declared shape \[n,3\] but the op gives \[n,2\]"):
        g.verify()
    g = _small_graph()
    g.value("d").type = TensorType(("n", 2), "float64")
    with pytest.raises(DTypeMismatchError, match="declared dtype float64 but the op gives float32"):
        g.verify()


def test_verify_detects_bad_einsum_operands_and_missing_outputs():
    g = _small_graph()
    g.nodes["c"].op = Einsum("nk,mk->nm")  # corrupt the payload behind the graph's back
    with pytest.raises(EinsumSpecError, match="label 'k' has size 4 in operand 0 but 2 in operand 1"):
        g.verify()
    g = _small_graph()
    g.outputs = []
    with pytest.raises(GraphError, match="has no outputs"):
        g.verify()


def test_text_form_is_stable_golden():
    g = _small_graph()
    assert str(g) == "\n".join(
        [
            "graph small(",
            "    a: float32[n,4]",
            ") {",
            "  const b: float32[4,2]",
            '  c: float32[n,2] = Einsum[spec="nk,km->nm"](a, b)',
            "  d: float32[n,2] = Softmax[axis=-1](c)",
            "  return d",
            "}",
        ]
    )
    assert str(g) == str(g.copy())


def test_sdpa_text_form_golden():
    g = graphc.sdpa_graph(graphc.AttentionConfig(16, 4, 2), causal=True)
    assert str(g).splitlines()[5:13] == [
        "  k_rep_BHTD: float32[batch,4,seq,4] = Repeat[axis=1, repeats=2](k_BHkvTD)",
        "  v_rep_BHTD: float32[batch,4,seq,4] = Repeat[axis=1, repeats=2](v_BHkvTD)",
        '  scores_BHST: float32[batch,4,seq,seq] = Einsum[spec="bhqd,bhkd->bhqk"](q_BHSD, k_rep_BHTD)',
        "  scaled_BHST: float32[batch,4,seq,seq] = Scale[factor=0.5](scores_BHST)",
        "  causal_BHST: float32[batch,4,seq,seq] = CausalMask[offset=0](scaled_BHST)",
        "  probs_BHST: float32[batch,4,seq,seq] = Softmax[axis=-1](causal_BHST)",
        '  attn_BHSD: float32[batch,4,seq,4] = Einsum[spec="bhqk,bhkd->bhqd"](probs_BHST, v_rep_BHTD)',
        "  return attn_BHSD",
    ]


# ------------------------------------------------------------------ JSON


def test_json_round_trip_preserves_text_and_numbers(tmp_path):
    cfg = graphc.AttentionConfig(32, 4, 2, bias=True)
    g = graphc.kv_cache_graph(cfg, seed=3)
    path = tmp_path / "g.json"
    save_graph(g, path)
    h = load_graph(path)
    assert str(h) == str(g)
    feeds = random_inputs(g, seed=1, batch=1, seq=2, past_seq=3)
    for name, arr in run_numpy(g, feeds).items():
        np.testing.assert_array_equal(run_numpy(h, feeds)[name], arr)


def test_json_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SerializationError, match="not valid JSON"):
        load_graph(bad)
    with pytest.raises(SerializationError, match="cannot read graph file"):
        load_graph(tmp_path / "missing.json")
    doc = graph_to_dict(_small_graph())
    with pytest.raises(SerializationError, match="not a graphc graph document"):
        graph_from_dict({"nodes": []})
    broken = json.loads(json.dumps(doc))
    broken["nodes"][0]["op"]["kind"] = "Eval"
    with pytest.raises(SerializationError, match="unknown op kind 'Eval'; valid kinds: Einsum, Reshape"):
        graph_from_dict(broken)
    broken = json.loads(json.dumps(doc))
    broken["nodes"][0]["op"]["attrs"] = {"spec": "ab"}
    with pytest.raises(SerializationError, match="exactly one '->'"):
        graph_from_dict(broken)
    broken = json.loads(json.dumps(doc))
    broken["nodes"][1]["inputs"] = ["zzz"]
    with pytest.raises(UndefinedValueError, match="'zzz' is used but never defined"):
        graph_from_dict(broken)
    broken = json.loads(json.dumps(doc))
    del broken["outputs"]
    with pytest.raises(SerializationError, match="missing field 'outputs'"):
        graph_from_dict(broken)
    broken = json.loads(json.dumps(doc))
    broken["initializers"][0]["data"] = "AAAA"
    with pytest.raises(SerializationError, match=r"initializers\[0\]: data does not decode"):
        graph_from_dict(broken)


def test_reshape_with_symbolic_products_verifies():
    g = Graph()
    x = g.input("x", ["b", "h", "s", 4])
    y = g.reshape(x, ["b", "h*s", 4])
    z = g.reshape(y, ["b", "h", "s", 4])
    g.output(g.transpose(z, [0, 2, 1, 3]))
    g.verify()
    assert g.types[y.name].shape == ("b", "h*s", 4)
    assert Reshape(("b", "s*h")).shape == ("b", "h*s")
    assert Transpose((1, 0)).perm == (1, 0)


# ------------------------------------------------------------ the IR core: users, order, multi-output


def test_values_know_their_producer_and_users_through_every_edit():
    g = _small_graph()
    assert g.value("c").producer is g.nodes["c"] and set(g.value("c").users) == {g.nodes["d"]}
    e = g.insert_before("d", graphc.ops.Scale(2.0), ["c"], "e")
    g.replace_uses("c", e)  # d now reads e; e still reads c
    assert [n.name for n in g.consumers("c")] == ["e"] and [n.name for n in g.consumers("e")] == ["d"]
    assert [n.name for n in g.topological_order()] == ["c", "e", "d"]
    g.verify()  # also checks every users list against the nodes
    g.set_inputs("d", ["c"])
    from graphc.optimizer.cleanup import remove_if_dead

    remove_if_dead(g, "e")
    assert "e" not in g.nodes and set(g.value("c").users) == {g.nodes["d"]}
    g.verify()


def test_rename_and_substitute_keep_graph_outputs_and_readers():
    g = _small_graph()
    g.rename_value("c", "scores")
    assert g.nodes["d"].inputs == ("scores",) and "scores" in g.nodes
    s = g.insert_before("d", graphc.ops.Softmax(-1), ["scores"], "d_new")
    g.substitute("d", {"d": s})  # d's readers (the graph output) move to d_new, which takes the name d
    assert g.outputs == ["d"] and g.nodes["d"].op == graphc.ops.Softmax(-1) and "d_new" not in g.types
    g.verify()


def test_multi_output_nodes_print_save_and_load():
    g = Graph("kv")
    q, k, v = (g.input(n, [1, 4, "s", 8]) for n in ("q", "k", "v"))
    pk, pv = g.input("pk", [1, 4, "p", 8]), g.input("pv", [1, 4, "p", 8])
    out, kk, vv = g.attention(q, k, v, 0.5, graphc.Visibility.causal("p"), past_key=pk, past_value=pv, names=["o", "present_key", "present_value"])
    g.output(out, kk, vv)
    g.verify()
    line = [ln for ln in str(g).splitlines() if "Attention" in ln][0]
    assert line.startswith("  o: float32[1,4,s,8], present_key: float32[1,4,p+s,8], present_value: float32[1,4,p+s,8] = Attention[")
    h = graph_from_dict(json.loads(json.dumps(graph_to_dict(g))))
    assert str(h) == str(g) and h.producer("present_value") is h.nodes["o"]


def test_scope_names_what_is_built_inside_it():
    g = Graph("scoped")
    x = g.input("x", ["n", 3])
    with g.scope("model.layers.0."):
        w = g.constant("w", np.eye(3, dtype=np.float32))
        assert g.qualified("w") == "model.layers.0.w" and w.name == "model.layers.0.w"
        y = g.einsum("ni,ij->nj", x, "w", name="y")  # operands by name: the scope first
        with g.scope("mlp."):
            inner = g.input("inner", ["n", 3])  # inputs are the interface: never scoped
            z = g.relu(g.add(y, inner), name=g.fresh_name("z"))
            z2 = g.relu(z, name=g.fresh_name("z"))
        assert g.value("y") is y  # value lookups by name see the scope too
    g.output(z2)
    g.verify()
    assert (y.name, inner.name, z.name, z2.name) == ("model.layers.0.y", "inner", "model.layers.0.mlp.z", "model.layers.0.mlp.z_1")
    assert g.fresh_name("y") == "y" and g.qualified("w") == "w"  # outside the scope again
    with pytest.raises(GraphError, match="name scope must be a string"):
        with g.scope(3):  # type: ignore[arg-type]
            pass


def test_scoped_build_matches_an_inlined_call():
    """Writing a layer under a scope gives the graph that inlining the layer's own graph under that prefix gives."""
    cfg = graphc.attention.AttentionConfig(16, 4, 2, rope=graphc.attention.RopeConfig())
    weights = graphc.attention.init_weights(cfg, seed=3)
    layer = graphc.attention_layer_graph(cfg, weights=weights)
    called = Graph("stack")
    out = called.call(layer, {"x_BSM": called.input("x_BSM", ["batch", "seq", 16])}, prefix="layers.0.")["out_BSM"]
    called.rename_value(out.name, "out_BSM")
    called.output("out_BSM")
    stack = graphc.attention_stack_graph(cfg, 1, weights=[weights])
    assert str(stack).splitlines()[1:] == str(called).splitlines()[1:] and list(stack.initializers) == list(called.initializers)


def test_call_inlines_a_graph_with_unique_names():
    sub = Graph("sub")
    x = sub.input("x", ["n", 3])
    sub.output(sub.relu(sub.einsum("ni,ij->nj", x, sub.constant("w", np.eye(3, dtype=np.float32)), name="y"), name="z"))
    g = Graph("two")
    a = g.input("a", ["n", 3])
    first = g.call(sub, {"x": a}, prefix="l0.")["z"]
    second = g.call(sub, {"x": first}, prefix="l0.")["z"]  # same prefix again: names still unique
    g.output(second)
    g.verify()
    assert first.name == "l0.z" and second.name == "l0.z_1" and g.initializers["l0.w"] is g.initializers["l0.w_1"]
    with pytest.raises(GraphError, match="missing \\['x'\\]"):
        g.call(sub, {})
