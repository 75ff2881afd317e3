"""RMS norm as one op for onnxruntime's CUDA provider: ``SimplifiedLayerNormalization`` instead of nine kernels.

graphc writes an RMS norm (Llama, Mistral, Qwen, ...) as its pieces: an einsum of the
value with itself, a scale by ``1/n``, ``+ eps``, ``sqrt``, ``reciprocal``, and two
products.  On a GPU every piece is a kernel launch, and a decode step is bound by launches,
not by bytes: :data:`fuse_rms_norm` (run by the CUDA target, :func:`lowering.exporter.targets.onnx_target`)
recognises the pattern once and rewrites it to :class:`OrtRMSNorm`, which the ONNX export
writes as onnxruntime's ``SimplifiedLayerNormalization`` (statistics in float32 inside the
kernel, ``stash_type=1``).  graphc's importer reads that op back as the same pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


from graphc.graph import Graph, Node
from graphc.ops import Binary, Dims, Einsum, Op, Scale, TensorType, Unary, register_op
from graphc.optimizer import PassContext, RewritePass, Rule

__all__ = ["OrtRMSNorm", "fuse_rms_norm", "match_rms_norm"]


@register_op
@dataclass(frozen=True)
class OrtRMSNorm(Op):
    """``x / sqrt(mean(x**2, axis=-1) + epsilon) * weight``: onnxruntime's ``SimplifiedLayerNormalization``."""

    epsilon: float
    arity: ClassVar[int | None] = 2

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return ins[0]

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        x, w = (np.asarray(a, np.float64) for a in args)
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.epsilon) * w
        return y.astype(args[0].dtype)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Square, sum, two products per element."""
        return 4 * math.prod(out_shapes[0])


def _einsum(graph: Graph, value: str) -> tuple[Node, list[str], str] | None:
    node = graph.producer(value)
    if node is None or not isinstance(node.op, Einsum):
        return None
    ins, out = node.op_as(Einsum).spec.split("->")
    return node, ins.split(","), out


def _only(graph: Graph, value: str, kinds: tuple[type[Op], ...]) -> Node | None:
    """The producer of ``value`` when it is one of ``kinds`` and ``value`` has a single reader."""
    node = graph.producer(value)
    if node is None or not isinstance(node.op, kinds) or graph.use_count(value) != 1 or graph.is_output(value):
        return None
    return node


RMSNormMatch = tuple[str, str, str, float, list[str]]
"""``(last node, x, weight, epsilon, the pattern's other nodes)``."""


def match_rms_norm(graph: Graph, node: Node, ctx: PassContext) -> RMSNormMatch | None:
    """The RMS norm ``node`` ends, written as graphc builds it (see the module's text), or None."""
    last = _einsum(graph, node.name)
    if last is None or len(last[1]) != 2 or len(last[1][1]) != 1 or last[1][0] != last[2] or last[1][1] != last[2][-1]:
        return None  # not y = y0[..., c] * w[c]
    step0, weight = node.inputs
    scaled = _einsum(graph, step0)
    if scaled is None or graph.use_count(step0) != 1 or scaled[1] != [last[2][:-1], last[2]] or scaled[2] != last[2]:
        return None  # not y0 = inv_rms[...] * x[..., c]
    inv_rms, x = scaled[0].inputs
    chain: list[Node] = []
    value = inv_rms
    for kinds, fn in (((Unary,), "reciprocal"), ((Unary,), "sqrt"), ((Binary,), "add")):
        link = _only(graph, value, kinds)
        if link is None or getattr(link.op, "fn", None) != fn:
            return None
        chain.append(link)
        value = link.inputs[0]
    add = chain[-1]
    eps = add.inputs[1]
    if not graph.is_constant(eps) or graph.initializers[eps].size != 1:
        return None
    mean = _only(graph, value, (Scale,))
    sums = _einsum(graph, mean.inputs[0]) if mean is not None else None
    width = graph.types[x].shape[-1]
    if mean is None or sums is None or graph.use_count(mean.inputs[0]) != 1 or tuple(sums[0].inputs) != (x, x) or not isinstance(width, int):
        return None
    if sums[1] != [last[2], last[2]] or sums[2] != last[2][:-1] or not math.isclose(mean.op_as(Scale).factor, 1 / width, rel_tol=1e-6):
        return None
    parts = [sums[0].name, mean.name, *(n.name for n in reversed(chain)), scaled[0].name]
    return node.name, x, weight, float(graph.initializers[eps].reshape(()).astype(np.float64)), parts


def _rewrite(graph: Graph, m: RMSNormMatch, ctx: PassContext) -> str:
    last, x, weight, eps, parts = m
    graph.redefine(last, OrtRMSNorm(eps), [x, weight])
    for name in reversed(parts):  # each read only by the next, the last by the node just redefined
        graph.remove_node(name)
    return f"RMS norm of {x!r} fused into SimplifiedLayerNormalization (eps {eps:g}; {len(parts) + 1} ops -> 1)"


def _match(graph: Graph, node: Node, ctx: PassContext) -> Any:
    return match_rms_norm(graph, node, ctx)


fuse_rms_norm = RewritePass(
    "fuse_rms_norm", "RMS norms as onnxruntime's SimplifiedLayerNormalization", [Rule("rms_norm", (Einsum,), _match, _rewrite)]
)
