"""Unoptimized vs optimized graphs on the NumPy backend: time and peak memory.

    python benchmarks/bench_optimizer.py [--repeats N] [--json out.json] [--cases prefill,decode]

The attention core (Q [B,Hq,Sq,D], K/V [B,Hkv,Sk,D], causal, float32) of
mistral-7b (32/8 heads) and llama2-70b (64/8), for a 1024-token causal prefill
and a 1-token decode over a 4096-token cache.  Times are medians over the
repeats after one warm-up; for decode, calls rotate over enough input copies
that K/V do not stay in cache.  Peak memory is tracemalloc's peak during one
call (NumPy reports its buffers to tracemalloc).  The unoptimized graph is the
naive NumPy peer (``np.repeat`` of K/V).  Other runtimes (torch SDPA,
onnxruntime) are timed against graphc by ``bench_speed.py``, in one run under
one method.  Prints the Markdown table docs/benchmarks-guide.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tracemalloc

import numpy as np

import graphc
from lowering import NumpyInterpreter, prepare, random_inputs

from _common import median_ms

CASES = {
    "prefill": dict(batch=1, q_len=1024, kv_len=1024),
    "decode": dict(batch=1, q_len=1, kv_len=4096),
}


def _peak(fn, feeds) -> int:
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn(feeds)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def bench(preset: str, case: str, repeats: int) -> dict:
    """Measure one preset and case; returns a dict of figures."""
    cfg = graphc.preset(preset)
    g = graphc.sdpa_graph(cfg, causal=True, **CASES[case])
    h, report = graphc.optimize(g)
    copies = 1 if case == "prefill" else 8
    feeds_list = [random_inputs(g, seed=s) for s in range(copies)]
    naive = NumpyInterpreter(g).run  # as written: np.repeat of K/V, scores materialised
    opt = prepare(h, "numpy").run  # optimized, then lowered: attention runs as the blocked kernel
    a, b = naive(feeds_list[0])["attn_BHSD"], opt(feeds_list[0])["attn_BHSD"]
    row = {
        "preset": preset,
        "case": case,
        "heads": f"{cfg.n_heads}/{cfg.n_kv_heads}",
        "max_abs_diff": float(np.abs(a - b).max()),
        "unopt_ms": median_ms(naive, feeds_list, repeats),
        "opt_ms": median_ms(opt, feeds_list, repeats),
        "unopt_peak_mib": _peak(naive, feeds_list[0]) / 2**20,
        "opt_peak_mib": _peak(opt, feeds_list[0]) / 2**20,
        "model_repeat_mib": report.before.repeat_bytes / 2**20,
    }
    return row


def main() -> None:
    """Run every preset and case and print a table (and JSON when asked)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", default="prefill,decode")
    ap.add_argument("--presets", default="mistral-7b,llama2-70b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [bench(p, c, args.repeats) for p in args.presets.split(",") for c in args.cases.split(",")]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}; float32, batch 1, causal; medians of {args.repeats} calls\n"
    )
    print("| preset | case | as written ms | optimized ms | speedup | peak MiB before / after | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    labels = {"prefill": "causal prefill 1024", "decode": "decode 1 over 4096"}
    for r in rows:
        print(
            f"| {r['preset']} ({r['heads']}) | {labels[r['case']]} | {r['unopt_ms']:.1f} | {r['opt_ms']:.1f} | {r['unopt_ms'] / r['opt_ms']:.2f}x "
            f"| {r['unopt_peak_mib']:.1f} / {r['opt_peak_mib']:.1f} | {r['max_abs_diff']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
