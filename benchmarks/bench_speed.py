"""graphc against torch SDPA and onnxruntime's fused attention ops: one process, one method, ratios to the best peer.

    python benchmarks/bench_speed.py [--configs mistral-7b,llama2-70b,falcon-7b,llama2-7b] [--cases ...] [--repeats 5]
                                     [--threads N] [--out docs/bench_speed]

Attention core (Q [B, Hq, Sq, D], K/V [B, Hkv, Skv, D]), float32.  Variants:

- graphc numpy: ``graphc.optimize(g)`` with no hints, run by the NumPy backend;
- graphc ort-cpu: the same graph exported with ``attention="auto"`` for the
  run's sizes (causal prefill as query chunks, decode as grouped MatMuls,
  bidirectional prefill as the Attention op);
- peers: torch ``scaled_dot_product_attention(enable_gqa=True)``; onnxruntime's
  ``Attention``-23 and ``com.microsoft.GroupQueryAttention`` (graphc's export
  with that op forced); NumPy with ``np.repeat`` of K/V (the naive form).

Method: every variant is prepared and checked against the float64 NumPy
reference first and called once to warm up; then ``--repeats`` rounds each
call every variant once, in a rotating order, after a 0.2 s pause (so the
previous runtime's thread pool has gone idle: OpenMP and onnxruntime pools
spin after a call).  Round robin spreads the noise of this shared machine over
every variant instead of one variant's block of calls.  onnxruntime's intra-op
threads do not spin at all (``session.intra_op.allow_spinning = 0``), so its
idle pool does not steal the cores NumPy's and torch's pools use in the same
process; every runtime gets ``--threads`` threads.  Decode is
timed cache-warm (the same K/V every call) and cache-cold (rotating over copies
of K/V totalling at least 512 MiB).  Reported: median and p10-p90 of the
calls, GFLOP/s and % of the GEMM peak measured at start (prefill: the FLOPs of
the visible scores, so a causal prefill counts half the square), GB/s and % of
the read bandwidth measured at start (decode: bytes of K, V, Q and the
output), peak extra memory of the NumPy variants (tracemalloc), and the ratio
to the fastest peer.  Writes ``<out>.json``, ``<out>.md`` and, with matplotlib,
``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import graphc
from graphc.errors import GraphcError
from lowering import prepare, random_inputs

sys.path.insert(0, str(Path(__file__).parent))
from _common import torch_sdpa  # noqa: E402

CONFIGS = ("mistral-7b", "llama2-70b", "falcon-7b", "llama2-7b")
CASES = {
    "causal prefill 1024": dict(batch=1, q_len=1024, kv_len=1024, causal=True),
    "causal prefill 4096": dict(batch=1, q_len=4096, kv_len=4096, causal=True),
    "prefill 1024": dict(batch=1, q_len=1024, kv_len=1024, causal=False),
    "decode 4096 B=1": dict(batch=1, q_len=1, kv_len=4096, causal=False),
    "decode 4096 B=8": dict(batch=8, q_len=1, kv_len=4096, causal=False),
}
NAIVE_SCORES_LIMIT = 2 << 30  # bytes of S x S scores the naive NumPy form may materialise
FUSED_SCORES_LIMIT = 3 << 30  # onnxruntime's CPU Attention op materialises the scores (and its softmax a second copy)
COLD_BYTES = 512 << 20
PAUSE_S = 0.2
GRAPHC = ("graphc numpy", "graphc ort-cpu", "graphc import of the torch export, ORT")


def machine_limits(threads: int) -> tuple[float, float]:
    """(fp32 GEMM GFLOP/s, read GB/s) measured now: np.matmul 2048^2, and summing 512 MiB split over ``threads``."""
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    np.matmul(a, a)
    best = min(_timed(lambda: np.matmul(a, a)) for _ in range(5))
    gemm = 2 * 2048**3 / best / 1e9
    x = np.ones(COLD_BYTES // 4, np.float32)
    parts = np.array_split(x, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        best = min(_timed(lambda: list(pool.map(np.sum, parts))) for _ in range(5))
    return gemm, x.nbytes / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def reference(feeds: dict, causal: bool, scale: float, rows: int = 256) -> np.ndarray:
    """Float64 attention written out here (np.repeat of K/V, bottom-right causal mask), ``rows`` queries at a time so S x S never exists."""
    q, k, v = (feeds[n].astype(np.float64) for n in ("q_BHSD", "k_BHkvTD", "v_BHkvTD"))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    sq, sk = q.shape[2], k.shape[2]
    out = np.empty(q.shape[:3] + (v.shape[3],))
    for i0 in range(0, sq, rows):
        i1 = min(sq, i0 + rows)
        s = np.matmul(q[:, :, i0:i1], np.swapaxes(k, -1, -2)) * scale
        if causal:
            s[..., np.arange(sk)[None, :] > np.arange(i0, i1)[:, None] + (sk - sq)] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, i0:i1] = np.matmul(p / p.sum(-1, keepdims=True), v)
    return out


def _naive(feeds: dict, causal: bool, scale: float) -> np.ndarray:
    q, k, v = feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"]
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.float32(scale)
    if causal:
        s[..., np.triu(np.ones(s.shape[-2:], bool), s.shape[-1] - s.shape[-2] + 1)] = -np.inf
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    return np.matmul(s, v)


def variants(g: graphc.Graph, sizes: dict, threads: int, causal: bool, scale: float) -> dict[str, Callable[[dict], np.ndarray] | str]:
    """Every variant's run function, or the reason it cannot run."""
    out: dict[str, Callable[[dict], np.ndarray] | str] = {}
    opt = graphc.optimize(g).graph  # no hints, as a user calls it
    out["graphc numpy"] = _runner(lambda: prepare(opt, "numpy", threads=threads, sizes=sizes))
    out["graphc ort-cpu"] = _runner(lambda: prepare(opt, "ort-cpu", attention="auto", threads=threads, sizes=sizes))
    out["torch SDPA"] = torch_sdpa((), threads, causal) or "torch is not installed"
    q, kv = sizes["batch"] * g.types["q_BHSD"].shape[1] * sizes["q_len"], sizes["kv_len"]
    if q * kv * 4 > FUSED_SCORES_LIMIT:
        out["ORT Attention-23"] = f"skipped: the CPU kernel materialises {q * kv * 4 / 2**30:.1f} GiB of scores"
    else:
        out["ORT Attention-23"] = _runner(lambda: prepare(opt, "ort-cpu", attention="onnx-attention", threads=threads, sizes=sizes))
    out["ORT GroupQueryAttention"] = _runner(lambda: prepare(opt, "ort-cpu", attention="ort-gqa", threads=threads, sizes=sizes))
    if q * kv * 4 > NAIVE_SCORES_LIMIT:
        out["NumPy np.repeat (naive)"] = f"skipped: its scores would take {q * kv * 4 / 2**30:.1f} GiB"
    else:
        out["NumPy np.repeat (naive)"] = lambda f: _naive(f, causal, scale)
    return out


def _runner(build: Callable[[], object]) -> Callable[[dict], np.ndarray] | str:
    try:
        r = build()
    except GraphcError as e:
        return f"n/a: {str(e).split(';')[0]}"
    return lambda f: next(iter(r.run(f).values()))  # type: ignore[attr-defined]


def _peak_mib(fn: Callable[[dict], np.ndarray], feeds: dict) -> float:
    tracemalloc.start()
    fn(feeds)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def time_variants(
    runs: dict, feed_list: list[dict], want: np.ndarray, repeats: int, tol: float = 1e-3
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Check every variant against ``want`` (max abs error <= ``tol``), then time them in ``repeats`` round-robin rounds, a pause before each call.

    Returns the seconds per call of each variant that ran, and a note for each that did not.
    """
    times: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    for name, fn in runs.items():
        if isinstance(fn, str):
            notes[name] = fn
            continue
        got = fn(feed_list[0])
        err = float(np.abs(got - want).max())
        if not err <= tol:  # NaN included
            notes[name] = f"wrong result: max abs error {err:.1e}"
            continue
        times[name] = []
    names = list(times)
    for name in names:  # warm-up: sessions, thread pools, first-call allocations
        time.sleep(PAUSE_S)
        runs[name](feed_list[0])
    for r in range(repeats):  # round robin: noise from other tenants spreads over every variant, not one block of calls
        f = feed_list[(r + 1) % len(feed_list)]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            time.sleep(PAUSE_S)  # the previous runtime's thread pool goes idle before the next call
            times[name].append(_timed(lambda: runs[name](f)))
    return times, notes


def bench_case(config: str, case: str, threads: int, repeats: int, limits: tuple[float, float]) -> list[dict]:
    """Rows for one config and case (two for decode: cache-warm and cache-cold)."""
    cfg = graphc.preset(config)
    c = CASES[case]
    g = graphc.sdpa_graph(cfg.with_(causal=c["causal"]), batch=c["batch"], q_len=c["q_len"], kv_len=c["kv_len"])
    sizes = {"batch": c["batch"], "q_len": c["q_len"], "kv_len": c["kv_len"]}
    feeds = random_inputs(g, seed=0)
    want = reference(feeds, c["causal"], cfg.softmax_scale)
    runs = variants(g, sizes, threads, c["causal"], cfg.softmax_scale)
    decode = c["q_len"] == 1
    kv_bytes = feeds["k_BHkvTD"].nbytes + feeds["v_BHkvTD"].nbytes
    copies = max(2, -(-COLD_BYTES // kv_bytes)) if decode else 1
    cold = [feeds] + [random_inputs(g, seed=i + 1) for i in range(copies - 1)] if decode else [feeds]
    rows = []
    for temp, feed_list in (("warm", [feeds]), ("cold", cold)) if decode else (("-", [feeds]),):
        times, notes = time_variants(runs, feed_list, want, 3 * repeats if decode else repeats)  # decode calls are short: more of them
        flops = 4 * c["batch"] * cfg.n_heads * c["q_len"] * c["kv_len"] * cfg.hd * (0.5 if c["causal"] else 1.0)
        peak = {
            n: (lambda n=n: _peak_mib(runs[n], feeds))
            for n in ("graphc numpy", "NumPy np.repeat (naive)")
            if temp != "cold" and not isinstance(runs[n], str)
        }
        rows += make_rows(
            dict(config=config, case=case, cache=temp), runs, times, notes, flops, kv_bytes + 2 * feeds["q_BHSD"].nbytes, decode, limits, peak
        )
    return rows


def make_rows(
    key: dict,
    runs: dict,
    times: dict[str, list[float]],
    notes: dict[str, str],
    flops: float,
    bytes_moved: float,
    decode: bool,
    limits: tuple[float, float],
    peak: dict[str, Callable[[], float]],
) -> list[dict]:
    """A row per variant: median and p10-p90, ratio to the fastest peer, GB/s (decode) or GFLOP/s (prefill), peak MiB where measured."""
    peers = [statistics.median(t) for n, t in times.items() if n not in GRAPHC]
    best_peer = min(peers) if peers else None
    rows = []
    for name in runs:
        row = {**key, "variant": name}
        if name in times:
            t = sorted(times[name])
            med = statistics.median(t)
            row.update(
                ms=1e3 * med,
                p10=1e3 * t[len(t) // 10],
                p90=1e3 * t[min(len(t) - 1, (9 * len(t)) // 10)],
                vs_best_peer=med / best_peer if best_peer else None,
            )
            if decode:
                row.update(gbs=bytes_moved / med / 1e9, pct_bandwidth=100 * bytes_moved / med / 1e9 / limits[1])
            else:
                row.update(gflops=flops / med / 1e9, pct_gemm=100 * flops / med / 1e9 / limits[0])
            if name in peak:
                row["peak_mib"] = peak[name]()
        else:
            row["note"] = notes.get(name, "")
        rows.append(row)
    return rows


def bench_layer_case(case: str, threads: int, repeats: int, limits: tuple[float, float]) -> list[dict]:
    """Rows for one decoder-layer case (``speed_layer``): transformers eager/sdpa and the torch.onnx export against graphc."""
    from speed_layer import layer_feeds, layer_variants, layer_work

    with tempfile.TemporaryDirectory(prefix="graphc_layer_") as work:
        runs = layer_variants(case, threads, Path(work))
        feeds = layer_feeds(case)
        reference_run = runs["transformers eager"]
        if isinstance(reference_run, str):
            return [{"config": "mistral-7b layer", "case": case, "cache": "-", "variant": n, "note": str(r)} for n, r in runs.items()]
        want = reference_run(feeds)
        times, notes = time_variants(runs, [feeds], want, repeats, tol=1e-3 * float(np.abs(want).max()))
        flops, bytes_moved = layer_work(case)
        return make_rows(dict(config="mistral-7b layer", case=case, cache="-"), runs, times, notes, flops, bytes_moved, "decode" in case, limits, {})


def markdown(rows: list[dict]) -> str:
    """One table: a row per config/case/cache and variant."""
    out = [
        "| config | case | cache | variant | median ms (p10-p90) | vs best peer | GFLOP/s (% peak) or GB/s (% bw) | peak extra MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "ms" not in r:
            out.append(f"| {r['config']} | {r['case']} | {r['cache']} | {r['variant']} | {r['note']} | | | |")
            continue
        rate = f"{r['gflops']:.0f} ({r['pct_gemm']:.0f}%)" if "gflops" in r else f"{r['gbs']:.1f} ({r['pct_bandwidth']:.0f}%)"
        ratio = f"{r['vs_best_peer']:.2f}x" if r.get("vs_best_peer") else "-"
        bold = "**" if r["variant"] in GRAPHC else ""
        peak = f"{r['peak_mib']:.1f}" if "peak_mib" in r else "-"
        out.append(
            f"| {r['config']} | {r['case']} | {r['cache']} | {bold}{r['variant']}{bold} | {r['ms']:.2f} ({r['p10']:.2f}-{r['p90']:.2f}) | "
            f"{bold}{ratio}{bold} | {rate} | {peak} |"
        )
    return "\n".join(out)


ORT_FUSED = ("ORT Attention-23", "ORT GroupQueryAttention")
TARGET_CONFIGS = ("mistral-7b", "llama2-70b")


def targets(rows: list[dict]) -> str:
    """The issue's targets per case (mistral-7b, llama2-70b): graphc numpy / torch SDPA, graphc ort-cpu / best onnxruntime fused op, decode GB/s."""
    out = [
        "| config | case | cache | numpy / torch SDPA | target | ort-cpu / best ORT fused op | target | faster backend % of read bandwidth "
        "(decode B=1 cold: >= 67%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["config"], r["case"], r["cache"]) for r in rows if r["config"] in TARGET_CONFIGS))
    for key in keys:
        by = {r["variant"]: r for r in rows if (r["config"], r["case"], r["cache"]) == key and "ms" in r}
        config, case, cache = key
        cells = []
        if "graphc numpy" in by and "torch SDPA" in by:
            ratio = by["graphc numpy"]["ms"] / by["torch SDPA"]["ms"]
            limit = 1.15 if case.startswith("prefill") else 1.0
            cells += [f"{ratio:.2f}x", f"<= {limit:.2f}x {'met' if ratio <= limit else 'NOT met'}"]
        else:
            cells += ["-", "-"]
        fused = [by[n]["ms"] for n in ORT_FUSED if n in by]
        if "graphc ort-cpu" in by and fused:
            ratio = by["graphc ort-cpu"]["ms"] / min(fused)
            cells += [f"{ratio:.2f}x", f"<= 1.00x {'met' if ratio <= 1.0 else 'NOT met'}"]
        else:
            cells += ["-", "-"]
        if "gbs" in by.get("graphc ort-cpu", {}) or "gbs" in by.get("graphc numpy", {}):
            pct = max(by[n].get("pct_bandwidth", 0.0) for n in GRAPHC if n in by)
            bar = case == "decode 4096 B=1" and cache == "cold"
            cells.append(f"{pct:.0f}%" + ((" met" if pct >= 100 / 1.5 else " NOT met") if bar else ""))
        else:
            cells.append("-")
        out.append(f"| {config} | {case} | {cache} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def chart(rows: list[dict], path: Path) -> str:
    """A bar chart of time relative to the best peer per case (matplotlib), or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    keys = sorted(
        {(r["config"], r["case"], r["cache"]) for r in rows},
        key=lambda k: [r for r in rows].index(next(r for r in rows if (r["config"], r["case"], r["cache"]) == k)),
    )
    names = sorted({r["variant"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, len(keys) * 0.9), 5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [
            next((r.get("vs_best_peer") or 0 for r in rows if (r["config"], r["case"], r["cache"]) == k and r["variant"] == name and "ms" in r), 0)
            for k in keys
        ]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 for j in range(len(keys))])
    ax.set_xticklabels([f"{c}\n{case}{'' if cache == '-' else ' ' + cache}" for c, case, cache in keys], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("time / fastest peer (lower is better)")
    ax.set_ylim(0, 3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def main() -> None:
    """Run the selected configs and cases; print the table; write JSON, Markdown and the chart."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--layer-cases", default="all", help="decoder-layer cases (speed_layer.py), comma-separated; 'all' or 'none'")
    ap.add_argument("--out", default="docs/bench_speed")
    ap.add_argument("--summarize", metavar="JSON", help="print the tables of an earlier run's JSON instead of running")
    args = ap.parse_args()
    if args.summarize:
        doc = json.loads(Path(args.summarize).read_text())
        print(doc["machine"])
        print(markdown(doc["rows"]))
        print()
        print(targets(doc["rows"]))
        return
    configs = [c for c in args.configs.split(",") if c]
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; cases: {', '.join(CASES)}")
    from speed_layer import LAYER_CASES

    layer_cases = list(LAYER_CASES) if args.layer_cases == "all" else [c for c in args.layer_cases.split(",") if c and c != "none"]
    for c in layer_cases:
        if c not in LAYER_CASES:
            raise SystemExit(f"unknown layer case {c!r}; layer cases: {', '.join(LAYER_CASES)}")
    limits = machine_limits(args.threads)
    import onnxruntime as ort

    header = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.threads} threads per runtime; numpy {np.__version__}, "
        f"onnxruntime {ort.__version__}, torch {_torch_version()}; measured limits: fp32 GEMM {limits[0]:.0f} GFLOP/s, read {limits[1]:.1f} GB/s"
    )
    print(header, flush=True)
    rows: list[dict] = []
    for config in configs:
        for case in cases:
            t0 = time.perf_counter()
            rows += bench_case(config, case, args.threads, args.repeats, limits)
            print(f"  {config} / {case}: {time.perf_counter() - t0:.0f} s", flush=True)
    for case in layer_cases:
        t0 = time.perf_counter()
        rows += bench_layer_case(case, args.threads, max(3, args.repeats - 2), limits)
        print(f"  mistral-7b layer / {case}: {time.perf_counter() - t0:.0f} s", flush=True)
    table = markdown(rows) + "\n\n" + targets(rows)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({"machine": header, "limits": {"gemm_gflops": limits[0], "read_gbs": limits[1]}, "rows": rows}, indent=1)
    )
    out.with_suffix(".md").write_text(header + "\n\n" + table + "\n")
    print(chart(rows, out.with_suffix(".png")))


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    main()
