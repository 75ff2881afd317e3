"""Qwen2 (``model_type: qwen2``): q/k/v biases (no o_proj bias); windows only with ``use_sliding_window``, from ``max_window_layers`` on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..hf_fields import flag, int_field
from .base import Family, register_family

__all__ = ["QwenWindows", "Qwen2", "QWEN2"]


@dataclass(frozen=True)
class QwenWindows(Family):
    """Qwen's windows: none unless ``use_sliding_window``; without ``layer_types``, layers from ``max_window_layers`` on slide."""

    def window(self, cfg: Mapping[str, Any], layer: int, window: int) -> int | None:
        """No window unless the config turns windows on."""
        if not flag(cfg, "use_sliding_window", False):
            return None
        return super().window(cfg, layer, window)

    def window_without_layer_types(self, cfg: Mapping[str, Any], layer: int, window: int) -> int | None:
        """Layers from ``max_window_layers`` on slide."""
        return window if layer >= int_field(cfg, "max_window_layers", 0, least=0) else None


@dataclass(frozen=True)
class Qwen2(QwenWindows):
    """Qwen2: biases on the q, k and v projections."""

    def attention_fields(self, cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
        """Llama's, with biases on q/k/v only."""
        return {**super().attention_fields(cfg, head_dim), "bias": False, "biases": ("q_proj", "k_proj", "v_proj")}


QWEN2 = register_family(Qwen2("qwen2"))
