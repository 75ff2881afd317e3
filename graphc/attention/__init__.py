"""Attention layers and decoder stacks as graphc graphs: configs, presets, statistics, builders, transformers configs."""

from .builders import (
    attention_core,
    attention_layer_graph,
    attention_stack_graph,
    cross_attention_graph,
    cross_kv_graph,
    init_weights,
    kv_cache_graph,
    sdpa_graph,
    weight_shapes,
)
from .config import PRESETS, AttentionConfig, Preset, RopeConfig, alibi_slopes, gqa, mha, mqa, preset, preset_names
from .causal_lm import CausalLMConfig, causal_lm_graph, causal_lm_weight_shapes, init_causal_lm_weights
from .decoder import DecoderConfig, decoder_layer_graph, decoder_stack_graph, decoder_weight_shapes
from .encoder import ENCODER_FAMILIES, EncoderConfig, encoder_config_from_hf, encoder_from_hf, encoder_stack_graph, encoder_weights_from_hf
from .relative import RelativePositionBias, relative_attention_graph, write_relative_position_bias
from .hf import attention_config_from_hf, decoder_config_from_hf, decoder_configs_from_hf, decoder_weights_from_hf
from .hf_lm import causal_lm_config_from_hf, causal_lm_from_hf, causal_lm_weights_from_hf

__all__ = [
    "RelativePositionBias",
    "relative_attention_graph",
    "write_relative_position_bias",
    "ENCODER_FAMILIES",
    "EncoderConfig",
    "encoder_config_from_hf",
    "encoder_from_hf",
    "encoder_stack_graph",
    "encoder_weights_from_hf",
    "AttentionConfig",
    "RopeConfig",
    "alibi_slopes",
    "DecoderConfig",
    "CausalLMConfig",
    "causal_lm_graph",
    "causal_lm_weight_shapes",
    "init_causal_lm_weights",
    "causal_lm_config_from_hf",
    "causal_lm_from_hf",
    "causal_lm_weights_from_hf",
    "decoder_layer_graph",
    "decoder_stack_graph",
    "decoder_weight_shapes",
    "attention_config_from_hf",
    "decoder_config_from_hf",
    "decoder_configs_from_hf",
    "decoder_weights_from_hf",
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
    "cross_kv_graph",
    "kv_cache_graph",
]
