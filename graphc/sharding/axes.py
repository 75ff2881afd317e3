"""Which axis of every value carries attention heads: the analysis behind :func:`graphc.sharding.shard`.

Two axes are *linked* when splitting one into ``n`` contiguous chunks forces
the same split of the other, chunk ``s`` for chunk ``s``: an einsum label's
axes, an elementwise op's aligned axes (not broadcast ones), a transpose's
permuted axes, the leading axes of a reshape's merged groups (heads are the
major factor of ``heads * head_dim``), ``Repeat``'s axis (KV head ``g`` becomes
query heads ``g*G .. g*G+G-1``: consecutive, as ``repeat_interleave``), a
concat's other axes, and ``Attention``'s head axis across Q, K, V, the cache
and the output (query heads in consecutive groups per KV head).  Linked axes
form classes (union-find); the head classes are those holding an attention's
KV-head axis, or its query-head axis in the multi-query fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from graphc.attention_op import Attention
from graphc.dims import Dim, dim_prod, normalize_dim
from graphc.graph import Graph, Node
from graphc.ops import Concat, Einsum, GroupOp, Op, Repeat, Reshape, Transpose, op_registrar
from graphc.rotary import Rotary
from graphc.tensor_ops import Reduce, Slice

__all__ = ["AxisClasses", "link_axes", "ELEMENTWISE", "AXIS_RULES", "axis_rule"]

Axis = tuple[str, int]
ELEMENTWISE = GroupOp.AXIS_ALIGNED
"""Ops whose output element depends on the inputs' elements at the same (broadcast) index along the head axis."""


@dataclass
class AxisClasses:
    """Union-find over ``(value, axis)`` pairs, and the nodes whose axes no rule relates (their values cannot be split)."""

    parent: dict[Axis, Axis] = field(default_factory=dict)
    opaque: dict[str, str] = field(default_factory=dict)

    def find(self, a: Axis) -> Axis:
        """The representative of ``a``'s class."""
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: Axis, b: Axis) -> None:
        """Link ``a`` and ``b``."""
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra

    def members(self, root: Axis) -> list[Axis]:
        """Every ``(value, axis)`` in the class of ``root``."""
        r = self.find(root)
        return sorted(a for a in list(self.parent) if self.find(a) == r)


def _is_one(d: Dim) -> bool:
    return normalize_dim(d) == 1


AxisRule = Callable[[AxisClasses, Graph, Node], None]
AXIS_RULES: dict[type[Op], AxisRule] = {}
"""How each op type links the axes of its operands and results (an op without a rule is opaque: nothing links)."""


axis_rule = op_registrar(AXIS_RULES)
"""``@axis_rule(OpType, ...)`` registers the decorated function as those op types' axis-linking rule."""


@axis_rule(*ELEMENTWISE)
def _link_aligned(c: AxisClasses, g: Graph, node: Node) -> None:
    out = g.types[node.outputs[0]].shape
    for name in node.inputs:
        shape = g.types[name].shape
        lead = len(out) - len(shape)
        for i, d in enumerate(shape):
            if lead + i >= 0 and not _is_one(d) and not _is_one(out[lead + i]):
                c.union((name, i), (node.outputs[0], lead + i))


def _groups(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> list[tuple[int, int]]:
    """Pairs of leading axes of the groups of ``a`` and ``b`` whose products match (a reshape's merge/split groups)."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        while i < len(a) and _is_one(a[i]):
            i += 1
        while j < len(b) and _is_one(b[j]):
            j += 1
        if i == len(a) or j == len(b):
            break
        i0, j0 = i, j
        pa, pb = [a[i]], [b[j]]
        i, j = i + 1, j + 1
        while normalize_dim(dim_prod(pa)) != normalize_dim(dim_prod(pb)):
            if i < len(a) and (j >= len(b) or len(pa) <= len(pb)):
                pa.append(a[i])
                i += 1
            elif j < len(b):
                pb.append(b[j])
                j += 1
            else:
                return out
        out.append((i0, j0))
    return out


def _link_node(c: AxisClasses, g: Graph, node: Node) -> None:
    rule = AXIS_RULES.get(type(node.op))
    if rule is None:
        c.opaque[node.name] = node.op.kind
    else:
        rule(c, g, node)


@axis_rule(Einsum)
def _link_einsum(c: AxisClasses, g: Graph, node: Node) -> None:
    spec = node.op_as(Einsum).parsed
    for label in spec.labels:
        places = [(v, term.index(label)) for v, term in zip(node.inputs, spec.inputs) if label in term]
        if label in spec.output:
            places.append((node.outputs[0], spec.output.index(label)))
        places = [p for p in places if not _is_one(g.types[p[0]].shape[p[1]])]
        for p in places[1:]:
            c.union(places[0], p)


@axis_rule(Rotary)
def _link_rotary(c: AxisClasses, g: Graph, node: Node) -> None:  # x's axes map one to one; the positions carry no head axis
    x, out = node.inputs[0], node.outputs[0]
    for i in range(len(g.types[x].shape)):
        c.union((x, i), (out, i))


@axis_rule(Transpose)
def _link_transpose(c: AxisClasses, g: Graph, node: Node) -> None:
    for k, p in enumerate(node.op_as(Transpose).perm):
        c.union((node.inputs[0], p), (node.outputs[0], k))


@axis_rule(Reshape)
def _link_reshape(c: AxisClasses, g: Graph, node: Node) -> None:
    for i, j in _groups(tuple(g.types[node.inputs[0]].shape), tuple(g.types[node.outputs[0]].shape)):
        c.union((node.inputs[0], i), (node.outputs[0], j))


@axis_rule(Repeat)
def _link_repeat(c: AxisClasses, g: Graph, node: Node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    for i, d in enumerate(g.types[x].shape):
        if not _is_one(d):
            c.union((x, i), (out, i))


@axis_rule(Concat)
def _link_concat(c: AxisClasses, g: Graph, node: Node) -> None:
    rank = len(g.types[node.outputs[0]].shape)
    for i in range(rank):
        if i != node.op_as(Concat).axis % rank:
            for name in node.inputs:
                c.union((name, i), (node.outputs[0], i))


@axis_rule(Slice)
def _link_slice(c: AxisClasses, g: Graph, node: Node) -> None:  # RoPE's rotate-half: every axis but the sliced one maps one to one
    x, out = node.inputs[0], node.outputs[0]
    rank = len(g.types[x].shape)
    for i in range(rank):
        if i != node.op_as(Slice).axis % rank:
            c.union((x, i), (out, i))


@axis_rule(Reduce)
def _link_reduce(c: AxisClasses, g: Graph, node: Node) -> None:
    op, x, out = node.op_as(Reduce), node.inputs[0], node.outputs[0]
    reduced = op.normalized_axes(len(g.types[x].shape))
    kept = [i for i in range(len(g.types[x].shape)) if i not in reduced]
    for k, i in enumerate(kept):
        c.union((x, i), (out, i if op.keepdims else k))


@axis_rule(Attention)
def _link_attention(c: AxisClasses, g: Graph, node: Node) -> None:
    op = node.op_as(Attention)
    q, k = node.inputs[0], node.inputs[1]
    kv_values = [k, node.inputs[2], *node.inputs[3 + op.has_mask :], *node.outputs[1:]]
    for v in kv_values[1:]:
        c.union((k, 1), (v, 1))
    c.union((q, 1), (node.outputs[0], 1))
    if not _is_one(g.types[k].shape[1]):  # multi-query: K/V stay whole, only query heads may split
        c.union((q, 1), (k, 1))
    if op.has_mask and not _is_one(g.types[node.inputs[3]].shape[1]):
        c.union((q, 1), (node.inputs[3], 1))


def link_axes(graph: Graph) -> AxisClasses:
    """The linked-axis classes of ``graph`` (every node's rule applied once)."""
    c = AxisClasses()
    for node in graph.topological_order():
        _link_node(c, graph, node)
    return c
