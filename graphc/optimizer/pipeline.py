"""``optimize``: the public entry point, optimization levels and the before/after report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from graphc.errors import UnknownNameError
from graphc.graph import Graph

from .cleanup import common_subexpression_elimination, constant_folding, dead_code_elimination, simplify_layout
from .cost import GraphCost, format_comparison, graph_cost
from .grouping import fold_groups, fuse_repeat_kv
from .infra import Pass, PassContext, PassManager, Trace
from .planning import check_optimizer, plan_contractions
from .scaling import hoist_elementwise

__all__ = ["optimize", "OptimizationResult", "OptimizationReport", "PIPELINES", "pipeline"]

PIPELINES: dict[int, tuple[Pass, ...]] = {
    0: (),
    1: (simplify_layout, constant_folding, common_subexpression_elimination, dead_code_elimination),
    2: (
        fuse_repeat_kv,
        fold_groups,
        simplify_layout,
        hoist_elementwise,
        plan_contractions,
        constant_folding,
        common_subexpression_elimination,
        dead_code_elimination,
    ),
}
"""The flat list of passes run at each level (level 2 is the default)."""


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
    max_iterations: int = 8,
) -> OptimizationResult:
    """Optimize ``graph`` (never modified) and report what changed.

    ``level`` 0 does nothing, 1 runs clean-ups (layout no-ops, constant folding,
    CSE, DCE), 2 also groups GQA's K/V repeat, folds groups into GEMM rows,
    moves the scale onto weights and plans contractions.  ``hints`` size
    symbolic dims for cost decisions (e.g. ``{"seq": 2048}``); ``optimizer`` is
    opt_einsum's path optimizer; ``verify`` checks the graph after every pass.
    """
    check_optimizer(optimizer)
    passes = pipeline(level)
    hints = {k: int(v) for k, v in (hints or {}).items()}
    graph.verify()
    ctx = PassContext(hints=hints, optimizer=optimizer)
    out, _ = PassManager(passes, max_iterations=max_iterations, verify=verify).run(graph, ctx)
    out.verify()
    report = OptimizationReport(graph_cost(graph, hints), graph_cost(out, hints), ctx.trace, hints, level)
    return OptimizationResult(out, report)
