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
from typing import Any

import numpy as np

from graphc.dims import Dim
from graphc.errors import AttentionConfigError, WeightError
from graphc.graph import Graph, Value
from graphc.memory import check_allocation
from graphc.ops import check_dtype

from .blocks import ACTIVATIONS, gated_mlp, layer_norm, plain_mlp, rms_norm
from .builders import attention_layer_graph, kv_cache_graph, layer_cache_inputs, layer_presents, name_stack_outputs, weight_shapes
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
    """The layer's weights against its config; errors name each tensor with ``prefix`` (``model.layers.3.``)."""
    expected = decoder_weight_shapes(cfg)
    missing = [prefix + n for n in sorted(set(expected) - set(weights))]
    extra = [prefix + n for n in sorted(set(weights) - set(expected))]
    if missing or extra:
        where = f"decoder layer {prefix.rstrip('.')!r}" if prefix else "decoder layer"
        raise WeightError(f"{where} weights: missing {missing}, unexpected {extra}; this config takes {sorted(expected)}")
    for name, shape in expected.items():
        check_weight(prefix + name, weights[name], shape, dtype)


def check_weight(name: str, arr: object, shape: tuple[int, ...], dtype: str) -> None:
    """A :class:`WeightError` naming ``name`` unless ``arr`` is a ``dtype`` ndarray of ``shape``."""
    if not isinstance(arr, np.ndarray) or tuple(arr.shape) != shape or str(arr.dtype) != dtype:
        got = f"{getattr(arr, 'dtype', type(arr).__name__)}{list(getattr(arr, 'shape', []))}"
        raise WeightError(f"weight {name!r} is {got}, expected {dtype}{list(shape)}")


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
    weights_prefix: str = "",
) -> Graph:
    """One decoder layer: ``x_BSM`` -> ``out_BSM`` (with ``kv_cache``: also ``past_key``/``past_value`` in, ``present_*`` out).

    ``mask``/``mask_per_query``: an ``attn_mask`` input as :func:`~graphc.attention.attention_layer_graph` takes it;
    ``past_lengths``/``position_ids`` (with ``kv_cache``): ragged caches and explicit RoPE positions, as
    :func:`~graphc.attention.kv_cache_graph` takes them.  ``weights_prefix``: how the checkpoint names this layer's
    tensors (``model.layers.3.``), for the errors.
    """
    weights = init_decoder_weights(cfg, seed, dtype) if weights is None else weights
    _check(cfg, weights, dtype, weights_prefix)
    g = Graph(name or "decoder_layer")
    for n, arr in weights.items():
        if not n.startswith("self_attn."):
            g.add_initializer(n, arr, copy=False)
    x = g.input("x_BSM", [batch, seq, cfg.attention.d_model], dtype)
    attn_weights = {n[len("self_attn.") :]: a for n, a in weights.items() if n.startswith("self_attn.")}
    h = _norm(g, cfg, x, "input_layernorm")
    masking: dict[str, Any] = {"mask": mask, "mask_per_query": mask_per_query}
    if kv_cache:
        layer = kv_cache_graph(
            cfg.attention, batch, seq, past, weights=attn_weights, dtype=dtype, past_lengths=past_lengths, position_ids=position_ids, **masking
        )
        pk = g.input("past_key", [batch, cfg.attention.n_kv_heads, past, cfg.attention.hd], dtype)
        pv = g.input("past_value", [batch, cfg.attention.n_kv_heads, past, cfg.attention.hd], dtype)
        bindings: dict[str, Value] = {"x_BSM": h, "past_key": pk, "past_value": pv}
    else:
        layer = attention_layer_graph(cfg.attention, batch, seq, weights=attn_weights, dtype=dtype, **masking)
        bindings = {"x_BSM": h}
    for shared in ("attn_mask", "past_lengths", "position_ids"):
        if shared in layer.inputs:
            t = layer.types[shared]
            bindings[shared] = g.input(shared, list(t.shape), t.dtype)
    outs = g.call(layer, bindings, prefix="self_attn.")
    a = outs["out_BSM"]
    mlp = gated_mlp if cfg.mlp == "gated" else plain_mlp
    if cfg.parallel:  # x + attn(n1(x)) + mlp(n2(x))
        m = mlp(g, h if cfg.parallel_norms == 1 else _norm(g, cfg, x, "post_attention_layernorm"), "mlp.", cfg.activation, cfg.mlp_bias)
        g.add(g.add(x, a, name=g.fresh_name("residual_attn_BSM")), m, name="out_BSM")
    else:
        if cfg.sandwich_norms:
            a = _norm(g, cfg, a, "post_attention_layernorm")
        h = g.add(x, a, name=g.fresh_name("residual_attn_BSM"))
        m = _norm(g, cfg, h, "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm")
        m = mlp(g, m, "mlp.", cfg.activation, cfg.mlp_bias)
        if cfg.sandwich_norms:
            m = _norm(g, cfg, m, "post_feedforward_layernorm")
        g.add(h, m, name="out_BSM")
    g.output("out_BSM")
    if kv_cache:
        for kind in ("key", "value"):
            g.rename_value(outs[f"present_{kind}"].name, f"present_{kind}")
            g.output(f"present_{kind}")
    return g


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
    g = Graph(name or f"decoder_stack_{len(layers)}")
    d = layers[0].attention.d_model
    x = g.input("x_BSM", [batch, seq, d], dtype)
    presents: list[tuple[Value, str]] = []
    for i, cfg in enumerate(layers):
        prefix = f"model.layers.{i}."
        if weights is None:
            layer_weights = init_decoder_weights(cfg, seed + i, dtype)
        else:
            layer_weights = {n[len(prefix) :]: a for n, a in weights.items() if n.startswith(prefix)}
            if not layer_weights:
                raise WeightError(f"no weights start with {prefix!r}; expected transformers' names such as {prefix}self_attn.q_proj.weight")
        layer = decoder_layer_graph(
            cfg,
            layer_weights,
            kv_cache,
            batch,
            seq,
            past,
            dtype=dtype,
            mask=mask,
            mask_per_query=mask_per_query,
            past_lengths=past_lengths,
            position_ids=position_ids,
            weights_prefix=prefix,
        )
        bindings: dict[str, Value | str] = {"x_BSM": x}
        for shared in ("attn_mask", "past_lengths", "position_ids"):
            if shared in layer.inputs:
                if shared not in g.types:
                    g.input(shared, list(layer.types[shared].shape), layer.types[shared].dtype)
                bindings[shared] = shared
        if kv_cache:
            bindings.update(layer_cache_inputs(g, i, cfg.attention, batch, past, dtype))
        outs = g.call(layer, bindings, prefix=prefix)
        x = outs["out_BSM"]
        presents += layer_presents(outs, i) if kv_cache else []
    if final_norm:
        names = ["model.norm.weight"] + (["model.norm.bias"] if layers[-1].norm == "layer" else [])
        if weights is None or any(n not in weights for n in names):
            raise WeightError(f"final_norm needs {names} in weights")
        for n in names:
            g.add_initializer(n, weights[n], copy=False)
        x = _norm(g, layers[-1], x, "model.norm")
    name_stack_outputs(g, x, presents)
    return g
