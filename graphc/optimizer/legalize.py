"""Legalisation: make a graph runnable by one target, once, after the target-free optimizer.

A :class:`Target` says which composite ops a backend runs natively and, for
``Attention``, whether it wants this node fused (its kernel) or decomposed (the
one decomposition, :func:`~graphc.attention_op.decompose_attention`), given the
sizes known at the time.  It also says how many operands an einsum may have; a
longer einsum is split into pairwise ones in opt_einsum's order, here, so no
backend plans contractions again.

``lower(graph, target, sizes)`` runs the lowering stages (``fuse_attention``,
layout clean-up, legalisation, dead-code removal) on a copy; backends call it
on the graph they are given, optimized or not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from graphc.attention_op import Attention
from graphc.dims import check_sizes
from graphc.errors import UnknownNameError
from graphc.graph import Graph, Node
from graphc.mapped import check_mapped_files
from graphc.ops import payload_fields
from graphc.rotary import Rotary, decompose_rotary

from .attention import fuse_attention
from .decompose import decompose_attention
from .heads import ABSORB_KV_CACHE_RULE, UNFLATTEN_HEADS_RULE
from .cleanup import LAYOUT_RULES, common_subexpression_elimination, dead_code_elimination
from .infra import Pass, PassContext, PassManager, RewritePass, Rule
from .planning import SPLIT_RULE
from .precision import KernelGap, has_low_precision, promote_low_precision

__all__ = ["Target", "LOW_PRECISION_MODES", "AttentionPolicy", "legalize", "lower", "LOWERING_STAGES", "REFERENCE_TARGET"]

AttentionPolicy = Callable[[Graph, Node, PassContext], "str | type[Attention] | Attention | None"]
"""Decides one ``Attention`` node, once: ``None`` keeps it for the backend's kernel, an ``Attention`` subclass (a form,
e.g. ``lowering.exporter.forms.ChunkedCausalAttention``) keeps it as that op with the node's fields, an instance of one
is the op the node becomes (a form with fields of its own), a string is the reason to decompose it."""


def _always_decompose(graph: Graph, node: Node, ctx: PassContext) -> str:
    return "the target has no attention kernel"


@dataclass(frozen=True)
class Target:
    """What a backend runs natively.

    ``attention``: the policy for ``Attention`` nodes (default: decompose all);
    ``max_einsum_operands``: longer einsums are split pairwise; ``description``
    is shown in reports; ``kernel`` names the form a kept ``Attention`` node
    takes on the backend (recorded in the optimizer's trace, shown by ``--explain``).
    ``low_precision``: how a float16/bfloat16 graph computes: ``"float32"`` between low-precision storage
    (CPU backends), or ``"storage"``: a float16 graph's contractions, attention and data movement in float16, the rest
    in float32 (GPU backends, whose fused kernels accumulate in float32 inside; :mod:`graphc.optimizer.precision`).
    ``lacks_kernel(op, dtype)``: under ``"storage"``, True for the ops the target has no kernel for on ``dtype``
    operands; they are computed in float32 (default: every op has one).
    ``passes``: the target's own rewrites to its ops (e.g. an RMS norm to one fused op), run after legalisation.
    """

    name: str
    attention: AttentionPolicy = _always_decompose
    max_einsum_operands: int = 2
    description: str = ""
    kernel: Callable[[Graph, Node, PassContext], str] | None = None
    low_precision: str = "float32"
    passes: tuple[Pass, ...] = ()
    lacks_kernel: KernelGap | None = None

    def __post_init__(self) -> None:
        if self.low_precision not in LOW_PRECISION_MODES:
            raise UnknownNameError("low-precision mode", self.low_precision, LOW_PRECISION_MODES)


LOW_PRECISION_MODES = ("float32", "storage")
"""How a target computes a float16/bfloat16 graph (:attr:`Target.low_precision`)."""

REFERENCE_TARGET = Target("reference", description="every composite op decomposed; reference semantics only")


def _match_attention(graph: Graph, node: Node, ctx: PassContext) -> object:
    if type(node.op) is not Attention:  # already a form
        return None
    decision = ctx.target.attention(graph, node, ctx) if ctx.target is not None else "no target"
    if decision is None:
        form = ctx.target.kernel(graph, node, ctx) if ctx.target.kernel is not None else "kernel"
        ctx.decide(node.name, f"Attention kept for {ctx.target.name}'s {form}")
        return None
    return node, decision


def _rewrite_attention(graph: Graph, m: tuple[Node, str | type[Attention] | Attention], ctx: PassContext) -> str:
    node, decision = m
    if isinstance(decision, str):
        decompose_attention(graph, node.name)
        return f"decomposed into grouped einsums: {decision}"
    op = node.op
    form = decision if isinstance(decision, Attention) else decision(**{f.name: getattr(op, f.name) for f in payload_fields(op)})
    graph.redefine(node.name, form, node.inputs)
    detail = ctx.target.kernel(graph, node, ctx) if ctx.target is not None and ctx.target.kernel is not None else ""
    kind = type(form)
    return f"kept as {kind.__name__}: {(kind.__doc__ or '').strip()}" + (f" ({detail})" if detail else "")


def _match_long_einsum(graph: Graph, node: Node, ctx: PassContext) -> object:
    limit = ctx.target.max_einsum_operands if ctx.target is not None else 2
    return SPLIT_RULE.match(graph, node, ctx) if len(node.inputs) > limit else None


def _match_rotary(graph: Graph, node: Node, ctx: PassContext) -> object:
    return node


def _rewrite_rotary(graph: Graph, node: Node, ctx: PassContext) -> str:
    return decompose_rotary(graph, node.name)


legalize = RewritePass(
    "legalize",
    "decompose Attention where the target has no kernel (or its policy says so), and Rotary everywhere; split einsums the target cannot run",
    [
        Rule("legalize_attention", (Attention,), _match_attention, _rewrite_attention),
        Rule("decompose_rotary", (Rotary,), _match_rotary, _rewrite_rotary),
        Rule("split_contraction", SPLIT_RULE.ops, _match_long_einsum, SPLIT_RULE.rewrite),
    ],
)

simplify_views = RewritePass(
    "simplify_views",
    "fold the views the attention rewrite left; an attention over a [batch*heads] view on [batch, heads], a KV cache concatenated before it taken in",
    [*LAYOUT_RULES, UNFLATTEN_HEADS_RULE, ABSORB_KV_CACHE_RULE],
)

LOWERING_STAGES: tuple[Pass, ...] = (fuse_attention, simplify_views, legalize, common_subexpression_elimination, dead_code_elimination)
"""The target-aware stages, in order (CSE merges what the decompositions of several layers share: one mask bias per model)."""


def lower(
    graph: Graph,
    target: Target,
    sizes: Mapping[str, int] | None = None,
    ctx: PassContext | None = None,
    verify: bool = False,
) -> Graph:
    """A copy of ``graph`` lowered for ``target``: attention recognised and kept or decomposed per node, einsums legal.

    ``sizes`` are the real sizes of symbolic dims when known (a run, or an
    export for one shape); policies see them through ``ctx.known_size``.
    """
    check_mapped_files(graph.initializers.values())  # every backend and export reads the weights after this
    ctx = ctx or PassContext()
    ctx.hints = {**dict(ctx.hints), **check_sizes(sizes, "sizes")}
    ctx.target = target
    low = has_low_precision(graph)
    storage = low and target.low_precision == "storage"
    work = promote_low_precision(graph) if low and not storage else graph.copy()
    stages = (*LOWERING_STAGES[:3], *target.passes, *LOWERING_STAGES[3:])  # the target's rewrites after legalize
    PassManager(stages, verify=verify).run(work, ctx)
    if storage:  # after the attention decisions: a kept attention reads float16 itself
        work = promote_low_precision(work, storage=True, lacks_kernel=target.lacks_kernel)
    work.verify()
    return work
