"""Shard a GQA decoder stack by KV-head group and decode on two Dask workers, the cache staying on the workers.

    pip install "graphc[distributed]"
    python examples/sharded_decode.py

A 2-layer decoder stack (8 query / 4 KV heads) is split two ways: each worker
holds two KV heads of every layer, their query heads, the matching projection
rows and output-projection columns, and its half of every layer's KV cache.
Each decode step sends the new token to both workers and gets back one addend
of each attention output; the caches never come back.  Every step is checked
against the whole stack run in this process.
"""

from __future__ import annotations

import numpy as np

import graphc
from graphc.attention.decoder import DecoderConfig, decoder_stack_graph
from graphc.sharding import shard
from lowering.distributed.dask_shards import close_cluster, local_cluster, sharded_runner
from lowering import prepare, random_inputs


def main() -> None:
    """Build, shard, decode three steps on a LocalCluster, compare with one process."""
    cfg = DecoderConfig(graphc.AttentionConfig(64, 8, 4), intermediate_size=128)
    g = decoder_stack_graph([cfg, cfg], seed=0, kv_cache=True)
    plan = shard(g, 2)
    print(plan)
    whole = prepare(g, "numpy")
    feeds = random_inputs(g, seed=1, batch=1, seq=1, past_seq=16)
    caches = [n for n in g.inputs if n.startswith("past_")]
    presents = [n.replace("past_", "present_") for n in caches]
    client = local_cluster(2)
    try:
        runner = sharded_runner(plan, client=client)
        state = {n: feeds[n] for n in caches}
        local = dict(state)
        for step in range(3):
            x = np.random.default_rng(step).standard_normal((1, 1, 64), dtype=np.float32)
            got = runner.run({"x_BSM": x, **state}, resident=presents)
            want = whole.run({"x_BSM": x, **local})
            err = float(np.abs(got["out_BSM"] - want["out_BSM"]).max())
            print(f"step {step}: max |sharded - whole| = {err:.1e}; sent {runner.last.bytes_sent} B, received {runner.last.bytes_received} B")
            assert err < 1e-4
            state = {c: got[p] for c, p in zip(caches, presents)}
            local = {c: want[p] for c, p in zip(caches, presents)}
        key = got["present_key.0"].gather(runner)
        np.testing.assert_allclose(key, want["present_key.0"], rtol=1e-5, atol=1e-5)
        print(f"layer 0 cache gathered from the workers: {key.shape}, equal to the single-process cache")
    finally:
        close_cluster(client)


if __name__ == "__main__":
    main()
