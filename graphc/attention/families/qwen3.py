"""Qwen3 (``model_type: qwen3``): RMS norms on q and k per head (``rms_norm_eps``), Qwen2's windows, no biases."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..hf_fields import number_field
from .base import register_family
from .qwen2 import QwenWindows

__all__ = ["Qwen3", "QWEN3"]


@dataclass(frozen=True)
class Qwen3(QwenWindows):
    """Qwen3: q/k norms."""

    def attention_fields(self, cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
        """Llama's, with q/k RMS norms."""
        return {**super().attention_fields(cfg, head_dim), "qk_norm_eps": number_field(cfg, "rms_norm_eps", 1e-6)}


QWEN3 = register_family(Qwen3("qwen3"))
