"""Projections of one value merged into one contraction: q/k/v (and an MLP's gate and up) as one matrix product.

A decoder layer reads its normed hidden state three times for q, k and v, and its MLP reads the second norm twice
(gate and up).  At decode, each of those products is a matrix-vector product bound by reading its weight; one product
over the concatenated weights reads the same bytes in one kernel launch instead of three (or two), which is what GPU
runtimes do (onnxruntime-genai's builders pack q/k/v into one MatMul).  :data:`merge_projections` rewrites each
group of ``x @ W_i`` that share ``x`` (same einsum, 2-D constant weights, one dtype) to ``x @ concat(W_i)``
followed by one ``Slice`` per original result; the merged weight is laid out ``[in, out]``, so an ONNX export writes a
plain ``MatMul`` with no ``Transpose`` to fold.

The CUDA export runs it (:func:`lowering.exporter.targets.onnx_target`).  The CPU export does not: on onnxruntime's
CPU provider (2 cores) a decode step measured the same with and without it (a 2-layer Mistral-7B-shaped float32 model
97-110 vs 108-113 ms/token, a 8-layer hidden-512 one 6.9 vs 6.8), while the merged weights are a copy of the
checkpoint's bytes where the separate ones are read from its mapped files.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from graphc.graph import Graph, Node
from graphc.ops import Einsum
from graphc.tensor_ops import Slice

from .infra import Pass, PassContext

__all__ = ["merge_projections", "projection_groups"]


def _projection(graph: Graph, node: Node) -> tuple[str, str, str] | None:
    """``(x, spec, dtype)`` when ``node`` is ``x @ W`` with a 2-D constant ``W`` whose free label is the result's last."""
    if not isinstance(node.op, Einsum) or len(node.inputs) != 2 or graph.is_output(node.output):
        return None
    x, w = node.inputs
    spec = node.op.parsed
    a, b = spec.inputs
    if w not in graph.initializers or x in graph.initializers or len(b) != 2 or not spec.output or spec.output[-1] not in b:
        return None
    free = spec.output[-1]
    summed = b.replace(free, "")
    if len(summed) != 1 or summed not in a or summed in spec.output or free in a or spec.output[:-1] != a.replace(summed, ""):
        return None
    return x, node.op.spec, graph.types[w].dtype


def projection_groups(graph: Graph) -> list[list[Node]]:
    """The groups of two or more projections of one value (same einsum, weight dtype and summed size), in graph order."""
    groups: dict[tuple[str, str, str], list[Node]] = defaultdict(list)
    for node in graph.topological_order():
        key = _projection(graph, node)
        if key is not None:
            groups[key].append(node)
    return [nodes for nodes in groups.values() if len(nodes) >= 2]


def _merged_weight(graph: Graph, nodes: list[Node]) -> np.ndarray:
    """The group's weights as one ``[in, out]`` array (each weight's free axis last, then concatenated)."""
    parts = []
    for n in nodes:
        b = n.op_as(Einsum).parsed.inputs[1]
        w = graph.initializers[n.inputs[1]]
        parts.append(w if b[-1] == n.op_as(Einsum).parsed.output[-1] else w.T)
    merged = np.concatenate(parts, axis=1)
    merged.setflags(write=False)
    return merged


def _merge(graph: Graph, nodes: list[Node]) -> str:
    first = nodes[0]
    spec = first.op_as(Einsum).parsed
    a, free = spec.inputs[0], spec.output[-1]
    summed = spec.inputs[1].replace(free, "")
    names = [n.inputs[1] for n in nodes]
    common = os.path.commonprefix(names)
    prefix = common.rsplit(".", 1)[0] + "." if "." in common else ""
    heads = "_".join(n[len(prefix) :].split(".")[0] for n in names)
    weight = graph.add_initializer(graph.fresh_name(f"{prefix}merged_{heads}.weight"), _merged_weight(graph, nodes), copy=False)
    merged = graph.add_node(
        Einsum(f"{a},{summed}{free}->{spec.output}"), [first.inputs[0], weight], graph.fresh_name(f"{first.output}_merged"), before=first.name
    )
    axis, start = len(spec.output) - 1, 0
    for n in nodes:
        width = int(graph.initializers[n.inputs[1]].shape[n.op_as(Einsum).parsed.inputs[1].index(free)])
        part = graph.add_node(Slice(axis, start, start + width), [merged], graph.fresh_name(f"{n.output}_part"), before=first.name)
        start += width
        graph.replace_uses(n.output, part)
    for n in nodes:
        graph.remove_node(n.name)
    return f"{len(nodes)} projections of {first.inputs[0]!r} ({', '.join(names)}) as one contraction over {weight.name!r}"


def _run(graph: Graph, ctx: PassContext) -> bool:
    groups = projection_groups(graph)
    for nodes in groups:
        ctx.fired("merge_projections", nodes[0].name, _merge(graph, nodes))
    return bool(groups)


merge_projections = Pass("merge_projections", "projections of one value as one contraction over their concatenated weights", _run)
"""The pass merging each group of projections of one value (:func:`projection_groups`)."""
