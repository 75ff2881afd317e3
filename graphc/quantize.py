"""``quantize_weights(graph)``: every product with a constant weight matrix reads it quantized, in blocks.

Each einsum ``x[..., K] . W[N, K] -> [..., N]`` whose ``W`` is a float initializer (the projections, the MLP and the
LM head of a causal LM) gets ``W`` quantized by round-to-nearest in ``MatMulNBits``' layout
(:func:`graphc.quantized.quantize_blocks`: ``bits`` 4 or 8, ``block_size`` values along ``K`` a block, symmetric by
default) and reads ``DequantizeBlocks(packed, scales[, zero_points])`` instead; :func:`graphc.optimize` then fuses
each into a :class:`~graphc.quantized.QuantizedMatMul`, and the ONNX export writes ``MatMulNBits`` (onnxruntime's CPU
and CUDA kernels).  A table tied to such a matrix (the embedding of a model whose LM head shares it) is looked up
with :class:`~graphc.quantized.QuantizedGather` from the same bytes (``GatherBlockQuantized``, as onnxruntime-genai's
builder writes a tied table); an untied embedding table stays float.  One weight is quantized at a time, a few rows at
a time, and its float array dropped from the graph once nothing reads it, its pages released from the resident set
when it is mapped from a checkpoint: the peak memory is near the packed weights', not the float checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import OptimizerError
from .graph import Graph, Node
from .ops import Einsum
from .quantized import DequantizeBlocks, QuantizedGather, quantize_blocks, reads_weight_rows
from .tensor_ops import Gather

__all__ = ["QuantizeOptions", "quantize_weights", "QUANTIZE_CHOICES"]

QUANTIZE_CHOICES = {"int4": 4, "int8": 8}
"""The ``--quantize`` names and their bits."""


@dataclass(frozen=True)
class QuantizeOptions:
    """How weights are quantized: ``bits`` (4 or 8), ``block_size`` (a power of two >= 16), ``symmetric`` (the default
    zero point, no zero points stored) and onnxruntime's ``accuracy_level`` for the products (4: int8 activations)."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 0

    def __post_init__(self) -> None:
        DequantizeBlocks(self.bits, self.block_size, 1, self.accuracy_level)  # the same checks, named
        if not isinstance(self.symmetric, bool):
            raise OptimizerError(f"QuantizeOptions: symmetric must be a bool, got {self.symmetric!r}")


def quantize_weights(graph: Graph, options: QuantizeOptions | None = None) -> tuple[Graph, int]:
    """A copy of ``graph`` whose weight matrices are read quantized (see the module doc), and how many were."""
    options = options or QuantizeOptions()
    g = graph.copy()
    done: dict[str, str] = {}  # weight -> its dequantized value (a weight two products read is quantized once)
    for node in list(g.topological_order()):
        weight = _weight_of(g, node)
        if weight is None:
            continue
        if weight not in done:
            done[weight] = _dequantized(g, weight, node.name, options)
        g.redefine(node.name, node.op, [node.inputs[0], done[weight]])
    for node in list(g.topological_order()):  # a table tied to a quantized matrix is looked up quantized too
        if isinstance(node.op, Gather) and node.op.axis == 0 and node.inputs[0] in done:
            dequantized = g.producer(done[node.inputs[0]])
            assert dequantized is not None
            packed, scales, *zeros = dequantized.inputs
            lookup = QuantizedGather(options.bits, options.block_size, int(g.types[node.inputs[0]].shape[1]))
            g.redefine(node.name, lookup, [packed, node.inputs[1], scales, *zeros])
    for weight in done:
        if not g.consumers(weight):
            g.remove_initializer(weight)
    g.verify()
    return g, len(done)


def _dequantized(g: Graph, weight: str, before: str, options: QuantizeOptions) -> str:
    """The value ``DequantizeBlocks`` of ``weight`` quantized, added before node ``before``."""
    w = g.initializers[weight]
    packed, scales, zeros = quantize_blocks(w, options.bits, options.block_size, options.symmetric)
    names = [g.add_initializer(g.fresh_name(f"{weight}.q{options.bits}"), packed, copy=False).name]
    names.append(g.add_initializer(g.fresh_name(f"{weight}.scales"), scales.astype(w.dtype), copy=False).name)
    if zeros is not None:
        names.append(g.add_initializer(g.fresh_name(f"{weight}.zero_points"), zeros, copy=False).name)
    op = DequantizeBlocks(options.bits, options.block_size, int(w.shape[1]), options.accuracy_level)
    return g.add_node(op, names, g.fresh_name(f"{weight}.dequantized"), before=before).name


def _weight_of(g: Graph, node: Node) -> str | None:
    """The float ``W[N, K]`` initializer an einsum ``x[..., K] . W[N, K] -> [..., N]`` reads, or None."""
    if not isinstance(node.op, Einsum) or len(node.inputs) != 2:
        return None
    weight = node.inputs[1]
    w = g.initializers.get(weight)
    if w is None or w.ndim != 2 or str(w.dtype) not in ("float32", "float16") or str(w.dtype) != g.types[node.inputs[0]].dtype:
        return None
    return weight if reads_weight_rows(node.op_as(Einsum).parsed) else None
