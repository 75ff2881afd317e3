"""GPT-2 (``model_type: gpt2``): learned position embeddings instead of RoPE, biases everywhere, ``Conv1D`` weights stored
``[in, out]``, a fused ``c_attn``, LayerNorms, a tied head."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphc.errors import AttentionConfigError

from ..config import AttentionConfig
from ..decoder import DecoderConfig
from ..hf_fields import activation, flag, int_field, number_field
from ..hf_weights import rename_layers, renamed_module, split_rows
from .base import Family, layer_norm_decoder, register_family

__all__ = ["GPT2", "GPT_2", "rename_gpt2"]


@dataclass(frozen=True)
class GPT2(Family):
    """GPT-2's configs and tensor names."""

    def attention_fields(self, cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
        """Biases everywhere, no RoPE (positions are learned embeddings), no scale when ``scale_attn_weights`` is false."""
        flag(cfg, "attention_bias", False)  # checked as every family checks it, though GPT-2 always has biases
        if flag(cfg, "scale_attn_by_inverse_layer_idx", False):
            raise AttentionConfigError("GPT-2 with scale_attn_by_inverse_layer_idx=True is not supported (a per-layer attention scale)")
        return {"bias": True, "scale": None if flag(cfg, "scale_attn_weights", True) else 1.0, "rope": None}

    def decoder(self, cfg: Mapping[str, Any], attention: AttentionConfig) -> DecoderConfig:
        """LayerNorms and a plain MLP with biases, one after the other."""
        intermediate = int_field(cfg, "intermediate_size", 4 * attention.d_model)
        act, eps = activation(cfg, "activation_function", "gelu_new"), number_field(cfg, "layer_norm_epsilon", 1e-5)
        return layer_norm_decoder(attention, intermediate, act, eps, True, False, 1)

    def lm_fields(self, cfg: Mapping[str, Any], d_model: int) -> dict[str, Any]:
        """Learned positions: ``n_positions`` of them."""
        return {"position_embeddings": int_field(cfg, "n_positions", most=1 << 24)}

    def rename(self, weights: Mapping[str, Any], cfg: Mapping[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        """``transformer.*`` under graphc's names, ``Conv1D`` weights transposed."""
        return rename_gpt2(weights, attention.d_model)


def rename_gpt2(weights: Mapping[str, Any], d_model: int) -> dict[str, Any]:
    """GPT-2's tensors (``transformer.*``) under graphc's names; its ``Conv1D`` weights ``[in, out]`` are transposed (copied)."""
    modules = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}

    def linear(arr: Any, kind: str) -> Any:
        return np.ascontiguousarray(np.asarray(arr).T) if kind == "weight" else arr

    def rename(module: str, kind: str, arr: Any) -> dict[str, Any]:
        if module == "attn.c_attn":
            parts = split_rows(np.asarray(arr).T if kind == "weight" else arr, [d_model] * 3)
            return {f"self_attn.{p}.{kind}": np.ascontiguousarray(part) for p, part in zip(("q_proj", "k_proj", "v_proj"), parts)}
        if module in ("ln_1", "ln_2"):
            return {f"{'input_layernorm' if module == 'ln_1' else 'post_attention_layernorm'}.{kind}": arr}
        if module == "attn" and kind in ("bias", "masked_bias"):
            return {}  # the causal-mask buffer of older checkpoints
        return renamed_module(modules, module, kind, linear(arr, kind), "GPT-2")

    outside = {
        "transformer.ln_f.weight": "model.norm.weight",
        "transformer.ln_f.bias": "model.norm.bias",
        "transformer.wte.weight": "model.embed_tokens.weight",
        "transformer.wpe.weight": "model.embed_positions.weight",
        "lm_head.weight": "lm_head.weight",
    }
    return rename_layers(weights, "transformer.h.", outside, rename, "GPT-2")


_ALIASES = (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"), ("n_inner", "intermediate_size"))
GPT_2 = register_family(GPT2("gpt2", tied_by_default=True, aliases=_ALIASES))
