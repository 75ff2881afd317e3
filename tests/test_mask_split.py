"""An exporter's one additive mask read back as a causal offset, a sliding window and a padding mask.

The graphs here spell the mask as transformers' exported models do (positions compared, ``And`` as
``Where(a, b, False)``, ``Where(keep, 0, fill)`` added to the scores); the optimizer must recognise one ``Attention``
with the causal structure understood, and give the numbers of the graph as written, padded rows included.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc import Graph, Visibility, optimize
from graphc.ops import Binary, Cast, Compare, Concat, Einsum, Repeat, Reshape, Scale, Softmax, Where
from graphc.optimizer import Target, lower, unfused_softmaxes
from graphc.rotary import Positions
from graphc.tensor_ops import Arange, BroadcastTo, ShapeValues, Slice
from lowering import random_inputs, run, unavailable_reason

KEEP_ALL = Target("keep", lambda graph, node, ctx: None)
HEADS, KV_HEADS, D = 4, 2, 8
MIN32 = float(np.finfo(np.float32).min)


def _masked_attention(fill=MIN32, window=None, cache=False, flipped=False, scale_after=False, expanded=False):
    """Scores of GQA heads plus ``Where(causal & window & padding, 0, fill)``, written as an exporter writes them."""
    g = Graph("masked")
    ids = g.input("ids", ["b", "s"], "int64")
    pad = g.input("attention_mask", ["b", "p+s" if cache else "s"], "bool")
    q = g.input("q", ["b", HEADS, "s", D])
    k, v = g.input("k", ["b", KV_HEADS, "s", D]).name, g.input("v", ["b", KV_HEADS, "s", D]).name
    total = "p+s" if cache else "s"
    add = lambda op, ins, name: g.add_node(op, ins, name).name  # noqa: E731
    if cache:  # a KV cache: past ++ new
        k = add(Concat(2), [g.input("past_k", ["b", KV_HEADS, "p", D]), k], "present_k")
        v = add(Concat(2), [g.input("past_v", ["b", KV_HEADS, "p", D]), v], "present_v")
    k, v = (add(Repeat(1, HEADS // KV_HEADS), [x], f"{x}_repeated") for x in (k, v))  # repeat_kv
    const = lambda name, value: g.add_initializer(name, np.asarray(value)).name  # noqa: E731
    key_pos = add(Reshape((1, 1, 1, total)), [add(Positions(1), [pad], "kpos")], "kpos4")
    query_pos = add(Positions(1), [ids], "qpos")
    if cache:
        query_pos = add(Binary("add"), [query_pos, add(ShapeValues(("p",), scalar=True), [], "past_len")], "qpos_past")
    query_pos = add(Reshape((1, 1, "s", 1)), [query_pos], "qpos4")
    false, true = const("false", False), const("true", True)
    keep = add(Compare("greater_equal" if flipped else "less_equal"), [query_pos, key_pos] if flipped else [key_pos, query_pos], "causal")
    keep = add(Where(), [true, keep, false], "and_true")  # transformers starts from an all-True mask
    if window is not None:
        lower_edge = add(Binary("sub"), [query_pos, const("window", np.int64(window))], "lower_edge")
        keep = add(Where(), [keep, add(Compare("greater"), [key_pos, lower_edge], "in_window"), false], "and_window")
    keep = add(Where(), [keep, add(Reshape(("b", 1, 1, total)), [pad], "pad4"), false], "and_pad")
    bias = add(Where(), [keep, const("zero", np.float32(0)), const("fill", np.float32(fill))], "bias")
    if expanded:  # optimum's files expand the mask to the scores' shape before the add
        bias = add(BroadcastTo(("b", HEADS, "s", total)), [bias], "bias_expanded")
    if scale_after:  # (q k^T + mask) * scale: the scale acts on the mask too
        s = add(Einsum("bhqd,bhkd->bhqk"), [q, k], "scores")
        p = add(Softmax(-1), [add(Scale(D**-0.5), [add(Binary("add"), [s, bias], "masked")], "scaled")], "probs")
    else:
        s = add(Einsum("bhqd,bhkd->bhqk"), [add(Scale(D**-0.5), [q], "q_scaled"), k], "scores")
        p = add(Softmax(-1), [add(Binary("add"), [s, bias], "masked")], "probs")
    g.output(add(Einsum("bhqk,bhkd->bhqd"), [p, v], "out"))
    return g


def _feeds(g, seq, past, pad, seed):
    feeds = random_inputs(g, seed=seed, b=2, s=seq, p=past)
    mask = np.ones((2, past + seq), bool)
    mask[0, :pad] = False
    feeds["attention_mask"] = mask
    return feeds


@pytest.mark.parametrize("flipped", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("cache", [False, True])
def test_transformers_mask_becomes_one_causal_attention_with_a_padding_mask(cache, window, flipped):
    g = _masked_attention(window=window, cache=cache, flipped=flipped)
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert len(attention) == 1
    op = attention[0]
    assert (op.visibility, op.kv_cache) == (Visibility.causal("p" if cache else 0, window, mask="bool", empty_rows="mean"), cache)
    for seq, past, pad in ((5, 3, 0), (6, 2, 4), (1, 7, 7)):
        if not cache and past:
            past = 0
        feeds = _feeds(g, seq, past, pad, seed=seq)
        want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
        backends = [("numpy", {}), ("ort-cpu", {"attention": "decomposed"})] + ([("ort-cpu", {"attention": "chunked"})] if window is None else [])
        if not unavailable_reason("torch"):
            backends.append(("torch", {}))
        for backend, options in backends:
            got = run(optimized, feeds, backend, **options)["out"]
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=f"{backend} {options} at {seq, past, pad}")


@settings(max_examples=20, deadline=None)
@given(seq=st.integers(1, 12), pad=st.integers(0, 12), window=st.sampled_from([None, 1, 2, 5]), seed=st.integers(0, 50))
def test_padded_rows_match_the_graph_as_written(seq, pad, window, seed):
    """Rows whose every key is padding average V over all keys, as the finfo.min fill makes the written graph do."""
    g = _masked_attention(window=window)
    optimized = optimize(g).graph
    feeds = _feeds(g, seq, 0, min(pad, seq), seed)
    want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
    np.testing.assert_allclose(run(optimized, feeds)["out"], want, rtol=2e-4, atol=2e-5)


def test_an_infinite_fill_keeps_zero_rows_and_a_small_fill_is_left_alone():
    op = next(n.op for n in lower(optimize(_masked_attention(fill=-np.inf)).graph, KEEP_ALL).nodes.values() if n.op.kind == "Attention")
    assert (op.visibility.causal_offset, op.visibility.empty_rows) == (0, "zero")
    small = lower(optimize(_masked_attention(fill=-1e4)).graph, KEEP_ALL)  # -1e4 does not swamp every score: not a mask
    op = next(n.op for n in small.nodes.values() if n.op.kind == "Attention")
    assert (op.visibility.causal_offset, op.mask) == (None, "additive")


def _attention_ops(g):
    from graphc.attention_op import Attention

    kept = lower(optimize(g).graph, KEEP_ALL)
    return [(n.op.visibility.causal_offset, n.op.visibility.window, n.op.mask) for n in kept.nodes.values() if isinstance(n.op, Attention)]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cache", [False, True])
def test_graphc_export_reimports_as_the_same_causal_attention(window, cache, tmp_path):
    """graphc's exported mask (``Where(j > i + offset or before the window, -inf, 0)`` over ``Range`` positions, symbolic
    sizes) reads back as the causal ``Attention`` it came from, and the round trip computes the same numbers."""
    from graphc import gqa
    from graphc.attention.builders import attention_layer_graph, kv_cache_graph
    from graphc.onnx_import import from_onnx
    from lowering import export

    cfg = gqa(32, 4, 2, causal=True, sliding_window=window)
    g = kv_cache_graph(cfg) if cache else attention_layer_graph(cfg)
    export(optimize(g).graph, tmp_path / "layer.onnx")
    back = from_onnx(tmp_path / "layer.onnx")
    assert _attention_ops(back) == _attention_ops(g) and len(_attention_ops(g)) == 1
    inputs = random_inputs(g, 0, batch=2, seq=6, past_seq=9)
    want, got = run(g, inputs), run(optimize(back).graph, dict(zip(back.inputs, (inputs[n] for n in g.inputs))))
    for a, b in zip(g.outputs, back.outputs):
        np.testing.assert_allclose(got[b], want[a], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fill", [MIN32, -np.inf])
@pytest.mark.parametrize("window", [None, 3])
def test_a_scale_after_the_mask_is_read_as_the_attention_scale(fill, window):
    """``softmax((q k^T + mask) * c)``: a positive scale leaves a mask that only hides keys hiding the same keys, so the
    attention is recognised with scale ``c`` and the same causal structure, and computes the graph as written."""
    g = _masked_attention(fill=fill, window=window, scale_after=True)
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert len(attention) == 1
    assert (attention[0].scale, attention[0].visibility.causal_offset, attention[0].visibility.window) == (pytest.approx(D**-0.5), 0, window)
    for seq, pad in ((5, 0), (6, 4)):
        feeds = _feeds(g, seq, 0, pad, seed=seq)
        want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
        np.testing.assert_allclose(run(optimized, feeds)["out"], want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("cache", [False, True])
def test_a_mask_expanded_to_the_scores_shape_is_told_from_the_scores(cache):
    """optimum's files add a mask already expanded to ``[batch, heads, queries, keys]``: both operands of the add are
    score-shaped, and the one that reads as a position mask is the mask."""
    g = _masked_attention(cache=cache, expanded=True)
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert len(attention) == 1 and attention[0].visibility.causal_offset == ("p" if cache else 0)
    feeds = _feeds(g, 5, 3 if cache else 0, 2, seed=1)
    want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
    np.testing.assert_allclose(run(optimized, feeds)["out"], want, rtol=2e-4, atol=2e-5)


def _heads_and_positions(name: str):  # noqa: ANN202 - the graph and its builder shorthands
    """A graph with ``q``/``k``/``v`` of HEADS heads, ``add``/``const`` shorthands, and key and query positions as
    ``[1, 1, 1, S]`` and ``[1, 1, S, 1]``."""
    g = Graph(name)
    q = g.input("q", ["b", HEADS, "s", D])
    k, v = g.input("k", ["b", HEADS, "s", D]).name, g.input("v", ["b", HEADS, "s", D]).name
    add = lambda op, ins, out: g.add_node(op, ins, out).name  # noqa: E731
    const = lambda out, value: g.add_initializer(out, np.asarray(value)).name  # noqa: E731
    key_pos = add(Reshape((1, 1, 1, "s")), [add(Positions(2), [k], "kpos")], "kpos4")
    query_pos = add(Reshape((1, 1, "s", 1)), [add(Positions(2), [q], "qpos")], "qpos4")
    return g, q, k, v, add, const, key_pos, query_pos


@pytest.mark.parametrize("alibi_last", [False, True])
def test_an_alibi_bias_and_a_causal_mask_are_one_attention(alibi_last):
    """ALiBi models add a per-head bias ``slope[h] * j`` and the causal mask, in either order: the position mask gives
    the causal offset and the bias stays the op's additive mask."""
    g, q, k, v, add, const, key_pos, query_pos = _heads_and_positions("alibi")
    keep = add(Compare("less_equal"), [key_pos, query_pos], "causal")
    causal = add(Where(), [keep, const("zero", np.float32(0)), const("fill", np.float32(-np.inf))], "causal_bias")
    slopes = const("slopes", (2.0 ** -np.arange(1, HEADS + 1, dtype=np.float32)).reshape(1, HEADS, 1, 1))
    alibi = add(Binary("mul"), [slopes, add(Cast("float32"), [key_pos], "kpos_f")], "alibi")
    s = add(Einsum("bhqd,bhkd->bhqk"), [add(Scale(D**-0.5), [q], "q_scaled"), k], "scores")
    first, second = (causal, alibi) if alibi_last else (alibi, causal)
    masked = add(Binary("add"), [add(Binary("add"), [s, first], "masked1"), second], "masked2")
    g.output(add(Einsum("bhqk,bhkd->bhqd"), [add(Softmax(-1), [masked], "probs"), v], "out"))
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert len(attention) == 1 and (attention[0].visibility.causal_offset, attention[0].mask) == (0, "additive")
    feeds = random_inputs(g, seed=3, b=2, s=6)
    want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
    np.testing.assert_allclose(run(optimized, feeds)["out"], want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("fill", [-np.inf, MIN32])
@pytest.mark.parametrize("padding", [False, True])
def test_a_masked_fill_of_the_scores_is_one_causal_attention(fill, padding):
    """MPT writes ``scores.masked_fill(hide, finfo.min)``, ``Where(hide, fill, s)`` with ``hide`` the keys after the
    query (and, with a padding mask, the padded ones): one ``Attention`` with its causal offset, the numbers of the
    graph as written (a row whose keys are all padding averages V over every key under a finite fill)."""
    g, q, k, v, add, const, key_pos, query_pos = _heads_and_positions("masked_fill")
    hide = add(Compare("greater"), [key_pos, query_pos], "future")
    if padding:
        pad = g.input("attention_mask", ["b", "s"], "bool")
        padded = add(Where(), [add(Reshape(("b", 1, 1, "s")), [pad], "pad4"), const("false", False), const("true", True)], "padded")
        hide = add(Where(), [hide, const("true2", True), padded], "hidden")  # future or padded
    s = add(Einsum("bhqd,bhkd->bhqk"), [add(Scale(D**-0.5), [q], "q_scaled"), k], "scores")
    masked = add(Where(), [hide, const("fill", np.float32(fill)), s], "masked")
    g.output(add(Einsum("bhqk,bhkd->bhqd"), [add(Softmax(-1), [masked], "probs"), v], "out"))
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert len(attention) == 1 and attention[0].visibility.causal_offset == 0
    assert attention[0].mask == ("bool" if padding else "none")
    feeds = random_inputs(g, seed=4, b=2, s=6)
    if padding:
        feeds["attention_mask"] = np.array([[False] * 6, [False, False] + [True] * 4])  # row 0: every key padding
    want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(optimized, feeds, backend)["out"], want, rtol=2e-4, atol=2e-5, err_msg=backend)


def test_a_bias_on_the_flat_heads_scores_beside_a_masked_fill_is_one_attention():
    """optimum's Bloom: the ALiBi bias is added to the ``[batch*heads, S, T]`` scores (``baddbmm``), which are then viewed
    as ``[batch, heads, S, T]`` and masked with ``masked_fill(hide, finfo.min)``, ``hide`` a mask graphc cannot read
    positions from (optimum writes it with a ScatterND): the bias is followed through the view and added to the mask,
    one ``Attention`` equal to the graph as written."""
    g, q, k, v, add, const, key_pos, query_pos = _heads_and_positions("flat_bias")
    flat = f"{HEADS}*b"
    hide = g.input("hide", ["b", 1, "s", "s"], "bool").name
    slopes = const("slopes", (2.0 ** -np.arange(1, HEADS + 1, dtype=np.float32)).reshape(1, HEADS, 1, 1))
    alibi = add(Binary("mul"), [slopes, add(Cast("float32"), [key_pos], "kpos_f")], "alibi")
    bias = add(Reshape((flat, 1, "s")), [add(BroadcastTo(("b", HEADS, 1, "s")), [alibi], "alibi_b")], "alibi_flat")
    q3, k3 = (add(Reshape((flat, "s", D)), [x], f"{x}_flat") for x in (add(Scale(D**-0.5), [q], "q_scaled"), k))
    s = add(Reshape(("b", HEADS, "s", "s")), [add(Binary("add"), [add(Einsum("nqd,nkd->nqk"), [q3, k3], "scores"), bias], "biased")], "scores4")
    masked = add(Where(), [hide, const("fill", np.float32(MIN32)), s], "masked")
    probs = add(Reshape((flat, "s", "s")), [add(Softmax(-1), [masked], "probs")], "probs_flat")
    out = add(Einsum("nqk,nkd->nqd"), [probs, add(Reshape((flat, "s", D)), [v], "v_flat")], "out_flat")
    g.output(add(Reshape(("b", HEADS, "s", D)), [out], "out"))
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert len(attention) == 1 and attention[0].mask == "additive", attention
    feeds = random_inputs(g, seed=5, b=2, s=6)
    padding = np.array([[True] * 6, [True, True] + [False] * 4])  # row 0: every key padding
    feeds["hide"] = (np.triu(np.ones((6, 6), bool), 1) | padding[:, None, None, :]).reshape(2, 1, 6, 6)
    want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(optimized, feeds, backend)["out"], want, rtol=2e-4, atol=2e-5, err_msg=backend)


@pytest.mark.parametrize("pad", [0, 2, 9])
def test_the_converter_mask_of_transformers_4_is_causal_at_the_past_offset(pad):
    """transformers 4.x's ``AttentionMaskConverter`` (MPT's optimum file): a triangle over the new keys after a block of
    zeros for the past (``Concat``), ``masked_fill``ed by the inverted padding (``Where(Cast(inverted, bool), fill, c)``),
    then ``.bool()`` and a masked fill of the scores plus an ALiBi bias.  One causal ``Attention`` at the past's offset
    with its cache, equal to the graph as written (``pad=9``: row 0 sees no key at all)."""
    g = Graph("converter")
    ids = g.input("ids", ["b", "s"], "int64")
    att = g.input("attention_mask", ["b", "p+s"], "int64")
    q, k, v = (g.input(n, ["b", HEADS, "s", D]).name for n in "qkv")
    add = lambda op, ins, name: g.add_node(op, ins, name).name  # noqa: E731
    const = lambda name, value: g.add_initializer(name, np.asarray(value)).name  # noqa: E731
    fill, zero = const("fill", np.float32(MIN32)), const("zero", np.float32(0))
    k = add(Concat(2), [g.input("past_k", ["b", HEADS, "p", D]), k], "present_k")
    v = add(Concat(2), [g.input("past_v", ["b", HEADS, "p", D]), v], "present_v")
    rows = add(Positions(1), [ids], "rows")  # the triangle over the new keys: j < i + 1 visible
    upto = add(Reshape(("s", 1)), [add(Binary("add"), [rows, const("one", np.int64(1))], "rows_1")], "rows_col")
    triangle = add(Where(), [add(Compare("less"), [rows, upto], "below"), zero, fill], "triangle")
    past_block = add(BroadcastTo(("s", "p")), [const("past_zero", np.float32(0))], "past_block")
    causal = add(Reshape((1, 1, "s", "p+s")), [add(Concat(1), [past_block, triangle], "causal2d")], "causal")
    expanded = add(Cast("float32"), [add(BroadcastTo(("b", 1, "s", "p+s")), [add(Reshape(("b", 1, 1, "p+s")), [att], "att4")], "att_x")], "att_f")
    inverted = add(Binary("sub"), [const("one_f", np.float32(1)), expanded], "inverted")
    padding = add(Where(), [add(Cast("bool"), [inverted], "inverted_b"), fill, inverted], "padding")
    mask = add(Where(), [add(Cast("bool"), [padding], "padded"), fill, causal], "mask")
    hide = add(Cast("bool"), [mask], "hide")
    slopes = const("slopes", (2.0 ** -np.arange(1, HEADS + 1, dtype=np.float32)).reshape(1, HEADS, 1, 1))
    key_pos = add(Cast("float32"), [add(Reshape((1, 1, 1, "p+s")), [add(Positions(1), [att], "kpos")], "kpos4")], "kpos_f")
    s = add(Einsum("bhqd,bhkd->bhqk"), [add(Scale(D**-0.5), [q], "q_scaled"), k], "scores")
    masked = add(Where(), [hide, fill, add(Binary("add"), [s, add(Binary("mul"), [slopes, key_pos], "alibi")], "biased")], "masked")
    g.output(add(Einsum("bhqk,bhkd->bhqd"), [add(Softmax(-1), [masked], "probs"), v], "out"), k, v)
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert [(op.visibility, op.kv_cache) for op in attention] == [(Visibility.causal("p", mask="additive", empty_rows="mean"), True)], attention
    feeds = random_inputs(g, seed=6, b=2, s=5, p=3)
    feeds["attention_mask"] = np.ones((2, 8), np.int64)
    feeds["attention_mask"][0, :pad] = 0
    want = run(g, feeds, reference=True, compute_dtype="float64")
    for backend in ("numpy", "ort-cpu"):
        got = run(optimized, feeds, backend)
        for name in g.outputs:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-5, err_msg=f"{backend} {name}")


def test_a_finite_fill_over_a_bool_of_an_infinite_mask_gives_padded_rows_the_mean():
    """``Where(Cast(m, bool), finfo.min, 0)`` with ``m = Where(causal & padding, 0, -inf)``: the keys ``m`` hides, filled
    with a finite number, so a row of padding is uniform (the mean of V), not the zeros ``m``'s own ``-inf`` would give."""
    from graphc.optimizer.masks import split_additive_mask

    g, q, k, v, add, const, key_pos, query_pos = _heads_and_positions("cast_of_inf")
    pad = g.input("attention_mask", ["b", "s"], "bool")
    keep = add(
        Where(),
        [add(Compare("less_equal"), [key_pos, query_pos], "causal"), add(Reshape(("b", 1, 1, "s")), [pad], "pad4"), const("false", False)],
        "keep",
    )
    inner = add(Where(), [keep, const("zero", np.float32(0)), const("neg_inf", np.float32(-np.inf))], "inner")
    mask = add(Where(), [add(Cast("bool"), [inner], "hidden"), const("fill", np.float32(MIN32)), const("zero2", np.float32(0))], "mask")
    split = split_additive_mask(g, mask)
    assert split is not None and (split.visibility.causal_offset, split.visibility.empty_rows) == (0, "mean"), split
    s = add(Einsum("bhqd,bhkd->bhqk"), [add(Scale(D**-0.5), [q], "q_scaled"), k], "scores")
    g.output(add(Einsum("bhqk,bhkd->bhqd"), [add(Softmax(-1), [add(Binary("add"), [s, mask], "masked")], "probs"), v], "out"))
    optimized = optimize(g).graph
    feeds = random_inputs(g, seed=7, b=2, s=6)
    feeds["attention_mask"] = np.array([[False] * 3 + [True] * 3, [True] * 6])  # row 0: its first 3 queries see no key
    want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(optimized, feeds, backend)["out"], want, rtol=2e-4, atol=2e-5, err_msg=backend)


@pytest.mark.parametrize("spelling", ["additive", "bool"])
@pytest.mark.parametrize("cache", [False, True])
def test_an_index_grid_causal_mask_without_an_attention_mask_is_a_causal_offset(spelling, cache):
    """A decoder's causal mask written without an ``attention_mask`` input (dynamo's BART and Whisper decoders):
    ``arange(keys)[None] <= arange(queries)[:, None] + past`` expanded to ``[b, 1, s, keys]``, added as ``Where(keep, 0,
    finfo.min)`` or applied as ``Where(keep, scores, finfo.min)``.  It is read as the causal offset (the cache taken in),
    not as a bool mask, and gives the graph's numbers."""
    g = Graph("grid")
    add = lambda op, ins, name: g.add_node(op, ins, name).name  # noqa: E731
    ids = g.input("ids", ["b", "s"], "int64")
    q = g.input("q", ["b", HEADS, "s", D])
    k, v = g.input("k", ["b", KV_HEADS, "s", D]).name, g.input("v", ["b", KV_HEADS, "s", D]).name
    total = "p+s" if cache else "s"
    if cache:
        k = add(Concat(2), [g.input("past_k", ["b", KV_HEADS, "p", D]), k], "present_k")
        v = add(Concat(2), [g.input("past_v", ["b", KV_HEADS, "p", D]), v], "present_v")
    k, v = (add(Repeat(1, HEADS // KV_HEADS), [x], f"{x}_repeated") for x in (k, v))
    const = lambda name, value: g.add_initializer(name, np.asarray(value)).name  # noqa: E731
    key_pos = add(Reshape((1, 1, 1, total)), [add(Arange(0, total), [], "kpos")], "kpos4")
    query_pos = add(Positions(1), [ids], "qpos")
    if cache:
        query_pos = add(Binary("add"), [query_pos, add(ShapeValues(("p",), scalar=True), [], "past_len")], "qpos_past")
    keep = add(Compare("less_equal"), [key_pos, add(Reshape((1, 1, "s", 1)), [query_pos], "qpos4")], "causal")
    keep = add(BroadcastTo(("b", 1, "s", total)), [keep], "causal_expanded")
    scores = add(Einsum("bhqd,bhkd->bhqk"), [add(Scale(D**-0.5), [q], "q_scaled"), k], "scores")
    fill = const("fill", np.float32(MIN32))
    if spelling == "additive":
        masked = add(Binary("add"), [scores, add(Where(), [keep, const("zero", np.float32(0)), fill], "mask")], "masked")
    else:
        masked = add(Where(), [keep, scores, fill], "masked")
    g.output(add(Einsum("bhqk,bhkd->bhqd"), [add(Softmax(-1), [masked], "probs"), v], "out"))
    optimized = optimize(g).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).nodes.values() if n.op.kind == "Attention"]
    assert [(op.visibility, op.kv_cache) for op in attention] == [(Visibility.causal("p" if cache else 0), cache)], attention
    for seq, past in ((5, 3), (1, 6)):
        feeds = random_inputs(g, seed=seq, b=2, s=seq, p=past if cache else 0)
        want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
        for backend, options in (("numpy", {}), ("ort-cpu", {"attention": "auto"})):
            np.testing.assert_allclose(run(optimized, feeds, backend, **options)["out"], want, rtol=2e-4, atol=2e-5, err_msg=f"{backend} {seq, past}")


def test_a_bias_as_large_as_the_scores_is_the_additive_mask():
    """T5 adds one tensor, its relative-position bias with the padding in it, to unscaled scores: both addends are
    score-shaped, and the scores are the one a QK^T einsum makes.  One attention whose additive mask is that tensor."""
    g = Graph("t5")
    add = lambda op, ins, name: g.add_node(op, ins, name).name  # noqa: E731
    q, k, v = g.input("q", ["b", HEADS, "s", D]), g.input("k", ["b", HEADS, "s", D]), g.input("v", ["b", HEADS, "s", D])
    table = g.add_initializer("relative_bias", np.random.default_rng(0).standard_normal((1, HEADS, 64, 64)).astype(np.float32)).name
    pad = g.input("pad", ["b", 1, 1, "s"])  # 0 or finfo.min, as T5's extended attention mask
    bias = add(Binary("add"), [add(Slice(3, 0, "s"), [add(Slice(2, 0, "s"), [table], "rows")], "bias"), pad], "position_bias")
    position_bias = add(BroadcastTo(("b", HEADS, "s", "s")), [bias], "position_bias_full")
    scores = add(Einsum("bhqd,bhkd->bhqk"), [q, k], "scores")
    g.output(add(Einsum("bhqk,bhkd->bhqd"), [add(Softmax(-1), [add(Binary("add"), [scores, position_bias], "biased")], "probs"), v], "out"))
    optimized = optimize(g).graph
    kept = lower(optimized, KEEP_ALL)
    attention = [n.op for n in kept.nodes.values() if n.op.kind == "Attention"]
    assert [op.visibility for op in attention] == [Visibility(mask="additive")] and unfused_softmaxes(kept, lowered=True) == []
    feeds = random_inputs(g, seed=1, b=2, s=5)
    feeds["pad"] = np.where(np.arange(5) < 2, np.float32(MIN32), np.float32(0)) * np.array([1, 0], np.float32)[:, None, None, None]
    want = run(g, feeds, reference=True, compute_dtype="float64")["out"]
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(optimized, feeds, backend)["out"], want, rtol=2e-4, atol=2e-5, err_msg=backend)
