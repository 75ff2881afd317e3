"""Gemma 2 (``model_type: gemma2``): attention scale from ``query_pre_attn_scalar``, logit softcaps, alternating windows,
``(1 + weight)`` RMS norms before and after each block, embeddings scaled by ``sqrt(hidden)``, a tied head."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..config import AttentionConfig
from ..decoder import DecoderConfig
from ..hf_fields import number_field
from .base import Family, register_family

__all__ = ["Gemma2", "GEMMA2"]


@dataclass(frozen=True)
class Gemma2(Family):
    """Gemma 2's quirks over Llama's layout."""

    def attention_fields(self, cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
        """Scale ``query_pre_attn_scalar ** -0.5`` and the attention logit softcap."""
        return {
            **super().attention_fields(cfg, head_dim),
            "scale": number_field(cfg, "query_pre_attn_scalar", head_dim) ** -0.5,
            "softcap": number_field(cfg, "attn_logit_softcapping", None),
        }

    def window_without_layer_types(self, cfg: Mapping[str, Any], layer: int, window: int) -> int | None:
        """Even layers slide, odd layers are global."""
        return window if layer % 2 == 0 else None

    def decoder(self, cfg: Mapping[str, Any], attention: AttentionConfig) -> DecoderConfig:
        """Llama's layer with ``(1 + weight)`` norms, before and after each block."""
        return replace(super().decoder(cfg, attention), norm_offset=1.0, sandwich_norms=True)

    def lm_fields(self, cfg: Mapping[str, Any], d_model: int) -> dict[str, Any]:
        """Embeddings times ``sqrt(hidden)``; the final logit softcap."""
        return {"embedding_scale": math.sqrt(d_model), "final_logit_softcap": number_field(cfg, "final_logit_softcapping", None)}


GEMMA2 = register_family(Gemma2("gemma2", tied_by_default=True))
