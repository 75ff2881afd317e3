"""Shards on ``dask.distributed`` workers: :class:`DaskExecutor` and :func:`run_sharded`.

Shard ``i`` is pinned to worker ``i`` (modulo the workers there are): its
graphs are sent once and prepared there, and the prepared runner stays in the
worker's memory as a future, as do the values the shard makes (its part of a
KV cache).  Tasks are submitted with ``workers=[address]`` and
``allow_other_workers=False``, so Dask never moves a shard's data to another
worker: what crosses is what the driver sends (``scatter``) or fetches.
"""

from __future__ import annotations

import atexit
import copy

from collections.abc import Mapping
from typing import Any

import numpy as np

from graphc.errors import BackendError, BackendUnavailableError, GraphcError
from graphc.graph import Graph

from graphc.sharding import ShardPlan, Stage, shard, sum_addends

from ..backends.registry import get_backend
from .sharded import RunStats, ShardedRunner, extend_last_axis, timed_run

__all__ = ["DaskExecutor", "run_sharded", "sharded_runner", "local_cluster", "close_cluster"]

EMBED_BYTES = 1 << 20
"""Arrays up to this size are sent inside the task message rather than scattered first."""
INSTALL_HINT = "pip install 'graphc[distributed]' (dask[distributed])"


def _distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise BackendUnavailableError("dask", f"dask.distributed is not installed; {INSTALL_HINT}") from None
    return distributed


WORKER_WAIT_SECONDS = 30
"""How long a runner waits for a Dask client with no worker yet to get one."""


def local_cluster(n_workers: int, threads_per_worker: int = 1, processes: bool = True) -> Any:
    """A ``distributed.Client`` on a new ``LocalCluster`` of ``n_workers`` worker processes."""
    distributed = _distributed()
    cluster = distributed.LocalCluster(
        n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes, dashboard_address=":0", memory_limit=0
    )  # any free port: never clashes with a running cluster
    client = distributed.Client(cluster)
    atexit.register(close_cluster, client)  # a script that never closes it exits quietly (workers would log lost data)
    return client


def close_cluster(client: Any) -> None:
    """Close ``client`` and the cluster it was made with (as :func:`local_cluster` makes them)."""
    cluster = client.cluster
    if client.status not in ("closed", "closing"):
        client.close()
    if cluster is not None and cluster.status.name not in ("closed", "closing"):
        cluster.close()


def _prepare_on_worker(graph: Graph, backend: str, options: Mapping[str, Any], weights: Mapping[str, np.ndarray] | None = None) -> Any:
    from ..backends.registry import prepare

    if weights:  # the weights sent apart (once per worker, however many stages read them) go back in
        graph = copy.copy(graph)
        graph.initializers = {**graph.initializers, **weights}
    return prepare(graph, backend, **dict(options))


def _without(graph: Graph, names: set[str]) -> Graph:
    """A shallow copy of ``graph`` without the initializers ``names`` (sent to the worker apart)."""
    light = copy.copy(graph)
    light.initializers = {k: v for k, v in graph.initializers.items() if k not in names}
    return light


def _run_on_worker(runner: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return timed_run(runner, {k: _aligned(v) for k, v in feeds.items()})


def _aligned(a: np.ndarray) -> np.ndarray:
    """``a``, copied once if it arrived unaligned (BLAS needs aligned operands)."""
    return np.require(a, requirements=("C", "A"))


def _item(d: Mapping[str, Any], key: str) -> Any:
    return d[key]


class DaskExecutor:
    """Shard ``i`` on worker ``i % workers`` of ``client``; handles are Dask futures kept on that worker."""

    places_weights = True
    """Each shard's graph and weight slices are sent to its worker once: the runner then drops its own copies."""

    def __init__(self, client: Any, n: int) -> None:
        self.client, self.n = client, n
        self.owns_client = False  # True when sharded_runner made the cluster: close() then shuts it down
        workers = sorted(client.scheduler_info()["workers"])
        if not workers:  # a cluster still starting, or a worker its nanny is restarting: give it a moment
            try:
                client.wait_for_workers(1, timeout=WORKER_WAIT_SECONDS)
            except Exception:  # noqa: BLE001 - distributed's TimeoutError, or a client already closing
                raise BackendUnavailableError("dask", f"the Dask client has no workers (waited {WORKER_WAIT_SECONDS} s)") from None
            workers = sorted(client.scheduler_info()["workers"])
        self.workers = [workers[i % len(workers)] for i in range(n)]
        self._runners: dict[tuple[int, int], Any] = {}
        self._graphs: list[Any] = []  # the scattered graphs: held, or Dask may drop them before the prepare tasks read them
        self._weights: dict[tuple[int, int], tuple[np.ndarray | None, Any]] = {}  # (shard, id(array)) -> (array, its future on the worker)
        self.setup_bytes = 0

    def _open(self) -> Any:
        if self.client.status in ("closed", "closing"):
            raise BackendError(
                "the Dask client of this sharded runner is closed; make a new runner (lowering.distributed.dask_shards.sharded_runner)"
            )
        return self.client

    def _submit(self, shard: int, fn: Any, *args: Any) -> Any:
        return self._open().submit(fn, *args, workers=[self.workers[shard]], allow_other_workers=False, pure=False)

    def prepare(self, stage: Stage, backend: str, options: Mapping[str, Any]) -> None:
        """Send each shard's graph and weight slices to its worker and prepare it there.

        Weights of ``EMBED_BYTES`` or more travel apart from the graph, once per worker: a
        table that several stages read (a tied embedding: the lookup and the LM head) is sent once.
        """
        for i, g in enumerate(stage.graphs):
            big = {k: a for k, a in g.initializers.items() if a.nbytes >= EMBED_BYTES}
            new = {k: a for k, a in big.items() if (i, id(a)) not in self._weights}
            if new:
                futures = self._open().scatter(list(new.values()), workers=[self.workers[i]], hash=False)
                for a, f in zip(new.values(), futures):
                    self._weights[(i, id(a))] = (a, f)  # the array is held too, so its id is not reused while the entry lives
            self.setup_bytes += sum(a.nbytes for k, a in g.initializers.items() if k not in big or k in new)
            [graph_future] = self._open().scatter([_without(g, set(big))], workers=[self.workers[i]], hash=False)
            self._graphs.append(graph_future)
            weights = {k: self._weights[(i, id(a))][1] for k, a in big.items()}
            self._runners[(stage.index, i)] = self._submit(i, _prepare_on_worker, graph_future, backend, dict(options), weights)

    def placed(self) -> None:
        """Every stage is prepared: let go of the driver's references to the weights sent (the workers hold them)."""
        self._weights = {key: (None, future) for key, (_, future) in self._weights.items()}

    def close(self) -> None:
        """Shut down the cluster if this executor's runner made it (a client you passed in stays open)."""
        if self.owns_client:
            close_cluster(self.client)

    def put(self, shard: int, array: np.ndarray) -> Any:
        """Small arrays travel inside the task that reads them (no extra round trip); large ones are scattered to the shard's worker."""
        if array.nbytes <= EMBED_BYTES:
            return array
        [future] = self._open().scatter(
            [array], workers=[self.workers[shard]], hash=False
        )  # a unique key per send: the same array goes to several workers
        return self._submit(shard, _aligned, future)

    def hold(self, shard: int, array: np.ndarray) -> Any:
        """Send ``array`` to the shard's worker and keep it there (a future), however small."""
        return self._submit(shard, _aligned, array)

    def extend(self, shard: int, held: Any, tail: np.ndarray) -> Any:
        """What the shard holds, with ``tail`` appended along the last axis on the worker: only ``tail`` crosses."""
        return self._submit(shard, extend_last_axis, held, tail)

    def run(self, stage: Stage, shard: int, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Submit the shard's run; a future per output, on the same worker."""
        result = self._submit(shard, _run_on_worker, self._runners[(stage.index, shard)], dict(feeds))
        out = {name: self._submit(shard, _item, result, name) for name in (*stage.outputs, "__seconds__")}
        out["__result__"] = result  # held until the outputs are picked, so Dask does not release it first
        return out

    def _gather(self, handles: list[Any]) -> list[Any]:
        try:
            return list(self._open().gather(handles))
        except GraphcError:
            raise
        except Exception as e:  # a worker's failure arrives here, re-raised by Dask
            raise BackendError(f"a shard failed on its Dask worker: {type(e).__name__}: {e}") from e

    def fetch(self, handles: list[Any]) -> list[Any]:
        """Gather the futures' values to the driver (one round trip)."""
        return self._gather(handles)

    def all_reduce(self, parts: list[Any]) -> list[Any]:
        """Each shard's worker sums every shard's addend (Dask moves them worker to worker; the driver holds only futures)."""
        return [self._submit(i, sum_addends, *parts) for i in range(self.n)]


def sharded_runner(graph: Graph | ShardPlan, n: int | None = None, backend: str = "numpy", client: Any = None, **options: Any) -> ShardedRunner:
    """A :class:`ShardedRunner` for ``graph`` split ``n`` ways (or a ready plan) on ``client`` (a new LocalCluster of ``n`` workers if None)."""
    get_backend(backend)  # an unknown name is refused before any worker starts
    plan = graph if isinstance(graph, ShardPlan) else shard(graph, n if n is not None else 2)
    own = client is None
    if own:
        client = local_cluster(plan.n)
    executor = DaskExecutor(client, plan.n)
    executor.owns_client = own
    return ShardedRunner(plan, executor, backend, **options)


def run_sharded(
    graph: Graph, inputs: Mapping[str, Any], n: int, backend: str = "numpy", client: Any = None, **options: Any
) -> tuple[dict[str, Any], RunStats]:
    """Split ``graph`` into ``n`` shards, run them on Dask (``client``, or a LocalCluster closed afterwards), gather the outputs.

    Returns the outputs and the run's :class:`RunStats`.  For several calls
    (decode steps with the cache kept on the workers) use
    :func:`sharded_runner` and ``runner.run(..., resident=[...])``.
    """
    own = client is None
    runner = sharded_runner(graph, n, backend, client, **options)
    try:
        out = runner.run(inputs)
        return out, runner.last
    finally:
        if own:
            runner.close()  # and the cluster it started
