"""Helpers shared by the benchmark scripts: timing and the torch SDPA peer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np


def median_ms(fn: Callable[[dict], object], feeds_list: Sequence[dict], repeats: int) -> float:
    """Median wall time in ms of ``fn`` over ``repeats`` calls after one warm-up, rotating over ``feeds_list``."""
    fn(feeds_list[0])
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(feeds_list[i % len(feeds_list)])
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


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
