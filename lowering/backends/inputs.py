"""Checking the arrays fed to a graph, and making random ones.

Every backend calls :func:`check_inputs` before anything runs, so a missing,
extra, mistyped or misshaped input (or a symbolic dimension bound to two
different sizes) fails with an :class:`~graphc.errors.InputError` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from graphc.dims import Dim, bind_shapes, check_sizes, dim_symbols, eval_dim, eval_shape
from graphc.errors import DimError, InputError
from graphc.graph import Graph
from graphc.memory import check_allocation

__all__ = [
    "check_inputs",
    "check_assumptions",
    "InputChecker",
    "check_arrays",
    "random_inputs",
    "symbol_bindings",
    "input_shapes",
    "input_bytes",
    "format_sizes",
]


def check_inputs(graph: Graph, feeds: Mapping[str, object]) -> dict[str, int]:
    """Validate ``feeds`` against ``graph.inputs`` and return the bindings of its symbolic dims."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"inputs must be a mapping from input name to array, got {type(feeds).__name__}")
    missing = [n for n in graph.inputs if n not in feeds]
    extra = sorted(n for n in feeds if n not in graph.inputs)
    if missing:
        raise InputError(f"missing input(s) {missing}; graph {graph.name!r} takes {graph.inputs}")
    if extra:
        raise InputError(f"unexpected input(s) {extra}; graph {graph.name!r} takes {graph.inputs}")
    dims = check_arrays({n: feeds[n] for n in graph.inputs}, graph.types, require_all=True)
    check_assumptions(graph.name, graph.assumptions, dims)
    return dims


def check_assumptions(name: str, assumptions: Sequence[tuple[Dim, Dim]], dims: Mapping[str, int]) -> None:
    """Raise :class:`InputError` when the sizes ``dims`` break one of a graph's assumptions (``Graph.assumptions``)."""
    for a, b in assumptions:
        if not (dim_symbols(a) | dim_symbols(b)) <= dims.keys():
            continue  # sizes of values the shards hold resident (checked when they were fed)
        x, y = eval_dim(a, dims), eval_dim(b, dims)
        if x != y:
            raise InputError(
                f"graph {name!r} is defined only where {a} == {b} (an assumption of the model it was imported from); with "
                f"{format_sizes(dims)} they are {x} and {y}"
            )


class InputChecker:
    """:func:`check_inputs` for one graph, remembering the bindings of the input signatures (names, dtypes, shapes) it has seen.

    A decode loop feeds the same shapes call after call: after the first, a
    call costs one pass over the inputs' dtypes and shapes instead of solving
    the symbolic dims again.  The graph's input types are read once, here.
    """

    MAX_SIGNATURES = 64

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._names = tuple(graph.inputs)
        self._known: dict[tuple, dict[str, int]] = {}

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, int]:
        """The symbol bindings of ``feeds``, checked as :func:`check_inputs` checks them."""
        try:
            key = tuple((feeds[n].dtype, feeds[n].shape) for n in self._names) if len(feeds) == len(self._names) else None
        except (KeyError, AttributeError, TypeError):
            key = None
        if key is not None and key in self._known and all(isinstance(feeds[n], np.ndarray) for n in self._names):
            return dict(self._known[key])
        dims = check_inputs(self.graph, feeds)
        if key is not None:
            if len(self._known) >= self.MAX_SIGNATURES:
                self._known.clear()
            self._known[key] = dict(dims)
        return dims


def check_arrays(arrays: Mapping[str, object], types: Mapping[str, Any], require_all: bool = False) -> dict[str, int]:
    """Check each array's type, dtype, rank and sizes against ``types[name]``; return the symbol bindings they imply."""
    env: dict[str, int] = {}
    items = []
    for name, arr in arrays.items():
        t = types[name]
        if not isinstance(arr, np.ndarray):
            raise InputError(f"input {name!r} must be a numpy.ndarray, got {type(arr).__name__}")
        if str(arr.dtype) != t.dtype:
            raise InputError(f"input {name!r} has dtype {arr.dtype}, expected {t.dtype}")
        items.append((t.shape, arr.shape, f"input {name!r}"))
    try:
        bind_shapes(items, env, require_all=require_all)
    except DimError as e:
        raise InputError(str(e)) from None
    return env


def symbol_bindings(graph: Graph, **sizes: int) -> dict[str, int]:
    """Check that ``sizes`` binds every symbol of the graph's inputs and return it as a dict."""
    sizes = check_sizes(sizes)
    needed = sorted({s for n in graph.inputs for d in graph.types[n].shape for s in dim_symbols(d)})
    missing = [s for s in needed if s not in sizes]
    if missing:
        raise InputError(f"sizes for symbolic dims {missing} are needed to make inputs for graph {graph.name!r} (its symbols: {needed})")
    return {s: int(sizes[s]) for s in needed}


def input_shapes(graph: Graph, sizes: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """The concrete shape of every input with symbols bound by ``sizes`` (every symbol must be bound)."""
    shapes = {}
    for name in graph.inputs:
        t = graph.types[name]
        for d in t.shape:
            if not dim_symbols(d) <= sizes.keys():
                raise InputError(f"cannot size input {name!r}: dim {d!r} has unbound symbols {sorted(dim_symbols(d) - sizes.keys())}")
        shape = eval_shape(t.shape, sizes)
        if any(n < 0 for n in shape):
            raise InputError(f"input {name!r} of shape {list(t.shape)} would have negative size {list(shape)} with {format_sizes(sizes)}")
        shapes[name] = shape
    return shapes


def input_bytes(graph: Graph, sizes: Mapping[str, int]) -> int:
    """Bytes of the graph's inputs with symbols bound by ``sizes``."""
    return sum(math.prod(shape) * np.dtype(graph.types[n].dtype).itemsize for n, shape in input_shapes(graph, sizes).items())


def format_sizes(sizes: Mapping[str, int]) -> str:
    """``{"batch": 1, "seq": 8}`` -> ``"batch=1, seq=8"``."""
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "static shapes"


def random_inputs(graph: Graph, seed: int = 0, **sizes: int) -> dict[str, np.ndarray]:
    """Random inputs for ``graph`` (standard normal floats, random bools), symbols bound by ``sizes``.

    Only bare symbols need a size; expression dims (``past_seq+seq``) are
    evaluated.  The inputs' bytes are checked against the memory cap first
    (:mod:`graphc.memory`).
    """
    env = symbol_bindings(graph, **sizes)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be an int >= 0, got {seed!r}")
    shapes = input_shapes(graph, env)
    check_allocation(input_bytes(graph, env), f"random inputs for graph {graph.name!r} with {format_sizes(env)}")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        t = graph.types[name]
        # drawn in the input's own width (float16 via float32), never in float64 first
        if t.dtype == "bool":
            out[name] = rng.random(shape, dtype=np.float32) < 0.8
        elif t.dtype.startswith("int"):
            out[name] = rng.integers(0, 10, shape, dtype=t.dtype)
        elif t.dtype in ("float16", "bfloat16"):
            out[name] = rng.standard_normal(shape, dtype=np.float32).astype(t.dtype)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.dtype(t.dtype).type)  # float32 draws as float32 (other numbers than a cast)
    return out
