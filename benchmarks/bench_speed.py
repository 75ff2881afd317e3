"""graphc against torch SDPA and onnxruntime's fused attention ops: one process, one method, ratios to the best peer.

    python benchmarks/bench_speed.py [--configs mistral-7b,llama2-70b,falcon-7b,llama2-7b] [--cases ...] [--blocks 5]
                                     [--threads N] [--avx2] [--out docs/bench/speed]

``--avx2`` holds NumPy (its ufuncs and OpenBLAS), numba's kernels and torch (its dispatch, MKL and oneDNN) to AVX2 on a CPU that has
AVX-512, to compare graphc's NumPy backend with torch SDPA as on an AVX2-only CPU; onnxruntime's MLAS picks its
kernels from the CPU and has no switch, so its rows stay AVX-512 (the header says which library ran what).

Attention core (Q [B, Hq, Sq, D], K/V [B, Hkv, Skv, D]), float32.  Variants:

- graphc numpy: ``graphc.optimize(g)`` with no hints, run by the NumPy backend;
- graphc ort-cpu: the same graph exported with ``attention="auto"`` for the
  run's sizes (causal prefill as query chunks, decode as grouped MatMuls,
  bidirectional prefill as the Attention op);
- peers: torch ``scaled_dot_product_attention(enable_gqa=True)``; onnxruntime's
  ``Attention``-23 and ``com.microsoft.GroupQueryAttention`` (graphc's export
  with that op forced); NumPy with ``np.repeat`` of K/V (the naive form).

Method (``benchmarks/_common.py``): every variant is prepared and checked
against the float64 NumPy reference first; then each is warmed up and timed
in blocks of back-to-back calls, the blocks alternating between variants
(A B C A B C ..., rotating order) ``--blocks`` times; a variant's figure is the
median of its block medians (p10-p90 over all its calls).  No pause precedes
a timed call (a pause measures the CPU waking up, milliseconds here); the first
call after 0.2 s idle is its own column.  onnxruntime's intra-op threads do
not spin (``session.intra_op.allow_spinning = 0``), so an idle pool does not
steal the cores the next runtime uses; every runtime gets ``--threads``
threads.  Decode is timed cache-warm (the same K/V every call) and cache-cold
(rotating over copies of K/V totalling at least 1 GiB, so every call reads
from memory).  The machine's limits are measured inside the same alternation,
as one more variant of each case: read bandwidth (``torch.sum`` over 1 GiB,
all threads) for decode, GEMM peak (float32 2048^2 ``np.matmul``, all
threads) for prefill.  Reported: median and p10-p90, GFLOP/s and % of that
GEMM peak (prefill: the FLOPs of the visible scores, so a causal prefill
counts half the square), GB/s and % of that read bandwidth (decode: bytes of
K, V, Q and the output), peak extra memory of the NumPy variants
(tracemalloc), the ratio to the fastest peer, and the first call after idle.
Writes ``<out>.json``, ``<out>.md`` and, with matplotlib, ``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

import graphc
from graphc.errors import GraphcError
from lowering import prepare, random_inputs

sys.path.insert(0, str(Path(__file__).parent))
from _common import gemm_probe, read_probe, time_after_idle, time_blocks, torch_sdpa  # noqa: E402

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
COLD_BYTES = 1 << 30
GRAPHC = ("graphc numpy", "graphc ort-cpu", "graphc import of the torch export, ORT")


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
    runs: dict, feed_list: list[dict], want: np.ndarray, blocks: int, probe: tuple[str, Callable[[dict], object]], tol: float = 1e-3
) -> tuple[dict[str, dict], dict[str, str]]:
    """Check every variant against ``want`` (max abs error <= ``tol``), then time them and the limit ``probe`` with :func:`time_blocks`.

    Returns the timing of each variant that ran (and of the probe, under its
    name), and a note for each that did not.
    """
    timed: dict[str, Callable[[dict], object]] = {}
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
        timed[name] = fn
    times = time_blocks({**timed, probe[0]: probe[1]}, feed_list, blocks)
    for name, fn in timed.items():
        times[name]["idle_ms"] = time_after_idle(fn, feed_list[0])
    return times, notes


READ_BYTES = 1 << 30
GEMM_N = 2048


def _probe(decode: bool, threads: int) -> tuple[str, Callable[[dict], object]]:
    """The limit measured beside a case: read bandwidth for decode, GEMM peak for prefill."""
    if decode:
        name, fn = read_probe(threads, READ_BYTES)
        return f"limit: read bandwidth ({name}, 1 GiB)", fn
    return f"limit: GEMM peak (np.matmul {GEMM_N}^2)", gemm_probe(GEMM_N)


def _limit(times: dict[str, dict], decode: bool) -> float:
    """GB/s (decode) or GFLOP/s (prefill) of the case's probe."""
    (name,) = [n for n in times if n.startswith("limit: ")]
    seconds = times[name]["ms"] / 1e3
    return READ_BYTES / seconds / 1e9 if decode else 2 * GEMM_N**3 / seconds / 1e9


def bench_case(config: str, case: str, threads: int, blocks: int) -> list[dict]:
    """Rows for one config and case (two sets for decode: cache-warm and cache-cold)."""
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
    probe = _probe(decode, threads)
    rows = []
    for temp, feed_list in (("warm", [feeds]), ("cold", cold)) if decode else (("-", [feeds]),):
        times, notes = time_variants(runs, feed_list, want, blocks, probe)
        flops = 4 * c["batch"] * cfg.n_heads * c["q_len"] * c["kv_len"] * cfg.hd * (0.5 if c["causal"] else 1.0)
        peak = {
            n: (lambda n=n: _peak_mib(runs[n], feeds))
            for n in ("graphc numpy", "NumPy np.repeat (naive)")
            if temp != "cold" and not isinstance(runs[n], str)
        }
        work = kv_bytes + 2 * feeds["q_BHSD"].nbytes if decode else flops
        key = dict(config=config, case=case, cache=temp, flops=flops)
        rows += make_rows(key, runs, times, notes, work, decode, _limit(times, decode), peak)
    return rows


def make_rows(
    key: dict,
    runs: dict,
    times: dict[str, dict],
    notes: dict[str, str],
    work: float,
    decode: bool,
    limit: float,
    peak: dict[str, Callable[[], float]],
) -> list[dict]:
    """A row per variant: median and p10-p90, ratio to the fastest peer, GB/s (decode: ``work`` bytes) or GFLOP/s (``work`` FLOPs) of ``limit``."""
    peers = [t["ms"] for n, t in times.items() if n not in GRAPHC and not n.startswith("limit: ")]
    best_peer = min(peers) if peers else None
    rows = []
    for name in runs:
        row = {**key, "variant": name}
        if name in times:
            t = times[name]
            row.update(t, vs_best_peer=t["ms"] / best_peer if best_peer else None)
            rate = work / (t["ms"] / 1e3) / 1e9
            if decode:
                row.update(gbs=rate, pct_bandwidth=100 * rate / limit, read_gbs=limit)
            else:
                row.update(gflops=rate, pct_gemm=100 * rate / limit, gemm_gflops=limit)
            if name in peak:
                row["peak_mib"] = peak[name]()
        else:
            row["note"] = notes.get(name, "")
        rows.append(row)
    return rows


def bench_layer_case(case: str, threads: int, blocks: int) -> list[dict]:
    """Rows for one decoder-layer or stack case (``speed_layer``): transformers eager/sdpa and the torch.onnx export against graphc."""
    from speed_layer import LAYER_CASES, layer_feeds, layer_variants, layer_work

    label = f"mistral-7b {LAYER_CASES[case]['layers']}-layer"
    with tempfile.TemporaryDirectory(prefix="graphc_layer_") as work:
        runs = layer_variants(case, threads, Path(work))
        feeds = layer_feeds(case)
        reference_run = runs["transformers eager"]
        if isinstance(reference_run, str):
            return [{"config": label, "case": case, "cache": "-", "variant": n, "note": str(r)} for n, r in runs.items()]
        want = reference_run(feeds)
        decode = "decode" in case
        times, notes = time_variants(runs, [feeds], want, blocks, _probe(decode, threads), tol=1e-3 * float(np.abs(want).max()))
        flops, bytes_moved = layer_work(case)
        return make_rows(
            dict(config=label, case=case, cache="-"), runs, times, notes, bytes_moved if decode else flops, decode, _limit(times, decode), {}
        )


def markdown(rows: list[dict]) -> str:
    """One table: a row per config/case/cache and variant."""
    out = [
        "| config | case | cache | variant | median ms (p10-p90) | vs best peer | GFLOP/s (% of GEMM peak) or GB/s (% of read bw) | "
        "first call after 0.2 s idle, ms | peak extra MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "ms" not in r:
            out.append(f"| {r['config']} | {r['case']} | {r['cache']} | {r['variant']} | {r['note']} | | | | |")
            continue
        if "gflops" in r:
            rate = f"{r['gflops']:.0f} ({r['pct_gemm']:.0f}% of {r['gemm_gflops']:.0f})"
        else:
            rate = f"{r['gbs']:.1f} ({r['pct_bandwidth']:.0f}% of {r['read_gbs']:.1f})"
        ratio = f"{r['vs_best_peer']:.2f}x" if r.get("vs_best_peer") else "-"
        bold = "**" if r["variant"] in GRAPHC else ""
        peak = f"{r['peak_mib']:.1f}" if "peak_mib" in r else "-"
        out.append(
            f"| {r['config']} | {r['case']} | {r['cache']} | {bold}{r['variant']}{bold} | {r['ms']:.2f} ({r['p10']:.2f}-{r['p90']:.2f}) | "
            f"{bold}{ratio}{bold} | {rate} | {r['idle_ms']:.2f} | {peak} |"
        )
    return "\n".join(out)


OWN = ("graphc numpy", "graphc ort-cpu")


def _target_rows(key: tuple[str, str, str], by: dict[str, dict], gemm_peak: float | None) -> list[tuple[str, float, str, bool | None]]:
    """``(measure, value, target text, met)`` for one config/case/cache (``met`` None: context, not a target).

    ``gemm_peak`` (GFLOP/s, from the config's prefill cases of the same run)
    gives decode its roofline: the slower of reading K/V at the measured
    bandwidth and doing its FLOPs at the GEMM peak; a row says so where the
    FLOPs are the slower.
    """
    config, case, cache = key
    out: list[tuple[str, float, str, bool | None]] = []
    own = [n for n in OWN if n in by]
    if case.startswith("decode") and cache == "cold" and own:
        pct = max(by[n]["pct_bandwidth"] for n in own)
        out.append(("faster graphc backend, % of read bandwidth", pct, ">= 80%", pct >= 80))
        row = by[own[0]]
        if gemm_peak and "flops" in row:
            fastest = min(by[n]["ms"] for n in own)
            read_ms = row["gbs"] * row["ms"] / row["read_gbs"]  # the case's bytes at the measured bandwidth
            flop_ms = 1e3 * row["flops"] / (gemm_peak * 1e9)
            if flop_ms > read_ms:  # FLOPs at the GEMM peak take longer than reading K/V (many query rows per KV head: MQA)
                out.append(("faster graphc backend, % of roofline (GEMM-peak-bound)", 100 * flop_ms / fastest, "-", None))
    if "prefill" in case and "layer" not in config and "torch SDPA" in by:
        torch_ms = by["torch SDPA"]["ms"]
        causal = case.startswith("causal")
        if "graphc numpy" in by:
            r = by["graphc numpy"]["ms"] / torch_ms
            limit = 0.9 if causal else 1.0
            out.append(("graphc numpy / torch SDPA", r, f"<= {limit:.1f}x", r <= limit))
        if causal and "graphc ort-cpu" in by:
            r = by["graphc ort-cpu"]["ms"] / torch_ms
            out.append(("graphc ort-cpu / torch SDPA", r, "<= 1.0x", r <= 1.0))
    if "layer" in config and own:
        best = min(by[n]["ms"] for n in own)
        limit = 0.8 if "decode" in case else 1.0
        for peer in ("transformers sdpa", "torch.onnx export on ORT"):
            if peer in by:
                r = best / by[peer]["ms"]
                out.append((f"faster graphc backend / {peer}", r, f"<= {limit:.1f}x", r <= limit))
    return out


def targets(rows: list[dict]) -> str:
    """The targets per case: decode % of read bandwidth, prefill against torch SDPA, layer and stack against transformers and its export."""
    out = ["| config | case | cache | measure | value | target | met |", "|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["config"], r["case"], r["cache"]) for r in rows))
    peaks: dict[str, float] = {}
    for r in rows:
        if r.get("gemm_gflops"):
            peaks[r["config"]] = max(peaks.get(r["config"], 0.0), r["gemm_gflops"])
    for key in keys:
        by = {r["variant"]: r for r in rows if (r["config"], r["case"], r["cache"]) == key and "ms" in r}
        for measure, value, target, met in _target_rows(key, by, peaks.get(key[0])):
            shown = f"{value:.1f}%" if "%" in measure else f"{value:.2f}x"
            verdict = "-" if met is None else "met" if met else "**NOT met**"
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | {measure} | {shown} | {target} | {verdict} |")
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


def compile_seconds() -> str:
    """The compiled kernels' first-call cost in a fresh process: compiling (empty numba cache) and loading from the cache."""
    from lowering.kernels import compiled

    if not compiled.use_compiled():
        return f"compiled kernels off: {compiled.compiled_reason()}"
    code = "from lowering.kernels.compiled import warm_up; print(warm_up())"
    with tempfile.TemporaryDirectory(prefix="graphc_numba_cache_") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        runs = [float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout) for _ in range(2)]
    return f"numba kernels: first call compiles in {runs[0]:.1f} s, then loads from the on-disk cache in {runs[1]:.2f} s"


def main() -> None:
    """Run the selected configs and cases; print the table; write JSON, Markdown and the chart."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--blocks", type=int, default=5, help="alternating blocks of back-to-back calls per variant")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--layer-cases", default="all", help="decoder-layer and stack cases (speed_layer.py), comma-separated; 'all' or 'none'")
    ap.add_argument("--out", default="docs/bench/speed")
    ap.add_argument("--summarize", metavar="JSON", help="print the tables of an earlier run's JSON instead of running")
    ap.add_argument("--avx2", action="store_true", help="hold NumPy's BLAS, numba and torch to AVX2 (onnxruntime has no such switch)")
    args = ap.parse_args()
    if args.avx2 and any(os.environ.get(k) != v for k, v in AVX2_ONLY.items()):  # read when the libraries load: start again with them set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ONLY})
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
    import onnxruntime as ort

    from lowering.kernels.compiled import kernels_description
    from lowering.kernels.softmax import blas_description

    header = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.threads} threads per runtime; numpy {np.__version__} "
        f"({kernels_description()}, {blas_description()}), onnxruntime {ort.__version__}, torch {_torch_version()}; {compile_seconds()}; "
        f"instructions: {_instructions(args.avx2)}"
    )
    print(header, flush=True)
    rows: list[dict] = []
    for config in configs:
        for case in cases:
            t0 = time.perf_counter()
            rows += bench_case(config, case, args.threads, args.blocks)
            print(f"  {config} / {case}: {time.perf_counter() - t0:.0f} s", flush=True)
    for case in layer_cases:
        t0 = time.perf_counter()
        rows += bench_layer_case(case, args.threads, args.blocks)
        print(f"  {case}: {time.perf_counter() - t0:.0f} s", flush=True)
    table = markdown(rows) + "\n\n" + targets(rows)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": header, "rows": rows}, indent=1))
    drawn = chart(rows, out.with_suffix(".png"))
    print(drawn)
    png = f"Chart: [{out.name}.png]({out.name}.png) (time relative to the fastest peer per case).\n" if not drawn.startswith("no chart") else ""
    out.with_suffix(".md").write_text(header + "\n\n" + table + "\n\n" + png + f"Raw figures: [{out.name}.json]({out.name}.json).\n")


AVX2_ONLY = {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "NUMBA_CPU_NAME": "haswell", "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"}  # fmt: skip
"""``--avx2``: what holds each library to AVX2 on a CPU that has AVX-512 (OpenBLAS's kernels, torch's dispatch and its
MKL and oneDNN, numba's target, NumPy's own ufunc dispatch).  onnxruntime's MLAS reads the CPU itself and has no such switch."""


def _instructions(avx2: bool) -> str:
    """What the run's libraries were allowed: the CPU's AVX-512 flags, and with ``--avx2`` who was held to AVX2."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    cpu = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    try:
        import torch

        torch_isa = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        torch_isa = "-"
    setting = os.environ.get("GRAPHC_TORCH_ATTENTION", "")
    attention = {"1": "torch's SDPA", "0": "graphc's kernel"}.get(setting, "the faster of graphc's kernel and torch's SDPA, timed")
    if not avx2:
        return f"the CPU's own ({cpu}; torch dispatches {torch_isa}); graphc numpy's prefill attention: {attention}"
    return (f"AVX2 for NumPy (ufuncs and BLAS), numba and torch (torch dispatches {torch_isa}) on a CPU with {cpu}; onnxruntime: "
            f"the CPU's own ({cpu}, no switch); graphc numpy's prefill attention: {attention}")  # fmt: skip


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    main()
