"""Ops that imported models need beyond attention's einsum core: reductions, gathers, shape values.

- :class:`Reduce` sums, averages or takes the max/min over axes (the norms of
  an imported decoder: ``ReduceMean(x * x)``).
- :class:`Gather` indexes one axis with a runtime index tensor (``position_ids``
  into a RoPE cos/sin cache, token ids into an embedding table).
- :class:`Arange` is ``start .. stop-1`` for dims known at run time (positions
  of a length no tensor of the graph has as an axis).
- :class:`BroadcastTo` stretches size-1 axes to a (symbolic) shape: an
  ``Expand`` whose result is used as it is, not only broadcast into another op.
- :class:`ShapeValues` is a small int64 tensor whose entries are dims, such as
  ``[batch, seq, 4096]``: what an ONNX ``Shape`` computation evaluates to when it
  must exist at run time (an input of an op graphc passes through unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .dims import Dim, Shape, dim_sub, eval_dim, eval_shape, format_shape, normalize_dim, normalize_shape
from .errors import DimError, DTypeMismatchError, OpError, ShapeMismatchError, UnknownNameError
from .ops import FLOAT_DTYPES, Dims, Op, TensorType, broadcast_shapes, dim_attr, register_op

__all__ = ["GatherElements", "Reduce", "Gather", "Slice", "ShapeValues", "Arange", "BroadcastTo", "REDUCE_FUNCTIONS"]

REDUCE_FUNCTIONS = ("sum", "mean", "max", "min")


@register_op
@dataclass(frozen=True)
class Reduce(Op):
    """Reduce ``x`` with ``fn`` (one of :data:`REDUCE_FUNCTIONS`) over ``axes``; ``keepdims`` keeps them as size 1."""

    fn: str
    axes: tuple[int, ...]
    keepdims: bool = True
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        if not isinstance(self.fn, str) or self.fn not in REDUCE_FUNCTIONS:
            raise UnknownNameError("reduction", str(self.fn), REDUCE_FUNCTIONS)
        if isinstance(self.axes, (str, bytes)) or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in self.axes):
            raise OpError(f"Reduce: attribute 'axes' must be a sequence of ints, got {self.axes!r}")
        object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))
        if not isinstance(self.keepdims, bool):
            raise OpError(f"Reduce: attribute 'keepdims' must be a bool, got {self.keepdims!r}")

    def normalized_axes(self, rank: int) -> tuple[int, ...]:
        """The reduced axes as non-negative, sorted, checked against ``rank``."""
        out = set()
        for a in self.axes:
            if not -rank <= a < rank:
                raise OpError(f"Reduce: axis {a} is out of range for rank {rank}")
            out.add(a % rank)
        if len(out) != len(self.axes):
            raise OpError(f"Reduce: axes {list(self.axes)} repeat an axis")
        return tuple(sorted(out))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        if x.dtype == "bool":
            raise DTypeMismatchError(f"Reduce {self.fn}: operand 0 is bool; reduce a float or int tensor")
        if self.fn == "mean" and x.dtype not in FLOAT_DTYPES:
            raise DTypeMismatchError(f"Reduce mean: operand 0 must be a float tensor, got {x.dtype}")
        axes = self.normalized_axes(x.rank)
        shape = [1 if i in axes else d for i, d in enumerate(x.shape)] if self.keepdims else [d for i, d in enumerate(x.shape) if i not in axes]
        return TensorType(tuple(shape), x.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        x = args[0]
        axes = self.normalized_axes(x.ndim)
        reducers: dict[str, Callable[..., Any]] = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}
        fn = reducers[self.fn]
        if self.fn in ("max", "min") and any(x.shape[a] == 0 for a in axes):
            raise OpError(f"Reduce {self.fn}: cannot reduce an empty axis (shape {list(x.shape)})")
        return np.asarray(fn(x, axis=axes, keepdims=self.keepdims)).astype(x.dtype, copy=False)


@register_op
@dataclass(frozen=True)
class Gather(Op):
    """``take(data, indices, axis)``: the output replaces axis ``axis`` of ``data`` by the shape of ``indices`` (int32/int64; negative counts
    from the end)."""

    axis: int = 0
    arity: ClassVar[int | None] = 2

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, (int, np.integer)):
            raise OpError(f"Gather: attribute 'axis' must be an int, got {self.axis!r}")
        object.__setattr__(self, "axis", int(self.axis))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        data, idx = ins
        if idx.dtype not in ("int32", "int64"):
            raise DTypeMismatchError(f"Gather: operand 1 (indices) must be int32 or int64, got {idx.dtype}")
        if not -data.rank <= self.axis < data.rank:
            raise OpError(f"Gather: axis {self.axis} is out of range for rank {data.rank}")
        a = self.axis % data.rank
        return TensorType(data.shape[:a] + idx.shape + data.shape[a + 1 :], data.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        data, idx = args
        a = self.axis % data.ndim
        n = data.shape[a]
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise OpError(f"Gather: index out of range for axis {a} of size {n} (indices span {int(idx.min())}..{int(idx.max())})")
        return np.take(data, np.where(idx < 0, idx + n, idx), axis=a)


@register_op
@dataclass(frozen=True)
class GatherElements(Op):
    """``take_along_axis(data, indices, axis)``: ``out[..., i, ...] = data[..., indices[..., i, ...], ...]`` along ``axis``;
    ``indices`` has ``data``'s rank, and its shape is the output's (ONNX ``GatherElements``; negative indices count from the end)."""

    axis: int = 0
    arity: ClassVar[int | None] = 2

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, (int, np.integer)):
            raise OpError(f"GatherElements: attribute 'axis' must be an int, got {self.axis!r}")
        object.__setattr__(self, "axis", int(self.axis))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        data, idx = ins
        if idx.dtype not in ("int32", "int64"):
            raise DTypeMismatchError(f"GatherElements: operand 1 (indices) must be int32 or int64, got {idx.dtype}")
        if idx.rank != data.rank:
            raise ShapeMismatchError(f"GatherElements: indices {format_shape(idx.shape)} must have the rank of data {format_shape(data.shape)}")
        if not -data.rank <= self.axis < data.rank:
            raise OpError(f"GatherElements: axis {self.axis} is out of range for rank {data.rank}")
        return TensorType(idx.shape, data.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        data, idx = args
        a = self.axis % data.ndim
        n = data.shape[a]
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise OpError(f"GatherElements: index out of range for axis {a} of size {n} (indices span {int(idx.min())}..{int(idx.max())})")
        for i, (dd, di) in enumerate(zip(data.shape, idx.shape)):
            if i != a and di > dd:
                raise OpError(f"GatherElements: indices {list(idx.shape)} exceed data {list(data.shape)} on axis {i}")
        data = data[tuple(slice(None) if i == a else slice(0, di) for i, di in enumerate(idx.shape))]
        return np.take_along_axis(data, np.where(idx < 0, idx + n, idx), axis=a)


@register_op
@dataclass(frozen=True)
class Slice(Op):
    """``x[start:stop:step]`` along ``axis``; ``start``/``stop`` are dims (symbolic allowed) with ``0 <= start <= stop <= size``, ``step >= 1``."""

    axis: int
    start: Dim
    stop: Dim
    step: int = 1
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, (int, np.integer)):
            raise OpError(f"Slice: attribute 'axis' must be an int, got {self.axis!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, (int, np.integer)) or self.step < 1:
            raise OpError(f"Slice: attribute 'step' must be an int >= 1, got {self.step!r}")
        object.__setattr__(self, "axis", int(self.axis))
        object.__setattr__(self, "step", int(self.step))
        object.__setattr__(self, "start", dim_attr("Slice", "start", self.start))
        object.__setattr__(self, "stop", dim_attr("Slice", "stop", self.stop))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        if not -x.rank <= self.axis < x.rank:
            raise OpError(f"Slice: axis {self.axis} is out of range for rank {x.rank}")
        a = self.axis % x.rank
        size = x.shape[a]
        length = dim_sub(self.stop, self.start)
        if isinstance(length, int) and length < 0 or isinstance(size, int) and isinstance(self.stop, int) and self.stop > size:
            raise OpError(f"Slice: [{self.start}:{self.stop}] does not fit axis {a} of size {size}")
        if self.step != 1:
            if not isinstance(length, int):
                raise OpError(f"Slice: a step of {self.step} needs static bounds, got [{self.start}:{self.stop}]")
            length = -(-length // self.step)
        return TensorType(x.shape[:a] + (length,) + x.shape[a + 1 :], x.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        x = args[0]
        a = self.axis % x.ndim
        start, stop = eval_dim(self.start, dims), eval_dim(self.stop, dims)
        if not 0 <= start <= stop <= x.shape[a]:  # an import's assumption (x[-8:] of an axis >= 8) that this run breaks
            raise DimError(
                f"Slice: bounds {self.start}..{self.stop} = {start}..{stop} fall outside axis {a} of size {x.shape[a]} "
                f"(with {', '.join(f'{k}={v}' for k, v in dims.items())})"
            )
        index = [slice(None)] * x.ndim
        index[a] = slice(start, stop, self.step)
        return x[tuple(index)]


@register_op
@dataclass(frozen=True)
class ShapeValues(Op):
    """An int64 tensor holding ``values`` (dims, evaluated at run time): rank 1, or rank 0 when ``scalar`` (one value)."""

    values: tuple[Dim, ...]
    scalar: bool = False
    arity: ClassVar[int | None] = 0

    def __post_init__(self) -> None:
        if isinstance(self.values, (str, bytes)):
            raise OpError(f"ShapeValues: attribute 'values' must be a sequence of dims, got {self.values!r}")
        try:
            object.__setattr__(self, "values", tuple(normalize_dim(d) for d in self.values))
        except DimError as e:
            raise OpError(f"ShapeValues: attribute 'values': {e}") from None
        if not isinstance(self.scalar, bool):
            raise OpError(f"ShapeValues: attribute 'scalar' must be a bool, got {self.scalar!r}")
        if self.scalar and len(self.values) != 1:
            raise OpError(f"ShapeValues: a scalar holds one value, got {len(self.values)}")

    def check_arity(self, n: int) -> None:
        if n:
            raise OpError(f"ShapeValues takes no inputs, got {n}")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return TensorType(() if self.scalar else (len(self.values),), "int64")

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        out = np.array([eval_dim(d, dims) for d in self.values], np.int64)
        return out.reshape(()) if self.scalar else out


@register_op
@dataclass(frozen=True)
class Arange(Op):
    """The int64 positions ``start, start+1, ..., stop-1`` for dims known at run time (an ONNX ``Range`` over shape values).

    Its length ``stop - start`` is the output's (symbolic) dim, so it broadcasts against tensors of that length.
    """

    start: Dim
    stop: Dim
    arity: ClassVar[int | None] = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", dim_attr("Arange", "start", self.start))
        object.__setattr__(self, "stop", dim_attr("Arange", "stop", self.stop))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return TensorType((dim_sub(self.stop, self.start),), "int64")

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        start, stop = eval_dim(self.start, dims), eval_dim(self.stop, dims)
        if stop < start:
            raise OpError(f"Arange: stop {self.stop}={stop} is below start {self.start}={start}")
        return np.arange(start, stop, dtype=np.int64)


@register_op
@dataclass(frozen=True)
class BroadcastTo(Op):
    """``x`` broadcast to ``shape`` (an ONNX ``Expand`` to a shape computed from dims): size-1 axes stretch."""

    shape: Shape
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "shape", normalize_shape(self.shape))
        except DimError as e:
            raise OpError(f"BroadcastTo: {e}") from None

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        out = broadcast_shapes(x.shape, self.shape, "BroadcastTo")
        if tuple(out) != tuple(self.shape):
            raise ShapeMismatchError(
                f"BroadcastTo: {format_shape(x.shape)} does not broadcast to {format_shape(self.shape)} (it gives {format_shape(out)})"
            )
        return TensorType(self.shape, x.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return np.ascontiguousarray(np.broadcast_to(args[0], eval_shape(self.shape, dims)))
