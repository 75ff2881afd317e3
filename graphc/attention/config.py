"""Attention layer configuration, model presets and layer statistics.

:class:`AttentionConfig` describes one attention layer (MHA, MQA or GQA); it is
validated on construction.  Query head ``h`` reads KV head ``h // group_size``
(consecutive groups, as ``torch.repeat_interleave`` and the ONNX ``Attention`` op).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from graphc.errors import AttentionConfigError, UnknownNameError
from graphc.ops import check_dtype
from graphc.rotary import Rotary

__all__ = ["AttentionConfig", "RopeConfig", "alibi_slopes", "PROJECTIONS", "Preset", "PRESETS", "preset", "preset_names", "mha", "mqa", "gqa"]


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


RopeConfig = Rotary
"""A layer's rotary embedding: the :class:`graphc.Rotary` op's settings (style, rotary_dim, base, scaling ...)."""


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes (the geometric sequence of the paper, interleaved for a non-power-of-two head count, as BLOOM and MPT)."""
    closest = 2 ** int(np.floor(np.log2(n_heads)))
    base = 2.0 ** (-(2.0 ** -(np.log2(closest) - 3)))
    slopes = base ** np.arange(1, closest + 1)
    if closest != n_heads:
        extra_base = 2.0 ** (-(2.0 ** -(np.log2(2 * closest) - 3)))
        remaining = min(closest, n_heads - closest)
        slopes = np.concatenate([slopes, extra_base ** np.arange(1, 1 + 2 * remaining, 2)])
    return slopes.astype(np.float32)


def _positive_int(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise AttentionConfigError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v <= 0:
        raise AttentionConfigError(f"{name} must be > 0, got {v}")


@dataclass(frozen=True)
class AttentionConfig:
    """One attention layer.

    ``d_model``: model width; ``n_heads``: query heads; ``n_kv_heads``: key/value
    heads (``n_heads`` for MHA, 1 for MQA, a divisor in between for GQA);
    ``head_dim`` defaults to ``d_model // n_heads``; ``scale`` defaults to
    ``head_dim ** -0.5``; ``bias`` adds biases to the four projections.
    ``dropout`` is recorded for fidelity but graphs are built for inference (no dropout).
    ``sliding_window``: each query sees its last ``sliding_window`` keys (with
    ``causal``; Mistral, Gemma 2).  Non-causal attention can be banded instead:
    ``sliding_window=W, right_window=R`` shows query i the keys
    ``i + o - W < j <= i + o + R`` (``o`` the cache offset).  ``softcap``: attention logits become
    ``softcap * tanh(logits / softcap)`` before masking (Gemma 2).  ``rope``:
    rotary embedding of queries and keys (:class:`RopeConfig`), positions
    counted from the KV cache's past length.  ``biases``: which projections
    have a bias, overriding ``bias`` (Qwen2: ``("q_proj", "k_proj", "v_proj")``).
    ``qk_norm_eps``: an RMSNorm over each head's queries and keys before RoPE
    (weights ``q_norm.weight``/``k_norm.weight``; Qwen3, Gemma 3 with
    ``qk_norm_offset=1``).  ``alibi``: ALiBi, ``slope_h * j`` added to the
    scaled scores of head ``h`` for key ``j`` (:func:`alibi_slopes`; the
    per-row constant of the ``slope * (j - i)`` form cancels in the softmax).
    """

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int | None = None
    causal: bool = True
    bias: bool = False
    scale: float | None = None
    dropout: float = 0.0
    sliding_window: int | None = None
    softcap: float | None = None
    right_window: int | None = None
    rope: RopeConfig | None = None
    biases: tuple[str, ...] | None = None
    qk_norm_eps: float | None = None
    qk_norm_offset: float = 0.0
    alibi: bool = False

    def __post_init__(self) -> None:
        _positive_int("d_model", self.d_model)
        _positive_int("n_heads", self.n_heads)
        _positive_int("n_kv_heads", self.n_kv_heads)
        if self.n_kv_heads > self.n_heads:
            raise AttentionConfigError(f"n_kv_heads ({self.n_kv_heads}) must be <= n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise AttentionConfigError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) so query heads form equal groups"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise AttentionConfigError(f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads}); pass head_dim explicitly")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        else:
            _positive_int("head_dim", self.head_dim)
        if not isinstance(self.causal, bool) or not isinstance(self.bias, bool):
            raise AttentionConfigError(f"causal and bias must be bools, got causal={self.causal!r}, bias={self.bias!r}")
        if self.scale is not None and (not isinstance(self.scale, (int, float)) or not np.isfinite(self.scale) or self.scale <= 0):
            raise AttentionConfigError(f"scale must be a positive finite number or None, got {self.scale!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout <= 1.0:
            raise AttentionConfigError(f"dropout must be in [0, 1], got {self.dropout!r}")
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
            if not self.causal and self.right_window is None:
                raise AttentionConfigError("a non-causal sliding_window needs right_window too (a band of keys around each query)")
        if self.right_window is not None:
            if isinstance(self.right_window, bool) or not isinstance(self.right_window, int) or self.right_window < 0:
                raise AttentionConfigError(f"right_window must be an int >= 0, got {self.right_window!r}")
            if self.causal or self.sliding_window is None:
                raise AttentionConfigError("right_window is for non-causal attention with a sliding_window (a band of keys around each query)")
        if self.qk_norm_eps is not None and (
            isinstance(self.qk_norm_eps, bool) or not isinstance(self.qk_norm_eps, (int, float)) or not 0 <= self.qk_norm_eps < 1
        ):
            raise AttentionConfigError(f"qk_norm_eps must be a small number >= 0 or None, got {self.qk_norm_eps!r}")
        if not isinstance(self.alibi, bool):
            raise AttentionConfigError(f"alibi must be a bool, got {self.alibi!r}")
        if self.rope is not None and not isinstance(self.rope, RopeConfig):
            raise AttentionConfigError(f"rope must be a RopeConfig (graphc.Rotary) or None, got {type(self.rope).__name__}")
        if self.rope is not None and self.rope.dim(self.hd) > self.hd:
            raise AttentionConfigError(f"rope.rotary_dim {self.rope.rotary_dim} exceeds head_dim {self.hd}")
        if self.biases is not None:
            if isinstance(self.biases, str) or not all(isinstance(p, str) for p in self.biases):
                raise AttentionConfigError(f"biases must be a tuple of projection names from {PROJECTIONS}, got {self.biases!r}")
            unknown = sorted(set(self.biases) - set(PROJECTIONS))
            if unknown:
                raise AttentionConfigError(f"biases names unknown projection(s) {unknown}; valid: {', '.join(PROJECTIONS)}")
            object.__setattr__(self, "biases", tuple(p for p in PROJECTIONS if p in self.biases))
        if self.softcap is not None and (
            isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) or not 0 < self.softcap < float("inf")
        ):
            raise AttentionConfigError(f"softcap must be a positive finite number or None, got {self.softcap!r}")

    # --------------------------------------------------------------- shape
    @property
    def hd(self) -> int:
        """``head_dim`` as a plain int (always set after construction)."""
        assert self.head_dim is not None
        return self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        """The scale applied to Q K^T: ``scale`` or ``head_dim ** -0.5``."""
        return float(self.scale) if self.scale is not None else self.hd**-0.5

    @property
    def is_mha(self) -> bool:
        """One KV head per query head."""
        return self.n_kv_heads == self.n_heads

    @property
    def is_mqa(self) -> bool:
        """A single KV head shared by all query heads (and more than one query head)."""
        return self.n_kv_heads == 1 and self.n_heads > 1

    @property
    def is_gqa(self) -> bool:
        """Several query heads per KV head, more than one KV head."""
        return 1 < self.n_kv_heads < self.n_heads

    @property
    def kind(self) -> str:
        """``"MHA"``, ``"MQA"`` or ``"GQA"``."""
        return "MHA" if self.is_mha else "MQA" if self.is_mqa else "GQA"

    def kv_head_of(self, query_head: int) -> int:
        """The KV head that query head ``query_head`` reads: ``query_head // group_size``."""
        if not 0 <= query_head < self.n_heads:
            raise AttentionConfigError(f"query head {query_head} is out of range 0..{self.n_heads - 1}")
        return query_head // self.group_size

    def has_bias(self, projection: str) -> bool:
        """Whether ``projection`` (``"q_proj"`` ...) has a bias."""
        return projection in self.biases if self.biases is not None else self.bias

    # --------------------------------------------------------------- stats
    def param_count(self, bias: bool | None = None) -> int:
        """Parameters of the four projections; ``bias`` overrides the config's own flag."""
        q, kv = self.n_heads * self.hd, self.n_kv_heads * self.hd
        weights = self.d_model * q + 2 * self.d_model * kv + q * self.d_model
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": self.d_model}
        biases = sum(n for p, n in sizes.items() if (self.has_bias(p) if bias is None else bias))
        return weights + biases

    def kv_cache_bytes(self, batch: int, seq_len: int, dtype: str = "float16", n_layers: int = 1) -> int:
        """Bytes of the K and V cache for ``batch`` sequences of ``seq_len`` tokens over ``n_layers`` layers."""
        for name, v in (("batch", batch), ("seq_len", seq_len), ("n_layers", n_layers)):
            if not isinstance(v, int) or v < 0:
                raise AttentionConfigError(f"{name} must be a non-negative int, got {v!r}")
        itemsize = np.dtype(check_dtype(dtype)).itemsize
        return 2 * batch * seq_len * self.n_kv_heads * self.hd * itemsize * n_layers

    def kv_saving_vs_mha(self) -> float:
        """Fraction of KV-cache memory saved against MHA with the same query heads (0 for MHA)."""
        return 1.0 - self.n_kv_heads / self.n_heads

    def flops(self, batch: int, q_len: int, kv_len: int | None = None, projections: bool = True) -> int:
        """Multiply-add FLOPs (2 per MAC) of one forward pass, dense (masked blocks counted).

        ``kv_len`` defaults to ``q_len``; with ``projections`` the K/V projections
        are counted for the ``q_len`` new tokens only (a KV cache holds the rest).
        """
        kv_len = q_len if kv_len is None else kv_len
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.hd
        core = 2 * batch * hq * q_len * kv_len * d * 2
        if not projections:
            return core
        proj = 2 * batch * q_len * self.d_model * (hq * d + 2 * hkv * d) + 2 * batch * q_len * hq * d * self.d_model
        return core + proj

    def summary(self, batch: int = 1, seq_len: int = 4096, dtype: str = "float16", n_layers: int = 1) -> str:
        """A readable multi-line description with parameter count, KV-cache size and FLOPs."""
        kv = self.kv_cache_bytes(batch, seq_len, dtype, n_layers)
        per_token = self.kv_cache_bytes(1, 1, dtype, n_layers)
        lines = [
            f"{self.kind}: d_model={self.d_model}, heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.hd}, "
            f"group_size={self.group_size}",
            f"  causal={self.causal}, bias={','.join(self.biases) if self.biases is not None else self.bias}, scale={self.softmax_scale:.6g}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window is not None else "")
            + (f", right_window={self.right_window}" if self.right_window is not None else "")
            + (f", softcap={self.softcap:g}" if self.softcap is not None else ""),
            f"  parameters per layer: {self.param_count():,} (with bias {self.param_count(True):,}, without {self.param_count(False):,})",
            f"  KV cache ({dtype}, {n_layers} layer(s)): {per_token:,} bytes/token; {kv / 2**20:,.1f} MiB at batch={batch}, seq={seq_len}",
            f"  KV saving vs MHA: {self.kv_saving_vs_mha():.1%}",
            f"  forward FLOPs at batch={batch}, seq={seq_len}: {self.flops(batch, seq_len) / 1e9:,.2f} GFLOP per layer",
        ]
        return "\n".join(lines)

    def with_(self, **changes: Any) -> "AttentionConfig":
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)


def mha(d_model: int, n_heads: int, **kw: Any) -> AttentionConfig:
    """Multi-head attention: one KV head per query head."""
    return AttentionConfig(d_model, n_heads, n_heads, **kw)


def mqa(d_model: int, n_heads: int, **kw: Any) -> AttentionConfig:
    """Multi-query attention: one KV head for all query heads."""
    return AttentionConfig(d_model, n_heads, 1, **kw)


def gqa(d_model: int, n_heads: int, n_kv_heads: int, **kw: Any) -> AttentionConfig:
    """Grouped-query attention: ``n_heads // n_kv_heads`` query heads per KV head."""
    return AttentionConfig(d_model, n_heads, n_kv_heads, **kw)


@dataclass(frozen=True)
class Preset:
    """A published model's attention layer and its layer count."""

    name: str
    config: AttentionConfig
    n_layers: int
    description: str


_ROPE_1E4 = RopeConfig(base=10000.0)
_LLAMA31_ROPE = RopeConfig(base=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama2-7b", AttentionConfig(4096, 32, 32, rope=_ROPE_1E4), 32, "Llama 2 7B (MHA)"),
        Preset("llama2-70b", AttentionConfig(8192, 64, 8, rope=_ROPE_1E4), 80, "Llama 2 70B (GQA, 8 groups of 8)"),
        Preset("llama3-8b", AttentionConfig(4096, 32, 8, rope=RopeConfig(base=500000.0)), 32, "Llama 3 8B (GQA, 8 groups of 4)"),
        Preset("llama3.1-8b", AttentionConfig(4096, 32, 8, rope=_LLAMA31_ROPE), 32, "Llama 3.1 8B (GQA, 8 groups of 4; RoPE with Llama 3 scaling)"),
        Preset("llama3-70b", AttentionConfig(8192, 64, 8, rope=RopeConfig(base=500000.0)), 80, "Llama 3 70B (GQA, 8 groups of 8)"),
        Preset(
            "mistral-7b", AttentionConfig(4096, 32, 8, rope=RopeConfig(base=1000000.0)), 32, "Mistral 7B v0.3 (GQA, 8 groups of 4; no sliding window)"
        ),
        Preset(
            "mistral-7b-v0.1",
            AttentionConfig(4096, 32, 8, rope=_ROPE_1E4, sliding_window=4096),
            32,
            "Mistral 7B v0.1 (GQA, 8 groups of 4; 4096-token sliding window)",
        ),
        Preset(
            "qwen2-7b",
            AttentionConfig(3584, 28, 4, head_dim=128, rope=RopeConfig(base=1000000.0), biases=("q_proj", "k_proj", "v_proj")),
            28,
            "Qwen2 7B (GQA, 4 groups of 7; q/k/v biases)",
        ),
        Preset(
            "gemma2-9b",
            AttentionConfig(3584, 16, 8, head_dim=256, scale=256**-0.5, rope=_ROPE_1E4, sliding_window=4096, softcap=50.0),
            42,
            "Gemma 2 9B, a sliding layer (GQA, 8 groups of 2; 4096-token window, softcap 50; odd layers are global)",
        ),
        Preset("falcon-7b", AttentionConfig(4544, 71, 1, head_dim=64, rope=_ROPE_1E4), 32, "Falcon 7B (MQA, 71 query heads)"),
        Preset("falcon-40b", AttentionConfig(8192, 128, 8, head_dim=64, rope=_ROPE_1E4), 60, "Falcon 40B (GQA, 8 groups of 16)"),
    )
}


def preset_names() -> list[str]:
    """The names :func:`preset` accepts."""
    return list(PRESETS)


def preset(name: str) -> AttentionConfig:
    """The attention config of a named model; an unknown name lists the valid ones."""
    if name not in PRESETS:
        raise UnknownNameError("preset", name, preset_names())
    return PRESETS[name].config
