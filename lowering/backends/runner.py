"""``Runner``: a graph prepared for one backend, the one protocol every backend's ``prepare`` returns.

Besides :meth:`Runner.run` (NumPy arrays in and out, checked), a runner serves a decode
loop: :meth:`Runner.new_cache` makes the backend's own KV cache (:mod:`lowering.decode.kv_cache`)
and :meth:`Runner.step` runs one step with it, keeping the outputs the cache takes in the
backend's own form (onnxruntime's ``OrtValue`` s, NumPy's growing buffers).
:class:`~lowering.distributed.sharded.ShardedRunner` serves the same protocol (:class:`DecodeRunner`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from graphc.errors import ExecutionError, GraphcError
from graphc.graph import Graph

from .inputs import InputChecker
from ..decode.kv_cache import ArrayKVCache, KVCache, LMInterface

__all__ = ["Runner", "DecodeRunner", "CacheMaker", "StepFn"]

CacheMaker = Callable[[LMInterface, int, int], KVCache]
"""``make(lm, batch, capacity)``: a backend's KV cache for a decode loop (``capacity``: positions to make room for at first)."""

StepFn = Callable[[Mapping[str, Any], Sequence[str] | Mapping[str, Any]], dict[str, Any]]
"""``step(inputs, keep)``: one run whose inputs may be a cache's values; outputs in ``keep`` stay in the backend's form
(written into the values ``keep`` maps them to, where it is a mapping and the backend can)."""


class DecodeRunner(Protocol):
    """What :func:`lowering.generate` needs of a runner: a name, a description, a cache, a step, and the model it was made for."""

    backend: str

    @property
    def provider(self) -> str:
        """What runs the steps, in words."""
        ...

    def new_cache(self, lm: LMInterface, batch: int, capacity: int) -> KVCache:
        """An empty KV cache of this backend for ``batch`` sequences."""
        ...

    def step(self, inputs: Mapping[str, Any], keep: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
        """Run one decode step; the outputs in ``keep`` come back as the backend holds them, the rest as NumPy arrays."""
        ...

    def prepared_for(self, graph: Graph) -> bool:
        """True when the runner computes ``graph`` (same structure; weights are not compared)."""
        ...


@dataclass
class Runner:
    """A graph prepared for one backend: call :meth:`run` as often as needed."""

    backend: str
    provider: str
    graph: Graph
    _fn: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
    session: Any = field(default=None, repr=False)
    """The backend's own session where callers may keep tensors on the backend between runs
    (onnxruntime's ``InferenceSession`` in this process, with the graph's own interface dtypes); else None."""
    weights: str = field(default="", repr=False)
    """Where the backend keeps the weights, when it says (onnxruntime: inline, read from the checkpoint files, handed over)."""
    caches: CacheMaker | None = field(default=None, repr=False)
    """The backend's KV cache for decode loops; None: the arrays a step returns are fed back (:class:`~lowering.decode.kv_cache.ArrayKVCache`)."""
    stepper: StepFn | None = field(default=None, repr=False)
    """The backend's decode step over its cache's values; None: :meth:`run`."""
    _check: InputChecker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check = InputChecker(self.graph)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check ``inputs`` against the graph, run, and return the outputs by name."""
        self._check(inputs)
        return self._guarded(self._fn, inputs)

    def new_cache(self, lm: LMInterface, batch: int, capacity: int) -> KVCache:
        """An empty KV cache of this backend for ``batch`` sequences, with room for ``capacity`` positions where it grows in place."""
        return self.caches(lm, batch, capacity) if self.caches is not None else ArrayKVCache(lm, batch, capacity=capacity)

    def step(self, inputs: Mapping[str, Any], keep: Sequence[str] | Mapping[str, Any] = ()) -> dict[str, Any]:
        """One decode step: :meth:`run`, or the backend's own step where its cache holds values NumPy cannot check."""
        stepper = self.stepper
        if stepper is None:
            return self.run(inputs)
        return self._guarded(lambda feeds: stepper(feeds, keep), inputs)

    def prepared_for(self, graph: Graph) -> bool:
        """True when this runner was prepared for ``graph`` or a graph of the same structure (weights are not compared)."""
        return self.graph is graph or str(self.graph) == str(graph)

    def _guarded(self, fn: Callable[[Mapping[str, Any]], dict[str, Any]], inputs: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return fn(inputs)
        except GraphcError:
            raise
        except Exception as e:  # noqa: BLE001 - a backend library's own error, wrapped
            raise ExecutionError(f"backend {self.backend!r} failed on graph {self.graph.name!r}: {type(e).__name__}: {e}") from e
