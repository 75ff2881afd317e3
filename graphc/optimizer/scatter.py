"""Scatters whose indices are a grid of positions: one that writes every element is its updates, one that writes a
contiguous slab along one axis is a ``Concat`` of the data's rest and the updates.

transformers' masks before 4.58 are written in place (``mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(...)``), which
the exporters write as an ONNX ``ScatterND`` whose indices are the grid of every position of the slice.  graphc carries
ScatterND as an opaque node, so the mask behind it cannot be read as a causal mask and padding.  Where the slice is the
whole tensor (the updates have the data's shape) and the indices are the identity grid (component ``j`` is
``arange`` along axis ``j``, broadcast), the scatter replaces every element: :data:`SCATTER_ALL_RULE` reads it as its
updates, and the mask analysis sees the mask as written.

Tensors assembled in place (``k = x.new_empty(...); k[..., :n].copy_(a); k[..., n:].copy_(b)``, as transformers'
DeepSeek-V3 attention builds its keys) export as ScatterNDs that each write a slab: indices that are ``arange(a, a+n)``
along one axis and the identity along the others (the legacy exporter's grid), or a constant ``[n, 1]`` column of
``a..a+n-1`` (the dynamo exporter's, on axis 0).  :data:`SCATTER_SLAB_RULE` reads such a scatter as
``Concat(data[:a], updates, data[a+n:])`` along that axis, and :data:`SLICE_OF_CONCAT_RULE` reads a slice that falls
in one operand of a Concat as a slice of that operand, and :data:`CONCAT_OF_TRANSPOSES_RULE` moves one permutation
shared by every operand below the Concat (the dynamo exporter scatters into a transposed tensor); between them the
assembled tensor becomes a Concat of its parts that the einsum reading it takes in its own layout.
"""

from __future__ import annotations

import numpy as np

from graphc.dims import Dim, dim_add, dim_is_nonnegative, dim_sub, normalize_dim
from graphc.graph import Graph, Node, ValueLike
from graphc.opaque import Opaque
from graphc.ops import Concat, Repeat, Reshape, Transpose
from graphc.rotary import Positions
from graphc.tensor_ops import Arange, BroadcastTo, Slice

from .infra import PassContext, Rule
from .patterns import Miss
from .uses import only_reader, remove_if_dead

__all__ = ["SCATTER_ALL_RULE", "SCATTER_SLAB_RULE", "SLICE_OF_CONCAT_RULE", "CONCAT_OF_TRANSPOSES_RULE", "is_identity_grid", "grid_starts"]


def _chain(graph: Graph, value: str) -> list[str]:
    """``value`` and the values it is a Reshape, BroadcastTo or Repeat of, outermost first, down to the first that is
    not one (a Repeat copies along its axis: :func:`_start_along` allows it only off the positions' axis)."""
    out = [value]
    node = graph.producer(value)
    while node is not None and isinstance(node.op, (Reshape, BroadcastTo, Repeat)):
        out.append(node.inputs[0])
        node = graph.producer(node.inputs[0])
    return out


def _is_zero(graph: Graph, value: str) -> bool:
    root = _chain(graph, value)[-1]
    return graph.is_constant(root) and not graph.initializers[root].any()


def _start_along(graph: Graph, value: str, axis: int, rank: int) -> Dim | None:
    """``a`` when ``value`` (``rank`` axes and a trailing 1) holds ``a + i`` at index ``i`` of ``axis`` and is constant
    along every other axis, else None.  The root is a ``Positions`` or an ``Arange`` of the axis' length (its offset or start is ``a``) or a
    constant of consecutive integers, 1-D or already lying along ``axis`` (every other axis 1); each step outwards is a Reshape that keeps every
    other axis 1, a trailing unit axis, or a broadcast (BroadcastTo, or a Repeat off ``axis``) of the same rank."""
    chain = _chain(graph, value)
    length = graph.types[value].shape[axis]
    root, start = chain[-1], None
    producer = graph.producer(root)
    if producer is not None and isinstance(producer.op, Positions) and graph.types[root].shape == (length,):
        start = producer.op.offset
    elif producer is not None and isinstance(producer.op, Arange) and graph.types[root].shape == (length,):
        start = producer.op.start
    elif graph.is_constant(root) and isinstance(length, int):
        flat = np.asarray(graph.initializers[root])
        placed = flat.ndim == 1 or (flat.ndim in (rank, rank + 1) and all(d == 1 for i, d in enumerate(flat.shape) if i != axis))
        if flat.dtype.kind in "iu" and flat.size == length and placed:  # 1-D, or already along ``axis``
            flat = flat.reshape(-1)
            if length and np.array_equal(flat, flat[0] + np.arange(length)):
                start = int(flat[0])
    if start is None or len(chain) < 2:
        return None
    for inner, outer in zip(reversed(chain[1:]), reversed(chain[:-1])):  # from the root outwards
        before, after, step = graph.types[inner].shape, graph.types[outer].shape, graph.producer(outer)
        along = len(after) in (rank, rank + 1) and all(d == 1 for i, d in enumerate(after) if i != axis)
        unit_added = after == (*before, 1)
        broadcast = (
            step is not None
            and len(after) == len(before)
            and (
                isinstance(step.op, BroadcastTo)
                or (isinstance(step.op, Repeat) and len(after) in (rank, rank + 1) and step.op.axis % len(after) != axis)
            )
        )
        if not (along or unit_added or broadcast):
            return None
    return start


def grid_starts(graph: Graph, indices: str, shape: tuple) -> list[Dim] | None:
    """``[a_0, ..]`` when ``indices`` (``[*shape, len(shape)]``) is a grid of positions: component ``j`` is
    ``a_j + arange(shape[j])`` along axis ``j`` (a constant 0 for an axis of size 1), broadcast over the others; else None."""
    node = graph.producer(indices)
    rank = len(shape)
    if node is None or not isinstance(node.op, Concat) or node.op.axis % (rank + 1) != rank or len(node.inputs) != rank:
        return None
    starts: list[Dim] = []
    for j, part in enumerate(node.inputs):
        if graph.types[part].shape[:rank] != tuple(shape):
            return None
        if shape[j] == 1 and _is_zero(graph, part):
            starts.append(0)
            continue
        start = _start_along(graph, part, j, rank)
        if start is None:
            return None
        starts.append(start)
    return starts


def is_identity_grid(graph: Graph, indices: str, shape: tuple) -> bool:
    """True when ``indices`` (``[*shape, len(shape)]``) is the index of every position of ``shape``: the concatenation of
    one ``arange`` per axis (a constant 0 for an axis of size 1), each broadcast over the others."""
    starts = grid_starts(graph, indices, shape)
    return starts is not None and all(normalize_dim(a) == 0 for a in starts)


def _plain_scatter(node: Node) -> bool | Miss:
    """True for an ONNX ``ScatterND`` that overwrites (no reduction), False for any other opaque op, a Miss for one that reduces."""
    op = node.op_as(Opaque)
    if (op.domain, op.op_type) != ("", "ScatterND") or len(node.inputs) != 3:
        return False
    proto = op.node_proto(node.inputs, node.outputs, node.name)
    if any(a.name == "reduction" and a.s not in (b"", b"none") for a in proto.attribute):
        return Miss(f"ScatterND {node.name!r} reduces into its data")
    return True


def _match_scatter_all(graph: Graph, node: Node, ctx: PassContext) -> Node | Miss | None:
    plain = _plain_scatter(node)
    if plain is not True:
        return plain or None
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


def _slab(graph: Graph, node: Node) -> tuple[int, Dim, Dim] | str:
    """``(axis, start, length)`` of the slab a ScatterND writes, or why it is not one."""
    data, indices, updates = node.inputs
    shape, written = graph.types[data].shape, graph.types[updates].shape
    if graph.types[updates].dtype != graph.types[data].dtype or len(written) != len(shape):
        return "its updates are not a block of its data"
    if graph.is_constant(indices) and graph.types[indices].shape == (written[0], 1) and isinstance(written[0], int):
        column = np.asarray(graph.initializers[indices]).reshape(-1)  # the dynamo exporter's form: rows of axis 0
        if written[1:] != shape[1:] or not written[0] or not np.array_equal(column, column[0] + np.arange(written[0])):
            return "its constant indices are not consecutive rows of axis 0"
        return 0, int(column[0]), written[0]
    starts = grid_starts(graph, indices, written)
    if starts is None:
        return "its indices are not a grid of positions"
    partial = [j for j in range(len(shape)) if normalize_dim(starts[j]) != 0 or written[j] != shape[j]]
    if len(partial) != 1:
        return f"it writes a block partial on {len(partial)} axes, not a slab of one"
    return partial[0], starts[partial[0]], written[partial[0]]


def _match_scatter_slab(graph: Graph, node: Node, ctx: PassContext) -> tuple[Node, tuple[int, Dim, Dim]] | Miss | None:
    plain = _plain_scatter(node)
    if plain is not True:
        return plain or None
    slab = _slab(graph, node)
    if isinstance(slab, str):
        return Miss(f"ScatterND {node.name!r}: {slab}")
    axis, start, length = slab
    end = dim_add(start, length)
    if not (dim_is_nonnegative(start) and dim_is_nonnegative(dim_sub(graph.types[node.inputs[0]].shape[axis], end))):
        return Miss(f"ScatterND {node.name!r}: its slab {start}..{end} may leave axis {axis}")
    return node, slab


def _rewrite_scatter_slab(graph: Graph, m: tuple[Node, tuple[int, Dim, Dim]], ctx: PassContext) -> str:
    node, (axis, start, length) = m
    data, _, updates = node.inputs
    size, end = graph.types[data].shape[axis], dim_add(start, length)
    parts: list[ValueLike] = []
    if normalize_dim(start) != 0:
        parts.append(graph.add_node(Slice(axis, 0, start), [data], graph.fresh_name(f"{node.output}_before"), before=node.name))
    parts.append(updates)
    if normalize_dim(dim_sub(size, end)) != 0:
        parts.append(graph.add_node(Slice(axis, end, size), [data], graph.fresh_name(f"{node.output}_after"), before=node.name))
    joined = graph.add_node(Concat(axis), parts, graph.fresh_name(f"{node.output}_slabs"), before=node.name) if len(parts) > 1 else updates
    graph.replace_uses(node.outputs[0], joined)
    graph.remove_node(node.name)
    return f"ScatterND of {updates!r} into {start}..{end} of axis {axis}: a Concat of the data's rest and the updates"


SCATTER_SLAB_RULE = Rule("scatter_slab", (Opaque,), _match_scatter_slab, _rewrite_scatter_slab)
"""``ScatterND(data, slab [a, a+n) of one axis, updates)`` -> ``Concat(data[:a], updates, data[a+n:])``."""


def _operand_span(graph: Graph, node: Node) -> tuple[str, Dim] | None:
    """The Concat operand a Slice of it falls in, and that operand's start along the axis."""
    op = node.op_as(Slice)
    producer = graph.producer(node.inputs[0])
    if producer is None or not isinstance(producer.op, Concat) or op.step != 1:
        return None
    rank = graph.types[node.inputs[0]].rank
    if producer.op.axis % rank != op.axis % rank:
        return None
    offset: Dim = 0
    for part in producer.inputs:
        end = dim_add(offset, graph.types[part].shape[op.axis % rank])
        if dim_is_nonnegative(dim_sub(op.start, offset)) and dim_is_nonnegative(dim_sub(end, op.stop)):
            return part, offset
        offset = end
    return None


def _match_slice_of_concat(graph: Graph, node: Node, ctx: PassContext) -> tuple[Node, str, Dim] | None:
    span = _operand_span(graph, node)
    return None if span is None else (node, *span)


def _rewrite_slice_of_concat(graph: Graph, m: tuple[Node, str, Dim], ctx: PassContext) -> str:
    node, part, offset = m
    op = node.op_as(Slice)
    inner = Slice(op.axis, dim_sub(op.start, offset), dim_sub(op.stop, offset))
    out = graph.add_node(inner, [part], graph.fresh_name(f"{node.output}_part"), before=node.name)
    concat = node.inputs[0]
    graph.replace_uses(node.output, out)
    graph.remove_node(node.name)
    remove_if_dead(graph, concat)  # its operands may now have one reader (concat_of_transposes asks)
    return f"a slice of one Concat operand: {inner.start}..{inner.stop} of {part!r}"


SLICE_OF_CONCAT_RULE = Rule("slice_of_concat", (Slice,), _match_slice_of_concat, _rewrite_slice_of_concat)
"""``Concat(.., x, ..)[a:b]`` within ``x`` -> ``x[a-o:b-o]`` (a whole ``x`` then goes with ``remove_whole_slice``)."""


def _match_concat_of_transposes(graph: Graph, node: Node, ctx: PassContext) -> Node | None:
    producers = [graph.producer(x) for x in node.inputs]
    if len(producers) < 2 or not all(p is not None and isinstance(p.op, Transpose) for p in producers):
        return None
    perms = {p.op_as(Transpose).perm for p in producers if p is not None}
    if len(perms) != 1 or not all(only_reader(graph, x, node.name) for x in node.inputs):
        return None
    return node


def _rewrite_concat_of_transposes(graph: Graph, node: Node, ctx: PassContext) -> str:
    transposes = [graph.nodes[x] for x in node.inputs]
    perm = transposes[0].op_as(Transpose).perm
    axis = perm[node.op_as(Concat).axis % len(perm)]
    inner = graph.add_node(Concat(axis), [t.inputs[0] for t in transposes], graph.fresh_name(f"{node.output}_inner"), before=node.name)
    graph.redefine(node.name, Transpose(perm), [inner])
    for t in transposes:
        graph.remove_node(t.name)
    return f"one Transpose{list(perm)} below the Concat of {len(transposes)} transposed operands"


CONCAT_OF_TRANSPOSES_RULE = Rule("concat_of_transposes", (Concat,), _match_concat_of_transposes, _rewrite_concat_of_transposes)
"""``Concat(T(a), T(b), axis)`` with one permutation ``T`` -> ``T(Concat(a, b, perm[axis]))``."""
