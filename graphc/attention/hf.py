"""Attention configs from transformers model configs (``config.json``), without transformers or the hub.

``attention_config_from_hf(config, layer=0)`` reads the fields a family uses
for its attention: head counts and head dim, RoPE (``rope_parameters`` as
transformers 5 writes it, or ``rope_theta`` + ``rope_scaling`` as older
``config.json`` files do), sliding windows (per layer where a family alternates
them), logit softcap, the attention scale and which projections have a bias.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphc.errors import AttentionConfigError, SerializationError, UnknownNameError, WeightError

from .config import AttentionConfig, RopeConfig
from .decoder import DecoderConfig

__all__ = ["attention_config_from_hf", "decoder_config_from_hf", "decoder_weights_from_hf", "decoder_configs_from_hf", "read_hf_config", "HF_FAMILIES", "HF_ACTIVATIONS"]

HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "falcon")
"""``model_type`` values whose attention graphc builds from a transformers config."""


def read_hf_config(config: Mapping[str, Any] | str | Path | Any) -> dict[str, Any]:
    """A transformers config as a plain dict: from a dict, a ``config.json`` path, or a ``PretrainedConfig``."""
    if isinstance(config, (str, Path)):
        try:
            doc = json.loads(Path(config).read_text(encoding="utf-8"))
        except OSError as e:
            raise SerializationError(f"cannot read config {str(config)!r}: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise SerializationError(f"{config}: not a JSON config: {e}") from None
        if not isinstance(doc, dict):
            raise SerializationError(f"{config}: a config.json holds a JSON object, got {type(doc).__name__}")
        return doc
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    raise AttentionConfigError(f"expected a config dict, a config.json path or a transformers config, got {type(config).__name__}")


def _get(cfg: Mapping[str, Any], key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise AttentionConfigError(f"config of model_type {cfg.get('model_type')!r} lacks {key!r}")
        return default
    v = cfg[key]
    if isinstance(v, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)) or not isinstance(v, typ):
        raise AttentionConfigError(f"config field {key!r} must be {typ}, got {type(v).__name__} {v!r}")
    return v


def _rope(cfg: Mapping[str, Any], head_dim: int) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    if not params:  # older config.json: rope_theta and rope_scaling
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = None if partial == 1.0 else int(head_dim * partial)
    if kind == "default":
        return RopeConfig("half", rotary_dim, theta)
    if kind == "linear":
        return RopeConfig("half", rotary_dim, theta, "linear", float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            "half",
            rotary_dim,
            theta,
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    raise AttentionConfigError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")


def _window(cfg: Mapping[str, Any], family: str, layer: int) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    layer_types = cfg.get("layer_types")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    if layer_types is not None:
        if not 0 <= layer < len(layer_types):
            raise AttentionConfigError(f"layer {layer} is out of range for {len(layer_types)} layer_types")
        return int(window) if layer_types[layer] == "sliding_attention" else None
    if family in ("qwen2", "qwen3"):
        return int(window) if layer >= int(cfg.get("max_window_layers", 0)) else None
    if family == "gemma2":
        return int(window) if layer % 2 == 0 else None  # even layers slide, odd layers are global
    return int(window)


def attention_config_from_hf(config: Mapping[str, Any] | str | Path | Any, layer: int = 0) -> AttentionConfig:
    """The :class:`AttentionConfig` of layer ``layer`` of a transformers model config.

    An unknown ``model_type`` raises :class:`UnknownNameError` listing :data:`HF_FAMILIES`.
    """
    cfg = read_hf_config(config)
    family = cfg.get("model_type")
    if family not in HF_FAMILIES:
        raise UnknownNameError("model_type", str(family), HF_FAMILIES)
    d_model = _get(cfg, "hidden_size", int)
    heads = _get(cfg, "num_attention_heads", int)
    kv_heads = _get(cfg, "num_key_value_heads", int, heads)
    if family == "falcon":
        if cfg.get("alibi"):
            raise AttentionConfigError("Falcon with alibi=True is not supported yet (ALiBi biases); rotary Falcon models are")
        kv_heads = _get(cfg, "num_kv_heads", int, heads) if cfg.get("new_decoder_architecture") else (1 if cfg.get("multi_query", True) else heads)
    head_dim = _get(cfg, "head_dim", int, d_model // heads if heads else 0)
    biases: tuple[str, ...] | None = None  # None: all four projections follow `bias`
    bias = False
    if family == "qwen2":
        biases = ("q_proj", "k_proj", "v_proj")
    elif _get(cfg, "attention_bias", bool, False) or (family == "falcon" and _get(cfg, "bias", bool, False)):
        bias = True
    scale = None
    softcap = None
    qk_norm = None
    if family == "gemma2":
        scale = float(_get(cfg, "query_pre_attn_scalar", (int, float), head_dim)) ** -0.5
        softcap = cfg.get("attn_logit_softcapping")
    if family == "qwen3":
        qk_norm = float(_get(cfg, "rms_norm_eps", (int, float), 1e-6))
    return AttentionConfig(
        d_model,
        heads,
        kv_heads,
        head_dim=head_dim,
        causal=True,
        bias=bias,
        scale=scale,
        sliding_window=_window(cfg, family, layer),
        softcap=None if softcap is None else float(softcap),
        rope=_rope(cfg, head_dim),
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
        new_arch = bool(cfg.get("new_decoder_architecture"))
        norms = cfg.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)
        return DecoderConfig(
            attention,
            _get(cfg, "ffn_hidden_size", int, 4 * attention.d_model),
            mlp="plain",
            activation=HF_ACTIVATIONS[cfg.get("activation") or "gelu"],
            norm="layer",
            norm_eps=float(_get(cfg, "layer_norm_epsilon", (int, float), 1e-5)),
            mlp_bias=bool(cfg.get("bias", False)),
            parallel=new_arch or bool(cfg.get("parallel_attn", True)),
            parallel_norms=int(norms) if new_arch else 1,
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in HF_ACTIVATIONS:
        raise UnknownNameError("hidden_act", str(act), tuple(HF_ACTIVATIONS))
    return DecoderConfig(
        attention,
        _get(cfg, "intermediate_size", int),
        mlp="gated",
        activation=HF_ACTIVATIONS[act],
        norm="rms",
        norm_eps=float(_get(cfg, "rms_norm_eps", (int, float), 1e-6)),
        norm_offset=1.0 if family == "gemma2" else 0.0,
        sandwich_norms=family == "gemma2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def decoder_configs_from_hf(config: Mapping[str, Any] | str | Path | Any, n_layers: int | None = None) -> list[DecoderConfig]:
    """One :class:`DecoderConfig` per layer (``num_hidden_layers``, or the first ``n_layers``): windows may alternate."""
    cfg = read_hf_config(config)
    total = int(_get(cfg, "num_hidden_layers", int))
    n = total if n_layers is None else n_layers
    if not 1 <= n <= total:
        raise AttentionConfigError(f"n_layers must be in 1..{total} (num_hidden_layers), got {n}")
    return [decoder_config_from_hf(cfg, i) for i in range(n)]


def decoder_weights_from_hf(weights: Mapping[str, Any], config: Mapping[str, Any] | str | Path | Any) -> dict[str, Any]:
    """A checkpoint's tensors under graphc's decoder names (``model.layers.{i}.self_attn.q_proj.weight`` ...).

    Llama-like families already use those names and pass through.  Falcon's
    ``transformer.h.{i}.self_attention.query_key_value`` is split into q/k/v in
    its layout (per-head ``[q, k, v]`` for MHA; all queries then one key and one
    value for multi-query; per KV group ``[queries..., key, value]`` for the
    new decoder architecture), ``dense``/``dense_h_to_4h``/``dense_4h_to_h``
    become ``o_proj``/``mlp.up_proj``/``mlp.down_proj``, ``ln_attn``/``ln_mlp``
    become ``input_layernorm``/``post_attention_layernorm`` and ``ln_f`` is ``model.norm``.
    """
    cfg = read_hf_config(config)
    if cfg.get("model_type") != "falcon":
        return dict(weights)
    attention = attention_config_from_hf(cfg)
    heads, kv, hd = attention.n_heads, attention.n_kv_heads, attention.hd
    group = heads // kv
    new_arch = bool(cfg.get("new_decoder_architecture"))
    rename = {"self_attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj",
              "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm", "input_layernorm": "input_layernorm",
              "post_attention_layernorm": "post_attention_layernorm"}
    out: dict[str, Any] = {}
    for name, arr in weights.items():
        if name.startswith("transformer.ln_f."):
            out["model.norm." + name.split(".")[-1]] = arr
            continue
        if not name.startswith("transformer.h."):
            continue
        layer, rest = name[len("transformer.h.") :].split(".", 1)
        module, kind = rest.rsplit(".", 1)
        prefix = f"model.layers.{layer}."
        if module == "self_attention.query_key_value":
            rows = arr.reshape(-1, hd, *arr.shape[1:])  # one row block per head slot
            if new_arch:
                slots = rows.reshape(kv, group + 2, hd, *arr.shape[1:])
                parts = (slots[:, :group], slots[:, group], slots[:, group + 1])
            elif kv == 1:
                parts = (rows[:heads], rows[heads], rows[heads + 1])
            else:
                slots = rows.reshape(heads, 3, hd, *arr.shape[1:])
                parts = (slots[:, 0], slots[:, 1], slots[:, 2])
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{prefix}self_attn.{proj}.{kind}"] = part.reshape(-1, *arr.shape[1:])
        elif module in rename:
            out[f"{prefix}{rename[module]}.{kind}"] = arr
        else:
            raise WeightError(f"tensor {name!r}: no graphc name for Falcon module {module!r}")
    return out
