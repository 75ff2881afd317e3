"""RMS norm as one op for onnxruntime's CUDA provider: ``SimplifiedLayerNormalization`` instead of seven kernels.

graphc writes an RMS norm (Llama, Mistral, Qwen, ...) as its pieces: an einsum of the
value with itself, a scale by ``1/n``, ``+ eps``, ``sqrt``, ``reciprocal``, and two
products.  On a GPU every piece is a kernel launch (with a Cast on each side of the
float32 ones): :data:`fuse_rms_norm` (run by the CUDA target, :func:`lowering.exporter.targets.onnx_target`)
recognises the pattern once and rewrites it to :class:`OrtRMSNorm`, which the ONNX export
writes as onnxruntime's ``SimplifiedLayerNormalization`` (statistics in float32 inside the
kernel, ``stash_type=1``).  graphc's importer reads that op back as the same pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


from graphc.graph import Graph, Node
from graphc.ops import Binary, Dims, Einsum, Op, Scale, TensorType, Unary, register_op
from graphc.tensor_ops import Reduce
from graphc.optimizer import Bindings, Miss, Pat, PassContext, RewritePass, Rule

__all__ = ["OrtRMSNorm", "RMS_NORM", "fuse_rms_norm", "match_rms_norm", "OnnxLayerNorm", "LAYER_NORM", "fuse_layer_norm", "match_layer_norm"]


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


def _terms(op: Einsum) -> tuple[list[str], str]:
    ins, out = op.spec.split("->")
    return ins.split(","), out


def _times_weight(op: Einsum) -> bool:  # y[..., c] = y0[..., c] * w[c]
    (a, *rest), out = _terms(op)
    return rest == [out[-1]] and a == out


def _row_times_value(op: Einsum) -> bool:  # y0[..., c] = r[...] * x[..., c]
    terms, out = _terms(op)
    return terms == [out[:-1], out]


def _sum_of_squares(op: Einsum) -> bool:  # s[...] = sum_c x[..., c] * x[..., c]
    terms, out = _terms(op)
    return len(terms) == 2 and terms[0] == terms[1] and out == terms[0][:-1]


def _fn(name: str) -> Callable[[Any], bool]:
    return lambda op: op.fn == name


RMS_NORM = Pat.op(Einsum, where=_times_weight, inputs=(
    Pat.op(Einsum, where=_row_times_value, name="normalized", single_use=True, inputs=(
        Pat.op(Unary, where=_fn("reciprocal"), name="inv_rms", single_use=True, inputs=(
            Pat.op(Unary, where=_fn("sqrt"), name="rms", single_use=True, inputs=(
                Pat.op(Binary, where=_fn("add"), name="plus_eps", single_use=True, inputs=(
                    Pat.op(Scale, name="mean", single_use=True, inputs=(
                        Pat.op(Einsum, where=_sum_of_squares, name="sum_sq", single_use=True, inputs=(Pat.var("x"), Pat.var("x"))),
                    )),
                    Pat.var("eps"),
                )),
            )),
        )),
        Pat.var("x"),
    )),
    Pat.var("weight"),
))  # fmt: skip
"""``weight * x / sqrt(mean(x * x) + eps)`` as graphc's builders write an RMS norm (each inner value read once)."""

_PARTS = ("sum_sq", "mean", "plus_eps", "rms", "inv_rms", "normalized")


def match_rms_norm(graph: Graph, node: Node, ctx: PassContext) -> tuple[Node, Bindings] | Miss | None:
    """``node`` and the bindings of :data:`RMS_NORM` when ``node`` ends an RMS norm over the last axis with a scalar
    constant epsilon; a :class:`~graphc.optimizer.Miss` saying why a near match is not one; else None."""
    got = RMS_NORM.match(graph, node.outputs[0])
    if got is None or isinstance(got, Miss):
        return got
    eps, width = got["eps"], graph.types[got["x"]].shape[-1]
    if not graph.is_constant(eps) or graph.initializers[eps].size != 1:
        return Miss(f"RMS norm of {got['x']!r}: its epsilon {eps!r} is not a scalar constant")
    if not isinstance(width, int) or not math.isclose(got["mean"].op_as(Scale).factor, 1 / width, rel_tol=1e-6):
        return Miss(f"RMS norm of {got['x']!r}: the sum of squares is not divided by the axis' {width} elements")
    return node, got


def _rewrite(graph: Graph, m: tuple[Node, Bindings], ctx: PassContext) -> str:
    node, got = m
    eps = float(graph.initializers[got["eps"]].reshape(()).astype(np.float64))
    graph.redefine(node.name, OrtRMSNorm(eps), [got["x"], got["weight"]])
    for part in reversed(_PARTS):  # each read only by the next, the last by the node just redefined
        graph.remove_node(got[part].name)
    return f"RMS norm of {got['x']!r} fused into SimplifiedLayerNormalization (eps {eps:g}; {len(_PARTS) + 1} ops -> 1)"


fuse_rms_norm = RewritePass(
    "fuse_rms_norm", "RMS norms as onnxruntime's SimplifiedLayerNormalization", [Rule("rms_norm", (Einsum,), match_rms_norm, _rewrite)]
)


@register_op
@dataclass(frozen=True)
class OnnxLayerNorm(Op):
    """``(x - mean(x)) / sqrt(var(x) + epsilon) * weight + bias`` over the last axis: ONNX ``LayerNormalization`` (opset 17),
    statistics in float32 (``stash_type=1``)."""

    epsilon: float
    arity: ClassVar[int | None] = 3

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        return ins[0]

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        x, w, b = (np.asarray(a, np.float64) for a in args)
        centered = x - x.mean(axis=-1, keepdims=True)
        y = centered / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + self.epsilon) * w + b
        return y.astype(args[0].dtype)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Two means, a square, a difference and two products and a sum per element."""
        return 7 * math.prod(out_shapes[0])


def _last_axis_mean(op: Reduce) -> bool:
    return op.fn == "mean" and op.keepdims and len(op.axes) == 1


_MEAN = Pat.op(Reduce, where=_last_axis_mean, name="mean", inputs=(Pat.var("x"),))
_CENTERED = Pat.op(Binary, where=_fn("sub"), name="centered", inputs=(Pat.var("x"), _MEAN))

LAYER_NORM = Pat.op(Binary, where=_fn("add"), inputs=(
    Pat.op(Binary, where=_fn("mul"), name="scaled", single_use=True, inputs=(
        Pat.op(Binary, where=_fn("mul"), name="normalized", single_use=True, inputs=(
            _CENTERED,
            Pat.op(Unary, where=_fn("reciprocal"), name="inv_std", single_use=True, inputs=(
                Pat.op(Unary, where=_fn("sqrt"), name="std", single_use=True, inputs=(
                    Pat.op(Binary, where=_fn("add"), name="plus_eps", single_use=True, inputs=(
                        Pat.op(Reduce, where=_last_axis_mean, name="var", single_use=True, inputs=(
                            Pat.op(Binary, where=_fn("mul"), name="squared", single_use=True, inputs=(Pat.var("c"), Pat.var("c"))),
                        )),
                        Pat.var("eps"),
                    )),
                )),
            )),
        )),
        Pat.var("weight"),
    )),
    Pat.var("bias"),
))  # fmt: skip
"""A LayerNorm as graphc's importer writes ONNX's ``LayerNormalization`` (and exporters' decomposed ones): ``(x - mean)``,
its mean square, ``+ eps``, ``sqrt``, ``reciprocal``, the products with the row factor and the weight, the bias."""

_LN_PARTS = ("scaled", "normalized", "inv_std", "std", "plus_eps", "var", "squared", "centered", "mean")


def match_layer_norm(graph: Graph, node: Node, ctx: PassContext) -> tuple[Node, Bindings] | Miss | None:
    """``node`` and the bindings of :data:`LAYER_NORM` when ``node`` ends a LayerNorm over the last axis with a scalar
    constant epsilon and 1-D weight and bias; a :class:`~graphc.optimizer.Miss` for a near match; else None."""
    got = LAYER_NORM.match(graph, node.outputs[0])
    if got is None or isinstance(got, Miss):
        return got
    x, rank = got["x"], graph.types[got["x"]].rank
    if got["c"] != got["centered"].outputs[0] or {got["mean"].op_as(Reduce).axes[0] % rank, got["var"].op_as(Reduce).axes[0] % rank} != {rank - 1}:
        return None
    readers = {n.name for n in graph.consumers(got["centered"].outputs[0])}, {n.name for n in graph.consumers(got["mean"].outputs[0])}
    shared = any(graph.is_output(got[part].outputs[0]) for part in _LN_PARTS)
    if shared or readers != ({got["squared"].name, got["normalized"].name}, {got["centered"].name}):
        return Miss(f"LayerNorm of {x!r}: its mean or centred value is read outside the norm")
    eps, width = got["eps"], graph.types[x].shape[-1]
    if not graph.is_constant(eps) or graph.initializers[eps].size != 1:
        return Miss(f"LayerNorm of {x!r}: its epsilon {eps!r} is not a scalar constant")
    if any(graph.types[got[k]].shape != (width,) or graph.types[got[k]].dtype != graph.types[x].dtype for k in ("weight", "bias")):
        return Miss(f"LayerNorm of {x!r}: its weight and bias are not vectors of the axis' {width} elements")
    return node, got


def _rewrite_layer_norm(graph: Graph, m: tuple[Node, Bindings], ctx: PassContext) -> str:
    node, got = m
    eps = float(graph.initializers[got["eps"]].reshape(()).astype(np.float64))
    graph.redefine(node.name, OnnxLayerNorm(eps), [got["x"], got["weight"], got["bias"]])
    for part in _LN_PARTS:  # outermost first: each is read only by the parts already removed
        graph.remove_node(got[part].name)
    return f"LayerNorm of {got['x']!r} fused into LayerNormalization (eps {eps:g}; {len(_LN_PARTS) + 1} ops -> 1)"


fuse_layer_norm = RewritePass(
    "fuse_layer_norm",
    "LayerNorms as ONNX's LayerNormalization (opset 17)",
    [Rule("layer_norm", (Binary,), match_layer_norm, _rewrite_layer_norm)],
)
