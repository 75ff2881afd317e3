"""What an ONNX value is while graphc imports it, and the context converters share.

An ONNX value becomes one of:

- a graphc value (``str``, its name): a tensor computed at run time;
- a known array (``np.ndarray``): initializers, ``Constant`` and everything
  computed from them only (folded at import time);
- :class:`SymInts`: a small int tensor whose entries are dims (``Shape(x)``,
  ``Gather(Shape(x), 1)``, ``Concat([batch, seq, 32, 128])``): shape
  computations are evaluated symbolically, so ``Reshape`` gets a symbolic
  target shape instead of a run-time shape tensor;
- :class:`Filled` / :class:`Triangle`: ``ConstantOfShape``/``Expand`` of a scalar
  to a symbolic shape, and ``Trilu`` of one (the causal masks exporters build
  with ``torch.full(...).triu(k)``); they become a scalar, a ``CausalMask`` or
  a position comparison where they meet a tensor;
- :class:`Broadcast`: ``Expand`` of a tensor to a symbolic shape, used where
  broadcasting makes it implicit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Union

import numpy as np
import onnx

from ..dims import Dim, dim_add, dim_sub, dim_symbols, format_shape, is_static, is_symbol, normalize_dim
from ..einsum_spec import parse_einsum
from ..errors import EinsumSpecError, OnnxImportError, ShapeMismatchError
from ..graph import Graph, GraphMark
from ..ops import QUANTIZED_DTYPES, Binary, Cast, Compare, Concat, Einsum, Reshape, Where
from ..quantized_int8 import IntegerMatMul
from ..tensor_ops import Arange, BroadcastTo, ShapeValues
from ..visibility import KeyBound
from .unify import MAX_UNIFICATIONS, DimConflict, conflict_in_broadcast, conflict_in_pairs, substitute

__all__ = ["SymInts", "Filled", "Triangle", "MaskSum", "Broadcast", "Imported", "ImportContext", "ONNX_TO_DTYPE"]

ONNX_TO_DTYPE: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.BOOL: "bool",
}


@dataclass(frozen=True)
class SymInts:
    """A tensor of rank 0 or 1 whose entries are dims: int64, or a float/int32 ``dtype`` after a ``Cast`` (``arange`` bounds)."""

    values: tuple[Dim, ...]
    scalar: bool = False
    dtype: str = "int64"

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return () if self.scalar else (len(self.values),)


@dataclass(frozen=True)
class Filled:
    """A tensor of symbolic ``shape`` filled with the scalar ``value``."""

    value: np.ndarray
    shape: tuple[Dim, ...]


@dataclass(frozen=True)
class Triangle:
    """``Trilu(Filled, k)``: ``value`` where ``j - i >= k`` (upper) or ``j - i <= k`` (lower), else 0, over the last two axes."""

    value: np.ndarray
    shape: tuple[Dim, ...]
    k: Dim
    upper: bool

    def kept(self) -> KeyBound:
        """The keys where the triangle is 0 (the ones a triangle of a fill added to scores keeps): ``j <= i + k - 1``
        for an upper triangle, ``j >= i + k + 1`` for a lower one."""
        return KeyBound(True, dim_sub(self.k, 1)) if self.upper else KeyBound(False, dim_add(self.k, 1))


@dataclass(frozen=True)
class MaskSum:
    """A sum of :class:`Filled`/:class:`Triangle` masks (Mistral's ``triu`` + ``tril`` window), added term by term to the tensor it meets."""

    parts: tuple[Union[Filled, Triangle], ...]

    @property
    def shape(self) -> tuple[Dim, ...]:
        """The shape of the first term (all terms broadcast into the tensor they meet)."""
        return self.parts[0].shape


@dataclass(frozen=True)
class Broadcast:
    """Graph value ``name`` broadcast to ``shape`` (an ``Expand`` to a symbolic shape)."""

    name: str
    shape: tuple[Dim, ...]


Imported = Union[str, np.ndarray, SymInts, Filled, Triangle, MaskSum, Broadcast]


def simplify(v: Imported) -> Imported:
    """A :class:`SymInts` whose entries are all ints becomes a known array; a static :class:`Filled` becomes one too."""
    if isinstance(v, SymInts) and all(isinstance(d, int) for d in v.values):
        arr = np.array(v.values, v.dtype)
        return arr.reshape(()) if v.scalar else arr
    if isinstance(v, Filled) and is_static(v.shape) and int(np.prod([int(d) for d in v.shape])) <= 1 << 20:
        return np.full(tuple(int(d) for d in v.shape), v.value, v.value.dtype)
    return v


class ImportContext:
    """The graph being built, the ONNX value map and the helpers converters share."""

    def __init__(self, graph: Graph, opset: int, strict: bool, attention_semantics: str = "onnx-1.23") -> None:
        self.graph = graph
        self.attention_semantics = attention_semantics
        self.opset = opset
        self.strict = strict
        self.env: dict[str, Imported] = {}
        self.node: onnx.NodeProto | None = None
        self.onnx_types: dict[str, onnx.TypeProto] = {}
        self.notes: list[str] = []
        self.array_names: dict[int, str] = {}  # id(initializer array) -> its ONNX name
        self.constants: dict[int, tuple[np.ndarray, str]] = {}  # id(array) -> (array, graph value): each array becomes one constant
        self.aliases: dict[str, Dim] = {}  # free symbol -> the dim the model proved it equal to (see .unify)
        self.free: dict[str, int] = {}  # free symbols (graph inputs', opaque outputs') -> the order they were met
        self.unfolded: dict[str, Checkpoint] = {}  # symbol -> the first Div/Equal that could not fold a shape value of it

    # ------------------------------------------------------------ errors
    def where(self) -> str:
        """``node 'name' (OpType)`` for the node being converted, or ``model``."""
        n = self.node
        if n is None:
            return "model"
        label = n.name or (n.output[0] if n.output else "") or "<unnamed>"
        return f"node {label!r} ({(n.domain + '::') if n.domain else ''}{n.op_type})"

    def error(self, message: str) -> OnnxImportError:
        """An import error that names the node being converted."""
        return OnnxImportError(f"{self.where()}: {message}")

    def axis(self, axis: object, rank: int, what: str, extra: int = 0) -> int:
        """``axis`` of a rank-``rank`` tensor in ``0..rank-1+extra``, counted from the end when negative; out of range is an error.

        ``extra`` is 1 where the axis may name the position after the last one (``Flatten``, ``Unsqueeze``'s output).
        """
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -rank <= int(axis) < rank + extra:
            raise self.error(f"{what} {axis!r} is out of range for rank {rank} (valid: {-rank}..{rank + extra - 1})")
        return int(axis) + rank if axis < 0 else int(axis)

    # ------------------------------------------------------------ values
    def get(self, name: str) -> Imported | None:
        """The imported form of ONNX value ``name`` (``None`` for an omitted optional input)."""
        if not name:
            return None
        if name not in self.env:
            raise self.error(f"input {name!r} is not defined before this node (the graph is not in topological order, or a name is misspelt)")
        return self.env[name]

    def known(self, v: Imported | None, what: str) -> np.ndarray:
        """``v`` as a known array, or an error saying that ``what`` must be a constant."""
        v = simplify(v) if v is not None else v
        if not isinstance(v, np.ndarray):
            raise self.error(f"{what} must be known when the model is imported (a constant or a shape computation), got a run-time tensor")
        return v

    def ints(self, v: Imported | None, what: str) -> tuple[Dim, ...]:
        """``v`` as a 1-D sequence of dims (a known int array or a symbolic one)."""
        v = simplify(v) if v is not None else v
        if isinstance(v, SymInts):
            return v.values
        arr = self.known(v, what)
        if arr.dtype.kind not in "iu":
            raise self.error(f"{what} must be an int tensor, got {arr.dtype}")
        return tuple(int(x) for x in arr.reshape(-1))

    def shape_of(self, v: Imported) -> tuple[Dim, ...]:
        """The shape of any imported value."""
        if isinstance(v, str):
            return self.graph.types[v].shape
        if isinstance(v, np.ndarray):
            return tuple(v.shape)
        if isinstance(v, SymInts):
            return v.shape
        return v.shape

    def dtype_of(self, v: Imported) -> str:
        """The graphc dtype of any imported value."""
        if isinstance(v, str):
            return self.graph.types[v].dtype
        if isinstance(v, SymInts):
            return v.dtype
        if isinstance(v, MaskSum):
            v = v.parts[0]
        if isinstance(v, Broadcast):
            return self.graph.types[v.name].dtype
        return str((v if isinstance(v, np.ndarray) else v.value).dtype)

    def tensor(self, v: Imported | None, what: str = "operand") -> str:
        """``v`` as a graph value, adding a constant or a :class:`ShapeValues` node when needed."""
        if v is None:
            raise self.error(f"{what} is missing")
        v = simplify(v)
        if isinstance(v, str):
            return v
        if isinstance(v, np.ndarray):
            hit = self.constants.get(id(v))
            if hit is not None and hit[0] is v:
                return hit[1]
            name = self.constant(v, self.array_names.get(id(v), what))
            self.constants[id(v)] = (v, name)
            return name
        if isinstance(v, SymInts):
            out = self.graph.add_node(ShapeValues(v.values, v.scalar), [], self.graph.fresh_name("shape_values")).name
            return out if v.dtype == "int64" else self.add(Cast(v.dtype), [out], "shape_values_cast")
        if isinstance(v, Broadcast):  # used as it is: materialised
            return self.add(BroadcastTo(v.shape), [v.name], "expand")
        if isinstance(v, Filled):
            fill = self.constant(np.asarray(v.value).reshape(()), "fill")
            return self.add(BroadcastTo(v.shape), [fill], "filled")
        if isinstance(v, Triangle):
            return self._triangle(v)
        parts = [self.tensor(p, what) for p in v.parts]  # a MaskSum used as it is
        out = parts[0]
        for p in parts[1:]:
            out = self.add(Binary("add"), [out, p], "mask_sum")
        return out

    def triangle_keep(self, rows: Dim, cols: Dim, k: Dim, upper: bool) -> str:
        """A bool ``[rows, cols]`` tensor, True where ``j - i >= k`` (``upper``) or ``j - i <= k`` (the side ``Trilu`` keeps)."""
        r = self.graph.add_node(Arange(0, rows), [], self.graph.fresh_name("tri_rows")).name
        c = self.graph.add_node(Arange(0, cols), [], self.graph.fresh_name("tri_cols")).name
        diff = self.add(Binary("sub"), [c, self.add(Reshape((rows, 1)), [r], "tri_rows_col")], "tri_diff")
        k_value = self.tensor(SymInts((normalize_dim(k),), True), "Trilu k")
        return self.add(Compare("greater_equal" if upper else "less_equal"), [diff, k_value], "tri_keep")

    def _triangle(self, t: Triangle) -> str:
        """``Trilu`` of a fill as a tensor: ``value`` where ``j - i >= k`` (upper) or ``<= k`` (lower), else 0."""
        if len(t.shape) < 2:
            raise self.error(f"Trilu needs rank >= 2, got shape {format_shape(t.shape)}")
        keep = self.triangle_keep(t.shape[-2], t.shape[-1], t.k, t.upper)
        value = np.asarray(t.value).reshape(())
        out = self.add(Where(), [keep, self.constant(value, "tri_value"), self.constant(np.zeros((), value.dtype), "tri_zero")], "triangle")
        return out if len(t.shape) == 2 else self.add(BroadcastTo(t.shape), [out], "triangle")

    def constant(self, arr: np.ndarray, base: str = "const") -> str:
        """A new initializer holding ``arr`` (converted to a graphc dtype; int8/uint8 data, the bytes of quantized
        weights, kept as it is)."""
        arr = np.asarray(arr)
        if str(arr.dtype) in QUANTIZED_DTYPES:  # quantized data: kept as the file holds it
            return self.graph.add_initializer(self.graph.fresh_name(_clean(base)), arr, copy=arr.flags.writeable).name
        if arr.dtype.kind == "U":
            raise self.error(f"{base}: dtype {arr.dtype} has no graphc equivalent")
        if arr.dtype.kind in "iu" and arr.dtype != np.int32:
            arr = arr.astype(np.int64)
        return self.graph.add_initializer(self.graph.fresh_name(_clean(base)), arr, copy=arr.flags.writeable).name

    def add(self, op: Any, inputs: Sequence[str], base: str = "t") -> str:
        """Add a single-output node and return its value name.

        A shape error between two dims of which one is a free symbol raises :class:`DimConflict` (the import then
        starts again with the two unified, see :mod:`.unify`).
        """
        try:
            return self.graph.add_node(op, list(inputs), self.graph.fresh_name(_clean(base))).name
        except (ShapeMismatchError, EinsumSpecError) as e:
            conflict = self._conflict(op, [self.graph.types[i].shape for i in inputs if i in self.graph.types])
            if conflict is not None:
                raise DimConflict(conflict[0], conflict[1], e) from None
            raise

    def _conflict(self, op: Any, shapes: list[tuple[Dim, ...]]) -> tuple[str, Dim] | None:
        if isinstance(op, (Binary, Compare, Where)):
            return conflict_in_broadcast(shapes, self.free)
        if isinstance(op, Concat):
            rank = len(shapes[0])
            axis = op.axis % rank if rank else 0
            pairs = [(s[k], t[k]) for s in shapes for t in shapes if len(s) == len(t) == rank for k in range(rank) if k != axis]
            return conflict_in_pairs(pairs, self.free)
        if isinstance(op, IntegerMatMul) and len(shapes) >= 2 and shapes[0] and len(shapes[1]) >= 2:  # K, then the batch axes
            a, b = shapes[0], shapes[1]
            return conflict_in_pairs([(a[-1], b[-2])], self.free) or (conflict_in_broadcast([a[:-2], b[:-2]], self.free) if len(a) > 1 else None)
        if isinstance(op, Einsum):
            spec = parse_einsum(op.spec)
            seen: dict[str, list[Dim]] = {}
            for term, shape in zip(spec.inputs, shapes):
                for ch, d in zip(term, shape):
                    seen.setdefault(ch, []).append(d)
            return conflict_in_pairs(((ds[0], d) for ds in seen.values() for d in ds[1:]), self.free)
        return None

    def unify(self, a: Dim, b: Dim, atoms: bool = True) -> None:
        """Raise :class:`DimConflict` when ``a`` and ``b`` differ and one is a free symbol (the caller's dims must agree);
        ``atoms=False`` where unequal dims are no error in onnxruntime (see :func:`.unify.conflict_in_pairs`)."""
        conflict = conflict_in_pairs([(a, b)], self.free, atoms)
        if conflict is not None:
            raise DimConflict(conflict[0], conflict[1], ShapeMismatchError(f"dims {a!r} and {b!r} must be equal"))

    def checkpoint(self, index: int, op_type: str, ins: Sequence[Imported | None]) -> Checkpoint:
        """The import's state before node ``index`` is converted.  The value map is copied only before a ``Div`` or
        ``Equal`` of shape values alone (no graph value among ``ins``): the nodes a later unification may send the
        import back to."""
        given = [x for x in ins if x is not None]
        undecidable = op_type in _UNDECIDABLE and bool(given) and not any(isinstance(x, str) for x in given)
        env = dict(self.env) if undecidable else None
        return Checkpoint(index, self.graph.mark(), env, dict(self.free), len(self.notes), dict(self.unfolded))

    def note_unfolded(self, here: Checkpoint, ins: Sequence[Imported | None], outs: Sequence[Imported | None]) -> None:
        """After a ``Div`` or ``Equal`` of shape values that made a run-time tensor (``(b*t) / b2`` before ``b2`` is
        known to be ``b``: the dim arithmetic that can be undecided), remember its symbols: unifying one of them later
        sends the import back to ``here`` to convert the node again."""
        if here.env is None or not any(isinstance(o, str) for o in outs):
            return
        for s in {s for x in ins if x is not None for d in _lazy_dims(x) for s in dim_symbols(d)}:
            self.unfolded.setdefault(s, here)

    def unify_conflict(self, conflict: DimConflict, here: Checkpoint) -> int:
        """Undo the conversion that met ``conflict`` (back to ``here``) and unify the conflict's symbol with the dim the
        model proved it equal to, in everything imported so far: the graph's shapes and op attributes
        (:meth:`Graph.map_dims`) and the lazy values; later dims get it as they are declared or resolved.  Returns the
        index of the node to convert next: ``here``'s, or an earlier ``Div``/``Equal`` that could not fold with the old
        symbol (the import goes back there).  Past :data:`MAX_UNIFICATIONS` the conflict is the import's error."""
        if len(self.aliases) >= MAX_UNIFICATIONS:
            raise self.error(str(conflict.error))
        symbol = str(conflict.a)
        self.aliases[symbol] = conflict.b
        back = self.unfolded.get(symbol, here)
        self._restore(back)
        self.free.pop(symbol, None)  # replaced everywhere: no longer a symbol of the graph
        self.graph.map_dims(self.resolve)
        self.env = {k: _map_lazy_dims(v, self.resolve) for k, v in self.env.items()}
        return back.index

    def _restore(self, cp: Checkpoint) -> None:
        self.graph.roll_back(cp.mark)
        self.constants = {k: c for k, c in self.constants.items() if c[1] in self.graph.initializers}
        if cp.env is not None:
            self.env = dict(cp.env)
        self.free, self.unfolded = dict(cp.free), dict(cp.unfolded)
        del self.notes[cp.notes :]

    def declare_dim(self, d: Dim) -> Dim:
        """A dim of a graph input or an opaque output: aliases applied; a bare symbol becomes a free symbol."""
        d = substitute(normalize_dim(d), self.aliases)
        if isinstance(d, str) and is_symbol(d) and d not in self.free:
            self.free[d] = len(self.free)
        return d

    def resolve(self, d: Dim) -> Dim:
        """A dim computed by the model (a ``Max`` of dims, a clamped ``Slice`` bound) with the aliases applied: an atom
        the import assumed equal to one of its arguments becomes that argument."""
        return substitute(normalize_dim(d), self.aliases)

    def dim(self, d: Dim) -> Dim:
        """Normalize a dim, with the error on the node."""
        try:
            return normalize_dim(d)
        except Exception as e:  # noqa: BLE001 - DimError or a bad int
            raise self.error(str(e)) from None


_UNDECIDABLE = ("Div", "Equal")  # dim arithmetic that may not fold until two symbols are known equal


@dataclass(frozen=True)
class Checkpoint:
    """The import's state before node ``index``: the graph's extent and, before a ``Div``/``Equal``, the value map."""

    index: int
    mark: GraphMark
    env: dict[str, Imported] | None
    free: dict[str, int]
    notes: int
    unfolded: dict[str, Checkpoint]


def _lazy_dims(v: Imported) -> tuple[Dim, ...]:
    if isinstance(v, SymInts):
        return v.values
    if isinstance(v, MaskSum):
        return tuple(d for p in v.parts for d in _lazy_dims(p))
    if isinstance(v, Triangle):
        return (*v.shape, v.k)
    return tuple(v.shape) if isinstance(v, (Filled, Broadcast)) else ()


def _map_lazy_dims(v: Imported, fn: Callable[[Dim], Dim]) -> Imported:
    """A lazy value with ``fn`` applied to its dims (graph values and arrays are returned as they are)."""
    if isinstance(v, SymInts):
        return replace(v, values=tuple(fn(d) for d in v.values))
    if isinstance(v, Broadcast):
        return replace(v, shape=tuple(fn(d) for d in v.shape))
    if isinstance(v, (Filled, Triangle)):
        return _map_mask_dims(v, fn)
    if isinstance(v, MaskSum):
        return MaskSum(tuple(_map_mask_dims(p, fn) for p in v.parts))
    return v


def _map_mask_dims(v: Filled | Triangle, fn: Callable[[Dim], Dim]) -> Filled | Triangle:
    shape = tuple(fn(d) for d in v.shape)
    return replace(v, shape=shape, k=fn(v.k)) if isinstance(v, Triangle) else replace(v, shape=shape)


_BAD = re.compile(r"[^A-Za-z0-9_.:/\-]")


def _clean(name: str) -> str:
    name = _BAD.sub("_", name or "t")
    return name if re.match(r"[A-Za-z_/]", name) else f"v_{name}"
