"""Every softmax that attention recognition leaves alone, with the reason the matcher gave up.

Attention fusion that stops matching an exporter's new spelling must not go quiet: :func:`unfused_softmaxes` lists each
``Softmax`` left once every attention the optimizer recognises is kept as one op, with the matcher's near miss
(``graphc optimize --explain`` and ``graphc info`` print the same list).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.graph import Graph
from graphc.ops import Softmax

from .attention import FUSE_ATTENTION_RULE
from .infra import Miss, PassContext
from .legalize import Target, lower

__all__ = ["UnfusedSoftmax", "unfused_softmaxes", "KEEP_EVERY_ATTENTION"]

KEEP_EVERY_ATTENTION = Target("every attention", lambda graph, node, ctx: None, description="every recognised attention kept as one op")
"""A target that keeps each recognised attention as one ``Attention`` op (no backend's kernel limits)."""


@dataclass(frozen=True)
class UnfusedSoftmax:
    """A softmax left in the graph and why it is not part of a recognised attention."""

    node: str
    reason: str

    def __str__(self) -> str:
        return f"{self.node}: {self.reason}"


def unfused_softmaxes(graph: Graph, lowered: bool = False) -> list[UnfusedSoftmax]:
    """Each ``Softmax`` of ``graph`` once attention is recognised (``graph`` lowered for :data:`KEEP_EVERY_ATTENTION`
    first, unless ``lowered`` says it already is), with the reason the attention matcher gave for leaving it."""
    kept = graph if lowered else lower(graph, KEEP_EVERY_ATTENTION)
    out = []
    for node in kept.topological_order():
        if isinstance(node.op, Softmax):
            found = FUSE_ATTENTION_RULE.match(kept, node, PassContext())
            reason = found.reason if isinstance(found, Miss) else "the attention chain matches, but the rewrite did not take it"
            out.append(UnfusedSoftmax(node.name, reason))
    return out
