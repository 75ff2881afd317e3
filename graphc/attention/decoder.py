"""Decoder layers and stacks of them: norms, attention, MLP and residuals, with a KV cache per layer.

A layer is pre-norm, as Llama, Mistral, Qwen2/3 and Gemma write it::

    h   = x + post_attn_norm?(attn(input_norm(x)))
    out = h + post_ff_norm?(mlp(pre_ff_norm(h)))

(``post_attn_norm``/``post_ff_norm`` only with ``sandwich_norms``, Gemma 2/3;
``pre_ff_norm`` is transformers' ``post_attention_layernorm`` otherwise).
Weight names are transformers' (``input_layernorm.weight``,
``self_attn.q_proj.weight``, ``mlp.gate_proj.weight`` ...), and a stack prefixes
them with ``model.layers.{i}.``, so a model's ``state_dict`` is the weights
mapping as it stands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from graphc.dims import Dim, dim_add
from graphc.errors import AttentionConfigError, WeightError
from graphc.graph import Graph, Value
from graphc.memory import check_allocation
from graphc.ops import check_dtype

from .blocks import ACTIVATIONS, gated_mlp, layer_norm, plain_mlp, rms_norm
from .builders import (
    declare_weights,
    layer_cache_inputs,
    mask_input,
    name_stack_outputs,
    weight_shapes,
    write_kv_cache_attention,
    write_self_attention,
)
from .config import AttentionConfig

__all__ = [
    "DecoderConfig",
    "check_weight",
    "decoder_weight_shapes",
    "decoder_layer_graph",
    "decoder_stack_graph",
    "init_decoder_weights",
    "MLP_KINDS",
    "NORM_KINDS",
]

MLP_KINDS = ("gated", "plain")
NORM_KINDS = ("rms", "layer")


@dataclass(frozen=True)
class DecoderConfig:
    """One decoder layer: its attention, MLP and norms.

    ``mlp``: ``"gated"`` (``down(act(gate(x)) * up(x))``: SwiGLU with ``silu``,
    GeGLU with ``gelu_tanh``) or ``"plain"`` (``down(act(up(x)))``).  ``norm``:
    ``"rms"`` or ``"layer"``; ``norm_offset`` 1 applies RMSNorm weights as
    ``1 + w`` (Gemma).  ``sandwich_norms`` adds the norms after attention and
    after the MLP (Gemma 2/3).  ``parallel``: attention and MLP both read the
    normed input and add to one residual, ``x + attn(n1(x)) + mlp(n2(x))``
    (Falcon; ``parallel_norms=1`` shares one norm, 2 gives the MLP
    ``post_attention_layernorm``).
    """

    attention: AttentionConfig
    intermediate_size: int
    mlp: str = "gated"
    activation: str = "silu"
    norm: str = "rms"
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    mlp_bias: bool = False
    parallel: bool = False
    parallel_norms: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.attention, AttentionConfig):
            raise AttentionConfigError(f"attention must be an AttentionConfig, got {type(self.attention).__name__}")
        if isinstance(self.intermediate_size, bool) or not isinstance(self.intermediate_size, int) or self.intermediate_size < 1:
            raise AttentionConfigError(f"intermediate_size must be an int > 0, got {self.intermediate_size!r}")
        for field, value, valid in (("mlp", self.mlp, MLP_KINDS), ("activation", self.activation, ACTIVATIONS), ("norm", self.norm, NORM_KINDS)):
            if value not in valid:
                raise AttentionConfigError(f"{field} must be one of {valid}, got {value!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not 0 <= self.norm_eps < 1:
            raise AttentionConfigError(f"norm_eps must be a small number >= 0, got {self.norm_eps!r}")
        if self.parallel_norms not in (1, 2) or (self.parallel and self.sandwich_norms):
            raise AttentionConfigError(f"parallel_norms must be 1 or 2 (and parallel layers have no sandwich norms), got {self.parallel_norms!r}")


def _norm_names(cfg: DecoderConfig) -> list[str]:
    if cfg.parallel:
        return ["input_layernorm"] + (["post_attention_layernorm"] if cfg.parallel_norms == 2 else [])
    names = ["input_layernorm", "post_attention_layernorm"]
    if cfg.sandwich_norms:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    return names


def decoder_weight_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one layer's weights (transformers' names)."""
    d, f = cfg.attention.d_model, cfg.intermediate_size
    shapes = {f"self_attn.{k}": v for k, v in weight_shapes(cfg.attention).items()}
    for n in _norm_names(cfg):
        shapes[f"{n}.weight"] = (d,)
        if cfg.norm == "layer":
            shapes[f"{n}.bias"] = (d,)
    projections = {"up_proj": (f, d), "down_proj": (d, f)}
    if cfg.mlp == "gated":
        projections["gate_proj"] = (f, d)
    for p, shape in projections.items():
        shapes[f"mlp.{p}.weight"] = shape
        if cfg.mlp_bias:
            shapes[f"mlp.{p}.bias"] = (shape[0],)
    return shapes


def init_decoder_weights(cfg: DecoderConfig, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Seeded random weights for one layer: projections scaled by ``fan_in ** -0.5``, norm gains around 1 (0 with an offset)."""
    shapes = decoder_weight_shapes(cfg)
    check_allocation(
        sum(int(np.prod(s)) for s in shapes.values()) * np.dtype(check_dtype(dtype)).itemsize, f"the weights of a decoder layer in {dtype}"
    )
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        draw = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):  # the gain scatters around 1, stored as gain - offset
            offset = cfg.norm_offset if "layernorm" in name else cfg.attention.qk_norm_offset
            draw = 1.0 - offset + 0.1 * draw
        elif name.endswith("bias"):
            draw *= 0.02
        else:
            draw *= shape[-1] ** -0.5
        out[name] = draw.astype(dtype)
    return out


def _norm(g: Graph, cfg: DecoderConfig, x: Value, name: str) -> Value:
    if cfg.norm == "rms":
        return rms_norm(g, x, f"{name}.weight", cfg.norm_eps, cfg.norm_offset, name=g.fresh_name(f"{name}_out"))
    return layer_norm(g, x, f"{name}.weight", f"{name}.bias", cfg.norm_eps, name=g.fresh_name(f"{name}_out"))


def _check(cfg: DecoderConfig, weights: Mapping[str, np.ndarray], dtype: str, prefix: str = "") -> None:
    """Layer ``prefix``'s weights (``weights`` holds them under their full names, ``model.layers.3.``...) against its
    config: each one present with its shape and dtype, and no other tensor under ``prefix``."""
    expected = {prefix + n: shape for n, shape in decoder_weight_shapes(cfg).items()}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(n for n in weights if n.startswith(prefix) and n not in expected)
    if missing or extra:
        where = f"decoder layer {prefix.rstrip('.')!r}" if prefix else "decoder layer"
        relative = sorted(n[len(prefix) :] for n in expected)
        raise WeightError(f"{where} weights: missing {missing}, unexpected {extra}; this config takes {relative}")
    for name, shape in expected.items():
        check_weight(name, weights[name], shape, dtype)


def check_weight(name: str, arr: object, shape: tuple[int, ...], dtype: str) -> None:
    """A :class:`WeightError` naming ``name`` unless ``arr`` is a ``dtype`` ndarray of ``shape``."""
    if not isinstance(arr, np.ndarray) or tuple(arr.shape) != shape or str(arr.dtype) != dtype:
        got = f"{getattr(arr, 'dtype', type(arr).__name__)}{list(getattr(arr, 'shape', []))}"
        raise WeightError(f"weight {name!r} is {got}, expected {dtype}{list(shape)}")


@dataclass(frozen=True)
class SharedInputs:
    """The inputs every layer of a stack reads (each ``None`` where the stack has none): the ``attn_mask``, ragged
    caches' ``past_lengths``, RoPE's ``position_ids`` and a fixed-capacity cache's ``cache_position``."""

    mask: Value | None = None
    lengths: Value | None = None
    positions: Value | None = None
    cache_position: Value | None = None


def layer_inputs(
    g: Graph,
    kv_cache: bool,
    dims: tuple[Dim, Dim, Dim],
    dtype: str,
    mask: str,
    mask_per_query: bool,
    past_lengths: bool,
    position_ids: bool,
) -> SharedInputs:
    """Declare the inputs a stack's layers share (:class:`SharedInputs`; lengths and positions with ``kv_cache``
    only).  ``dims`` is ``(batch, seq, past)``."""
    batch, seq, past = dims
    m = mask_input(g, mask, mask_per_query, batch, seq, dim_add(past, seq) if kv_cache else seq, dtype)
    lengths = g.input("past_lengths", [batch], "int64") if kv_cache and past_lengths else None
    positions = g.input("position_ids", [batch, seq], "int64") if kv_cache and position_ids else None
    return SharedInputs(m, lengths, positions)


def write_decoder_layer(
    g: Graph,
    cfg: DecoderConfig,
    x: Value,
    weights: Mapping[str, np.ndarray],
    cache: tuple[Value, Value] | None = None,
    shared: SharedInputs = SharedInputs(),
) -> tuple[Value, tuple[Value, Value] | None]:
    """Write one decoder layer into ``g`` under its current scope and return ``out_BSM`` and, with ``cache``
    (``past_key``, ``past_value``), the presents.  ``weights`` holds the layer's tensors under the names the scope
    gives them (checked by the caller); ``shared``: the inputs every layer reads (:func:`layer_inputs`)."""
    declare_weights(g, [n for n in decoder_weight_shapes(cfg) if not n.startswith("self_attn.")], weights)
    h = _norm(g, cfg, x, "input_layernorm")
    with g.scope("self_attn."):
        declare_weights(g, list(weight_shapes(cfg.attention)), weights)
        if cache is None:
            a, presents = write_self_attention(g, cfg.attention, h, shared.mask), None
        else:
            a, k, v = write_kv_cache_attention(g, cfg.attention, h, *cache, shared.mask, shared.lengths, shared.positions, shared.cache_position)
            presents = (k, v)
    mlp = gated_mlp if cfg.mlp == "gated" else plain_mlp
    if cfg.parallel:  # x + attn(n1(x)) + mlp(n2(x))
        m = mlp(g, h if cfg.parallel_norms == 1 else _norm(g, cfg, x, "post_attention_layernorm"), "mlp.", cfg.activation, cfg.mlp_bias)
        return g.add(g.add(x, a, name=g.fresh_name("residual_attn_BSM")), m, name="out_BSM"), presents
    if cfg.sandwich_norms:
        a = _norm(g, cfg, a, "post_attention_layernorm")
    h = g.add(x, a, name=g.fresh_name("residual_attn_BSM"))
    m = _norm(g, cfg, h, "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm")
    m = mlp(g, m, "mlp.", cfg.activation, cfg.mlp_bias)
    if cfg.sandwich_norms:
        m = _norm(g, cfg, m, "post_feedforward_layernorm")
    return g.add(h, m, name="out_BSM"), presents


def decoder_layer_graph(
    cfg: DecoderConfig,
    weights: Mapping[str, np.ndarray] | None = None,
    kv_cache: bool = False,
    batch: Dim = "batch",
    seq: Dim = "seq",
    past: Dim = "past_seq",
    seed: int = 0,
    dtype: str = "float32",
    name: str | None = None,
    mask: str = "none",
    mask_per_query: bool = True,
    past_lengths: bool = False,
    position_ids: bool = False,
) -> Graph:
    """One decoder layer: ``x_BSM`` -> ``out_BSM`` (with ``kv_cache``: also ``past_key``/``past_value`` in, ``present_*`` out).

    ``mask``/``mask_per_query``: an ``attn_mask`` input as :func:`~graphc.attention.attention_layer_graph` takes it;
    ``past_lengths``/``position_ids`` (with ``kv_cache``): ragged caches and explicit RoPE positions, as
    :func:`~graphc.attention.kv_cache_graph` takes them.
    """
    weights = init_decoder_weights(cfg, seed, dtype) if weights is None else weights
    _check(cfg, weights, dtype)
    g = Graph(name or "decoder_layer")
    x = g.input("x_BSM", [batch, seq, cfg.attention.d_model], dtype)
    cache = layer_cache_inputs(g, None, cfg.attention, batch, past, dtype) if kv_cache else None
    shared = layer_inputs(g, kv_cache, (batch, seq, past), dtype, mask, mask_per_query, past_lengths, position_ids)
    out, presents = write_decoder_layer(g, cfg, x, weights, cache, shared)
    g.output(out)
    for kind, value in zip(("key", "value"), presents or ()):
        g.rename_value(value.name, f"present_{kind}")
        g.output(f"present_{kind}")
    return g


def write_decoder_stack(
    g: Graph,
    layers: Sequence[DecoderConfig],
    x: Value,
    weights: Mapping[str, np.ndarray],
    caches: Sequence[tuple[Value, Value]] | None = None,
    shared: SharedInputs = SharedInputs(),
    final_norm: bool = False,
) -> tuple[Value, list[tuple[Value, Value]]]:
    """Write ``layers`` into ``g``, layer i under the scope ``model.layers.{i}.``, and the final norm
    ``model.norm`` with ``final_norm``; returns the last hidden state and each layer's presents (with ``caches``).
    ``weights`` holds every tensor under its full transformers name; each layer's are checked here."""
    presents = []
    for i, cfg in enumerate(layers):
        prefix = f"model.layers.{i}."
        if not any(n.startswith(prefix) for n in weights):
            raise WeightError(f"no weights start with {prefix!r}; expected transformers' names such as {prefix}self_attn.q_proj.weight")
        _check(cfg, weights, x.type.dtype, prefix)
        with g.scope(prefix):
            x, layer_presents = write_decoder_layer(g, cfg, x, weights, None if caches is None else caches[i], shared)
        presents += [layer_presents] if layer_presents is not None else []
    if final_norm:
        names = ["model.norm.weight"] + (["model.norm.bias"] if layers[-1].norm == "layer" else [])
        if any(n not in weights for n in names):
            raise WeightError(f"final_norm needs {names} in weights")
        declare_weights(g, names, weights)
        x = _norm(g, layers[-1], x, "model.norm")
    return x, presents


def decoder_stack_graph(
    cfgs: DecoderConfig | Sequence[DecoderConfig],
    n_layers: int | None = None,
    weights: Mapping[str, np.ndarray] | None = None,
    kv_cache: bool = False,
    batch: Dim = "batch",
    seq: Dim = "seq",
    past: Dim = "past_seq",
    seed: int = 0,
    dtype: str = "float32",
    final_norm: bool = False,
    name: str | None = None,
    mask: str = "none",
    mask_per_query: bool = True,
    past_lengths: bool = False,
    position_ids: bool = False,
) -> Graph:
    """``n_layers`` decoder layers in a row (one config for all, or one per layer: Gemma 2 alternates windows).

    ``weights`` is one mapping with transformers' names (``model.layers.{i}.self_attn.q_proj.weight`` ...,
    and ``model.norm.weight`` with ``final_norm``), as a model's ``state_dict`` has them; default random.
    With ``kv_cache`` layer i takes ``past_key.{i}``/``past_value.{i}`` and returns ``present_key.{i}``/``present_value.{i}``.
    ``mask``/``mask_per_query``: one ``attn_mask`` input that every layer applies (a padding mask, say);
    ``past_lengths``/``position_ids`` (with ``kv_cache``): one input each, shared by every layer.
    """
    layers = [cfgs] * (n_layers or 1) if isinstance(cfgs, DecoderConfig) else list(cfgs)
    if n_layers is not None and len(layers) != n_layers:
        raise WeightError(f"{len(layers)} layer configs given for n_layers={n_layers}")
    if not layers:
        raise WeightError("a decoder stack needs at least one layer")
    if weights is None:
        per_layer = sum(int(np.prod(s)) for s in decoder_weight_shapes(layers[0]).values()) * np.dtype(check_dtype(dtype)).itemsize
        check_allocation(per_layer * len(layers), f"the weights of {len(layers)} decoder layers in {dtype}")
        weights = {f"model.layers.{i}.{n}": a for i, cfg in enumerate(layers) for n, a in init_decoder_weights(cfg, seed + i, dtype).items()}
    g = Graph(name or f"decoder_stack_{len(layers)}")
    x = g.input("x_BSM", [batch, seq, layers[0].attention.d_model], dtype)
    shared = layer_inputs(g, kv_cache, (batch, seq, past), dtype, mask, mask_per_query, past_lengths, position_ids)
    caches = [layer_cache_inputs(g, i, cfg.attention, batch, past, dtype) for i, cfg in enumerate(layers)] if kv_cache else None
    x, presents = write_decoder_stack(g, layers, x, weights, caches, shared, final_norm)
    name_stack_outputs(g, x, [(v, f"present_{kind}.{i}") for i, kv in enumerate(presents) for kind, v in zip(("key", "value"), kv)])
    return g
