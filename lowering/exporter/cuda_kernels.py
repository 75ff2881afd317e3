"""Which ops onnxruntime's CUDA provider runs on bfloat16: what a bfloat16 export for CUDA may use.

A node whose type has no kernel for its operands' dtype on a provider is placed on the CPU by onnxruntime
(with a copy each way) or refused.  float16 has a CUDA kernel for every op graphc's exports use; bfloat16 lacks
several (comparisons, ``Einsum``, ``Reciprocal``, ``ReduceMean``, ``Cos``/``Sin``, ``Range``, ``Log``).  The CUDA
target computes an op that lacks one in float32 (:func:`cuda_lacks_kernel`, :attr:`graphc.optimizer.Target.lacks_kernel`),
and :func:`kernel_gaps` checks a finished model against the table.

The table is onnxruntime's own list of registered kernels (``docs/OperatorKernels.md``, CUDAExecutionProvider,
the ops whose float types include ``tensor(bfloat16)`` at the opsets graphc writes).
"""

from __future__ import annotations

import onnx

from graphc.errors import ExportError
from graphc.ops import Binary, Compare, Einsum, Op, Unary
from graphc.tensor_ops import Reduce

__all__ = ["CUDA_BFLOAT16_OPS", "cuda_lacks_kernel", "element_types", "kernel_gaps", "onnx_op_type"]

CUDA_BFLOAT16_OPS = frozenset(
    {
        # ai.onnx
        "Abs", "Add", "Attention", "Cast", "Concat", "ConstantOfShape", "Div", "Dropout", "Erf", "Exp", "Expand",
        "Flatten", "Gather", "GatherElements", "GatherND", "Gelu", "Gemm", "Identity", "IsInf", "IsNaN",
        "LayerNormalization", "MatMul", "Max", "Min", "Mod", "Mul", "Neg", "Pow", "RMSNormalization", "ReduceSum",
        "Relu", "Reshape", "RotaryEmbedding", "ScatterElements", "ScatterND", "Shape", "Sigmoid", "Sign",
        "SimplifiedLayerNormalization", "Size", "Slice", "Softmax", "Split", "Sqrt", "Squeeze", "Sub", "Sum", "Tanh",
        "Tile", "Transpose", "Trilu", "Unsqueeze", "Where",
        # com.microsoft
        "FastGelu", "FusedMatMul", "GroupQueryAttention", "MultiHeadAttention", "QuickGelu", "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization",
    }
)  # fmt: skip
"""ONNX op types with a bfloat16 kernel in onnxruntime's CUDA provider."""

_BINARY_ONNX = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min", "pow": "Pow"}
_COMPARE_ONNX = {"less": "Less", "less_equal": "LessOrEqual", "greater": "Greater", "greater_equal": "GreaterOrEqual", "equal": "Equal"}
_REDUCE_ONNX = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax", "min": "ReduceMin"}


def onnx_op_type(op: Op) -> str | None:
    """The ONNX op type the export writes for an elementwise, comparison, reduction or one-operand einsum ``op``;
    ``None`` for the others (data movement, contractions of two operands: ``MatMul``, attention forms)."""
    if isinstance(op, Unary):
        return op.function.onnx
    if isinstance(op, Binary):
        return _BINARY_ONNX.get(op.fn)
    if isinstance(op, Compare):
        return _COMPARE_ONNX[op.fn]
    if isinstance(op, Reduce):
        return _REDUCE_ONNX[op.fn]
    if isinstance(op, Einsum) and len(op.parsed.inputs) == 1:
        return "Einsum"
    return None


def cuda_lacks_kernel(op: Op, dtype: str) -> bool:
    """True where onnxruntime's CUDA provider has no kernel for ``op`` on ``dtype`` operands (only bfloat16 lacks any)."""
    if dtype != "bfloat16":
        return False
    kind = onnx_op_type(op)
    return kind is not None and kind not in CUDA_BFLOAT16_OPS


def kernel_gaps(model: onnx.ModelProto, dtype: int = onnx.TensorProto.BFLOAT16) -> list[str]:
    """The nodes of ``model`` that read or write ``dtype`` (an ``onnx.TensorProto`` element type) but have no such kernel
    in onnxruntime's CUDA provider (:data:`CUDA_BFLOAT16_OPS`), as ``"name (OpType)"``; empty when it all runs there."""
    if dtype != onnx.TensorProto.BFLOAT16:
        raise ExportError(f"kernel_gaps knows onnxruntime's CUDA kernels for bfloat16 only, not element type {dtype}")
    elem = element_types(model)
    graph = model.graph
    gaps = []
    for node in graph.node:
        if node.op_type == "Constant" or node.op_type in CUDA_BFLOAT16_OPS:
            continue
        if any(elem.get(v) == dtype for v in (*node.input, *node.output) if v):
            gaps.append(f"{node.name} ({node.op_type})")
    return gaps


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every value of ``model`` that has one: onnx's shape inference, and where it stops at an op it
    does not know (onnxruntime's own ``SimplifiedLayerNormalization``, ``GroupQueryAttention``), each output of that op
    given its first input's type (true of those ops), then inference again from there."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    while True:
        graph = onnx.shape_inference.infer_shapes(work).graph
        elem = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)}
        elem.update({t.name: t.data_type for t in graph.initializer})
        known = {k for k, v in elem.items() if v}
        filled = [
            onnx.helper.make_tensor_value_info(o, elem[node.input[0]], None)
            for node in graph.node
            if node.input and node.input[0] in known
            for o in node.output
            if o and o not in known
        ]
        if not filled:
            return {k: v for k, v in elem.items() if v}
        work.graph.value_info.extend(filled)
