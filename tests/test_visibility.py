"""``Visibility``: what a query may see, as one value.

Its reference (``hidden``) against loops written here; its key ranges, bounds and conjunction against that reference;
and one hypothesis test that draws visibilities and checks the ``Attention`` op on every backend, and every ONNX form
that claims the features it uses, against ``Visibility.hidden`` (a form that does not claim them must refuse, never
compute something else).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import INSTALLED
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc import Graph, KeyBound, Visibility, VisibilityError
from graphc.errors import BackendUnavailableError, ExportError, OpError
from graphc.numerics import safe_softmax
from lowering import run
from lowering.exporter.forms import FORMS, attention_features

MODES = {"decomposed": None, "onnx-attention": "OnnxAttention", "ort-gqa": "OrtGroupQueryAttention", "chunked": "ChunkedCausalAttention"}
"""Each ONNX attention mode and the form it writes (``None``: grouped MatMuls, which carry every feature)."""


def _hidden_by_loops(vis: Visibility, rows: int, keys: int, mask: np.ndarray | None = None) -> np.ndarray:
    """What ``vis`` hides, one (query, key) pair at a time: the definition in the module doc of graphc.visibility."""
    out = np.zeros((rows, keys), bool)
    for i in range(rows):
        for j in range(keys):
            if vis.causal_offset is not None:
                last = i + int(vis.causal_offset)
                out[i, j] = j > last or (vis.window is not None and j <= last - vis.window)
    if mask is None:
        return out
    return out | (~mask if vis.mask == "bool" else np.isneginf(mask))


offsets = st.one_of(st.none(), st.integers(-4, 6))


@st.composite
def visibilities(draw: st.DrawFn, masks: tuple[str, ...] = ("none", "bool", "additive")) -> Visibility:
    offset = draw(offsets)
    window = draw(st.one_of(st.none(), st.integers(1, 5))) if offset is not None else None
    return Visibility(offset, window, draw(st.sampled_from(masks)), draw(st.sampled_from(("zero", "mean"))))


@settings(max_examples=60, deadline=None)
@given(vis=visibilities(("none",)), rows=st.integers(0, 7), keys=st.integers(0, 9))
def test_hidden_is_the_definition(vis, rows, keys):
    np.testing.assert_array_equal(vis.hidden(rows, keys), _hidden_by_loops(vis, rows, keys))
    lo, hi = vis.key_ranges(rows, keys)
    j = np.arange(keys)
    np.testing.assert_array_equal((j[None] < lo[:, None]) | (j[None] >= hi[:, None]), _hidden_by_loops(vis, rows, keys))


@settings(max_examples=40, deadline=None)
@given(vis=visibilities(("none",)), rows=st.integers(1, 7), keys=st.integers(1, 9), r0=st.integers(0, 6), k0=st.integers(0, 8))
def test_a_block_of_rows_and_keys_is_the_same_block_of_the_whole(vis, rows, keys, r0, k0):
    """A kernel asks for one block (rows r0.., keys k0..): it is that block of the whole grid."""
    r0, k0 = min(r0, rows - 1), min(k0, keys - 1)
    whole = vis.hidden(rows, keys)
    np.testing.assert_array_equal(vis.hidden(range(r0, rows), range(k0, keys)), whole[r0:, k0:])
    lo, hi = vis.key_span(range(r0, rows), keys)
    seen = np.flatnonzero(~whole[r0:].all(axis=0))
    assert seen.size == 0 or (lo <= seen.min() and seen.max() < hi)


@settings(max_examples=60, deadline=None)
@given(a=visibilities(("none", "bool")), b=visibilities(("none", "bool")), rows=st.integers(1, 6), keys=st.integers(1, 8))
def test_conjunction_hides_what_either_hides(a, b, rows, keys):
    a, b = Visibility(a.causal_offset, a.window, a.mask, "zero"), Visibility(b.causal_offset, b.window, b.mask, "zero")
    try:
        both = a & b
    except VisibilityError:  # a window and a causal bound that together keep no key: no one value says that
        assert (a.hidden(rows + 20, keys + 20) | b.hidden(rows + 20, keys + 20)).all()
        return
    np.testing.assert_array_equal(both.hidden(rows, keys), a.hidden(rows, keys) | b.hidden(rows, keys))
    assert both.mask == ("bool" if "bool" in (a.mask, b.mask) else "none")


def test_conjunction_refuses_what_no_one_value_holds():
    with pytest.raises(VisibilityError, match="mean of V"):
        _ = Visibility(mask="bool", empty_rows="mean") & Visibility.causal(0)
    with pytest.raises(VisibilityError, match="order is not known"):
        _ = Visibility.causal("p") & Visibility.causal("q")
    assert Visibility.causal(2) & Visibility() == Visibility.causal(2)
    assert (Visibility.causal(0, mask="bool") & Visibility(mask="additive")).mask == "additive"


def test_bounds_round_trip_and_refuse_what_has_no_form():
    for vis in (Visibility.causal(3), Visibility.causal("p", 4), Visibility.causal(-2, 1)):
        assert Visibility.from_bounds(vis.bounds()) == vis
    assert Visibility.from_bounds([KeyBound(False, 0)]) is None  # a lower edge alone is no causal mask
    assert Visibility.from_bounds([KeyBound(True, 0), KeyBound(False, 2)]) is None  # a window that keeps no key
    assert KeyBound(True, 3).complement() == KeyBound(False, 4)


def test_malformed_values_say_what_was_expected():
    for kwargs, message in (
        ({"window": 3}, "needs a causal mask"),
        ({"causal_offset": 0, "window": 0}, "window must be an int >= 1"),
        ({"mask": "float"}, "mask must be one of"),
        ({"empty_rows": "nan"}, "empty_rows must be one of"),
        ({"causal_offset": 1.5}, "causal_offset must be"),
    ):
        with pytest.raises(OpError, match=message):
            Visibility(**kwargs)


def _reference(q, k, v, vis, mask, scale):  # noqa: ANN001, ANN202 - the op by the textbook formula, over Visibility.hidden
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, 1).astype(np.float64), np.repeat(v, group, 1).astype(np.float64)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kr) * scale
    hidden = np.broadcast_to(vis.hidden(s.shape[2], s.shape[3], mask=mask), s.shape)
    if vis.mask == "additive":
        s = s + mask
    out = np.einsum("bhqk,bhkd->bhqd", safe_softmax(np.where(hidden, -np.inf, s), -1), vr)
    if vis.empty_rows == "mean":
        out = np.where(hidden.all(-1, keepdims=True), vr.mean(2, keepdims=True), out)
    return out


@st.composite
def attention_cases(draw: st.DrawFn) -> tuple:
    cache = draw(st.booleans())
    past, seq = (draw(st.integers(1, 4)) if cache else 0), draw(st.integers(1, 4))
    offset = draw(st.sampled_from(["p", "shifted"] if cache else [0, "shifted", None]))
    offset = draw(st.integers(-3, 5)) if offset == "shifted" else offset
    window = draw(st.one_of(st.none(), st.integers(1, 4))) if offset is not None else None
    vis = Visibility(offset, window, draw(st.sampled_from(("none", "bool", "additive"))), draw(st.sampled_from(("zero", "mean"))))
    per_row, seed = draw(st.booleans()), draw(st.integers(0, 2**16))
    return vis, cache, past, seq, per_row, seed


def _graph(vis: Visibility, cache: bool, per_row: bool) -> Graph:
    g = Graph("visibility")
    keys = "p+s" if cache else "s"
    q = g.input("q", ["b", 4, "s", 8])
    k, v = g.input("k", ["b", 2, "s", 8]), g.input("v", ["b", 2, "s", 8])
    mask = None
    if vis.has_mask:
        mask = g.input("m", ["b", 1, "s" if per_row else 1, keys], "bool" if vis.mask == "bool" else "float32")
    past = (g.input("pk", ["b", 2, "p", 8]), g.input("pv", ["b", 2, "p", 8])) if cache else (None, None)
    out = g.attention(q, k, v, 0.35, vis, mask, *past, names=["o", "pres_k", "pres_v"] if cache else ["o"])
    g.output(*(out if isinstance(out, tuple) else (out,)))
    return g


def _feeds(vis: Visibility, g: Graph, past: int, seq: int, per_row: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal([int({"b": 2, "s": seq, "p": past}.get(str(d), d)) for d in g.types[n].shape]).astype(np.float32)
             for n in g.inputs if n != "m"}  # fmt: skip
    if vis.has_mask:
        keep = rng.random((2, 1, seq if per_row else 1, past + seq)) < 0.7
        feeds["m"] = keep if vis.mask == "bool" else np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(np.float32)
    return feeds


def _refused_a_claimed_feature(form_name: str | None, g: Graph, message: str) -> bool:
    """Whether the form ``form_name`` refused by a feature although it claims every feature the graph's attention uses
    (a refusal for shapes, the opset or onnxruntime's limits is the form's to make)."""
    if form_name is None:
        return True
    form = next(f for f in FORMS if f.__name__ == form_name)
    claims = form.NEEDS <= attention_features(g, g.nodes["o"]) <= form.SUPPORTS
    return claims and (f"{form.NAME} cannot carry" in message or f"{form.NAME} needs" in message)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inside the ONNX evaluator, before the NaN guard
@settings(max_examples=25, deadline=None)
@given(case=attention_cases())
def test_every_backend_and_every_form_that_claims_the_features_sees_what_visibility_hides(case):
    vis, cache, past, seq, per_row, seed = case
    g = _graph(vis, cache, per_row)
    feeds = _feeds(vis, g, past, seq, per_row, seed)
    k = np.concatenate([feeds["pk"], feeds["k"]], 2) if cache else feeds["k"]
    v = np.concatenate([feeds["pv"], feeds["v"]], 2) if cache else feeds["v"]
    offset_dims = {"p": past}
    want = _reference(feeds["q"], k, v, vis.at(offset_dims), feeds.get("m"), 0.35)
    for backend in INSTALLED:
        for mode, form in MODES.items() if backend in ("ort-cpu", "onnx-reference") else [(None, None)]:
            options = {"attention": mode} if mode else {}
            try:
                got = run(g, feeds, backend, **options)["o"]
            except BackendUnavailableError:
                continue  # the ONNX evaluator has no GroupQueryAttention
            except ExportError as e:
                assert not _refused_a_claimed_feature(form, g, str(e)), (backend, mode, str(e))
                continue
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=f"{backend} {mode} {vis.describe()} {case}")
