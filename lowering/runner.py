"""``Runner``: a graph prepared for one backend, the one protocol every backend's ``prepare`` returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphc.errors import ExecutionError, GraphcError
from graphc.graph import Graph

from .inputs import InputChecker

__all__ = ["Runner"]


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
    _check: InputChecker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check = InputChecker(self.graph)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check ``inputs`` against the graph, run, and return the outputs by name."""
        self._check(inputs)
        try:
            return self._fn(inputs)
        except GraphcError:
            raise
        except Exception as e:  # noqa: BLE001 - a backend library's own error, wrapped
            raise ExecutionError(f"backend {self.backend!r} failed on graph {self.graph.name!r}: {type(e).__name__}: {e}") from e
