"""Where graphc's NumPy prefill spends its time: the row-blocked attention kernel's steps, timed one by one.

    python benchmarks/profile_prefill.py [--config mistral-7b] [--seq 1024] [--threads 2]

Runs the same steps as ``lowering.kernels.attention_kernel.blocked_attention`` (same
blocks, BLAS pinned to one thread per block, blocks on ``--threads`` threads)
with a clock around each step, for causal and non-causal prefill, and prints
each step's share of the thread time next to the wall time of the real kernel
and of torch SDPA (when installed) on the same inputs, with the FLOP-bound time
at the GEMM peak measured now (float32 2048^2 ``np.matmul``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import graphc
import numpy as np

from graphc.visibility import Visibility
from lowering.kernels import compiled
from lowering.kernels.attention_kernel import GEMM_ROWS, _tasks, blocked_attention
from lowering.kernels.softmax import blas_description, exp_rows_, run_blocks

sys.path.insert(0, str(Path(__file__).parent))
from _common import gemm_probe, time_blocks, torch_sdpa  # noqa: E402

STEPS = ("Q K^T GEMM", "causal mask", "exp + row sums", "P V GEMM", "divide + copy out")


def profiled(q: np.ndarray, k: np.ndarray, v: np.ndarray, sq: int, offset: int | None, threads: int) -> dict[str, float]:
    """Thread-seconds per step of one call of the blocked kernel's prefill path (no window, no softcap)."""
    lead, groups = q.shape[0], q.shape[1] // sq
    t_len, dim, e_dim = k.shape[1], q.shape[2], v.shape[2]
    q5, k_t, out = q.reshape(lead, groups, sq, dim), np.swapaxes(k, -1, -2), np.empty((lead, groups, sq, e_dim), np.float32)
    rows = max(1, min(sq, GEMM_ROWS // groups))
    exp_rows = compiled.exp_rows_compiled if compiled.use_compiled() else exp_rows_
    spent: dict[str, float] = defaultdict(float)

    def block(task: tuple[int, int, int]) -> None:
        b0, b1, i0 = task
        i1 = min(sq, i0 + rows)
        r, c = i1 - i0, t_len if offset is None else max(0, min(t_len, i1 + offset))
        t0 = time.perf_counter()
        s = np.matmul(q5[b0:b1, :, i0:i1, :].reshape(b1 - b0, groups * r, dim), k_t[b0:b1, :, :c])
        t1 = time.perf_counter()
        if offset is not None:
            lo = max(0, min(c, i0 + offset + 1))
            hidden = Visibility.causal(offset).hidden(range(i0, i1), range(lo, c))
            if hidden.any():
                np.copyto(s.reshape(b1 - b0, groups, r, c)[..., lo:], np.float32(-np.inf), where=hidden)
        t2 = time.perf_counter()
        total = exp_rows(s)
        t3 = time.perf_counter()
        pv = np.matmul(s, v[b0:b1, :c, :])
        t4 = time.perf_counter()
        pv /= total
        out[b0:b1, :, i0:i1, :] = pv.reshape(b1 - b0, groups, r, e_dim)
        t5 = time.perf_counter()
        for name, dt in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            spent[name] += dt  # one += per step: a data race would lose a few microseconds at most

    run_blocks(block, _tasks(lead, range(0, sq, rows), threads), threads, pin_blas=True)
    return spent


def main() -> None:
    """Print the step profile of causal and non-causal prefill beside the kernel's and torch SDPA's wall times."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="mistral-7b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg = graphc.preset(args.config)
    rng = np.random.default_rng(0)
    hq, hkv, d, s = cfg.n_heads, cfg.n_kv_heads, cfg.hd, args.seq
    q = rng.standard_normal((1, hq, s, d), dtype=np.float32) * np.float32(cfg.softmax_scale)
    k = rng.standard_normal((1, hkv, s, d), dtype=np.float32)
    v = rng.standard_normal((1, hkv, s, d), dtype=np.float32)
    qf = q.reshape(hkv, hq // hkv * s, d)
    peak_probe = gemm_probe()
    print(f"{args.config}, prefill {s}, {args.threads} threads, {compiled.kernels_description()}, {blas_description()}")
    print("| case | step | thread ms | share |")
    print("|---|---|---|---|")
    summary = []
    for causal in (True, False):
        offset = 0 if causal else None
        spent = defaultdict(list)
        for _ in range(5):
            for name, t in profiled(qf, k[0], v[0], s, offset, args.threads).items():
                spent[name].append(t)
        med = {n: statistics.median(ts) for n, ts in spent.items()}
        total = sum(med.values())
        label = "causal" if causal else "non-causal"
        for name in STEPS:
            if name in med:
                print(f"| {label} | {name} | {1e3 * med[name]:.1f} | {100 * med[name] / total:.0f}% |")
        feeds = {"q_BHSD": q / np.float32(cfg.softmax_scale), "k_BHkvTD": k, "v_BHkvTD": v}
        vis = Visibility() if offset is None else Visibility.causal(offset)
        runs = {"graphc kernel": lambda f, o=vis: blocked_attention(qf, k[0], v[0], s, o, None, args.threads), "GEMM probe": peak_probe}
        sdpa = torch_sdpa([feeds], args.threads, causal)
        if sdpa is not None:
            runs["torch SDPA"] = sdpa
        times = time_blocks(runs, [feeds], 5)
        gemm_flops = 4 * hq * s * s * d * (0.5 if causal else 1.0)
        peak = 2 * 2048**3 / (times["GEMM probe"]["ms"] / 1e3)
        line = f"{label}: graphc kernel {times['graphc kernel']['ms']:.1f} ms wall"
        if "torch SDPA" in times:
            line += f", torch SDPA {times['torch SDPA']['ms']:.1f} ms"
        line += f"; both GEMMs at the measured peak ({peak / 1e9:.0f} GFLOP/s) alone take {1e3 * gemm_flops / peak:.1f} ms"
        summary.append(line)
    print()
    print("\n".join(summary))


if __name__ == "__main__":
    main()
