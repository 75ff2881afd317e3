"""8-bit activations and weights as ONNX's integer ops define them: what ``quantize_dynamic`` and optimum write.

onnxruntime's ``quantize_dynamic`` (and ``optimum-cli onnxruntime quantize``) turn ``y = x @ W`` into::

    x_q, x_scale, x_zero = DynamicQuantizeLinear(x)                # uint8, per tensor, from x's range
    y = Cast(MatMulInteger(x_q, W_q, x_zero, W_zero), float) * (x_scale * W_scale)

:class:`DynamicQuantize` and :class:`IntegerMatMul` are those two ops with ONNX's semantics (and :class:`Dequantize`
is ``DequantizeLinear`` of 8-bit data: the quantized embedding table ``quantize_dynamic`` writes for a ``Gather``;
:class:`Quantize` is ``QuantizeLinear``: with ``Dequantize``, the QDQ pairs of ``quantize_static``'s files) (``round`` half to even,
saturating), so the NumPy interpreter gives the reference numbers and the export writes the same standard ops back:
``W_q`` stays ``int8``/``uint8`` as the file holds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .dims import format_shape, normalize_dim
from .errors import DTypeMismatchError, ShapeMismatchError
from .errors import OpError
from .ops import FLOAT_DTYPES, QUANTIZED_DTYPES, Dims, Op, TensorType, broadcast_shapes, register_op

__all__ = ["DynamicQuantize", "IntegerMatMul", "Dequantize", "Quantize", "dynamic_quantize"]


def dynamic_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ONNX ``DynamicQuantizeLinear``: ``(uint8 values, float32 scale, uint8 zero point)`` of ``x``'s range with 0 in
    it, computed in float32 as onnxruntime computes it; an all-zero ``x`` gets scale 1 as onnxruntime gives it (ONNX's
    reference evaluator gives 1/255: the values and zero point, 0, are the same either way)."""
    x = np.asarray(x, np.float32)
    lo = np.minimum(x.min(), np.float32(0)) if x.size else np.float32(0)
    hi = np.maximum(x.max(), np.float32(0)) if x.size else np.float32(0)
    scale = np.float32((hi - lo) / np.float32(255))
    if scale == 0:
        return np.zeros(x.shape, np.uint8), np.array(1.0, np.float32), np.array(0, np.uint8)
    zero = np.clip(np.rint(-lo / scale), 0, 255)
    q = np.clip(np.rint(x / scale) + zero, 0, 255)
    return q.astype(np.uint8), np.array(scale, np.float32), np.array(zero, np.uint8)


def _same_form(zero: TensorType, scale: TensorType) -> bool:
    """A zero point matches its scale: the same shape, or each one value (``[]`` or ``[1]``, as files mix them)."""
    return zero.shape == scale.shape or (zero.shape in ((), (1,)) and scale.shape in ((), (1,)))


def _check_scale_form(kind: str, x: TensorType, scale: TensorType, axis: int, block_size: int) -> None:
    """ONNX's three forms of ``(De)QuantizeLinear`` scales: one value, one a slice along ``axis``, or block-wise."""
    per_axis = scale.rank == 1 and scale.shape[0] != 1
    if (block_size or per_axis) and not -x.rank <= axis < x.rank:  # one value for the whole tensor: the axis plays no part
        raise OpError(f"{kind}: axis {axis} is out of range for rank {x.rank}")
    if block_size and scale.rank != x.rank:
        raise ShapeMismatchError(f"{kind}: block-wise scales have x's rank {x.rank}, got {format_shape(scale.shape)}")
    if not block_size and scale.rank > 1:
        raise ShapeMismatchError(f"{kind}: scales are one value or one a slice along axis {axis}, got {format_shape(scale.shape)}")


def _spread(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, axis: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The float32 scale and zero point broadcastable against ``x``: as given, along ``axis``, or each block's repeated."""
    zero = np.asarray(zero_point).astype(np.float32) if zero_point is not None else np.zeros(scale.shape, np.float32)
    if block_size:
        axis %= x.ndim
        rows = np.arange(x.shape[axis])
        return np.repeat(scale, block_size, axis=axis).take(rows, axis=axis), np.repeat(zero, block_size, axis=axis).take(rows, axis=axis)
    if scale.ndim == 1 and scale.size > 1:
        shape = [1] * x.ndim
        shape[axis % x.ndim] = scale.size
        return scale.reshape(shape), zero.reshape(shape)
    return scale, zero


@register_op
@dataclass(frozen=True)
class DynamicQuantize(Op):
    """``DynamicQuantizeLinear(x) -> (y uint8, y_scale float32 [], y_zero_point uint8 [])``."""

    arity: ClassVar[int | None] = 1
    num_outputs: ClassVar[int] = 3

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return self.infer_all(ins)[0]

    def infer_all(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        (x,) = ins
        if x.dtype != "float32":
            raise DTypeMismatchError(f"DynamicQuantize: x must be float32 (ONNX DynamicQuantizeLinear), got {x.dtype}")
        return TensorType(x.shape, "uint8"), TensorType((), "float32"), TensorType((), "uint8")

    def evaluate_all(self, args: Sequence[np.ndarray], dims: Dims) -> tuple[np.ndarray, ...]:
        return dynamic_quantize(args[0])

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """A min, a max and a divide-round per element."""
        return 3 * math.prod(in_shapes[0])


@register_op
@dataclass(frozen=True)
class IntegerMatMul(Op):
    """ONNX ``MatMulInteger``: ``(a - a_zero) @ (b - b_zero)`` in int32, for 8-bit ``a [..., M, K]`` and ``b [..., K, N]``
    (batch axes broadcast as ``numpy.matmul``'s: a projection's ``b [K, N]``, or optimum's quantized rotary product of
    two activations); zero points per tensor (``[]`` or ``[1]``), ``b``'s also per column (``[N]``); without them 0."""

    arity: ClassVar[int | None] = None

    def check_arity(self, n: int) -> None:
        if n not in (2, 3, 4):
            raise OpError(f"IntegerMatMul: takes a, b and up to two zero points, got {n} operand(s)")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        a, b = ins[0], ins[1]
        for name, t in (("a", a), ("b", b), *((f"zero point {i}", z) for i, z in enumerate(ins[2:]))):
            if t.dtype not in QUANTIZED_DTYPES:
                raise DTypeMismatchError(f"IntegerMatMul: {name} must be int8 or uint8, got {t.dtype}")
        if b.rank < 2 or a.rank < 1 or normalize_dim(a.shape[-1]) != normalize_dim(b.shape[-2]):
            raise ShapeMismatchError(f"IntegerMatMul: a {format_shape(a.shape)} and b {format_shape(b.shape)} must be [..., K] and [..., K, N]")
        for i, z in enumerate(ins[2:]):
            n = b.shape[-1] if i == 1 else None
            if z.rank > 1 or (z.rank == 1 and normalize_dim(z.shape[0]) not in (1, normalize_dim(n) if n is not None else 1)):
                per = " or one a column" if i else ""
                raise ShapeMismatchError(f"IntegerMatMul: zero point {i} {format_shape(z.shape)} must be one value{per}")
        if a.rank == 1:
            return TensorType((*b.shape[:-2], b.shape[-1]), "int32")
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], "IntegerMatMul")
        return TensorType((*batch, a.shape[-2], b.shape[-1]), "int32")

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        a = args[0].astype(np.int32) - (args[2].astype(np.int32) if len(args) > 2 else 0)
        b = args[1].astype(np.int32) - (args[3].astype(np.int32).reshape(1, -1) if len(args) > 3 else 0)
        return np.matmul(a, b).astype(np.int32)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """A multiply-add per weight per row."""
        return 2 * math.prod(out_shapes[0]) * in_shapes[1][-2]


@register_op
@dataclass(frozen=True)
class Dequantize(Op):
    """ONNX ``DequantizeLinear`` of 8-bit ``x`` (or int32: the bias ``quantize_static`` quantizes with its product's
    scale): ``(x - zero_point) * scale`` in the scale's dtype; the scale (and zero
    point) one value (``[]``/``[1]``), one a slice along ``axis`` (``[x.shape[axis]]``), or, with ``block_size``, of
    ``x``'s rank with ``axis`` in blocks of ``block_size`` (opset 21)."""

    axis: int = 1
    block_size: int = 0
    arity: ClassVar[int | None] = None
    folds: ClassVar[bool] = False  # an 8-bit weight stays 8-bit: never folded into its float values

    def check_arity(self, n: int) -> None:
        if n not in (2, 3):
            raise OpError(f"Dequantize: takes x, its scale and an optional zero point, got {n} operand(s)")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        x, scale = ins[0], ins[1]
        if x.dtype not in (*QUANTIZED_DTYPES, "int32"):
            raise DTypeMismatchError(f"Dequantize: x must be int8, uint8 or int32 (a quantized bias), got {x.dtype}")
        if scale.dtype not in FLOAT_DTYPES:
            raise DTypeMismatchError(f"Dequantize: the scale must be float, got {scale.dtype}")
        if len(ins) == 3 and (ins[2].dtype != x.dtype or not _same_form(ins[2], scale)):
            raise ShapeMismatchError(f"Dequantize: the zero point must be {x.dtype}{format_shape(scale.shape)} like x and the scale")
        _check_scale_form("Dequantize", x, scale, self.axis, self.block_size)
        return TensorType(x.shape, scale.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        x, scale = args[0], np.asarray(args[1])
        scale32, zero = _spread(x, scale.astype(np.float32), args[2] if len(args) == 3 else None, self.axis, self.block_size)
        return ((x.astype(np.float32) - zero) * scale32).astype(scale.dtype)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Two per element."""
        return 2 * math.prod(out_shapes[0])


@register_op
@dataclass(frozen=True)
class Quantize(Op):
    """ONNX ``QuantizeLinear`` to 8 bits: ``saturate(round(x / scale) + zero_point)``, rounding half to even, in
    ``dtype`` (``int8`` or ``uint8``: the zero point's, else uint8); the scale (and zero point) one value, one a slice
    along ``axis``, or, with ``block_size``, of ``x``'s rank with ``axis`` in blocks of ``block_size`` (opset 21)."""

    dtype: str = "uint8"
    axis: int = 1
    block_size: int = 0
    arity: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        if self.dtype not in QUANTIZED_DTYPES:
            raise OpError(f"Quantize: dtype must be int8 or uint8, got {self.dtype!r}")

    def check_arity(self, n: int) -> None:
        if n not in (2, 3):
            raise OpError(f"Quantize: takes x, its scale and an optional zero point, got {n} operand(s)")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        x, scale = ins[0], ins[1]
        if x.dtype not in FLOAT_DTYPES or scale.dtype not in FLOAT_DTYPES:
            raise DTypeMismatchError(f"Quantize: x and its scale must be float, got {x.dtype} and {scale.dtype}")
        if len(ins) == 3 and (ins[2].dtype != self.dtype or not _same_form(ins[2], scale)):
            raise ShapeMismatchError(f"Quantize: the zero point must be {self.dtype}{format_shape(scale.shape)}, like the scale")
        _check_scale_form("Quantize", x, scale, self.axis, self.block_size)
        return TensorType(x.shape, self.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        x = np.asarray(args[0], np.float32)
        scale, zero = _spread(x, np.asarray(args[1], np.float32), args[2] if len(args) == 3 else None, self.axis, self.block_size)
        info = np.iinfo(self.dtype)
        return np.clip(np.rint(x / scale) + zero, info.min, info.max).astype(self.dtype)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """A divide, a round and an add per element."""
        return 3 * math.prod(out_shapes[0])
