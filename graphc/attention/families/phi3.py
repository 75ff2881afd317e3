"""Phi-3 (``model_type: phi3``): Llama's layout with fused ``qkv_proj`` and ``gate_up_proj`` tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import AttentionConfig
from ..hf_fields import int_field
from ..hf_weights import split_rows
from .base import Family, register_family

__all__ = ["Phi3", "PHI3", "rename_phi3"]


@dataclass(frozen=True)
class Phi3(Family):
    """Phi-3's fused tensors."""

    def rename(self, weights: Mapping[str, Any], cfg: Mapping[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        """``qkv_proj`` and ``gate_up_proj`` split."""
        return rename_phi3(weights, attention.n_heads, attention.n_kv_heads, attention.hd, int_field(cfg, "intermediate_size"))


def rename_phi3(weights: Mapping[str, Any], heads: int, kv: int, hd: int, intermediate: int) -> dict[str, Any]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` split; every other name is already graphc's."""
    out: dict[str, Any] = {}
    for name, arr in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            stem = name[: -len("qkv_proj.weight")]
            q, k, v = split_rows(arr, [heads * hd, kv * hd, kv * hd])
            out.update({f"{stem}q_proj.weight": q, f"{stem}k_proj.weight": k, f"{stem}v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            stem = name[: -len("gate_up_proj.weight")]
            gate, up = split_rows(arr, [intermediate, intermediate])
            out.update({f"{stem}gate_proj.weight": gate, f"{stem}up_proj.weight": up})
        else:
            out[name] = arr
    return out


PHI3 = register_family(Phi3("phi3"))
