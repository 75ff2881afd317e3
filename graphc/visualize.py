"""Graphviz rendering of graphs: DOT text (no dependency) and SVG (with Graphviz when present).

Nodes are coloured by op kind, edges are labelled with the shapes they carry;
inputs, initializers and outputs are drawn as distinct shapes.
"""

from __future__ import annotations

import shutil
import subprocess

from .errors import GraphcError
from .graph import Graph

__all__ = ["to_dot", "to_svg", "OP_COLOURS"]

OP_COLOURS = {
    "Einsum": "#8fb8ff",
    "Reshape": "#e3e3e3",
    "Transpose": "#e3e3e3",
    "Repeat": "#ff9f9f",
    "Softmax": "#b4e6a6",
    "CausalMask": "#ffd98a",
    "Where": "#ffd98a",
    "Scale": "#f2c6ff",
    "Concat": "#c7f0f0",
    "Cast": "#e3e3e3",
    "Unary": "#f2c6ff",
    "Binary": "#f2c6ff",
}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(graph: Graph, title: str | None = None) -> str:
    """The graph as Graphviz DOT text (deterministic)."""
    lines = [f"digraph {_q(graph.name)} {{", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10, style=filled];']
    lines.append('  edge [fontname="Helvetica", fontsize=8, color="#555555"];')
    if title:
        lines.append(f"  labelloc=t; label={_q(title)};")
    for name in graph.inputs:
        lines.append(f'  {_q(name)} [shape=ellipse, fillcolor="#ffffff", label={_q(name + chr(10) + str(graph.types[name]))}];')
    for name in sorted(graph.initializers):
        lines.append(f'  {_q(name)} [shape=note, fillcolor="#f7f7f7", label={_q(name + chr(10) + str(graph.types[name]))}];')
    for node in graph.topological_order():
        label = f"{node.op}\n{node.name}"
        shape = "doubleoctagon" if node.name in graph.outputs else "box"
        lines.append(f"  {_q(node.name)} [shape={shape}, fillcolor={_q(OP_COLOURS.get(node.op.kind, '#ffffff'))}, label={_q(label)}];")
        for i in node.inputs:
            lines.append(f"  {_q(i)} -> {_q(node.name)} [label={_q(str(graph.types[i]))}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


_NO_DOT = (
    "SVG output needs the Graphviz 'dot' program (apt install graphviz, brew install graphviz; the graphviz Python package "
    "alone is not enough) or use --format dot"
)


def to_svg(graph: Graph, title: str | None = None) -> bytes:
    """The graph as SVG, rendered by the Graphviz ``dot`` program (directly, or through the ``graphviz`` Python package)."""
    dot = to_dot(graph, title)
    exe = shutil.which("dot")
    if exe:
        proc = subprocess.run([exe, "-Tsvg"], input=dot.encode(), capture_output=True, check=False)
        if proc.returncode:
            raise GraphcError(f"Graphviz dot failed: {proc.stderr.decode(errors='replace').strip()}")
        return proc.stdout
    try:
        import graphviz
    except ImportError:
        raise GraphcError(_NO_DOT) from None
    try:
        return graphviz.Source(dot).pipe(format="svg")
    except Exception as e:  # noqa: BLE001 - graphviz.ExecutableNotFound when the package is there but the program is not
        raise GraphcError(f"{_NO_DOT} (the graphviz Python package runs the same program: {type(e).__name__})") from None
