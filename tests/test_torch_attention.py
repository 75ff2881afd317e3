"""A plain prefill's attention core runs on graphc's kernel or torch's SDPA, whichever this machine runs faster
(lowering.kernels.torch_attention): the NumPy backend's numbers are the same on either, against a float64 reference
written here, and only plain prefills may go to torch."""

from __future__ import annotations

import numpy as np
import pytest

import graphc
from graphc.visibility import Visibility
from lowering import prepare
from lowering.kernels import torch_attention as ta

pytest.importorskip("torch")


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    """float64 attention with np.repeat of K/V: query head h reads KV head h // group; causal from key 0."""
    group = q.shape[1] // k.shape[1]
    k, v = (np.repeat(a.astype(np.float64), group, axis=1) for a in (k, v))
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_the_attention_core_on_torch_equals_the_reference(causal, heads):
    hq, hkv = heads
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, hq, 96, 32)).astype(np.float32)
    k = rng.standard_normal((2, hkv, 96, 32)).astype(np.float32)
    v = rng.standard_normal((2, hkv, 96, 32)).astype(np.float32)
    want = _reference(q, k, v, 32**-0.5, causal)
    got = ta.torch_attention(q * np.float32(32**-0.5), k, v, causal, threads=2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("setting", ["1", "0", "auto"])
def test_a_layers_prefill_is_the_same_on_either_kernel(monkeypatch, setting):
    """A GQA layer's causal prefill through the NumPy backend, torch's SDPA forced on, off, or timed against graphc's
    kernel (the warm-up, each kernel once, then the faster), against the float64 reference every run."""
    monkeypatch.setenv("GRAPHC_TORCH_ATTENTION", setting)
    calls: list[bool] = []
    original = ta.torch_attention
    monkeypatch.setattr(ta, "torch_attention", lambda *a, **kw: calls.append(True) or original(*a, **kw))
    g = graphc.attention_layer_graph(graphc.gqa(256, 8, 2), seed=0)
    x = np.random.default_rng(1).standard_normal((1, 80, 256)).astype(np.float32)
    runner = prepare(g, "numpy", threads=2)
    want = prepare(g, "numpy", compute_dtype="float64", reference=True).run({"x_BSM": x})["out_BSM"]
    for _ in range(4):
        np.testing.assert_allclose(runner.run({"x_BSM": x})["out_BSM"], want, rtol=1e-4, atol=1e-4)
    if setting == "auto":  # run 1 a warm-up and run 2 on graphc's kernel, run 3 on torch's, run 4 on the faster
        assert 1 <= len(calls) <= 2
    else:
        assert len(calls) == {"1": 4, "0": 0}[setting]


def test_only_plain_prefills_may_go_to_torch():
    q, k = np.zeros((1, 4, 128, 16), np.float32), np.zeros((1, 2, 128, 16), np.float32)
    assert ta.plain_prefill(q, k, Visibility.causal(0), None)
    assert ta.plain_prefill(q, k, Visibility(), None)
    assert not ta.plain_prefill(q, k, Visibility.causal(5), None)  # a past: the causal mask is not at key 0
    assert not ta.plain_prefill(q, k, Visibility.causal(0, window=16), None)
    assert not ta.plain_prefill(q, k, Visibility(mask="bool"), None)
    assert not ta.plain_prefill(q, k, Visibility.causal(0), 30.0)  # softcap
    assert not ta.plain_prefill(q[:, :, :8], k, Visibility(), None)  # a short chunk
    assert not ta.plain_prefill(q.astype(np.float64), k, Visibility(), None)


def test_a_bidirectional_prefill_with_its_group_folded_into_the_rows_may_go_to_torch():
    q, k = np.zeros((1, 2, 4 * 128, 16), np.float32), np.zeros((1, 2, 128, 16), np.float32)  # 4 query heads per KV head, folded
    assert ta.plain_prefill(q, k, Visibility(), None)
    assert not ta.plain_prefill(q, k, Visibility.causal(0), None)


def test_a_folded_bidirectional_prefill_on_torch_equals_the_reference():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 4, 80, 16)).astype(np.float32)  # [B, Hkv, group, S, D]
    k, v = (rng.standard_normal((1, 2, 80, 16)).astype(np.float32) for _ in range(2))
    want = _reference(q.reshape(1, 8, 80, 16), k, v, 1.0, causal=False).reshape(1, 2, 320, 16)
    np.testing.assert_allclose(ta.torch_attention(q.reshape(1, 2, 320, 16), k, v, False, 2), want, rtol=1e-4, atol=1e-4)


def test_torch_is_not_imported_for_the_choice(monkeypatch):
    """Unless torch is loaded already (or forced), a prefill's attention runs graphc's kernel: no import in a first prefill."""
    import sys

    monkeypatch.setenv("GRAPHC_TORCH_ATTENTION", "auto")
    monkeypatch.delitem(sys.modules, "torch")
    q, k = np.zeros((1, 4, 128, 16), np.float32), np.zeros((1, 2, 128, 16), np.float32)
    ran = ta.attention_on_the_faster_kernel(q, k, k, Visibility(), None, 2, lambda: np.ones(1))
    assert ran.tolist() == [1.0] and "torch" not in sys.modules
