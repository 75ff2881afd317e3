"""The closed op set of graphc: frozen payloads with shape and dtype inference.

Each op is a frozen dataclass whose fields are its typed attributes (a scale is a
``float`` on :class:`Scale`, a causal offset a :data:`~graphc.dims.Dim` on
:class:`CausalMask`, a softmax axis an ``int``), never text folded into a name.
``op.infer(input_types)`` returns the output type or raises a
:class:`~graphc.errors.GraphError` subclass that says which operand is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, asdict, dataclass, fields, is_dataclass
from typing import Any, ClassVar, TypeVar

import ml_dtypes  # noqa: F401 - registers the bfloat16 dtype with NumPy
import numpy as np

from .dims import Dim, Shape, dim_add, dim_is_nonnegative, dim_prod, eval_dim, eval_shape, format_shape, normalize_dim, normalize_shape
from .einsum_spec import EinsumSpec, einsum_flops, infer_einsum_shape, parse_einsum
from .errors import DimError, DTypeMismatchError, OpError, ShapeMismatchError, UnknownNameError
from .visibility import Visibility
from .numerics import safe_softmax

__all__ = [
    "payload_fields",
    "DTYPES",
    "FLOAT_DTYPES",
    "LOW_PRECISION_DTYPES",
    "QUANTIZED_DTYPES",
    "dim_attr",
    "TensorType",
    "Op",
    "Einsum",
    "Reshape",
    "Transpose",
    "Repeat",
    "Softmax",
    "Concat",
    "Cast",
    "Unary",
    "Binary",
    "Compare",
    "COMPARE_FUNCTIONS",
    "Where",
    "Scale",
    "CausalMask",
    "UNARY_FUNCTIONS",
    "GroupOp",
    "op_registrar",
    "UnaryFunction",
    "register_unary",
    "BINARY_FUNCTIONS",
    "OP_TYPES",
    "register_op",
    "Dims",
    "check_dtype",
    "broadcast_shapes",
    "integer_divide",
]

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
QUANTIZED_DTYPES = ("int8", "uint8")
"""Integer storage of quantized weights (8-bit values, or 4-bit values packed two per byte in ``uint8``: see
:mod:`graphc.quantized`)."""
LOW_PRECISION_DTYPES = ("float16", "bfloat16")
"""Storage dtypes whose values every backend computes with in float32 (see :mod:`graphc.optimizer.precision`)."""
UNARY_FUNCTIONS: dict[str, "UnaryFunction"] = {}
"""Every unary function by name (see :func:`register_unary`); the ``Unary`` op, its NumPy semantics, the ONNX emitter,
the torch kernel and the ONNX importer all read this one table."""
BINARY_FUNCTIONS = ("add", "sub", "mul", "div", "max", "min", "pow")


def check_dtype(dtype: str) -> str:
    """Return ``dtype`` if graphc supports it, else raise :class:`UnknownNameError` listing the valid ones."""
    if dtype not in DTYPES:
        raise UnknownNameError("dtype", str(dtype), DTYPES)
    return dtype


@dataclass(frozen=True)
class TensorType:
    """The static type of a value: a shape of :data:`~graphc.dims.Dim` and a dtype name."""

    shape: Shape
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", normalize_shape(self.shape))
        check_dtype(self.dtype)

    @property
    def rank(self) -> int:
        """Number of axes."""
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}{format_shape(self.shape)}"


def _int_attr(op: str, name: str, value: object, least: int | None = None) -> int:
    """An int attribute (numpy ints accepted; bools, floats and strings refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OpError(f"{op}: attribute {name!r} must be an int, got {type(value).__name__} {value!r}")
    if least is not None and value < least:
        raise OpError(f"{op}: attribute {name!r} must be >= {least}, got {value}")
    return int(value)


def dim_attr(op: str, name: str, value: object) -> Dim:
    """A dim attribute (an int or a symbolic expression) in canonical form; a malformed one is an :class:`OpError`."""
    if isinstance(value, bool) or not isinstance(value, (int, str, np.integer)):
        raise OpError(f"{op}: attribute {name!r} must be an int or a dim expression, got {type(value).__name__} {value!r}")
    try:
        return normalize_dim(int(value) if isinstance(value, np.integer) else value)
    except DimError as e:
        raise OpError(f"{op}: attribute {name!r}: {e}") from None


def _str_attr(op: str, name: str, value: object) -> str:
    if not isinstance(value, str):
        raise OpError(f"{op}: attribute {name!r} must be a string, got {type(value).__name__} {value!r}")
    return value


def _axis(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < rank:
        raise OpError(f"{op}: axis {axis} is out of range for rank {rank}")
    return axis % rank


def _same_dtype(op: str, ins: Sequence[TensorType]) -> str:
    dtypes = {t.dtype for t in ins}
    if len(dtypes) > 1:
        listed = ", ".join(f"operand {i}: {t.dtype}" for i, t in enumerate(ins))
        raise DTypeMismatchError(f"{op}: operands must share one dtype ({listed})")
    return ins[0].dtype


def _float(op: str, t: TensorType, i: int = 0) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise DTypeMismatchError(f"{op}: operand {i} must be a float tensor, got {t.dtype}")


def _numeric(op: str, ins: Sequence[TensorType]) -> None:
    for i, t in enumerate(ins):
        if t.dtype == "bool":
            raise DTypeMismatchError(f"{op}: operand {i} is bool; arithmetic needs a float or int tensor (Cast it, or use Where for masks)")


def broadcast_shapes(a: Shape, b: Shape, op: str = "broadcast") -> Shape:
    """NumPy broadcasting of two symbolic shapes; a size-1 axis stretches, others must be equal."""
    rank = max(len(a), len(b))
    pa = (1,) * (rank - len(a)) + tuple(a)
    pb = (1,) * (rank - len(b)) + tuple(b)
    out = []
    for axis, (x, y) in enumerate(zip(pa, pb)):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ShapeMismatchError(f"{op}: shapes {format_shape(a)} and {format_shape(b)} do not broadcast (axis {axis}: {x!r} vs {y!r})")
    return tuple(out)


Dims = Mapping[str, int]
"""Bindings of symbolic dims at run time (``{"batch": 2, "seq": 16}``)."""


class Op:
    """Base of every op payload. Subclasses are frozen dataclasses.

    An op says what it computes in three places: ``infer`` (output types),
    ``evaluate`` (its reference semantics in plain NumPy, used by constant
    folding and the reference interpreter; backends may run faster kernels) and,
    for composite ops, a decomposition into simpler ops.
    """

    arity: ClassVar[int | None] = None  # None: variadic (at least one)
    num_outputs: ClassVar[int] = 1
    moves_data: ClassVar[bool] = True  # False for a view (Reshape): no FLOPs and no bytes in the cost model
    reads_shape_only: ClassVar[bool] = False  # True: the result depends on the operands' shapes, never their values
    folds: ClassVar[bool] = True  # False: never constant-folded (a dequantization: folding would widen quantized weights)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Floating-point operations on operands and results of these sizes (the cost model asks the op; 0: data movement only)."""
        return 0

    def neg_inf_rows(self, ins: Sequence[TensorType]) -> str:
        """How a row of ``-inf`` flows through the op with inputs of types ``ins`` (for the NaN guards of exported
        softmaxes): ``"propagate"`` (from
        any operand), ``"clear"`` (never in the result), ``"introduce"`` (the op may make one), ``"select"`` (from
        the operands after the first, as ``Where``'s values) or ``"contract"`` (only from constants: user tensors
        reaching a contraction are taken to be finite)."""
        return "propagate"

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        """Return the output type for inputs of types ``ins`` (single-output ops)."""
        raise NotImplementedError

    def infer_all(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        """Return the type of every output (one per :attr:`num_outputs`)."""
        return (self.infer(ins),)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        """The reference result for arrays ``args`` with symbolic dims bound by ``dims`` (single-output ops)."""
        raise NotImplementedError(f"{self.kind} has no reference semantics")

    def evaluate_all(self, args: Sequence[np.ndarray], dims: Dims) -> tuple[np.ndarray, ...]:
        """The reference result of every output."""
        return (self.evaluate(args, dims),)

    def check_arity(self, n: int) -> None:
        """Raise :class:`OpError` if ``n`` inputs do not fit this op."""
        if self.arity is not None and n != self.arity:
            raise OpError(f"{self.kind} takes {self.arity} input(s), got {n}")
        if self.arity is None and n < 1:
            raise OpError(f"{self.kind} takes at least one input, got none")

    @property
    def kind(self) -> str:
        """The op's name, e.g. ``"Einsum"``."""
        return type(self).__name__

    def attributes(self) -> dict[str, Any]:
        """The typed attributes as a plain dict (JSON-ready)."""
        out = {}
        for f in payload_fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else asdict(v) if is_dataclass(v) and not isinstance(v, type) else v
        return out

    def __str__(self) -> str:
        optional = {f.name for f in payload_fields(self) if f.default is None}
        attrs = ", ".join(f"{k}={_fmt(v)}" for k, v in self.attributes().items() if not (v is None and k in optional))
        return f"{self.kind}[{attrs}]" if attrs else self.kind


def payload_fields(op: Op | type[Op]) -> tuple[Field[Any], ...]:
    """The attribute fields of an op payload (an op instance or class), checked to be the frozen dataclass every op is."""
    if not is_dataclass(op):
        raise OpError(f"op {getattr(op, '__name__', type(op).__name__)} is not a dataclass: op payloads are frozen dataclasses")
    return fields(op)


def _fmt(v: Any) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


@dataclass(frozen=True)
class Einsum(Op):
    """Tensor contraction written as an explicit einsum spec, e.g. ``"bhqd,bhkd->bhqk"``.

    It cannot split or merge axes (use :class:`Reshape`); operands share one dtype.
    """

    spec: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", str(parse_einsum(_str_attr("Einsum", "spec", self.spec))))

    @property
    def parsed(self) -> EinsumSpec:
        """The spec as an :class:`~graphc.einsum_spec.EinsumSpec`."""
        return parse_einsum(self.spec)

    def check_arity(self, n: int) -> None:
        if n != len(self.parsed.inputs):
            raise OpError(f"Einsum {self.spec!r} has {len(self.parsed.inputs)} operand(s) but {n} input(s) were given")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        dtype = _same_dtype(f"Einsum {self.spec!r}", ins)
        _numeric(f"Einsum {self.spec!r}", ins)
        return TensorType(infer_einsum_shape(self.parsed, [t.shape for t in ins]), dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return np.einsum(self.spec, *args, optimize=len(args) > 1)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Two per multiply-add when a label is summed, in one go (:func:`~graphc.einsum_spec.einsum_flops`)."""
        sizes: dict[str, int] = {}
        for term, shape in zip(self.parsed.inputs, in_shapes):
            sizes.update(zip(term, shape))
        return einsum_flops(self.parsed, sizes)

    def neg_inf_rows(self, ins: Sequence[TensorType]) -> str:
        """A contraction carries ``-inf`` from constants only (a transpose, a single operand, passes everything)."""
        return "contract" if len(ins) > 1 else "propagate"


@dataclass(frozen=True)
class Reshape(Op):
    """Reinterpret a tensor with a new shape of the same element count (splits and merges axes)."""

    shape: Shape
    arity: ClassVar[int | None] = 1
    moves_data: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", normalize_shape(self.shape))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        if dim_prod(x.shape) != dim_prod(self.shape):
            raise ShapeMismatchError(
                f"Reshape: cannot reshape {format_shape(x.shape)} ({dim_prod(x.shape)} elements) to {format_shape(self.shape)} "
                f"({dim_prod(self.shape)} elements)"
            )
        return TensorType(self.shape, x.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return args[0].reshape(eval_shape(self.shape, dims))


@dataclass(frozen=True)
class Transpose(Op):
    """Permute axes: output axis i is input axis ``perm[i]``."""

    perm: tuple[int, ...]
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        if isinstance(self.perm, (str, bytes)) or not isinstance(self.perm, (tuple, list)):
            raise OpError(f"Transpose: attribute 'perm' must be a list of ints, got {type(self.perm).__name__} {self.perm!r}")
        object.__setattr__(self, "perm", tuple(_int_attr("Transpose", "perm", p) for p in self.perm))
        if sorted(self.perm) != list(range(len(self.perm))):
            raise OpError(f"Transpose: perm {list(self.perm)} is not a permutation of 0..{len(self.perm) - 1}")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        if len(self.perm) != x.rank:
            raise ShapeMismatchError(f"Transpose: perm {list(self.perm)} has length {len(self.perm)} but the input has rank {x.rank}")
        return TensorType(tuple(x.shape[p] for p in self.perm), x.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return args[0].transpose(self.perm)


@dataclass(frozen=True)
class Repeat(Op):
    """Repeat-interleave along ``axis``: element i of the output is element ``i // repeats`` of the input.

    This is ``torch.repeat_interleave`` and the KV-head repeat of GQA: query head h
    reads KV head ``h // repeats``.
    """

    axis: int
    repeats: int
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int_attr("Repeat", "axis", self.axis))
        object.__setattr__(self, "repeats", _int_attr("Repeat", "repeats", self.repeats, least=1))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        a = _axis(self.axis, x.rank, "Repeat")
        shape = list(x.shape)
        shape[a] = normalize_dim(dim_prod([shape[a], self.repeats]))
        return TensorType(tuple(shape), x.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return np.repeat(args[0], self.repeats, axis=self.axis)


@dataclass(frozen=True)
class Softmax(Op):
    """Softmax along ``axis``. A row whose entries are all ``-inf`` (fully masked) gives zeros, not NaN."""

    axis: int = -1
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int_attr("Softmax", "axis", self.axis))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        _float("Softmax", x)
        _axis(self.axis, x.rank, "Softmax")
        return x

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return safe_softmax(args[0], self.axis)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Max, subtract, exp, sum and divide: five per element."""
        return 5 * math.prod(out_shapes[0])

    def neg_inf_rows(self, ins: Sequence[TensorType]) -> str:
        """A softmax row is never all ``-inf`` (zeros for a fully masked row)."""
        return "clear"


@dataclass(frozen=True)
class Concat(Op):
    """Concatenate the inputs along ``axis`` (the KV cache appends new keys to past keys)."""

    axis: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int_attr("Concat", "axis", self.axis))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        dtype = _same_dtype("Concat", ins)
        rank = ins[0].rank
        a = _axis(self.axis, rank, "Concat")
        total: Dim = 0
        for i, t in enumerate(ins):
            if t.rank != rank:
                raise ShapeMismatchError(f"Concat: operand {i} has rank {t.rank}, operand 0 has rank {rank}")
            for ax in range(rank):
                if ax != a and t.shape[ax] != ins[0].shape[ax]:
                    raise ShapeMismatchError(
                        f"Concat(axis={self.axis}): operand {i} shape {format_shape(t.shape)} differs from operand 0 shape "
                        f"{format_shape(ins[0].shape)} at axis {ax}"
                    )
            total = dim_add(total, t.shape[a])
        shape = list(ins[0].shape)
        shape[a] = total
        return TensorType(tuple(shape), dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return np.concatenate(args, axis=self.axis)


@dataclass(frozen=True)
class Cast(Op):
    """Convert to ``dtype``."""

    dtype: str
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        check_dtype(_str_attr("Cast", "dtype", self.dtype))

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return TensorType(ins[0].shape, self.dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return args[0].astype(self.dtype)


@dataclass(frozen=True)
class Unary(Op):
    """Elementwise unary function ``fn``, one of :data:`UNARY_FUNCTIONS` (:func:`register_unary` adds one)."""

    fn: str
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        if _str_attr("Unary", "fn", self.fn) not in UNARY_FUNCTIONS:
            raise UnknownNameError("unary function", self.fn, list(UNARY_FUNCTIONS))

    @property
    def function(self) -> UnaryFunction:
        """The registered function: its NumPy semantics and its ONNX and torch spellings."""
        return UNARY_FUNCTIONS[self.fn]

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        if not self.function.on_ints:
            _float(f"Unary {self.fn}", ins[0])
        _numeric(f"Unary {self.fn}", ins)
        return ins[0]

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return self.function.numpy(args[0])

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """One per element of the result."""
        return math.prod(out_shapes[0])


@dataclass(frozen=True)
class UnaryFunction:
    """A unary function in one place: ``numpy`` (the reference semantics, in the input's dtype), ``onnx`` (the ONNX
    op type computing it, or ``None``: export refuses it, naming it), ``torch`` (the attribute path of the torch
    function, e.g. ``"nn.functional.softplus"``, or ``None``: the torch backend runs the NumPy semantics)."""

    name: str
    numpy: Callable[[np.ndarray], np.ndarray]
    onnx: str | None = None
    torch: str | None = None
    on_ints: bool = False


def register_unary(
    name: str, numpy: Callable[[np.ndarray], np.ndarray], onnx: str | None = None, torch: str | None = None, on_ints: bool = False
) -> UnaryFunction:
    """Add the unary function ``name`` to every layer at once (``Unary(name)``, NumPy, ONNX export and import, torch)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise OpError(f"register_unary: name must be an identifier, got {name!r}")
    fn = UnaryFunction(name, numpy, onnx, torch, on_ints)
    UNARY_FUNCTIONS[name] = fn
    return fn


@dataclass(frozen=True)
class Binary(Op):
    """Elementwise binary function ``fn`` (one of :data:`BINARY_FUNCTIONS`) with NumPy broadcasting.

    Operands are float or int (not bool) of one dtype.  On ints, ``div`` truncates
    toward zero and gives 0 for a zero divisor (:func:`integer_divide`); integer
    overflow wraps."""

    fn: str
    arity: ClassVar[int | None] = 2

    def __post_init__(self) -> None:
        if _str_attr("Binary", "fn", self.fn) not in BINARY_FUNCTIONS:
            raise UnknownNameError("binary function", self.fn, BINARY_FUNCTIONS)

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        dtype = _same_dtype(f"Binary {self.fn}", ins)
        _numeric(f"Binary {self.fn}", ins)
        return TensorType(broadcast_shapes(ins[0].shape, ins[1].shape, f"Binary {self.fn}"), dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return _BINARY[self.fn](args[0], args[1])

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """One per element of the result."""
        return math.prod(out_shapes[0])


COMPARE_FUNCTIONS = ("less", "less_equal", "greater", "greater_equal", "equal")


@dataclass(frozen=True)
class Compare(Op):
    """Elementwise comparison ``fn`` (one of :data:`COMPARE_FUNCTIONS`) of two numeric tensors with broadcasting; the result is bool."""

    fn: str
    arity: ClassVar[int | None] = 2

    def __post_init__(self) -> None:
        if _str_attr("Compare", "fn", self.fn) not in COMPARE_FUNCTIONS:
            raise UnknownNameError("comparison", self.fn, COMPARE_FUNCTIONS)

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        _same_dtype(f"Compare {self.fn}", ins)
        _numeric(f"Compare {self.fn}", ins)
        return TensorType(broadcast_shapes(ins[0].shape, ins[1].shape, f"Compare {self.fn}"), "bool")

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return _COMPARE[self.fn](args[0], args[1])


_COMPARE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "equal": np.equal,
}


@dataclass(frozen=True)
class Where(Op):
    """``where(cond, x, y)`` with broadcasting; ``cond`` is bool (a user attention mask: True = keep)."""

    arity: ClassVar[int | None] = 3

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        cond, x, y = ins
        if cond.dtype != "bool":
            raise DTypeMismatchError(f"Where: operand 0 (condition) must be bool, got {cond.dtype}")
        dtype = _same_dtype("Where", [x, y])
        shape = broadcast_shapes(broadcast_shapes(cond.shape, x.shape, "Where"), y.shape, "Where")
        return TensorType(shape, dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        return np.where(args[0], args[1], args[2])

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """One per element of the result."""
        return math.prod(out_shapes[0])

    def neg_inf_rows(self, ins: Sequence[TensorType]) -> str:
        """The values come from ``x`` or ``y``."""
        return "select"


@dataclass(frozen=True)
class Scale(Op):
    """Multiply by a constant ``factor`` (the attention scale, typically ``head_dim ** -0.5``)."""

    factor: float
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float, np.integer, np.floating)):
            raise OpError(f"Scale: attribute 'factor' must be a number, got {type(self.factor).__name__} {self.factor!r}")
        object.__setattr__(self, "factor", float(self.factor))
        if not math.isfinite(self.factor):
            raise OpError(f"Scale: factor must be finite, got {self.factor!r}")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        _float("Scale", ins[0])
        return ins[0]

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        with np.errstate(over="ignore"):  # a product past the dtype's range is +-inf, as IEEE and onnxruntime give it
            return args[0] * np.array(self.factor, args[0].dtype)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """One per element of the result."""
        return math.prod(out_shapes[0])


@dataclass(frozen=True)
class CausalMask(Op):
    """Set ``x[..., i, j]`` to ``-inf`` where key ``j`` is hidden from query ``i`` by position (axes -2: queries, -1: keys).

    Hidden: ``j > i + offset``.  With a KV cache of past length P the offset is P, so query i (the (P+i)-th
    token) sees keys 0..P+i.  ``offset`` may be symbolic (``"past_seq"``).
    A sliding ``window`` also hides ``j <= i + offset - window``: each query
    sees its last ``window`` keys (Mistral, Gemma 2).  :attr:`visibility` is the same as a
    :class:`~graphc.visibility.Visibility`.
    """

    offset: Dim = 0
    window: int | None = None
    arity: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", dim_attr("CausalMask", "offset", self.offset))
        if self.window is not None:
            object.__setattr__(self, "window", _int_attr("CausalMask", "window", self.window, least=1))

    @classmethod
    def of(cls, visibility: Visibility) -> CausalMask:
        """The positional part of a causal ``visibility`` as an op on the scores."""
        if visibility.causal_offset is None:
            raise OpError(f"CausalMask.of: {visibility.describe()} has no causal mask")
        return cls(visibility.causal_offset, visibility.window)

    @property
    def visibility(self) -> Visibility:
        """What the mask lets each query see."""
        return Visibility.causal(self.offset, self.window)

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        (x,) = ins
        _float("CausalMask", x)
        if x.rank < 2:
            raise ShapeMismatchError(f"CausalMask: input must have rank >= 2 (queries, keys), got shape {format_shape(x.shape)}")
        return x

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        x = args[0]
        return np.where(self.visibility.hidden(x.shape[-2], x.shape[-1], dims), np.array(-np.inf, x.dtype), x)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """One per element of the result."""
        return math.prod(out_shapes[0])

    def neg_inf_rows(self, ins: Sequence[TensorType]) -> str:
        """A negative offset, or a window that may start past the last key, can hide every key of a row."""
        queries, keys = ins[0].shape[-2:]
        return "introduce" if self.visibility.may_hide_whole_rows(queries, keys) else "propagate"


def integer_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """graphc's integer ``div``: the quotient truncated toward zero (C, ONNX), and 0 where the divisor is 0.

    Every backend computes this (onnxruntime's ``Div`` traps on a zero divisor,
    so the export guards it).
    """
    zero = b == 0
    safe = np.where(zero, np.ones((), b.dtype), b)
    q = np.floor_divide(a, safe)
    q = q + ((np.remainder(a, safe) != 0) & ((a < 0) != (safe < 0))).astype(q.dtype)
    return np.where(zero, np.zeros((), q.dtype), q)


for _name, _numpy, _onnx, _torch in (
    ("exp", np.exp, "Exp", "exp"),
    ("neg", np.negative, "Neg", "neg"),
    ("tanh", np.tanh, "Tanh", "tanh"),
    ("sqrt", np.sqrt, "Sqrt", "sqrt"),
    ("reciprocal", np.reciprocal, "Reciprocal", "reciprocal"),
    ("relu", lambda x: np.maximum(x, np.zeros((), x.dtype)), "Relu", "relu"),
    ("sigmoid", lambda x: _sigmoid(x), "Sigmoid", "sigmoid"),
    ("cos", np.cos, "Cos", "cos"),
    ("sin", np.sin, "Sin", "sin"),
    ("erf", lambda x: _erf(x), "Erf", "erf"),
    ("log", lambda x: _log(x), "Log", "log"),
    ("abs", np.abs, "Abs", "abs"),
):
    register_unary(_name, _numpy, _onnx, _torch, on_ints=_name in ("neg", "abs"))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))``, the same operations in the same order in one buffer (a SwiGLU prefill's gate is 11 MB:
    four temporaries of it cost more than the arithmetic)."""
    out = np.empty_like(x)
    np.negative(x, out=out)
    np.exp(out, out=out)
    np.add(out, 1, out=out)
    return np.divide(1, out, out=out)


def _log(x: np.ndarray) -> np.ndarray:
    """``log(x)``, quietly: ``log(0)`` is ``-inf`` and a negative's ``nan``, as in ONNX (T5's position buckets take
    ``log(0)`` in the branch their ``Where`` does not pick)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(x)


def _erf(x: np.ndarray) -> np.ndarray:
    """The error function in ``x``'s dtype (NumPy has no ufunc for it).

    Abramowitz & Stegun 7.1.26 evaluated in float64: absolute error below 1.5e-7,
    under float32's resolution near 1, where GELU needs it.
    """
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (np.sign(x) * (1.0 - poly * np.exp(-z * z))).astype(x.dtype)


_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": lambda a, b: integer_divide(a, b) if a.dtype.kind in "iu" else np.divide(a, b),
    "max": np.maximum,
    "min": np.minimum,
    "pow": lambda a, b: np.power(a, b) if a.dtype.kind == "f" else np.power(a, np.maximum(b, np.zeros((), b.dtype))),
}


class GroupOp:
    """Op groups declared once: rules and analyses name a group, not their own list of classes."""

    POINTWISE = (Scale, Unary)
    """One operand, one result element per operand element (hoistable above any layout change)."""
    ELEMENTWISE = (Unary, Binary, Compare, Where, Cast, Scale)
    """The result's axes align with the (broadcast) operands' axes, element by element."""
    LAST_AXES = (Softmax, CausalMask)
    """Axis-aligned, but computed along the last axis (softmax) or the last two (causal mask)."""
    AXIS_ALIGNED = ELEMENTWISE + LAST_AXES
    """Every op whose result axes are its operands' axes."""


OP_TYPES: dict[str, type[Op]] = {
    cls.__name__: cls for cls in (Einsum, Reshape, Transpose, Repeat, Softmax, Concat, Cast, Unary, Binary, Compare, Where, Scale, CausalMask)
}
"""Every op kind by name (the loader's registry); :func:`register_op` adds one."""

_O = TypeVar("_O", bound=type)


_F = TypeVar("_F", bound=Callable[..., Any])


def op_registrar(table: dict[type[Op], _F]) -> Callable[..., Callable[[_F], _F]]:
    """A decorator factory filling ``table`` by op type: ``@rule(OpA, OpB)`` registers the function for both (a
    backend's emitters, an analysis's per-op rules: each declared once, beside its function)."""

    def rule(*op_types: type[Op]) -> Callable[[_F], _F]:
        def register(fn: _F) -> _F:
            for t in op_types:
                table[t] = fn
            return fn

        return register

    return rule


def register_op(cls: _O) -> _O:
    """Class decorator: add an op payload class to :data:`OP_TYPES` (for loading, printing, backends)."""
    OP_TYPES[cls.__name__] = cls
    return cls
