"""One decode step of the NumPy attention kernel with a KV cache: the past concatenated each step vs a buffer growing in place.

A mistral-7b-shaped layer (32 query / 8 KV heads, head_dim 128), batch 1, one new token over
``--past`` cached tokens.  "concatenated": the past is a plain array, so the kernel concatenates
past and new keys (a new ``[B, 8, P+1, 128]`` array per step) and the compiled kernel reads
that; "in place": the past is a prefix of a :func:`lowering.decode.kv_buffers.allocate` buffer, so the
step writes one key into it and reads the buffer directly.  Timed with the blocks of
back-to-back calls of ``benchmarks/_common.py`` (the in-place variant re-appends at the same
frontier each call, as the loop does one step at a time)::

    python benchmarks/bench_kv_cache.py [--past 4096] [--blocks 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import time_blocks  # noqa: E402

from graphc.attention_op import Attention  # noqa: E402
from graphc.visibility import Visibility  # noqa: E402
from lowering.kernels import compiled  # noqa: E402
from lowering.kernels.attention_kernel import attention_kernel  # noqa: E402
from lowering.decode.kv_buffers import allocate, append  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--past", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    heads, kv, dim, past = 32, 8, 128, args.past
    op = Attention(dim**-0.5, Visibility.causal("past"), kv_cache=True)
    q = rng.standard_normal((1, heads, 1, dim), dtype=np.float32)
    new = rng.standard_normal((1, kv, 1, dim), dtype=np.float32)
    plain_k, plain_v = (rng.standard_normal((1, kv, past, dim), dtype=np.float32) for _ in range(2))
    grown = [append(allocate(1, kv, past + 1, dim, np.float32), a) for a in (plain_k, plain_v)]

    def concatenated(feeds: dict) -> object:
        return attention_kernel(op, [q, new, new, plain_k, plain_v], {"past": past}, None)

    def in_place(feeds: dict) -> object:
        for prefix in grown:  # one step at a time: the frontier sits at the past's end before every call
            prefix.owner.frontier = past
        return attention_kernel(op, [q, new, new, *grown], {"past": past}, None)

    a, b = concatenated({})[0], in_place({})[0]
    assert np.array_equal(a, b), "the two caches must give the same numbers"
    times = time_blocks({"concatenated": concatenated, "in place": in_place}, [{}], args.blocks)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}; {compiled.kernels_description()}; "
        f"1 query token, 32/8 heads, head_dim 128, past {past}, float32"
    )
    print("| KV cache | ms per step | p10 | p90 |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t['ms']:.2f} | {t['p10']:.2f} | {t['p90']:.2f} |")
    print(f"in place / concatenated: {times['in place']['ms'] / times['concatenated']['ms']:.2f}x")


if __name__ == "__main__":
    main()
