"""Patterns with named bindings: a rule's match written as data (in the spirit of tinygrad's ``UPat``).

``Pat.op(Scale, inputs=(Pat.op(Scale, name="inner", single_use=True, inputs=(Pat.var("x"),)),), name="outer")``
matches ``Scale(Scale(x))`` where the inner scale has no other reader, and binds ``outer`` and ``inner`` to their
nodes and ``x`` to the value under them.  :func:`pattern_rule` turns a pattern and a rewrite of the bindings into a
:class:`~graphc.optimizer.infra.Rule`; a pattern that matches up to a failed ``single_use`` gives a
:class:`~graphc.optimizer.infra.Miss` naming the value, so ``--explain`` still says why.

Beyond ops and variables: :meth:`Pat.const` matches a one-element constant (seen through a widening ``Cast``) and binds
its value, :meth:`Pat.any` takes the first of several patterns that matches, ``commutative`` tries a two-operand op's
operands in both orders, ``check`` looks at the matched node in its graph (shapes, dtypes), and :meth:`Pat.through`
first walks up through views (``Reshape``, ``BroadcastTo``) that do not change what a pattern means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphc.errors import OptimizerError
from graphc.graph import Graph, Node
from graphc.ops import FLOAT_DTYPES, Cast, Op

from .uses import only_reader
from .infra import Miss, PassContext, Rule

__all__ = ["Pat", "Bindings", "pattern_rule", "one_element"]

Bindings = dict[str, Any]
"""Name -> the :class:`~graphc.graph.Node` an op pattern matched, the value name a :meth:`Pat.var` matched, or the 0-d
array a :meth:`Pat.const` matched."""

Check = Callable[[Graph, Node], bool]


def one_element(graph: Graph, value: str) -> np.ndarray | None:
    """``value`` as a 0-d array when it is a one-element constant, or a widening float ``Cast`` of one (a float16 model's
    mask values, widened where graphc computes in float32: the constant keeps its own dtype); else ``None``."""
    node = graph.producer(value)
    if node is not None and isinstance(node.op, Cast) and node.op.dtype in FLOAT_DTYPES and graph.is_constant(node.inputs[0]):
        arr = graph.initializers[node.inputs[0]]
        return arr.reshape(()) if arr.size == 1 and str(arr.dtype) in FLOAT_DTYPES else None
    if graph.is_constant(value):
        arr = graph.initializers[value]
        return arr.reshape(()) if arr.size == 1 else None
    return None


@dataclass(frozen=True)
class Pat:
    """A pattern on the value graph.

    ``ops``: the op types the producing node may have (``None``: any value, a leaf); ``inputs``: patterns for the node's
    operands, in order (both orders for a two-operand node when ``commutative``); ``where``: a check on the op;
    ``check``: a check on the node in its graph (for a leaf: on the value, ``check(graph, value)``); ``name``: the
    binding; ``single_use``: the value may be read only by the node that matched the enclosing pattern (so a rewrite
    may replace it).  ``alternatives`` (:meth:`any`), ``constant`` (:meth:`const`) and ``skip`` (:meth:`through`) are
    set by their constructors.
    """

    ops: tuple[type[Op], ...] | None = None
    inputs: tuple[Pat, ...] | None = None
    where: Callable[[Any], bool] | None = None
    name: str | None = None
    single_use: bool = False
    check: Callable[[Graph, Any], bool] | None = None
    commutative: bool = False
    alternatives: tuple[Pat, ...] | None = None
    constant: Callable[[np.ndarray], bool] | None = None
    skip: tuple[type[Op], ...] = ()

    @staticmethod
    def var(name: str | None = None, check: Callable[[Graph, str], bool] | None = None) -> Pat:
        """Any value (passing ``check(graph, value)``), bound to ``name`` (the same name twice must be the same value)."""
        return Pat(name=name, check=check)

    @staticmethod
    def op(
        *ops: type[Op],
        inputs: tuple[Pat, ...] | None = None,
        where: Callable[[Any], bool] | None = None,
        name: str | None = None,
        single_use: bool = False,
        check: Check | None = None,
        commutative: bool = False,
    ) -> Pat:
        """A node of one of ``ops`` whose operands match ``inputs`` and whose op passes ``where`` (and node ``check``)."""
        return Pat(tuple(ops), inputs, where, name, single_use, check, commutative)

    @staticmethod
    def const(name: str | None = None, where: Callable[[np.ndarray], bool] | None = None) -> Pat:
        """A one-element constant (:func:`one_element`) whose value passes ``where``, bound to ``name`` as a 0-d array."""
        return Pat(name=name, constant=where or (lambda a: True))

    @staticmethod
    def any(*alternatives: Pat, name: str | None = None) -> Pat:
        """The first of ``alternatives`` that matches (its bindings kept); ``name`` binds the value."""
        return Pat(name=name, alternatives=alternatives)

    @staticmethod
    def through(ops: tuple[type[Op], ...], pat: Pat, check: Check | None = None) -> Pat:
        """``pat``, after walking up through nodes of ``ops`` (their first operand) that pass ``check``."""
        return Pat(skip=ops, alternatives=(pat,), check=check)

    def match(self, graph: Graph, value: str, reader: str | None = None, bindings: Bindings | None = None) -> Bindings | Miss | None:
        """The bindings when ``value`` matches (``reader``: the node reading it, for ``single_use``), a Miss, or None."""
        bindings = {} if bindings is None else bindings
        if self.skip:
            return self._match_through(graph, value, reader, bindings)
        if self.alternatives is not None:
            return self._match_any(graph, value, reader, bindings)
        if self.constant is not None:
            arr = one_element(graph, value)
            return self._bind(bindings, arr) if arr is not None and self.constant(arr) else None
        if self.ops is None:
            return self._bind(bindings, value) if self.check is None or self.check(graph, value) else None
        node = graph.producer(value)
        if node is None or not isinstance(node.op, self.ops) or (self.where is not None and not self.where(node.op)):
            return None
        if (self.inputs is not None and len(self.inputs) != len(node.inputs)) or (self.check is not None and not self.check(graph, node)):
            return None
        if self._bind(bindings, node) is None:
            return None
        got = self._match_operands(graph, node, bindings)
        if got is None:
            return None
        if self.single_use and reader is not None and not only_reader(graph, value, reader):
            return Miss(f"{value!r} is read outside the pattern")
        return got

    def _bind(self, bindings: Bindings, mine: Any) -> Bindings | None:
        if self.name is None:
            return bindings
        bound = bindings.get(self.name)
        if bound is not None and bound is not mine and not _same(bound, mine):
            return None
        bindings[self.name] = mine
        return bindings

    def _match_operands(self, graph: Graph, node: Node, bindings: Bindings) -> Bindings | Miss | None:
        orders = [tuple(node.inputs)]
        if self.commutative and len(node.inputs) == 2:
            orders.append((node.inputs[1], node.inputs[0]))
        for operands in orders:
            trial = dict(bindings)
            near: Miss | None = None
            for pat, operand in zip(self.inputs or (), operands):
                got = pat.match(graph, operand, node.name, trial)
                if got is None:
                    break
                near = near or (got if isinstance(got, Miss) else None)
            else:
                bindings.update(trial)
                return near or bindings
        return None

    def _match_any(self, graph: Graph, value: str, reader: str | None, bindings: Bindings) -> Bindings | Miss | None:
        for alt in self.alternatives or ():
            trial = dict(bindings)
            got = alt.match(graph, value, reader, trial)
            if got is not None and self._bind(trial, value) is not None:
                bindings.update(trial)
                return got if isinstance(got, Miss) else bindings
        return None

    def _match_through(self, graph: Graph, value: str, reader: str | None, bindings: Bindings) -> Bindings | Miss | None:
        node = graph.producer(value)
        while node is not None and isinstance(node.op, self.skip) and (self.check is None or self.check(graph, node)):
            value, reader, node = node.inputs[0], node.name, graph.producer(node.inputs[0])
        return (self.alternatives or (Pat(),))[0].match(graph, value, reader, bindings)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and bool(np.array_equal(a, b))
    return bool(a == b)


def pattern_rule(name: str, pat: Pat, rewrite: Callable[[Graph, Bindings, PassContext], str]) -> Rule:
    """A :class:`Rule` that fires where ``pat`` matches the node's output; ``rewrite`` gets the bindings."""
    if pat.ops is None:
        raise OptimizerError(f"pattern_rule {name!r}: the top pattern must name op types")

    def match(graph: Graph, node: Node, ctx: PassContext) -> Bindings | Miss | None:
        return pat.match(graph, node.outputs[0])

    return Rule(name, pat.ops, match, rewrite)
