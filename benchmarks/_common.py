"""Helpers shared by the benchmark scripts: the timing method, the machine's limits and the torch SDPA peer.

The method (:func:`time_blocks`): each variant is warmed up, then timed in
blocks of back-to-back calls (as a decode loop calls: layer after layer, token
after token), the blocks alternating between variants (A B C A B C ..., the
order rotating each round) so that a noisy stretch of this shared machine hits
every variant; a variant's figure is the median of its blocks' medians.  No
pause precedes a timed call: on these machines a pause costs milliseconds of
wake-up on the next call, which would be measured instead of the kernel.  The
first call after 0.2 s idle is measured separately (:func:`time_after_idle`)
and reported as its own column, never as the main figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def machine() -> str:
    """``x86_64 Intel(R) Xeon(R) Processor, 2 cores``: the architecture, the CPU's model name and the cores this process may use."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())
    return f"{platform.machine()} {cpu}, {len(os.sched_getaffinity(0))} cores"


def lm_feeds(graph: Any, rows: int, past: int = 0) -> dict[str, np.ndarray]:
    """A causal LM graph's inputs for one sequence: ``rows`` new tokens (seeded random ids) after ``past`` cached
    positions (seeded random keys and values), every position attended."""
    ids = np.random.default_rng(0).integers(3, 1000, (1, rows))
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, past + rows), np.int64), "position_ids": np.arange(past, past + rows)[None]}
    for n in graph.inputs:
        if n.startswith("past_key_values"):
            shape = graph.types[n].shape
            feeds[n] = np.random.default_rng(1).standard_normal((1, shape[1], past, shape[3])).astype(graph.types[n].dtype)
    return feeds


def median_ms(fn: Callable[[dict], object], feeds_list: Sequence[dict], repeats: int) -> float:
    """Median wall time in ms of ``fn`` over ``repeats`` calls after one warm-up, rotating over ``feeds_list``."""
    fn(feeds_list[0])
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(feeds_list[i % len(feeds_list)])
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


BLOCK_SECONDS = 0.25
"""Back-to-back calls per block: as many as take about this long (at least :data:`MIN_CALLS`, at most :data:`MAX_CALLS`)."""
MIN_CALLS, MAX_CALLS = 2, 40
IDLE_SECONDS = 0.2


def time_blocks(runs: dict[str, Callable[[dict], object]], feeds_list: Sequence[dict], blocks: int) -> dict[str, dict[str, float]]:
    """Time every run function as described in this module's docstring; ``feeds_list`` rotates per call (cache-cold copies).

    Returns, per variant: ``ms`` (median of block medians), ``p10``/``p90`` (over
    every timed call, ms), ``calls`` per block and ``blocks``.
    """
    names = list(runs)
    per_block: dict[str, int] = {}
    for name in names:  # warm-up: sessions, thread pools, first-call allocations, compiled kernels
        runs[name](feeds_list[0])
        t0 = time.perf_counter()
        runs[name](feeds_list[1 % len(feeds_list)])
        per_block[name] = max(MIN_CALLS, min(MAX_CALLS, round(BLOCK_SECONDS / max(time.perf_counter() - t0, 1e-6))))
    medians: dict[str, list[float]] = {n: [] for n in names}
    calls: dict[str, list[float]] = {n: [] for n in names}
    turn = dict.fromkeys(names, 0)
    for b in range(blocks):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            fn, block = runs[name], []
            for _ in range(per_block[name]):
                feeds = feeds_list[turn[name] % len(feeds_list)]
                turn[name] += 1
                t0 = time.perf_counter()
                fn(feeds)
                block.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(block))
            calls[name] += block
    out = {}
    for name in names:
        t = sorted(calls[name])
        out[name] = dict(
            ms=1e3 * statistics.median(medians[name]),
            p10=1e3 * t[len(t) // 10],
            p90=1e3 * t[min(len(t) - 1, (9 * len(t)) // 10)],
            calls=per_block[name],
            blocks=blocks,
        )
    return out


def time_after_idle(fn: Callable[[dict], object], feeds: dict, repeats: int = 3) -> float:
    """Median ms of one call made after :data:`IDLE_SECONDS` of sleep (what a first request after idle sees)."""
    times = []
    for _ in range(repeats):
        time.sleep(IDLE_SECONDS)
        t0 = time.perf_counter()
        fn(feeds)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def read_probe(threads: int, nbytes: int = 1 << 30) -> tuple[str, Callable[[dict], object]]:
    """A call that reads ``nbytes`` once with ``threads`` threads: ``torch.sum`` (vectorised, multithreaded), else a NumPy sum per thread."""
    try:
        import torch

        torch.set_num_threads(threads)
        x = torch.ones(nbytes // 4)
        return "torch.sum", lambda feeds: x.sum()
    except ImportError:
        from concurrent.futures import ThreadPoolExecutor

        parts = np.array_split(np.ones(nbytes // 4, np.float32), threads)
        pool = ThreadPoolExecutor(threads)
        return "numpy sum per thread", lambda feeds: list(pool.map(np.sum, parts))


def gemm_probe(n: int = 2048) -> Callable[[dict], object]:
    """A float32 ``n x n`` GEMM through NumPy's BLAS (the one graphc's NumPy backend calls), all its threads."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    return lambda feeds: np.matmul(a, a)


PEAK_SHAPE = (512, 2048, 5632)
"""The product the peaks are measured on (rows, inner, columns): a 512-token prompt through a 1B model's MLP."""


def matmul_peaks() -> dict[str, float]:
    """The machine's measured matrix-product GFLOP/s per dtype on :data:`PEAK_SHAPE`: ``float32`` through NumPy's BLAS
    (what graphc's NumPy backend and, near enough, onnxruntime's MLAS reach) and ``bfloat16`` through torch where it is
    installed (its oneDNN kernels use the CPU's AMX or AVX-512 bfloat16 instructions where present).  Each is the
    best rate of three blocks of five back-to-back products, after one warm-up: a peak, not an average (one block
    alone read the bfloat16 peak a quarter low, below the rate transformers' prefill then reached)."""
    m, k, n = PEAK_SHAPE
    rng = np.random.default_rng(0)
    a, b = rng.random((m, k), dtype=np.float32), rng.random((k, n), dtype=np.float32)
    peaks = {"float32": _rate(lambda: a @ b, 2 * m * k * n)}
    try:
        import torch
    except ImportError:
        return peaks
    a16, b16 = torch.from_numpy(a).to(torch.bfloat16), torch.from_numpy(b).to(torch.bfloat16)
    peaks["bfloat16"] = _rate(lambda: a16 @ b16, 2 * m * k * n)
    return peaks


def _rate(fn: Callable[[], object], flops: float, blocks: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        best = min(best, time.perf_counter() - t0)
    return flops * 5 / best / 1e9


def torch_sdpa(feeds_list: Sequence[dict], threads: int, causal: bool) -> Callable[[dict], np.ndarray] | None:
    """torch's ``scaled_dot_product_attention(enable_gqa=True)`` on the same inputs, or None without torch.

    Tensors share the feeds' memory; they are made for ``feeds_list`` now and
    for any other feeds dict on its first call (kept while the run function lives).
    """
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    tensors = {id(f): {k: torch.from_numpy(v) for k, v in f.items()} for f in feeds_list}

    def run(feeds: dict) -> np.ndarray:
        if id(feeds) not in tensors:  # not setdefault: that would build the tensors on every timed call
            tensors[id(feeds)] = {k: torch.from_numpy(v) for k, v in feeds.items()}
        t = tensors[id(feeds)]
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                t["q_BHSD"], t["k_BHkvTD"], t["v_BHkvTD"], is_causal=causal, enable_gqa=True
            ).numpy()

    return run


def checkpoint_args(doc: str, out: str, **options: int | tuple[str, ...]) -> argparse.Namespace:
    """The command line of a benchmark over one checkpoint folder: ``checkpoint``, ``--prompt`` (512 tokens), each of
    ``options`` (``runs=3`` gives ``--runs 3``, an int; ``backend=("numpy", "ort-cpu")`` a choice, the first the
    default), and ``--out`` (default ``docs/bench/<out>``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", type=int, default=512)
    for name, default in options.items():
        if isinstance(default, tuple):
            ap.add_argument(f"--{name}", choices=default, default=default[0])
        else:
            ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "bench" / out))
    return ap.parse_args()


def prefill_flops(folder: Path | str, prompt: int) -> int:
    """A prompt's weight-product multiply-adds for the checkpoint in ``folder``, ``2 * params * tokens`` over every
    layer's matrices (the embedding, the head's one row and attention's scores, 2% at 512 tokens, left out)."""
    from graphc.weights import load_weights

    w = load_weights(folder)
    return 2 * prompt * sum(a.size for n, a in w.items() if a.ndim == 2 and "embed_tokens" not in n and "lm_head" not in n)
