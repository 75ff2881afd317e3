"""Encoder stacks from a transformers checkpoint: BERT, DistilBERT and ViT, as einsum and elementwise nodes.

:func:`encoder_config_from_hf` reads a ``config.json`` (its dict) into a frozen :class:`EncoderConfig`;
:func:`encoder_stack_graph` builds the whole encoder, embeddings to ``last_hidden_state``, with the checkpoint's
tensors (its safetensors, memory-mapped: :func:`graphc.weights.load_weights`) renamed, not copied.  Every attention is
non-causal self-attention (one ``Attention`` op once optimized); BERT and DistilBERT take ``input_ids`` and
``attention_mask`` ``[batch, seq]`` (1 keeps a token; token types all 0, as transformers defaults them), ViT takes
``pixel_values [batch, channels, image, image]`` at the config's image size.  BERT and DistilBERT normalise after each
residual (post-norm), ViT before (pre-norm, with a final ``layernorm``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphc.errors import WeightError
from graphc.graph import Graph, Value
from graphc.tensor_ops import BroadcastTo, Gather, Slice

from .blocks import layer_norm, plain_mlp
from .builders import declare_weights, weight_shapes, write_self_attention
from .config import AttentionConfig
from .hf import read_hf_config

__all__ = ["ENCODER_FAMILIES", "EncoderConfig", "encoder_config_from_hf", "encoder_from_hf", "encoder_stack_graph", "encoder_weights_from_hf"]

ENCODER_FAMILIES = ("bert", "distilbert", "vit")
"""The ``model_type`` values :func:`encoder_config_from_hf` reads."""

_LAYER_NAMES = {
    "bert": {
        "self_attn.q_proj": "attention.self.query",
        "self_attn.k_proj": "attention.self.key",
        "self_attn.v_proj": "attention.self.value",
        "self_attn.o_proj": "attention.output.dense",
        "attn_norm": "attention.output.LayerNorm",
        "mlp.up_proj": "intermediate.dense",
        "mlp.down_proj": "output.dense",
        "mlp_norm": "output.LayerNorm",
    },
    "distilbert": {
        "self_attn.q_proj": "attention.q_lin",
        "self_attn.k_proj": "attention.k_lin",
        "self_attn.v_proj": "attention.v_lin",
        "self_attn.o_proj": "attention.out_lin",
        "attn_norm": "sa_layer_norm",
        "mlp.up_proj": "ffn.lin1",
        "mlp.down_proj": "ffn.lin2",
        "mlp_norm": "output_layer_norm",
    },
    "vit": {
        "self_attn.q_proj": "attention.attention.query",
        "self_attn.k_proj": "attention.attention.key",
        "self_attn.v_proj": "attention.attention.value",
        "self_attn.o_proj": "attention.output.dense",
        "attn_norm": "layernorm_before",
        "mlp.up_proj": "intermediate.dense",
        "mlp.down_proj": "output.dense",
        "mlp_norm": "layernorm_after",
    },
}
"""graphc's name of each layer tensor (before ``.weight``/``.bias``) -> transformers' (under the layer's prefix)."""
_LAYER_PREFIX = {"bert": "encoder.layer.", "distilbert": "transformer.layer.", "vit": "encoder.layer."}
_EMBEDDINGS = {
    "bert": {
        "embed.tokens": "embeddings.word_embeddings.weight",
        "embed.positions": "embeddings.position_embeddings.weight",
        "embed.token_types": "embeddings.token_type_embeddings.weight",
        "embed.norm.weight": "embeddings.LayerNorm.weight",
        "embed.norm.bias": "embeddings.LayerNorm.bias",
    },
    "distilbert": {
        "embed.tokens": "embeddings.word_embeddings.weight",
        "embed.positions": "embeddings.position_embeddings.weight",
        "embed.norm.weight": "embeddings.LayerNorm.weight",
        "embed.norm.bias": "embeddings.LayerNorm.bias",
    },
    "vit": {
        "embed.class_token": "embeddings.cls_token",
        "embed.positions": "embeddings.position_embeddings",
        "embed.patches.weight": "embeddings.patch_embeddings.projection.weight",
        "embed.patches.bias": "embeddings.patch_embeddings.projection.bias",
        "final_norm.weight": "layernorm.weight",
        "final_norm.bias": "layernorm.bias",
    },
}
"""graphc's name of each embedding (and final) tensor -> transformers'."""


@dataclass(frozen=True)
class EncoderConfig:
    """One encoder: its family, layer count, attention, MLP width and activation, norm epsilon, and what embeds its input
    (a vocabulary and position table for text; the image, its patches and channels for ViT)."""

    family: str
    layers: int
    attention: AttentionConfig
    intermediate: int
    activation: str = "gelu"
    norm_eps: float = 1e-12
    vocab: int = 0
    max_positions: int = 0
    image_size: int = 0
    patch_size: int = 0
    channels: int = 3

    @property
    def pre_norm(self) -> bool:
        """Whether each block normalises its input (ViT) rather than its residual sum (BERT, DistilBERT)."""
        return self.family == "vit"


def _number(hf: Mapping[str, object], family: str, names: tuple[str, ...], default: float | None = None) -> float:
    """The first of ``names`` that ``hf`` sets, as a number (``default`` where none is, else an error)."""
    for n in names:
        value = hf.get(n)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    if default is None:
        raise WeightError(f"config.json of a {family} model sets none of {', '.join(names)}")
    return default


def encoder_config_from_hf(config: Mapping[str, Any] | str | Path | Any) -> EncoderConfig:
    """The :class:`EncoderConfig` of a transformers config (a dict, a ``config.json`` path or a ``PretrainedConfig``)
    whose ``model_type`` is in :data:`ENCODER_FAMILIES`."""
    hf = read_hf_config(config)
    family = str(hf.get("model_type"))
    if family not in ENCODER_FAMILIES:
        raise WeightError(f"model_type {family!r} is not an encoder graphc builds; supported: {', '.join(ENCODER_FAMILIES)}")

    def count(*names: str, default: int | None = None) -> int:
        return int(_number(hf, family, names, default))

    act = str(hf.get("hidden_act") or hf.get("activation") or "gelu")
    if act != "gelu":
        raise WeightError(f"{family} with activation {act!r}: graphc builds the erf 'gelu' these encoders use")
    d_model, heads = count("hidden_size", "dim"), count("num_attention_heads", "n_heads")
    return EncoderConfig(
        family=family,
        layers=count("num_hidden_layers", "n_layers"),
        attention=AttentionConfig(d_model, heads, heads, causal=False, bias=True),
        intermediate=count("intermediate_size", "hidden_dim"),
        norm_eps=float(_number(hf, family, ("layer_norm_eps",), 1e-12)),
        vocab=count("vocab_size", default=0),
        max_positions=count("max_position_embeddings", default=0),
        image_size=count("image_size", default=0),
        patch_size=count("patch_size", default=0),
        channels=count("num_channels", default=3),
    )


def encoder_weights_from_hf(cfg: EncoderConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under graphc's names (``layers.{i}.self_attn.q_proj.weight`` ..., ``embed.*``), the
    arrays themselves (no copy); a model saved with its task head (``bert.``, ``distilbert.``, ``vit.`` prefixes) too.
    Every tensor the encoder needs must be there (the pooler and heads are left out)."""
    prefix = next((p for p in (f"{cfg.family}.", "") if any(k.startswith(p + "embeddings.") for k in tensors)), None)
    if prefix is None:
        raise WeightError(f"no {cfg.family} embeddings in the checkpoint (expected embeddings.* or {cfg.family}.embeddings.*)")
    names = dict(_EMBEDDINGS[cfg.family])
    for i in range(cfg.layers):
        for ours, theirs in _LAYER_NAMES[cfg.family].items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = f"{_LAYER_PREFIX[cfg.family]}{i}.{theirs}.{kind}"
    missing = sorted(theirs for theirs in names.values() if prefix + theirs not in tensors)
    if missing:
        raise WeightError(f"the {cfg.family} checkpoint lacks {len(missing)} tensor(s) the encoder needs, such as {', '.join(missing[:3])}")
    return {ours: tensors[prefix + theirs] for ours, theirs in names.items()}


def _text_embeddings(g: Graph, cfg: EncoderConfig) -> tuple[Value, Value]:
    """``input_ids`` and ``attention_mask`` in; the normalised sum of token, position (and type-0) embeddings, and the
    bool key mask ``[batch, 1, 1, seq]``."""
    ids = g.input("input_ids", ["batch", "seq"], "int64")
    keep = g.input("attention_mask", ["batch", "seq"], "int64")
    x = g.add_node(Gather(0), ["embed.tokens", ids], g.fresh_name("tokens_BSM"))
    positions = g.add_node(Slice(0, 0, "seq"), ["embed.positions"], g.fresh_name("positions_SM"))
    x = g.add(x, positions, name=g.fresh_name("embedded_BSM"))
    if cfg.family == "bert":  # token type 0 everywhere, transformers' default
        x = g.add(x, g.add_node(Gather(0), ["embed.token_types", g.constant(g.fresh_name("type_zero"), np.array(0, np.int64))], "type_M"))
    x = layer_norm(g, x, "embed.norm.weight", "embed.norm.bias", cfg.norm_eps, name="embed_norm_BSM")
    zero = g.constant(g.fresh_name("pad"), np.array(0, np.int64))
    mask = g.reshape(g.compare("greater", keep, zero, name="keep_BS"), ["batch", 1, 1, "seq"], name="keep_B11S")
    return x, mask


def _image_embeddings(g: Graph, cfg: EncoderConfig) -> Value:
    """``pixel_values`` in; the class token and the patches (a Conv with stride = kernel, as one einsum), plus positions."""
    side, p = cfg.image_size, cfg.patch_size
    if not side or not p or side % p:
        raise WeightError(f"a ViT of image size {side} and patch size {p}: the image must hold whole patches")
    n, d = side // p, cfg.attention.d_model
    pixels = g.input("pixel_values", ["batch", cfg.channels, side, side], g.types["embed.positions"].dtype)
    tiles = g.reshape(pixels, ["batch", cfg.channels, n, p, n, p], name="tiles_BCIPJQ")
    patches = g.einsum("bcipjq,dcpq->bijd", tiles, "embed.patches.weight", name="patches_BIJD")
    patches = g.add(g.reshape(patches, ["batch", n * n, d], name="patches_BND"), "embed.patches.bias", name="patches_biased_BND")
    cls = g.add_node(BroadcastTo(("batch", 1, d)), ["embed.class_token"], "class_token_B1D")
    x = g.concat([cls, patches], axis=1, name="tokens_BTD")
    return g.add(x, "embed.positions", name="embedded_BTD")


def _write_layer(g: Graph, cfg: EncoderConfig, x: Value, mask: Value | None) -> Value:
    """One encoder layer under the current scope: post-norm (BERT) or pre-norm (ViT) residual blocks."""
    norm = lambda v, name: layer_norm(g, v, f"{name}.weight", f"{name}.bias", cfg.norm_eps, name=g.fresh_name(f"{name}_out"))  # noqa: E731
    h = norm(x, "attn_norm") if cfg.pre_norm else x
    with g.scope("self_attn."):
        a = write_self_attention(g, cfg.attention, h, mask)
    h = g.add(x, a, name=g.fresh_name("residual_attn_BSM"))
    if not cfg.pre_norm:
        h = norm(h, "attn_norm")
    down = plain_mlp(g, norm(h, "mlp_norm") if cfg.pre_norm else h, "mlp.", cfg.activation, bias=True)
    out = g.add(h, down, name=g.fresh_name("residual_mlp_BSM"))
    return out if cfg.pre_norm else norm(out, "mlp_norm")


def encoder_stack_graph(cfg: EncoderConfig, weights: Mapping[str, np.ndarray], name: str | None = None) -> Graph:
    """The whole encoder of ``cfg``, its inputs to ``last_hidden_state [batch, seq, d_model]``, with ``weights`` under
    graphc's names (:func:`encoder_weights_from_hf`; their dtype is the graph's)."""
    g = Graph(name or f"{cfg.family}_encoder")
    declare_weights(g, sorted(k for k in weights if k.startswith(("embed.", "final_norm."))), weights)
    x, mask = (_image_embeddings(g, cfg), None) if cfg.family == "vit" else _text_embeddings(g, cfg)
    layer_names = [*(f"self_attn.{n}" for n in weight_shapes(cfg.attention))]
    layer_names += [f"{n}.{k}" for n in ("attn_norm", "mlp_norm", "mlp.up_proj", "mlp.down_proj") for k in ("weight", "bias")]
    for i in range(cfg.layers):
        with g.scope(f"layers.{i}."):
            declare_weights(g, layer_names, weights)
            x = _write_layer(g, cfg, x, mask)
    if cfg.family == "vit":
        x = layer_norm(g, x, "final_norm.weight", "final_norm.bias", cfg.norm_eps, name="final_norm_BTD")
    g.output(g.reshape(x, x.type.shape, name="last_hidden_state"))
    return g


def encoder_from_hf(config: Mapping[str, Any] | str | Path | Any, weights: Mapping[str, np.ndarray], name: str | None = None) -> Graph:
    """The encoder of a transformers checkpoint in one call: ``config`` as :func:`encoder_config_from_hf` takes it,
    ``weights`` the checkpoint's tensors (:func:`graphc.load_weights` of its folder: memory-mapped safetensors)."""
    cfg = encoder_config_from_hf(config)
    return encoder_stack_graph(cfg, encoder_weights_from_hf(cfg, weights), name)
