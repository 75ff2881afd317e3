"""``graphc show``: a graph as text, Graphviz DOT or SVG."""

from __future__ import annotations

import argparse
from typing import Any

from ..optimizer import optimize
from ..visualize import to_dot, to_svg
from .common import write_output
from .source import GraphSource, add_graph_args

__all__ = ["add_command", "run"]


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc show``."""
    s = sub.add_parser("show", parents=[common], help="print a graph as text, Graphviz DOT or SVG")
    add_graph_args(s, sizes=False)
    s.add_argument("--optimized", action="store_true", help="show the graph after optimization")
    s.add_argument("--format", default="text", choices=("text", "dot", "svg"))
    s.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print a graph as text, DOT or SVG."""
    g, _ = GraphSource.from_args(args).build()
    title = g.name
    if args.optimized:
        g = optimize(g).graph
        title += " (optimized)"
    text = str(g) + "\n" if args.format == "text" else to_dot(g, title) if args.format == "dot" else to_svg(g, title)
    write_output(args.output, text)
    if args.output and args.output != "-":
        print(f"wrote {args.output}")
    return 0
