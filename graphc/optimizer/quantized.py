"""A product with a dequantized weight becomes one quantized product, the weight left packed.

``einsum("...k,nk->...n", x, DequantizeBlocks(packed, scales[, zero_points]))`` (how a ``MatMulNBits`` imports) is
rewritten to ``QuantizedMatMul(x, packed, scales[, zero_points])``: the same numbers (it is the definition), and the
backends then run their packed kernels (onnxruntime's ``MatMulNBits``) instead of materialising ``W``.  The
dequantize node is left to dead-code elimination once no product reads it.
"""

from __future__ import annotations

from graphc.graph import Graph, Node
from graphc.ops import Einsum
from graphc.quantized import DequantizeBlocks, QuantizedMatMul, reads_weight_rows

from .infra import PassContext, Rule
from .patterns import Miss

__all__ = ["QUANTIZED_MATMUL_RULE"]


def _match(graph: Graph, node: Node, ctx: PassContext) -> Node | Miss | None:
    if len(node.inputs) != 2:
        return None
    weight = graph.producer(node.inputs[1])
    if weight is None or not isinstance(weight.op, DequantizeBlocks):
        return None
    if not reads_weight_rows(node.op_as(Einsum).parsed):
        return Miss(f"einsum {node.name!r} ({node.op_as(Einsum).spec}) is not x[..., K] times a dequantized W[N, K] transposed")
    if graph.types[node.inputs[0]].dtype != graph.types[node.inputs[1]].dtype:
        return Miss(f"einsum {node.name!r}: x and the dequantized weight differ in dtype")
    return node


def _rewrite(graph: Graph, node: Node, ctx: PassContext) -> str:
    weight = graph.producer(node.inputs[1])
    assert weight is not None and isinstance(weight.op, DequantizeBlocks)  # what _match checked
    op = weight.op
    graph.redefine(node.name, QuantizedMatMul(op.bits, op.block_size, op.k, op.accuracy_level), [node.inputs[0], *weight.inputs])
    return f"{op.bits}-bit weight {weight.inputs[0]!r} multiplied packed (block {op.block_size})"


QUANTIZED_MATMUL_RULE = Rule("quantized_matmul", (Einsum,), _match, _rewrite)
"""``einsum(x, DequantizeBlocks(...))`` -> ``QuantizedMatMul``: the weight stays packed."""
