"""The NumPy interpreter: an environment loop that knows no particular op.

Each node runs through a kernel table: an op type maps to a fast kernel where
the interpreter has one (``Einsum`` as batched GEMMs, a last-axis ``Softmax``
blocked on a thread pool, ``Attention`` as the row-blocked kernel), and every
other op falls back to its own reference semantics (``op.evaluate_all``).
Nodes that read only weights (the float32 casts a low-precision graph's
weights get) run once when the interpreter is built, and weights nothing else
reads are dropped then (a memory-mapped checkpoint's pages with them).  Values are dropped
after their last reader, and a failing node is re-raised as
:class:`~graphc.errors.ExecutionError` naming the node and its op, with the
original exception as ``__cause__``.

``reference=True`` uses no fast kernel but the GEMM contraction: together with
a graph lowered for :data:`~graphc.optimizer.REFERENCE_TARGET` (attention
decomposed) this is the independent reference ``compare`` checks against.
``compute_dtype="float64"`` runs every float value in float64 (inputs and
weights are upcast).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from graphc.attention_op import Attention
from graphc.dims import Dim, dim_prod, dim_symbols, eval_dim, is_symbol, normalize_dim
from graphc.errors import ExecutionError, GraphcError
from graphc.graph import Graph
from graphc.mapped import release_pages
from graphc.ops import FLOAT_DTYPES, Cast, Einsum, Op, Softmax
from graphc.quantized import QuantizedMatMul
from graphc.tensor_ops import Gather

from ..kernels.attention_kernel import attention_kernel
from ..kernels.contraction import FEW_ROWS, contract
from .inputs import InputChecker
from ..kernels.softmax import blas_threads, default_threads, masked_softmax
from ..kernels.quantized import quantized_matmul
from ..kernels.thread_choice import ThreadChoice
from ..kernels.low_precision import LOW_PRECISION, MIN_STORED_BYTES, StoredWeight, contract_stored, keeps_stored

__all__ = ["NumpyInterpreter", "FAST_KERNELS", "REFERENCE_KERNELS", "run_numpy", "Kernel"]

Kernel = Callable[[Any, Sequence[np.ndarray], Mapping[str, int], "int | None"], tuple[np.ndarray, ...]]
"""``kernel(op, arrays, dims, threads) -> outputs``."""


def _einsum(op: Einsum, a: Sequence[np.ndarray], dims: Mapping[str, int], threads: int | None) -> tuple[np.ndarray, ...]:
    if any(isinstance(x, StoredWeight) for x in a):
        return (contract_stored(op.parsed, list(a), threads),)
    return (contract(op.parsed, *a, threads=threads),)


def _gather(op: Gather, a: Sequence[np.ndarray], dims: Mapping[str, int], threads: int | None) -> tuple[np.ndarray, ...]:
    if isinstance(a[0], StoredWeight):
        return (a[0].take(op, np.asarray(a[1])),)
    return (op.evaluate(a, dims),)


def _softmax(op: Softmax, a: Sequence[np.ndarray], dims: Mapping[str, int], threads: int | None) -> tuple[np.ndarray, ...]:
    x = a[0]
    if x.ndim >= 2 and op.axis % x.ndim == x.ndim - 1:
        return (masked_softmax(x, threads=threads),)
    return (op.evaluate(a, dims),)


REFERENCE_KERNELS: dict[type[Op], Kernel] = {Einsum: _einsum}
"""Reference mode: contractions as GEMMs, everything else the ops' own semantics."""

FAST_KERNELS: dict[type[Op], Kernel] = {
    **REFERENCE_KERNELS,
    Softmax: _softmax,
    Attention: attention_kernel,
    Gather: _gather,
    QuantizedMatMul: quantized_matmul,
}
"""The fast kernels; an op without one runs its reference semantics."""


class NumpyInterpreter:
    """Runs a graph with NumPy. Build once, call :meth:`run` many times.

    The graph should be lowered for the NumPy target first (``lowering.prepare``
    does that); any op without a kernel runs its reference semantics.
    """

    def __init__(self, graph: Graph, compute_dtype: str | None = None, threads: int | None = None, reference: bool = False) -> None:
        if compute_dtype is not None and compute_dtype not in FLOAT_DTYPES:
            raise GraphcError(f"compute_dtype must be one of {FLOAT_DTYPES} or None, got {compute_dtype!r}")
        self.graph = graph
        self.compute_dtype = compute_dtype
        self.threads = threads
        self.kernels = REFERENCE_KERNELS if reference else FAST_KERNELS
        self._keep_stored = not reference and compute_dtype is None
        # arrays, and a StoredWeight for each low-precision matrix kept as stored (see _stays_stored)
        self._weights: dict[str, Any] = {k: self._cast(v) for k, v in graph.initializers.items()}
        self._check = InputChecker(graph)
        self.order = self._precompute_constants(graph.topological_order())
        last: dict[str, int] = {}
        for idx, node in enumerate(self.order):
            for name in node.inputs:
                last[name] = idx
        self._free_after: list[list[str]] = [[] for _ in self.order]
        for name, idx in last.items():
            if not graph.is_output(name):
                self._free_after[idx].append(name)
        self._data_dims = _data_dependent_dims(graph, self.order)
        self._weight_rows = _weight_rows(graph, self.order, set(self._weights))
        self._few_row_threads = ThreadChoice(threads or default_threads())

    def _precompute_constants(self, order: list[Any]) -> list[Any]:
        """Run once, here, the nodes that read only weights (the float32 casts of low-precision weights); return the rest."""
        rest = []
        readers: dict[str, list[Any]] = {}
        for node in order:
            for i in node.inputs:
                readers.setdefault(i, []).append(node)
        for node in order:
            if node.inputs and all(i in self._weights for i in node.inputs) and not any(self.graph.is_output(o) for o in node.outputs):
                if self._keep_stored and self._stays_stored(node, readers):
                    self._weights[node.outputs[0]] = StoredWeight(self._weights[node.inputs[0]])
                    continue
                try:
                    results = self._run_node(node.op, [self._weights[i] for i in node.inputs], {})
                except Exception:  # noqa: BLE001 - e.g. a symbol bound only at run time: run it then, with the usual error
                    rest.append(node)
                    continue
                self._weights.update(zip(node.outputs, results))
                for i in node.inputs:  # read once: its pages need not stay resident (a later reader faults them back)
                    release_pages(self._weights[i])
            else:
                rest.append(node)
        still_read = {i for node in rest for i in node.inputs} | set(self.graph.outputs)
        for name in [n for n in self._weights if n not in still_read]:  # e.g. bfloat16 weights now held as float32
            del self._weights[name]
        return rest

    def _stays_stored(self, node: Any, readers: Mapping[str, list[Any]]) -> bool:
        """True for the float32 cast of a large low-precision matrix that only linear einsums and Gathers read
        (see :mod:`lowering.kernels.low_precision`)."""
        if not (isinstance(node.op, Cast) and node.op.dtype == "float32"):
            return False
        w = self._weights[node.inputs[0]]
        if not (isinstance(w, np.ndarray) and w.dtype.name in LOW_PRECISION and w.ndim == 2 and w.flags.c_contiguous):
            return False
        if w.nbytes < MIN_STORED_BYTES:
            return False
        users = readers.get(node.outputs[0], [])
        return bool(users) and all(keeps_stored(user, node.outputs[0]) for user in users)

    def _cast(self, arr: np.ndarray) -> np.ndarray:
        if self.compute_dtype and str(arr.dtype) in FLOAT_DTYPES:
            return arr.astype(self.compute_dtype, copy=False)
        return arr

    def _run_node(self, op: Op, args: list[np.ndarray], dims: Mapping[str, int], threads: int | None = None) -> tuple[np.ndarray, ...]:
        kernel = self.kernels.get(type(op))
        if kernel is not None:
            return kernel(op, args, dims, threads or self.threads)
        if isinstance(op, Cast) and self.compute_dtype and op.dtype in FLOAT_DTYPES:
            return (args[0].astype(self.compute_dtype),)
        return op.evaluate_all(args, dims)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on ``feeds`` (checked first) and return its outputs by name.

        Threads: in a run whose weight products have many rows (a prefill), graphc's own threads (``threads``, default
        the cores) do every parallel part: a large GEMM's blocks (:mod:`lowering.kernels.contraction`), attention's
        and softmax's row blocks, with BLAS held to one thread for the whole run, so no second pool spins beside
        graphc's and a core another process slows takes fewer blocks.  In a run of few rows (a decode step, bound by
        reading the weights) BLAS's own threads split each product: ``threads`` of them, or one where one ran such
        runs faster lately (another process busy on a core; :mod:`lowering.kernels.thread_choice`)."""
        dims = dict(self._check(feeds))
        rows = max((eval_dim(d, dims) for d in self._weight_rows if dim_symbols(d) <= dims.keys()), default=0)
        if rows > FEW_ROWS:
            with blas_threads(1):
                return self._run(feeds, dims, self.threads)

        def run_on(threads: int) -> dict[str, np.ndarray]:
            with blas_threads(threads):
                return self._run(feeds, dims, threads)

        return self._few_row_threads.timed(rows, run_on)

    def _run(self, feeds: Mapping[str, np.ndarray], dims: dict[str, int], threads: int | None) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = dict(self._weights)
        env.update({k: self._cast(v if isinstance(v, np.ndarray) else np.asarray(v)) for k, v in feeds.items()})  # a KV prefix stays one
        for idx, node in enumerate(self.order):
            try:
                results = self._run_node(node.op, [env[i] for i in node.inputs], dims, threads)
            except Exception as e:  # noqa: BLE001 - re-raised with the node attached
                shapes = ", ".join(f"{i}{list(env[i].shape)}" for i in node.inputs if i in env)
                raise ExecutionError(f"node {node.name!r} ({node.op}) failed on operands {shapes}: {type(e).__name__}: {e}", node.name) from e
            for name, value in zip(node.outputs, results):
                env[name] = value
            for out, axis, symbol in self._data_dims[idx]:  # a count only the data gives (a NonZero's): bound as computed
                dims[symbol] = int(results[out].shape[axis])
            for name in self._free_after[idx]:
                env.pop(name, None)
        return {o: env[o] if isinstance(env[o], np.ndarray) else np.asarray(env[o]) for o in self.graph.outputs}  # a KV prefix stays one


def run_numpy(
    graph: Graph, feeds: Mapping[str, np.ndarray], compute_dtype: str | None = None, threads: int | None = None, reference: bool = False
) -> dict[str, np.ndarray]:
    """One-shot convenience: ``NumpyInterpreter(graph, compute_dtype, threads, reference).run(feeds)`` (no lowering)."""
    return NumpyInterpreter(graph, compute_dtype, threads, reference).run(feeds)


def _weight_rows(graph: Graph, order: list[Any], weights: set[str]) -> set[Dim]:
    """The row counts (product of all but the last output axis) of the einsums that multiply by a weight, symbolic and
    distinct: what says whether a run is a prefill or a decode step."""
    rows: set[Dim] = set()
    for node in order:
        if isinstance(node.op, Einsum) and any(i in weights for i in node.inputs) and graph.types[node.outputs[0]].rank >= 2:
            rows.add(normalize_dim(dim_prod(graph.types[node.outputs[0]].shape[:-1])))
    return rows


def _data_dependent_dims(graph: Graph, order: list[Any]) -> list[list[tuple[int, int, str]]]:
    """Per node of ``order``: ``(output index, axis, symbol)`` for each symbol no input's shape binds that first
    appears as that axis of the node's output (a data-dependent count, e.g. an imported NonZero's ``unk``)."""
    bound = {s for name in graph.inputs for d in graph.types[name].shape for s in dim_symbols(d)}
    out: list[list[tuple[int, int, str]]] = []
    for node in order:
        here = []
        for i, name in enumerate(node.outputs):
            for axis, d in enumerate(graph.types[name].shape):
                if is_symbol(d) and str(d) not in bound:
                    bound.add(str(d))
                    here.append((i, axis, str(d)))
        out.append(here)
    return out
