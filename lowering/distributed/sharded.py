"""Running a :class:`~graphc.sharding.ShardPlan`: one driver loop over the stages, and where the shards run.

:class:`ShardedRunner` walks the stages in order.  Sharded stages run on the
executor's shards; replicated stages run in the driver process.  Values live
where they were made: the parts of a split value (a KV cache, say) stay on
their shards and are read there by later stages and later calls
(:class:`Resident`); the driver sends a shard only what the shard does not
hold (whole inputs, their slices, values a replicated stage made) and fetches
only what a replicated stage or the caller needs.  Every array that crosses
between processes is counted in :attr:`RunStats.bytes_sent` and
:attr:`RunStats.bytes_received`.

:class:`LocalExecutor` runs the shards one after another in this process (the
exact semantics, for tests and for the single-process comparison);
:class:`lowering.distributed.dask_shards.DaskExecutor` runs them on Dask workers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from graphc.dims import dim_symbols, eval_shape
from graphc.errors import InputError, ShardingError
from graphc.graph import Graph
from graphc.sharding import ShardPlan, Stage, sum_addends

from ..backends.inputs import check_arrays, check_assumptions
from ..decode.kv_cache import ArrayKVCache, KVCache, LMInterface

__all__ = ["ShardedRunner", "Resident", "RunStats", "Executor", "LocalExecutor", "timed_run", "extend_last_axis", "GROWING_MAX_BYTES"]


def timed_run(runner: Any, feeds: Mapping[str, Any]) -> dict[str, Any]:
    """``runner.run(feeds)``'s outputs plus ``"__seconds__"``, the time it took (every executor reports shard times this way)."""
    t0 = time.perf_counter()
    out = dict(runner.run(dict(feeds)))
    out["__seconds__"] = time.perf_counter() - t0
    return out


class Executor(Protocol):
    """Where shard ``i`` of a sharded stage runs: handles are whatever the executor keeps (arrays, futures)."""

    n: int

    def prepare(self, stage: Stage, backend: str, options: Mapping[str, Any]) -> None:
        """Set up every shard's graph of ``stage`` once (weights go to the shards here)."""

    def put(self, shard: int, array: np.ndarray) -> Any:
        """Send ``array`` to ``shard``; return a handle."""

    def run(self, stage: Stage, shard: int, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run shard ``shard`` of ``stage`` on handles; return a handle per stage output (and ``"__seconds__"``)."""

    def fetch(self, handles: list[Any]) -> list[Any]:
        """The arrays (and the ``"__seconds__"`` floats) behind ``handles``, in the driver, in one round trip."""


GROWING_MAX_BYTES = 1 << 20
"""Inputs up to this size are checked for growth (a decode loop's ``attention_mask``): larger ones are sent whole."""


def _extends(old: np.ndarray, new: np.ndarray) -> bool:
    """True when ``new`` is ``old`` with more entries along the last axis."""
    return (
        old.ndim == new.ndim >= 1
        and old.dtype == new.dtype
        and old.shape[:-1] == new.shape[:-1]
        and new.shape[-1] > old.shape[-1]
        and np.array_equal(new[..., : old.shape[-1]], old)
    )


def extend_last_axis(held: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """``held`` with ``tail`` appended along the last axis (run where ``held`` lives)."""
    return np.concatenate([held, tail], axis=-1)


@dataclass
class Resident:
    """A value left on the shards (a KV cache between decode steps: each shard's part, or its own copy when replicated); pass it back as an input
    to keep it there."""

    name: str
    parts: list[Any]
    plan_id: int

    def gather(self, runner: ShardedRunner) -> np.ndarray:
        """The whole array, fetched from the shards."""
        return runner._whole(self.name, ("parts", self.parts))


@dataclass
class RunStats:
    """One call's wall time, per-stage shard times and the bytes that crossed between the driver and the shards."""

    wall_s: float = 0.0
    shard_s: list[list[float]] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_between_shards: int = 0
    """Bytes the all-reduces moved from shard to shard (each shard receives the other shards' addends), never through the driver."""
    all_reduces: int = 0
    driver_waits: int = 0
    """Times the driver waited for the shards (fetches); stages whose inputs stay on the shards are queued without waiting."""


class LocalExecutor:
    """Shards run one after another in this process (no copies: handles are the arrays)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._runners: dict[tuple[int, int], Any] = {}

    def prepare(self, stage: Stage, backend: str, options: Mapping[str, Any]) -> None:
        """Prepare each shard's graph with :func:`lowering.prepare`."""
        from ..backends.registry import prepare

        for i, g in enumerate(stage.graphs):
            self._runners[(stage.index, i)] = prepare(g, backend, **dict(options))

    def put(self, shard: int, array: np.ndarray) -> Any:
        """The array itself."""
        return array

    def hold(self, shard: int, array: np.ndarray) -> Any:
        """The array itself (held by the caller)."""
        return array

    def extend(self, shard: int, held: Any, tail: np.ndarray) -> Any:
        """``held`` with ``tail`` appended along its last axis."""
        return extend_last_axis(held, tail)

    def run(self, stage: Stage, shard: int, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run the prepared shard."""
        return timed_run(self._runners[(stage.index, shard)], feeds)

    def fetch(self, handles: list[Any]) -> list[Any]:
        """The arrays themselves."""
        return list(handles)

    def all_reduce(self, parts: list[Any]) -> list[Any]:
        """The sum of the shards' addends (:func:`graphc.sharding.sum_addends`, as the driver's gather sums), for every shard."""
        return [sum_addends(*parts)] * self.n


class ShardedRunner:
    """Run a plan on an executor with ``backend`` for every stage; weights are placed once, at construction.

    ``run(inputs, resident=(...))`` returns numpy arrays, except the outputs
    named in ``resident``, which stay on the shards as :class:`Resident`
    handles (pass them back as inputs: a decode loop's cache never leaves
    the workers).
    """

    def __init__(self, plan: ShardPlan, executor: Executor, backend: str = "numpy", **options: Any) -> None:
        if executor.n != plan.n:
            raise ShardingError(f"the executor runs {executor.n} shard(s), the plan has {plan.n}")
        self.plan, self.executor, self.backend = plan, executor, backend
        self.last = RunStats()
        self._fetched: dict[tuple[str, int], np.ndarray] = {}
        self._held: dict[tuple[str, int], tuple[np.ndarray, Any]] = {}  # (input, shard) -> last value sent, its handle if kept there
        self._local: dict[int, Any] = {}
        from ..backends.registry import prepare

        for st in plan.stages:
            if st.sharded:
                executor.prepare(st, backend, options)
            else:
                self._local[st.index] = prepare(st.graphs[0], backend, **options)
        placed = getattr(executor, "placed", None)
        if placed is not None:
            placed()
        if getattr(executor, "places_weights", False):  # the shard graphs (and their weight slices) now live on the workers
            self.plan = replace(plan, stages=tuple(replace(st, graphs=()) if st.sharded else st for st in plan.stages))

    @property
    def provider(self) -> str:
        """What runs the shards, in words."""
        return f"sharded x{self.plan.n}, {self.backend} per shard"

    def new_cache(self, lm: LMInterface, batch: int, capacity: int) -> KVCache:
        """A decode cache whose values, after the first step, are :class:`Resident` parts each shard keeps (``capacity``: a
        fixed-capacity cache's slots)."""
        return ArrayKVCache(lm, batch, capacity=capacity)

    def step(self, inputs: Mapping[str, Any], keep: Sequence[str] | Mapping[str, Any] = ()) -> dict[str, Any]:
        """One decode step: :meth:`run` with the outputs in ``keep`` left on the shards."""
        return self.run(inputs, resident=list(keep))

    def prepared_for(self, graph: Graph) -> bool:
        """True when the plan was made from ``graph`` or a graph of the same name and interface."""
        plan = self.plan
        return plan.name == graph.name and all(plan.types.get(n) == graph.types[n] for n in (*graph.inputs, *graph.outputs))

    def close(self) -> None:
        """Release the executor (a LocalCluster that :func:`~lowering.distributed.dask_shards.sharded_runner` started is shut down)."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "ShardedRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _whole(self, name: str, where: tuple[str, Any]) -> np.ndarray:
        return self._wholes({name: where})[0][name]

    def _wholes(self, wanted: Mapping[str, tuple[str, Any]], extra: Sequence[Any] = ()) -> tuple[dict[str, np.ndarray], list[Any]]:
        """Whole arrays of several values, and the values behind the ``extra`` handles, with one fetch from the shards for all of them."""
        out: dict[str, np.ndarray] = {}
        todo: list[tuple[str, tuple[str, int], list[Any]]] = []
        for name, (kind, val) in wanted.items():
            key = (name, id(val))
            if kind == "whole":
                out[name] = val
            elif key in self._fetched:
                out[name] = self._fetched[key]
            elif kind == "summed":  # every shard holds the same sum: shard 0's copy is the whole value
                todo.append((name, key, val[:1]))
            else:
                todo.append((name, key, val if name in self.plan.split_axis or name in self.plan.partial else val[:1]))
        if not todo and not extra:
            return out, []
        fetched = self.executor.fetch([h for _, _, parts in todo for h in parts] + list(extra))
        self.last.driver_waits += 1
        arrays, extras = fetched[: len(fetched) - len(extra)], fetched[len(fetched) - len(extra) :]
        self.last.bytes_received += sum(a.nbytes for a in arrays)
        i = 0
        for name, key, parts in todo:
            got = arrays[i : i + len(parts)]
            self._fetched[key] = out[name] = got[0] if wanted[name][0] == "summed" else self.plan.gather(name, got)
            i += len(parts)
        return out, extras

    def _all_reduce(self, st: Stage, where: dict[str, tuple[str, Any]], dims: Mapping[str, int]) -> None:
        """Replace each addend value ``st`` reads by its sum on every shard (``("summed", handles)``), when the executor sums among shards."""
        reduce = getattr(self.executor, "all_reduce", None)
        if reduce is None:
            return
        n = self.plan.n
        for v in st.inputs:
            if where[v][0] == "parts" and v in self.plan.partial and v not in self.plan.split_axis:
                where[v] = ("summed", reduce(where[v][1]))
                t = self.plan.types[v]
                bound = all(sym in dims for d in t.shape for sym in dim_symbols(d))
                nbytes = int(np.prod(eval_shape(t.shape, dims), dtype=np.int64)) * np.dtype(t.dtype).itemsize if bound else 0
                self.last.bytes_between_shards += (n - 1) * n * nbytes
                self.last.all_reduces += 1

    def _feed(self, name: str, where: tuple[str, Any], shard: int, sent: dict[tuple[str, int], Any]) -> Any:
        kind, val = where
        if kind == "summed" or (kind == "parts" and name not in self.plan.partial):
            return val[shard]  # made on this shard (its part, its own copy of a replicated value, or the all-reduced sum)
        if (name, shard) not in sent:
            part = self.plan.split(name, self._whole(name, where), shard)
            sent[(name, shard)] = self._send(name, shard, part)
        return sent[(name, shard)]

    def _send(self, name: str, shard: int, part: np.ndarray) -> Any:
        """Put ``part`` on ``shard``.  A small input that extends the last call's value along its last axis (a decode loop's
        ``attention_mask``) is kept on the shard from then on and sent as its new entries only, where the executor can extend
        what it holds."""
        extend = getattr(self.executor, "extend", None)
        if extend is None or part.nbytes > GROWING_MAX_BYTES:
            self.last.bytes_sent += part.nbytes
            return self.executor.put(shard, part)
        last = self._held.get((name, shard))
        grows = last is not None and _extends(last[0], part)
        if grows and last is not None and last[1] is not None:
            tail = np.ascontiguousarray(part[..., last[0].shape[-1] :])
            self.last.bytes_sent += tail.nbytes
            handle = kept = extend(shard, last[1], tail)
        else:
            self.last.bytes_sent += part.nbytes
            hold = getattr(self.executor, "hold", self.executor.put)  # an executor that extends also holds
            handle = hold(shard, part) if grows else self.executor.put(shard, part)
            kept = handle if grows else None  # held on the shard once it has grown; other inputs travel as before
        self._held[(name, shard)] = (np.array(part, copy=True), kept)  # a copy: the caller may change its array in place
        return handle

    def run(self, inputs: Mapping[str, Any], resident: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
        """Run every stage on ``inputs`` (arrays, or :class:`Resident` parts from an earlier call); gather the outputs."""
        plan = self.plan
        missing = [n for n in plan.inputs if n not in inputs]
        if missing:
            raise InputError(f"missing input(s) {missing}; the sharded graph {plan.name!r} takes {list(plan.inputs)}")
        unknown = sorted(set(inputs) - set(plan.inputs))
        if unknown:
            raise InputError(f"unexpected input(s) {unknown}; the sharded graph {plan.name!r} takes {list(plan.inputs)}")
        bad = [r for r in resident if r not in plan.outputs]
        if bad:
            raise InputError(f"resident output(s) {bad} are not outputs of {plan.name!r}: {list(plan.outputs)}")
        self.last = RunStats()
        self._fetched = {}
        t0 = time.perf_counter()
        where: dict[str, tuple[str, Any]] = {}
        for name in plan.inputs:
            v = inputs[name]
            if isinstance(v, Resident):
                if v.plan_id != id(plan):
                    raise InputError(f"input {name!r}: a resident value of another plan ({v.name!r}); pass a numpy array")
                where[name] = ("parts", v.parts)
            elif isinstance(v, np.ndarray):
                where[name] = ("whole", v)
            else:
                raise InputError(f"input {name!r} must be a numpy.ndarray or a Resident, got {type(v).__name__}")
        dims = check_arrays({n: inputs[n] for n in plan.inputs if where[n][0] == "whole" and n in plan.types}, plan.types)
        check_assumptions(plan.name, plan.assumptions, dims)
        seconds: list[list[Any]] = []
        # what each shard already holds this call: an input is sent to a shard once, however many stages read it
        sent: dict[tuple[str, int], Any] = {}
        for st in plan.stages:
            if st.sharded:
                self._all_reduce(st, where, dims)  # addends this stage needs whole: summed among the shards where the executor can
                whole_first = {v: where[v] for v in st.inputs if where[v][0] == "parts" and v in plan.partial}
                self._wholes(whole_first)  # the rest: through the driver, one fetch for all of them
                outs = [self.executor.run(st, i, {v: self._feed(v, where[v], i, sent) for v in st.inputs}) for i in range(plan.n)]
                for o in st.outputs:
                    where[o] = ("parts", [out[o] for out in outs])
                seconds.append([out["__seconds__"] for out in outs])
            else:
                feeds, _ = self._wholes({v: where[v] for v in st.inputs})
                outs1 = self._local[st.index].run(feeds)
                for o in st.outputs:
                    where[o] = ("whole", outs1[o])
        keep = {n for n in plan.outputs if n in resident and where[n][0] == "parts" and n not in plan.partial}
        result: dict[str, Any] = {n: Resident(n, where[n][1], id(plan)) for n in keep}
        wholes, times = self._wholes({n: where[n] for n in plan.outputs if n not in keep}, [h for row in seconds for h in row])
        flat = [float(x) for x in times]  # shard times come back with the outputs: one round trip
        result.update(wholes)
        result = {n: result[n] for n in plan.outputs}
        self.last.shard_s = [flat[i * plan.n : (i + 1) * plan.n] for i in range(len(seconds))]
        self.last.wall_s = time.perf_counter() - t0
        return result
