"""GPT-NeoX (``model_type: gpt_neox``): biases everywhere, partial rotary (``rotary_pct``), parallel or sequential residuals,
LayerNorms, a plain GELU MLP, a per-head fused ``query_key_value``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


from ..config import AttentionConfig
from ..decoder import DecoderConfig
from ..hf_fields import activation, flag, int_field, number_field
from ..hf_weights import DENSE_LAYER, per_head_qkv, rename_layers, renamed_module
from .base import Family, layer_norm_decoder, register_family

__all__ = ["GPTNeoX", "GPT_NEOX", "rename_gpt_neox"]


@dataclass(frozen=True)
class GPTNeoX(Family):
    """GPT-NeoX's configs and tensor names."""

    def attention_fields(self, cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
        """Biases on every projection unless ``attention_bias`` is false."""
        return {**super().attention_fields(cfg, head_dim), "bias": flag(cfg, "attention_bias", True)}

    def decoder(self, cfg: Mapping[str, Any], attention: AttentionConfig) -> DecoderConfig:
        """LayerNorms, a plain MLP with biases; attention and MLP in parallel unless ``use_parallel_residual`` is false."""
        parallel = flag(cfg, "use_parallel_residual", True)
        intermediate = int_field(cfg, "intermediate_size", 4 * attention.d_model)
        act, eps = activation(cfg, "hidden_act", "gelu"), number_field(cfg, "layer_norm_eps", 1e-5)
        return layer_norm_decoder(attention, intermediate, act, eps, True, parallel, 2 if parallel else 1)

    def rename(self, weights: Mapping[str, Any], cfg: Mapping[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        """``gpt_neox.*`` under graphc's names."""
        return rename_gpt_neox(weights, attention.n_heads, attention.hd)


def rename_gpt_neox(weights: Mapping[str, Any], heads: int, hd: int) -> dict[str, Any]:
    """GPT-NeoX's tensors (``gpt_neox.*``, ``embed_out``) under graphc's names."""
    modules = {**DENSE_LAYER, "attention.dense": "self_attn.o_proj"}

    def rename(module: str, kind: str, arr: Any) -> dict[str, Any]:
        if module == "attention.query_key_value":
            return {f"self_attn.{p}.{kind}": part for p, part in zip(("q_proj", "k_proj", "v_proj"), per_head_qkv(arr, heads, hd))}
        if module in ("attention.bias", "attention.masked_bias") or kind == "inv_freq":
            return {}
        return renamed_module(modules, module, kind, arr, "GPT-NeoX")

    outside = {
        "gpt_neox.final_layer_norm.weight": "model.norm.weight",
        "gpt_neox.final_layer_norm.bias": "model.norm.bias",
        "gpt_neox.embed_in.weight": "model.embed_tokens.weight",
        "embed_out.weight": "lm_head.weight",  # older checkpoints; transformers 5 writes lm_head
        "lm_head.weight": "lm_head.weight",
    }
    return rename_layers(weights, "gpt_neox.layers.", outside, rename, "GPT-NeoX")


GPT_NEOX = register_family(GPTNeoX("gpt_neox", aliases=(("rotary_pct", "partial_rotary_factor"), ("rotary_emb_base", "rope_theta"))))
