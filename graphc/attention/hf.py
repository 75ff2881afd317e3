"""Attention configs from transformers model configs (``config.json``), without transformers or the hub.

``attention_config_from_hf(config, layer=0)`` reads the fields a family uses
for its attention: head counts and head dim, RoPE (``rope_parameters`` as
transformers 5 writes it, or ``rope_theta`` + ``rope_scaling`` as older
``config.json`` files do), sliding windows (per layer where a family alternates
them), logit softcap, the attention scale and which projections have a bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphc.errors import AttentionConfigError, WeightError
from graphc.weights import read_json_object

from .config import AttentionConfig
from .decoder import DecoderConfig
from .families import family_names, get_family
from .hf_fields import HF_ACTIVATIONS, int_field, layer_types

__all__ = [
    "attention_config_from_hf",
    "decoder_config_from_hf",
    "decoder_weights_from_hf",
    "decoder_configs_from_hf",
    "read_hf_config",
    "HF_FAMILIES",
    "HFConfig",
    "HF_ACTIVATIONS",
    "MAX_LAYERS",
]

HF_FAMILIES = family_names()
"""``model_type`` values of the built-in families (:mod:`graphc.attention.families`; :func:`family_names` lists those registered since)."""


class HFConfig(dict[str, Any]):
    """A transformers config read once (:func:`read_hf_config`): a plain dict under the names graphc reads, passed down
    as it is by every builder it reaches (read again, it is the same object, never parsed or copied again)."""


def read_hf_config(config: Mapping[str, Any] | str | Path | Any) -> HFConfig:
    """A transformers config as a plain dict: from a dict, a ``config.json`` path, or a ``PretrainedConfig``; an
    :class:`HFConfig` (one already read) is returned as it is."""
    if isinstance(config, HFConfig):
        return config
    if isinstance(config, (str, Path)):
        return HFConfig(_canonical(read_json_object(config, "config")))
    if hasattr(config, "to_dict"):
        return HFConfig(_canonical(dict(config.to_dict())))
    if isinstance(config, Mapping):
        return HFConfig(_canonical(dict(config)))
    raise AttentionConfigError(f"expected a config dict, a config.json path or a transformers config, got {type(config).__name__}")


def _canonical(cfg: dict[str, Any]) -> dict[str, Any]:
    """Field aliases of a known family copied to the names graphc reads (an unknown ``model_type`` is refused later, where it is read)."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in family_names():
        return get_family(model_type).canonical(cfg)
    return cfg


MAX_LAYERS = 1024
"""The most layers graphc builds from one config (the largest public decoders have ~130); more is taken as a typo."""


def attention_config_from_hf(config: Mapping[str, Any] | str | Path | Any, layer: int = 0) -> AttentionConfig:
    """The :class:`AttentionConfig` of layer ``layer`` of a transformers model config.

    An unknown ``model_type`` raises :class:`UnknownNameError` listing the registered families
    (:func:`graphc.attention.families.family_names`).
    """
    cfg = read_hf_config(config)
    family = get_family(cfg.get("model_type"))
    d_model = int_field(cfg, "hidden_size")
    heads = int_field(cfg, "num_attention_heads")
    kv_heads = family.kv_heads(cfg, heads)
    head_dim = int_field(cfg, "head_dim", max(d_model // heads, 1))
    window = int_field(cfg, "sliding_window", None)
    layer_types(cfg)  # checked whether or not a window uses it
    fields: dict[str, Any] = {"bias": False, "scale": None, "softcap": None, "rope": None, "biases": None, "qk_norm_eps": None}
    fields.update(family.attention_fields(cfg, head_dim))
    return AttentionConfig(
        d_model,
        heads,
        kv_heads,
        head_dim=head_dim,
        causal=True,
        sliding_window=None if window is None else family.window(cfg, layer, window),
        **fields,
    )


def decoder_config_from_hf(config: Mapping[str, Any] | str | Path | Any, layer: int = 0) -> DecoderConfig:
    """The :class:`DecoderConfig` of layer ``layer`` (norms, MLP and attention) of a transformers model config."""
    cfg = read_hf_config(config)
    return get_family(cfg.get("model_type")).decoder(cfg, attention_config_from_hf(cfg, layer))


def decoder_configs_from_hf(config: Mapping[str, Any] | str | Path | Any, n_layers: int | None = None) -> list[DecoderConfig]:
    """One :class:`DecoderConfig` per layer (``num_hidden_layers``, or the first ``n_layers``): windows may alternate."""
    cfg = read_hf_config(config)
    total = int_field(cfg, "num_hidden_layers", most=MAX_LAYERS)
    n = total if n_layers is None else n_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= total:
        raise AttentionConfigError(f"n_layers must be an int in 1..{total} (num_hidden_layers), got {n!r}")
    return [decoder_config_from_hf(cfg, i) for i in range(n)]


def decoder_weights_from_hf(weights: Mapping[str, Any], config: Mapping[str, Any] | str | Path | Any) -> dict[str, Any]:
    """A checkpoint's tensors under graphc's names (``model.layers.{i}.self_attn.q_proj.weight`` ..., ``model.embed_tokens.weight``,
    ``model.norm.weight``, ``lm_head.weight``): Llama-like families pass through; the others are renamed and their fused
    tensors split by their family's ``rename`` (:mod:`graphc.attention.families`)."""
    cfg = read_hf_config(config)
    family = get_family(cfg.get("model_type"))
    bad = [k for k in weights if not isinstance(k, str)]
    if bad:
        raise WeightError(f"weight names must be strings, got {type(bad[0]).__name__} {bad[0]!r}")
    # rotary tables older checkpoints saved as buffers: recomputed from the config, as transformers does
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if not family.renames_weights:
        return dict(weights)
    return family.rename(weights, cfg, attention_config_from_hf(cfg))
