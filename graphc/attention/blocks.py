"""Building blocks of decoder layers, as einsum and elementwise nodes: norms, activations, MLPs.

Every block reduces over the last axis with an einsum (``"bsm,bsm->bs"`` for a
sum of squares) and applies per-row factors with an einsum too
(``"bsm,bs,m->bsm"``), so no op beyond graphc's closed set is needed and every
backend runs them.  Weight names follow transformers (``input_layernorm.weight``,
``mlp.gate_proj.weight`` ...); callers pass the full names.
"""

from __future__ import annotations

import math

import numpy as np

from graphc.dims import eval_dim
from graphc.errors import UnknownNameError
from graphc.graph import Graph, Value

__all__ = ["rms_norm", "layer_norm", "activation", "gated_mlp", "plain_mlp", "ACTIVATIONS"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
_LETTERS = "abcdefghijkl"


def _const(g: Graph, base: str, value: float, dtype: str) -> Value:
    return g.constant(g.fresh_name(base), np.array(value, dtype))


def _row_factor(g: Graph, x: Value, sumsq: Value, eps: float, base: str) -> Value:
    """``1 / sqrt(sumsq / n + eps)`` for the rows of ``x`` (``n`` its last axis)."""
    n = eval_dim(x.type.shape[-1], {})  # the model width: static
    mean = g.scale(sumsq, 1.0 / n, name=g.fresh_name(f"{base}_mean_sq"))
    return g.reciprocal(
        g.sqrt(g.add(mean, _const(g, f"{base}_eps", eps, x.type.dtype)), name=g.fresh_name(f"{base}_rms")), name=g.fresh_name(f"{base}_inv_rms")
    )


def rms_norm(g: Graph, x: Value, weight: str, eps: float, offset: float = 0.0, name: str | None = None) -> Value:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * (offset + weight)`` (Gemma: ``offset=1``)."""
    base = name or g.fresh_name("rms_norm")
    lab = _LETTERS[: x.type.rank]
    sumsq = g.einsum(f"{lab},{lab}->{lab[:-1]}", x, x, name=g.fresh_name(f"{base}_sum_sq"))
    w = g.value(weight)
    if offset:
        w = g.add(w, _const(g, f"{base}_offset", offset, w.type.dtype), name=g.fresh_name(f"{base}_weight"))
    return g.einsum(f"{lab},{lab[:-1]},{lab[-1]}->{lab}", x, _row_factor(g, x, sumsq, eps, base), w, name=name or g.fresh_name(f"{base}_out"))


def layer_norm(g: Graph, x: Value, weight: str, bias: str | None, eps: float, name: str | None = None) -> Value:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``."""
    base = name or g.fresh_name("layer_norm")
    lab = _LETTERS[: x.type.rank]
    n = eval_dim(x.type.shape[-1], {})  # the model width: static
    mean = g.scale(g.einsum(f"{lab}->{lab[:-1]}", x, name=g.fresh_name(f"{base}_sum")), 1.0 / n, name=g.fresh_name(f"{base}_mean"))
    centred = g.sub(x, g.reshape(mean, [*x.type.shape[:-1], 1], name=g.fresh_name(f"{base}_mean_col")), name=g.fresh_name(f"{base}_centred"))
    sumsq = g.einsum(f"{lab},{lab}->{lab[:-1]}", centred, centred, name=g.fresh_name(f"{base}_sum_sq"))
    y = g.einsum(
        f"{lab},{lab[:-1]},{lab[-1]}->{lab}", centred, _row_factor(g, centred, sumsq, eps, base), weight, name=g.fresh_name(f"{base}_scaled")
    )
    return g.add(y, bias, name=name or g.fresh_name(f"{base}_out")) if bias else y


def activation(g: Graph, x: Value, kind: str, name: str | None = None) -> Value:
    """``silu`` (x * sigmoid(x)), ``gelu`` (erf form), ``gelu_tanh`` (tanh approximation) or ``relu``."""
    base = name or g.fresh_name(kind)
    dt = x.type.dtype
    if kind == "silu":
        return g.mul(x, g.sigmoid(x, name=g.fresh_name(f"{base}_sigmoid")), name=name)
    if kind == "relu":
        return g.relu(x, name=name)
    if kind == "gelu":
        e = g.unary("erf", g.scale(x, 1 / math.sqrt(2.0), name=g.fresh_name(f"{base}_scaled")), name=g.fresh_name(f"{base}_erf"))
        return g.mul(g.scale(x, 0.5, name=g.fresh_name(f"{base}_half")), g.add(e, _const(g, f"{base}_one", 1.0, dt)), name=name)
    if kind == "gelu_tanh":
        cube = g.mul(g.mul(x, x), x, name=g.fresh_name(f"{base}_cube"))
        inner = g.scale(g.add(x, g.scale(cube, 0.044715)), math.sqrt(2.0 / math.pi), name=g.fresh_name(f"{base}_inner"))
        t = g.add(g.tanh(inner), _const(g, f"{base}_one", 1.0, dt), name=g.fresh_name(f"{base}_1_plus_tanh"))
        return g.mul(g.scale(x, 0.5, name=g.fresh_name(f"{base}_half")), t, name=name)
    raise UnknownNameError("activation", kind, ACTIVATIONS)


def _linear(g: Graph, x: Value, weight: str, bias: str | None, name: str) -> Value:
    lab = _LETTERS[: x.type.rank - 1]
    y = g.einsum(f"{lab}m,nm->{lab}n", x, weight, name=g.fresh_name(name))
    return g.add(y, bias, name=g.fresh_name(f"{name}_biased")) if bias else y


def gated_mlp(g: Graph, x: Value, prefix: str, act: str, bias: bool = False, name: str | None = None) -> Value:
    """``down(act(gate(x)) * up(x))``: SwiGLU with ``act="silu"``, GeGLU with ``gelu``/``gelu_tanh`` (weights ``{prefix}gate_proj`` ...)."""
    b = (lambda p: f"{prefix}{p}.bias") if bias else (lambda p: None)
    gate = activation(g, _linear(g, x, f"{prefix}gate_proj.weight", b("gate_proj"), "mlp_gate"), act)
    h = g.mul(gate, _linear(g, x, f"{prefix}up_proj.weight", b("up_proj"), "mlp_up"), name=g.fresh_name("mlp_hidden"))
    y = _linear(g, h, f"{prefix}down_proj.weight", b("down_proj"), name or "mlp_out")
    return y


def plain_mlp(g: Graph, x: Value, prefix: str, act: str, bias: bool = False, name: str | None = None) -> Value:
    """``down(act(up(x)))`` (weights ``{prefix}up_proj`` and ``{prefix}down_proj``)."""
    b = (lambda p: f"{prefix}{p}.bias") if bias else (lambda p: None)
    h = activation(g, _linear(g, x, f"{prefix}up_proj.weight", b("up_proj"), "mlp_up"), act)
    return _linear(g, h, f"{prefix}down_proj.weight", b("down_proj"), name or "mlp_out")
