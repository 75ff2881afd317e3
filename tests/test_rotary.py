"""Rotary embeddings: the op's reference, its einsum decomposition on every backend, and transformers' own RoPE."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphc import Graph, Positions, Rotary
from graphc.errors import OpError, ShapeMismatchError
from graphc.optimizer import lower
from graphc.rotary import rope_inv_freq
from lowering import prepare
from lowering.exporter.targets import NUMPY_TARGET

from conftest import INSTALLED

BACKENDS = INSTALLED


def _plain_rope(x, positions, style, rotary_dim, base):
    """A per-pair loop in float64: features (a, b) rotate by position * base^(-2f/r)."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    r = rotary_dim
    for f in range(r // 2):
        a, b = (f, f + r // 2) if style == "half" else (2 * f, 2 * f + 1)
        theta = np.asarray(positions, np.float64)[..., None] * base ** (-2.0 * f / r)  # [S,1] or [B,S,1]
        if theta.ndim == 3:
            theta = theta[:, None]
        c, s = np.cos(theta)[..., 0], np.sin(theta)[..., 0]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def _graph(style, rotary_dim, offset=0, per_batch=False, scaling="none", **kw):
    g = Graph("rope")
    x = g.input("x", ["batch", 3, "seq", 8])
    pos = g.input("pos", ["batch", "seq"], "int64") if per_batch else g.add_node(Positions(2, offset), [x], "pos")
    g.output(g.add_node(Rotary(style, rotary_dim, 10000.0, scaling, **kw), [x, pos], "y"))
    return g


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("per_batch", [False, True])
def test_rotary_matches_a_plain_loop_on_every_backend(style, rotary_dim, per_batch):
    g = _graph(style, rotary_dim, offset=5, per_batch=per_batch)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 6, 8)).astype(np.float32)}
    positions = np.arange(5, 11)
    if per_batch:
        feeds["pos"] = rng.integers(0, 4000, (2, 6)).astype(np.int64)
        positions = feeds["pos"]
    want = _plain_rope(feeds["x"], positions, style, rotary_dim or 8, 10000.0)
    np.testing.assert_allclose(Rotary(style, rotary_dim).evaluate([feeds["x"], np.asarray(positions)], {}), want, atol=2e-4)
    assert "Rotary" not in lower(g, NUMPY_TARGET).op_counts()  # every target runs the einsum decomposition
    for backend in BACKENDS:
        got = prepare(g, backend).run(feeds)["y"]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4, err_msg=backend)  # angles up to 4000 rad in float32


def test_llama3_and_linear_scaling_match_transformers_inv_freq():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    got = rope_inv_freq(64, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    cfg = LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    )
    want, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, torch.device("cpu"))
    np.testing.assert_allclose(rope_inv_freq(64, 10000.0, "linear", 4.0), want.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_matches_transformers_llama_rope(rope):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_parameters=rope)
    x = torch.randn(2, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    position_ids = torch.tensor([[7, 8, 9, 10, 11, 12], [0, 1, 2, 3, 90, 91]])
    cos, sin = LlamaRotaryEmbedding(cfg)(x, position_ids)
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)
    scaling = "llama3" if rope["rope_type"] == "llama3" else "none"
    extra = {"factor": 8.0, "original_max_position": 64} if scaling == "llama3" else {}
    g = Graph("rope")
    xv = g.input("x", ["batch", 3, "seq", 8])
    g.output(g.add_node(Rotary("half", None, rope["rope_theta"], scaling, **extra), [xv, g.input("pos", ["batch", "seq"], "int64")], "y"))
    feeds = {"x": x.numpy(), "pos": position_ids.numpy()}
    for backend in BACKENDS:
        np.testing.assert_allclose(prepare(g, backend).run(feeds)["y"], want.numpy(), atol=1e-5, err_msg=backend)


def test_interleaved_rotary_matches_transformers_gptj():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    x = torch.randn(1, 5, 2, 8, generator=torch.Generator().manual_seed(1))  # GPT-J: [B, S, H, D]
    sincos = create_sinusoidal_positions(16, 4)[torch.arange(3, 8)][None]  # rotary_dim 4, positions 3..7
    sin, cos = torch.split(sincos, 2, dim=-1)
    want = torch.cat([apply_rotary_pos_emb(x[..., :4], sin, cos), x[..., 4:]], dim=-1).permute(0, 2, 1, 3)
    g = Graph("gptj")
    xv = g.input("x", [1, 2, "seq", 8])
    g.output(g.add_node(Rotary("interleaved", 4), [xv, g.add_node(Positions(2, 3), [xv], "pos")], "y"))
    for backend in BACKENDS:
        np.testing.assert_allclose(prepare(g, backend).run({"x": x.permute(0, 2, 1, 3).contiguous().numpy()})["y"], want.numpy(), atol=1e-5)


def test_rotary_attributes_and_shapes_are_checked():
    with pytest.raises(OpError, match="style"):
        Rotary("spiral")
    with pytest.raises(OpError, match="even"):
        Rotary("half", 5)
    with pytest.raises(OpError, match="base"):
        Rotary("half", None, -1.0)
    with pytest.raises(OpError, match="high_freq_factor"):
        Rotary("half", None, 10000.0, "llama3", 8.0, 4.0, 1.0)
    g = Graph("bad")
    x = g.input("x", [1, 2, 3, 8])
    with pytest.raises(ShapeMismatchError, match="rotary_dim 16"):
        g.add_node(Rotary("half", 16), [x, g.add_node(Positions(2), [x], "p")])
    with pytest.raises(ShapeMismatchError, match="positions"):
        g.add_node(Rotary(), [x, g.input("pos", [4], "int64")])


@settings(max_examples=20, deadline=None)
@given(
    style=st.sampled_from(["half", "interleaved"]), half=st.integers(1, 4), extra=st.integers(0, 2), seq=st.integers(0, 5), offset=st.integers(0, 9)
)
def test_random_rotary_decomposition_equals_the_op(style, half, extra, seq, offset):
    d = 2 * half + 2 * extra
    g = Graph("rope")
    x = g.input("x", [1, 2, "seq", d])
    g.output(g.add_node(Rotary(style, 2 * half), [x, g.add_node(Positions(2, offset), [x], "pos")], "y"))
    feeds = {"x": np.random.default_rng(seq).standard_normal((1, 2, seq, d)).astype(np.float32)}
    want = _plain_rope(feeds["x"], np.arange(offset, offset + seq), style, 2 * half, 10000.0)
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(prepare(g, backend).run(feeds)["y"], want, atol=1e-5, err_msg=backend)


@pytest.mark.parametrize("past", [2048, 4096, 8192])
def test_float32_rope_at_long_positions_stays_within_compare_tolerance(past):
    """Positions past ~2k: float32 angles were off by up to angle * 6e-8 rad, and ``compare`` reported FAIL (4.7e-4 at 4096).

    The float32 run on every backend is checked against the exact rotation (float64 loop, float32 frequencies as transformers).
    """
    g = _graph("half", None, offset=past)
    x = np.random.default_rng(1).standard_normal((1, 3, 4, 8)).astype(np.float32) * 3
    inv = rope_inv_freq(8, 10000.0).astype(np.float64)
    theta = np.arange(past, past + 4, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(theta), np.sin(theta)
    xd = x.astype(np.float64)
    want = np.concatenate([xd[..., :4] * c - xd[..., 4:] * s, xd[..., 4:] * c + xd[..., :4] * s], axis=-1)
    for backend in BACKENDS:
        got = prepare(g, backend).run({"x": x})["y"]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=backend)


def test_compare_passes_a_float32_decode_step_over_a_long_cache():
    """``graphc compare --preset mistral-7b --decode --past 4096`` reported FAIL on every backend (RoPE angles in float32)."""
    from graphc import kv_cache_graph, preset
    from lowering import compare

    cfg = preset("mistral-7b").with_(d_model=512, n_heads=4, n_kv_heads=2)
    report = compare(kv_cache_graph(cfg, seed=0), sizes={"batch": 1, "seq": 1, "past_seq": 4096}, backends=["numpy", "ort-cpu"], repeats=1)
    assert report.ok, str(report)
    assert max(r.max_abs_err for r in report.results) < 2e-5, str(report)
