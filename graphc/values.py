"""The IR's values and nodes: :class:`Value` (a named, typed value with its producer and users) and :class:`Node`.

A leaf module: :mod:`graphc.graph` (the container that keeps them consistent) and
:mod:`graphc.builder` (the op-building methods a graph inherits) both import it, so
neither imports the other for a type.
"""

from __future__ import annotations

from typing import TypeVar

from .dims import Dim
from .errors import GraphError
from .ops import Op, TensorType

OpT = TypeVar("OpT", bound=Op)

__all__ = ["Value", "Node", "ValueLike"]


class Value:
    """A named value of a graph: its type, its producer (``None`` for inputs and
    initializers) and its users (node -> number of operand slots reading it)."""

    __slots__ = ("name", "type", "producer", "users")

    def __init__(self, name: str, type: TensorType, producer: Node | None = None) -> None:
        self.name = name
        self.type = type
        self.producer = producer
        self.users: dict[Node, int] = {}

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

    def __repr__(self) -> str:
        return f"<Value {self.name}: {self.type}>"


ValueLike = Value | str


class Node:
    """One operation: ``op`` applied to the values named ``inputs``, producing ``outputs``.

    Nodes are created and edited through their :class:`Graph` only (which keeps
    users and the order up to date); ``name`` is the first output's name.
    """

    __slots__ = ("name", "op", "inputs", "outputs", "_prev", "_next", "_key")

    def __init__(self, name: str, op: Op, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        self.name = name
        self.op = op
        self.inputs = inputs
        self.outputs = outputs
        self._prev: Node | None = None
        self._next: Node | None = None
        self._key = 0

    @property
    def output(self) -> str:
        """The single output's name (an error for multi-output nodes)."""
        if len(self.outputs) != 1:
            raise GraphError(f"node {self.name!r} ({self.op.kind}) has {len(self.outputs)} outputs; use node.outputs")
        return self.outputs[0]

    def op_as(self, kind: type[OpT]) -> OpT:
        """The node's op, checked to be a ``kind`` (a rule that matched the node by its op's class reads the payload typed)."""
        if not isinstance(self.op, kind):
            raise GraphError(f"node {self.name!r} is {self.op.kind}, not {kind.__name__}")
        return self.op

    def __str__(self) -> str:
        return f"{', '.join(self.outputs)} = {self.op}({', '.join(self.inputs)})"

    def __repr__(self) -> str:
        return f"<Node {self}>"
