"""Patterns with named bindings: a rule's match written as data (in the spirit of tinygrad's ``UPat``).

``Pat.op(Scale, inputs=(Pat.op(Scale, name="inner", single_use=True, inputs=(Pat.var("x"),)),), name="outer")``
matches ``Scale(Scale(x))`` where the inner scale has no other reader, and binds ``outer`` and ``inner`` to their
nodes and ``x`` to the value under them.  :func:`pattern_rule` turns a pattern and a rewrite of the bindings into a
:class:`~graphc.optimizer.infra.Rule`; a pattern that matches up to a failed ``single_use`` gives a
:class:`~graphc.optimizer.infra.Miss` naming the value, so ``--explain`` still says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphc.errors import OptimizerError
from graphc.graph import Graph, Node
from graphc.ops import Op

from .uses import only_reader
from .infra import Miss, PassContext, Rule

__all__ = ["Pat", "Bindings", "pattern_rule"]

Bindings = dict[str, Any]
"""Name -> the :class:`~graphc.graph.Node` an op pattern matched, or the value name a :meth:`Pat.var` matched."""


@dataclass(frozen=True)
class Pat:
    """A pattern on the value graph.

    ``ops``: the op types the producing node may have (``None``: any value, a leaf); ``inputs``: patterns for the node's
    operands, in order; ``where``: a check on the op; ``name``: the binding; ``single_use``: the value may be read only
    by the node that matched the enclosing pattern (so a rewrite may replace it).
    """

    ops: tuple[type[Op], ...] | None = None
    inputs: tuple[Pat, ...] | None = None
    where: Callable[[Any], bool] | None = None
    name: str | None = None
    single_use: bool = False

    @staticmethod
    def var(name: str) -> Pat:
        """Any value, bound to ``name`` (the same name twice must be the same value)."""
        return Pat(name=name)

    @staticmethod
    def op(
        *ops: type[Op],
        inputs: tuple[Pat, ...] | None = None,
        where: Callable[[Any], bool] | None = None,
        name: str | None = None,
        single_use: bool = False,
    ) -> Pat:
        """A node of one of ``ops`` whose operands match ``inputs`` and whose op passes ``where``."""
        return Pat(tuple(ops), inputs, where, name, single_use)

    def match(self, graph: Graph, value: str, reader: str | None = None, bindings: Bindings | None = None) -> Bindings | Miss | None:
        """The bindings when ``value`` matches (``reader``: the node reading it, for ``single_use``), a Miss, or None."""
        bindings = {} if bindings is None else bindings
        node = graph.producer(value)
        if self.ops is not None:
            if node is None or not isinstance(node.op, self.ops) or (self.where is not None and not self.where(node.op)):
                return None
            if self.inputs is not None and len(self.inputs) != len(node.inputs):
                return None
        if self.name is not None:
            bound = bindings.get(self.name)
            mine: Any = node if self.ops is not None else value
            if bound is not None and bound is not mine and bound != mine:
                return None
            bindings[self.name] = mine
        if self.ops is None:
            return bindings
        assert node is not None
        near: Miss | None = None
        for pat, operand in zip(self.inputs or (), node.inputs):
            got = pat.match(graph, operand, node.name, bindings)
            if got is None:
                return None
            if isinstance(got, Miss):
                near = near or got
        if self.single_use and reader is not None and not only_reader(graph, value, reader):
            return Miss(f"{value!r} is read outside the pattern")
        return near or bindings


def pattern_rule(name: str, pat: Pat, rewrite: Callable[[Graph, Bindings, PassContext], str]) -> Rule:
    """A :class:`Rule` that fires where ``pat`` matches the node's output; ``rewrite`` gets the bindings."""
    if pat.ops is None:
        raise OptimizerError(f"pattern_rule {name!r}: the top pattern must name op types")

    def match(graph: Graph, node: Node, ctx: PassContext) -> Bindings | Miss | None:
        return pat.match(graph, node.outputs[0])

    return Rule(name, pat.ops, match, rewrite)
