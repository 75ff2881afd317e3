"""Rotary position embeddings (RoPE) as ops: ``Positions`` and ``Rotary``, and their decomposition.

``Rotary(x [B, H, S, D], positions [S] or [B, S])`` rotates the first
``rotary_dim`` features of every head by angles ``position * inv_freq``:

- ``style="half"`` (Llama, Mistral, Qwen, Gemma, GPT-NeoX): feature ``k`` pairs
  with ``k + rotary_dim/2`` (``rotate_half``);
- ``style="interleaved"`` (GPT-J): feature ``2f`` pairs with ``2f + 1``.

``inv_freq = base ** (-2f / rotary_dim)``, then the frequency scaling:
``linear`` divides it by ``factor``; ``llama3`` applies Llama 3.1's per-wavelength
rule (``factor``, ``low_freq_factor``, ``high_freq_factor``,
``original_max_position``).  The frequencies are rounded to float32, as
transformers rounds them; the angles ``position * inv_freq`` and their cos and
sin are computed in float64 and cast to float32, then to ``x``'s dtype.  In
float32 the product alone would be off by up to ``angle * 6e-8`` rad (2.4e-4 at
position 4096), the largest error of a float32 layer at long contexts.

The decomposition is einsums and elementwise ops only: angles are an outer
product ``einsum("s,f->sf", positions, inv_freq)``, cos/sin are spread over the
head dim by a constant 0/1 matrix, and the pair rotation is ``x @ R`` with a
constant signed permutation ``R``; so dynamic sequence lengths and a position
offset from the KV cache (``Positions(offset=past_len)``) need no special
kernel.  Every target runs the decomposition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .dims import Dim, eval_dim
from .errors import DTypeMismatchError, GraphError, OpError, ShapeMismatchError
from .graph import Graph
from .ops import FLOAT_DTYPES, Binary, Cast, Dims, Einsum, Op, Reshape, TensorType, Unary, dim_attr, register_op

__all__ = ["Positions", "Rotary", "ROPE_STYLES", "ROPE_SCALINGS", "rope_inv_freq", "rotate_matrix", "spread_matrix", "decompose_rotary"]

ROPE_STYLES = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "llama3")


def _int(op: str, name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise OpError(f"{op}: attribute {name!r} must be an int >= {least}, got {value!r}")
    return int(value)


def _number(op: str, name: str, value: object, positive: bool = True) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        raise OpError(f"{op}: attribute {name!r} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


@register_op
@dataclass(frozen=True)
class Positions(Op):
    """``offset + arange(n)`` as int64, where ``n`` is axis ``axis`` of the input (token positions of a sequence).

    With a KV cache of past length P, ``Positions(axis=2, offset="past_seq")`` of
    ``q [B, H, S, D]`` gives the positions P..P+S-1 of the new tokens.
    """

    axis: int
    offset: Dim = 0
    arity: ClassVar[int | None] = 1
    reads_shape_only: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, (int, np.integer)):
            raise OpError(f"Positions: attribute 'axis' must be an int, got {self.axis!r}")
        object.__setattr__(self, "axis", int(self.axis))
        object.__setattr__(self, "offset", dim_attr("Positions", "offset", self.offset))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        if not -x.rank <= self.axis < x.rank:
            raise OpError(f"Positions: axis {self.axis} is out of range for rank {x.rank}")
        return TensorType((x.shape[self.axis],), "int64")

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        start = eval_dim(self.offset, dims)
        return np.arange(start, start + args[0].shape[self.axis], dtype=np.int64)


def rope_inv_freq(
    rotary_dim: int,
    base: float,
    scaling: str = "none",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> np.ndarray:
    """The ``rotary_dim // 2`` inverse frequencies, float32, after the frequency scaling."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    inv_freq = (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)
    if scaling == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32)
    if scaling == "llama3":
        low_wavelen = original_max_position / low_freq_factor
        high_wavelen = original_max_position / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def spread_matrix(style: str, rotary_dim: int, head_dim: int) -> np.ndarray:
    """``E [rotary_dim/2, head_dim]``: feature ``k`` takes the angle of frequency ``f`` where ``E[f, k] = 1``."""
    half = rotary_dim // 2
    e = np.zeros((half, head_dim), np.float32)
    for f in range(half):
        pair = (f, f + half) if style == "half" else (2 * f, 2 * f + 1)
        e[f, list(pair)] = 1
    return e


def rotate_matrix(style: str, rotary_dim: int, head_dim: int) -> np.ndarray:
    """``R [head_dim, head_dim]`` with ``(x @ R)[k]`` the pair partner of ``x[k]``, signed (``rotate_half`` for ``half``)."""
    half = rotary_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    for f in range(half):
        a, b = (f, f + half) if style == "half" else (2 * f, 2 * f + 1)
        r[b, a] = -1.0  # out[a] = -x[b]
        r[a, b] = 1.0  # out[b] = x[a]
    return r


@register_op
@dataclass(frozen=True)
class Rotary(Op):
    """Rotary position embedding of ``x [B, H, S, D]`` at ``positions`` (int64 ``[S]`` or ``[B, S]``); see the module doc."""

    style: str = "half"
    rotary_dim: int | None = None
    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    arity: ClassVar[int | None] = 2

    def __post_init__(self) -> None:
        if self.style not in ROPE_STYLES:
            raise OpError(f"Rotary: style must be one of {ROPE_STYLES}, got {self.style!r}")
        if self.scaling not in ROPE_SCALINGS:
            raise OpError(f"Rotary: scaling must be one of {ROPE_SCALINGS}, got {self.scaling!r}")
        if self.rotary_dim is not None:
            dim = _int("Rotary", "rotary_dim", self.rotary_dim, 2)
            if dim % 2:
                raise OpError(f"Rotary: rotary_dim must be even, got {dim}")
            object.__setattr__(self, "rotary_dim", dim)
        for name in ("base", "factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, name, _number("Rotary", name, getattr(self, name)))
        object.__setattr__(self, "original_max_position", _int("Rotary", "original_max_position", self.original_max_position, 1))
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise OpError(f"Rotary: llama3 scaling needs high_freq_factor > low_freq_factor, got {self.high_freq_factor} <= {self.low_freq_factor}")

    def dim(self, head_dim: int) -> int:
        """The rotated features for a head dim (all of them unless ``rotary_dim`` says fewer)."""
        return head_dim if self.rotary_dim is None else self.rotary_dim

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The inverse frequencies for ``head_dim``."""
        return rope_inv_freq(
            self.dim(head_dim), self.base, self.scaling, self.factor, self.low_freq_factor, self.high_freq_factor, self.original_max_position
        )

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        x, pos = ins
        if x.rank != 4:
            raise ShapeMismatchError(f"Rotary: x must be 4-D [batch, heads, seq, head_dim], got {x}")
        if x.dtype not in FLOAT_DTYPES:
            raise DTypeMismatchError(f"Rotary: x must be a float tensor, got {x.dtype}")
        if pos.dtype not in ("int32", "int64"):
            raise DTypeMismatchError(f"Rotary: positions must be int32 or int64, got {pos.dtype}")
        b, _, s, d = x.shape
        if pos.shape not in ((s,), (b, s)):
            raise ShapeMismatchError(f"Rotary: positions must be [{s}] or [{b},{s}] for x {x}, got {pos}")
        if not isinstance(d, int):
            raise ShapeMismatchError(f"Rotary: the head dim must be static, got {d!r}")
        if self.dim(d) > d:
            raise ShapeMismatchError(f"Rotary: rotary_dim {self.rotary_dim} exceeds the head dim {d}")
        return x

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        """Plain reference: rotate each pair ``(x_a, x_b)`` by its angle (float64 angles, as the decomposition)."""
        x, pos = args
        d = x.shape[-1]
        r = self.dim(d)
        half = r // 2
        angles = pos.astype(np.float64)[..., None] * self.inv_freq(d).astype(np.float64)  # [S, F] or [B, S, F]
        cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
        if cos.ndim == 3:  # per batch: [B, 1, S, F]
            cos, sin = cos[:, None], sin[:, None]
        out = x.copy()
        if self.style == "half":
            a, b = x[..., :half], x[..., half:r]
            out[..., :half] = a * cos - b * sin
            out[..., half:r] = b * cos + a * sin
        else:
            a, b = x[..., 0:r:2], x[..., 1:r:2]
            out[..., 0:r:2] = a * cos - b * sin
            out[..., 1:r:2] = b * cos + a * sin
        return out


def decompose_rotary(graph: Graph, node_name: str) -> str:
    """Replace the ``Rotary`` node by einsums and elementwise ops (see the module doc); returns a description."""
    node = graph.nodes[node_name]
    op = node.op
    if not isinstance(op, Rotary):
        raise GraphError(f"decompose_rotary: {node_name!r} is a {op.kind}, not Rotary")
    x, pos = node.inputs
    xt = graph.types[x]
    b, _, s, d = xt.shape
    assert isinstance(d, int)
    r = op.dim(d)

    def add(o: Op, inputs: Sequence[str], label: str) -> str:
        return graph.insert_before(node_name, o, inputs, f"{node_name}_{label}").name

    def const(label: str, arr: np.ndarray) -> str:  # one per graph and value: every layer's tables then merge (CSE)
        return graph.shared_initializer(f"rotary_{label}", arr)

    per_batch = graph.types[pos].rank == 2
    lead = "bs" if per_batch else "s"
    # Angles in float64: in float32, position x frequency loses ~angle * 6e-8 rad (2.4e-4 at position 4096), which
    # is the whole error of a float32 layer at long contexts.  The table is [S, rotary_dim/2]: float64 costs nothing.
    inv_freq = op.inv_freq(d).astype(np.float64)  # the float32 frequencies transformers uses, multiplied exactly
    angles = add(Einsum(f"{lead},f->{lead}f"), [add(Cast("float64"), [pos], "pos_f64"), const("inv_freq", inv_freq)], "angles")
    spread = const("spread", spread_matrix(op.style, r, d))
    tables = []
    for fn in ("cos", "sin"):
        t32 = add(Cast("float32"), [add(Unary(fn), [angles], fn)], f"{fn}_f32")
        t = add(Einsum(f"{lead}f,fd->{lead}d"), [t32, spread], f"{fn}_full")
        if fn == "cos" and r < d:  # features past rotary_dim pass through: cos 1, sin 0
            t = add(Binary("add"), [t, const("pass", (np.arange(d) >= r).astype(np.float32))], "cos_pass")
        if xt.dtype != "float32":
            t = add(Cast(xt.dtype), [t], f"{fn}_{xt.dtype}")
        if per_batch:
            t = add(Reshape((b, 1, s, d)), [t], f"{fn}_B1SD")
        tables.append(t)
    rot = const("rotate", rotate_matrix(op.style, r, d).astype(xt.dtype))
    partner = add(Einsum("bhsd,de->bhse"), [x, rot], "partner")
    y = add(Binary("add"), [add(Binary("mul"), [x, tables[0]], "x_cos"), add(Binary("mul"), [partner, tables[1]], "partner_sin")], "rotated")
    graph.substitute(node_name, {node_name: y})
    return f"decomposed rotary ({op.style}, {r} of {d} features) into einsums"
