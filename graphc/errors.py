"""Exception types raised by graphc.

Every error graphc raises on bad input derives from :class:`GraphcError`, so a
caller can catch one type.  Each kind of mistake has its own subclass, and the
subclasses also derive from the matching builtin (``ValueError``, ``KeyError``
...) so that generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "GraphcError",
    "AttentionConfigError",
    "WeightError",
    "UnknownNameError",
    "DimError",
    "EinsumSpecError",
    "GraphError",
    "DuplicateNameError",
    "UndefinedValueError",
    "CycleError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "OpError",
    "SerializationError",
    "InputError",
    "ExecutionError",
    "OptimizerError",
    "ExportError",
    "OnnxImportError",
    "ResourceLimitError",
    "ShardingError",
    "BackendError",
    "BackendUnavailableError",
]


class GraphcError(Exception):
    """Base class of every error graphc raises on purpose."""


class AttentionConfigError(GraphcError, ValueError):
    """An :class:`~graphc.attention.AttentionConfig` is inconsistent."""


class WeightError(GraphcError, ValueError):
    """User-supplied layer weights are missing, unexpected, or of the wrong shape or dtype."""


class UnknownNameError(GraphcError, KeyError):
    """A name looked up in a registry (preset, backend, pass, optimizer) is unknown.

    The message lists the valid names.
    """

    def __init__(self, kind: str, name: str, valid: list[str] | tuple[str, ...]) -> None:
        self.kind = kind
        self.name = name
        self.valid = tuple(valid)
        super().__init__(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(self.valid)}")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DimError(GraphcError, ValueError):
    """A dimension is malformed, or a symbolic dimension cannot be bound consistently."""


class EinsumSpecError(GraphcError, ValueError):
    """An einsum specification is malformed or does not fit its operands."""


class GraphError(GraphcError, ValueError):
    """A graph is structurally invalid (base of the verification errors)."""


class DuplicateNameError(GraphError):
    """Two values (inputs, initializers or node outputs) share one name."""


class UndefinedValueError(GraphError):
    """A node or graph output refers to a value that is not defined before it."""


class CycleError(GraphError):
    """The graph's nodes form a cycle."""


class ShapeMismatchError(GraphError):
    """A value's declared shape disagrees with what its op infers, or operands do not fit."""


class DTypeMismatchError(GraphError):
    """A value's declared dtype disagrees with what its op infers, or operands disagree."""


class OpError(GraphError):
    """An op payload has invalid attributes (bad axis, bad permutation ...)."""


class SerializationError(GraphcError, ValueError):
    """A saved graph cannot be read: malformed JSON, unknown op, wrong field types."""


class InputError(GraphcError, ValueError):
    """Arrays passed to run a graph do not match its inputs (missing, extra, dtype, shape)."""


class ExecutionError(GraphcError, RuntimeError):
    """A node failed while a backend executed it; ``node`` names it and ``__cause__`` holds the error."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class OptimizerError(GraphcError, RuntimeError):
    """An optimization pass produced an invalid graph or did not converge."""


class ExportError(GraphcError, ValueError):
    """A graph cannot be expressed in ONNX with the requested options."""


class OnnxImportError(GraphcError, ValueError):
    """An ONNX model cannot be imported: unreadable file, unsafe external data, unknown opset, an op or shape graphc cannot express (``--strict``)."""


class ResourceLimitError(GraphcError, MemoryError):
    """An allocation graphc was asked for exceeds its memory cap (:mod:`graphc.memory`); ``nbytes`` and ``cap`` say by how much."""

    def __init__(self, message: str, nbytes: int = 0, cap: int = 0) -> None:
        super().__init__(message)
        self.nbytes = nbytes
        self.cap = cap


class ShardingError(GraphcError, ValueError):
    """A graph cannot be split into the requested shards (a shard count that does not divide the heads, an op with no sharding rule)."""


class BackendError(GraphcError, RuntimeError):
    """A backend failed to set up or run (for example a silent fallback to another device)."""


class BackendUnavailableError(BackendError):
    """A backend's library or device is not present on this machine; ``reason`` says why."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"backend {backend!r} is unavailable: {reason}")
        self.backend = backend
        self.reason = reason
