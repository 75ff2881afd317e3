"""The NumPy interpreter: GEMM contractions, input checks, error wrapping, value freeing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphc
from graphc import Graph
from graphc.einsum_spec import LETTERS
from graphc.errors import ExecutionError, InputError
from graphc.ops import Reshape, TensorType
from lowering import NumpyInterpreter, contract, plan_matmul, random_inputs, run_numpy


def test_plan_prefers_layout_without_output_transpose():
    p = plan_matmul("bhqk,bhkd->bhqd")
    assert (p.batch, p.a_free, p.contract, p.b_free, p.swap) == ("bh", "q", "k", "d", False)
    assert not p.needs_out_transpose
    p = plan_matmul("bnkd,bngqd->bngqk")  # grouped QK^T with K first: swapped so (g,q) fold into M
    assert p.swap and p.a_free == "gq" and not p.needs_out_transpose


@st.composite
def pairwise_specs(draw):
    labels = LETTERS[: draw(st.integers(2, 7))]
    a = draw(st.permutations(labels).map(lambda p: "".join(p[: len(p) // 2 + 1])))
    b = draw(st.permutations(labels).map(lambda p: "".join(p[len(p) // 3 :])))
    pool = sorted(set(a) | set(b))
    out = "".join(draw(st.permutations(pool))[: draw(st.integers(0, len(pool)))])
    sizes = {c: draw(st.integers(1, 4)) for c in pool}
    return f"{a},{b}->{out}", sizes


@settings(max_examples=60, deadline=None)
@given(spec_sizes=pairwise_specs(), seed=st.integers(0, 1000))
def test_pairwise_contraction_equals_np_einsum(spec_sizes, seed):
    spec, sizes = spec_sizes
    rng = np.random.default_rng(seed)
    (a, b), _ = spec.split("->")[0].split(","), None
    x = rng.standard_normal([sizes[c] for c in a])
    y = rng.standard_normal([sizes[c] for c in b])
    np.testing.assert_allclose(contract(spec, x, y), np.einsum(spec, x, y), rtol=1e-10, atol=1e-12)


def test_three_operand_contraction_follows_a_path():
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), rng.standard_normal((5, 2))
    np.testing.assert_allclose(contract("ij,jk,kl->li", a, b, c), (a @ b @ c).T, rtol=1e-12)


def _graph() -> Graph:
    g = Graph("g")
    x = g.input("x", ["n", 3])
    y = g.input("y", ["n", 3])
    s = g.add(x, y, name="s")
    g.output(g.exp(s, name="e"), g.reshape(s, [3, "n"], name="r"))
    return g


def test_input_checks():
    g = _graph()
    ok = {"x": np.ones((2, 3), np.float32), "y": np.ones((2, 3), np.float32)}
    run_numpy(g, ok)
    with pytest.raises(InputError, match=r"missing input\(s\) \['y'\]"):
        run_numpy(g, {"x": ok["x"]})
    with pytest.raises(InputError, match=r"unexpected input\(s\) \['z'\]"):
        run_numpy(g, dict(ok, z=ok["x"]))
    with pytest.raises(InputError, match="'x' has dtype float64, expected float32"):
        run_numpy(g, dict(ok, x=np.ones((2, 3))))
    with pytest.raises(InputError, match="'n' is 4 here but was bound to 2"):
        run_numpy(g, dict(ok, y=np.ones((4, 3), np.float32)))
    with pytest.raises(InputError, match=r"axis 1 must be 3 = 3, got 5"):
        run_numpy(g, dict(ok, y=np.ones((2, 5), np.float32)))
    with pytest.raises(InputError, match="expected rank 2"):
        run_numpy(g, dict(ok, y=np.ones((2, 3, 1), np.float32)))
    with pytest.raises(InputError, match="must be a numpy.ndarray"):
        run_numpy(g, dict(ok, y=[[1.0, 2.0, 3.0]]))
    with pytest.raises(InputError, match=r"sizes for symbolic dims \['n'\]"):
        random_inputs(g)


def test_failures_are_wrapped_with_the_node():
    g = Graph("g")
    x = g.input("x", ["n", 4])
    # skips inference, as a hand-edited graph could: symbol 'm' is bound by no input
    g.output(g.add_node(Reshape(("m", 4)), [x], name="bad", out_type=TensorType(("m", 4), "float32")))
    with pytest.raises(ExecutionError, match=r"node 'bad' \(Reshape\[shape=\[m,4\]\]\) failed .*'m'.*not bound") as info:
        run_numpy(g, {"x": np.ones((2, 4), np.float32)})
    assert info.value.node == "bad"
    assert info.value.__cause__ is not None


def test_values_are_freed_after_last_use():
    g = _graph()
    interp = NumpyInterpreter(g)
    freed = {interp.order[i].name: names for i, names in enumerate(interp._free_after)}
    assert freed["s"] == ["x", "y"]
    assert freed["r"] == ["s"]  # 's' lives until its last reader; outputs are never freed
    assert all("e" not in names for names in freed.values())


def test_float64_compute_upcasts_everything():
    g = _graph()
    feeds = {"x": np.full((1, 3), 0.1, np.float32), "y": np.full((1, 3), 0.2, np.float32)}
    out = NumpyInterpreter(g, compute_dtype="float64").run(feeds)
    assert out["e"].dtype == np.float64
    np.testing.assert_allclose(out["e"], np.exp(np.float64(np.float32(0.1)) + np.float64(np.float32(0.2))), rtol=1e-15)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("offset", [None, 0, 3, -2])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 1, 40, 40), (4, 1, 300)])
def test_fused_masked_softmax_equals_mask_then_softmax(shape, offset, threads):
    from lowering.kernels.softmax import masked_softmax
    from graphc.numerics import safe_softmax

    x = np.random.default_rng(0).standard_normal(shape)
    x = x[..., ::-1]  # a non-contiguous view
    hidden = np.zeros(shape[-2:], bool) if offset is None else np.triu(np.ones(shape[-2:], bool), offset + 1)  # j > i + offset
    want = safe_softmax(np.where(hidden, -np.inf, x), -1)
    got = masked_softmax(x, graphc.Visibility() if offset is None else graphc.Visibility.causal(offset), threads)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    if offset is not None and offset < 0:
        assert (got[..., :-offset, :] == 0).all()  # rows that see no key are zeros


def test_interpreter_runs_mask_and_softmax_as_written_when_both_are_outputs():
    g = Graph("m")
    x = g.input("x", [2, 4, 4], "float64")
    m = g.causal_mask(x, 1, name="m")
    g.output(g.softmax(m, name="p"))
    g.output(m)  # the masked scores are an output too: both computed
    interp = NumpyInterpreter(g)
    xs = np.random.default_rng(1).standard_normal((2, 4, 4))
    out = interp.run({"x": xs})
    assert np.isneginf(out["m"][:, 0, 2:]).all()
    np.testing.assert_allclose(out["p"].sum(-1), 1.0)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=64),
    dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
)
def test_sigmoid_in_one_buffer_is_the_textbook_formula_to_the_bit(values, dtype):
    """The Sigmoid op computes ``1 / (1 + exp(-x))`` in place, one buffer for the steps: the formula's own bits in every
    float dtype (NaN, infinities and overflow included)."""
    from graphc.ops import Unary

    x = np.array(values, np.float32).astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        got = Unary("sigmoid").evaluate([x], {})
        want = 1 / (1 + np.exp(-x))
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
