"""The graph IR: typed values, nodes with frozen op payloads, a DAG on networkx.

A :class:`Graph` holds named values (graph inputs, initializers and node
outputs), each with a :class:`~graphc.ops.TensorType`; every node produces one
value, named as the node.  ``str(graph)`` is a stable text form with one node per
line in the deterministic topological order, and :meth:`Graph.verify` checks the
whole graph, raising a typed error that names the node, operand, label and sizes.
The builder methods (``g.input``, ``g.einsum`` ...) come from
:class:`~graphc.builder.GraphBuilder`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from .builder import GraphBuilder
from .dims import Dim, format_shape
from .errors import (
    CycleError,
    DTypeMismatchError,
    DuplicateNameError,
    GraphcError,
    GraphError,
    ShapeMismatchError,
    UndefinedValueError,
)
from .ops import Op, TensorType, check_dtype

__all__ = ["Value", "Node", "Graph", "ValueLike"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]*\Z")


@dataclass(frozen=True)
class Value:
    """A handle on a named value of a graph, returned by the builder methods."""

    name: str
    type: TensorType

    @property
    def shape(self) -> tuple[Dim, ...]:
        """The value's (possibly symbolic) shape."""
        return self.type.shape

    @property
    def dtype(self) -> str:
        """The value's dtype name."""
        return self.type.dtype

    def __str__(self) -> str:
        return f"{self.name}: {self.type}"


ValueLike = Value | str


@dataclass(frozen=True)
class Node:
    """One operation: ``op`` applied to the values named ``inputs``, producing the value ``name``."""

    name: str
    op: Op
    inputs: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name} = {self.op}({', '.join(self.inputs)})"


def _name_of(v: ValueLike) -> str:
    return v.name if isinstance(v, Value) else v


class Graph(GraphBuilder):
    """A DAG of einsum and elementwise nodes with typed values.

    Build one with the methods of :class:`~graphc.builder.GraphBuilder`, mark
    results with :meth:`output`, then run it with ``lowering.run`` or optimize it
    with ``graphc.optimize``.
    """

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.types: dict[str, TensorType] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.initializers: dict[str, np.ndarray] = {}
        self.nodes: dict[str, Node] = {}
        self._order_key: dict[str, int] = {}
        self._counter = 0

    # ----------------------------------------------------------------- naming
    def fresh_name(self, base: str) -> str:
        """Return ``base`` or ``base_N``, whichever is not used yet."""
        if base not in self.types:
            return base
        i = 1
        while f"{base}_{i}" in self.types:
            i += 1
        return f"{base}_{i}"

    def _claim(self, name: str) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise GraphError(f"invalid value name {name!r}: use letters, digits and _ . : / - (starting with a letter or _)")
        if name in self.types:
            raise DuplicateNameError(f"value name {name!r} is already defined in graph {self.name!r}")

    # ------------------------------------------------------------ definitions
    def value(self, v: ValueLike) -> Value:
        """Return the :class:`Value` handle of ``v`` (a name or a handle)."""
        name = _name_of(v)
        if name not in self.types:
            raise UndefinedValueError(f"value {name!r} is not defined in graph {self.name!r}")
        return Value(name, self.types[name])

    def add_input(self, name: str, shape: Sequence[Dim], dtype: str = "float32") -> Value:
        """Declare a graph input of ``shape`` (ints or symbols such as ``"batch"``) and ``dtype``."""
        self._claim(name)
        self.types[name] = TensorType(tuple(shape), check_dtype(dtype))
        self.inputs.append(name)
        return Value(name, self.types[name])

    def add_initializer(self, name: str, array: np.ndarray) -> Value:
        """Declare a constant (a weight) holding ``array``; the graph keeps a read-only copy."""
        self._claim(name)
        arr = np.array(array, copy=True)
        check_dtype(str(arr.dtype))
        arr.setflags(write=False)
        self.initializers[name] = arr
        self.types[name] = TensorType(tuple(int(d) for d in arr.shape), str(arr.dtype))
        return Value(name, self.types[name])

    def add_node(self, op: Op, inputs: Sequence[ValueLike], name: str | None = None, out_type: TensorType | None = None) -> Value:
        """Append a node applying ``op`` to ``inputs`` and return its output value.

        The output type is inferred (errors name the node); ``out_type`` skips
        inference and is used by the loader, whose result :meth:`verify` checks.
        """
        names = tuple(_name_of(v) for v in inputs)
        name = name if name is not None else self.fresh_name(op.kind.lower())
        self._claim(name)
        if out_type is None:
            out_type = self._infer(name, op, names)
        self.types[name] = out_type
        self.nodes[name] = Node(name, op, names)
        self._counter += 1
        self._order_key[name] = self._counter
        return Value(name, out_type)

    def _infer(self, name: str, op: Op, names: Sequence[str]) -> TensorType:
        for i, n in enumerate(names):
            if n not in self.types:
                raise UndefinedValueError(f"node {name!r} ({op.kind}): operand {i} {n!r} is not defined")
        try:
            op.check_arity(len(names))
            return op.infer([self.types[n] for n in names])
        except GraphcError as e:
            operands = ", ".join(f"{n}: {self.types[n]}" for n in names)
            raise type(e)(f"node {name!r}: {e} [operands: {operands}]") from None

    def output(self, *values: ValueLike) -> None:
        """Mark ``values`` as graph outputs (in order)."""
        for v in values:
            name = _name_of(v)
            if name not in self.types:
                raise UndefinedValueError(f"graph output {name!r} is not defined")
            if name in self.outputs:
                raise DuplicateNameError(f"{name!r} is already a graph output")
            self.outputs.append(name)

    # ---------------------------------------------------------------- queries
    def producer(self, value: ValueLike) -> Node | None:
        """The node that produces ``value``, or ``None`` for inputs and initializers."""
        return self.nodes.get(_name_of(value))

    def consumers(self, value: ValueLike) -> list[Node]:
        """The nodes that read ``value``, in topological order."""
        name = _name_of(value)
        return [n for n in self.topological_order() if name in n.inputs]

    def use_count(self, value: ValueLike) -> int:
        """Number of node operands plus graph outputs that read ``value``."""
        name = _name_of(value)
        return sum(n.inputs.count(name) for n in self.nodes.values()) + self.outputs.count(name)

    def is_constant(self, value: ValueLike) -> bool:
        """True when ``value`` is an initializer."""
        return _name_of(value) in self.initializers

    def to_networkx(self) -> nx.DiGraph:
        """The node DAG: one networkx node per graph node, an edge per data dependency."""
        dag = nx.DiGraph()
        for node in self.nodes.values():
            dag.add_node(node.name, op=node.op)
            for i in node.inputs:
                if i in self.nodes:
                    dag.add_edge(i, node.name)
        return dag

    def topological_order(self) -> list[Node]:
        """Nodes in a deterministic topological order (ties broken by insertion order)."""
        dag = self.to_networkx()
        try:
            order = nx.lexicographical_topological_sort(dag, key=lambda n: self._order_key[n])
            return [self.nodes[n] for n in order]
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(dag)
            raise CycleError(f"graph {self.name!r} has a cycle: {' -> '.join(a for a, _ in cycle)} -> {cycle[0][0]}") from None

    # ------------------------------------------------------------- mutation
    def copy(self) -> "Graph":
        """A copy sharing the immutable op payloads and read-only initializer arrays."""
        g = Graph(self.name)
        g.types = dict(self.types)
        g.inputs = list(self.inputs)
        g.outputs = list(self.outputs)
        g.initializers = dict(self.initializers)
        g.nodes = dict(self.nodes)
        g._order_key = dict(self._order_key)
        g._counter = self._counter
        return g

    def replace_uses(self, old: ValueLike, new: ValueLike) -> None:
        """Make every reader of ``old`` (nodes and graph outputs) read ``new`` instead."""
        old_n, new_n = _name_of(old), _name_of(new)
        if self.types[old_n] != self.types[new_n]:
            raise GraphError(f"cannot replace {old_n!r} ({self.types[old_n]}) by {new_n!r} ({self.types[new_n]}): types differ")
        for name, node in list(self.nodes.items()):
            if old_n in node.inputs:
                self.nodes[name] = Node(name, node.op, tuple(new_n if i == old_n else i for i in node.inputs))
        self.outputs = [new_n if o == old_n else o for o in self.outputs]

    def set_inputs(self, node: str, inputs: Sequence[ValueLike]) -> None:
        """Rewire ``node`` to read ``inputs`` (its type is re-checked by :meth:`verify`)."""
        old = self.nodes[node]
        self.nodes[node] = Node(node, old.op, tuple(_name_of(v) for v in inputs))

    def redefine(self, name: str, op: Op, inputs: Sequence[ValueLike]) -> None:
        """Replace the op and operands of node ``name``, keeping its name, type and readers.

        The new definition must infer exactly the old type, so readers stay valid.
        """
        names = tuple(_name_of(v) for v in inputs)
        t = self._infer(name, op, names)
        if t != self.types[name]:
            raise GraphError(f"cannot redefine {name!r} as {op}: it would be {t}, not {self.types[name]}")
        self.nodes[name] = Node(name, op, names)

    def insert_before(self, anchor: str, op: Op, inputs: Sequence[ValueLike], base_name: str) -> Value:
        """Add a node (named ``base_name`` or a fresh variant) ordered just before node ``anchor``."""
        v = self.add_node(op, inputs, self.fresh_name(base_name))
        if anchor in self._order_key:
            self.place_before(v.name, anchor)
        return v

    def remove_node(self, name: str) -> None:
        """Delete node ``name`` and its value; it must have no readers left."""
        if self.use_count(name):
            raise GraphError(f"cannot remove node {name!r}: it still has {self.use_count(name)} reader(s)")
        del self.nodes[name]
        del self.types[name]
        del self._order_key[name]

    def replace_with_constant(self, name: str, array: np.ndarray) -> None:
        """Turn node ``name`` into an initializer holding ``array`` (same name and type; readers unchanged)."""
        arr = np.array(array, copy=True)
        if (tuple(arr.shape), str(arr.dtype)) != (self.types[name].shape, self.types[name].dtype):
            raise GraphError(f"cannot replace {name!r} ({self.types[name]}) by a constant of {arr.dtype}{list(arr.shape)}")
        arr.setflags(write=False)
        del self.nodes[name]
        del self._order_key[name]
        self.initializers[name] = arr

    def remove_initializer(self, name: str) -> None:
        """Delete an unused initializer."""
        if self.use_count(name):
            raise GraphError(f"cannot remove initializer {name!r}: it is still read")
        del self.initializers[name]
        del self.types[name]

    def place_before(self, name: str, anchor: str) -> None:
        """Give node ``name`` a topological tie-break key just before ``anchor`` (keeps printed order readable)."""
        keys = [k for k in sorted(self._order_key, key=self._order_key.__getitem__) if k != name]
        keys.insert(keys.index(anchor), name)
        self._order_key = {k: i for i, k in enumerate(keys, 1)}
        self._counter = len(keys)

    # ----------------------------------------------------------- validation
    def verify(self) -> None:
        """Check the whole graph; raise the typed error of the first problem found.

        Checks: duplicate names, undefined values, cycles, op attributes and arity,
        einsum specs, shapes and dtypes against inference, initializers against
        their declared types, and that there is at least one output.
        """
        seen: set[str] = set()
        for name in [*self.inputs, *self.initializers, *self.nodes]:
            if name in seen:
                raise DuplicateNameError(f"value name {name!r} is defined more than once")
            seen.add(name)
        for node in self.nodes.values():
            for i, inp in enumerate(node.inputs):
                if inp not in seen:
                    raise UndefinedValueError(f"node {node.name!r} ({node.op.kind}): operand {i} {inp!r} is used but never defined")
        if not self.outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        for out in self.outputs:
            if out not in seen:
                raise UndefinedValueError(f"graph output {out!r} is never defined")
        for name, arr in self.initializers.items():
            t = self.types[name]
            if tuple(arr.shape) != t.shape or str(arr.dtype) != t.dtype:
                raise ShapeMismatchError(f"initializer {name!r} holds {arr.dtype}{list(arr.shape)} but is declared {t}")
        for node in self.topological_order():  # raises CycleError
            expected = self._infer(node.name, node.op, node.inputs)
            declared = self.types[node.name]
            if expected.dtype != declared.dtype:
                raise DTypeMismatchError(f"node {node.name!r} ({node.op}): declared dtype {declared.dtype} but the op gives {expected.dtype}")
            if expected.shape != declared.shape:
                raise ShapeMismatchError(
                    f"node {node.name!r} ({node.op}): declared shape {format_shape(declared.shape)} but the op gives {format_shape(expected.shape)}"
                )

    # ---------------------------------------------------------------- text
    def __str__(self) -> str:
        lines = [f"graph {self.name}("]
        for name in self.inputs:
            lines.append(f"    {name}: {self.types[name]}")
        lines.append(") {")
        for name in sorted(self.initializers):
            lines.append(f"  const {name}: {self.types[name]}")
        for node in self.topological_order():
            lines.append(f"  {node.name}: {self.types[node.name]} = {node.op}({', '.join(node.inputs)})")
        lines.append(f"  return {', '.join(self.outputs)}")
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Graph {self.name!r}: {len(self.inputs)} inputs, {len(self.initializers)} initializers, {len(self.nodes)} nodes, {len(self.outputs)} outputs>"

    def op_counts(self) -> dict[str, int]:
        """How many nodes of each op kind the graph holds."""
        counts: dict[str, int] = {}
        for node in self.nodes.values():
            counts[node.op.kind] = counts.get(node.op.kind, 0) + 1
        return dict(sorted(counts.items()))
