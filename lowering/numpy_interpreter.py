"""The NumPy interpreter: the reference semantics of every graphc op.

An environment dict maps value names to arrays; a dispatch table maps each op
type to a kernel.  Nodes run in the graph's deterministic topological order,
each value is dropped from the environment after its last reader, and a failing
node is re-raised as :class:`~graphc.errors.ExecutionError` naming the node and
its op, with the original exception as ``__cause__``.

``compute_dtype="float64"`` runs every float value in float64 (inputs and
weights are upcast), which is what the comparisons use as the reference.

Two kernel fusions: an attention chain (QK^T einsum, scale, mask, softmax, PV
einsum, with views between) runs as one row-blocked kernel that never
materialises the scores (:mod:`lowering.attention_kernel`); any other
``CausalMask`` read only by a last-axis ``Softmax`` runs fused with it
(:func:`~lowering.kernels.masked_softmax`).  Both use ``threads`` threads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from graphc.dims import eval_dim, eval_shape
from graphc.errors import ExecutionError, GraphcError
from graphc.graph import Graph, Node
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

from .attention_kernel import BlockedAttention, blocked_attention, find_blocked_attention
from .contraction import contract
from .inputs import check_inputs
from .kernels import hidden_keys, masked_softmax

__all__ = ["NumpyInterpreter", "KERNELS", "causal_mask", "safe_softmax", "run_numpy"]


@dataclass
class Context:
    """What a kernel may need beyond its operands."""

    env: dict[str, int]  # symbolic dim bindings
    compute_dtype: str | None
    threads: int | None = None


def causal_mask(x: np.ndarray, offset: int) -> np.ndarray:
    """Return ``x`` with ``x[..., i, j] = -inf`` where ``j > i + offset``."""
    sq, sk = x.shape[-2:]
    return np.where(hidden_keys(0, sq, sk, offset), np.array(-np.inf, x.dtype), x)


def safe_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax along ``axis``; a row of all ``-inf`` gives zeros instead of NaN."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, np.zeros((), x.dtype))
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s == 0, np.ones((), x.dtype), s)


def _softmax(op: Softmax, x: np.ndarray, ctx: Context, offset: int | None = None) -> np.ndarray:
    if op.axis % x.ndim == x.ndim - 1 and x.ndim >= 2:
        return masked_softmax(x, offset, ctx.threads)
    return safe_softmax(x, op.axis)


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
    Softmax: lambda op, a, ctx: _softmax(op, a[0], ctx),  # type: ignore[arg-type]
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

    def __init__(self, graph: Graph, compute_dtype: str | None = None, threads: int | None = None, fuse: bool = True) -> None:
        if compute_dtype is not None and compute_dtype not in FLOAT_DTYPES:
            raise GraphcError(f"compute_dtype must be one of {FLOAT_DTYPES} or None, got {compute_dtype!r}")
        self.graph = graph
        self.compute_dtype = compute_dtype
        self.threads = threads
        self.order = graph.topological_order()
        self._attention = {a.anchor: a for a in find_blocked_attention(graph)} if fuse else {}
        self._skipped = {n for a in self._attention.values() for n in a.skipped}
        self.order = [n for n in self.order if n.name not in self._skipped]
        # CausalMask -> last-axis Softmax pairs run as one kernel: mask name -> softmax name
        self._fused_mask: dict[str, str] = {}
        for node in self.order if fuse else []:
            if isinstance(node.op, CausalMask) and node.name not in graph.outputs:
                readers = graph.consumers(node.name)
                if len(readers) == 1 and isinstance(readers[0].op, Softmax) and readers[0].op.axis in (-1, graph.types[node.name].rank - 1):
                    self._fused_mask[node.name] = readers[0].name
        self._mask_of = {s: m for m, s in self._fused_mask.items()}
        keep = set(graph.outputs)
        self._free_after: list[list[str]] = [[] for _ in self.order]
        last: dict[str, int] = {}
        for idx, node in enumerate(self.order):
            for name in self._reads(node):
                last[name] = idx
        for name, idx in last.items():
            if name not in keep:
                self._free_after[idx].append(name)
        self._weights = {k: self._cast(v) for k, v in graph.initializers.items()}

    def _reads(self, node: Node) -> tuple[str, ...]:
        a = self._attention.get(node.name)
        return (a.q, a.k, a.v) if a else node.inputs  # a fused chain reads Q, K, V at its anchor

    def _run_attention(self, a: BlockedAttention, env: dict[str, np.ndarray], ctx: Context) -> np.ndarray:
        offset = None if a.offset is None else eval_dim(a.offset, ctx.env)
        q, k, v = env[a.q].transpose(a.q_perm), env[a.k].transpose(a.k_perm), env[a.v].transpose(a.v_perm)
        return blocked_attention(q, k, v, eval_dim(a.query_len, ctx.env), offset, a.scale, ctx.threads)

    def _cast(self, arr: np.ndarray) -> np.ndarray:
        if self.compute_dtype and str(arr.dtype) in FLOAT_DTYPES:
            return arr.astype(self.compute_dtype, copy=False)
        return arr

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on ``feeds`` (checked first) and return its outputs by name."""
        ctx = Context(check_inputs(self.graph, feeds), self.compute_dtype, self.threads)
        env: dict[str, np.ndarray] = dict(self._weights)
        env.update({k: self._cast(np.asarray(v)) for k, v in feeds.items()})
        for idx, node in enumerate(self.order):
            try:
                if node.name in self._attention:
                    env[node.name] = self._run_attention(self._attention[node.name], env, ctx)
                elif node.name in self._fused_mask:  # computed by its softmax; pass the scores through
                    env[node.name] = env[node.inputs[0]]
                elif node.name in self._mask_of:
                    mask = self.graph.nodes[self._mask_of[node.name]]
                    offset = eval_dim(mask.op.offset, ctx.env)  # type: ignore[attr-defined]
                    env[node.name] = _softmax(node.op, env[node.inputs[0]], ctx, offset)  # type: ignore[arg-type]
                else:
                    env[node.name] = KERNELS[type(node.op)](node.op, [env[i] for i in node.inputs], ctx)
            except Exception as e:  # noqa: BLE001 - re-raised with the node attached
                shapes = ", ".join(f"{i}{list(env[i].shape)}" for i in node.inputs if i in env)
                raise ExecutionError(f"node {node.name!r} ({node.op}) failed on operands {shapes}: {type(e).__name__}: {e}", node.name) from e
            for name in self._free_after[idx]:
                env.pop(name, None)
        return {o: np.asarray(env[o]) for o in self.graph.outputs}


def run_numpy(
    graph: Graph, feeds: Mapping[str, np.ndarray], compute_dtype: str | None = None, threads: int | None = None
) -> dict[str, np.ndarray]:
    """One-shot convenience: ``NumpyInterpreter(graph, compute_dtype, threads).run(feeds)``."""
    return NumpyInterpreter(graph, compute_dtype, threads).run(feeds)
