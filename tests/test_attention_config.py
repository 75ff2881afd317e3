"""AttentionConfig validation, presets and statistics."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import graphc
from graphc import AttentionConfig, gqa, mha, mqa, preset
from graphc.errors import AttentionConfigError, UnknownNameError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=0, n_heads=4, n_kv_heads=4), "d_model must be > 0, got 0"),
        (dict(d_model=64, n_heads=-1, n_kv_heads=1), "n_heads must be > 0"),
        (dict(d_model=64, n_heads=4, n_kv_heads=8), r"n_kv_heads \(8\) must be <= n_heads \(4\)"),
        (dict(d_model=64, n_heads=6, n_kv_heads=4), r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"),
        (dict(d_model=100, n_heads=8, n_kv_heads=2), r"d_model \(100\) is not divisible by n_heads \(8\); pass head_dim"),
        (dict(d_model=64, n_heads=4, n_kv_heads=2, dropout=1.5), r"dropout must be in \[0, 1\], got 1.5"),
        (dict(d_model=64, n_heads=4, n_kv_heads=2, scale=0.0), "scale must be a positive finite number"),
        (dict(d_model=64.0, n_heads=4, n_kv_heads=2), "d_model must be an int, got float"),
        (dict(d_model=64, n_heads=4, n_kv_heads=2, head_dim=0), "head_dim must be > 0"),
    ],
)
def test_invalid_configs(kwargs, message):
    with pytest.raises(AttentionConfigError, match=message):
        AttentionConfig(**kwargs)


def test_kinds_and_groups():
    assert mha(64, 8).is_mha and mha(64, 8).kind == "MHA" and mha(64, 8).group_size == 1
    assert mqa(64, 8).is_mqa and mqa(64, 8).group_size == 8
    g = gqa(64, 8, 2)
    assert g.is_gqa and not g.is_mha and not g.is_mqa and g.group_size == 4
    assert [g.kv_head_of(h) for h in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(AttentionConfigError, match="query head 8 is out of range"):
        g.kv_head_of(8)


def test_presets():
    assert (preset("falcon-40b").n_heads, preset("falcon-40b").n_kv_heads, preset("falcon-40b").hd) == (128, 8, 64)
    f7 = preset("falcon-7b")
    assert (f7.n_heads, f7.n_kv_heads, f7.hd, f7.is_mqa) == (71, 1, 64, True)
    assert (preset("llama2-70b").n_heads, preset("llama2-70b").n_kv_heads) == (64, 8)
    assert preset("llama2-7b").is_mha and preset("mistral-7b").group_size == 4
    with pytest.raises(UnknownNameError, match="unknown preset 'gpt5'; valid presets: llama2-7b, llama2-70b"):
        preset("gpt5")


def test_stats_match_hand_computation():
    cfg = preset("mistral-7b")  # 4096 wide, 32 q heads, 8 kv heads, head_dim 128
    assert cfg.param_count() == 4096 * 4096 * 2 + 2 * 4096 * 1024
    assert cfg.param_count(bias=True) - cfg.param_count() == 4096 + 2 * 1024 + 4096
    # 2 (K,V) x 8 heads x 128 x 2 bytes x 32 layers = 131072 bytes per token
    assert cfg.kv_cache_bytes(1, 1, "float16", n_layers=32) == 131072
    assert cfg.kv_cache_bytes(2, 4096, "float32") == 2 * 2 * 4096 * 8 * 128 * 4
    assert cfg.kv_saving_vs_mha() == 0.75
    assert cfg.flops(1, 10, projections=False) == 2 * 32 * 10 * 10 * 128 * 2
    assert cfg.flops(1, 1, 100) - cfg.flops(1, 1, 100, projections=False) == 2 * 4096 * (4096 + 2 * 1024) + 2 * 4096 * 4096
    text = cfg.summary(batch=1, seq_len=4096, n_layers=32)
    assert "GQA: d_model=4096, heads=32, kv_heads=8, head_dim=128, group_size=4" in text
    assert "131,072 bytes/token; 512.0 MiB" in text and "KV saving vs MHA: 75.0%" in text
    with pytest.raises(AttentionConfigError, match="seq_len must be a non-negative int"):
        cfg.kv_cache_bytes(1, -1)


@given(n_kv=st.integers(1, 16), group=st.integers(1, 16), hd=st.integers(1, 256))
def test_random_valid_configs(n_kv, group, hd):
    cfg = AttentionConfig(hd * n_kv * group, n_kv * group, n_kv)
    assert cfg.hd == hd and cfg.group_size == group
    assert cfg.is_mha + cfg.is_mqa + cfg.is_gqa == (0 if n_kv * group == 1 else 1) or cfg.is_mha
    assert all(cfg.kv_head_of(h) == h // group for h in range(cfg.n_heads))
    assert cfg.kv_saving_vs_mha() == pytest.approx(1 - 1 / group)


def test_preset_graphs_build_and_verify():
    for name in graphc.preset_names():
        g = graphc.kv_cache_graph(preset(name).with_(d_model=preset(name).n_heads * 2, head_dim=2))
        g.verify()
