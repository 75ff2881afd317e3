"""Compile time of decoder-sized graphs: build, optimize, lower and export stacks of attention layers.

    python benchmarks/bench_compile.py [--preset mistral-7b] [--layers 1,8,32,80]

Each stack is N copies of the preset's attention layer inlined with
``Graph.call``, with the weights tied (one layer's arrays shared by all), so an
80-layer stack fits in memory and the figures measure the compiler, not weight
generation.  Phases: build (the stack from one layer), optimize (the default
level-2 pipeline), lower (for the NumPy backend: attention recognised per
layer), export (decomposed ONNX, weights as external data, each distinct array
written once).  One run, wall time of each phase; the last column is optimize
time per layer, which stays flat when the optimizer is linear in graph size.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

import graphc
from graphc.optimizer import lower
from lowering import NUMPY_TARGET, export


def main() -> None:
    """Time each phase for each stack size and print a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mistral-7b")
    p.add_argument("--layers", default="1,8,32,80")
    args = p.parse_args()
    cfg = graphc.preset(args.preset)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}; preset {args.preset} (tied weights)")
    print()
    print("| layers | nodes | build s | optimize s | lower s | export s | optimize ms / layer | attention ops after lowering |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.layers.split(",")):
        t0 = time.perf_counter()
        g = graphc.attention_stack_graph(cfg, n, tie_weights=True)
        t1 = time.perf_counter()
        opt = graphc.optimize(g).graph
        t2 = time.perf_counter()
        low = lower(opt, NUMPY_TARGET)
        t3 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            export(opt, Path(tmp) / "stack.onnx", external_data=True)
        t4 = time.perf_counter()
        fused = low.op_counts().get("Attention", 0)
        print(f"| {n} | {len(g.nodes)} | {t1 - t0:.2f} | {t2 - t1:.2f} | {t3 - t2:.2f} | {t4 - t3:.2f} | {1e3 * (t2 - t1) / n:.1f} | {fused} |")


if __name__ == "__main__":
    main()
