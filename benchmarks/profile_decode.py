"""Where the compiled decode kernel's time goes, cache-cold: reading K/V, computing on them, or both.

    python benchmarks/profile_decode.py [--configs mistral-7b,llama2-70b,llama2-7b] [--batches 1,8] [--threads 2] [--blocks 5]

For each config and batch, one alternation (``_common.time_blocks``: blocks of
back-to-back calls, A B C A B C ...) of four variants over the same rotating
copies of K/V (at least 1 GiB, so every call reads from memory):

- **kernel, cold**: ``lowering.kernels.compiled.decode_attention``, as the NumPy backend calls it;
- **read alone**: the same K/V bytes summed with the same threads, shares and
  prefetch distance (a streaming pass with no attention arithmetic);
- **compute alone**: the kernel on one KV head of 1024 keys (1 MiB, resident
  in a core's L2) on one thread, scaled to the call's bytes per thread;
- **read bandwidth**: ``torch.sum`` over 1 GiB (the limit ``bench_speed.py`` measures).

Where the cold kernel takes about *read alone + compute alone*, reading and
computing do not overlap; where it takes about the larger of the two, they do.
Needs numba (``graphc[fast]``); torch for the bandwidth probe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import graphc
from graphc.visibility import Visibility
import numpy as np

from lowering.kernels import compiled
from lowering.kernels.softmax import run_blocks

sys.path.insert(0, str(Path(__file__).parent))
from _common import read_probe, time_blocks  # noqa: E402

COLD_BYTES = 1 << 30
RESIDENT_KEYS = 1024


def _stream_sum():  # type: ignore[no-untyped-def]
    """A compiled pass that reads every row of ``k[h]`` then ``v[h]`` for the given heads, prefetching as the kernel does."""
    from numba import njit

    from lowering.kernels import _numba_attention as kern

    @njit(fastmath=kern.FAST, nogil=True)
    def read_heads(k, v, heads):  # type: ignore[no-untyped-def]
        total = np.float32(0.0)
        for h in heads:
            for a in (k[h], v[h]):
                flat = a.ravel()
                lanes = np.zeros(a.shape[1], np.float32)
                for j in range(0, a.shape[0], 4):
                    kern._prefetch_ahead(flat, j, a.shape[1])
                    for r in range(j, min(j + 4, a.shape[0])):
                        for i in range(a.shape[1]):
                            lanes[i] += a[r, i]
                total += lanes.sum()
        return total

    return read_heads


def profile(config: str, batch: int, threads: int, blocks: int) -> dict[str, float]:
    """Median ms per variant (see the module docstring) and the read bandwidth in GB/s, for one config and batch."""
    cfg = graphc.preset(config)
    kv_heads, rows, dim, keys = batch * cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.hd, 4096
    rng = np.random.default_rng(0)
    bytes_per_copy = 2 * kv_heads * keys * dim * 4
    copies = max(2, -(-COLD_BYTES // bytes_per_copy))
    shape = (kv_heads, keys, dim)
    kv = [(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)) for _ in range(copies)]
    q = rng.standard_normal((kv_heads, rows, dim), dtype=np.float32) * np.float32(dim**-0.5)
    feeds = [{"i": i} for i in range(copies)]
    read_heads = _stream_sum()
    shares = [part for part in np.array_split(np.arange(kv_heads), min(4 * threads, kv_heads)) if part.size]
    q1, k1, v1 = q[:1], kv[0][0][:1, :RESIDENT_KEYS].copy(), kv[0][1][:1, :RESIDENT_KEYS].copy()
    probe_name, probe = read_probe(threads)
    runs = {
        "kernel, cold": lambda f: compiled.decode_attention(q, kv[f["i"]][0], kv[f["i"]][1], 1, Visibility(), threads),
        "read alone": lambda f: run_blocks(lambda part: read_heads(kv[f["i"]][0], kv[f["i"]][1], part), shares, threads),
        "compute alone (1 MiB, 1 thread)": lambda f: compiled.decode_attention(q1, k1, v1, 1, Visibility(), 1),
        f"read bandwidth ({probe_name}, 1 GiB)": probe,
    }
    times = time_blocks(runs, feeds, blocks)
    out = {name: t["ms"] for name, t in times.items()}
    per_thread = bytes_per_copy / min(threads, kv_heads)
    out["compute alone"] = out.pop("compute alone (1 MiB, 1 thread)") * per_thread / (k1.nbytes + v1.nbytes)
    out["read GB/s"] = COLD_BYTES / (out.pop(f"read bandwidth ({probe_name}, 1 GiB)") / 1e3) / 1e9
    out["bytes"] = bytes_per_copy
    return out


def main() -> None:
    """Print one row per config and batch."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="mistral-7b,llama2-70b,llama2-7b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=5)
    args = ap.parse_args()
    if not compiled.use_compiled():
        raise SystemExit(f"profile_decode.py profiles the compiled kernel, which is off: {compiled.compiled_reason()}")
    compiled.warm_up()
    print(f"decode over a 4096-token cache, cache-cold, {args.threads} threads, {compiled.kernels_description()}; ms per call")
    print("| config | batch | query rows per KV head | kernel, cold | read alone | compute alone | read + compute | % of read bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs.split(","):
        cfg = graphc.preset(config)
        for batch in (int(b) for b in args.batches.split(",")):
            r = profile(config, batch, args.threads, args.blocks)
            pct = 100 * r["bytes"] / (r["kernel, cold"] / 1e3) / 1e9 / r["read GB/s"]
            print(
                f"| {config} | {batch} | {cfg.n_heads // cfg.n_kv_heads} | {r['kernel, cold']:.2f} | {r['read alone']:.2f} | "
                f"{r['compute alone']:.2f} | {r['read alone'] + r['compute alone']:.2f} | {pct:.1f}% of {r['read GB/s']:.1f} GB/s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
