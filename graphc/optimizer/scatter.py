"""A scatter that writes every element: ``ScatterND(data, grid, updates)`` is ``updates``.

transformers' masks before 4.58 are written in place (``mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(...)``), which
the exporters write as an ONNX ``ScatterND`` whose indices are the grid of every position of the slice.  graphc carries
ScatterND as an opaque node, so the mask behind it cannot be read as a causal mask and padding.  Where the slice is the
whole tensor (the updates have the data's shape) and the indices are the identity grid (component ``j`` is
``arange`` along axis ``j``, broadcast), the scatter replaces every element: :data:`SCATTER_ALL_RULE` reads it as its
updates, and the mask analysis sees the mask as written.
"""

from __future__ import annotations

from graphc.graph import Graph, Node
from graphc.opaque import Opaque
from graphc.ops import Concat, Reshape
from graphc.rotary import Positions
from graphc.tensor_ops import BroadcastTo

from .infra import PassContext, Rule
from .patterns import Miss

__all__ = ["SCATTER_ALL_RULE", "is_identity_grid"]


def _chain(graph: Graph, value: str) -> list[str]:
    """``value`` and the values it is a Reshape or BroadcastTo of, outermost first, down to the first that is not one."""
    out = [value]
    node = graph.producer(value)
    while node is not None and isinstance(node.op, (Reshape, BroadcastTo)):
        out.append(node.inputs[0])
        node = graph.producer(node.inputs[0])
    return out


def _is_zero(graph: Graph, value: str) -> bool:
    root = _chain(graph, value)[-1]
    return graph.is_constant(root) and not graph.initializers[root].any()


def _arange_along(graph: Graph, value: str, axis: int, rank: int) -> bool:
    """True when ``value`` (``rank`` axes and a trailing 1) holds each position's index along ``axis``: a ``Positions``
    (offset 0) of the axis' length, reshaped to lie along ``axis`` (every other axis 1), then broadcast (same rank) and
    given a trailing unit axis; no step may move the positions to another axis."""
    chain = _chain(graph, value)
    root = graph.producer(chain[-1])
    if root is None or not isinstance(root.op, Positions) or root.op.offset != 0 or len(chain) < 2:
        return False
    if graph.types[chain[-1]].shape != (graph.types[value].shape[axis],):
        return False
    for inner, outer in zip(reversed(chain[1:]), reversed(chain[:-1])):  # from the positions outwards
        before, after, step = graph.types[inner].shape, graph.types[outer].shape, graph.producer(outer)
        along = len(after) in (rank, rank + 1) and all(d == 1 for i, d in enumerate(after) if i != axis)
        unit_added = after == (*before, 1)
        if not (along or unit_added or (step is not None and isinstance(step.op, BroadcastTo) and len(after) == len(before))):
            return False
    return True


def is_identity_grid(graph: Graph, indices: str, shape: tuple) -> bool:
    """True when ``indices`` (``[*shape, len(shape)]``) is the index of every position of ``shape``: the concatenation of
    one ``arange`` per axis (a constant 0 for an axis of size 1), each broadcast over the others."""
    node = graph.producer(indices)
    rank = len(shape)
    if node is None or not isinstance(node.op, Concat) or node.op.axis % (rank + 1) != rank or len(node.inputs) != rank:
        return False
    for j, part in enumerate(node.inputs):
        if graph.types[part].shape[:rank] != tuple(shape):
            return False
        if not (_is_zero(graph, part) if shape[j] == 1 else _arange_along(graph, part, j, rank)):
            return False
    return True


def _match_scatter_all(graph: Graph, node: Node, ctx: PassContext) -> Node | Miss | None:
    op = node.op_as(Opaque)
    if (op.domain, op.op_type) != ("", "ScatterND") or len(node.inputs) != 3:
        return None
    proto = op.node_proto(node.inputs, node.outputs, node.name)
    if any(a.name == "reduction" and a.s not in (b"", b"none") for a in proto.attribute):
        return Miss(f"ScatterND {node.name!r} reduces into its data")
    data, indices, updates = node.inputs
    shape = graph.types[data].shape
    if graph.types[updates].shape != shape or graph.types[updates].dtype != graph.types[data].dtype:
        return Miss(f"ScatterND {node.name!r} writes a part of its data, not all of it")
    if not is_identity_grid(graph, indices, shape):
        return Miss(f"ScatterND {node.name!r}: its indices are not the grid of every position")
    return node


def _rewrite_scatter_all(graph: Graph, node: Node, ctx: PassContext) -> str:
    updates = node.inputs[2]
    graph.replace_uses(node.outputs[0], updates)
    graph.remove_node(node.name)
    return f"ScatterND over every position: its updates {updates!r}"


SCATTER_ALL_RULE = Rule("scatter_all", (Opaque,), _match_scatter_all, _rewrite_scatter_all)
"""``ScatterND(data, identity grid, updates)`` with updates of the data's shape -> ``updates``."""
