"""DeepSeek's multi-head latent attention at a real shape: onnxruntime on the torch.onnx export against graphc's re-export.

    python benchmarks/bench_latent_attention.py [--pasts 512,2048] [--prefill 256] [--threads T]

A 2-layer random-weight transformers DeepSeek-V3 model with DeepSeek-V2-Lite's attention shape (hidden 2048, 16 heads,
a 512-wide latent, rotary 64, nope 128, value 128; dense MLPs of 2048, no MoE) is exported with its cache by the legacy
torch.onnx exporter (eager attention).  Its cache holds the latents, so the export projects every cached latent to keys
and values each step.  graphc imports the file, optimizes it with the case's sizes as hints (decode: the absorbed
form, multi-query attention over the latents; a long prefill keeps the projected form, which costs less there) and
re-exports it (``attention="auto"``).  Each pair is checked (logits within 1e-4 + 1e-3*|ref|), then timed: warm-up,
blocks of 5 back-to-back calls alternating between the two files, median over 5 blocks; onnxruntime CPU with
``--threads`` intra-op threads and no spinning.  Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FAMILY = "deepseek_v2_lite_attention"
"""``tests/real_exports.py``'s DeepSeek-V2-Lite-shaped attention model."""


def _session(path: Path, threads: int):  # noqa: ANN202 - an onnxruntime InferenceSession
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_case(path: Path, seq: int, past: int, threads: int, work: Path) -> tuple[float, float, str]:
    """``(export ms, graphc ms, graphc's form)`` for one case."""
    import onnx
    from real_exports import feeds

    import graphc
    from graphc.onnx_import import from_onnx
    from lowering.exporter.onnx_export import export

    sizes = {"batch": 1, "seq": seq, "past_seq": past}
    optimized, report = graphc.optimize(from_onnx(path), hints=sizes)
    absorbed = sum(1 for f in report.trace.fired if f.rule == "absorb_latent_attention")
    mine = work / f"graphc_{seq}_{past}.onnx"
    export(optimized, mine, opset=23, attention="auto", sizes=sizes, external_data=True)
    f = feeds(onnx.load(str(path), load_external_data=False), 1, seq, past)
    sessions = [(s, {i.name: f[i.name] for i in s.get_inputs()}) for s in (_session(path, threads), _session(mine, threads))]
    want, got = (s.run(None, fe)[0] for s, fe in sessions)
    if not np.all(np.abs(got - want) <= 1e-4 + 1e-3 * np.abs(want)):
        raise SystemExit(f"graphc's re-export differs from the export at seq {seq}, past {past}: {float(np.max(np.abs(got - want)))}")
    for s, fe in sessions:
        for _ in range(2):
            s.run(None, fe)
    times: list[list[float]] = [[], []]
    for _ in range(5):
        for k, (s, fe) in enumerate(sessions):
            block = []
            for _ in range(5):
                t0 = time.perf_counter()
                s.run(None, fe)
                block.append(time.perf_counter() - t0)
            times[k].append(statistics.median(block))
    form = f"absorbed ({absorbed} layers)" if absorbed else "projected"
    return 1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1]), form


def main() -> None:
    import onnxruntime as ort
    from real_exports import export_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pasts", default="512,2048", help="decode: one new token over each of these cached lengths")
    ap.add_argument("--prefill", type=int, default=256, help="prefill: this many tokens, no past (0: none)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    cases = [(1, int(p)) for p in args.pasts.split(",") if p] + ([(args.prefill, 0)] if args.prefill else [])
    print(
        f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores; onnxruntime {ort.__version__} CPU, {args.threads} threads, "
        "no spinning; DeepSeek-V3 with DeepSeek-V2-Lite's attention shape, 2 layers, float32, batch 1, legacy torch.onnx export "
        "with its latent cache; median of 5 alternating blocks of 5 back-to-back calls\n"
    )
    print("| case | export ms | graphc ms | graphc / export | graphc's attention |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = export_model(FAMILY, "legacy", "eager", True, work / "deepseek.onnx")
        for seq, past in cases:
            export_ms, graphc_ms, form = run_case(path, seq, past, args.threads, work)
            name = f"decode 1 over {past}" if past else f"prefill {seq}"
            print(f"| {name} | {export_ms:.2f} | {graphc_ms:.2f} | {graphc_ms / export_ms:.3f} | {form} |", flush=True)


if __name__ == "__main__":
    main()
