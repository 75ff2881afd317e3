"""Pass infrastructure: rewrite rules as data, one driver, a pass manager with a trace.

A :class:`Rule` is a pattern on one node kind: ``match`` inspects the graph and
returns a match object (the rule applies), a :class:`Miss` (the pattern almost
matched; the reason is kept for ``--explain``) or ``None`` (not this pattern).
``rewrite`` changes the graph and returns a one-line description.

A :class:`Pass` maps a graph to ``(graph, modified)`` and never mutates the
graph it is given (it works on a copy).  :class:`PassManager` runs a flat list
of named passes to a bounded fixed point, optionally calling
:meth:`~graphc.graph.Graph.verify` after every pass, and records every rewrite
and near miss in a :class:`Trace`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphc.dims import Dim, dim_symbols, eval_dim, eval_shape
from graphc.errors import GraphcError, OptimizerError
from graphc.graph import Graph, Node
from graphc.ops import Op

__all__ = ["Miss", "Rule", "Pass", "RewritePass", "PassContext", "PassManager", "Trace", "Fired", "NearMiss", "DEFAULT_DIM_HINT"]

DEFAULT_DIM_HINT = 512
"""Size assumed for a symbolic dim without a hint when costs are compared."""


@dataclass(frozen=True)
class Miss:
    """A near miss: the rule's pattern matched partly; ``reason`` says why it did not fire."""

    reason: str


@dataclass(frozen=True)
class Fired:
    """One rewrite: which pass and rule fired on which node, and what it did."""

    iteration: int
    pass_name: str
    rule: str
    node: str
    detail: str


@dataclass(frozen=True)
class NearMiss:
    """A rule that looked at a node and declined, with its reason."""

    pass_name: str
    rule: str
    node: str
    reason: str


@dataclass
class Trace:
    """Everything the optimizer did, in order, and the near misses of its last look at each node."""

    fired: list[Fired] = field(default_factory=list)
    near_misses: dict[tuple[str, str], NearMiss] = field(default_factory=dict)
    iterations: int = 0

    def explain(self) -> str:
        """A readable account: one line per rewrite, then the rules that did not fire and why."""
        lines = [f"optimizer ran {self.iterations} iteration(s), {len(self.fired)} rewrite(s)"]
        for f in self.fired:
            lines.append(f"  [{f.iteration}] {f.pass_name}/{f.rule} on {f.node}: {f.detail}")
        if self.near_misses:
            lines.append("did not fire:")
            for m in self.near_misses.values():
                lines.append(f"  {m.pass_name}/{m.rule} on {m.node}: {m.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON-ready data."""
        return {
            "iterations": self.iterations,
            "fired": [f.__dict__ for f in self.fired],
            "near_misses": [m.__dict__ for m in self.near_misses.values()],
        }


@dataclass
class PassContext:
    """Options shared by the passes of one run, and the trace they write to."""

    hints: Mapping[str, int] = field(default_factory=dict)
    optimizer: str = "auto"
    trace: Trace = field(default_factory=Trace)
    iteration: int = 0
    current_pass: str = ""

    def size(self, d: Dim) -> int:
        """A dim's size with symbols replaced by their hint (:data:`DEFAULT_DIM_HINT` if none)."""
        env = {s: int(self.hints.get(s, DEFAULT_DIM_HINT)) for s in dim_symbols(d)}
        return eval_dim(d, env)

    def shape(self, shape: Sequence[Dim]) -> tuple[int, ...]:
        """A shape's sizes under the hints."""
        env = {s: int(self.hints.get(s, DEFAULT_DIM_HINT)) for d in shape for s in dim_symbols(d)}
        return eval_shape(shape, env)

    def numel(self, shape: Sequence[Dim]) -> int:
        """Element count of ``shape`` under the hints."""
        n = 1
        for d in self.shape(shape):
            n *= d
        return n

    def fired(self, rule: str, node: str, detail: str) -> None:
        """Record a rewrite."""
        self.trace.fired.append(Fired(self.iteration, self.current_pass, rule, node, detail))
        self.trace.near_misses.pop((rule, node), None)

    def missed(self, rule: str, node: str, reason: str) -> None:
        """Record a near miss (the latest reason per rule and node wins)."""
        self.trace.near_misses[(rule, node)] = NearMiss(self.current_pass, rule, node, reason)


@dataclass(frozen=True)
class Rule:
    """A local rewrite: ``match(graph, node, ctx)`` then ``rewrite(graph, match, ctx) -> description``."""

    name: str
    ops: tuple[type[Op], ...]
    match: Callable[[Graph, Node, PassContext], Any]
    rewrite: Callable[[Graph, Any, PassContext], str]


@dataclass(frozen=True)
class Pass:
    """A named graph transformation ``run(graph, ctx) -> modified`` applied to a private copy."""

    name: str
    description: str
    run: Callable[[Graph, PassContext], bool]

    def __call__(self, graph: Graph, ctx: PassContext) -> tuple[Graph, bool]:
        """Return ``(new_graph, modified)``; ``graph`` itself is never changed."""
        work = graph.copy()
        ctx.current_pass = self.name
        modified = self.run(work, ctx)
        return (work, True) if modified else (graph, False)


_MAX_REWRITES = 10_000


def RewritePass(name: str, description: str, rules: Sequence[Rule]) -> Pass:
    """A pass that applies ``rules`` node by node, in topological order, until none fires."""

    def run(graph: Graph, ctx: PassContext) -> bool:
        modified = False
        for _ in range(_MAX_REWRITES):
            fired = False
            for node in graph.topological_order():
                if node.name not in graph.nodes:
                    continue
                for rule in rules:
                    if not isinstance(node.op, rule.ops):
                        continue
                    m = rule.match(graph, graph.nodes[node.name], ctx)
                    if isinstance(m, Miss):
                        ctx.missed(rule.name, node.name, m.reason)
                    elif m is not None:
                        ctx.fired(rule.name, node.name, rule.rewrite(graph, m, ctx))
                        fired = modified = True
                        break
                if fired:
                    break
            if not fired:
                return modified
        raise OptimizerError(f"pass {name!r} did not settle after {_MAX_REWRITES} rewrites")

    return Pass(name, description, run)


class PassManager:
    """Runs a flat list of passes, repeating the list until nothing changes (at most ``max_iterations`` times)."""

    def __init__(self, passes: Sequence[Pass], max_iterations: int = 8, verify: bool = False) -> None:
        self.passes = list(passes)
        self.max_iterations = max_iterations
        self.verify = verify

    def run(self, graph: Graph, ctx: PassContext) -> tuple[Graph, bool]:
        """Optimize ``graph``; returns ``(graph, modified)`` and fills ``ctx.trace``."""
        any_change = False
        for iteration in range(1, self.max_iterations + 1):
            ctx.iteration = iteration
            ctx.trace.iterations = iteration
            changed = False
            for p in self.passes:
                graph, modified = p(graph, ctx)
                changed |= modified
                if modified and self.verify:
                    try:
                        graph.verify()
                    except GraphcError as e:
                        raise OptimizerError(f"pass {p.name!r} produced an invalid graph: {type(e).__name__}: {e}") from e
            any_change |= changed
            if not changed:
                return graph, any_change
        raise OptimizerError(f"optimizer did not reach a fixed point in {self.max_iterations} iterations:\n{ctx.trace.explain()}")
