"""Contraction planning with opt_einsum.

Chains of einsums with no barrier between them (an einsum whose result only
feeds another einsum) are merged into one multi-operand contraction when the
best order of the merged contraction costs fewer FLOPs than the chain as
written.  Every einsum with three or more operands is then split into pairwise
einsums in the order that ``opt_einsum.contract_path`` picks, with symbolic
dims sized by the user's hints.  Softmax, masks and every other non-linear op
are barriers, so attention's QK^T and PV are never merged.
"""

from __future__ import annotations

import opt_einsum

from graphc.einsum_spec import EinsumSpec, einsum_flops, fresh_labels
from graphc.errors import UnknownNameError
from graphc.graph import Graph, Node
from graphc.ops import Einsum

from .cleanup import only_reader, remove_if_dead
from .infra import Miss, PassContext, RewritePass, Rule

__all__ = ["plan_contractions", "SPLIT_RULE", "OPTIMIZERS", "check_optimizer", "einsum_flops", "merge_specs", "plan_path"]

OPTIMIZERS = ("auto", "auto-hq", "greedy", "optimal", "dp", "branch-all", "branch-2", "branch-1", "random-greedy")


def check_optimizer(name: str) -> str:
    """Return ``name`` if opt_einsum knows it, else raise listing the valid ones."""
    if name not in OPTIMIZERS:
        raise UnknownNameError("contraction optimizer", name, OPTIMIZERS)
    return name


def plan_path(spec: EinsumSpec, shapes: list[tuple[int, ...]], optimizer: str) -> opt_einsum.contract.PathInfo:
    """opt_einsum's plan (a printable ``PathInfo``) for ``spec`` on operands of ``shapes``."""
    _, info = opt_einsum.contract_path(str(spec), *shapes, shapes=True, optimize=check_optimizer(optimizer))
    return info


def merge_specs(outer: EinsumSpec, pos: int, inner: EinsumSpec) -> EinsumSpec:
    """Substitute ``inner`` (producing operand ``pos`` of ``outer``) into ``outer``."""
    term = outer.inputs[pos]
    mapping = dict(zip(inner.output, term))
    internal = [c for c in inner.labels if c not in inner.output]
    used = outer.labels + "".join(mapping.values())
    for c, f in zip(internal, fresh_labels(used, len(internal))):
        mapping[c] = f
    inner_terms = ["".join(mapping[c] for c in t) for t in inner.inputs]
    terms = list(outer.inputs[:pos]) + inner_terms + list(outer.inputs[pos + 1 :])
    return EinsumSpec(tuple(terms), outer.output)


def _path_cost(graph: Graph, node: Node, ctx: PassContext) -> int:
    spec = node.op_as(Einsum).parsed
    return int(plan_path(spec, [ctx.shape(graph.types[v].shape) for v in node.inputs], ctx.optimizer).opt_cost)


def _match_merge(graph: Graph, node: Node, ctx: PassContext) -> object:
    spec = node.op_as(Einsum).parsed
    for pos, v in enumerate(node.inputs):
        inner = graph.producer(v)
        if inner is None or not isinstance(inner.op, Einsum) or not only_reader(graph, v, node.name):
            continue
        merged = merge_specs(spec, pos, inner.op.parsed)
        inputs = list(node.inputs[:pos]) + list(inner.inputs) + list(node.inputs[pos + 1 :])
        # one cost model on both sides (opt_einsum's), so that a split of the
        # merged einsum never costs more than the merge promised: merging then
        # strictly lowers the cost, and merge and split cannot undo each other
        now = sum(_path_cost(graph, n, ctx) for n in (inner, node))
        best = int(plan_path(merged, [ctx.shape(graph.types[i].shape) for i in inputs], ctx.optimizer).opt_cost)
        if best < now:
            return node, merged, inputs, inner.name, now, best
        return Miss(f"merging with {inner.name!r} would cost {best:,} FLOPs, not less than {now:,}")
    return None


def _rewrite_merge(graph: Graph, m: tuple, ctx: PassContext) -> str:
    node, merged, inputs, inner, now, best = m
    graph.redefine(node.name, Einsum(str(merged)), inputs)
    remove_if_dead(graph, inner)
    return f"merged with {inner!r} into {merged} ({now:,} -> {best:,} FLOPs under the hints)"


def _match_split(graph: Graph, node: Node, ctx: PassContext) -> object:
    return node if len(node.op_as(Einsum).parsed.inputs) > 2 else None


def _rewrite_split(graph: Graph, node: Node, ctx: PassContext) -> str:
    spec = node.op_as(Einsum).parsed
    info = plan_path(spec, [ctx.shape(graph.types[v].shape) for v in node.inputs], ctx.optimizer)
    operands = list(node.inputs)
    steps = []
    for k, step in enumerate(info.contraction_list):
        positions, step_spec = step[0], step[2]
        args = [operands[i] for i in positions]
        for i in sorted(positions, reverse=True):
            del operands[i]
        if k == len(info.contraction_list) - 1:
            graph.redefine(node.name, Einsum(step_spec), args)
            operands.append(node.name)
        else:
            v = graph.insert_before(node.name, Einsum(step_spec), args, f"{node.name}_step{k}")
            operands.append(v.name)
        steps.append(step_spec)
    return f"split {spec} into {' then '.join(steps)} (optimizer {ctx.optimizer!r}, {int(info.opt_cost):,} FLOPs under the hints)"


SPLIT_RULE = Rule("split_contraction", (Einsum,), _match_split, _rewrite_split)
"""Split an einsum of three or more operands into pairwise einsums in opt_einsum's order."""

plan_contractions = RewritePass(
    "plan_contractions",
    "merge barrier-free einsum chains when cheaper, split multi-operand einsums in opt_einsum's order",
    [Rule("merge_einsum_chain", (Einsum,), _match_merge, _rewrite_merge), SPLIT_RULE],
)
