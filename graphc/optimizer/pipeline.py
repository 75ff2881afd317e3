"""``optimize``: the public entry point, optimization levels and the before/after report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from graphc.dims import check_sizes
from graphc.errors import UnknownNameError
from graphc.graph import Graph
from graphc.mapped import check_mapped_files

from .cleanup import CONSTANT_FOLD_RULE, LAYOUT_RULES, common_subexpression_elimination, dead_code_elimination
from .cost import GraphCost, format_comparison, graph_cost
from .grouping import ABOVE_REPEAT_RULE, EXPAND_REPEAT_RULE, FOLD_RULE, FUSE_REPEAT_RULE, HOIST_RULE
from .infra import Pass, PassContext, PassManager, RewritePass, Rule, Trace
from .experts import DENSE_EXPERTS_RULE
from .quantized import QUANTIZED_MATMUL_RULE
from .latent import ABSORB_LATENT_RULE
from .legalize import LOWERING_STAGES, Target
from .planning import check_optimizer, plan_contractions
from .scaling import SCALE_RULES
from .scatter import CONCAT_OF_TRANSPOSES_RULE, SCATTER_ALL_RULE, SCATTER_SLAB_RULE, SLICE_OF_CONCAT_RULE

__all__ = ["optimize", "OptimizationResult", "OptimizationReport", "PIPELINES", "pipeline", "STAGES", "register_rule", "unregister_rule"]

SCATTER_RULES = (SCATTER_ALL_RULE, SCATTER_SLAB_RULE, SLICE_OF_CONCAT_RULE, CONCAT_OF_TRANSPOSES_RULE)

STAGES: dict[str, Pass] = {
    p.name: p
    for p in (
        RewritePass(
            "group_kv",
            "products with a dequantized weight kept packed; turn Repeat of K/V + einsum into a grouped einsum (no K/V copy) and fold the "
            "group into the GEMM rows",
            [QUANTIZED_MATMUL_RULE, EXPAND_REPEAT_RULE, ABOVE_REPEAT_RULE, FUSE_REPEAT_RULE, FOLD_RULE, *LAYOUT_RULES],
        ),
        RewritePass(
            "simplify",
            "layout no-ops and chains, elementwise ops above layout changes, the scale onto the smallest operand or a weight, constants folded; "
            "a repeat that the moves expose is grouped; tensors assembled by scatters read as Concats; "
            "multi-head latent attention absorbed where cheaper",
            [
                *LAYOUT_RULES,
                HOIST_RULE,
                *SCALE_RULES,
                CONSTANT_FOLD_RULE,
                ABOVE_REPEAT_RULE,
                FUSE_REPEAT_RULE,
                FOLD_RULE,
                *SCATTER_RULES,
                ABSORB_LATENT_RULE,
                DENSE_EXPERTS_RULE,
            ],
        ),
        RewritePass("cleanup", "layout no-ops and chains, constants folded, scatters of grids", [*LAYOUT_RULES, CONSTANT_FOLD_RULE, *SCATTER_RULES]),
        plan_contractions,
        common_subexpression_elimination,
        dead_code_elimination,
    )
}
"""Every named stage; a pipeline is a list of them, each run once (rewrite stages run to their own fixed point)."""

PIPELINES: dict[int, tuple[Pass, ...]] = {
    0: (),
    1: tuple(STAGES[n] for n in ("cleanup", "cse", "dce")),
    2: tuple(STAGES[n] for n in ("group_kv", "simplify", "plan_contractions", "cleanup", "cse", "dce")),
}
"""The stages run at each level (level 2 is the default)."""


def register_rule(stage: str, rule: Rule, first: bool = False) -> None:
    """Add ``rule`` to the rewrite stage ``stage`` (one of :data:`STAGES`, or ``fuse_attention``); it then runs in every
    pipeline that has the stage, traced like the built-in rules.  ``first``: try it before the stage's own rules."""
    from .legalize import LOWERING_STAGES

    stages = {**STAGES, **{p.name: p for p in LOWERING_STAGES}}
    if stage not in stages or not stages[stage].rules:
        raise UnknownNameError("rewrite stage", stage, [n for n, p in stages.items() if p.rules])
    rules = stages[stage].rules
    if first:
        rules.insert(0, rule)
    else:
        rules.append(rule)


def unregister_rule(stage: str, name: str) -> None:
    """Remove the rule called ``name`` from ``stage`` (for tests and plug-ins that clean up)."""
    from .legalize import LOWERING_STAGES

    stages = {**STAGES, **{p.name: p for p in LOWERING_STAGES}}
    stages[stage].rules[:] = [r for r in stages[stage].rules if r.name != name]


def pipeline(level: int) -> tuple[Pass, ...]:
    """The passes of optimization ``level``; an unknown level lists the valid ones."""
    if level not in PIPELINES:
        raise UnknownNameError("optimization level", str(level), [str(k) for k in PIPELINES])
    return PIPELINES[level]


@dataclass(frozen=True)
class OptimizationReport:
    """Costs before and after, with the trace of what fired (and what almost did)."""

    before: GraphCost
    after: GraphCost
    trace: Trace
    hints: dict[str, int]
    level: int

    def __str__(self) -> str:
        hints = ", ".join(f"{k}={v}" for k, v in sorted(self.hints.items())) or "none (symbols sized 512)"
        return f"optimization level {self.level}, dim hints: {hints}\n{format_comparison(self.before, self.after)}"

    def explain(self) -> str:
        """The report followed by every rewrite and near miss."""
        return f"{self}\n\n{self.trace.explain()}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "level": self.level,
            "hints": dict(self.hints),
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
            "trace": self.trace.to_dict(),
        }


class OptimizationResult(NamedTuple):
    """``optimize``'s result; unpack it as ``graph, report = optimize(g)``."""

    graph: Graph
    report: OptimizationReport


def optimize(
    graph: Graph,
    level: int = 2,
    hints: Mapping[str, int] | None = None,
    optimizer: str = "auto",
    verify: bool = False,
    target: Target | None = None,
    sizes: Mapping[str, int] | None = None,
) -> OptimizationResult:
    """Optimize ``graph`` (never modified) and report what changed.

    ``level`` 0 does nothing, 1 runs clean-ups (layout no-ops, constant folding,
    CSE, DCE), 2 also groups GQA's K/V repeat, folds groups into GEMM rows,
    moves the scale onto weights and plans contractions.  ``hints`` size
    symbolic dims for cost decisions (e.g. ``{"seq": 2048}``); ``optimizer`` is
    opt_einsum's path optimizer; ``verify`` checks the graph after every stage.

    With a ``target`` (a :class:`~graphc.optimizer.legalize.Target`, e.g. from
    ``lowering.onnx_target``) the lowering stages follow: attention is
    recognised as one ``Attention`` op and kept or decomposed per node for that
    target, with ``sizes`` (the real sizes, when known) informing the choice.
    """
    check_optimizer(optimizer)
    passes = pipeline(level) + (LOWERING_STAGES if target is not None else ())
    known = {**check_sizes(hints, "hints"), **check_sizes(sizes, "sizes")}
    graph.verify()
    check_mapped_files(graph.initializers.values())  # constant folding reads weights (the scale folded into q_proj)
    ctx = PassContext(hints=known, optimizer=optimizer, target=target)
    out = graph.copy()
    PassManager(passes, verify=verify).run(out, ctx)
    out.verify()
    report = OptimizationReport(graph_cost(graph, known), graph_cost(out, known), ctx.trace, known, level)
    return OptimizationResult(out, report)
