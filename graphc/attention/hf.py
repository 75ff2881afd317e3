"""Attention configs from transformers model configs (``config.json``), without transformers or the hub.

``attention_config_from_hf(config, layer=0)`` reads the fields a family uses
for its attention: head counts and head dim, RoPE (``rope_parameters`` as
transformers 5 writes it, or ``rope_theta`` + ``rope_scaling`` as older
``config.json`` files do), sliding windows (per layer where a family alternates
them), logit softcap, the attention scale and which projections have a bias.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphc.errors import AttentionConfigError, SerializationError, UnknownNameError, WeightError
from graphc.weights import require_regular_file

from .config import AttentionConfig, RopeConfig
from .decoder import DecoderConfig
from .hf_weights import rename_falcon, rename_gpt2, rename_gpt_neox, rename_phi3

__all__ = [
    "attention_config_from_hf",
    "decoder_config_from_hf",
    "decoder_weights_from_hf",
    "decoder_configs_from_hf",
    "read_hf_config",
    "HF_FAMILIES",
    "HF_ACTIVATIONS",
    "MAX_LAYERS",
]

HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "falcon", "phi3", "gpt_neox", "gpt2")
"""``model_type`` values whose attention graphc builds from a transformers config."""


def read_hf_config(config: Mapping[str, Any] | str | Path | Any) -> dict[str, Any]:
    """A transformers config as a plain dict: from a dict, a ``config.json`` path, or a ``PretrainedConfig``."""
    if isinstance(config, (str, Path)):
        require_regular_file(config, "config")
        try:
            doc = json.loads(Path(config).read_text(encoding="utf-8"))
        except OSError as e:
            raise SerializationError(f"cannot read config {str(config)!r}: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise SerializationError(f"{config}: not a JSON config: {e}") from None
        if not isinstance(doc, dict):
            raise SerializationError(f"{config}: a config.json holds a JSON object, got {type(doc).__name__}")
        return _canonical(doc)
    if hasattr(config, "to_dict"):
        return _canonical(dict(config.to_dict()))
    if isinstance(config, Mapping):
        return _canonical(dict(config))
    raise AttentionConfigError(f"expected a config dict, a config.json path or a transformers config, got {type(config).__name__}")


_ALIASES = {
    "gpt2": {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers", "n_inner": "intermediate_size"},
    "gpt_neox": {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"},
}
"""Per family, older or family-specific ``config.json`` field names and the names graphc reads them under."""


def _canonical(cfg: dict[str, Any]) -> dict[str, Any]:
    for old, new in _ALIASES.get(str(cfg.get("model_type")), {}).items():
        if cfg.get(new) is None and cfg.get(old) is not None:
            cfg[new] = cfg[old]
    return cfg


MAX_LAYERS = 1024
"""The most layers graphc builds from one config (the largest public decoders have ~130); more is taken as a typo."""


def _get(cfg: Mapping[str, Any], key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise AttentionConfigError(f"config of model_type {cfg.get('model_type')!r} lacks {key!r}")
        return default
    v = cfg[key]
    kinds = typ if isinstance(typ, tuple) else (typ,)
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise AttentionConfigError(f"config field {key!r} must be {names}, got {type(v).__name__} {v!r}")
    return v


def _int(cfg: Mapping[str, Any], key: str, default: Any = ..., least: int = 1, most: int | None = None) -> Any:
    """An int field in ``least..most`` (a float such as ``4.7`` is refused, not truncated)."""
    v = _get(cfg, key, int, default)
    if v is None:
        return v
    if v < least or most is not None and v > most:
        bound = f"{least}..{most}" if most is not None else f">= {least}"
        raise AttentionConfigError(f"config field {key!r} must be an int {bound}, got {v!r}")
    return int(v)


def _number(cfg: Mapping[str, Any], key: str, default: Any = ..., positive: bool = True) -> Any:
    """A finite number field (> 0 unless ``positive=False``)."""
    v = _get(cfg, key, (int, float), default)
    if v is None:
        return v
    if not math.isfinite(v) or positive and v <= 0:
        raise AttentionConfigError(f"config field {key!r} must be a finite number{' > 0' if positive else ''}, got {v!r}")
    return float(v)


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    return bool(_get(cfg, key, bool, default))


def _rope(cfg: Mapping[str, Any], head_dim: int) -> RopeConfig:
    params = cfg.get("rope_parameters")
    source = "rope_parameters"
    if not params:  # older config.json: rope_theta and rope_scaling
        params, source = cfg.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, Mapping):
        raise AttentionConfigError(f"config field {source!r} must be an object (rope_type, factor, ...), got {type(params).__name__} {params!r}")
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise AttentionConfigError(f"{source}.rope_type must be a string, got {kind!r}")
    theta = _number(params, "rope_theta", None) or _number(cfg, "rope_theta", 10000.0)
    partial = _number(cfg, "partial_rotary_factor", None) or _number(params, "partial_rotary_factor", 1.0)
    if partial > 1.0:
        raise AttentionConfigError(f"config field 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    rotary_dim = None if partial == 1.0 else int(head_dim * partial)
    if kind == "default":
        return RopeConfig("half", rotary_dim, theta)
    where = {**params, "model_type": f"{cfg.get('model_type')}'s {source}"}
    if kind == "linear":
        return RopeConfig("half", rotary_dim, theta, "linear", _number(where, "factor"))
    if kind == "llama3":
        return RopeConfig(
            "half",
            rotary_dim,
            theta,
            "llama3",
            _number(where, "factor"),
            _number(where, "low_freq_factor"),
            _number(where, "high_freq_factor"),
            _int(where, "original_max_position_embeddings"),
        )
    raise AttentionConfigError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")


LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(cfg: Mapping[str, Any]) -> list[str] | None:
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or not all(isinstance(t, str) and t in LAYER_TYPES for t in types):
        raise AttentionConfigError(f"config field 'layer_types' must be a list of {' / '.join(LAYER_TYPES)}, got {types!r}"[:300])
    return types


def _window(cfg: Mapping[str, Any], family: str, layer: int) -> int | None:
    window = _int(cfg, "sliding_window", None)
    layer_types = _layer_types(cfg)
    if window is None:
        return None
    if family in ("qwen2", "qwen3") and not _flag(cfg, "use_sliding_window", False):
        return None
    if layer_types is not None:
        if not 0 <= layer < len(layer_types):
            raise AttentionConfigError(f"layer {layer} is out of range for {len(layer_types)} layer_types")
        return window if layer_types[layer] == "sliding_attention" else None
    if family in ("qwen2", "qwen3"):
        return window if layer >= _int(cfg, "max_window_layers", 0, least=0) else None
    if family == "gemma2":
        return window if layer % 2 == 0 else None  # even layers slide, odd layers are global
    return window


def attention_config_from_hf(config: Mapping[str, Any] | str | Path | Any, layer: int = 0) -> AttentionConfig:
    """The :class:`AttentionConfig` of layer ``layer`` of a transformers model config.

    An unknown ``model_type`` raises :class:`UnknownNameError` listing :data:`HF_FAMILIES`.
    """
    cfg = read_hf_config(config)
    family = cfg.get("model_type")
    if family not in HF_FAMILIES:
        raise UnknownNameError("model_type", str(family), HF_FAMILIES)
    d_model = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    if family == "falcon":
        if _flag(cfg, "alibi", False):
            raise AttentionConfigError("Falcon with alibi=True is not supported yet (ALiBi biases); rotary Falcon models are")
        kv_heads = (
            _int(cfg, "num_kv_heads", heads) if _flag(cfg, "new_decoder_architecture", False) else (1 if _flag(cfg, "multi_query", True) else heads)
        )
    head_dim = _int(cfg, "head_dim", max(d_model // heads, 1))
    biases: tuple[str, ...] | None = None  # None: all four projections follow `bias`
    bias = family == "gpt2"
    if family == "qwen2":
        biases = ("q_proj", "k_proj", "v_proj")
    elif _flag(cfg, "attention_bias", family == "gpt_neox") or (family == "falcon" and _flag(cfg, "bias", False)):
        bias = True
    scale = None
    if family == "gpt2":
        if _flag(cfg, "scale_attn_by_inverse_layer_idx", False):
            raise AttentionConfigError("GPT-2 with scale_attn_by_inverse_layer_idx=True is not supported (a per-layer attention scale)")
        scale = None if _flag(cfg, "scale_attn_weights", True) else 1.0
    softcap = None
    qk_norm = None
    if family == "gemma2":
        scale = _number(cfg, "query_pre_attn_scalar", head_dim) ** -0.5
        softcap = _number(cfg, "attn_logit_softcapping", None)
    if family == "qwen3":
        qk_norm = _number(cfg, "rms_norm_eps", 1e-6)
    return AttentionConfig(
        d_model,
        heads,
        kv_heads,
        head_dim=head_dim,
        causal=True,
        bias=bias,
        scale=scale,
        sliding_window=_window(cfg, family, layer),
        softcap=softcap,
        rope=None if family == "gpt2" else _rope(cfg, head_dim),  # GPT-2 adds learned positions to the embeddings instead
        biases=biases,
        qk_norm_eps=qk_norm,
    )


HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu"}
"""transformers' ``hidden_act`` names and graphc's activation for each."""


def decoder_config_from_hf(config: Mapping[str, Any] | str | Path | Any, layer: int = 0) -> DecoderConfig:
    """The :class:`DecoderConfig` of layer ``layer`` (norms, MLP and attention) of a transformers model config."""
    cfg = read_hf_config(config)
    attention = attention_config_from_hf(cfg, layer)
    family = cfg["model_type"]
    if family == "falcon":
        new_arch = _flag(cfg, "new_decoder_architecture", False)
        norms = _int(cfg, "num_ln_in_parallel_attn", None, most=2) or (2 if new_arch else 1)
        return DecoderConfig(
            attention,
            _int(cfg, "ffn_hidden_size", 4 * attention.d_model),
            mlp="plain",
            activation=_activation(cfg, "activation", "gelu"),
            norm="layer",
            norm_eps=_number(cfg, "layer_norm_epsilon", 1e-5),
            mlp_bias=_flag(cfg, "bias", False),
            parallel=new_arch or _flag(cfg, "parallel_attn", True),
            parallel_norms=norms if new_arch else 1,
        )
    if family in ("gpt2", "gpt_neox"):
        parallel = family == "gpt_neox" and _flag(cfg, "use_parallel_residual", True)
        return DecoderConfig(
            attention,
            _int(cfg, "intermediate_size", 4 * attention.d_model),
            mlp="plain",
            activation=_activation(cfg, "activation_function" if family == "gpt2" else "hidden_act", "gelu_new" if family == "gpt2" else "gelu"),
            norm="layer",
            norm_eps=_number(cfg, "layer_norm_epsilon" if family == "gpt2" else "layer_norm_eps", 1e-5),
            mlp_bias=True,
            parallel=parallel,
            parallel_norms=2 if parallel else 1,
        )
    key = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
    return DecoderConfig(
        attention,
        _int(cfg, "intermediate_size"),
        mlp="gated",
        activation=_activation(cfg, key, "silu"),
        norm="rms",
        norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
        norm_offset=1.0 if family == "gemma2" else 0.0,
        sandwich_norms=family == "gemma2",
        mlp_bias=_flag(cfg, "mlp_bias", False),
    )


def _activation(cfg: Mapping[str, Any], key: str, default: str) -> str:
    act = _get(cfg, key, str, default)
    if act not in HF_ACTIVATIONS:
        raise UnknownNameError(f"config field {key!r} value", str(act), tuple(HF_ACTIVATIONS))
    return HF_ACTIVATIONS[act]


def decoder_configs_from_hf(config: Mapping[str, Any] | str | Path | Any, n_layers: int | None = None) -> list[DecoderConfig]:
    """One :class:`DecoderConfig` per layer (``num_hidden_layers``, or the first ``n_layers``): windows may alternate."""
    cfg = read_hf_config(config)
    total = _int(cfg, "num_hidden_layers", most=MAX_LAYERS)
    n = total if n_layers is None else n_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= total:
        raise AttentionConfigError(f"n_layers must be an int in 1..{total} (num_hidden_layers), got {n!r}")
    return [decoder_config_from_hf(cfg, i) for i in range(n)]


def decoder_weights_from_hf(weights: Mapping[str, Any], config: Mapping[str, Any] | str | Path | Any) -> dict[str, Any]:
    """A checkpoint's tensors under graphc's names (``model.layers.{i}.self_attn.q_proj.weight`` ..., ``model.embed_tokens.weight``,
    ``model.norm.weight``, ``lm_head.weight``): Llama-like families pass through; Falcon, Phi-3, GPT-NeoX and GPT-2 are renamed and
    their fused tensors split (:mod:`graphc.attention.hf_weights`)."""
    cfg = read_hf_config(config)
    family = cfg.get("model_type")
    bad = [k for k in weights if not isinstance(k, str)]
    if bad:
        raise WeightError(f"weight names must be strings, got {type(bad[0]).__name__} {bad[0]!r}")
    # rotary tables older checkpoints saved as buffers: recomputed from the config, as transformers does
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if family not in ("falcon", "phi3", "gpt_neox", "gpt2"):
        return dict(weights)
    a = attention_config_from_hf(cfg)
    if family == "falcon":
        return rename_falcon(weights, a.n_heads, a.n_kv_heads, a.hd, bool(cfg.get("new_decoder_architecture")))
    if family == "phi3":
        return rename_phi3(weights, a.n_heads, a.n_kv_heads, a.hd, _int(cfg, "intermediate_size"))
    if family == "gpt_neox":
        return rename_gpt_neox(weights, a.n_heads, a.hd)
    return rename_gpt2(weights, a.d_model)
