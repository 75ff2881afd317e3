"""A decode loop's KV cache as an object of the backend that runs the steps.

A causal LM step (:func:`graphc.causal_lm_graph`) reads ``past_key_values.{i}.key/value`` and
returns ``present.{i}.key/value``; between steps the presents become the next pasts.
*Where* they live between steps is the backend's business, so each backend's runner makes its
own cache (:meth:`lowering.Runner.new_cache`):

- NumPy: buffers with room to grow, appended to in place by the attention kernel
  (:class:`ArrayKVCache` over :func:`lowering.decode.kv_buffers.allocate`);
- onnxruntime: ``OrtValue`` s that never come back to NumPy (:class:`lowering.backends.ort_backend.OrtKVCache`);
- sharded runs: after the first step, :class:`lowering.distributed.sharded.Resident` handles of the parts each
  shard keeps (an :class:`ArrayKVCache` fed back as the step returned it);
- any other backend: the plain arrays a step returns (:class:`ArrayKVCache`, the default).

The decode loop (:func:`lowering.generate`) knows only the :class:`KVCache` protocol and
:meth:`~lowering.Runner.step`: ``runner.step({**feeds, **cache.feeds()}, keep=cache.outputs)``,
then ``cache.advance(outputs)``.  A new backend brings its cache in its own module
(``tests/test_extending_decode.py`` adds one in one file).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["LMInterface", "KVCache", "ArrayKVCache", "EmptyCache", "zeros_cache"]


@dataclass(frozen=True)
class LMInterface:
    """What a decode loop needs to know of a causal LM graph: its layers' cache shapes, dtype and vocabulary."""

    n_layers: int
    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    cache_dtype: str
    vocab_size: int
    static: bool = False
    """A fixed-capacity cache (``cache_position`` input; presents of the pasts' shape, written in place where a backend can)."""

    @property
    def cache_names(self) -> list[tuple[str, str]]:
        """``(past input, present output)`` per layer, keys then values."""
        return [(f"past_key_values.{i}.{k}", f"present.{i}.{k}") for i in range(self.n_layers) for k in ("key", "value")]

    def cache_shape(self, past: str, batch: int) -> tuple[int, int, int]:
        """``(batch, kv_heads, head_dim)`` of one past input (its length axis left out)."""
        layer = int(past.split(".")[1])
        return batch, self.kv_heads[layer], self.head_dims[layer]


@runtime_checkable
class KVCache(Protocol):
    """One decode loop's cache on one backend: what a step is fed, and what it keeps of the step's outputs."""

    outputs: Sequence[str] | Mapping[str, Any]
    """The step outputs the cache takes (``present.*``): a runner's :meth:`~lowering.Runner.step` keeps them in the backend's own form.
    A mapping also names, for each, the backend value the step writes it into (a fixed-capacity cache's buffers)."""

    @property
    def length(self) -> int:
        """Positions the cache holds."""
        ...

    @property
    def capacity(self) -> int:
        """Positions it can hold without moving to larger storage (``length`` where it never grows in place)."""
        ...

    def feeds(self) -> dict[str, Any]:
        """The ``past_key_values.*`` inputs of the next step, in the form the runner's ``step`` takes."""
        ...

    def advance(self, outputs: Mapping[str, Any]) -> None:
        """Take the step's ``present.*`` (as ``step`` returned them) as the cache."""
        ...

    def close(self) -> None:
        """Let go of the cache's storage."""
        ...


EmptyCache = Callable[[int, int, int, int, str], Any]
"""``empty(batch, heads, length, head_dim, dtype)``: one layer's first past, zeros, in a backend's form (``length`` 0,
or a fixed-capacity cache's capacity)."""


def zeros_cache(batch: int, heads: int, length: int, head_dim: int, dtype: str) -> np.ndarray:
    """A first past as a NumPy array of zeros ``[batch, heads, length, head_dim]``."""
    return np.zeros((batch, heads, length, head_dim), dtype)


class ArrayKVCache:
    """The cache as whatever values a step returns, fed back as they are; the first pasts come from ``empty``
    (length 0, or ``capacity`` slots of zeros for a fixed-capacity cache: ``lm.static``)."""

    def __init__(self, lm: LMInterface, batch: int, empty: EmptyCache = zeros_cache, capacity: int = 0) -> None:
        self._names = lm.cache_names
        self.outputs: Sequence[str] | Mapping[str, Any] = tuple(present for _, present in self._names)
        length = capacity if lm.static else 0
        self._values: dict[str, Any] = {}
        for past, _ in self._names:
            b, h, d = lm.cache_shape(past, batch)
            self._values[past] = empty(b, h, length, d, lm.cache_dtype)

    @property
    def length(self) -> int:
        """Positions the cache holds (axis 2 of its first past)."""
        first = next(iter(self._values.values()), None)
        return 0 if first is None else int(first.shape[2])

    @property
    def capacity(self) -> int:
        """Room without a move: a buffer's full length where the value is a prefix of one (NumPy), else the length."""
        rooms = [getattr(v, "room", None) for v in self._values.values()]
        sizes = [r for r in rooms if isinstance(r, int)]
        return min(sizes) if rooms and len(sizes) == len(rooms) else self.length

    def feeds(self) -> dict[str, Any]:
        """The pasts, as the last step returned them."""
        return dict(self._values)

    def advance(self, outputs: Mapping[str, Any]) -> None:
        """The presents become the pasts."""
        self._values = {past: outputs[present] for past, present in self._names}

    def close(self) -> None:
        """Drop the values (a backend's storage goes with its last reference)."""
        self._values = {}
