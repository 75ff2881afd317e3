"""float16 and bfloat16 graphs: stored in low precision, computed in float32 (or, for GPU targets, in the storage dtype).

A graph whose inputs, weights or outputs are ``float16``/``bfloat16`` keeps
that dtype at its interface and in its weights (half the bytes of float32), and
every backend computes in float32 between them: :func:`promote_low_precision`
casts each low-precision input and weight to float32 where it is read, runs
every op in float32 (a ``Cast`` to a low-precision dtype inside the graph
becomes a ``Cast`` to float32), and rounds each low-precision output at the
end.  So softmax, accumulation and mask constants are float32 everywhere (no
fp16 overflow of ``exp`` or of a large negative mask), and backends differ only
by float32 rounding before the final rounding to the storage dtype.
``lower()`` applies it for every target whose ``low_precision`` is ``"float32"`` (the CPU backends).

A GPU target (``low_precision="storage"``) computes as transformers' float16 models and the GPU's fused
kernels do instead (:func:`promote_low_precision` with ``storage=True``): contractions and attention (float32
accumulation and softmax statistics inside the kernels), data movement and plain elementwise math (residual adds,
SiLU gates, rotary products) stay in the storage dtype; reductions (norms), a decomposed softmax and the functions
whose float16 result loses range or digits (:func:`needs_float32`) run in float32, as does an einsum of a value
with itself (a norm's sum of squares, which overflows float16 past 65504), and so does the pointwise math
that follows them until a contraction reads the result (one ``Cast`` narrows it there).  No ``Cast`` pair stands
around a MatMul or a fused attention: they read and write float16 directly.  bfloat16 is computed the same way,
except that an op the target has no bfloat16 kernel for (``Target.lacks_kernel``: onnxruntime's CUDA provider has
none for comparisons, ``Einsum``, ``Reciprocal``, ...) reads float32 too.
"""

from __future__ import annotations

from collections.abc import Callable

from graphc.attention_op import Attention
from graphc.graph import Graph, Node
from graphc.ops import LOW_PRECISION_DTYPES, Binary, Cast, Concat, Einsum, Op, Repeat, Reshape, Softmax, TensorType, Transpose, Unary
from graphc.tensor_ops import BroadcastTo, Gather, Reduce, Slice

__all__ = ["promote_low_precision", "has_low_precision", "widen_interface", "needs_float32", "STORAGE_PRECISION_OPS", "KernelGap"]

KernelGap = Callable[[Op, str], bool]
"""``(op, dtype) -> bool``: True where a target has no kernel for ``op`` reading ``dtype`` (:attr:`Target.lacks_kernel`)."""

STORAGE_PRECISION_OPS: tuple[type[Op], ...] = (Einsum, Attention, Reshape, Transpose, Repeat, Concat, Gather, Slice, BroadcastTo, Cast)
"""Ops that always run in the dtypes the graph gives them under ``storage=True``: contractions and attention
(float32 accumulation inside the kernels) and data movement; a float32 value reaching one is narrowed first."""

FLOAT32_UNARY = frozenset({"exp", "sqrt", "reciprocal", "tanh", "cos", "sin", "erf"})
FLOAT32_BINARY = frozenset({"div", "pow"})


def needs_float32(op: Op) -> bool:
    """True for the ops a GPU target computes in float32 from low-precision operands: reductions (norms' statistics),
    a decomposed softmax, and functions whose float16 result loses range or digits (exp, sqrt, reciprocal, tanh,
    cos/sin, erf, div, pow)."""
    if isinstance(op, (Reduce, Softmax)):
        return True
    return (isinstance(op, Unary) and op.fn in FLOAT32_UNARY) or (isinstance(op, Binary) and op.fn in FLOAT32_BINARY)


def has_low_precision(graph: Graph) -> bool:
    """True when any value of ``graph`` is float16 or bfloat16."""
    return any(t.dtype in LOW_PRECISION_DTYPES for t in graph.types.values())


def promote_low_precision(graph: Graph, storage: bool = False, lacks_kernel: KernelGap | None = None) -> Graph:
    """A copy of ``graph`` computing in float32 between its low-precision inputs, weights and outputs (same interface).

    ``storage=True``: only what needs float32 (:func:`needs_float32`, and pointwise math reading a float32 result)
    is computed in float32; everything else runs in the dtypes ``graph`` gives it (see the module's text).
    ``lacks_kernel(op, dtype)``: True where the target has no kernel for ``op`` on ``dtype`` operands (a comparison of
    bfloat16 values on onnxruntime's CUDA provider); such an op reads its operands widened to float32 too.
    """
    converted: dict[tuple[str, str], str] = {}
    narrow_outputs = {o for o in graph.outputs if graph.types[o].dtype in LOW_PRECISION_DTYPES}

    def as_dtype(g: Graph, value: str, dtype: str) -> str:  # ``value`` in ``dtype`` (one Cast per value and dtype)
        if g.types[value].dtype == dtype:
            return value
        if (value, dtype) not in converted:
            suffix = "f32" if dtype == "float32" else dtype
            converted[value, dtype] = g.add_node(Cast(dtype), [value], g.fresh_name(f"{value}_{suffix}")).name
        return converted[value, dtype]

    def in_float32(g: Graph, node: Node, operands: list[str]) -> bool:  # under ``storage``: does ``node`` run in float32?
        if isinstance(node.op, Einsum) and len(set(node.inputs)) < len(node.inputs):  # a sum of squares (a norm's)
            return True
        low = {graph.types[i].dtype for i in node.inputs} & set(LOW_PRECISION_DTYPES)
        if lacks_kernel is not None and any(lacks_kernel(node.op, d) for d in low):
            return True
        if isinstance(node.op, STORAGE_PRECISION_OPS):
            return False
        return needs_float32(node.op) or any(g.types[v].dtype != graph.types[i].dtype for v, i in zip(operands, node.inputs))

    def on_node(g: Graph, node: Node, operands: list[str]) -> list[str]:
        if storage and not in_float32(g, node, operands):  # as written: each operand in the dtype the graph gave it
            wanted = [graph.types[i].dtype for i in node.inputs]
            ins = [as_dtype(g, v, d) if d in LOW_PRECISION_DTYPES else v for v, d in zip(operands, wanted)]
            return [v.name for v in g.add_multi_node(node.op, ins, node.outputs)]
        op = Cast("float32") if isinstance(node.op, Cast) and node.op.dtype in LOW_PRECISION_DTYPES else node.op
        names = [g.fresh_name(f"{o}_f32") if o in narrow_outputs else o for o in node.outputs]
        wide = [as_dtype(g, v, "float32") if g.types[v].dtype in LOW_PRECISION_DTYPES else v for v in operands]
        return [v.name for v in g.add_multi_node(op, wide, names)]

    def on_output(g: Graph, name: str, value: str) -> None:
        if value != name:  # computed in float32: narrowed back under the output's name
            g.add_node(Cast(graph.types[name].dtype), [value], name)

    return graph.rebuild(on_node=on_node, on_output=on_output)


def widen_interface(graph: Graph, dtype: str = "bfloat16", keep: frozenset[str] = frozenset()) -> Graph:
    """A copy of ``graph`` whose ``dtype`` inputs and outputs are float32 at the interface (same names), but those in
    ``keep`` (a decode cache that stays in the runtime's own tensors between steps).

    Inside, each such input is rounded to ``dtype`` first and each such output
    is produced in ``dtype`` and then widened, so the numbers are those of
    ``graph`` exactly.  For runtimes whose API takes no arrays of ``dtype``
    (onnxruntime's Python API and bfloat16).
    """
    narrow_outputs = {o for o in graph.outputs if graph.types[o].dtype == dtype and o not in keep}

    def on_input(g: Graph, name: str, t: TensorType) -> str:
        if t.dtype != dtype or name in keep:
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
