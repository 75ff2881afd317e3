"""Attention layers as graphc graphs: configs, presets, statistics and builders."""

from .builders import (
    attention_core,
    attention_layer_graph,
    attention_stack_graph,
    cross_attention_graph,
    init_weights,
    kv_cache_graph,
    sdpa_graph,
    weight_shapes,
)
from .config import PRESETS, AttentionConfig, Preset, gqa, mha, mqa, preset, preset_names

__all__ = [
    "AttentionConfig",
    "Preset",
    "PRESETS",
    "preset",
    "preset_names",
    "mha",
    "mqa",
    "gqa",
    "weight_shapes",
    "init_weights",
    "attention_core",
    "sdpa_graph",
    "attention_layer_graph",
    "attention_stack_graph",
    "cross_attention_graph",
    "kv_cache_graph",
]
