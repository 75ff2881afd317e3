"""Move the attention scale off the S x S scores: onto Q (or K), and into the projection weights.

``Scale(einsum(a, b))`` equals ``einsum(Scale(a), b)``; the rule scales an
initializer operand when there is one (constant folding then bakes the scale
into the weight), else the smallest operand, and only when that is smaller
than the einsum's result.  Together with the layout hoisting rule this carries
the scale from the scores to ``q_proj.weight`` (and ``q_proj.bias``), through
a rotary embedding too (it is linear in the rotated tensor).  A weight that is a
view of a memory-mapped checkpoint is never scaled (that would copy it): the
scale goes onto the einsum's other operand (the projection's input
activations, a cheap pass) when that is smaller than the result.
"""

from __future__ import annotations

from graphc.dims import dim_is_nonnegative, dim_prod, dim_sub
from graphc.graph import Graph, Node
from graphc.mapped import mapped_location
from graphc.ops import Binary, Einsum, Scale
from graphc.rotary import Rotary

from .cleanup import only_reader, remove_if_dead
from .infra import Miss, PassContext, Rule
from .patterns import Bindings, Pat, pattern_rule

__all__ = ["SCALE_RULES"]


def _merge_scales(graph: Graph, b: Bindings, ctx: PassContext) -> str:
    outer, inner = b["outer"], b["inner"]
    factor = outer.op.factor * inner.op.factor
    graph.redefine(outer.name, Scale(factor), [b["x"]])
    remove_if_dead(graph, inner.name)
    return f"merged with {inner.name!r}: factor {factor!r}"


SCALE_OF_SCALE = Pat.op(Scale, name="outer", inputs=(Pat.op(Scale, name="inner", single_use=True, inputs=(Pat.var("x"),)),))
"""``Scale(Scale(x))`` with the inner scale read only here."""


def _match_scale_into_einsum(graph: Graph, node: Node, ctx: PassContext) -> object:
    e = graph.producer(node.inputs[0])
    if e is None or not isinstance(e.op, Einsum):
        return None
    if not only_reader(graph, e.name, node.name):
        return Miss(f"einsum {e.name!r} has other readers")
    mapped = {i for i, v in enumerate(e.inputs) if v in graph.initializers and mapped_location(graph.initializers[v]) is not None}
    consts = [i for i, v in enumerate(e.inputs) if graph.is_constant(v) and i not in mapped]
    if consts:
        return node, e, consts[0]
    candidates = [i for i in range(len(e.inputs)) if i not in mapped]  # a checkpoint's mapped weight is never copied to scale it
    shapes = [graph.types[v].shape for v in e.inputs]
    if all(ctx.known_size(d) is not None for shape in shapes for d in shape):
        sizes = [ctx.numel(shapes[i]) for i in candidates]  # every size is known: compare them
        pos = candidates[sizes.index(min(sizes))]
    else:  # guessed sizes must never put the scale on the larger operand (a pass over a KV cache)
        numels = {i: dim_prod(shapes[i]) for i in candidates}
        smallest = [i for i, n in numels.items() if all(dim_is_nonnegative(dim_sub(m, n)) for m in numels.values())]
        if not smallest:
            return Miss(
                f"which operand of {e.name!r} is smaller depends on unhinted sizes ({', '.join(map(str, numels))}); "
                "the scale stays on the result, where attention kernels apply it"
            )
        pos = smallest[0]
    if ctx.numel(shapes[pos]) >= ctx.numel(graph.types[e.name].shape):
        return Miss(f"no operand of {e.name!r} is smaller than its result, so scaling the result is cheapest")
    return node, e, pos


def _rewrite_scale_into_einsum(graph: Graph, m: tuple[Node, Node, int], ctx: PassContext) -> str:
    node, e, pos = m
    operand = e.inputs[pos]
    scaled = graph.insert_before(e.name, node.op, [operand], f"{operand}_scaled")
    inputs = list(e.inputs)
    inputs[pos] = scaled.name
    if graph.is_output(node.name):  # the output keeps its name: the scale node becomes the einsum
        graph.redefine(node.name, e.op, inputs)
        remove_if_dead(graph, e.name)
    else:  # the einsum keeps its (layout-carrying) name and takes over the scale's readers
        graph.redefine(e.name, e.op, inputs)
        graph.replace_uses(node.name, e.name)
        graph.remove_node(node.name)
    return f"scale moved onto operand {operand!r} of {e.name!r}"


def _match_scale_over_bias(graph: Graph, node: Node, ctx: PassContext) -> object:
    add = graph.producer(node.inputs[0])
    if add is None or not isinstance(add.op, Binary) or add.op.fn != "add":
        return None
    if not any(graph.is_constant(v) for v in add.inputs):
        return None
    return (node, add) if only_reader(graph, add.name, node.name) else Miss(f"{add.name!r} has other readers")


def _rewrite_scale_over_bias(graph: Graph, m: tuple[Node, Node], ctx: PassContext) -> str:
    node, add = m
    parts = [graph.insert_before(add.name, node.op, [v], f"{v}_scaled").name for v in add.inputs]
    graph.redefine(node.name, add.op, parts)
    remove_if_dead(graph, add.name)
    return f"scale distributed over both terms of {add.name!r}"


SCALE_OF_ROTARY = Pat.op(Scale, name="scale", inputs=(Pat.op(Rotary, name="rot", single_use=True),))
"""A scale of a rotary read by nothing else."""


def _rewrite_scale_through_rotary(graph: Graph, b: Bindings, ctx: PassContext) -> str:
    node, rot = b["scale"], b["rot"]  # Rotary is linear in x: scale(rotary(x)) = rotary(scale(x))
    x, positions = rot.inputs
    scaled = graph.insert_before(rot.name, node.op, [x], f"{x}_scaled")
    graph.redefine(node.name, rot.op, [scaled.name, positions])
    remove_if_dead(graph, rot.name)
    return f"moved Scale above Rotary {rot.name!r}"


SCALE_RULES = (
    pattern_rule("scale_through_rotary", SCALE_OF_ROTARY, _rewrite_scale_through_rotary),
    pattern_rule("merge_scales", SCALE_OF_SCALE, _merge_scales),
    Rule("scale_into_einsum_operand", (Scale,), _match_scale_into_einsum, _rewrite_scale_into_einsum),
    Rule("scale_over_bias", (Scale,), _match_scale_over_bias, _rewrite_scale_over_bias),
)
