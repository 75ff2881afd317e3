"""The compiled (numba) kernel tier: its numbers against plain NumPy written here, and the fallback when it is off."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_sdpa

import graphc
from graphc.errors import GraphcError
from graphc.optimizer import REFERENCE_TARGET, lower
from lowering import NumpyInterpreter, prepare, random_inputs, run
from lowering.kernels import compiled
from lowering.kernels.attention_kernel import blocked_attention
from graphc import Visibility


def _visibility(offset, window=None):  # noqa: ANN001, ANN202
    return Visibility() if offset is None else Visibility.causal(offset, window)

needs_numba = pytest.mark.skipif(not compiled.use_compiled(), reason=f"compiled kernels off: {compiled.compiled_reason()}")
F32 = dict(rtol=1e-4, atol=1e-5)  # float32 scores over up to 700 keys against float64


@needs_numba
def test_exp_is_accurate_on_the_softmax_range_and_exactly_zero_below_it():
    from lowering.kernels._numba_attention import exp_rows

    x = np.concatenate([np.linspace(-87.0, 0.0, 200_001, dtype=np.float32), np.float32([-87.31, -100.0, -1e30, -np.inf])])
    s = x[None, :].copy()  # one row whose max is 0: exp_rows gives exp(x) itself
    totals = np.empty(1, np.float32)
    exp_rows(s, totals)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(s[0, :-4] / want[:-4] - 1)
    assert rel.max() < 3e-7
    assert (s[0, -4:] == 0).all()
    assert totals[0] == pytest.approx(want.sum(), rel=1e-5)


@needs_numba
def test_exp_rows_matches_numpy_with_fully_masked_rows():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 6, 37), dtype=np.float32) * 20
    s[0, 1] = -np.inf
    s[1, 2, :30] = -np.inf
    want = s.astype(np.float64)
    m = want.max(-1, keepdims=True)
    m[~np.isfinite(m)] = 0
    want = np.exp(want - m)
    total = compiled.exp_rows_compiled(s)
    np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-30)  # s - max rounds to float32 first: ~ulp(60) = 4e-6
    np.testing.assert_allclose(total[..., 0], np.where(want.sum(-1) == 0, 1, want.sum(-1)), rtol=1e-5)


@needs_numba
@settings(max_examples=80, deadline=None)
@given(
    lead=st.integers(1, 5),
    groups=st.integers(1, 9),
    sq=st.integers(1, 7),
    t_len=st.integers(0, 700),
    dim=st.sampled_from([1, 3, 16, 64]),
    causal=st.booleans(),
    past_shift=st.integers(-9, 3),
    window=st.none() | st.integers(1, 50),
    threads=st.sampled_from([1, 2, 3, 8]),
    value_dim=st.sampled_from([None, 64, 128]),
    seed=st.integers(0, 999),
)
def test_decode_kernel_equals_numpy_reference(lead, groups, sq, t_len, dim, causal, past_shift, window, threads, value_dim, seed):
    """Every key slice split, causal offset (negative ones give empty rows), window and head grouping, against float64 NumPy."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, lead * groups, sq, dim), dtype=np.float32) * np.float32(dim**-0.5)  # scaled as attention scales it
    k = rng.standard_normal((1, lead, t_len, dim), dtype=np.float32)
    v = rng.standard_normal((1, lead, t_len, value_dim or dim + 1), dtype=np.float32)  # 64 and 128: the register-blocked P V
    offset = t_len - sq + past_shift if causal else None
    got = compiled.decode_attention(q.reshape(lead, groups * sq, dim), k[0], v[0], sq, _visibility(offset, window if causal else None), threads)
    want = ref_sdpa(q, k, v, causal=causal, offset=offset, scale=1.0, window=window if causal else None)
    np.testing.assert_allclose(got.reshape(want.shape), want, **F32)


@needs_numba
@settings(max_examples=15, deadline=None)
@given(
    t_len=st.integers(900, 3200),
    sq=st.integers(1, 5),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 1500),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 999),
)
def test_decode_kernel_over_several_key_blocks(t_len, sq, causal, window, threads, seed):
    """Caches longer than the kernel's key block: running maxima and sums merged across blocks, and blocks a window hides."""
    from lowering.kernels._numba_attention import KEY_BLOCK

    assert t_len < 4 * KEY_BLOCK
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 6, sq, 16), dtype=np.float32) * np.float32(2.0)  # large scores: block maxima differ
    k = rng.standard_normal((1, 2, t_len, 16), dtype=np.float32)
    k[0, :, ::700] *= 4  # a few keys dominate, in different blocks
    v = rng.standard_normal((1, 2, t_len, 64), dtype=np.float32)
    offset = t_len - sq if causal else None
    got = compiled.decode_attention(q.reshape(2, 3 * sq, 16), k[0], v[0], sq, _visibility(offset, window if causal else None), threads)
    want = ref_sdpa(q, k, v, causal=causal, offset=offset, scale=1.0, window=window if causal else None)
    np.testing.assert_allclose(got.reshape(want.shape), want, **F32)


@needs_numba
def test_query_head_uses_its_consecutive_kv_head_not_the_tiled_one():
    """Query head h reads KV head h // group: with K/V of head 1 = 0 and V of head 0 = 1, heads 0..3 give 1 and 4..7 give 0."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 8), dtype=np.float32)  # [KV heads, group rows, D]
    k = rng.standard_normal((2, 300, 8), dtype=np.float32)
    v = np.stack([np.ones((300, 5), np.float32), np.zeros((300, 5), np.float32)])
    out = compiled.decode_attention(q, k, v, 1, Visibility(), 2).reshape(8, 5)
    np.testing.assert_allclose(out[:4], 1.0, rtol=1e-6)
    np.testing.assert_allclose(out[4:], 0.0, atol=0)


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
def test_a_nan_score_gives_nan_as_the_reference_does(threads):
    """A NaN in a key makes every row that sees it NaN (the exp gave 0 for NaN: the key silently got weight 0)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 1, 16), dtype=np.float32)
    k = rng.standard_normal((1, 1, 2600, 16), dtype=np.float32)
    v = rng.standard_normal((1, 1, 2600, 16), dtype=np.float32)
    k[0, 0, 2123, 5] = np.nan  # in the third key block
    got = compiled.decode_attention(q.reshape(1, 2, 16), k[0], v[0], 1, Visibility(), threads)
    want = ref_sdpa(q, k, v, causal=False, offset=None, scale=1.0)
    assert np.isnan(want).all() and np.isnan(got).all()
    s = np.float32([[0.0, np.nan, -1.0], [0.0, -1.0, -2.0]])
    total = compiled.exp_rows_compiled(s)
    assert np.isnan(s[0, 1]) and np.isnan(total[0, 0])
    np.testing.assert_allclose(s[1], np.exp(np.float32([0.0, -1.0, -2.0])), rtol=1e-6)  # a row without NaN is untouched by it


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_attention_takes_the_compiled_path_for_decode_and_prefill(threads, monkeypatch):
    """The same call, compiled and NumPy kernels, equal to each other and to the reference (decode rows, then prefill rows)."""
    rng = np.random.default_rng(2)
    for sq, t_len in ((1, 513), (5, 40), (90, 90)):
        q = rng.standard_normal((2, 3, 4 * sq, 16), dtype=np.float32)
        k = rng.standard_normal((2, 3, t_len, 16), dtype=np.float32)
        v = rng.standard_normal((2, 3, t_len, 16), dtype=np.float32)
        offset = t_len - sq
        fast = blocked_attention(q, k, v, sq, Visibility.causal(offset), None, threads)
        monkeypatch.setenv("GRAPHC_KERNELS", "numpy")
        plain = blocked_attention(q, k, v, sq, Visibility.causal(offset), None, threads)
        monkeypatch.delenv("GRAPHC_KERNELS")
        want = ref_sdpa(q.reshape(2, 12, sq, 16), k, v, causal=True, offset=offset, scale=1.0).reshape(fast.shape)
        np.testing.assert_allclose(fast, want, **F32)
        np.testing.assert_allclose(plain, want, **F32)


@needs_numba
def test_decode_graph_on_numpy_backend_compiled_and_not(monkeypatch):
    """A GQA decode step with a KV cache: compiled kernels, NumPy kernels and the reference interpreter agree."""
    cfg = graphc.AttentionConfig(64, 8, 2)
    raw = graphc.kv_cache_graph(cfg, seed=0)
    g = graphc.optimize(raw).graph
    feeds = random_inputs(g, seed=4, batch=2, seq=1, past_seq=300)
    fast = run(g, feeds, backend="numpy")
    monkeypatch.setenv("GRAPHC_KERNELS", "numpy")
    plain = run(g, feeds, backend="numpy")
    want = NumpyInterpreter(lower(raw, REFERENCE_TARGET), compute_dtype="float64", reference=True).run(feeds)
    for name in want:
        np.testing.assert_allclose(fast[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(plain[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_kernel_choice_is_reported(monkeypatch):
    monkeypatch.setenv("GRAPHC_KERNELS", "numpy")
    assert compiled.compiled_reason() == "GRAPHC_KERNELS=numpy" and not compiled.use_compiled()
    assert compiled.warm_up() == 0.0
    monkeypatch.setenv("GRAPHC_KERNELS", "fastest")
    with pytest.raises(GraphcError, match="GRAPHC_KERNELS must be 'auto' .* or 'numpy', got 'fastest'"):
        compiled.use_compiled()


def test_a_kernel_module_that_cannot_load_falls_back_to_numpy_and_says_why(monkeypatch):
    """A broken numba install (or no writable cache) must not break the NumPy backend: NumPy kernels, and the reason in the provider."""
    if compiled.compiled_reason() is not None:
        pytest.skip(f"compiled kernels off: {compiled.compiled_reason()}")
    monkeypatch.setattr(compiled, "_MODULE", [])
    monkeypatch.setattr(compiled, "_LOAD_ERROR", [])

    def broken(name):
        raise RuntimeError("cannot cache function 'attend_rows': no locator available")

    monkeypatch.setattr(compiled.importlib, "import_module", broken)
    assert not compiled.use_compiled()
    assert "could not be loaded (RuntimeError: cannot cache function" in compiled.compiled_reason()
    cfg = graphc.AttentionConfig(64, 8, 2)
    g = graphc.optimize(graphc.kv_cache_graph(cfg, seed=0)).graph
    feeds = random_inputs(g, seed=1, batch=1, seq=1, past_seq=40)
    prepared = prepare(g, "numpy")
    assert "could not be loaded" in prepared.provider
    want = NumpyInterpreter(lower(graphc.kv_cache_graph(cfg, seed=0), REFERENCE_TARGET), compute_dtype="float64", reference=True).run(feeds)
    got = prepared.run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
