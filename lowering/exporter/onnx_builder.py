"""``OnnxBuilder``: ONNX nodes and initializers collected for one graph, with shape tensors for its symbolic dims.

Every ONNX emitter (``lowering.exporter.onnx_export``'s per-op lowering, ``lowering.exporter.onnx_chunked``'s causal chunks) writes
through one builder: fresh names, constants, ``Shape``-based dims (a symbol read off the input that carries it, or
solved from an input's dim expression) and the ``-inf`` analysis that says which softmax needs a NaN guard.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphc.dims import Dim, dim_mul, dim_sub, dim_terms, is_static, is_symbol, min_max_args, normalize_dim
from graphc.errors import ExportError
from graphc.graph import Graph
from graphc.mapped import all_finite, all_finite_each
from graphc.ops import FLOAT_DTYPES, Binary

__all__ = ["OnnxBuilder", "may_carry_neg_inf", "ONNX_DTYPES", "QUANTIZED_FORMS"]

_T = TypeVar("_T")

ONNX_DTYPES = {
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "float32": TensorProto.FLOAT,
    "float64": TensorProto.DOUBLE,
    "int8": TensorProto.INT8,
    "uint8": TensorProto.UINT8,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
}


QUANTIZED_FORMS = ("matmulnbits", "qdq")
"""How an export writes a quantized product (:mod:`lowering.exporter.quantized_export`)."""


class OnnxBuilder:
    """Collects ONNX nodes and initializers; computes shape tensors for symbolic dims."""

    def __init__(self, graph: Graph, quantized: str = "matmulnbits", fused_matmul: bool = False) -> None:
        if quantized not in QUANTIZED_FORMS:
            raise ExportError(f"quantized must be one of {QUANTIZED_FORMS}, got {quantized!r}")
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set(graph.types)
        self._dim_cache: dict[Dim, str] = {}
        self.known_shapes: dict[str, tuple[Dim, ...]] = {}
        self.may_carry_neg_inf = may_carry_neg_inf(graph)
        self.quantized = quantized  # how a quantized product is written (lowering.exporter.quantized_export)
        self.fused_matmul = fused_matmul  # a transposed 2-D operand as FusedMatMul(transB=1): onnxruntime's contrib op
        self.symbol_source: dict[str, tuple[str, int]] = {}
        self._shaped: list[str] = list(graph.inputs)  # values whose shapes a Shape node may read (inputs, then computed ones)
        self._once: dict[Hashable, Any] = {}
        for name in graph.inputs:
            for axis, d in enumerate(graph.types[name].shape):
                if is_symbol(d):
                    self.symbol_source.setdefault(str(d), (name, axis))

    def computed(self, values: tuple[str, ...]) -> None:
        """Record node outputs now in the ONNX graph: a dim no input has (a data-dependent count, such as a NonZero's or
        an import's ``unk``) is read from the first of them that carries it."""
        for name in values:
            self._shaped.append(name)
            for axis, d in enumerate(self.graph.types[name].shape):
                if is_symbol(d):
                    self.symbol_source.setdefault(str(d), (name, axis))

    def once(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """What ``make`` emits, emitted once per graph for ``key`` and shared by every later caller with an equal key (the
        chunk bounds and masks every layer's attention reads).  Nodes are appended in order, so the first caller's
        nodes precede every later reader."""
        if key not in self._once:
            self._once[key] = make()
        return cast(_T, self._once[key])

    def fresh(self, base: str) -> str:
        """A tensor name not used yet."""
        name, i = base, 1
        while name in self._names:
            name, i = f"{base}_{i}", i + 1
        self._names.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, base: str = "t", domain: str = "", **attrs: Any) -> str:
        """Append an ONNX node with one output and return that output's name."""
        out = output or self.fresh(base)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.fresh(f"n_{out}"), domain=domain, **attrs))
        return out

    def op_outputs(self, op_type: str, inputs: list[str], count: int, base: str = "t", **attrs: Any) -> list[str]:
        """Append an ONNX node with ``count`` outputs (a Split) and return their names."""
        outs = [self.fresh(f"{base}_{i}") for i in range(count)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(f"n_{outs[0]}"), **attrs))
        return outs

    def const(self, array: np.ndarray, base: str = "c") -> str:
        """An initializer holding ``array``."""
        name = self.fresh(base)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def dim(self, d: Dim) -> str:
        """A 1-element int64 tensor holding dim ``d`` (computed from input shapes when symbolic)."""
        d = normalize_dim(d)
        if d in self._dim_cache:
            return self._dim_cache[d]
        if isinstance(d, int):
            out = self.const(np.array([d], np.int64), f"dim_{d}")
        elif (atom := min_max_args(d)) is not None:
            kind, args = atom
            out = self.op("Min" if kind == "min" else "Max", [self.dim(x) for x in args], base=f"dim_{kind}")
        elif is_symbol(d):
            if d in self.symbol_source:
                src, axis = self.symbol_source[d]
                out = self.op("Shape", [src], base=f"dim_{d}", start=axis, end=axis + 1)
            else:
                out = self._solve(d)
        else:
            out = self._poly(d)
        self._dim_cache[d] = out
        return out

    def _solve(self, sym: str) -> str:
        """A symbol seen only inside a dim expression of an input (or a value computed so far): ``past_seq`` from an axis
        of ``past_seq+seq``."""
        for name in self._shaped:
            for axis, d in enumerate(self.graph.types[name].shape):
                terms = dim_terms(d)
                mine = [(syms, c) for syms, c in terms if sym in syms]
                if len(mine) != 1 or mine[0][0] != (sym,):
                    continue
                rest = [(syms, c) for syms, c in terms if sym not in syms]
                if not all(s in self.symbol_source for syms, _ in rest for s in syms):
                    continue
                coef = mine[0][1]
                total = self.op("Shape", [name], base=f"{name}_dim{axis}", start=axis, end=axis + 1)
                rest_dim = dim_sub(d, dim_mul(coef, sym))
                value = self.op("Sub", [total, self.dim(rest_dim)]) if rest else total
                return self.op("Div", [value, self.dim(coef)], base=f"dim_{sym}") if coef != 1 else value
        raise ExportError(f"symbolic dim {sym!r} cannot be computed at run time from any graph input's or earlier value's shape")

    def _poly(self, d: Dim) -> str:
        total: str | None = None
        for syms, coef in dim_terms(d):
            term = self.dim(abs(coef)) if not syms or abs(coef) != 1 else None
            for s in syms:
                term = self.dim(s) if term is None else self.op("Mul", [term, self.dim(s)])
            assert term is not None
            if total is None:
                total = term if coef > 0 else self.op("Neg", [term])
            else:
                total = self.op("Add" if coef > 0 else "Sub", [total, term])
        return total if total is not None else self.dim(0)

    def shape(self, shape: tuple[Dim, ...] | list[Dim]) -> str:
        """A 1-D int64 shape tensor for a graphc shape (a constant when all dims are ints)."""
        if is_static(shape):
            return self.const(np.array([normalize_dim(d) for d in shape], np.int64), "shape")
        return self.op("Concat", [self.dim(d) for d in shape], base="shape", axis=0)

    def reshape(
        self, x: str, shape: tuple[Dim, ...] | list[Dim], output: str | None = None, source: tuple[Dim, ...] | list[Dim] | None = None
    ) -> str:
        """Reshape ``x`` to ``shape``.

        With ``x``'s shape known (``source``, a graph value's type or an earlier reshape's target), a symbolic target
        needs no shape computation per call: inserting or dropping size-1 axes is an ``Unsqueeze``/``Squeeze``, and a
        target whose symbolic dims each sit at the same index in ``x`` is a constant with 0 = 'copy that dim' (never
        -1, which cannot be inferred on an empty tensor).  Otherwise the shape is computed and ``allowzero=1`` makes a
        0 mean an empty axis, never 'copy'.
        """
        target = tuple(normalize_dim(d) for d in shape)
        source = source if source is not None else self.graph.types[x].shape if x in self.graph.types else self.known_shapes.get(x)
        out = None
        if source is not None and not is_static(target):
            src = tuple(normalize_dim(d) for d in source)
            squeeze, unsqueeze = _unit_axes(src, target), _unit_axes(target, src)
            if squeeze is not None or unsqueeze is not None:
                kind, axes = ("Squeeze", squeeze) if squeeze is not None else ("Unsqueeze", unsqueeze)
                out = self.op(kind, [x, self.const(np.array(axes, np.int64), "axes")], output, base=f"{x}_r")
            elif (copying := _copying_shape(target, src)) is not None:
                out = self.op("Reshape", [x, self.const(copying, "shape")], output, base=f"{x}_r")
        if out is None:
            out = self.op("Reshape", [x, self.shape(target)], output, base=f"{x}_r", allowzero=1)
        self.known_shapes[out] = target
        return out


def _unit_axes(longer: tuple[Dim, ...], shorter: tuple[Dim, ...]) -> list[int] | None:
    """The axes of ``longer`` that are literal 1s and, dropped, leave ``shorter``; None if ``longer`` is not so."""
    if len(longer) <= len(shorter):
        return None
    axes, j = [], 0
    for i, d in enumerate(longer):
        if j < len(shorter) and d == shorter[j]:
            j += 1
        elif d == 1:
            axes.append(i)
        else:
            return None
    return axes if j == len(shorter) else None


def _copying_shape(shape: tuple[Dim, ...], source: tuple[Dim, ...]) -> np.ndarray | None:
    """``shape`` as Reshape's constant with 0 = 'the input's dim at this index'; None when a symbolic dim sits elsewhere."""
    out: list[int] = []
    for i, d in enumerate(shape):
        if isinstance(d, int):
            if d == 0:
                return None  # a literal 0 would copy: an empty axis needs allowzero=1
            out.append(d)
        elif i < len(source) and source[i] == d:
            out.append(0)
        else:
            return None
    return np.array(out, np.int64)


def _finite_constant(g: Graph, name: str) -> bool:
    """``name`` is a small constant (a fill) whose every entry is a finite number."""
    if not g.is_constant(name):
        return False
    arr = g.initializers[name]
    return arr.size <= 16 and str(arr.dtype) in FLOAT_DTYPES and all_finite(arr)


def may_carry_neg_inf(g: Graph) -> dict[str, bool]:
    """For every value: can a row of it be all ``-inf`` (so that a softmax over it needs the NaN guard)?

    ``-inf`` enters through a boolean mask, a causal mask with a negative
    offset, a constant holding a non-finite entry (an additive mask, or one the
    optimizer folded) or a floating user tensor, and survives every op but a softmax (or
    an attention) — contractions included (a transposing einsum, or a product
    with a positive weight).  User tensors that reach a value only through a
    contraction (queries and keys) are taken to be finite.  One pass in
    topological order; each constant is scanned once.
    """
    from_any: dict[str, bool] = {}  # counting user tensors
    from_const: dict[str, bool] = {}  # counting constants and masks only
    float_values = {name for name, t in g.types.items() if str(t.dtype) in FLOAT_DTYPES}  # -inf lives in floating values only
    for name in g.inputs:
        from_any[name], from_const[name] = name in float_values, False
    floating = {id(a): a for a in g.initializers.values() if str(a.dtype) in FLOAT_DTYPES}  # bfloat16 included (NumPy kind "V")
    finite_arrays = dict(zip(floating, all_finite_each(list(floating.values()))))
    for name, arr in g.initializers.items():
        from_any[name] = from_const[name] = not finite_arrays.get(id(arr), True)
    for node in g.topological_order():
        flow = node.op.neg_inf_rows([g.types[i] for i in node.inputs])  # the op says (graphc.ops.Op.neg_inf_rows)
        sources = node.inputs[1:] if flow == "select" else node.inputs
        if isinstance(node.op, Binary) and node.op.fn == "max" and any(_finite_constant(g, i) for i in node.inputs):
            flow = "clear"  # max(x, a finite number) is finite (a mask's -inf raised to the fill)
        if flow == "clear":
            flags = (False, False)
        elif flow == "introduce":
            flags = (True, True)
        elif flow == "contract":
            c = any(from_const.get(i, False) for i in node.inputs)
            flags = (c, c)
        else:
            flags = (any(from_any.get(i, False) for i in sources), any(from_const.get(i, False) for i in sources))
        for out in node.outputs:  # an integer or bool value holds no -inf (a Cast of token positions starts finite)
            from_any[out], from_const[out] = (flags[0] and out in float_values, flags[1] and out in float_values)
    return from_any
