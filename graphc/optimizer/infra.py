"""Pass infrastructure: rewrite rules as data, one driver, a pass manager with a trace.

A :class:`Rule` is a pattern on one node kind: ``match`` inspects the graph and
returns a match object (the rule applies), a :class:`Miss` (the pattern almost
matched; the reason is kept for ``--explain``) or ``None`` (not this pattern).
``rewrite`` changes the graph and returns a one-line description.

A :class:`Pass` edits a graph in place and returns ``PassResult(graph,
modified)``; ``optimize`` gives the passes its own copy, so the caller's graph
is never changed.  Rewrite passes share one worklist driver
(:func:`rewrite_to_fixed_point`) that revisits only what a rewrite touched.
:class:`PassManager` runs the named stages in order, each once, optionally
calling :meth:`~graphc.graph.Graph.verify` after every stage, and records every
rewrite and near miss in a :class:`Trace`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from graphc.dims import DEFAULT_DIM_HINT, Dim, dim_symbols, eval_dim, eval_shape
from graphc.errors import GraphcError, OptimizerError
from graphc.graph import Graph, Node
from graphc.ops import Op

__all__ = [
    "Miss",
    "Rule",
    "Pass",
    "PassResult",
    "RewritePass",
    "rewrite_to_fixed_point",
    "PassContext",
    "PassManager",
    "Trace",
    "Fired",
    "NearMiss",
    "DEFAULT_DIM_HINT",
]


@dataclass(frozen=True)
class Miss:
    """A near miss: the rule's pattern matched partly; ``reason`` says why it did not fire."""

    reason: str


@dataclass(frozen=True)
class Fired:
    """One rewrite: which pass and rule fired on which node, and what it did."""

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
    decisions: dict[str, str] = field(default_factory=dict)

    def explain(self, last: int | None = None) -> str:
        """A readable account: one line per rewrite (the ``last`` ones only, if given), then the rules that did not fire and why."""
        lines = [f"optimizer ran {len(self.fired)} rewrite(s)"]
        for f in self.fired[-last:] if last else self.fired:
            lines.append(f"  {f.pass_name}/{f.rule} on {f.node}: {f.detail}")
        if self.decisions:
            lines.append("decisions:")
            lines.extend(f"  {d}" for d in self.decisions.values())
        if self.near_misses:
            lines.append("did not fire:")
            for m in self.near_misses.values():
                lines.append(f"  {m.pass_name}/{m.rule} on {m.node}: {m.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON-ready data."""
        return {
            "fired": [f.__dict__ for f in self.fired],
            "near_misses": [m.__dict__ for m in self.near_misses.values()],
            "decisions": list(self.decisions.values()),
        }


@dataclass
class PassContext:
    """Options shared by the passes of one run, and the trace they write to."""

    hints: Mapping[str, int] = field(default_factory=dict)
    optimizer: str = "auto"
    trace: Trace = field(default_factory=Trace)
    current_pass: str = ""
    target: Any = None  # a graphc.optimizer.legalize.Target while lowering
    fold_cache: dict[Any, Any] = field(default_factory=dict)

    def known_size(self, d: Dim) -> int | None:
        """A dim's size when every symbol in it is hinted, else ``None`` (for choices that must not guess)."""
        syms = dim_symbols(d)
        if not syms <= set(self.hints):
            return None
        return eval_dim(d, {s: int(self.hints[s]) for s in syms})

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
        self.trace.fired.append(Fired(self.current_pass, rule, node, detail))
        self.trace.near_misses.pop((rule, node), None)

    def decide(self, node: str, text: str) -> None:
        """Record a choice made without rewriting (a kernel kept for a backend, say)."""
        self.trace.decisions[node] = f"{self.current_pass} on {node}: {text}"

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


class PassResult(NamedTuple):
    """What a pass returns: the graph (the same object: passes work in place) and whether it changed."""

    graph: Graph
    modified: bool


@dataclass(frozen=True)
class Pass:
    """A named in-place graph transformation ``run(graph, ctx) -> modified``.

    Passes edit the graph they are given (``optimize`` hands them its own copy),
    as onnx-ir's in-place passes do; calling one returns a :class:`PassResult`.
    """

    name: str
    description: str
    run: Callable[[Graph, PassContext], bool]
    rules: list[Rule] = field(default_factory=list, compare=False)  # a rewrite pass's rules, in the order they are tried

    def __call__(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Run on ``graph`` (edited in place) and return ``PassResult(graph, modified)``."""
        ctx.current_pass = self.name
        return PassResult(graph, bool(self.run(graph, ctx)))


_MAX_REWRITES_PER_NODE = 50


def rewrite_to_fixed_point(graph: Graph, rules: Sequence[Rule], ctx: PassContext, stage: str = "rewrite") -> int:
    """Apply ``rules`` with a worklist until none fires; returns the number of rewrites.

    Every node is visited once in topological order; after a rewrite only the
    nodes it touched (created, rewired or whose readers changed) and their
    direct neighbours are visited again.  A rule set that keeps undoing its own
    rewrites (more than a bounded number per node) raises :class:`OptimizerError`.
    """
    order = graph.topological_order()
    work: deque[str] = deque(n.name for n in order)
    queued = set(work)
    limit = 1000 + _MAX_REWRITES_PER_NODE * len(order)
    fired = 0
    while work:
        name = work.popleft()
        queued.discard(name)
        node = graph.nodes.get(name)
        if node is None:
            continue
        for rule in rules:
            if not isinstance(node.op, rule.ops):
                continue
            try:
                m = rule.match(graph, node, ctx)
            except GraphcError:  # a typed error the rule means to raise (a target refusing a form, a bad graph)
                raise
            except Exception as e:  # noqa: BLE001 - a bug in a rule: reported with where it happened
                raise _rule_failed(rule, "match", node, e) from e
            if isinstance(m, Miss):
                ctx.missed(rule.name, node.name, m.reason)
                continue
            if m is None:
                continue
            touched = graph.track_changes()
            try:
                detail = rule.rewrite(graph, m, ctx)
            except GraphcError:
                raise
            except Exception as e:  # noqa: BLE001 - as in match
                raise _rule_failed(rule, "rewrite", node, e) from e
            finally:
                graph.stop_tracking()
            ctx.fired(rule.name, node.name, detail)
            fired += 1
            if fired > limit:
                raise OptimizerError(
                    f"stage {stage!r} did not settle after {fired} rewrites (rules keep undoing each other):\n{ctx.trace.explain(last=20)}"
                )
            again = set(touched)
            again.add(name)
            for t in list(again):
                n = graph.nodes.get(t)
                if n is None:
                    continue
                for i in n.inputs:
                    p = graph.producer(i)
                    if p is not None:
                        again.add(p.name)
                for o in n.outputs:
                    again.update(u.name for u in graph.value(o).users)
            for later in sorted((graph.nodes[t] for t in again if t in graph.nodes), key=lambda n: n._key):
                if later.name not in queued:
                    work.append(later.name)
                    queued.add(later.name)
            break
    return fired


def _rule_failed(rule: Rule, step: str, node: Node, e: Exception) -> OptimizerError:
    """The error for an exception inside a rule's ``match`` or ``rewrite``: it names the rule, the step and the node."""
    return OptimizerError(f"rule {rule.name!r} failed in {step} on node {node.name!r} ({node.op}): {type(e).__name__}: {e}")


def RewritePass(name: str, description: str, rules: Sequence[Rule]) -> Pass:
    """A pass that applies ``rules`` with the worklist driver :func:`rewrite_to_fixed_point`.

    The pass keeps its rule list (``Pass.rules``): :func:`graphc.optimizer.register_rule` adds one in one place."""
    own = list(rules)

    def run(graph: Graph, ctx: PassContext) -> bool:
        return rewrite_to_fixed_point(graph, own, ctx, name) > 0

    return Pass(name, description, run, own)


class PassManager:
    """Runs named stages in order, each once (a rewrite stage itself runs to its fixed point)."""

    def __init__(self, passes: Sequence[Pass], verify: bool = False) -> None:
        self.passes = list(passes)
        self.verify = verify

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Run every stage on ``graph`` (in place); returns ``PassResult(graph, modified)`` and fills ``ctx.trace``."""
        any_change = False
        for p in self.passes:
            _, modified = p(graph, ctx)
            any_change |= modified
            if self.verify:
                try:
                    graph.verify()
                except GraphcError as e:
                    raise OptimizerError(f"pass {p.name!r} produced an invalid graph: {type(e).__name__}: {e}") from e
        return PassResult(graph, any_change)
