"""Sharding by KV-head group on Dask: 2 worker processes against 1 process, for a llama2-70b-shaped attention layer and a whole model.

    python benchmarks/bench_sharding.py [--config llama2-70b] [--shards 2] [--repeats 5] [--out docs/bench/sharding]

Cases: causal prefill of 1024 tokens (``attention_layer_graph``) and one token
decoded over a 4096-token cache (``kv_cache_graph``), float32, batch 1, the
graph optimized with no hints.  "1 process": the whole layer on the NumPy
backend with every core.  "sharded": ``shard(graph, n)`` on a Dask
LocalCluster of ``n`` worker processes with ``cores / n`` threads each; the
weights are placed once (reported as setup bytes); decode steps feed the
previous step's cache back as resident values, so after the first step only
the new token goes out and one addend of the output comes back per shard.
Each timed call is checked against the 1-process result.  A second table
(:func:`bench_lm`) decodes a whole 4-layer model greedily both ways and reports
per token the time, the bytes between the driver and the workers and between
the workers, the all-reduces and the driver's waits, beside what
``docs/sharding.md`` predicts.  Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import graphc
from graphc.sharding import shard
from lowering.distributed.dask_shards import close_cluster, local_cluster, sharded_runner
from lowering import prepare, random_inputs

CASES = {"prefill 1024": dict(seq=1024, past=0), "decode over 4096": dict(seq=1, past=4096)}


def _graph(cfg: graphc.AttentionConfig, case: str) -> tuple[graphc.Graph, dict[str, int]]:
    c = CASES[case]
    if c["past"]:
        return graphc.kv_cache_graph(cfg, seed=0), dict(batch=1, seq=1, past_seq=c["past"])
    return graphc.attention_layer_graph(cfg, seed=0), dict(batch=1, seq=c["seq"])


def bench(config: str, n: int, repeats: int, client: object) -> list[dict]:
    """One row per case and variant: median and p10-p90 ms, bytes sent/received per call, setup bytes."""
    cfg = graphc.preset(config)
    threads = os.cpu_count() or 1
    rows = []
    for case in CASES:
        g, sizes = _graph(cfg, case)
        opt = graphc.optimize(g).graph
        feeds = random_inputs(g, seed=1, **sizes)
        single = prepare(opt, "numpy", threads=threads, sizes=sizes)
        want = single.run(feeds)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            single.run(feeds)
            times.append(time.perf_counter() - t0)
        rows.append(_row(config, case, "1 process", times, threads=threads))
        t0 = time.perf_counter()
        runner = sharded_runner(shard(opt, n), backend="numpy", client=client, threads=max(1, threads // n), sizes=sizes)
        setup_s = time.perf_counter() - t0
        resident = [o for o in ("present_key", "present_value") if o in g.outputs]
        runner.run(feeds, resident=resident)
        first = (runner.last.bytes_sent, runner.last.bytes_received)
        step_feeds = feeds
        if resident:  # later steps read the cache the previous step left on the workers; same past length each call
            step_feeds = {
                **feeds,
                **{"past_key": _resident_past(runner, feeds, "past_key"), "past_value": _resident_past(runner, feeds, "past_value")},
            }
        times, stats = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = runner.run(step_feeds, resident=resident)
            times.append(time.perf_counter() - t0)
            stats.append(runner.last)
            err = float(np.abs(out["out_BSM"] - want["out_BSM"]).max())
            if not err <= 1e-3:
                raise SystemExit(f"{case}: sharded result differs from the 1-process result by {err:.2e}")
        last = stats[-1]
        rows.append(
            _row(
                config,
                case,
                f"sharded x{n} (Dask, {n} workers)",
                times,
                threads=max(1, threads // n),
                sent=last.bytes_sent,
                received=last.bytes_received,
                first_sent=first[0],
                setup_bytes=runner.executor.setup_bytes,
                setup_s=setup_s,  # type: ignore[attr-defined]
                shard_ms=[1e3 * statistics.median(s[i] for st in stats for s in st.shard_s[:1]) for i in range(n)],
            )
        )
    return rows


LM_CONFIG = {"model_type": "mistral", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 5632, "num_hidden_layers": 4, "vocab_size": 32000, "rope_theta": 10000.0}  # fmt: skip
"""The whole-model case: a 4-layer Mistral-shaped model of 1.3 GB in float32 (random weights)."""


def bench_lm(n: int, rounds: int, client: object, prompt: int = 32, new: int = 16) -> list[dict]:
    """Greedy decoding of the whole model: 1 process vs ``n`` Dask workers (every layer's attention and MLP split, the residual stream
    and the caches on the workers); per token the time, the bytes each way and between the workers, the all-reduces and the driver's
    waits, beside what docs/sharding.md predicts (``2 L n (n-1) B M b`` between workers, ``2 L`` all-reduces)."""
    from graphc.attention import causal_lm_config_from_hf
    from lowering import generate

    cfg = causal_lm_config_from_hf(LM_CONFIG)
    threads = os.cpu_count() or 1
    g = graphc.optimize(graphc.causal_lm_graph(cfg, seed=0, logits="last"), hints={"batch": 1, "seq": 1, "past_seq": prompt + new}).graph
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, prompt).tolist()
    single = prepare(g, "numpy", threads=threads)
    t0 = time.perf_counter()
    runner = sharded_runner(shard(g, n), backend="numpy", client=client, threads=max(1, threads // n))
    setup_s = time.perf_counter() - t0
    variants = {"1 process": single, f"sharded x{n} (Dask, {n} workers)": runner}
    for r in variants.values():
        generate(g, [tokens], 2, runner=r)
    per_token: dict[str, list[float]] = {v: [] for v in variants}
    results = {}
    for _ in range(rounds):
        for v, r in variants.items():
            results[v] = generate(g, [tokens], new, runner=r)
            per_token[v].append(results[v].ms_per_token)
    base = results["1 process"].new_tokens
    if not all((res.new_tokens == base).all() for res in results.values()):
        raise SystemExit("the sharded run's tokens differ from the 1-process run's")
    last = runner.last  # the final decode step's statistics
    d, layers, b = cfg.d_model, cfg.n_layers, 4
    rows = [_row("4-layer LM", f"decode, {prompt}-token prompt", "1 process", [t / 1e3 for t in per_token["1 process"]], threads=threads)]
    rows.append(
        _row(
            "4-layer LM",
            f"decode, {prompt}-token prompt",
            f"sharded x{n} (Dask, {n} workers)",
            [t / 1e3 for t in per_token[f"sharded x{n} (Dask, {n} workers)"]],
            threads=max(1, threads // n),
            sent=last.bytes_sent,
            received=last.bytes_received,
            between=last.bytes_between_shards,
            between_model=2 * layers * n * (n - 1) * 1 * d * b,
            all_reduces=last.all_reduces,
            all_reduces_model=2 * layers,
            driver_waits=last.driver_waits,
            setup_bytes=runner.executor.setup_bytes,  # type: ignore[attr-defined]
            setup_s=setup_s,
        )
    )
    runner.close()
    return rows


def lm_markdown(rows: list[dict]) -> str:
    """The whole-model table: per token, time and what moved, beside the model's prediction."""
    out = [
        "| variant | ms per token (p10-p90) | vs 1 process | driver -> workers / back per token | between workers per token (model) "
        "| all-reduces per token (model) | driver waits per token | weights placed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = rows[0]["ms"]
    for r in rows:
        if "sent" not in r:
            out.append(f"| {r['variant']} | {r['ms']:.1f} ({r['p10']:.1f}-{r['p90']:.1f}) | 1.00x | - | - | - | - | - |")
            continue
        out.append(
            f"| {r['variant']} | {r['ms']:.1f} ({r['p10']:.1f}-{r['p90']:.1f}) | {r['ms'] / base:.2f}x | {r['sent']} B / {r['received']} B | "
            f"{_size(r['between'])} ({_size(r['between_model'])}) | {r['all_reduces']} ({r['all_reduces_model']}) | {r['driver_waits']} | "
            f"{r['setup_bytes'] / 2**20:.0f} MiB in {r['setup_s']:.1f} s |"
        )
    return "\n".join(out)


def _resident_past(runner: object, feeds: dict, name: str) -> object:
    """``feeds[name]`` placed on the shards once, as a resident value (what a decode loop's previous step leaves there)."""
    from lowering.distributed.sharded import Resident

    plan = runner.plan  # type: ignore[attr-defined]
    ex = runner.executor  # type: ignore[attr-defined]
    return Resident(name, [ex.put(i, plan.split(name, feeds[name], i)) for i in range(plan.n)], id(plan))


def _row(config: str, case: str, variant: str, times: list[float], **extra: object) -> dict:
    t = sorted(times)
    return {
        "config": config,
        "case": case,
        "variant": variant,
        "ms": 1e3 * statistics.median(t),
        "p10": 1e3 * t[len(t) // 10],
        "p90": 1e3 * t[min(len(t) - 1, 9 * len(t) // 10)],
        **extra,
    }


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def markdown(rows: list[dict]) -> str:
    """The Markdown table docs/dask.md shows."""
    out = [
        "| case | variant | median ms (p10-p90) | vs 1 process | sent / received per call | shard ms | weights placed |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {r["case"]: r["ms"] for r in rows if r["variant"] == "1 process"}
    for r in rows:
        moved = f"{_size(r['sent'])} / {_size(r['received'])}" if "sent" in r else "-"
        if "first_sent" in r and r["first_sent"] != r["sent"]:
            moved += f" (first call sent {_size(r['first_sent'])})"
        shard_ms = "/".join(f"{t:.0f}" for t in r.get("shard_ms", [])) or "-"
        setup = f"{r['setup_bytes'] / 2**20:.0f} MiB in {r['setup_s']:.1f} s" if "setup_bytes" in r else "-"
        out.append(
            f"| {r['case']} | {r['variant']} | {r['ms']:.1f} ({r['p10']:.1f}-{r['p90']:.1f}) | {r['ms'] / base[r['case']]:.2f}x | {moved} | "
            f"{shard_ms} | {setup} |"
        )
    return "\n".join(out)


def main() -> None:
    """Run both cases; print and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama2-70b")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="docs/bench/sharding")
    args = ap.parse_args()
    client = local_cluster(args.shards, threads_per_worker=max(1, (os.cpu_count() or 1) // args.shards))
    try:
        rows = bench(args.config, args.shards, args.repeats, client)
        lm_rows = bench_lm(args.shards, 3, client)
    finally:
        close_cluster(client)
    header = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores; config {args.config} attention layer, float32, batch 1; numpy backend in every "
        f"process"
    )
    table = markdown(rows)
    lm_header = (
        f"whole model: {LM_CONFIG['num_hidden_layers']} layers, hidden {LM_CONFIG['hidden_size']}, "
        f"{LM_CONFIG['num_attention_heads']}/{LM_CONFIG['num_key_value_heads']} heads, vocab {LM_CONFIG['vocab_size']}, float32; "
        "greedy decoding of 16 tokens after a 32-token prompt, batch 1, medians of 3 alternating rounds; per-token figures from the last step"
    )
    lm_table = lm_markdown(lm_rows)
    print(header)
    print(table)
    print()
    print(lm_header)
    print(lm_table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": header, "rows": rows, "lm": lm_rows}, indent=1))
    out.with_suffix(".md").write_text(header + "\n\n" + table + "\n\n" + lm_header + "\n\n" + lm_table + "\n")


if __name__ == "__main__":
    main()
