"""GQA's KV-head repeat becomes a grouped einsum; the group axis then folds into the GEMM rows.

``fuse_repeat_kv``: a ``Repeat(axis, g)`` of K (or V) read by pairwise einsums
is removed.  In each reader, the repeated axis's label ``h`` becomes ``n`` on the
un-repeated K/V and ``n j`` on the other operand, which a Reshape splits from
``[.., Hkv*g, ..]`` to ``[.., Hkv, g, ..]``: query head ``h = n*g + j`` reads KV
head ``n = h // g``, exactly the repeat-interleave order.  ``bhqd,bhkd->bhqk``
becomes ``bnjqd,bnkd->bnjqk`` and a Reshape merges the heads back, so no copy
of K/V remains.

``fold_groups``: two adjacent free labels of an operand that a Reshape produced
(the group ``j`` and the query sequence ``q``) merge into one, so a decode step
is one GEMM over ``g`` rows per KV head instead of ``g`` GEMVs.  It applies only
where the einsum's result is read by Reshapes alone, so the reshapes it adds
compose with existing ones and the node count does not grow.

``hoist_elementwise``: scale, unary ops, masks and softmax move above the
Reshape/Transpose in front of them when that layout change leaves the axes they
act on alone; the head merge after the grouped QK^T then meets the head split
before the grouped PV and both disappear.
"""

from __future__ import annotations

import re

from graphc.dims import dim_mul
from graphc.einsum_spec import fresh_labels
from graphc.graph import Graph, Node
from graphc.ops import CausalMask, Einsum, GroupOp, Repeat, Reshape, Softmax, Transpose

from .cleanup import only_reader, remove_if_dead
from .infra import Miss, PassContext, Rule

__all__ = ["EXPAND_REPEAT_RULE", "FUSE_REPEAT_RULE", "ABOVE_REPEAT_RULE", "FOLD_RULE", "HOIST_RULE", "grouped_name", "folded_name"]

_LAYOUT = re.compile(r"^(.*)_BH([A-Z]+)$")


def grouped_name(name: str) -> str:
    """``q_BHSD`` -> ``q_BHkvGSD`` (layout-carrying names); other names get ``_grouped``."""
    m = _LAYOUT.match(name)
    return f"{m.group(1)}_BHkvG{m.group(2)}" if m else f"{name}_grouped"


def folded_name(name: str) -> str:
    """``q_BHkvGSD`` -> ``q_BHkvMD`` (M: group x query rows); other names get ``_fold``."""
    return name.replace("_BHkvGS", "_BHkvM", 1) if "_BHkvGS" in name else f"{name}_fold"


# --------------------------------------------------------------- expand-form repeat


def _match_expand_repeat(graph: Graph, node: Node, ctx: PassContext) -> object:
    """``Reshape(Repeat(Reshape(x, insert 1 at a), a, n), merge a-1 and a)``: the exporters' ``repeat_kv`` (Unsqueeze, Expand, Reshape)."""
    rep = graph.producer(node.inputs[0])
    if rep is None or not isinstance(rep.op, Repeat):
        return None
    ins = graph.producer(rep.inputs[0])
    if ins is None or not isinstance(ins.op, Reshape):
        return Miss(f"the repeat {rep.name!r} does not read a reshape that inserts its axis")
    x = ins.inputs[0]
    shape = graph.types[x].shape
    a = rep.op.axis % (len(shape) + 1)
    n = rep.op.repeats
    if a == 0 or graph.types[ins.name].shape != shape[:a] + (1,) + shape[a:]:
        return Miss(f"{ins.name!r} does not insert a size-1 axis at {a} of {x!r} after another axis")
    if graph.types[node.name].shape != shape[: a - 1] + (dim_mul(shape[a - 1], n),) + shape[a:]:
        return Miss(f"{node.name!r} does not merge the repeated axis into the axis before it")
    if not only_reader(graph, rep.name, node.name):
        return Miss(f"the repeated value {rep.name!r} has other readers")
    return node, rep, ins, x, a - 1, n


def _rewrite_expand_repeat(graph: Graph, m: tuple[Node, Node, Node, str, int, int], ctx: PassContext) -> str:
    node, rep, ins, x, axis, n = m
    graph.redefine(node.name, Repeat(axis, n), [x])
    remove_if_dead(graph, rep.name)
    remove_if_dead(graph, ins.name)
    return f"unsqueeze/expand/reshape of {x!r} is a repeat-interleave of axis {axis} by {n}"


EXPAND_REPEAT_RULE = Rule("expand_to_repeat", (Reshape,), _match_expand_repeat, _rewrite_expand_repeat)
"""The Expand form of ``repeat_kv`` becomes one ``Repeat`` (then grouped by ``fuse_repeat_kv``)."""


# --------------------------------------------------------------- repeat fusion


def _match_fuse(graph: Graph, node: Node, ctx: PassContext) -> object:
    op = node.op_as(Repeat)
    if op.repeats == 1:
        return None
    if graph.is_output(node.name):
        return Miss("its value is a graph output, so the repeated tensor must be materialised")
    readers = graph.consumers(node.name)
    if not readers:
        return None
    axis = op.axis % graph.types[node.inputs[0]].rank
    plans = []
    for r in readers:
        if not isinstance(r.op, Einsum):
            return Miss(f"reader {r.name!r} is a {r.op.kind}, not an einsum")
        spec = r.op.parsed
        if len(spec.inputs) != 2:
            return Miss(f"reader {r.name!r} has {len(spec.inputs)} operands; only pairwise einsums are grouped")
        if r.inputs.count(node.name) != 1:
            return Miss(f"reader {r.name!r} reads the repeated value twice")
        pos = r.inputs.index(node.name)
        h = spec.inputs[pos][axis]
        if h not in spec.inputs[1 - pos]:
            return Miss(
                f"in {r.name!r} ({spec}) the repeated axis {axis} (label {h!r}) is not shared with the other operand, so there is no axis to group"
            )
        plans.append((r.name, pos, h))
    return node, axis, plans


def _rewrite_fuse(graph: Graph, m: tuple[Node, int, list[tuple[str, int, str]]], ctx: PassContext) -> str:
    node, axis, plans = m
    src = node.inputs[0]
    kv = graph.types[src].shape[axis]
    g = node.op_as(Repeat).repeats
    done = []
    for name, pos, h in plans:
        reader = graph.nodes[name]
        spec = reader.op_as(Einsum).parsed
        n, j = (c for c in fresh_labels(spec.labels, 2))
        other = 1 - pos
        terms = list(spec.inputs)
        hi = terms[other].index(h)
        terms[pos] = terms[pos].replace(h, n)
        terms[other] = terms[other].replace(h, n + j)
        out = spec.output.replace(h, n + j)
        o_name = reader.inputs[other]
        o_shape = graph.types[o_name].shape
        split = graph.insert_before(name, Reshape(o_shape[:hi] + (kv, g) + o_shape[hi + 1 :]), [o_name], grouped_name(o_name))
        operands = [src, src]
        operands[other] = split.name
        new_spec = ",".join(terms) + "->" + out
        if h in spec.output:
            e = graph.insert_before(name, Einsum(new_spec), operands, grouped_name(name))
            graph.redefine(name, Reshape(graph.types[name].shape), [e])
        else:
            graph.redefine(name, Einsum(new_spec), operands)
        done.append(f"{name}: {spec} -> {new_spec}")
    remove_if_dead(graph, node.name)
    return f"removed repeat of {src!r} by {g} on axis {axis}; grouped " + "; ".join(done)


# ----------------------------------------------------------------- group fold


def _match_fold(graph: Graph, node: Node, ctx: PassContext) -> object:
    spec = node.op_as(Einsum).parsed
    if len(spec.inputs) != 2:
        return None
    readers = graph.consumers(node.name)
    if graph.is_output(node.name) or not readers or not all(isinstance(r.op, Reshape) for r in readers):
        return None  # the result's un-fold reshape would not compose with a reshape after it
    for pos in (0, 1):
        term, other = spec.inputs[pos], spec.inputs[1 - pos]
        prod = graph.producer(node.inputs[pos])
        if prod is None or not isinstance(prod.op, Reshape):
            continue
        for i in range(len(term) - 1):
            a, b = term[i], term[i + 1]
            if a in other or b in other or a not in spec.output or b not in spec.output:
                continue
            if spec.output.index(b) == spec.output.index(a) + 1:
                return node, pos, i
    return None


def _rewrite_fold(graph: Graph, m: tuple[Node, int, int], ctx: PassContext) -> str:
    node, pos, i = m
    spec = node.op_as(Einsum).parsed
    term = spec.inputs[pos]
    a, b = term[i], term[i + 1]
    x = node.inputs[pos]
    shape = graph.types[x].shape
    merged = graph.insert_before(node.name, Reshape(shape[:i] + (dim_mul(shape[i], shape[i + 1]),) + shape[i + 2 :]), [x], folded_name(x))
    terms = list(spec.inputs)
    terms[pos] = term.replace(b, "")
    new_spec = ",".join(terms) + "->" + spec.output.replace(b, "")
    operands = list(node.inputs)
    operands[pos] = merged.name
    e = graph.insert_before(node.name, Einsum(new_spec), operands, folded_name(node.name))
    graph.redefine(node.name, Reshape(graph.types[node.name].shape), [e])
    return f"folded labels {a}{b} into one GEMM axis: {spec} -> {new_spec}"


# ---------------------------------------------------------- elementwise hoisting


def _trailing_axes(node: Node, rank: int) -> int | None:
    """How many trailing axes ``node``'s op depends on (None: not an elementwise op)."""
    op = node.op
    if isinstance(op, GroupOp.POINTWISE):
        return 0
    if isinstance(op, CausalMask):
        return 2
    if isinstance(op, Softmax):
        return rank - (op.axis % rank)
    return None


def _preserves_trailing(graph: Graph, layout: Node, k: int) -> bool:
    src, dst = graph.types[layout.inputs[0]].shape, graph.types[layout.name].shape
    if k == 0:
        return True
    if isinstance(layout.op, Transpose):
        r = len(layout.op.perm)
        return layout.op.perm[r - k :] == tuple(range(r - k, r))
    return len(src) >= k and len(dst) >= k and src[-k:] == dst[-k:]


def _match_hoist(graph: Graph, node: Node, ctx: PassContext) -> object:
    layout = graph.producer(node.inputs[0])
    if layout is None or not isinstance(layout.op, (Reshape, Transpose)):
        return None
    k = _trailing_axes(node, graph.types[node.name].rank)
    if isinstance(layout.op, Transpose) and k != 0:
        return None
    if not _preserves_trailing(graph, layout, k or 0):
        return Miss(f"{layout.op.kind} {layout.name!r} changes the last {k} axes that {node.op.kind} acts on")
    if not only_reader(graph, layout.name, node.name):
        return Miss(f"{layout.name!r} has other readers")
    return node, layout


def _rewrite_hoist(graph: Graph, m: tuple[Node, Node], ctx: PassContext) -> str:
    node, layout = m
    op = node.op
    kind = op.kind
    if isinstance(op, Softmax):
        op = Softmax(op.axis - graph.types[node.name].rank if op.axis >= 0 else op.axis)
    moved = graph.insert_before(layout.name, op, [layout.inputs[0]], f"{layout.inputs[0]}_{node.op.kind.lower()}")
    graph.redefine(node.name, layout.op, [moved])
    remove_if_dead(graph, layout.name)
    return f"moved {kind} above {layout.op.kind} {layout.name!r}"


def _match_above_repeat(graph: Graph, node: Node, ctx: PassContext) -> object:
    """A Scale or unary op on a repeated K/V (sdpa's ``k * sqrt(scale)`` after ``repeat_interleave``) moves above the
    Repeat: it then runs on the un-repeated tensor, and the Repeat meets the einsum that groups it."""
    repeat = graph.producer(node.inputs[0])
    if repeat is None or not isinstance(repeat.op, Repeat):
        return None
    if not only_reader(graph, repeat.name, node.name):
        return Miss(f"{repeat.name!r} has other readers")
    return node, repeat


FUSE_REPEAT_RULE = Rule("fuse_repeat_kv", (Repeat,), _match_fuse, _rewrite_fuse)
ABOVE_REPEAT_RULE = Rule("hoist_above_repeat", GroupOp.POINTWISE, _match_above_repeat, _rewrite_hoist)
FOLD_RULE = Rule("fold_groups", (Einsum,), _match_fold, _rewrite_fold)


HOIST_RULE = Rule("hoist_elementwise", GroupOp.POINTWISE + GroupOp.LAST_AXES, _match_hoist, _rewrite_hoist)
