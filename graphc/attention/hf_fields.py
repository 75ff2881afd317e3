"""Typed, range-checked reads of transformers ``config.json`` fields, shared by :mod:`graphc.attention.hf` and the family modules.

Every reader raises :class:`~graphc.errors.AttentionConfigError` naming the field and what it must be
(``sliding_window: 4.7`` is an error, not 4).  ``default=...`` (the default) makes a field required.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from graphc.errors import AttentionConfigError, UnknownNameError

from .config import RopeConfig

__all__ = ["field", "int_field", "number_field", "flag", "activation", "rope_config", "layer_types", "HF_ACTIVATIONS", "LAYER_TYPES"]

HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu"}
"""transformers' ``hidden_act`` names and graphc's activation for each."""

LAYER_TYPES = ("full_attention", "sliding_attention")
"""The values of a config's ``layer_types`` list."""


def field(cfg: Mapping[str, Any], key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
    """``cfg[key]`` checked to be of ``typ`` (a bool is not an int); ``default`` when absent or null (required when ``...``)."""
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


def int_field(cfg: Mapping[str, Any], key: str, default: Any = ..., least: int = 1, most: int | None = None) -> Any:
    """An int field in ``least..most`` (a float such as ``4.7`` is refused, not truncated); ``default`` when absent."""
    v = field(cfg, key, int, default)
    if v is None:
        return v
    if v < least or most is not None and v > most:
        bound = f"{least}..{most}" if most is not None else f">= {least}"
        raise AttentionConfigError(f"config field {key!r} must be an int {bound}, got {v!r}")
    return int(v)


def number_field(cfg: Mapping[str, Any], key: str, default: Any = ..., positive: bool = True) -> Any:
    """A finite number field (> 0 unless ``positive=False``); ``default`` when absent."""
    v = field(cfg, key, (int, float), default)
    if v is None:
        return v
    if not math.isfinite(v) or positive and v <= 0:
        raise AttentionConfigError(f"config field {key!r} must be a finite number{' > 0' if positive else ''}, got {v!r}")
    return float(v)


def flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """A bool field."""
    return bool(field(cfg, key, bool, default))


def activation(cfg: Mapping[str, Any], key: str, default: str) -> str:
    """graphc's name of the activation a field names (:data:`HF_ACTIVATIONS`)."""
    act = field(cfg, key, str, default)
    if act not in HF_ACTIVATIONS:
        raise UnknownNameError(f"config field {key!r} value", str(act), tuple(HF_ACTIVATIONS))
    return HF_ACTIVATIONS[act]


def layer_types(cfg: Mapping[str, Any]) -> list[str] | None:
    """The ``layer_types`` list (``full_attention`` / ``sliding_attention`` per layer), or None."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or not all(isinstance(t, str) and t in LAYER_TYPES for t in types):
        raise AttentionConfigError(f"config field 'layer_types' must be a list of {' / '.join(LAYER_TYPES)}, got {types!r}"[:300])
    return types


def rope_config(cfg: Mapping[str, Any], head_dim: int) -> RopeConfig:
    """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older files): default, linear, llama3."""
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
    theta = number_field(params, "rope_theta", None) or number_field(cfg, "rope_theta", 10000.0)
    partial = number_field(cfg, "partial_rotary_factor", None) or number_field(params, "partial_rotary_factor", 1.0)
    if partial > 1.0:
        raise AttentionConfigError(f"config field 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    rotary_dim = None if partial == 1.0 else int(head_dim * partial)
    if kind == "default":
        return RopeConfig("half", rotary_dim, theta)
    where = {**params, "model_type": f"{cfg.get('model_type')}'s {source}"}
    if kind == "linear":
        return RopeConfig("half", rotary_dim, theta, "linear", number_field(where, "factor"))
    if kind == "llama3":
        return RopeConfig(
            "half",
            rotary_dim,
            theta,
            "llama3",
            number_field(where, "factor"),
            number_field(where, "low_freq_factor"),
            number_field(where, "high_freq_factor"),
            int_field(where, "original_max_position_embeddings"),
        )
    raise AttentionConfigError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")
