"""A transformers model family as an object, and the registry that finds it by ``model_type``.

A :class:`Family` says how one family's ``config.json`` and tensor names map onto
graphc's decoder: its KV heads, the attention fields (biases, scale, softcap, q/k norms,
RoPE), its sliding windows, the decoder layer (norms, MLP, residuals), what sits around
the stack (embedding scale, learned positions, final softcap, a tied head by default) and
its weight-name table.  The defaults are Llama's; each family module overrides what differs
and registers one instance (:func:`register_family`).  ``graphc.attention.hf`` asks the
registry and holds no per-family branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from graphc.errors import AttentionConfigError, UnknownNameError

from ..config import AttentionConfig
from ..decoder import DecoderConfig
from ..hf_fields import activation, flag, int_field, layer_types, number_field, rope_config

__all__ = ["Family", "register_family", "unregister_family", "family_names", "get_family", "layer_norm_decoder"]


@dataclass(frozen=True)
class Family:
    """One transformers model family (``model_type``); every method has Llama's behaviour unless a family overrides it."""

    model_type: str
    tied_by_default: bool = False
    """``tie_word_embeddings`` when ``config.json`` does not say (transformers' config default)."""
    aliases: tuple[tuple[str, str], ...] = ()
    """Older or family-specific ``config.json`` field names and the names graphc reads them under."""

    def canonical(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """``cfg`` with :attr:`aliases` copied to the names graphc reads (where those are absent)."""
        for old, new in self.aliases:
            if cfg.get(new) is None and cfg.get(old) is not None:
                cfg[new] = cfg[old]
        return cfg

    def kv_heads(self, cfg: Mapping[str, Any], heads: int) -> int:
        """The number of KV heads."""
        return int(int_field(cfg, "num_key_value_heads", heads))

    def attention_fields(self, cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
        """The :class:`AttentionConfig` fields beyond the head geometry: ``bias``, ``biases``, ``scale``, ``softcap``, ``rope``, ``qk_norm_eps``."""
        return {"bias": flag(cfg, "attention_bias", False), "rope": rope_config(cfg, head_dim)}

    def window(self, cfg: Mapping[str, Any], layer: int, window: int) -> int | None:
        """Layer ``layer``'s sliding window, given the config's ``sliding_window``: per ``layer_types`` where the config lists them."""
        types = layer_types(cfg)
        if types is None:
            return self.window_without_layer_types(cfg, layer, window)
        if not 0 <= layer < len(types):
            raise AttentionConfigError(f"layer {layer} is out of range for {len(types)} layer_types")
        return window if types[layer] == "sliding_attention" else None

    def window_without_layer_types(self, cfg: Mapping[str, Any], layer: int, window: int) -> int | None:
        """The window when the config has no ``layer_types``: every layer slides."""
        return window

    def decoder(self, cfg: Mapping[str, Any], attention: AttentionConfig) -> DecoderConfig:
        """The decoder layer around ``attention``: RMS norms and a gated MLP."""
        key = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
        return DecoderConfig(
            attention,
            int_field(cfg, "intermediate_size"),
            mlp="gated",
            activation=activation(cfg, key, "silu"),
            norm="rms",
            norm_eps=number_field(cfg, "rms_norm_eps", 1e-6),
            mlp_bias=flag(cfg, "mlp_bias", False),
        )

    def lm_fields(self, cfg: Mapping[str, Any], d_model: int) -> dict[str, Any]:
        """:class:`~graphc.attention.CausalLMConfig` fields around the stack (``embedding_scale``, ``final_logit_softcap``,
        ``position_embeddings``): none for Llama."""
        return {}

    @property
    def renames_weights(self) -> bool:
        """True when the family's tensor names are not graphc's (Llama's) and :meth:`rename` maps them."""
        return type(self).rename is not Family.rename

    def rename(self, weights: Mapping[str, Any], cfg: Mapping[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        """The checkpoint's tensors under graphc's names (Llama's names: as they are)."""
        return dict(weights)


def layer_norm_decoder(
    attention: AttentionConfig, intermediate: int, act: str, eps: float, mlp_bias: bool, parallel: bool, parallel_norms: int
) -> DecoderConfig:
    """The GPT-style layer: LayerNorms and a plain (ungated) MLP, attention and MLP in parallel or one after the other."""
    return DecoderConfig(
        attention, intermediate, mlp="plain", activation=act, norm="layer", norm_eps=eps, mlp_bias=mlp_bias,
        parallel=parallel, parallel_norms=parallel_norms,
    )  # fmt: skip


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add (or replace) ``family`` under its ``model_type``; returns it."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family takes a Family, got {type(family).__name__}")
    _FAMILIES[family.model_type] = family
    return family


def unregister_family(model_type: str) -> None:
    """Remove a family (an unknown name is ignored)."""
    _FAMILIES.pop(model_type, None)


def family_names() -> tuple[str, ...]:
    """The ``model_type`` values graphc builds, in the order they were registered."""
    return tuple(_FAMILIES)


def get_family(model_type: Any) -> Family:
    """The family of ``model_type``; an unknown one raises :class:`UnknownNameError` listing :func:`family_names`."""
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnknownNameError("model_type", str(model_type), family_names())
    return family
