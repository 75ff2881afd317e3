"""ONNX for graphc's quantized ops, the packed bytes written as they are held.

- ``QuantizedMatMul`` -> ``com.microsoft.MatMulNBits`` (``quantized="matmulnbits"``, the default: onnxruntime's packed
  kernel on CPU and CUDA, ``accuracy_level`` kept), or -> a standard block-wise ``DequantizeLinear`` of the same bytes
  seen as ``UINT4``/``UINT8 [N, K]`` and a ``MatMul`` (``quantized="qdq"``: runtimes without onnxruntime's contrib ops,
  ONNX's reference evaluator among them);
- ``QuantizedGather`` -> ``com.microsoft.GatherBlockQuantized`` (``qdq``: the table's ``DequantizeLinear`` and a ``Gather``);
- ``DequantizeBlocks`` (a dequantized weight some other op reads) -> that ``DequantizeLinear`` alone;
- ``DynamicQuantize``, ``IntegerMatMul`` and ``Dequantize`` -> ONNX's ``DynamicQuantizeLinear``, ``MatMulInteger`` and
  ``DequantizeLinear``.

Zero points given as floats have no standard ``DequantizeLinear`` form (its zero point has the data's type): their
``qdq`` export is refused by name.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphc.dims import normalize_dim
from graphc.errors import ExportError
from graphc.graph import Node
from graphc.quantized import DequantizeBlocks, QuantizedGather, QuantizedMatMul, block_zero_points, pack_bits
from graphc.quantized_int8 import Dequantize, Quantize

from .onnx_builder import QUANTIZED_FORMS, OnnxBuilder

__all__ = [
    "emit_quantized_matmul",
    "emit_quantized_gather",
    "emit_dequantize_blocks",
    "emit_dynamic_quantize",
    "emit_integer_matmul",
    "emit_dequantize",
    "emit_quantize",
    "QUANTIZED_FORMS",
]



def emit_quantized_matmul(b: OnnxBuilder, node: Node) -> None:
    """``QuantizedMatMul`` as ``MatMulNBits``, or as ``DequantizeLinear`` + ``MatMul`` (``b.quantized == "qdq"``)."""
    op = node.op_as(QuantizedMatMul)
    n = normalize_dim(b.graph.types[node.inputs[1]].shape[0])
    if not isinstance(n, int):
        raise ExportError(f"node {node.name!r}: a quantized weight needs a static row count, got {n!r}")
    if b.quantized == "matmulnbits":
        b.op("MatMulNBits", list(node.inputs), node.name, domain="com.microsoft",
             K=op.k, N=n, bits=op.bits, block_size=op.block_size, accuracy_level=op.accuracy_level)  # fmt: skip
        return
    w = _dequantize_linear(b, node, node.inputs[1:], op.bits, op.block_size, op.k, n)
    b.op("MatMul", [node.inputs[0], b.op("Transpose", [w], base=f"{node.name}_wT", perm=[1, 0])], node.name)


def emit_quantized_gather(b: OnnxBuilder, node: Node) -> None:
    """``QuantizedGather`` as ``com.microsoft.GatherBlockQuantized`` over the table's bytes seen as ``[rows, packed
    columns]``, or (``quantized="qdq"``) as the table's ``DequantizeLinear`` and a ``Gather``."""
    op = node.op_as(QuantizedGather)
    packed, ids, scales = node.inputs[0], node.inputs[1], node.inputs[2]
    table = b.graph.initializers.get(packed)
    if table is None:
        raise ExportError(f"node {node.name!r}: the packed table {packed!r} must be a constant")
    rows, blocks, blob = table.shape
    if b.quantized == "qdq":
        w = _dequantize_linear(b, node, [packed, scales, *node.inputs[3:]], op.bits, op.block_size, op.k, rows)
        b.op("Gather", [w, ids], node.name, axis=0)
        return
    data = b.op("Reshape", [packed, b.const(np.array([rows, blocks * blob], np.int64))], base=f"{node.name}_data")
    scales2 = b.op("Reshape", [scales, b.const(np.array([rows, blocks], np.int64))], base=f"{node.name}_scales")
    zero = [b.op("Reshape", [node.inputs[3], b.const(np.array([rows, -1], np.int64))], base=f"{node.name}_zero")] if len(node.inputs) > 3 else []
    b.op("GatherBlockQuantized", [data, ids, scales2, *zero], node.name, domain="com.microsoft",
         bits=op.bits, block_size=op.block_size, gather_axis=0, quantize_axis=1)  # fmt: skip


def emit_dequantize_blocks(b: OnnxBuilder, node: Node) -> None:
    """``DequantizeBlocks`` as a standard block-wise ``DequantizeLinear`` (and a ``Slice`` where ``K`` was padded)."""
    op = node.op_as(DequantizeBlocks)
    n = normalize_dim(b.graph.types[node.inputs[0]].shape[0])
    if not isinstance(n, int):
        raise ExportError(f"node {node.name!r}: a quantized weight needs a static row count, got {n!r}")
    w = _dequantize_linear(b, node, node.inputs, op.bits, op.block_size, op.k, n)
    b.op("Identity", [w], node.name)


def emit_dynamic_quantize(b: OnnxBuilder, node: Node) -> None:
    """``DynamicQuantize`` as ONNX ``DynamicQuantizeLinear`` (three outputs)."""
    b.nodes.append(onnx.helper.make_node("DynamicQuantizeLinear", list(node.inputs), list(node.outputs), name=b.fresh(f"n_{node.outputs[0]}")))


def emit_dequantize(b: OnnxBuilder, node: Node) -> None:
    """``Dequantize`` as ONNX ``DequantizeLinear`` (``block_size`` where it has one: opset 21)."""
    op = node.op_as(Dequantize)
    proto = onnx.helper.make_node("DequantizeLinear", list(node.inputs), [node.name], name=b.fresh(f"n_{node.name}"), axis=op.axis)
    if op.block_size:
        proto.attribute.append(onnx.helper.make_attribute("block_size", op.block_size))
    b.nodes.append(proto)


def emit_quantize(b: OnnxBuilder, node: Node) -> None:
    """``Quantize`` as ONNX ``QuantizeLinear`` (the zero point gives the output type; without one, ``output_dtype``;
    ``block_size`` where it has one: opset 21)."""
    op = node.op_as(Quantize)
    proto = onnx.helper.make_node("QuantizeLinear", list(node.inputs), [node.name], name=b.fresh(f"n_{node.name}"), axis=op.axis)
    if len(node.inputs) < 3 and op.dtype != "uint8":
        proto.attribute.append(onnx.helper.make_attribute("output_dtype", onnx.TensorProto.INT8))
    if op.block_size:
        proto.attribute.append(onnx.helper.make_attribute("block_size", op.block_size))
    b.nodes.append(proto)


def emit_integer_matmul(b: OnnxBuilder, node: Node) -> None:
    """``IntegerMatMul`` as ONNX ``MatMulInteger``."""
    b.op("MatMulInteger", list(node.inputs), node.name)


def _dequantize_linear(b: OnnxBuilder, node: Node, operands: tuple[str, ...] | list[str], bits: int, block_size: int, k: int, n: int) -> str:
    """``W [N, K]`` from the packed operands, written as ``DequantizeLinear(axis=1, block_size)`` over the same bytes."""
    graph = b.graph
    packed_name, scales_name = operands[0], operands[1]
    packed = graph.initializers.get(packed_name)
    if packed is None:
        raise ExportError(f"node {node.name!r}: the packed weight {packed_name!r} must be a constant to be written as DequantizeLinear")
    blocks = packed.shape[1]
    kind = onnx.TensorProto.UINT4 if bits == 4 else onnx.TensorProto.UINT8
    data = b.fresh(f"{packed_name}_{'uint4' if bits == 4 else 'uint8'}")
    b.initializers.append(_raw(data, kind, [n, blocks * block_size], np.ascontiguousarray(packed).tobytes()))
    zero = b.fresh(f"{packed_name}_zero_points")
    z = graph.initializers.get(operands[2]) if len(operands) == 3 else None
    if len(operands) == 3 and (z is None or z.dtype != np.uint8):
        raise ExportError(
            f"node {node.name!r}: zero points {operands[2]!r} are not packed uint8 constants; standard DequantizeLinear takes zero points "
            "of the data's type (export with quantized='matmulnbits')"
        )
    values = block_zero_points(z, n, blocks, bits).astype(np.uint8)
    b.initializers.append(_raw(zero, kind, [n, blocks], pack_bits(values.reshape(-1), bits).tobytes()))
    scales = b.op("Reshape", [scales_name, b.const(np.array([n, blocks], np.int64), f"{node.name}_scale_shape")], base=f"{node.name}_scales")
    w = b.op("DequantizeLinear", [data, scales, zero], base=f"{node.name}_w", axis=1, block_size=block_size)
    if blocks * block_size != k:
        bounds = [b.const(np.array([v], np.int64)) for v in (0, k, 1)]
        w = b.op("Slice", [w, *bounds], base=f"{node.name}_wk")
    return w


def _raw(name: str, data_type: int, dims: list[int], raw: bytes) -> onnx.TensorProto:
    """A tensor of ``data_type`` whose bytes are ``raw`` (4-bit types: two values a byte, the low nibble first)."""
    return onnx.TensorProto(name=name, data_type=data_type, dims=dims, raw_data=raw)
