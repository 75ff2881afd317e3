"""Large GEMMs cut into blocks for graphc's threads (column blocks of a 2-D product, batch entries of a batched one) give
NumPy's own product, and the NumPy backend's thread count reaches BLAS."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphc
from graphc.einsum_spec import parse_einsum
from lowering import prepare
from lowering.kernels import contraction
from lowering.kernels.contraction import contract
from lowering.kernels.softmax import _blas_controller, blas_threads

pytestmark = pytest.mark.core


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 70), inner=st.integers(1, 40), cols=st.integers(1, 1200), batch=st.integers(0, 3), threads=st.sampled_from([2, 3]))
def test_blocked_products_equal_numpys(rows, inner, cols, batch, threads):
    saved = contraction.BLOCKED_MIN_FLOPS, os.environ.get("GRAPHC_ADAPTIVE_THREADS")
    contraction.BLOCKED_MIN_FLOPS = 1  # every product large enough to be cut
    os.environ["GRAPHC_ADAPTIVE_THREADS"] = "0"  # and cut on every call (not run whole where one thread was faster)
    try:
        rng = np.random.default_rng(rows * 1000 + cols)
        lead = (batch,) if batch else ()
        a = rng.standard_normal((*lead, rows, inner)).astype(np.float32)
        b = rng.standard_normal((*lead, cols, inner)).astype(np.float32)  # a weight as stored: [out, in]
        spec = "zmk,znk->zmn" if batch else "mk,nk->mn"
        got = contract(parse_einsum(spec), a, b, threads=threads)
        np.testing.assert_allclose(got, np.einsum(spec, a.astype(np.float64), b.astype(np.float64)), rtol=1e-4, atol=1e-4)
    finally:
        contraction.BLOCKED_MIN_FLOPS = saved[0]
        if saved[1] is None:
            os.environ.pop("GRAPHC_ADAPTIVE_THREADS")
        else:
            os.environ["GRAPHC_ADAPTIVE_THREADS"] = saved[1]


def test_blas_threads_holds_blas_to_the_count_asked_for():
    with blas_threads(1):
        assert {i["num_threads"] for i in _blas_controller().info() if i["user_api"] == "blas"} == {1}
    with blas_threads(None):  # nothing changed
        pass


def test_a_prefill_with_blocked_products_equals_the_reference():
    """A layer whose projections pass the blocking threshold, on 2 threads, against the float64 reference."""
    g = graphc.attention_layer_graph(graphc.gqa(512, 8, 2), seed=0)
    x = np.random.default_rng(1).standard_normal((1, 96, 512)).astype(np.float32)
    got = prepare(g, "numpy", threads=2).run({"x_BSM": x})["out_BSM"]
    want = prepare(g, "numpy", compute_dtype="float64", reference=True).run({"x_BSM": x})["out_BSM"]
    assert 96 * 512 * 512 >= contraction.BLOCKED_MIN_FLOPS  # the q and o projections are cut into blocks
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_products_that_sum_no_label_equal_numpys_einsum(data):
    """A norm's weight (``abc,c->abc``), a row's scale (``ab,abc->abc``), an outer product: one broadcast multiply."""
    labels = data.draw(st.permutations("abcd"))
    a_labels = "".join(data.draw(st.lists(st.sampled_from(labels), min_size=1, max_size=3, unique=True)))
    b_labels = "".join(data.draw(st.lists(st.sampled_from(labels), min_size=1, max_size=3, unique=True)))
    out = "".join(data.draw(st.permutations(sorted(set(a_labels) | set(b_labels)))))
    sizes = dict(zip("abcd", data.draw(st.lists(st.integers(1, 5), min_size=4, max_size=4))))
    rng = np.random.default_rng(len(out))
    a = rng.standard_normal([sizes[c] for c in a_labels]).astype(np.float32)
    b = rng.standard_normal([sizes[c] for c in b_labels]).astype(np.float32)
    spec = f"{a_labels},{b_labels}->{out}"
    np.testing.assert_allclose(contract(spec, a, b, threads=2), np.einsum(spec, a, b), rtol=1e-6, atol=1e-6)
