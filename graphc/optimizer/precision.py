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

from graphc.graph import Graph
from graphc.ops import LOW_PRECISION_DTYPES, Cast

__all__ = ["promote_low_precision", "has_low_precision", "widen_interface"]


def has_low_precision(graph: Graph) -> bool:
    """True when any value of ``graph`` is float16 or bfloat16."""
    return any(t.dtype in LOW_PRECISION_DTYPES for t in graph.types.values())


def promote_low_precision(graph: Graph) -> Graph:
    """A copy of ``graph`` computing in float32 between its low-precision inputs, weights and outputs (same interface)."""
    g = Graph(graph.name)
    rename: dict[str, str] = {}
    for name in graph.inputs:
        t = graph.types[name]
        g.add_input(name, t.shape, t.dtype)
        rename[name] = name
    for name, arr in graph.initializers.items():
        g.add_initializer(name, arr, copy=False)
        rename[name] = name
    widened: dict[str, str] = {}

    def read(name: str) -> str:
        src = rename[name]
        if g.types[src].dtype not in LOW_PRECISION_DTYPES:
            return src
        if src not in widened:
            widened[src] = g.add_node(Cast("float32"), [src], g.fresh_name(f"{src}_f32")).name
        return widened[src]

    outputs = set(graph.outputs)
    for node in graph.topological_order():
        op = Cast("float32") if isinstance(node.op, Cast) and node.op.dtype in LOW_PRECISION_DTYPES else node.op
        names = [g.fresh_name(f"{o}_f32") if o in outputs and graph.types[o].dtype in LOW_PRECISION_DTYPES else o for o in node.outputs]
        made = g.add_multi_node(op, [read(i) for i in node.inputs], names)
        for o, v in zip(node.outputs, made):
            rename[o] = v.name
    for o in graph.outputs:
        dtype = graph.types[o].dtype
        if dtype in LOW_PRECISION_DTYPES and rename[o] != o:
            g.add_node(Cast(dtype), [rename[o]], o)
        elif rename[o] != o:  # pragma: no cover - outputs keep their names above
            raise AssertionError(o)
    g.outputs = list(graph.outputs)
    return g


def widen_interface(graph: Graph, dtype: str = "bfloat16") -> Graph:
    """A copy of ``graph`` whose ``dtype`` inputs and outputs are float32 at the interface (same names).

    Inside, each such input is rounded to ``dtype`` first and each such output
    is produced in ``dtype`` and then widened, so the numbers are those of
    ``graph`` exactly.  For runtimes whose API takes no arrays of ``dtype``
    (onnxruntime's Python API and bfloat16).
    """
    g = Graph(graph.name)
    rename: dict[str, str] = {}
    for name in graph.inputs:
        t = graph.types[name]
        if t.dtype == dtype:
            g.add_input(name, t.shape, "float32")
            rename[name] = g.add_node(Cast(dtype), [name], g.fresh_name(f"{name}_{dtype}")).name
        else:
            g.add_input(name, t.shape, t.dtype)
            rename[name] = name
    for name, arr in graph.initializers.items():
        g.add_initializer(name, arr, copy=False)
        rename[name] = name
    narrow_outputs = {o for o in graph.outputs if graph.types[o].dtype == dtype}
    for node in graph.topological_order():
        names = [g.fresh_name(f"{o}_{dtype}") if o in narrow_outputs else o for o in node.outputs]
        for o, v in zip(node.outputs, g.add_multi_node(node.op, [rename[i] for i in node.inputs], names)):
            rename[o] = v.name
    for o in graph.outputs:
        if o in narrow_outputs:
            g.add_node(Cast("float32"), [rename[o]], o)
    g.outputs = list(graph.outputs)
    return g
