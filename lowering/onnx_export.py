"""Export a graphc graph to ONNX.

Every pairwise einsum that maps onto a batched GEMM is emitted as
Transpose/Reshape + ``MatMul`` (the plan of :mod:`lowering.contraction`), since
onnxruntime's ``Einsum`` kernel is 1.4-3x slower on prefill shapes and 7-12x on
decode shapes; einsums with three or more operands are split in opt_einsum's
order first.  Symbolic dims become dynamic axes (``dim_param``); shapes that
Reshape needs are computed at run time from the inputs' ``Shape``.  The
attention core can instead be emitted as one fused op (:mod:`lowering.fusion`).

The IR version is the lowest that the opset needs, so the installed
onnxruntime (which refuses IR 14, onnx 1.23's default) loads the model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphc.dims import Dim, dim_prod, dim_symbols, dim_terms, eval_dim, is_static, is_symbol, normalize_dim
from graphc.einsum_spec import label_sizes, parse_einsum
from graphc.errors import ExportError, UnknownNameError
from graphc.graph import Graph, Node
from graphc.ops import Binary, CausalMask, Cast, Concat, Einsum, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where
from graphc.optimizer.infra import DEFAULT_DIM_HINT

from .contraction import contraction_order, plan_matmul
from .kernels import hidden_keys
from .fusion import ATTENTION_MODES, AttentionMatch, emit_fused, find_attention_cores

__all__ = ["export", "DEFAULT_OPSET", "MIN_OPSET", "ONNX_DTYPES"]

DEFAULT_OPSET = 23
MIN_OPSET = 18
ONNX_DTYPES = {
    "float16": TensorProto.FLOAT16,
    "float32": TensorProto.FLOAT,
    "float64": TensorProto.DOUBLE,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
}
_UNARY = {"exp": "Exp", "neg": "Neg", "tanh": "Tanh", "sqrt": "Sqrt", "reciprocal": "Reciprocal", "relu": "Relu", "sigmoid": "Sigmoid"}
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max"}


class OnnxBuilder:
    """Collects ONNX nodes and initializers; computes shape tensors for symbolic dims."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set(graph.types)
        self._dim_cache: dict[Dim, str] = {}
        self.symbol_source: dict[str, tuple[str, int]] = {}
        for name in graph.inputs:
            for axis, d in enumerate(graph.types[name].shape):
                if is_symbol(d):
                    self.symbol_source.setdefault(str(d), (name, axis))

    def fresh(self, base: str) -> str:
        """A tensor name not used yet."""
        name, i = base, 1
        while name in self._names:
            name, i = f"{base}_{i}", i + 1
        self._names.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, base: str = "t", domain: str = "", **attrs: object) -> str:
        """Append an ONNX node with one output and return that output's name."""
        out = output or self.fresh(base)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.fresh(f"n_{out}"), domain=domain, **attrs))
        return out

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
        elif is_symbol(d):
            if d not in self.symbol_source:
                raise ExportError(f"symbolic dim {d!r} is not the size of any graph input axis, so it cannot be computed at run time")
            src, axis = self.symbol_source[d]
            out = self.op("Shape", [src], base=f"dim_{d}", start=axis, end=axis + 1)
        else:
            out = self._poly(d)
        self._dim_cache[d] = out
        return out

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

    def reshape(self, x: str, shape: tuple[Dim, ...] | list[Dim], output: str | None = None) -> str:
        """Reshape ``x`` (allowzero: a 0 in the target means an empty axis, never 'copy')."""
        return self.op("Reshape", [x, self.shape(shape)], output, base=f"{x}_r", allowzero=1)


def _lower_pair(b: OnnxBuilder, spec_text: str, names: list[str], shapes: list[tuple[Dim, ...]], out: str) -> None:
    spec = parse_einsum(spec_text)
    sizes = label_sizes(spec, shapes)
    p = plan_matmul(spec)
    (a, ta), (c, tc) = (names[0], spec.inputs[0]), (names[1], spec.inputs[1])
    if p.swap:
        (a, ta), (c, tc) = (c, tc), (a, ta)

    def prepare(x: str, term: str, summed: str, perm: tuple[int, ...], groups: tuple[str, str]) -> str:
        if summed:
            axes = b.const(np.array([term.index(ch) for ch in summed], np.int64), "axes")
            x = b.op("ReduceSum", [x, axes], base=f"{x}_sum", keepdims=0)
        if perm != tuple(range(len(perm))):
            x = b.op("Transpose", [x], base=f"{x}_t", perm=list(perm))
        if any(len(g) != 1 for g in groups):
            x = b.reshape(x, [sizes[ch] for ch in p.batch] + [dim_prod(sizes[ch] for ch in g) for g in groups])
        return x

    a2 = prepare(a, ta, p.a_sum, p.a_perm, (p.a_free, p.contract))
    c2 = prepare(c, tc, p.b_sum, p.b_perm, (p.contract, p.b_free))
    needs_reshape = len(p.a_free) != 1 or len(p.b_free) != 1
    last = not needs_reshape and not p.needs_out_transpose
    y = b.op("MatMul", [a2, c2], out if last else None, base=f"{out}_mm")
    if needs_reshape:
        y = b.reshape(y, [sizes[ch] for ch in p.batch + p.a_free + p.b_free], None if p.needs_out_transpose else out)
    if p.needs_out_transpose:
        b.op("Transpose", [y], out, perm=list(p.out_perm))


def _lower_einsum(b: OnnxBuilder, node: Node) -> None:
    g = b.graph
    spec = node.op.parsed  # type: ignore[attr-defined]
    shapes = [g.types[i].shape for i in node.inputs]
    if len(spec.inputs) == 1:
        b.op("Einsum", list(node.inputs), node.name, equation=str(spec))
        return
    if len(spec.inputs) == 2:
        _lower_pair(b, str(spec), list(node.inputs), shapes, node.name)
        return
    sizes = label_sizes(spec, shapes)
    hint = {s: DEFAULT_DIM_HINT for d in sizes.values() for s in dim_symbols(d)}
    int_shapes = [tuple(eval_dim(d, hint) for d in s) for s in shapes]
    operands = [(n, s) for n, s in zip(node.inputs, shapes)]
    steps = contraction_order(spec, int_shapes)
    for k, (positions, step) in enumerate(steps):
        args = [operands[i] for i in positions]
        for i in sorted(positions, reverse=True):
            del operands[i]
        step_spec = parse_einsum(step)
        step_sizes = label_sizes(step_spec, [s for _, s in args])
        out_shape = tuple(step_sizes[ch] for ch in step_spec.output)
        out = node.name if k == len(steps) - 1 else b.fresh(f"{node.name}_step{k}")
        if len(args) == 2:
            _lower_pair(b, step, [n for n, _ in args], [s for _, s in args], out)
        else:
            b.op("Einsum", [n for n, _ in args], out, equation=step)
        operands.append((out, out_shape))


def _may_mask_whole_rows(g: Graph, value: str) -> bool:
    """True unless every path into a softmax provably leaves a finite entry in each row."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        node = g.producer(v)
        if node is None:
            if v in g.inputs:
                return True  # a user tensor may carry -inf
            continue
        op = node.op
        if isinstance(op, Where) or (isinstance(op, CausalMask) and not op.offset_is_nonnegative):
            return True
        if isinstance(op, (Scale, Unary, Binary, Reshape, Transpose, CausalMask, Cast)):
            stack.extend(node.inputs)
    return False


def _lower_node(b: OnnxBuilder, node: Node) -> None:
    g, op, ins, out = b.graph, node.op, list(node.inputs), node.name
    dtype = g.types[out].dtype
    if isinstance(op, Einsum):
        _lower_einsum(b, node)
    elif isinstance(op, Reshape):
        b.reshape(ins[0], op.shape, out)
    elif isinstance(op, Transpose):
        b.op("Transpose", ins, out, perm=list(op.perm))
    elif isinstance(op, Repeat):
        rank = g.types[ins[0]].rank
        axis = op.axis % rank
        u = b.op("Unsqueeze", [ins[0], b.const(np.array([axis + 1], np.int64), "axes")], base=f"{out}_u")
        reps = np.ones(rank + 1, np.int64)
        reps[axis + 1] = op.repeats
        e = b.op("Expand", [u, b.const(reps, "reps")], base=f"{out}_e")
        b.reshape(e, g.types[out].shape, out)
    elif isinstance(op, Softmax):
        if _may_mask_whole_rows(g, ins[0]):
            y = b.op("Softmax", ins, base=f"{out}_raw", axis=op.axis)
            zero = b.const(np.zeros((), dtype), "zero")
            b.op("Where", [b.op("IsNaN", [y]), zero, y], out)
        else:
            b.op("Softmax", ins, out, axis=op.axis)
    elif isinstance(op, Concat):
        b.op("Concat", ins, out, axis=op.axis)
    elif isinstance(op, Cast):
        b.op("Cast", ins, out, to=ONNX_DTYPES[op.dtype])
    elif isinstance(op, Unary):
        b.op(_UNARY[op.fn], ins, out)
    elif isinstance(op, Binary):
        b.op(_BINARY[op.fn], ins, out)
    elif isinstance(op, Where):
        b.op("Where", ins, out)
    elif isinstance(op, Scale):
        b.op("Mul", [ins[0], b.const(np.array(op.factor, dtype), "scale")], out)
    elif isinstance(op, CausalMask):
        b.op("Where", [causal_hidden(b, ins[0], g.types[ins[0]].shape, op.offset), b.const(np.array(-np.inf, dtype), "neg_inf"), ins[0]], out)
    else:  # pragma: no cover - every op kind is handled above
        raise ExportError(f"node {out!r}: no ONNX lowering for {op.kind}")


def causal_hidden(b: OnnxBuilder, x: str, shape: tuple[Dim, ...], offset: Dim) -> str:
    """A bool ``[Sq, Sk]`` tensor, True where key j is hidden from query i (``j > i + offset``)."""
    sq, sk = normalize_dim(shape[-2]), normalize_dim(shape[-1])
    offset = normalize_dim(offset)
    if all(isinstance(d, int) for d in (sq, sk, offset)) and sq * sk <= 1 << 24:  # type: ignore[operator]
        return b.const(hidden_keys(0, sq, sk, offset), "causal_hidden")  # type: ignore[arg-type]
    zero, one = b.const(np.array(0, np.int64), "zero"), b.const(np.array(1, np.int64), "one")
    scalar = lambda d: b.op("Squeeze", [b.dim(d), b.const(np.array([0], np.int64), "axes")])  # noqa: E731
    rows = b.op("Range", [zero, scalar(sq), one], base="rows")
    cols = b.op("Range", [zero, scalar(sk), one], base="cols")
    limit = b.op("Add", [b.op("Unsqueeze", [rows, b.const(np.array([1], np.int64), "axes")]), scalar(offset)])
    return b.op("Greater", [cols, limit], base="causal_hidden")


def _value_info(g: Graph, name: str) -> onnx.ValueInfoProto:
    t = g.types[name]
    return helper.make_tensor_value_info(name, ONNX_DTYPES[t.dtype], [d if isinstance(d, int) else str(d) for d in t.shape])


def export(
    graph: Graph,
    path: str | Path | None = None,
    opset: int = DEFAULT_OPSET,
    attention: str = "decomposed",
    hints: dict[str, int] | None = None,
) -> onnx.ModelProto:
    """Export ``graph`` to an ONNX model (written to ``path`` when given).

    ``attention``: ``"decomposed"`` (MatMul/Softmax nodes), ``"onnx-attention"``
    (the standard ``Attention`` op, opset 23+), ``"ort-gqa"`` (onnxruntime's
    ``com.microsoft.GroupQueryAttention``) or ``"auto"`` (fused for prefill-like
    shapes, decomposed for decode; ``hints`` size symbolic dims for that choice).
    """
    if attention not in ATTENTION_MODES:
        raise UnknownNameError("attention mode", attention, ATTENTION_MODES)
    max_opset = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= max_opset:
        raise ExportError(f"opset must be an int in {MIN_OPSET}..{max_opset} (the installed onnx), got {opset!r}")
    graph.verify()
    for out in graph.outputs:
        if out in graph.inputs or out in graph.initializers:
            raise ExportError(f"graph output {out!r} is a graph input or initializer; ONNX needs outputs computed by nodes")
    b = OnnxBuilder(graph)
    matches: list[AttentionMatch] = find_attention_cores(graph, attention, opset, hints or {})
    absorbed = {n for m in matches for n in m.absorbed}
    at = {m.anchor: m for m in matches}
    for node in graph.topological_order():
        if node.name in at:
            emit_fused(b, at[node.name])
        elif node.name not in absorbed:
            _lower_node(b, node)
    for name, arr in graph.initializers.items():
        b.initializers.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
    onnx_graph = helper.make_graph(
        b.nodes,
        graph.name,
        [_value_info(graph, n) for n in graph.inputs],
        [_value_info(graph, n) for n in graph.outputs],
        b.initializers,
    )
    imports = [helper.make_opsetid("", opset)]
    if any(n.domain == "com.microsoft" for n in b.nodes):
        imports.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(onnx_graph, opset_imports=imports, producer_name="graphc")
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    if path is not None:
        onnx.save(model, str(path))
    return model
