"""Where one decode step of an ONNX causal LM spends its time on onnxruntime: per op type, from onnxruntime's own profiler.

Runs each given model (optimum-style inputs: ``input_ids``, ``attention_mask``, optional ``position_ids``,
``past_key_values.{i}.key/value``) on one token over a ``--past``-token cache, ``--steps`` times back to back with
profiling on, and prints per model the mean ``model_run`` time, the kernels' share of it and the op types
that take the most kernel time (with their node count per step)::

    python benchmarks/profile_decode_onnx.py /tmp/models/tiny/graphc/model.onnx /tmp/models/tiny/optimum/model.onnx \\
        /tmp/models/tiny/genai/model.onnx [--past 140] [--steps 200]

(``bench_generate.py`` writes those three files.)  Profiling adds a few microseconds per node, so the
totals sit above the benchmark's; the split between op types is what it is for.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

import numpy as np


def _cache_dims(sess, heads: int, head_dim: int) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    """(kv heads, head dim) per cache input; an axis a file leaves symbolic (genai's ``kv_cache_dim``) takes the given default."""
    out = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            h, d = i.shape[1], i.shape[3]
            out[i.name] = (h if isinstance(h, int) else heads, d if isinstance(d, int) else head_dim)
    return out


def profile(path: str, past: int, steps: int, heads: int, head_dim: int) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(us per run, kernel us per run, [(op type, kernel us per run, nodes per run)] most expensive first)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "decode")
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {
        n: rng.standard_normal((1, h, past, d), dtype=np.float32) for n, (h, d) in _cache_dims(sess, heads, head_dim).items()
    }
    feeds["input_ids"] = np.array([[5]], np.int64)
    feeds["attention_mask"] = np.ones((1, past + 1), np.int64)
    if any(i.name == "position_ids" for i in sess.get_inputs()):
        feeds["position_ids"] = np.array([[past]], np.int64)
    names = [o.name for o in sess.get_outputs()]
    for _ in range(steps):
        sess.run(names, feeds)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    kernel: collections.Counter[str] = collections.Counter()
    nodes: collections.Counter[str] = collections.Counter()
    runs, run_us = 0, 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            kernel[e["args"]["op_name"]] += e["dur"]
            nodes[e["args"]["op_name"]] += 1
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            runs += 1
            run_us += e["dur"]
    rows = [(op, us / runs, nodes[op] / runs) for op, us in kernel.most_common()]
    return run_us / runs, sum(kernel.values()) / runs, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--past", type=int, default=140)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--heads", type=int, default=2, help="KV heads where a file leaves the axis symbolic (default 2)")
    p.add_argument("--head-dim", type=int, default=32, help="head dim where a file leaves the axis symbolic (default 32)")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    for path in args.models:
        run_us, kernel_us, rows = profile(path, args.past, args.steps, args.heads, args.head_dim)
        total_nodes = sum(n for _, _, n in rows)
        print(f"{path}: {run_us:.0f} us per decode step, kernels {kernel_us:.0f} us in {total_nodes:.0f} nodes")
        for op, us, n in rows[: args.top]:
            print(f"  {op:34s} {us:8.1f} us  {n:4.0f} nodes")


if __name__ == "__main__":
    main()
