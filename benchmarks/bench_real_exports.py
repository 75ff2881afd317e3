"""onnxruntime CPU on whole-model torch.onnx exports: as exported, re-exported by graphc, and after the peer optimizers.

    python benchmarks/bench_real_exports.py [--blocks N] [--calls N] [--threads T] [--families llama,qwen2,gpt2,mistral,mpt,bloom]

For each family a 2-layer random-weight transformers model of hidden 256
(8 query / 2 KV heads where the family has GQA; Mistral's sliding window 4096,
as Mistral-7B's) is exported with the legacy
torch.onnx exporter and transformers' default sdpa attention: with a KV cache
for decode (one token over a past of 1024 and 2048) and without for prefill
(256 and 512 tokens), batch 1.  Variants, each checked against onnxruntime on
the original before it is timed (1e-4 + 1e-3*|ref|): the export itself;
``graphc optimize`` re-exported (grouped MatMuls) and with ``attention="auto"``
for the case's sizes; onnxruntime's ``transformers.optimizer.optimize_model``;
onnxscript's ``optimize`` + ``rewrite`` and ``optimize_for_ort``; onnxslim
(when installed).  Method: every session is warmed up, then blocks of
back-to-back calls alternate between the variants (A B C ... A B C ...), so a
noisy stretch of the machine hits all of them; the figure is the median over
blocks of each block's median call, and a variant's ratio to the export is the
median over blocks of its block median over the export's in the same round (a
slow stretch of the machine moves both); onnxruntime runs with ``--threads`` intra-op
threads and no spinning.  A variant that cannot be made or run is reported with
its error.  Prints a Markdown table (ratios to the export in the same run) and writes it to ``--out``
(default ``docs/bench/real_exports.md``).
"""

from __future__ import annotations

import argparse
import builtins
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
ROOT_DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench"

WINDOW = 4096
"""Mistral's sliding window, as Mistral-7B's: longer than the pasts timed (a torch.onnx cache export is defined only for a
past shorter than the window, onnxruntime fails on it past that)."""
CASES = {"decode 1 over 1024": (True, 1, 1024), "decode 1 over 2048": (True, 1, 2048), "prefill 256": (False, 256, 0), "prefill 512": (False, 512, 0)}


def variants(path: Path, work: Path, sizes: dict[str, int], ort_model_type: str = "gpt2") -> dict[str, Callable[[], Path]]:
    """How to make each variant of the export at ``path`` (called lazily, so one failure is one row); ``ort_model_type``:
    the model type onnxruntime's transformers optimizer is told."""
    import onnx

    def graphc_variant(auto: bool) -> Path:
        import graphc
        from graphc.onnx_import import from_onnx
        from lowering.exporter.onnx_export import export

        g = graphc.optimize(from_onnx(path), hints=sizes).graph
        out = work / ("graphc_auto.onnx" if auto else "graphc.onnx")
        export(g, out, opset=23 if auto else 18, **({"attention": "auto", "sizes": sizes} if auto else {}))
        return out

    def ort_optimizer() -> Path:
        from onnxruntime.transformers.optimizer import optimize_model

        out = work / "ort_transformers.onnx"
        optimize_model(str(path), model_type=ort_model_type, num_heads=0, hidden_size=0, opt_level=1).save_model_to_file(str(out))
        return out

    def onnxscript_rewrite() -> Path:
        import onnxscript.optimizer
        import onnxscript.rewriter

        out = work / "onnxscript.onnx"
        onnx.save(onnxscript.rewriter.rewrite(onnxscript.optimizer.optimize(onnx.load(str(path)))), str(out))
        return out

    def onnxscript_for_ort() -> Path:
        import onnx_ir
        import onnxscript.optimizer
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model = onnx_ir.from_proto(onnx.load(str(path)))
        onnxscript.optimizer.optimize_ir(model)
        fused, _ = optimize_for_ort(model)
        out = work / "onnxscript_ort.onnx"
        onnx.save(onnx_ir.to_proto(fused), str(out))
        return out

    def onnxslim() -> Path:
        import onnxslim as slim

        out = work / "onnxslim.onnx"
        onnx.save(slim.slim(onnx.load(str(path))), str(out))
        return out

    return {
        "torch.onnx export": lambda: path,
        "graphc (grouped MatMul)": lambda: graphc_variant(False),
        "graphc (attention auto)": lambda: graphc_variant(True),
        "onnxruntime transformers optimizer": ort_optimizer,
        "onnxscript optimize + rewrite": onnxscript_rewrite,
        "onnxscript optimize_for_ort": onnxscript_for_ort,
        "onnxslim": onnxslim,
    }


def session(path: Path, threads: int):  # noqa: ANN202 - an onnxruntime.InferenceSession
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def attention_of(family: str) -> str:
    """transformers' attention the family is exported with: eager for MPT and Bloom (no sdpa) and the further and MoE
    families (as their tests export them), sdpa for the others."""
    from real_exports import ALIBI_FAMILIES, MOE_FAMILIES, MORE_FAMILIES

    return "eager" if family in (*ALIBI_FAMILIES, *MORE_FAMILIES, *MOE_FAMILIES) else "sdpa"


Row = tuple[str, float | None, float | None, str]
"""``(variant, median ms, ratio to the export paired by round, note)``; None where the variant could not be timed."""


def run_case(family: str, case: str, args: argparse.Namespace, work: Path) -> list[Row]:
    """One row per variant for one family and case (the export first)."""
    import onnx
    from real_exports import export_model, feeds

    cache, seq, past = CASES[case]
    attention = attention_of(family)
    path = export_model(family, "legacy", attention, cache, work / "model.onnx", hidden=256, window=WINDOW)
    f = feeds(onnx.load(str(path), load_external_data=False), 1, seq, past)
    sizes = {"batch": 1, "seq": seq, **({"past_seq": past} if cache else {})}
    base = session(path, args.threads)
    try:
        want = base.run(None, f)
    except Exception as e:  # noqa: BLE001 - e.g. a sliding-window cache export, valid only for a past shorter than the window
        return [("torch.onnx export", None, None, f"onnxruntime fails on the export itself at this size: {str(e).splitlines()[0][-90:]}")]
    return timed_rows(base, f, want, variants(path, work, sizes), args)


def timed_rows(base, feeds: dict, want: list, made: dict[str, Callable[[], Path]], args: argparse.Namespace) -> list[Row]:  # noqa: ANN001
    """Each variant checked against the export's outputs ``want`` (1e-4 + 1e-3*|ref|), then timed in alternating blocks of
    back-to-back calls (``args.blocks`` x ``args.calls``, ``args.threads`` threads); one row each, the export first."""
    runners: dict[str, Callable[[], object]] = {}
    notes: dict[str, str] = {}
    for name, make in made.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sess = base if name == "torch.onnx export" else session(make(), args.threads)
            got = sess.run(None, feeds)
            worst = max(float(np.max(np.abs(g - w) / (1e-4 + 1e-3 * np.abs(w)))) for g, w in zip(got, want))
            if worst > 1:
                notes[name] = f"outputs differ ({worst:.1f}x the tolerance)"
                continue
            runners[name] = (lambda s: lambda: s.run(None, feeds))(sess)
        except Exception as e:  # noqa: BLE001 - a peer that cannot handle the file is a row, not a crash
            notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    for run in runners.values():
        for _ in range(3):
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.blocks):
        for name, run in runners.items():
            block = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                run()
                block.append(1e3 * (time.perf_counter() - t0))
            times[name].append(statistics.median(block))
    export = times["torch.onnx export"]
    paired = {name: statistics.median(t / e for t, e in zip(block, export)) for name, block in times.items()}
    medians = {name: statistics.median(block) for name, block in times.items()}
    return [(name, medians.get(name), paired.get(name), notes.get(name, "")) for name in made]


def main() -> None:
    """Run every family and case; print one Markdown table per family."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--families", default="llama,qwen2,gpt2,mistral")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(ROOT_DOCS / "real_exports.md"), help="the Markdown file to write")
    args = ap.parse_args()
    import onnxruntime as ort

    lines: list[str] = ["# `python benchmarks/bench_real_exports.py`: one run\n"]

    def print(text: str = "", flush: bool = False) -> None:  # noqa: A001 - each line to stdout and to --out
        builtins.print(text, flush=flush)
        lines.append(text)

    print(
        f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores; onnxruntime {ort.__version__} CPU, {args.threads} threads, "
        f"no spinning; legacy torch.onnx exports, {'/'.join(sorted({attention_of(f) for f in args.families.split(',')}))} attention, "
        "hidden 256, 2 layers, float32, batch 1; "
        f"median of {args.blocks} alternating blocks of {args.calls} back-to-back calls"
    )
    summary = []
    for family in args.families.split(","):
        print(f"\n{family}:\n\n| case | variant | median ms | vs export | note |\n|---|---|---|---|---|")
        for case in args.cases.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                rows = run_case(family, case, args, Path(tmp))
            base = rows[0][1]
            for name, ms, paired, note in rows:
                if base is None and name != "torch.onnx export":
                    continue
                ratio = "-" if paired is None else f"{paired:.2f}"
                print(f"| {case} | {name} | {'-' if ms is None else f'{ms:.2f}'} | {ratio} | {note} |", flush=True)
            summary.append(_summary_row(family, case, rows))
    print("\nsummary (best graphc form against the best peer; ratios paired by round):\n")
    print("| model | case | export ms | graphc ms (best form) | graphc / export | best peer | peer / export |\n|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    Path(args.out).write_text("\n".join(lines) + "\n")


def _summary_row(family: str, case: str, rows: list[Row]) -> str:
    """One line of the summary: the export, graphc's faster form and the fastest peer (by their paired ratios)."""
    base = rows[0][1]
    if base is None:
        return f"| {family} | {case} | - | - | - | - | - ({rows[0][3]}) |"
    timed = [(paired, ms, name) for name, ms, paired, _ in rows[1:] if ms is not None and paired is not None]
    ours = min(((p, ms, name) for p, ms, name in timed if name.startswith("graphc")), default=None)
    peer = min(((p, ms, name) for p, ms, name in timed if not name.startswith("graphc")), default=None)
    mine = f"{ours[1]:.2f} ({ours[2].removeprefix('graphc (').rstrip(')')}) | {ours[0]:.2f}" if ours else "- | -"
    theirs = f"{peer[2]} | {peer[0]:.2f}" if peer else "- | -"
    return f"| {family} | {case} | {base:.2f} | {mine} | {theirs} |"


if __name__ == "__main__":
    main()
