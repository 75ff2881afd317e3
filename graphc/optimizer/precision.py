"""float16 and bfloat16 graphs: stored in low precision, computed in float32 on every backend.

A graph whose inputs, weights or outputs are ``float16``/``bfloat16`` keeps
that dtype at its interface and in its weights (half the bytes of float32), and
every backend computes in float32 between them: :func:`promote_low_precision`
casts each low-precision input and weight to float32 where it is read, runs
every op in float32 (a ``Cast`` to a low-precision dtype inside the graph
becomes a ``Cast`` to float32), and rounds each low-precision output at the
end.  So softmax, accumulation and mask constants are float32 everywhere (no
fp16 overflow of ``exp`` or of a large negative mask), and backends differ only
by float32 rounding before the final rounding to the storage dtype.
``lower()`` applies it for every target.
"""

from __future__ import annotations

from graphc.graph import Graph, Node
from graphc.ops import LOW_PRECISION_DTYPES, Cast, TensorType

__all__ = ["promote_low_precision", "has_low_precision", "widen_interface"]


def has_low_precision(graph: Graph) -> bool:
    """True when any value of ``graph`` is float16 or bfloat16."""
    return any(t.dtype in LOW_PRECISION_DTYPES for t in graph.types.values())


def promote_low_precision(graph: Graph) -> Graph:
    """A copy of ``graph`` computing in float32 between its low-precision inputs, weights and outputs (same interface)."""
    widened: dict[str, str] = {}
    narrow_outputs = {o for o in graph.outputs if graph.types[o].dtype in LOW_PRECISION_DTYPES}

    def wide(g: Graph, value: str) -> str:  # a low-precision value read as float32 (one Cast per value)
        if g.types[value].dtype not in LOW_PRECISION_DTYPES:
            return value
        if value not in widened:
            widened[value] = g.add_node(Cast("float32"), [value], g.fresh_name(f"{value}_f32")).name
        return widened[value]

    def on_node(g: Graph, node: Node, operands: list[str]) -> list[str]:
        op = Cast("float32") if isinstance(node.op, Cast) and node.op.dtype in LOW_PRECISION_DTYPES else node.op
        names = [g.fresh_name(f"{o}_f32") if o in narrow_outputs else o for o in node.outputs]
        return [v.name for v in g.add_multi_node(op, [wide(g, v) for v in operands], names)]

    def on_output(g: Graph, name: str, value: str) -> None:
        if value != name:  # computed in float32: narrowed back under the output's name
            g.add_node(Cast(graph.types[name].dtype), [value], name)

    return graph.rebuild(on_node=on_node, on_output=on_output)


def widen_interface(graph: Graph, dtype: str = "bfloat16") -> Graph:
    """A copy of ``graph`` whose ``dtype`` inputs and outputs are float32 at the interface (same names).

    Inside, each such input is rounded to ``dtype`` first and each such output
    is produced in ``dtype`` and then widened, so the numbers are those of
    ``graph`` exactly.  For runtimes whose API takes no arrays of ``dtype``
    (onnxruntime's Python API and bfloat16).
    """
    narrow_outputs = {o for o in graph.outputs if graph.types[o].dtype == dtype}

    def on_input(g: Graph, name: str, t: TensorType) -> str:
        if t.dtype != dtype:
            return g.add_input(name, t.shape, t.dtype).name
        g.add_input(name, t.shape, "float32")
        return g.add_node(Cast(dtype), [name], g.fresh_name(f"{name}_{dtype}")).name

    def on_node(g: Graph, node: Node, operands: list[str]) -> list[str]:
        names = [g.fresh_name(f"{o}_{dtype}") if o in narrow_outputs else o for o in node.outputs]
        return [v.name for v in g.add_multi_node(node.op, operands, names)]

    def on_output(g: Graph, name: str, value: str) -> None:
        if name in narrow_outputs:
            g.add_node(Cast("float32"), [value], name)

    return graph.rebuild(on_input, on_node, on_output)
