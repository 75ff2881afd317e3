"""The NumPy interpreter: the reference semantics of every graphc op.

An environment dict maps value names to arrays; a dispatch table maps each op
type to a kernel.  Nodes run in the graph's deterministic topological order,
each value is dropped from the environment after its last reader, and a failing
node is re-raised as :class:`~graphc.errors.ExecutionError` naming the node and
its op, with the original exception as ``__cause__``.

``compute_dtype="float64"`` runs every float value in float64 (inputs and
weights are upcast), which is what the comparisons use as the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from graphc.dims import eval_dim, eval_shape
from graphc.errors import ExecutionError, GraphcError
from graphc.graph import Graph
from graphc.ops import (
    FLOAT_DTYPES,
    Binary,
    CausalMask,
    Cast,
    Concat,
    Einsum,
    Op,
    Repeat,
    Reshape,
    Scale,
    Softmax,
    Transpose,
    Unary,
    Where,
)

from .contraction import contract
from .inputs import check_inputs

__all__ = ["NumpyInterpreter", "KERNELS", "causal_mask", "safe_softmax", "run_numpy"]


@dataclass
class Context:
    """What a kernel may need beyond its operands."""

    env: dict[str, int]  # symbolic dim bindings
    compute_dtype: str | None


def causal_mask(x: np.ndarray, offset: int) -> np.ndarray:
    """Return ``x`` with ``x[..., i, j] = -inf`` where ``j > i + offset``."""
    sq, sk = x.shape[-2:]
    masked = np.arange(sk)[None, :] > (np.arange(sq)[:, None] + offset)
    return np.where(masked, np.array(-np.inf, x.dtype), x)


def safe_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax along ``axis``; a row of all ``-inf`` gives zeros instead of NaN."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, np.zeros((), x.dtype))
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s == 0, np.ones((), x.dtype), s)


def _float_dtype(dtype: str, ctx: Context) -> np.dtype:
    return np.dtype(ctx.compute_dtype if ctx.compute_dtype and dtype in FLOAT_DTYPES else dtype)


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp,
    "neg": np.negative,
    "tanh": np.tanh,
    "sqrt": np.sqrt,
    "reciprocal": np.reciprocal,
    "relu": lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "max": np.maximum,
}

Kernel = Callable[[Op, list[np.ndarray], Context], np.ndarray]

KERNELS: dict[type[Op], Kernel] = {
    Einsum: lambda op, a, ctx: contract(op.parsed, *a),  # type: ignore[attr-defined]
    Reshape: lambda op, a, ctx: a[0].reshape(eval_shape(op.shape, ctx.env)),  # type: ignore[attr-defined]
    Transpose: lambda op, a, ctx: a[0].transpose(op.perm),  # type: ignore[attr-defined]
    Repeat: lambda op, a, ctx: np.repeat(a[0], op.repeats, axis=op.axis),  # type: ignore[attr-defined]
    Softmax: lambda op, a, ctx: safe_softmax(a[0], op.axis),  # type: ignore[attr-defined]
    Concat: lambda op, a, ctx: np.concatenate(a, axis=op.axis),  # type: ignore[attr-defined]
    Cast: lambda op, a, ctx: a[0].astype(_float_dtype(op.dtype, ctx)),  # type: ignore[attr-defined]
    Unary: lambda op, a, ctx: _UNARY[op.fn](a[0]),  # type: ignore[attr-defined]
    Binary: lambda op, a, ctx: _BINARY[op.fn](a[0], a[1]),  # type: ignore[attr-defined]
    Where: lambda op, a, ctx: np.where(a[0], a[1], a[2]),
    Scale: lambda op, a, ctx: a[0] * np.array(op.factor, a[0].dtype),  # type: ignore[attr-defined]
    CausalMask: lambda op, a, ctx: causal_mask(a[0], eval_dim(op.offset, ctx.env)),  # type: ignore[attr-defined]
}


class NumpyInterpreter:
    """Runs a graph with NumPy. Build once, call :meth:`run` many times."""

    def __init__(self, graph: Graph, compute_dtype: str | None = None) -> None:
        if compute_dtype is not None and compute_dtype not in FLOAT_DTYPES:
            raise GraphcError(f"compute_dtype must be one of {FLOAT_DTYPES} or None, got {compute_dtype!r}")
        self.graph = graph
        self.compute_dtype = compute_dtype
        self.order = graph.topological_order()
        keep = set(graph.outputs)
        self._free_after: list[list[str]] = [[] for _ in self.order]
        last: dict[str, int] = {}
        for idx, node in enumerate(self.order):
            for name in node.inputs:
                last[name] = idx
        for name, idx in last.items():
            if name not in keep:
                self._free_after[idx].append(name)
        self._weights = {k: self._cast(v) for k, v in graph.initializers.items()}

    def _cast(self, arr: np.ndarray) -> np.ndarray:
        if self.compute_dtype and str(arr.dtype) in FLOAT_DTYPES:
            return arr.astype(self.compute_dtype, copy=False)
        return arr

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on ``feeds`` (checked first) and return its outputs by name."""
        ctx = Context(check_inputs(self.graph, feeds), self.compute_dtype)
        env: dict[str, np.ndarray] = dict(self._weights)
        env.update({k: self._cast(np.asarray(v)) for k, v in feeds.items()})
        for idx, node in enumerate(self.order):
            kernel = KERNELS[type(node.op)]
            try:
                env[node.name] = kernel(node.op, [env[i] for i in node.inputs], ctx)
            except Exception as e:  # noqa: BLE001 - re-raised with the node attached
                shapes = ", ".join(f"{i}{list(env[i].shape)}" for i in node.inputs if i in env)
                raise ExecutionError(f"node {node.name!r} ({node.op}) failed on operands {shapes}: {type(e).__name__}: {e}", node.name) from e
            for name in self._free_after[idx]:
                env.pop(name, None)
        return {o: np.asarray(env[o]) for o in self.graph.outputs}


def run_numpy(graph: Graph, feeds: Mapping[str, np.ndarray], compute_dtype: str | None = None) -> dict[str, np.ndarray]:
    """One-shot convenience: ``NumpyInterpreter(graph, compute_dtype).run(feeds)``."""
    return NumpyInterpreter(graph, compute_dtype).run(feeds)
