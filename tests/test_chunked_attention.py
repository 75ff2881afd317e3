"""Causal attention exported as query chunks: user masks per key and per query row give the op's numbers (rows that see
no key, rows whose visible keys all sit at a finite fill) with no NaN on the way, and what does not depend on the layer
(chunk bounds, the causal bias, the mask's slices) is emitted once for every layer that reads it."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import ref_sdpa

from graphc import Graph, Visibility
from graphc.errors import ExportError
from lowering import export, random_inputs, run

FILL = float(np.finfo(np.float32).min)


def _two_layers(hkv: int, group: int, kind: str, per_row: bool) -> Graph:
    """Two causal attentions over caches, the second reading the first's output as its queries; one mask for both
    (``[b, 1, s, p+s]`` when ``per_row``, else a key mask ``[b, 1, 1, p+s]``; none when ``kind`` is ``"none"``)."""
    g = Graph("two")
    heads = hkv * group
    q = g.input("q", ["b", heads, "s", 8])
    m = None if kind == "none" else g.input("m", ["b", 1, "s" if per_row else 1, "p+s"], "bool" if kind == "bool" else "float32")
    out = q
    for layer, scale in ((1, 0.3), (2, 0.5)):
        k, v = g.input(f"k{layer}", ["b", hkv, "s", 8]), g.input(f"v{layer}", ["b", hkv, "s", 8])
        pk, pv = g.input(f"pk{layer}", ["b", hkv, "p", 8]), g.input(f"pv{layer}", ["b", hkv, "p", 8])
        names = [f"o{layer}", f"pres_k{layer}", f"pres_v{layer}"]
        out, *cache = g.attention(out, k, v, scale, Visibility.causal("p", mask=kind), m, pk, pv, names=names)
        g.output(*cache)
    g.output(out)
    return g


def _reference(feeds: dict[str, np.ndarray], kind: str) -> np.ndarray:
    """The independent float64 reference, layer by layer: causal over the cache, the bool mask (or an additive mask's
    -inf as hidden keys, its other entries added), zeros for a row that sees no key."""
    out, mask = feeds["q"], feeds["m"]
    keep, bias = (mask, None) if kind == "bool" else (~np.isneginf(mask), np.where(np.isneginf(mask), 0.0, mask))
    for layer, scale in ((1, 0.3), (2, 0.5)):
        k = np.concatenate([feeds[f"pk{layer}"], feeds[f"k{layer}"]], 2)
        v = np.concatenate([feeds[f"pv{layer}"], feeds[f"v{layer}"]], 2)
        out = ref_sdpa(out, k, v, causal=True, mask=keep, scale=scale, bias=bias)
    return out


@settings(max_examples=25, deadline=None)
@given(
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    s=st.integers(1, 9),
    past=st.integers(0, 3),
    kind=st.sampled_from(["bool", "additive"]),
    per_row=st.booleans(),
    seed=st.integers(0, 99),
)
def test_chunks_under_a_user_mask_give_the_op_numbers_without_nan(hkv, group, s, past, kind, per_row, seed):
    """Row 0 of batch 0 sees no key (its every visible key masked); with an additive mask, row 1 sees only keys at the
    finite fill (not empty: a softmax over them).  onnxruntime and ONNX's reference evaluator run the chunks with
    warnings as errors (a softmax over a row of -inf would warn), against plain NumPy."""
    g = _two_layers(hkv, group, kind, per_row)
    feeds = random_inputs(g, seed=seed, b=2, s=s, p=past)
    rng = np.random.default_rng(seed)
    shape = feeds["m"].shape
    if kind == "bool":
        mask = rng.random(shape) < 0.7
        mask[0, :, 0, : past + 1] = False  # query 0 sees keys 0..past: all masked
    else:
        mask = np.where(rng.random(shape) < 0.25, -np.inf, rng.normal(size=shape)).astype(np.float32)
        mask[0, :, 0, : past + 1] = -np.inf
        if per_row and s > 1:
            mask[0, :, 1, : past + 2] = FILL  # query 1 sees only keys at the fill
    feeds["m"] = mask
    want = _reference(feeds, kind)
    for backend in ("ort-cpu", "onnx-reference"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = run(g, feeds, backend, attention="chunked")["o2"]
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=backend)


@pytest.mark.parametrize(("kind", "per_row"), [("none", False), ("bool", False), ("bool", True), ("additive", False), ("additive", True)])
def test_what_every_layer_reads_is_emitted_once(kind, per_row):
    """Chunk bounds, causal biases and the mask's chunk biases are one set of nodes for both layers: each layer adds its
    own slices, MatMuls, Adds and Softmaxes only."""
    g = _two_layers(2, 2, kind, per_row)
    model = export(g, attention="chunked")
    outputs = [o for n in model.graph.node for o in n.output]
    assert [n.op_type for n in model.graph.node].count("Softmax") == 2 * 8
    for shared in ("chunk_sizes", "chunk0_causal", "chunk7_hidden", *(() if kind == "none" else ("chunk0_bias", "empty_rows"))):
        assert sum(o == shared or o.startswith(shared + "_") for o in outputs) == 1, shared


def test_chunks_refuse_keys_that_are_not_the_queries_plus_the_offset():
    """The chunk bounds take the past as keys - queries: an offset that is not that is refused, never mis-masked."""
    g = Graph("offset")
    q, k, v = g.input("q", ["b", 2, "s", 8]), g.input("k", ["b", 2, "t", 8]), g.input("v", ["b", 2, "t", 8])
    g.output(g.attention(q, k, v, 0.3, Visibility.causal(0), names=["o"]))
    with pytest.raises(ExportError, match=r"are not the queries \(s\) plus the causal offset"):
        export(g, attention="chunked")


def test_auto_chunks_an_additive_key_mask_of_any_rank():
    """``auto`` chunks a causal prefill under an additive key mask, a 1-D ``[T]`` one included, and the chunks give the
    reference's numbers."""
    g = Graph("key_bias")
    q, k, v = (g.input(n, [1, 4, "s", 8]) for n in "qkv")
    m = g.input("m", ["s"])
    g.output(g.attention(q, k, v, 0.3, Visibility.causal(0, mask="additive"), m, names=["o"]))
    model = export(g, attention="auto", sizes={"s": 512})
    assert [n.op_type for n in model.graph.node].count("Softmax") == 8
    feeds = random_inputs(g, seed=4, s=70)
    want = ref_sdpa(feeds["q"], feeds["k"], feeds["v"], causal=True, scale=0.3, bias=feeds["m"].reshape(1, 1, 1, 70))
    np.testing.assert_allclose(run(g, feeds, "ort-cpu", attention="auto", sizes={"s": 512})["o"], want, rtol=2e-4, atol=2e-5)
