"""Who reads a value: the checks and removals that rules and patterns share."""

from __future__ import annotations

from graphc.graph import Graph

__all__ = ["only_reader", "remove_if_dead"]


def only_reader(graph: Graph, value: str, reader: str) -> bool:
    """True when node ``reader`` is the sole reader of ``value`` (once) and ``value`` is no graph output."""
    return not graph.is_output(value) and graph.use_count(value) == 1 and value in graph.nodes[reader].inputs


def remove_if_dead(graph: Graph, name: str) -> None:
    """Remove the node producing ``name`` if none of its outputs is read, then its operands' producers likewise."""
    stack = [name]
    while stack:
        node = graph.producer(stack.pop())
        if node is not None and all(graph.use_count(o) == 0 for o in node.outputs):
            inputs = node.inputs
            graph.remove_node(node.name)
            stack.extend(inputs)
