"""Falcon (``model_type: falcon``): multi-query (7B), grouped (40B, ``new_decoder_architecture``) or MHA attention with a
fused ``query_key_value``; parallel attention and MLP, LayerNorms, a plain GELU MLP, a tied head; ALiBi variants refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphc.errors import AttentionConfigError, WeightError

from ..config import AttentionConfig
from ..decoder import DecoderConfig
from ..hf_fields import activation, flag, int_field, number_field
from ..hf_weights import DENSE_LAYER, per_head_qkv, rename_layers, renamed_module
from .base import Family, layer_norm_decoder, register_family

__all__ = ["Falcon", "FALCON", "rename_falcon"]


@dataclass(frozen=True)
class Falcon(Family):
    """Falcon's configs and tensor names."""

    def kv_heads(self, cfg: Mapping[str, Any], heads: int) -> int:
        """``num_kv_heads`` (new decoder architecture), one (multi-query) or one per head."""
        if flag(cfg, "alibi", False):
            raise AttentionConfigError("Falcon with alibi=True is not supported yet (ALiBi biases); rotary Falcon models are")
        if flag(cfg, "new_decoder_architecture", False):
            return int(int_field(cfg, "num_kv_heads", heads))
        return 1 if flag(cfg, "multi_query", True) else heads

    def attention_fields(self, cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
        """Biases on every projection when ``bias`` (or ``attention_bias``) says so."""
        fields = super().attention_fields(cfg, head_dim)
        return {**fields, "bias": fields["bias"] or flag(cfg, "bias", False)}

    def decoder(self, cfg: Mapping[str, Any], attention: AttentionConfig) -> DecoderConfig:
        """LayerNorms, a plain MLP, attention and MLP in parallel (one norm, or two with the new architecture)."""
        new_arch = flag(cfg, "new_decoder_architecture", False)
        norms = int_field(cfg, "num_ln_in_parallel_attn", None, most=2) or (2 if new_arch else 1)
        intermediate = int_field(cfg, "ffn_hidden_size", 4 * attention.d_model)
        act, eps = activation(cfg, "activation", "gelu"), number_field(cfg, "layer_norm_epsilon", 1e-5)
        parallel = new_arch or flag(cfg, "parallel_attn", True)
        return layer_norm_decoder(attention, intermediate, act, eps, flag(cfg, "bias", False), parallel, norms if new_arch else 1)

    def rename(self, weights: Mapping[str, Any], cfg: Mapping[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        """``transformer.*`` under graphc's names, ``query_key_value`` split in its layout."""
        return rename_falcon(weights, attention.n_heads, attention.n_kv_heads, attention.hd, bool(cfg.get("new_decoder_architecture")))


def rename_falcon(weights: Mapping[str, Any], heads: int, kv: int, hd: int, new_arch: bool) -> dict[str, Any]:
    """Falcon's tensors (``transformer.*``) under graphc's names."""
    group = heads // kv
    modules = {**DENSE_LAYER, "self_attention.dense": "self_attn.o_proj", "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"}

    def rename(module: str, kind: str, arr: Any) -> dict[str, Any]:
        if module == "self_attention.query_key_value":
            rows = (heads + 2 * kv) * hd  # every layout: the query heads, then one K and one V per KV head
            if heads % kv or np.shape(arr)[0] != rows:
                raise WeightError(
                    f"Falcon {module}.{kind} has {np.shape(arr)[0]} rows; {heads} query heads and {kv} KV heads of {hd} take {rows}"
                    + (f" (and {heads} query heads are not a multiple of {kv} KV heads)" if heads % kv else "")
                )
            if new_arch:
                slots = arr.reshape(kv, group + 2, hd, *arr.shape[1:])
                parts = (slots[:, :group], slots[:, group], slots[:, group + 1])
            elif kv == 1:
                per_row = arr.reshape(-1, hd, *arr.shape[1:])
                parts = (per_row[:heads], per_row[heads], per_row[heads + 1])
            else:
                parts = per_head_qkv(arr, heads, hd)
            return {f"self_attn.{p}.{kind}": part.reshape(-1, *arr.shape[1:]) for p, part in zip(("q_proj", "k_proj", "v_proj"), parts)}
        return renamed_module(modules, module, kind, arr, "Falcon")

    outside = {
        "transformer.ln_f.weight": "model.norm.weight",
        "transformer.ln_f.bias": "model.norm.bias",
        "transformer.word_embeddings.weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
    }
    return rename_layers(weights, "transformer.h.", outside, rename, "Falcon")


FALCON = register_family(Falcon("falcon", tied_by_default=True))
