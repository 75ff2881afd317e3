"""Sharding attention graphs by KV-head group: ``shard(graph, n)`` (see :mod:`graphc.sharding.plan`).

Running a plan is the backends' side: :class:`lowering.distributed.sharded.ShardedRunner`
(one process, or any executor) and :func:`lowering.distributed.dask_shards.run_sharded` /
:func:`lowering.distributed.dask_shards.sharded_runner` on Dask workers.
"""

from .plan import REPLICATED_MODES, ShardPlan, Stage, shard, sum_addends

__all__ = ["shard", "ShardPlan", "Stage", "sum_addends", "REPLICATED_MODES"]
