"""A static cost model: FLOPs, bytes moved, largest intermediate and peak live memory.

Symbolic dims are sized by hints (default
:data:`~graphc.dims.DEFAULT_DIM_HINT`).  A Reshape is counted as a
view (no bytes), every other node allocates its result.  Peak memory walks the
deterministic topological order, allocating each result and freeing a value
after its last reader; graph inputs are live from the start, initializers are
reported separately as weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from graphc.graph import Graph, Node
from graphc.ops import Repeat

from graphc.memory import live_bytes

from .infra import PassContext

__all__ = ["NodeCost", "GraphCost", "node_cost", "graph_cost", "format_comparison"]


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node under the hints."""

    flops: int
    bytes_moved: int
    out_bytes: int


@dataclass(frozen=True)
class GraphCost:
    """Totals for a graph under the hints."""

    flops: int
    bytes_moved: int
    largest_intermediate: int
    peak_live_bytes: int
    weight_bytes: int
    repeat_bytes: int
    nodes: int
    einsums: int
    repeats: int

    def to_dict(self) -> dict[str, int]:
        """The figures as a dict."""
        return asdict(self)


def _bytes(graph: Graph, name: str, ctx: PassContext) -> int:
    t = graph.types[name]
    return ctx.numel(t.shape) * np.dtype(t.dtype).itemsize


def node_cost(graph: Graph, node: Node, ctx: PassContext) -> NodeCost:
    """FLOPs (the op's own count, :meth:`~graphc.ops.Op.flops`), bytes read plus written, and result bytes of ``node``."""
    if not node.op.moves_data:
        return NodeCost(0, 0, 0)
    out = sum(_bytes(graph, o, ctx) for o in node.outputs)
    in_shapes = [ctx.shape(graph.types[i].shape) for i in node.inputs]
    out_shapes = [ctx.shape(graph.types[o].shape) for o in node.outputs]
    moved = sum(_bytes(graph, i, ctx) for i in node.inputs) + out
    return NodeCost(node.op.flops(in_shapes, out_shapes), moved, out)


def graph_cost(graph: Graph, hints: Mapping[str, int] | None = None) -> GraphCost:
    """Totals for ``graph`` with symbolic dims sized by ``hints``."""
    ctx = PassContext(hints=dict(hints or {}))
    flops = moved = repeat_bytes = 0
    for node in graph.topological_order():
        c = node_cost(graph, node, ctx)
        flops += c.flops
        moved += c.bytes_moved
        if isinstance(node.op, Repeat):
            repeat_bytes += c.out_bytes
    peak, largest = live_bytes(graph, lambda v: _bytes(graph, v, ctx))
    counts = graph.op_counts()
    return GraphCost(
        flops=flops,
        bytes_moved=moved,
        largest_intermediate=largest,
        peak_live_bytes=peak,
        weight_bytes=sum(int(a.nbytes) for a in graph.initializers.values()),
        repeat_bytes=repeat_bytes,
        nodes=len(graph.nodes),
        einsums=counts.get("Einsum", 0),
        repeats=counts.get("Repeat", 0),
    )


def _human(n: int, unit: str) -> str:
    if unit == "B":
        for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(n) >= s:
                return f"{n / s:.2f} {u}"
        return f"{n} B"
    if abs(n) >= 1e9:
        return f"{n / 1e9:.3f} G"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.3f} M"
    return str(n)


_ROWS = (
    ("FLOPs", "flops", ""),
    ("bytes moved", "bytes_moved", "B"),
    ("largest intermediate", "largest_intermediate", "B"),
    ("peak live memory", "peak_live_bytes", "B"),
    ("repeated K/V bytes", "repeat_bytes", "B"),
    ("weights", "weight_bytes", "B"),
    ("nodes", "nodes", ""),
    ("einsums", "einsums", ""),
    ("repeats", "repeats", ""),
)


def format_comparison(before: GraphCost, after: GraphCost) -> str:
    """An aligned before/after table."""
    rows = [("metric", "before", "after", "after/before")]
    for label, key, unit in _ROWS:
        b, a = getattr(before, key), getattr(after, key)
        ratio = f"{a / b:.3f}" if b else ("-" if not a else "new")
        rows.append((label, _human(b, unit), _human(a, unit), ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
