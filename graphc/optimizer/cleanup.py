"""Classic clean-up passes: dead code, common subexpressions, layout no-ops, constant folding.

Rules never rename a graph output: a rewrite that would replace an output value
by another value declines with a :class:`~graphc.optimizer.infra.Miss`.
"""

from __future__ import annotations


from graphc.dims import dim_prod, eval_shape, is_static, normalize_dim
from graphc.graph import Graph, Node
from graphc.numerics import contiguous
from graphc.opaque import Opaque
from graphc.tensor_ops import Slice
from graphc.ops import CausalMask, Einsum, Op, Repeat, Reshape, Transpose

from .infra import Miss, Pass, PassContext, Rule
from .patterns import Bindings, Pat, pattern_rule
from .uses import only_reader, remove_if_dead

__all__ = [
    "remove_if_dead",
    "mask_hides_nothing",
    "only_reader",
    "dead_code_elimination",
    "common_subexpression_elimination",
    "LAYOUT_RULES",
    "CONSTANT_FOLD_LIMIT",
    "CONSTANT_FOLD_RULE",
]

CONSTANT_FOLD_LIMIT = 1 << 26
"""Largest result (in elements) that constant folding computes ahead of time."""


def _bypass(graph: Graph, node: Node, rule: str) -> Miss | Node:
    """Check that ``node`` (an identity) can be removed by sending its readers to its input."""
    if graph.is_output(node.name):
        return Miss(f"{rule}: {node.name!r} is a graph output, so it is kept under its name")
    return node


def _do_bypass(graph: Graph, node: Node, ctx: PassContext) -> str:
    graph.replace_uses(node.name, node.inputs[0])
    remove_if_dead(graph, node.name)
    return f"removed; readers now use {node.inputs[0]!r}"


# ---------------------------------------------------------------- layout rules


def _match_noop_reshape(graph: Graph, node: Node, ctx: PassContext) -> object:
    if graph.types[node.inputs[0]].shape != graph.types[node.name].shape:
        return None
    src = node.inputs[0]
    if graph.is_output(node.name) and graph.producer(src) is not None and only_reader(graph, src, node.name):
        return node  # the output keeps its name: its input's node takes it over
    return _bypass(graph, node, "identity reshape")


def _do_remove_identity(graph: Graph, node: Node, ctx: PassContext) -> str:
    src = node.inputs[0]
    if graph.is_output(node.name):
        graph.substitute(node.name, {node.name: src})
        return f"removed; {src!r} now carries the name {node.name!r}"
    return _do_bypass(graph, node, ctx)


RESHAPE_OF_RESHAPE = Pat.op(Reshape, name="outer", inputs=(Pat.op(Reshape, name="inner", inputs=(Pat.var("x"),)),))


def _rewrite_reshape_chain(graph: Graph, b: Bindings, ctx: PassContext) -> str:
    outer, inner, x = b["outer"], b["inner"], b["x"]
    graph.redefine(outer.name, outer.op, [x])
    remove_if_dead(graph, inner.name)
    return f"reshape of reshape {inner.name!r} now reads {x!r} directly"


def _match_identity_transpose(graph: Graph, node: Node, ctx: PassContext) -> object:
    perm = node.op_as(Transpose).perm
    return _bypass(graph, node, "identity transpose") if perm == tuple(range(len(perm))) else None


TRANSPOSE_OF_TRANSPOSE = Pat.op(Transpose, name="outer", inputs=(Pat.op(Transpose, name="inner", inputs=(Pat.var("x"),)),))


def _rewrite_transpose_chain(graph: Graph, b: Bindings, ctx: PassContext) -> str:
    outer, inner = b["outer"], b["inner"]
    p1, p2 = inner.op_as(Transpose).perm, outer.op_as(Transpose).perm
    graph.redefine(outer.name, Transpose(tuple(p1[j] for j in p2)), [b["x"]])
    remove_if_dead(graph, inner.name)
    return f"composed with transpose {inner.name!r}"


def _match_transpose_in_merge(graph: Graph, node: Node, ctx: PassContext) -> object:
    """``Reshape(split) . Transpose . Reshape(merge)`` where the merge joins leading axes, the transpose leaves the
    merged axis first, and the split restores those leading axes: one Transpose of the original (dynamo writes K^T of
    a ``[b, h, s, d]`` tensor as ``[b*h, s, d]`` -> ``[b*h, d, s]`` -> ``[b, h, d, s]``)."""
    t = graph.producer(node.inputs[0])
    if t is None or not isinstance(t.op, Transpose) or t.op.perm[:1] != (0,):
        return None
    merge = graph.producer(t.inputs[0])
    if merge is None or not isinstance(merge.op, Reshape) or not only_reader(graph, merge.name, t.name) or not only_reader(graph, t.name, node.name):
        return None
    src, merged, out = graph.types[merge.inputs[0]].shape, graph.types[merge.name].shape, graph.types[node.name].shape
    lead = len(src) - len(merged) + 1
    if lead < 2 or tuple(src[lead:]) != tuple(merged[1:]) or tuple(out[:lead]) != tuple(src[:lead]):
        return None
    if normalize_dim(dim_prod(src[:lead])) != normalize_dim(merged[0]) or len(out) != len(src):
        return None
    return node, t, merge, lead


def _rewrite_transpose_in_merge(graph: Graph, m: tuple[Node, Node, Node, int], ctx: PassContext) -> str:
    node, t, merge, lead = m
    perm = tuple(range(lead)) + tuple(lead - 1 + p for p in t.op_as(Transpose).perm[1:])
    graph.redefine(node.name, Transpose(perm), [merge.inputs[0]])
    remove_if_dead(graph, t.name)
    remove_if_dead(graph, merge.name)
    return f"merge {merge.name!r}, transpose {t.name!r} and split are one transpose {list(perm)}"


def _match_unit_repeat(graph: Graph, node: Node, ctx: PassContext) -> object:
    return _bypass(graph, node, "repeat by 1") if node.op_as(Repeat).repeats == 1 else None


def _match_whole_slice(graph: Graph, node: Node, ctx: PassContext) -> object:
    """``x[0:n]`` along an axis of size ``n``, step 1: ``x`` itself (an import's bound that unification made the whole axis)."""
    op = node.op_as(Slice)
    shape = graph.types[node.inputs[0]].shape
    whole = op.step == 1 and normalize_dim(op.start) == 0 and normalize_dim(op.stop) == normalize_dim(shape[op.axis % len(shape)])
    return _bypass(graph, node, "slice of the whole axis") if whole else None


def mask_hides_nothing(graph: Graph, node: Node) -> bool:
    """True when a CausalMask provably hides no key: a static key length Sk, an offset >= Sk - 1, and no window
    that hides a key (the last query's window must still reach key 0)."""
    shape = graph.types[node.inputs[0]].shape
    return node.op_as(CausalMask).visibility.hides_nothing(shape[-2], shape[-1])


def _match_vacuous_mask(graph: Graph, node: Node, ctx: PassContext) -> object:
    return _bypass(graph, node, "vacuous causal mask") if mask_hides_nothing(graph, node) else None


def _match_transpose_into_einsum(graph: Graph, node: Node, ctx: PassContext) -> object:
    for pos, name in enumerate(node.inputs):
        prod = graph.producer(name)
        if prod is not None and isinstance(prod.op, Transpose) and node.inputs.count(name) == 1:
            return node, pos
    return None


def _rewrite_transpose_into_einsum(graph: Graph, m: tuple[Node, int], ctx: PassContext) -> str:
    node, pos = m
    t = graph.nodes[node.inputs[pos]]
    spec = node.op_as(Einsum).parsed
    term = spec.inputs[pos]
    new_term = [""] * len(term)
    for i, p in enumerate(t.op_as(Transpose).perm):
        new_term[p] = term[i]
    terms = list(spec.inputs)
    terms[pos] = "".join(new_term)
    inputs = list(node.inputs)
    inputs[pos] = t.inputs[0]
    new_spec = ",".join(terms) + "->" + spec.output
    graph.redefine(node.name, Einsum(new_spec), inputs)
    remove_if_dead(graph, t.name)
    return f"absorbed transpose {t.name!r}: {spec} -> {new_spec}"


TRANSPOSE_OF_EINSUM = Pat.op(Transpose, name="t", inputs=(Pat.op(Einsum, name="e", single_use=True),))
"""A transpose of an einsum read by nothing else (with other readers the einsum's layout stays: a Miss)."""


def _rewrite_einsum_into_transpose(graph: Graph, b: Bindings, ctx: PassContext) -> str:
    node, e = b["t"], b["e"]
    spec = e.op_as(Einsum).parsed
    out = "".join(spec.output[p] for p in node.op_as(Transpose).perm)
    new_spec = ",".join(spec.inputs) + "->" + out
    graph.redefine(node.name, Einsum(new_spec), e.inputs)
    remove_if_dead(graph, e.name)
    return f"transpose absorbed into einsum {e.name!r}: {new_spec}"


LAYOUT_RULES = (
    Rule("remove_identity_reshape", (Reshape,), _match_noop_reshape, _do_remove_identity),
    pattern_rule("fold_reshape_chain", RESHAPE_OF_RESHAPE, _rewrite_reshape_chain),
    Rule("remove_identity_transpose", (Transpose,), _match_identity_transpose, _do_bypass),
    pattern_rule("fold_transpose_chain", TRANSPOSE_OF_TRANSPOSE, _rewrite_transpose_chain),
    Rule("fold_transpose_in_merge", (Reshape,), _match_transpose_in_merge, _rewrite_transpose_in_merge),
    Rule("remove_unit_repeat", (Repeat,), _match_unit_repeat, _do_bypass),
    Rule("remove_whole_slice", (Slice,), _match_whole_slice, _do_bypass),
    Rule("remove_vacuous_causal_mask", (CausalMask,), _match_vacuous_mask, _do_bypass),
    Rule("fold_transpose_into_einsum", (Einsum,), _match_transpose_into_einsum, _rewrite_transpose_into_einsum),
    pattern_rule("fold_einsum_into_transpose", TRANSPOSE_OF_EINSUM, _rewrite_einsum_into_transpose),
)


# --------------------------------------------------------------- whole-graph passes


def _dce(graph: Graph, ctx: PassContext) -> bool:
    live: set[str] = set()
    stack = list(graph.outputs)
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        p = graph.producer(n)
        if p is not None:
            stack.extend(p.inputs)
            live.update(p.outputs)
    dead = [n.name for n in graph.topological_order() if not any(o in live for o in n.outputs)]
    unused = [n for n in graph.initializers if n not in live]
    for n in reversed(dead):
        graph.remove_node(n)
    for n in unused:
        graph.remove_initializer(n)
    if dead or unused:
        ctx.fired("dce", ", ".join(dead + unused), f"removed {len(dead)} dead node(s), {len(unused)} unused initializer(s)")
    return bool(dead or unused)


dead_code_elimination = Pass("dce", "remove nodes and initializers that no output depends on", _dce)


def _cse_key(graph: Graph, node: Node) -> tuple[object, tuple[object, ...]]:
    """What makes two nodes compute the same: their op and operands, or the operands' shapes for an op that reads only
    those (``Positions`` of layer 3's cache and of layer 5's: one node, and everything computed from it merges too)."""
    if node.op.reads_shape_only:
        return node.op, tuple(graph.types[i].shape for i in node.inputs)
    return node.op, node.inputs


def _cse(graph: Graph, ctx: PassContext) -> bool:
    seen: dict[tuple[object, tuple[object, ...]], Node] = {}
    changed = False
    for node in graph.topological_order():
        key = _cse_key(graph, node)
        first = seen.get(key)
        if first is not None and not isinstance(node.op, Opaque) and not any(graph.is_output(o) for o in node.outputs):
            for o, f in zip(node.outputs, first.outputs):
                graph.replace_uses(o, f)
            graph.remove_node(node.name)
            ctx.fired("cse", node.name, f"same as {first.name!r}")
            changed = True
        else:
            seen.setdefault(key, node)
    return changed


common_subexpression_elimination = Pass("cse", "merge nodes that apply the same op to the same operands", _cse)


def _match_constant(graph: Graph, node: Node, ctx: PassContext) -> object:
    if not node.inputs or not all(graph.is_constant(i) for i in node.inputs):
        return None
    if isinstance(node.op, (Repeat, Opaque)) or not node.op.folds or len(node.outputs) != 1 or graph.is_output(node.name):
        return None
    if not is_static(graph.types[node.name].shape):  # a slice of a constant up to a run-time length (nanoGPT's tril buffer)
        return Miss("its result has a symbolic shape")
    if ctx.numel(graph.types[node.name].shape) > CONSTANT_FOLD_LIMIT:
        return Miss(f"result has more than {CONSTANT_FOLD_LIMIT} elements")
    return node


def _rewrite_constant(graph: Graph, node: Node, ctx: PassContext) -> str:
    arrays = [graph.initializers[i] for i in node.inputs]
    key = (node.op, tuple(id(a) for a in arrays))
    hit = ctx.fold_cache.get(key)
    if hit is None:  # tied weights (one array under several names) fold once
        value = node.op.evaluate(arrays, {})
        value = contiguous(value, graph.types[node.name].dtype).reshape(eval_shape(graph.types[node.name].shape, {}))  # folded: static
        value.setflags(write=False)
        ctx.fold_cache[key] = (arrays, value)  # the arrays are kept so their ids stay unique
    else:
        value = hit[1]
    inputs = node.inputs
    graph.replace_with_constant(node.name, value)
    for i in inputs:
        if graph.use_count(i) == 0 and i in graph.initializers:
            graph.remove_initializer(i)
    return f"computed {node.op} of {', '.join(inputs)} ahead of time"


CONSTANT_FOLD_RULE = Rule("constant_fold", (Op,), _match_constant, _rewrite_constant)
"""Evaluate a node whose operands are all initializers with the op's reference semantics."""
