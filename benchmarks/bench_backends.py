"""Backends side by side on the attention core: NumPy, onnxruntime (decomposed and fused), torch SDPA.

    python benchmarks/bench_backends.py [--repeats N] [--preset mistral-7b] [--threads 2]

Causal prefill of 1024 tokens and one decode token over a 4096-token cache,
float32, batch 1.  Every row runs the same graph (or, for torch SDPA, the same
inputs); times are medians after one warm-up, and each result is checked
against the NumPy interpreter before it is timed.  Ratios are against
onnxruntime's own fused ``Attention`` op measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform

import numpy as np

import graphc
from graphc.errors import GraphcError
from lowering import NumpyInterpreter, prepare, random_inputs

from _common import median_ms, torch_sdpa

CASES = {"causal prefill 1024": dict(batch=1, q_len=1024, kv_len=1024), "decode 1 over 4096": dict(batch=1, q_len=1, kv_len=4096)}


def main() -> None:
    """Run both cases and print one table per case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--preset", default="mistral-7b")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    cfg = graphc.preset(args.preset)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; preset {args.preset} ({cfg.n_heads}/{cfg.n_kv_heads} heads, head_dim {cfg.hd}); threads {args.threads}")
    for case, dims in CASES.items():
        g = graphc.sdpa_graph(cfg, causal=True, **dims)
        h = graphc.optimize(g).graph
        copies = 1 if dims["q_len"] > 1 else 8  # decode: rotate inputs so K/V are not cache-resident
        feeds_list = [random_inputs(g, seed=s) for s in range(copies)]
        want = prepare(g, "numpy", compute_dtype="float64", reference=True).run(feeds_list[0])["attn_BHSD"]
        specs = [
            ("numpy, repeat K/V (graph as written)", lambda: NumpyInterpreter(g, threads=args.threads).run),
            ("numpy, Attention kernel (optimized)", lambda: prepare(h, "numpy", threads=args.threads).run),
            ("ort-cpu, grouped MatMul (optimized)", lambda: prepare(h, "ort-cpu", threads=args.threads).run),
            ("ort-cpu, Attention op", lambda: prepare(h, "ort-cpu", attention="onnx-attention", threads=args.threads).run),
            ("ort-cpu, GroupQueryAttention op", lambda: prepare(h, "ort-cpu", attention="ort-gqa", threads=args.threads).run),
        ]
        sdpa = torch_sdpa(feeds_list, args.threads, causal=dims["q_len"] == dims["kv_len"])
        if sdpa is not None:
            specs.append(("torch SDPA enable_gqa", lambda: sdpa))
        results, skipped = [], []
        for name, make in specs:
            try:
                fn = make()
            except GraphcError as e:
                skipped.append((name, str(e)))
                continue
            out = fn(feeds_list[0])
            got = out["attn_BHSD"] if isinstance(out, dict) else out
            err = float(np.abs(got - want).max())
            results.append((name, median_ms(fn, feeds_list, args.repeats), err))
        peer = dict((n, t) for n, t, _ in results)["ort-cpu, Attention op"]
        print(f"\n{case} (ratios: time / onnxruntime Attention op in this run)")
        print(f"{'backend':<38} {'median ms':>10} {'vs Attention':>13} {'max abs err':>12}")
        for name, ms, err in results:
            print(f"{name:<38} {ms:>10.2f} {ms / peer:>12.2f}x {err:>12.1e}")
        for name, why in skipped:
            print(f"{name:<38} {'n/a':>10}  ({why})")


if __name__ == "__main__":
    main()
