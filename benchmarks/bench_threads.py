"""Threads that do not fight: the NumPy backend's prefill and decode step at 1 and 2 threads, on a quiet machine and
with a second process burning one core, beside BLAS's own threads (what the backend did before) and ort-cpu.

    python benchmarks/bench_threads.py CHECKPOINT_DIR [--prompt 128] [--past 128] [--blocks 5] [--out docs/bench/threads.md]

The checkpoint's whole model (``causal_lm_from_hf``, the last position's logits), optimized.  Contenders, each
prepared once: ``numpy tN`` (graphc's threads: a prefill's GEMMs in blocks on N threads with BLAS held to one
thread, a decode step's products on N BLAS threads or on one, whichever ran faster lately), ``numpy t2, fixed
count`` (a decode step always on 2 BLAS threads, ``GRAPHC_ADAPTIVE_THREADS=0``), ``numpy tN, BLAS's threads`` (the
same graph with every GEMM handed to BLAS whole and BLAS left to its own thread count, as before), ``ort-cpu tN``.  Each case times blocks of
back-to-back calls, the contenders alternating, and reports the median of the blocks; the loaded case starts a
process that spins on one core first.  Writes the table to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import lm_feeds, machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _blas_whole(runner: Any) -> Any:
    """``runner.run`` with every GEMM given to BLAS whole at BLAS's own thread count (the backend before its threads
    were sized together)."""
    import lowering.backends.numpy_interpreter as interpreter
    import lowering.kernels.contraction as contraction

    def run(feeds: dict[str, np.ndarray]) -> Any:
        saved = (contraction.BLOCKED_MIN_FLOPS, interpreter.blas_threads)
        contraction.BLOCKED_MIN_FLOPS, interpreter.blas_threads = 1 << 62, lambda n: nullcontext()
        try:
            with _choice_off():
                return runner.run(feeds)
        finally:
            contraction.BLOCKED_MIN_FLOPS, interpreter.blas_threads = saved

    return run


def _fixed_count(runner: Any) -> Any:
    """``runner.run`` with a decode step always on the thread count asked for (``GRAPHC_ADAPTIVE_THREADS=0``)."""

    def run(feeds: dict[str, np.ndarray]) -> Any:
        with _choice_off():
            return runner.run(feeds)

    return run


@contextmanager
def _choice_off() -> Iterator[None]:
    """``GRAPHC_ADAPTIVE_THREADS=0`` inside the ``with``, the variable as it was after."""
    saved = os.environ.get("GRAPHC_ADAPTIVE_THREADS")
    os.environ["GRAPHC_ADAPTIVE_THREADS"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GRAPHC_ADAPTIVE_THREADS", None)
        else:
            os.environ["GRAPHC_ADAPTIVE_THREADS"] = saved


def _median_blocks(runs: dict[str, Any], feeds: dict[str, np.ndarray], blocks: int, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(blocks):
        for name, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                run(feeds)
            times[name].append((time.perf_counter() - t0) / calls)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def main() -> None:
    """Time every contender quiet and loaded, prefill and decode; print the table and write it to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "threads.md"))
    args = ap.parse_args()
    import graphc
    from graphc.weights import load_weights
    from lowering import prepare
    from lowering.kernels.softmax import blas_description

    folder = args.checkpoint
    graph = graphc.optimize(graphc.causal_lm_from_hf(f"{folder}/config.json", load_weights(folder), logits="last")).graph
    runs: dict[str, Any] = {}
    for t in (1, 2):
        runner = prepare(graph, "numpy", threads=t)
        runs[f"numpy t{t}"] = runner.run
        if t > 1:
            runs[f"numpy t{t}, fixed count"] = _fixed_count(runner)
        runs[f"numpy t{t}, BLAS's threads"] = _blas_whole(runner)
    for t in (1, 2):
        runs[f"ort-cpu t{t}"] = prepare(graph, "ort-cpu", threads=t).run
    cases = {f"prefill {args.prompt}": lm_feeds(graph, args.prompt), f"decode over {args.past}": lm_feeds(graph, 1, args.past)}
    for feeds in cases.values():
        for run in runs.values():
            run(feeds)
    lines = [
        "# `python benchmarks/bench_threads.py`: one run\n",
        f"machine: {machine()}, {blas_description()}; "
        f"{graph.name}; ms per call, median of {args.blocks} alternating blocks\n",
        "| case | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    print("\n".join(lines), flush=True)
    for load in ("quiet", "one core busy"):
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "quiet" else None
        try:
            time.sleep(0.5)
            for case, feeds in cases.items():
                ms = _median_blocks(runs, feeds, args.blocks, 1 if case.startswith("prefill") else 10)
                line = f"| {case}, {load} | " + " | ".join(f"{ms[k]:.0f}" for k in runs) + " |"
                print(line, flush=True)
                lines.append(line)
        finally:
            if burner is not None:
                burner.kill()
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
