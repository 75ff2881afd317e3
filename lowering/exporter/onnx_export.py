"""Export a graphc graph to ONNX.

The graph is first lowered for the ONNX target of the chosen attention mode
(:mod:`lowering.exporter.targets`): attention is recognised once by the optimizer and
each ``Attention`` node is kept (emitted as the standard ``Attention`` op or
onnxruntime's ``com.microsoft.GroupQueryAttention``) or decomposed, and
einsums of three or more operands are split pairwise.  Every pairwise einsum
that maps onto a batched GEMM is emitted as Transpose/Reshape + ``MatMul`` (the
plan of :mod:`lowering.kernels.contraction`), since onnxruntime's ``Einsum`` kernel is
1.4-3x slower on prefill shapes and 7-12x on decode shapes.  Symbolic dims
become dynamic axes (``dim_param``); shapes that Reshape needs are computed at
run time from the inputs' ``Shape``.

The IR version is the lowest that the opset needs, so the installed
onnxruntime (which refuses IR 14, onnx 1.23's default) loads the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphc.folders import replacing, write_replacing
from graphc.attention_op import Attention
from graphc.dims import Dim, dim_add, dim_prod, normalize_dim
from graphc.einsum_spec import EinsumSpec, label_sizes, parse_einsum
from graphc.errors import ExportError, UnknownNameError
from graphc.graph import Graph, Node
from graphc.mapped import distinct_nbytes
from graphc.memory import format_bytes
from graphc.numerics import contiguous
from graphc.visibility import Visibility
from graphc.ops import Binary, CausalMask, Cast, Compare, Concat, Einsum, Op, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where, op_registrar
from graphc.optimizer import PassContext, lower
from graphc.opaque import Opaque
from graphc.quantized import DequantizeBlocks, QuantizedGather, QuantizedMatMul
from graphc.quantized_int8 import Dequantize, DynamicQuantize, IntegerMatMul, Quantize
from graphc.rotary import Positions
from graphc.tensor_ops import Arange, BroadcastTo, Gather, GatherElements, Reduce, ShapeValues, Slice

from ..kernels.contraction import MatmulPlan, plan_matmul
from .onnx_builder import ONNX_DTYPES, OnnxBuilder, may_carry_neg_inf
from .forms import ChunkedCausalAttention, OnnxAttention, OrtGroupQueryAttention
from .onnx_chunked import emit_chunked_attention
from .norm_form import OnnxLayerNorm, OrtRMSNorm
from .quantized_export import (
    emit_dequantize,
    emit_dequantize_blocks,
    emit_dynamic_quantize,
    emit_integer_matmul,
    emit_quantize,
    emit_quantized_gather,
    emit_quantized_matmul,
)
from .targets import ATTENTION_MODES, onnx_target

__all__ = ["export", "may_carry_neg_inf", "DEFAULT_OPSET", "MIN_OPSET", "ONNX_DTYPES", "ONNX_EMITTERS", "onnx_emitter"]

DEFAULT_OPSET = 23
MIN_OPSET = 18
_COMPARE = {"less": "Less", "less_equal": "LessOrEqual", "greater": "Greater", "greater_equal": "GreaterOrEqual", "equal": "Equal"}
_REDUCE = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax", "min": "ReduceMin"}
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min", "pow": "Pow"}


def _lower_product(b: OnnxBuilder, spec: EinsumSpec, names: list[str], out: str) -> None:
    """An einsum that sums no label (a scale by a vector, an outer product): one broadcasting ``Mul``, not a GEMM with K = 1."""
    operands = []
    for x, term in zip(names, spec.inputs):
        order = sorted(term, key=spec.output.index)
        if list(term) != order:
            x = b.op("Transpose", [x], base=f"{x}_t", perm=[term.index(ch) for ch in order])
        missing = [i for i, ch in enumerate(spec.output) if ch not in term]
        if missing and len(missing) < len(spec.output):
            x = b.op("Unsqueeze", [x, b.const(np.array(missing, np.int64), "axes")], base=f"{x}_u")
        operands.append(x)
    b.op("Mul", operands, out)


def _lower_pair(b: OnnxBuilder, spec_text: str, names: list[str], shapes: list[tuple[Dim, ...]], out: str) -> None:
    spec = parse_einsum(spec_text)
    sizes = label_sizes(spec, shapes)
    if set("".join(spec.inputs)) <= set(spec.output):  # no label summed: an elementwise or outer product
        _lower_product(b, spec, names, out)
        return
    if names[0] == names[1] and spec.inputs[0] == spec.inputs[1] and len(set(spec.inputs[0])) == len(spec.inputs[0]):
        _lower_sum_of_squares(b, spec, names[0], out)
        return
    p = plan_matmul(spec)
    (a, ta), (c, tc) = (names[0], spec.inputs[0]), (names[1], spec.inputs[1])
    if p.swap:
        (a, ta), (c, tc) = (c, tc), (a, ta)
    if not p.batch and not p.a_sum and not p.b_sum and len(p.contract) == 1 and len(p.b_free) == 1:
        _lower_broadcast_matmul(b, p, a, ta, c, tc, out)  # [..., K] @ [K, N]: onnx MatMul broadcasts, no reshapes
        return

    def prepare(x: str, term: str, summed: str, perm: tuple[int, ...], groups: tuple[str, str]) -> str:
        if summed:
            axes = b.const(np.array([term.index(ch) for ch in summed], np.int64), "axes")
            x = b.op("ReduceSum", [x, axes], base=f"{x}_sum", keepdims=0)
        if perm != tuple(range(len(perm))):
            x = b.op("Transpose", [x], base=f"{x}_t", perm=list(perm))
        if any(len(g) != 1 for g in groups):
            source = [sizes[ch] for ch in p.batch + groups[0] + groups[1]]
            x = b.reshape(x, [sizes[ch] for ch in p.batch] + [dim_prod(sizes[ch] for ch in g) for g in groups], source=source)
        return x

    a2 = prepare(a, ta, p.a_sum, p.a_perm, (p.a_free, p.contract))
    c2 = prepare(c, tc, p.b_sum, p.b_perm, (p.contract, p.b_free))
    needs_reshape = len(p.a_free) != 1 or len(p.b_free) != 1
    last = not needs_reshape and not p.needs_out_transpose
    y = b.op("MatMul", [a2, c2], out if last else None, base=f"{out}_mm")
    if needs_reshape:
        flat = [sizes[ch] for ch in p.batch] + [dim_prod(sizes[ch] for ch in p.a_free), dim_prod(sizes[ch] for ch in p.b_free)]
        y = b.reshape(y, [sizes[ch] for ch in p.batch + p.a_free + p.b_free], None if p.needs_out_transpose else out, source=flat)
    if p.needs_out_transpose:
        b.op("Transpose", [y], out, perm=list(p.out_perm))


def _lower_sum_of_squares(b: OnnxBuilder, spec: EinsumSpec, x: str, out: str) -> None:
    """``x . x`` over the labels missing from the output (an RMSNorm's sum of squares): one ``ReduceSumSquare``."""
    term = spec.inputs[0]
    summed = [i for i, ch in enumerate(term) if ch not in spec.output]
    kept = "".join(ch for ch in term if ch in spec.output)
    perm = [kept.index(ch) for ch in spec.output]
    last = perm == list(range(len(perm)))
    y = b.op("ReduceSumSquare", [x, b.const(np.array(summed, np.int64), "axes")], out if last else None, base=f"{out}_sq", keepdims=0)
    if not last:
        b.op("Transpose", [y], out, perm=perm)


def _lower_broadcast_matmul(b: OnnxBuilder, p: MatmulPlan, a: str, ta: str, c: str, tc: str, out: str) -> None:
    """A contraction of one label with a 2-D operand (a projection ``bsm,nm->bsn``): ``MatMul(A[..., K], B[K, N])``, ``A``'s free
    axes left as they are (onnx MatMul broadcasts them), so no Reshape or shape computation runs per call."""
    a_order = p.a_free + p.contract
    if ta != a_order:
        a = b.op("Transpose", [a], base=f"{a}_t", perm=[ta.index(ch) for ch in a_order])
    c_order = p.contract + p.b_free
    if b.fused_matmul and tc == p.b_free + p.contract:  # [N, K] read as stored: onnxruntime packs it transposed, no copy folded
        y = b.op("FusedMatMul", [a, c], None if p.needs_out_transpose else out, base=f"{out}_mm", domain="com.microsoft", transB=1)
        if p.needs_out_transpose:
            b.op("Transpose", [y], out, perm=list(p.out_perm))
        return
    if tc != c_order:
        c = b.op("Transpose", [c], base=f"{c}_t", perm=[tc.index(ch) for ch in c_order])
    y = b.op("MatMul", [a, c], None if p.needs_out_transpose else out, base=f"{out}_mm")
    if p.needs_out_transpose:
        b.op("Transpose", [y], out, perm=list(p.out_perm))


def _lower_einsum(b: OnnxBuilder, node: Node) -> None:
    g = b.graph
    spec = node.op_as(Einsum).parsed
    if len(spec.inputs) == 1:
        b.op("Einsum", list(node.inputs), node.name, equation=str(spec))
    elif len(spec.inputs) == 2:
        _lower_pair(b, str(spec), list(node.inputs), [g.types[i].shape for i in node.inputs], node.name)
    else:  # pragma: no cover - legalisation splits these
        raise ExportError(f"node {node.name!r}: einsum {spec} has {len(spec.inputs)} operands; lower the graph first")


def _emit_unformed_attention(b: OnnxBuilder, node: Node) -> None:
    raise ExportError(
        f"node {node.name!r}: an Attention op with no ONNX form; lower the graph for an ONNX target (lowering.exporter.targets.onnx_target)"
    )


def _emit_onnx_attention(b: OnnxBuilder, node: Node) -> None:
    """The standard ``Attention`` op (opset 23+)."""
    op = node.op_as(Attention)
    ins = list(node.inputs)
    mask = ins[3] if op.has_mask else None
    past = ins[3 + op.has_mask :] if op.kv_cache else []
    inputs = ins[:3] + ([mask or ""] if (mask or past) else []) + past
    attrs: dict[str, Any] = {"is_causal": int(op.visibility.is_causal), "scale": op.scale}
    if op.softcap is not None:  # the op caps before masking, as graphc does (checked in the tests)
        attrs["softcap"] = op.softcap
    b.nodes.append(helper.make_node("Attention", inputs, list(node.outputs), name=b.fresh(f"n_{node.name}"), **attrs))


def _emit_gqa(b: OnnxBuilder, node: Node) -> None:
    """onnxruntime's ``com.microsoft.GroupQueryAttention`` on packed ``[B, S, H*D]`` Q/K/V.  Without a cache the presents
    are still named (unused): onnxruntime's CUDA kernel refuses to run without them."""
    op = node.op_as(Attention)
    g = b.graph
    ins = list(node.inputs)
    past = ins[3 + op.has_mask :] if op.kv_cache else []
    q, k, v = ins[:3]
    batch, n_heads, sq, head_dim = g.types[q].shape
    n_kv, k_len = g.types[k].shape[1], g.types[k].shape[2]

    def pack(x: str, heads: Dim, seq: Dim) -> str:  # [B,H,S,D] -> [B,S,H*D]
        t = b.op("Transpose", [x], base=f"{x}_BSHD", perm=[0, 2, 1, 3])
        return b.reshape(t, [batch, seq, dim_prod([heads, head_dim])])

    total = dim_add(g.types[past[0]].shape[2], k_len) if past else k_len
    total32 = b.op("Cast", [b.dim(total)], base="total_len", to=6)
    seqlens = b.op("Cast", [b.op("Expand", [b.op("Sub", [b.dim(total), b.dim(1)]), b.dim(batch)])], base="seqlens_k", to=6)
    inputs = [pack(q, n_heads, sq), pack(k, n_kv, k_len), pack(v, n_kv, k_len), *(past or ["", ""]), seqlens, total32]
    packed = b.fresh(f"{node.name}_BSN")
    optional: dict[str, Any] = {"softcap": op.softcap} if op.softcap is not None else {}
    if "window" in op.features():  # the same window: keys i+P-W < j <= i+P
        optional["local_window_size"] = op.visibility.window
    b.nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            inputs,
            [packed, *(node.outputs[1:] if past else (b.fresh(f"{node.name}_present_key"), b.fresh(f"{node.name}_present_value")))],
            name=b.fresh(f"n_{node.name}"),
            domain="com.microsoft",
            num_heads=int(n_heads),
            kv_num_heads=int(n_kv),
            scale=op.scale,
            **optional,
        )
    )
    y = b.reshape(packed, [batch, sq, n_heads, head_dim])
    b.op("Transpose", [y], node.name, perm=[0, 2, 1, 3])


def _range(b: OnnxBuilder, start: Dim, stop: Dim, out: str) -> None:
    """ONNX ``Range(start, stop, 1)`` over dims computed at run time."""
    scalar = lambda d: b.op("Squeeze", [b.dim(d), b.const(np.array([0], np.int64), "axes")])  # noqa: E731
    b.op("Range", [scalar(start), scalar(stop), b.const(np.array(1, np.int64), "one")], out)


Emitter = Callable[[OnnxBuilder, Node], object]
ONNX_EMITTERS: dict[type[Op], Emitter] = {}
"""Each op type's ONNX emitter: ``emit(builder, node)`` writes the node's ONNX nodes (the attention form was chosen when
the graph was lowered for the target, so no emitter needs the export's attention mode)."""


onnx_emitter = op_registrar(ONNX_EMITTERS)
"""``@onnx_emitter(OpType, ...)`` registers the decorated function as those op types' ONNX emitter."""


def _lower_node(b: OnnxBuilder, node: Node) -> None:
    emit = ONNX_EMITTERS.get(type(node.op))
    if emit is None:
        raise ExportError(f"node {node.name!r}: no ONNX lowering for {node.op.kind}")
    emit(b, node)
    b.computed(node.outputs)


OpT = TypeVar("OpT", bound=Op)


def _simple(onnx_op: str, kind: type[OpT], **attrs: Callable[[OpT], Any]) -> Emitter:
    """An emitter writing one ONNX node of type ``onnx_op`` on the node's inputs, attributes read off the op."""

    def emit(b: OnnxBuilder, node: Node) -> None:
        b.op(onnx_op, list(node.inputs), node.name, **{k: f(node.op_as(kind)) for k, f in attrs.items()})

    return emit


ONNX_EMITTERS.update(
    {
        QuantizedMatMul: emit_quantized_matmul,
        QuantizedGather: emit_quantized_gather,
        DequantizeBlocks: emit_dequantize_blocks,
        DynamicQuantize: emit_dynamic_quantize,
        IntegerMatMul: emit_integer_matmul,
        Dequantize: emit_dequantize,
        Quantize: emit_quantize,
        Einsum: lambda b, node: _lower_einsum(b, node),
        Reshape: lambda b, node: b.reshape(node.inputs[0], node.op_as(Reshape).shape, node.name),
        Concat: _simple("Concat", Concat, axis=lambda op: op.axis),
        Cast: _simple("Cast", Cast, to=lambda op: ONNX_DTYPES[op.dtype]),
        Compare: lambda b, node: b.op(_COMPARE[node.op_as(Compare).fn], list(node.inputs), node.name),
        Gather: _simple("Gather", Gather, axis=lambda op: op.axis),
        GatherElements: _simple("GatherElements", GatherElements, axis=lambda op: op.axis),
        BroadcastTo: lambda b, node: b.op("Expand", [node.inputs[0], b.shape(node.op_as(BroadcastTo).shape)], node.name),
        Arange: lambda b, node: _range(b, node.op_as(Arange).start, node.op_as(Arange).stop, node.name),
        Opaque: lambda b, node: b.nodes.append(node.op_as(Opaque).node_proto(list(node.inputs), list(node.outputs), b.fresh(f"n_{node.name}"))),
        Attention: _emit_unformed_attention,
        OnnxAttention: _emit_onnx_attention,
        OrtGroupQueryAttention: _emit_gqa,
        ChunkedCausalAttention: lambda b, node: emit_chunked_attention(b, node),
    }
)


@onnx_emitter(OrtRMSNorm)
def _rms_norm(b: OnnxBuilder, node: Node) -> None:
    """onnxruntime's ``SimplifiedLayerNormalization`` (default domain, as onnxruntime registers it): float32 statistics."""
    eps = node.op_as(OrtRMSNorm).epsilon
    name = b.fresh(f"n_{node.name}")
    b.nodes.append(helper.make_node("SimplifiedLayerNormalization", list(node.inputs), [node.name], name=name, axis=-1, epsilon=eps, stash_type=1))


@onnx_emitter(OnnxLayerNorm)
def _layer_norm(b: OnnxBuilder, node: Node) -> None:
    """ONNX's ``LayerNormalization`` (opset 17) over the last axis: float32 statistics."""
    eps = node.op_as(OnnxLayerNorm).epsilon
    name = b.fresh(f"n_{node.name}")
    b.nodes.append(helper.make_node("LayerNormalization", list(node.inputs), [node.name], name=name, axis=-1, epsilon=eps, stash_type=1))


@onnx_emitter(Unary)
def _unary(b: OnnxBuilder, node: Node) -> None:
    fn = node.op_as(Unary).function
    if fn.onnx is None:
        raise ExportError(f"node {node.name!r}: unary function {fn.name!r} has no ONNX spelling (register_unary(..., onnx=...))")
    b.op(fn.onnx, list(node.inputs), node.name)


@onnx_emitter(Transpose)
def _transpose(b: OnnxBuilder, node: Node) -> None:
    perm = node.op_as(Transpose).perm
    if perm:
        b.op("Transpose", list(node.inputs), node.name, perm=list(perm))
    else:  # rank 0: nothing to permute (and an empty perm attribute has no ONNX type)
        b.op("Identity", list(node.inputs), node.name)


@onnx_emitter(Repeat)
def _repeat(b: OnnxBuilder, node: Node) -> None:
    op, x, out = node.op_as(Repeat), node.inputs[0], node.name
    rank = b.graph.types[x].rank
    axis = op.axis % rank
    u = b.op("Unsqueeze", [x, b.const(np.array([axis + 1], np.int64), "axes")], base=f"{out}_u")
    reps = np.ones(rank + 1, np.int64)
    reps[axis + 1] = op.repeats
    e = b.op("Expand", [u, b.const(reps, "reps")], base=f"{out}_e")
    b.reshape(e, b.graph.types[out].shape, out)


@onnx_emitter(Softmax)
def _softmax(b: OnnxBuilder, node: Node) -> None:
    ins, out, axis = list(node.inputs), node.name, node.op_as(Softmax).axis
    if b.may_carry_neg_inf[ins[0]]:  # a row of -inf: zeros, not NaN
        y = b.op("Softmax", ins, base=f"{out}_raw", axis=axis)
        zero = b.const(np.zeros((), b.graph.types[out].dtype), "zero")
        b.op("Where", [b.op("IsNaN", [y]), zero, y], out)
    else:
        b.op("Softmax", ins, out, axis=axis)


@onnx_emitter(Binary)
def _binary(b: OnnxBuilder, node: Node) -> None:
    dtype = b.graph.types[node.name].dtype
    fn = node.op_as(Binary).fn
    if fn == "div" and dtype.startswith("int"):
        _integer_divide(b, list(node.inputs), node.name, dtype)
    else:
        b.op(_BINARY[fn], list(node.inputs), node.name)


@onnx_emitter(Where)
def _where(b: OnnxBuilder, node: Node) -> None:
    c, x, y = node.inputs
    out = node.name
    if b.graph.types[out].dtype == "bool":  # onnxruntime has no bool Where: (c and x) or (not c and y)
        constant = b.graph.initializers.get(y)
        if constant is not None and constant.size == 1 and not constant.any():  # Where(c, x, False): c and x
            b.op("And", [c, x], out)
            return
        b.op("Or", [b.op("And", [c, x], base=f"{out}_then"), b.op("And", [b.op("Not", [c], base=f"{out}_not"), y], base=f"{out}_else")], out)
    else:
        b.op("Where", [c, x, y], out)


@onnx_emitter(Scale)
def _scale(b: OnnxBuilder, node: Node) -> None:
    """``x * c``; ``x / (1/c)`` where the scale feeds an ``Erf`` alone (a GELU's ``x / sqrt(2)``: onnxruntime fuses the
    erf GELU into one ``Gelu`` kernel only when it is written with that division, as torch writes it)."""
    factor, dtype = node.op_as(Scale).factor, b.graph.types[node.name].dtype
    readers = b.graph.consumers(node.name)
    if factor != 0 and readers and all(isinstance(r.op, Unary) and r.op.fn == "erf" for r in readers):
        b.op("Div", [node.inputs[0], b.const(np.array(1 / factor, dtype), "scale_divisor")], node.name)
        return
    b.op("Mul", [node.inputs[0], b.const(np.array(factor, dtype), "scale")], node.name)


@onnx_emitter(Positions)
def _positions(b: OnnxBuilder, node: Node) -> None:
    op = node.op_as(Positions)
    _range(b, op.offset, dim_add(op.offset, b.graph.types[node.inputs[0]].shape[op.axis]), node.name)


@onnx_emitter(Reduce)
def _reduce(b: OnnxBuilder, node: Node) -> None:
    op, x = node.op_as(Reduce), node.inputs[0]
    axes = b.const(np.array(op.normalized_axes(b.graph.types[x].rank), np.int64), "axes")
    b.op(_REDUCE[op.fn], [x, axes], node.name, keepdims=int(op.keepdims))


@onnx_emitter(Slice)
def _slice(b: OnnxBuilder, node: Node) -> None:
    op, x = node.op_as(Slice), node.inputs[0]
    axis = op.axis % b.graph.types[x].rank
    one = lambda v: b.const(np.array([v], np.int64), "i")  # noqa: E731
    b.op("Slice", [x, b.dim(op.start), b.dim(op.stop), one(axis), one(op.step)], node.name)


@onnx_emitter(ShapeValues)
def _shape_values(b: OnnxBuilder, node: Node) -> None:
    op = node.op_as(ShapeValues)
    values = b.shape(op.values)
    if op.scalar:
        b.op("Squeeze", [values, b.const(np.array([0], np.int64), "axes")], node.name)
    else:
        b.op("Identity", [values], node.name)


@onnx_emitter(CausalMask)
def _causal_mask(b: OnnxBuilder, node: Node) -> None:
    # x + bias with a [Sq, Sk] bias of 0 / -inf: onnxruntime's broadcasting Add is ~2.5x faster than Where over the scores
    op, x, dtype = node.op_as(CausalMask), node.inputs[0], b.graph.types[node.name].dtype
    hidden = causal_hidden(b, b.graph.types[x].shape, op.visibility)
    bias = b.op("Where", [hidden, b.const(np.array(-np.inf, dtype), "neg_inf"), b.const(np.zeros((), dtype), "zero")], base="causal_bias")
    b.op("Add", [x, bias], node.name)


def _integer_divide(b: OnnxBuilder, ins: list[str], out: str, dtype: str) -> None:
    """graphc's integer ``div`` (truncating; 0 for a zero divisor): ONNX ``Div`` truncates but traps on zero."""
    zero, one = b.const(np.zeros((), dtype), "zero"), b.const(np.ones((), dtype), "one")
    is_zero = b.op("Equal", [ins[1], zero], base=f"{out}_div0")
    quotient = b.op("Div", [ins[0], b.op("Where", [is_zero, one, ins[1]], base=f"{out}_den")], base=f"{out}_q")
    b.op("Where", [is_zero, zero, quotient], out)


def causal_hidden(b: OnnxBuilder, shape: tuple[Dim, ...], visibility: Visibility) -> str:
    """A bool ``[Sq, Sk]`` tensor, True where key j is hidden from query i by position (:meth:`Visibility.hidden`):
    a constant when the sizes are known, else built from the bounds (``j > i + u`` for the upper one, ``j < i + l`` for
    a window's lower edge)."""
    sq, sk = normalize_dim(shape[-2]), normalize_dim(shape[-1])
    if isinstance(sq, int) and isinstance(sk, int) and all(isinstance(d, int) for d in visibility.dims()) and sq * sk <= 1 << 24:
        return b.const(visibility.hidden(sq, sk), "causal_hidden")
    zero, one = b.const(np.array(0, np.int64), "zero"), b.const(np.array(1, np.int64), "one")
    scalar = lambda d: b.op("Squeeze", [b.dim(d), b.const(np.array([0], np.int64), "axes")])  # noqa: E731
    rows = b.op("Unsqueeze", [b.op("Range", [zero, scalar(sq), one], base="rows"), b.const(np.array([1], np.int64), "axes")])
    cols = b.op("Range", [zero, scalar(sk), one], base="cols")
    hidden = None
    for bound in visibility.bounds():  # upper: hidden where j > i + u; lower: hidden where j < i + l
        edge = b.op("Add", [rows, scalar(bound.at)], base="key_bound")
        outside = b.op("Greater" if bound.upper else "Less", [cols, edge], base="causal_hidden")
        hidden = outside if hidden is None else b.op("Or", [hidden, outside], base="causal_hidden")
    if hidden is None:
        raise ExportError(f"causal_hidden: {visibility.describe()} hides no key by position")
    return hidden


def _value_info(g: Graph, name: str) -> onnx.ValueInfoProto:
    t = g.types[name]
    return helper.make_tensor_value_info(name, ONNX_DTYPES[t.dtype], [d if isinstance(d, int) else str(d) for d in t.shape])


def export(
    graph: Graph,
    path: str | Path | None = None,
    opset: int = DEFAULT_OPSET,
    attention: str = "decomposed",
    hints: dict[str, int] | None = None,
    sizes: dict[str, int] | None = None,
    external_data: bool = False,
    ctx: PassContext | None = None,
    place_weights: Callable[[str, np.ndarray], onnx.TensorProto] | None = None,
    device: str = "cpu",
    quantized: str = "matmulnbits",
    fused_matmul: bool = False,
) -> onnx.ModelProto:
    """Export ``graph`` (optimized or not) to an ONNX model (written to ``path`` when given).

    ``device``: ``"cpu"`` or ``"cuda"``, the onnxruntime provider the model is for (:func:`~lowering.exporter.targets.onnx_target`).
    ``quantized``: how a quantized product is written, ``"matmulnbits"`` (onnxruntime's ``MatMulNBits``, the weight
    packed as held) or ``"qdq"`` (a standard block-wise ``DequantizeLinear`` of the same bytes and a ``MatMul``), see
    :mod:`lowering.exporter.quantized_export`.
    ``fused_matmul=True`` writes a product whose 2-D operand is read transposed (a projection over an ``[out, in]``
    weight) as onnxruntime's ``com.microsoft.FusedMatMul`` with ``transB=1`` instead of ``Transpose`` and ``MatMul``:
    onnxruntime then packs the weight as stored, where it would otherwise fold a transposed copy of every weight while
    the session is built (one thread; 15 s of TinyLlama's float32 load, ``docs/export.md``).  The ort-cpu backend asks
    for it; a file for other runtimes keeps the standard ops.

    ``ctx``: a :class:`~graphc.optimizer.PassContext` whose trace records the export's lowering (each attention
    recognised and the form chosen for it, what ``graphc optimize --explain -o X.onnx`` prints).

    ``attention``: ``"decomposed"`` (MatMul/Softmax nodes), ``"onnx-attention"``
    (the standard ``Attention`` op, opset 23+), ``"ort-gqa"`` (onnxruntime's
    ``com.microsoft.GroupQueryAttention``), ``"chunked"`` (causal attention as
    query chunks against the visible keys only, :mod:`lowering.exporter.onnx_chunked`) or ``"auto"`` (per attention, under
    ``sizes``/``hints``: chunked or fused when each KV head serves at least 64 query rows and, for chunks, the scores
    are large enough (:data:`lowering.exporter.targets.AUTO_MIN_CHUNKED_SCORES`), else grouped MatMuls; decomposed when the
    query length is unknown).  An
    explicit fused mode that cannot carry a recognised attention raises
    :class:`ExportError` with the reason; ``auto`` falls back to the decomposed form.

    ``external_data=True`` (needs ``path``) streams the weights into
    ``<path>.data`` beside the model, one array at a time, each distinct array
    once (tied weights share their bytes), so models past protobuf's 2 GiB
    limit export without copying every weight into one message.

    Weights past protobuf's 2 GiB limit are written as external data even
    without ``external_data`` (with no ``path``, :class:`ExportError`).
    ``place_weights(name, array) -> TensorProto`` decides how each initializer
    is carried instead (inline, or external data that a session is pointed at;
    see :class:`lowering.backends.ort_weights.SessionWeights`); it excludes
    ``external_data``.
    """
    if external_data and path is None:
        raise ExportError("external_data=True needs a path to write the weights next to")
    if attention not in ATTENTION_MODES:
        raise UnknownNameError("attention mode", attention, ATTENTION_MODES)
    max_opset = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= max_opset:
        raise ExportError(f"opset must be an int in {MIN_OPSET}..{max_opset} (the installed onnx), got {opset!r}")
    graph.verify()
    for out in graph.outputs:
        if out in graph.inputs or out in graph.initializers:
            raise ExportError(f"graph output {out!r} is a graph input or initializer; ONNX needs outputs computed by nodes")
    ctx = PassContext() if ctx is None else ctx
    lowered = lower(graph, onnx_target(attention, opset, device), {**(hints or {}), **(sizes or {})}, ctx)
    if attention in ("onnx-attention", "ort-gqa", "chunked"):
        _require_attention(lowered, attention, ctx)
    b = OnnxBuilder(lowered, quantized, fused_matmul)
    for node in lowered.topological_order():
        _lower_node(b, node)
    b.initializers.extend(_initializers(lowered, path, external_data, place_weights))
    model = _model_proto(b, lowered, graph.name, opset)
    if path is not None:
        try:
            write_replacing(path, model.SerializeToString())  # the name is replaced, never written through
        except OSError as e:
            raise ExportError(f"cannot write {str(path)!r}: {e.strerror}") from None
    return model


def _model_proto(b: OnnxBuilder, lowered: Graph, name: str, opset: int) -> onnx.ModelProto:
    """The model of what ``b`` collected: the lowered graph's interface, every domain its nodes use imported."""
    onnx_graph = helper.make_graph(
        b.nodes, name, [_value_info(lowered, n) for n in lowered.inputs], [_value_info(lowered, n) for n in lowered.outputs], b.initializers
    )
    imports = [helper.make_opsetid("", opset)]
    domains = {n.domain for n in b.nodes} - {"", "ai.onnx"}
    opaque_opsets = {n.op.domain: n.op.opset for n in lowered.topological_order() if isinstance(n.op, Opaque)}
    imports += [helper.make_opsetid(d, opaque_opsets.get(d, 1)) for d in sorted(domains)]
    model = helper.make_model(onnx_graph, opset_imports=imports, producer_name="graphc")
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return model


def _initializers(
    lowered: Graph, path: str | Path | None, external_data: bool, place_weights: Callable[[str, np.ndarray], onnx.TensorProto] | None
) -> list[onnx.TensorProto]:
    """The model's initializers: inline, streamed into ``<path>.data``, or as ``place_weights`` decides.

    Weights too large for one protobuf (:data:`INLINE_LIMIT`) go to ``<path>.data`` even without ``external_data``."""
    if external_data and place_weights is not None:
        raise ExportError("external_data=True and place_weights both place the weights; pass one")
    if place_weights is None and not external_data:
        total = distinct_nbytes(lowered.initializers.values())
        if total > INLINE_LIMIT:
            if path is None:
                raise ExportError(
                    f"graph {lowered.name!r} has {format_bytes(total)} of weights, past what one protobuf holds (2 GiB); "
                    "export to a path (the weights go to <path>.data) or run it with lowering.prepare, which reads them from the checkpoint"
                )
            external_data = True
    if external_data:
        return _write_external(lowered, Path(str(path)))
    place = place_weights or (lambda name, arr: numpy_helper.from_array(contiguous(arr), name))
    return [place(name, arr) for name, arr in lowered.initializers.items()]


INLINE_LIMIT = 2**31 - (64 << 20)
"""Initializer bytes above which an export writes external data whatever it was asked (protobuf's 2 GiB, less room for the graph)."""
_EXTERNAL_MIN_BYTES = 1024
_ALIGN = 4096


def _write_external(graph: Graph, path: Path) -> list[onnx.TensorProto]:
    """Stream every initializer of at least 1 KiB into ``<path>.data`` (each distinct array once) and return the tensors."""
    location = path.name + ".data"
    tensors: list[onnx.TensorProto] = []
    placed: dict[int, tuple[int, int]] = {}
    try:
        with replacing(path.parent / location) as f:
            for name, arr in graph.initializers.items():
                if arr.nbytes < _EXTERNAL_MIN_BYTES:
                    tensors.append(numpy_helper.from_array(contiguous(arr), name))
                    continue
                if id(arr) not in placed:
                    offset = -f.tell() % _ALIGN + f.tell()
                    f.seek(offset)
                    data = contiguous(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
                    f.write(data.data.cast("B"))
                    placed[id(arr)] = (offset, arr.nbytes)
                offset, length = placed[id(arr)]
                t = onnx.TensorProto(name=name, data_type=ONNX_DTYPES[str(arr.dtype)], dims=list(arr.shape))
                t.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
                    entry = t.external_data.add()
                    entry.key, entry.value = key, value
                tensors.append(t)
    except OSError as e:
        raise ExportError(f"cannot write weights to {str(path.parent / location)!r}: {e.strerror}") from None
    return tensors


def _require_attention(lowered: Graph, mode: str, ctx: PassContext) -> None:
    """An explicit fused mode must recognise at least one attention (the target refuses any it cannot carry)."""
    if not any(isinstance(n.op, Attention) for n in lowered.topological_order()):
        misses = "; ".join(f"{m.node!r}: {m.reason}" for m in ctx.trace.near_misses.values() if m.rule == "fuse_attention")
        raise ExportError(f"attention={mode!r}: no attention recognised ({misses or 'the graph has no softmax over scores'})")
