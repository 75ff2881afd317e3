"""The graph IR: values that know their producer and users, nodes kept in topological order.

A :class:`Graph` holds named values (graph inputs, initializers and node
outputs), each a :class:`Value` with a :class:`~graphc.ops.TensorType`, the
:class:`Node` that produces it (``None`` for inputs and initializers) and its
users (the nodes reading it, with how many operand slots each).  A node applies
a frozen op payload to input values and produces one or more output values;
the node is named after its first output.

Nodes sit in a doubly linked list that is always a valid topological order
(as in torch.fx): insertion before an anchor, removal, rewiring and
``replace_uses`` cost O(1) or O(users), never a rebuild.  Each node carries an
order key, so "is a before b" is O(1) and readers come back in order.
``str(graph)`` is a stable text form with one node per line in that order;
:meth:`Graph.verify` checks the whole graph, raising a typed error that names
the node, operand, label and sizes.  Builder methods (``g.input``,
``g.einsum`` ...) come from :class:`~graphc.builder.GraphBuilder`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from .builder import GraphBuilder
from .dims import Dim, dim_symbols, format_shape, normalize_dim
from .errors import (
    CycleError,
    DTypeMismatchError,
    DuplicateNameError,
    GraphcError,
    GraphError,
    ShapeMismatchError,
    UndefinedValueError,
)
from .mapped import check_mapped_files
from .ops import Op, TensorType, check_dtype, payload_fields
from .values import Node, Value, ValueLike
from .visibility import Visibility

__all__ = ["Value", "Node", "Graph", "GraphMark", "ValueLike", "map_op_dims", "op_dims"]

_NAME = re.compile(r"[A-Za-z_/][A-Za-z0-9_.:/\-]*\Z")
_GAP = 1 << 20  # spacing of order keys; an insertion between two adjacent keys renumbers


@dataclass(frozen=True)
class GraphMark:
    """What :meth:`Graph.mark` recorded: how many nodes and initializers the graph held (both kept in the order they
    were added; a renamed one counts as added when renamed)."""

    nodes: int
    initializers: int


def _dim_fields(op: Op) -> list[str]:
    """The attributes of ``op`` typed as a dim or a shape (``Dim``, ``Dim | None``, ``Shape``, tuples of them)."""
    return [f.name for f in payload_fields(op) if any(t in str(f.type) for t in ("Dim", "Shape", "Visibility"))]


def map_op_dims(op: Op, fn: Callable[[Dim], Dim]) -> Op:
    """``op`` with ``fn`` applied to each dim-valued attribute; the same object when nothing changes."""
    mapped = {name: _map_nested(getattr(op, name), fn) for name in _dim_fields(op)}
    if all(value == getattr(op, name) for name, value in mapped.items()):
        return op
    return type(op)(**{**{f.name: getattr(op, f.name) for f in payload_fields(op)}, **mapped})


def op_dims(op: Op) -> list[Dim]:
    """Every dim in ``op``'s dim-valued attributes (offsets, bounds, target shapes, an opaque node's output shapes)."""
    return [d for name in _dim_fields(op) for d in _flatten(getattr(op, name))]


def _flatten(value: Any) -> list[Dim]:
    if value is None:
        return []
    if isinstance(value, tuple):
        return [d for v in value for d in _flatten(v)]
    if isinstance(value, Visibility):
        return list(value.dims())
    return [value]


def _map_nested(value: Any, fn: Callable[[Dim], Dim]) -> Any:
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_map_nested(x, fn) for x in value)
    if isinstance(value, Visibility):
        return value.map_dims(fn)
    return fn(value)


def _name_of(v: ValueLike) -> str:
    return v.name if isinstance(v, Value) else v


def _operand_name(graph: "Graph", v: ValueLike) -> str:
    """The name of operand ``v``; a :class:`Value` handle must belong to ``graph`` (not to another graph of the same names)."""
    if isinstance(v, Value):
        if graph._values.get(v.name) is not v:
            raise UndefinedValueError(
                f"value {v.name!r} is a handle from another graph (or a replaced value), not of graph {graph.name!r}; "
                "pass this graph's values (or their names)"
            )
        return v.name
    if not isinstance(v, str):
        raise GraphError(f"an operand must be a Value of graph {graph.name!r} or a value name, got {type(v).__name__} {v!r}")
    return graph._in_scope(v)


class _TypesView(Mapping[str, TensorType]):
    """Read-only name -> type view of a graph's values."""

    def __init__(self, values: dict[str, Value]) -> None:
        self._values = values

    def __getitem__(self, name: str) -> TensorType:
        return self._values[name].type

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, name: object) -> bool:
        return name in self._values


class _NodesView(Mapping[str, Node]):
    """Read-only name -> node view; iterates in topological order."""

    def __init__(self, graph: Graph) -> None:
        self._graph = graph

    def __getitem__(self, name: str) -> Node:
        return self._graph._nodes[name]

    def __iter__(self) -> Iterator[str]:
        return (n.name for n in self._graph._walk())

    def __len__(self) -> int:
        return len(self._graph._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._graph._nodes


class Graph(GraphBuilder):
    """A DAG of einsum and elementwise nodes with typed values.

    Build one with the methods of :class:`~graphc.builder.GraphBuilder`, mark
    results with :meth:`output`, then run it with ``lowering.run`` or optimize it
    with ``graphc.optimize``.
    """

    def __init__(self, name: str = "graph") -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"a graph's name must be a non-empty string, got {type(name).__name__} {name!r}")
        self.name = name
        self._values: dict[str, Value] = {}
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._output_uses: dict[str, int] = {}
        self.initializers: dict[str, np.ndarray] = {}
        self._nodes: dict[str, Node] = {}
        self._head = Node("", _Sentinel(), (), ())  # circular list: head._next is the first node
        self._head._prev = self._head._next = self._head
        self._fresh: dict[str, int] = {}
        self._scope = ""
        self._touched: set[str] | None = None
        self.assumptions: list[tuple[Dim, Dim]] = []

    # ----------------------------------------------------------------- views
    @property
    def types(self) -> Mapping[str, TensorType]:
        """Name -> type of every value (read-only)."""
        return _TypesView(self._values)

    @property
    def nodes(self) -> Mapping[str, Node]:
        """Name -> node (read-only); iterates in topological order."""
        return _NodesView(self)

    @property
    def inputs(self) -> list[str]:
        """Names of the graph inputs, in order."""
        return list(self._inputs)

    @property
    def outputs(self) -> list[str]:
        """Names of the graph outputs, in order."""
        return list(self._outputs)

    @outputs.setter
    def outputs(self, names: Sequence[str]) -> None:
        self._outputs = []
        self._output_uses = {}
        self.output(*names)

    # ----------------------------------------------------------------- naming
    def assume(self, a: Dim, b: Dim) -> None:
        """Record that dims ``a`` and ``b`` are equal wherever the graph is defined (an imported model's own assumption,
        such as a sliding-window cache no longer than the window); every run checks it against the input sizes."""
        a, b = normalize_dim(a), normalize_dim(b)
        if a != b and (a, b) not in self.assumptions:
            self.assumptions.append((a, b))

    @contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Build under a name scope: inside ``with g.scope("model.layers.3.")`` every initializer and node output
        is named ``prefix`` + the name given (scopes nest), :meth:`fresh_name` answers names relative to the scope,
        and an operand given by name is looked up in the scope first, then as written.  Inputs keep their names
        (they are the graph's interface).  So one builder writes a layer into a whole model, and each weight is
        named once, where the checkpoint names it."""
        if not isinstance(prefix, str):
            raise GraphError(f"a name scope must be a string, got {type(prefix).__name__} {prefix!r}")
        outer = self._scope
        self._scope = outer + prefix
        try:
            yield
        finally:
            self._scope = outer

    def qualified(self, name: str) -> str:
        """``name`` as the current :meth:`scope` names it (``name`` itself outside any scope)."""
        return self._scope + name

    def _in_scope(self, name: str) -> str:
        """The value a name given inside the current scope refers to: the scoped one if it exists, else ``name``."""
        scoped = self._scope + name
        return scoped if scoped in self._values else name

    def fresh_name(self, base: str) -> str:
        """Return ``base`` or ``base_N``, whichever is not used yet (relative to the current :meth:`scope`)."""
        full = self._scope + base
        if full not in self._values:
            return base
        i = self._fresh.get(full, 1)
        while f"{full}_{i}" in self._values:
            i += 1
        self._fresh[full] = i + 1
        return f"{base}_{i}"

    def _claim(self, name: str) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise GraphError(f"invalid value name {name!r}: use letters, digits and _ . : / - (starting with a letter, _ or /)")
        if name in self._values:
            raise DuplicateNameError(f"value name {name!r} is already defined in graph {self.name!r}")

    # ------------------------------------------------------------ definitions
    def value(self, v: ValueLike) -> Value:
        """Return the :class:`Value` of ``v`` (a name or a handle)."""
        name = self._in_scope(v) if isinstance(v, str) else v.name
        if name not in self._values:
            raise UndefinedValueError(f"value {name!r} is not defined in graph {self.name!r}")
        return self._values[name]

    def add_input(self, name: str, shape: Sequence[Dim], dtype: str = "float32") -> Value:
        """Declare a graph input of ``shape`` (ints or symbols such as ``"batch"``) and ``dtype``."""
        self._claim(name)
        v = Value(name, TensorType(tuple(shape), check_dtype(dtype)))
        self._values[name] = v
        self._inputs.append(name)
        return v

    def shared_initializer(self, name: str, value: np.ndarray) -> str:
        """The initializer ``name`` holding ``value``, made once per graph: a second rewrite (or builder) asking for
        the same constant under the same name gets the first one back (so the nodes of several layers reading it
        merge); a different value gets a fresh name.  The name is the graph's, whatever :meth:`scope` is open."""
        outer, self._scope = self._scope, ""
        try:
            have = self.initializers.get(name)
            if have is not None and have.dtype == value.dtype and have.shape == value.shape and np.array_equal(have, value):
                return name
            return self.add_initializer(self.fresh_name(name) if have is not None or name in self.types else name, value).name
        finally:
            self._scope = outer

    def add_initializer(self, name: str, array: np.ndarray, copy: bool = True) -> Value:
        """Declare a constant (a weight) holding ``array``.

        The graph keeps a read-only array: a copy, unless ``copy=False`` and the
        array is already read-only (weights shared between graphs, memory maps).
        """
        name = self._scope + name
        self._claim(name)
        arr = np.asarray(array)
        if copy or arr.flags.writeable:
            check_mapped_files([arr])  # copying reads the data: a memory-mapped file that shrank would SIGBUS here
            arr = np.array(arr, copy=True)
            arr.setflags(write=False)
        check_dtype(str(arr.dtype))
        self.initializers[name] = arr
        v = Value(name, TensorType(tuple(int(d) for d in arr.shape), str(arr.dtype)))
        self._values[name] = v
        return v

    def add_node(
        self,
        op: Op,
        inputs: Sequence[ValueLike],
        name: str | None = None,
        out_type: TensorType | None = None,
        before: str | None = None,
    ) -> Value:
        """Add a node applying a single-output ``op`` to ``inputs`` and return its output value.

        The output type is inferred (errors name the node); ``out_type`` skips
        inference and is used by the loader, whose result :meth:`verify` checks.
        The node goes last, or just before node ``before``.
        """
        names = [name if name is not None else self.fresh_name(op.kind.lower())]
        types = None if out_type is None else [out_type]
        return self.add_multi_node(op, inputs, names, types, before)[0]

    def add_multi_node(
        self,
        op: Op,
        inputs: Sequence[ValueLike],
        names: Sequence[str] | None = None,
        out_types: Sequence[TensorType] | None = None,
        before: str | None = None,
    ) -> tuple[Value, ...]:
        """Add a node with one output per name in ``names`` (default: fresh names) and return them."""
        in_names = tuple(_operand_name(self, v) for v in inputs)
        n_out = op.num_outputs
        if names is None:
            base = op.kind.lower()
            names = [self.fresh_name(base)] + [self.fresh_name(f"{base}_out{i}") for i in range(1, n_out)]
        names = [self._scope + n for n in names]
        if len(names) != n_out:
            raise GraphError(f"{op.kind} has {n_out} output(s) but {len(names)} name(s) were given: {names}")
        for n in names:
            self._claim(n)
        if len(set(names)) != len(names):
            raise DuplicateNameError(f"output names {names} repeat")
        types = list(out_types) if out_types is not None else list(self._infer(names[0], op, in_names))
        if len(types) != n_out:
            raise GraphError(f"{op.kind} declares {n_out} output(s) but {len(types)} type(s) were given")
        node = Node(names[0], op, in_names, tuple(names))
        for n, t in zip(names, types):
            self._values[n] = Value(n, t, node)
        self._nodes[node.name] = node
        for i in in_names:
            if i in self._values:  # the loader may name values defined later; verify() reports them
                self._add_use(i, node)
        self._link_before(node, self._nodes[before] if before is not None else self._head)
        self._touch(node.name)
        return tuple(self._values[n] for n in names)

    def _infer(self, name: str, op: Op, names: Sequence[str]) -> tuple[TensorType, ...]:
        for i, n in enumerate(names):
            if n not in self._values:
                raise UndefinedValueError(f"node {name!r} ({op.kind}): operand {i} {n!r} is not defined")
        try:
            op.check_arity(len(names))
            return op.infer_all([self._values[n].type for n in names])
        except GraphcError as e:
            operands = ", ".join(f"{n}: {self._values[n].type}" for n in names)
            raise type(e)(f"node {name!r}: {e} [operands: {operands}]") from None

    def output(self, *values: ValueLike) -> None:
        """Mark ``values`` as graph outputs (in order)."""
        for v in values:
            name = _operand_name(self, v)
            if name not in self._values:
                raise UndefinedValueError(f"graph output {name!r} is not defined")
            if name in self._output_uses:
                raise DuplicateNameError(f"{name!r} is already a graph output")
            self._outputs.append(name)
            self._output_uses[name] = 1

    def call(self, sub: Graph, bindings: Mapping[str, ValueLike], prefix: str = "") -> dict[str, Value]:
        """Inline ``sub`` into this graph with its inputs bound to values of this graph.

        ``bindings`` maps every input name of ``sub`` to a value here (types must
        match).  Initializers and nodes are copied under ``prefix`` + their name
        (made unique with a suffix if taken); weight arrays are shared, not
        copied.  Returns ``sub``'s outputs by their names in ``sub``.  An
        N-layer stack is N calls of one layer graph.
        """
        missing = [n for n in sub._inputs if n not in bindings]
        extra = sorted(set(bindings) - set(sub._inputs))
        if missing or extra:
            raise GraphError(f"call of {sub.name!r}: inputs {sub._inputs} must each be bound; missing {missing}, unknown {extra}")
        rename: dict[str, str] = {}
        for n in sub._inputs:
            v = self.value(bindings[n])
            if v.type != sub._values[n].type:
                raise GraphError(f"call of {sub.name!r}: input {n!r} is {sub._values[n].type} but is bound to {v.name!r} ({v.type})")
            rename[n] = v.name
        for n, arr in sub.initializers.items():
            rename[n] = self.add_initializer(self.fresh_name(prefix + n), arr, copy=False).name
        for node in sub._walk():
            outs = [self.fresh_name(prefix + o) for o in node.outputs]
            for o, new in zip(node.outputs, outs):
                rename[o] = new
            self.add_multi_node(node.op, [rename[i] for i in node.inputs], outs, [sub._values[o].type for o in node.outputs])
        return {o: self._values[rename[o]] for o in sub._outputs}

    # ---------------------------------------------------------------- queries
    def producer(self, value: ValueLike) -> Node | None:
        """The node that produces ``value``, or ``None`` for inputs and initializers."""
        v = self._values.get(_name_of(value))
        return v.producer if v is not None else None

    def consumers(self, value: ValueLike) -> list[Node]:
        """The nodes that read ``value``, in topological order."""
        v = self._values.get(_name_of(value))
        return sorted(v.users, key=lambda n: n._key) if v is not None else []

    def use_count(self, value: ValueLike) -> int:
        """Number of node operands plus graph outputs that read ``value``."""
        name = _name_of(value)
        v = self._values.get(name)
        return (sum(v.users.values()) if v is not None else 0) + self._output_uses.get(name, 0)

    def is_output(self, value: ValueLike) -> bool:
        """True when ``value`` is a graph output."""
        return _name_of(value) in self._output_uses

    def is_constant(self, value: ValueLike) -> bool:
        """True when ``value`` is an initializer."""
        return _name_of(value) in self.initializers

    def is_before(self, a: str, b: str) -> bool:
        """True when node ``a`` comes before node ``b`` in the order."""
        return self._nodes[a]._key < self._nodes[b]._key

    def to_networkx(self) -> nx.DiGraph:
        """The node DAG: one networkx node per graph node, an edge per data dependency."""
        dag = nx.DiGraph()
        for node in self._walk():
            dag.add_node(node.name, op=node.op)
            for i in node.inputs:
                p = self.producer(i)
                if p is not None:
                    dag.add_edge(p.name, node.name)
        return dag

    def _walk(self) -> Iterator[Node]:
        node = self._head._next
        while node is not None and node is not self._head:  # a linked node always has a next (the circle closes at the head)
            nxt = node._next  # read first: the caller may unlink ``node``
            yield node
            node = nxt

    def topological_order(self) -> list[Node]:
        """Nodes in topological order (the maintained list; no sort)."""
        return list(self._walk())

    # ------------------------------------------------------------- mutation
    def track_changes(self) -> set[str]:
        """Start recording the names of nodes that edits touch; returns the live set (see :meth:`stop_tracking`)."""
        self._touched = set()
        return self._touched

    def stop_tracking(self) -> None:
        """Stop recording touched nodes."""
        self._touched = None

    def _touch(self, *names: str) -> None:
        if self._touched is not None:
            self._touched.update(names)

    def _add_use(self, value: str, node: Node) -> None:
        users = self._values[value].users
        users[node] = users.get(node, 0) + 1

    def _drop_use(self, value: str, node: Node) -> None:
        v = self._values.get(value)
        if v is None:
            return
        n = v.users.get(node, 0) - 1
        if n > 0:
            v.users[node] = n
        else:
            v.users.pop(node, None)
        if v.producer is not None:
            self._touch(v.producer.name)

    def _link_before(self, node: Node, anchor: Node) -> None:
        prev = anchor._prev
        assert prev is not None
        node._prev, node._next = prev, anchor
        prev._next = node
        anchor._prev = node
        lo = prev._key if prev is not self._head else 0
        hi = anchor._key if anchor is not self._head else lo + 2 * _GAP
        if hi - lo < 2:
            self._renumber()
        else:
            node._key = (lo + hi) // 2

    def _unlink(self, node: Node) -> None:
        assert node._prev is not None and node._next is not None
        node._prev._next = node._next
        node._next._prev = node._prev
        node._prev = node._next = None

    def _renumber(self) -> None:
        for i, node in enumerate(self._walk(), 1):
            node._key = i * _GAP

    def copy(self) -> Graph:
        """A copy sharing the immutable op payloads and read-only initializer arrays."""
        g = self.rebuild()
        g._fresh = dict(self._fresh)
        return g

    def rebuild(
        self,
        on_input: Callable[[Graph, str, TensorType], str] | None = None,
        on_node: Callable[[Graph, Node, list[str]], Sequence[str]] | None = None,
        on_output: Callable[[Graph, str, str], None] | None = None,
    ) -> Graph:
        """A new graph from this one in one walk (the one loop behind copies and interface-changing rebuilds).

        ``on_input(new, name, type)`` declares what stands for an input and returns that value (default: the same
        input); initializers are shared; ``on_node(new, node, operands)`` adds what stands for a node, its operands
        already mapped, and returns the values of its outputs (default: the same op under the same names);
        ``on_output(new, name, value)`` makes the output ``name`` from the value that stands for it (default: the
        value itself, which then has that name).  The outputs keep their names and order.
        """
        g = Graph(self.name)
        value_of: dict[str, str] = {}
        for name in self._inputs:
            t = self._values[name].type
            value_of[name] = on_input(g, name, t) if on_input is not None else g.add_input(name, t.shape, t.dtype).name
        for name, arr in self.initializers.items():
            value_of[name] = g.add_initializer(name, arr, copy=False).name
        for node in self._walk():
            operands = [value_of[i] for i in node.inputs]
            if on_node is None:
                made = [v.name for v in g.add_multi_node(node.op, operands, node.outputs, [self._values[o].type for o in node.outputs])]
            else:
                made = list(on_node(g, node, operands))
            value_of.update(zip(node.outputs, made))
        for name in self._outputs:
            if on_output is not None:
                on_output(g, name, value_of[name])
            elif value_of[name] != name:  # pragma: no cover - the defaults keep every name
                raise GraphError(f"rebuild of {self.name!r}: output {name!r} is now {value_of[name]!r}")
        g.outputs = list(self._outputs)
        g.assumptions = list(self.assumptions)
        return g

    def __getstate__(self) -> dict[str, Any]:
        """Pickle as flat lists (the node list is linked; pickling the links would recurse once per node)."""
        return {
            "name": self.name,
            "inputs": [(n, self._values[n].type) for n in self._inputs],
            "initializers": self.initializers,
            "nodes": [(node.op, node.inputs, node.outputs, [self._values[o].type for o in node.outputs]) for node in self._walk()],
            "outputs": list(self._outputs),
            "fresh": dict(self._fresh),
            "assumptions": list(self.assumptions),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from :meth:`__getstate__`'s lists."""
        self.__init__(state["name"])  # type: ignore[misc]
        # arrays unpickled from a socket's frames may be unaligned: BLAS refuses those and NumPy falls back to slow loops
        self.initializers = {k: np.require(a, requirements=("C", "A")) for k, a in state["initializers"].items()}
        for name, t in state["inputs"]:
            self._values[name] = Value(name, t)
            self._inputs.append(name)
        for name, arr in self.initializers.items():
            arr.setflags(write=False)  # weights stay read-only, as add_initializer keeps them
            self._values[name] = Value(name, TensorType(tuple(int(d) for d in arr.shape), str(arr.dtype)))
        for op, ins, outs, types in state["nodes"]:
            self.add_multi_node(op, ins, outs, types)
        self.outputs = state["outputs"]
        self._fresh = dict(state["fresh"])
        self.assumptions = list(state.get("assumptions", ()))

    def replace_uses(self, old: ValueLike, new: ValueLike) -> None:
        """Make every reader of ``old`` (nodes and graph outputs) read ``new`` instead: O(readers).

        ``new`` must be defined before every reader of ``old``; the node that
        computes ``new`` keeps reading ``old`` (insert a node, then redirect).
        """
        old_n, new_n = _name_of(old), _name_of(new)
        ov, nv = self.value(old_n), self.value(new_n)
        if ov.type != nv.type:
            raise GraphError(f"cannot replace {old_n!r} ({ov.type}) by {new_n!r} ({nv.type}): types differ")
        for node, count in list(ov.users.items()):
            if node is nv.producer:
                continue  # ``new`` computed from ``old`` (insert, then redirect): it keeps reading ``old``
            node.inputs = tuple(new_n if i == old_n else i for i in node.inputs)
            nv.users[node] = nv.users.get(node, 0) + count
            del ov.users[node]
            self._touch(node.name)
        if old_n in self._output_uses:
            self._outputs = [new_n if o == old_n else o for o in self._outputs]
            self._output_uses = {o: 1 for o in self._outputs}
        for v in (ov, nv):
            if v.producer is not None:
                self._touch(v.producer.name)

    def rename_value(self, old: str, new: str) -> None:
        """Give value ``old`` the unused name ``new`` everywhere (readers, outputs, its node): O(readers)."""
        v = self.value(old)
        self._claim(new)
        del self._values[old]
        v.name = new
        self._values[new] = v
        for node in v.users:
            node.inputs = tuple(new if i == old else i for i in node.inputs)
        if old in self._output_uses:
            self._outputs = [new if o == old else o for o in self._outputs]
            self._output_uses = {o: 1 for o in self._outputs}
        if old in self.initializers:
            self.initializers[new] = self.initializers.pop(old)
        if old in self._inputs:
            self._inputs = [new if i == old else i for i in self._inputs]
        p = v.producer
        if p is not None:
            p.outputs = tuple(new if o == old else o for o in p.outputs)
            if p.name == old:
                del self._nodes[old]
                p.name = new
                self._nodes[new] = p
            self._touch(p.name)

    def substitute(self, node: str, replacements: Mapping[str, ValueLike]) -> None:
        """Replace node ``node`` by values built before it: each output's readers move to its
        replacement, which then takes the output's name (so graph outputs and names survive)."""
        n = self._nodes[node]
        if set(replacements) != set(n.outputs):
            raise GraphError(f"substitute {node!r}: give a replacement for each output {list(n.outputs)}")
        pairs = [(o, _name_of(replacements[o])) for o in n.outputs]
        for o, r in pairs:
            self.replace_uses(o, r)
        self.remove_node(node)
        for o, r in pairs:
            if self.producer(r) is not None:  # an input or weight keeps its own name
                self.rename_value(r, o)

    def set_inputs(self, node: str, inputs: Sequence[ValueLike]) -> None:
        """Rewire ``node`` to read ``inputs`` (its type is re-checked by :meth:`verify`)."""
        n = self._nodes[node]
        for i in n.inputs:
            self._drop_use(i, n)
        n.inputs = tuple(_operand_name(self, v) for v in inputs)
        for i in n.inputs:
            if i in self._values:
                self._add_use(i, n)
        self._touch(node)

    def redefine(self, name: str, op: Op, inputs: Sequence[ValueLike]) -> None:
        """Replace the op and operands of node ``name``, keeping its outputs, their types and readers.

        The new definition must infer exactly the old types, so readers stay valid.
        """
        node = self._nodes[name]
        names = tuple(_operand_name(self, v) for v in inputs)
        types = self._infer(name, op, names)
        old = tuple(self._values[o].type for o in node.outputs)
        if types != old:
            shown = ", ".join(map(str, types))
            raise GraphError(f"cannot redefine {name!r} as {op}: it would be {shown}, not {', '.join(map(str, old))}")
        node.op = op
        self.set_inputs(name, names)

    def insert_before(self, anchor: str, op: Op, inputs: Sequence[ValueLike], base_name: str) -> Value:
        """Add a node (named ``base_name`` or a fresh variant) just before node ``anchor``."""
        return self.add_node(op, inputs, self.fresh_name(base_name), before=anchor if anchor in self._nodes else None)

    def move_before(self, name: str, anchor: str) -> None:
        """Move node ``name`` to just before node ``anchor`` (the caller keeps every value defined before its readers)."""
        node = self._nodes[name]
        self._unlink(node)
        self._link_before(node, self._nodes[anchor])
        self._touch(name)

    def remove_node(self, name: str) -> None:
        """Delete node ``name`` and its output values; none may have readers left."""
        node = self._nodes[name]
        for o in node.outputs:
            if self.use_count(o):
                raise GraphError(f"cannot remove node {name!r}: its output {o!r} still has {self.use_count(o)} reader(s)")
        for i in node.inputs:
            self._drop_use(i, node)
        self._unlink(node)
        del self._nodes[name]
        for o in node.outputs:
            del self._values[o]
        if self._touched is not None:
            self._touched.discard(name)

    def replace_with_constant(self, name: str, array: np.ndarray) -> None:
        """Turn single-output node ``name`` into an initializer holding ``array`` (same name and type; readers unchanged)."""
        node = self._nodes[name]
        arr = np.asarray(array)
        t = self._values[node.output].type
        if (tuple(arr.shape), str(arr.dtype)) != (t.shape, t.dtype):
            raise GraphError(f"cannot replace {name!r} ({t}) by a constant of {arr.dtype}{list(arr.shape)}")
        if arr.flags.writeable:
            arr = np.array(arr, copy=True)
            arr.setflags(write=False)
        for i in node.inputs:
            self._drop_use(i, node)
        self._unlink(node)
        del self._nodes[name]
        self._values[name].producer = None
        self.initializers[name] = arr
        for reader in self._values[name].users:
            self._touch(reader.name)

    def map_dims(self, fn: Callable[[Dim], Dim]) -> None:
        """Replace every dim the graph holds by ``fn(dim)``: value shapes, op attributes that are dims (offsets, target
        shapes, bounds) and assumptions.  An importer that proves two symbols equal renames one of them this way."""
        for v in self._values.values():
            shape = tuple(fn(d) for d in v.type.shape)
            if shape != v.type.shape:
                v.type = TensorType(shape, v.type.dtype)
        for node in self._nodes.values():
            node.op = map_op_dims(node.op, fn)
        self.assumptions = [(fn(a), fn(b)) for a, b in self.assumptions]

    def mark(self) -> GraphMark:
        """The graph's extent now (O(1)): :meth:`roll_back` removes whatever is added after it."""
        return GraphMark(len(self._nodes), len(self.initializers))

    def roll_back(self, mark: GraphMark) -> None:
        """Remove the nodes and initializers added (or renamed) since ``mark``, readers first."""
        added = set(list(self._nodes)[mark.nodes :])
        for node in reversed(self.topological_order()):
            if node.name in added:
                self.remove_node(node.name)
        for name in list(self.initializers)[mark.initializers :]:
            self.remove_initializer(name)

    def remove_initializer(self, name: str) -> None:
        """Delete an unused initializer."""
        if self.use_count(name):
            raise GraphError(f"cannot remove initializer {name!r}: it is still read")
        del self.initializers[name]
        del self._values[name]

    def _check_acyclic(self) -> nx.DiGraph:
        dag = self.to_networkx()
        if not nx.is_directed_acyclic_graph(dag):
            cycle = nx.find_cycle(dag)
            raise CycleError(f"graph {self.name!r} has a cycle: {' -> '.join(a for a, _ in cycle)} -> {cycle[0][0]}")
        return dag

    # ----------------------------------------------------------- validation
    def verify(self) -> None:
        """Check the whole graph; raise the typed error of the first problem found.

        Checks: undefined values, cycles and the node order, op attributes and
        arity, einsum specs, shapes and dtypes against inference, initializers
        against their declared types, the users lists, and that there is at
        least one output.
        """
        defined = set(self._inputs) | set(self.initializers)
        for node in self._walk():
            for i, inp in enumerate(node.inputs):
                if inp not in self._values:
                    raise UndefinedValueError(f"node {node.name!r} ({node.op.kind}): operand {i} {inp!r} is used but never defined")
                if inp not in defined:
                    self._check_acyclic()
                    raise GraphError(f"node {node.name!r} reads {inp!r}, which is defined after it (a node must come after the values it reads)")
            defined.update(node.outputs)
        if not self._outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        bound = {s for n in self._inputs for d in self._values[n].type.shape for s in dim_symbols(d)} if self.assumptions else set()
        for a, b in self.assumptions:
            if not (dim_symbols(a) | dim_symbols(b)) <= bound:
                raise GraphError(
                    f"graph {self.name!r} assumes {a} == {b}, but its inputs do not size {sorted((dim_symbols(a) | dim_symbols(b)) - bound)}"
                )
        for out in self._outputs:
            if out not in self._values:
                raise UndefinedValueError(f"graph output {out!r} is never defined")
        for name, arr in self.initializers.items():
            t = self._values[name].type
            if tuple(arr.shape) != t.shape or str(arr.dtype) != t.dtype:
                raise ShapeMismatchError(f"initializer {name!r} holds {arr.dtype}{list(arr.shape)} but is declared {t}")
        users: dict[str, dict[Node, int]] = {}
        for node in self._walk():
            for inp in node.inputs:
                users.setdefault(inp, {}).setdefault(node, 0)
                users[inp][node] += 1
            expected = self._infer(node.name, node.op, node.inputs)
            for o, t in zip(node.outputs, expected):
                declared = self._values[o].type
                which = f" (output {o!r})" if len(node.outputs) > 1 else ""
                if t.dtype != declared.dtype:
                    raise DTypeMismatchError(f"node {node.name!r} ({node.op}){which}: declared dtype {declared.dtype} but the op gives {t.dtype}")
                if t.shape != declared.shape:
                    raise ShapeMismatchError(
                        f"node {node.name!r} ({node.op}){which}: declared shape {format_shape(declared.shape)} but the op gives "
                        f"{format_shape(t.shape)}"
                    )
        for name, v in self._values.items():
            if v.users != users.get(name, {}):
                raise GraphError(f"internal: the users of {name!r} are out of date")

    # ---------------------------------------------------------------- text
    def __str__(self) -> str:
        lines = [f"graph {self.name}("]
        for name in self._inputs:
            lines.append(f"    {name}: {self._values[name].type}")
        lines.append(") {")
        for name in sorted(self.initializers):
            lines.append(f"  const {name}: {self._values[name].type}")
        for a, b in self.assumptions:
            lines.append(f"  assume {a} == {b}")
        for node in self._walk():
            outs = ", ".join(f"{o}: {self._values[o].type}" for o in node.outputs)
            lines.append(f"  {outs} = {node.op}({', '.join(node.inputs)})")
        lines.append(f"  return {', '.join(self._outputs)}")
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<Graph {self.name!r}: {len(self._inputs)} inputs, {len(self.initializers)} initializers, "
            f"{len(self._nodes)} nodes, {len(self._outputs)} outputs>"
        )

    def op_counts(self) -> dict[str, int]:
        """How many nodes of each op kind the graph holds."""
        counts: dict[str, int] = {}
        for node in self._nodes.values():
            counts[node.op.kind] = counts.get(node.op.kind, 0) + 1
        return dict(sorted(counts.items()))


class _Sentinel(Op):
    """The list head's placeholder op (never in a graph's node table)."""

    def attributes(self) -> dict[str, Any]:
        return {}
