"""onnxruntime CPU on encoders and encoder-decoder parts exported by torch.onnx: as exported, re-exported by graphc, and
after onnxruntime's transformers optimizer.

    python benchmarks/bench_encoders.py [--blocks N] [--calls N] [--threads T] [--families bert,vit,clip_text,...]

Each family of ``tests/encoder_exports.py`` at its ``base`` shape (hidden 256, 4 layers, 4 heads, MLP 1024; ViT on
64x64 images, 64 patches; Whisper's encoder on 256 mel frames, 128 positions) by the legacy exporter, run at batch 1
and 128 tokens (BART's decoder: 128 tokens over 128 encoder positions).  Variants, each checked against onnxruntime
on the export before it is timed (1e-4 + 1e-3*|ref|): the export itself; ``graphc optimize`` re-exported (grouped
MatMuls) and with ``attention="auto"``; onnxruntime's ``transformers.optimizer.optimize_model`` told the family's
model type.  The method of ``bench_real_exports.py``: alternating blocks of back-to-back calls, ratios paired by
round.  Prints a Markdown table and writes it to ``--out`` (default ``docs/bench/encoders.md``).
"""

from __future__ import annotations

import argparse
import builtins
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_real_exports import ROOT_DOCS, Row, session, timed_rows, variants  # noqa: E402

ORT_MODEL_TYPES = {"bert": "bert", "vit": "vit", "clip_text": "clip", "whisper_encoder": "bart", "bart_decoder": "bart", "t5_encoder": "t5"}
"""The model type onnxruntime's transformers optimizer is told for each family."""
SEQ = 128


def run_family(family: str, args: argparse.Namespace, work: Path) -> list[Row]:
    """One row per variant (the export first)."""
    from encoder_exports import export_encoder, feeds

    path = export_encoder(family, "legacy", work / "model.onnx", shape="base")
    f = feeds(family, shape="base", sizes=(1, SEQ, SEQ))
    if "attention_mask" in f:
        f["attention_mask"][:] = 1  # no padding in the timed run
    if "encoder_attention_mask" in f:
        f["encoder_attention_mask"][:] = 1
    sizes = {"batch": 1, "seq": SEQ, "enc": SEQ}
    base = session(path, args.threads)
    want = base.run(None, f)
    made = variants(path, work, sizes, ORT_MODEL_TYPES[family])
    keep = ("torch.onnx export", "graphc (grouped MatMul)", "graphc (attention auto)", "onnxruntime transformers optimizer")
    return timed_rows(base, f, want, {k: v for k, v in made.items() if k in keep}, args)


def main() -> None:
    """Run every family; print one Markdown table and write it to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--families", default=",".join(ORT_MODEL_TYPES))
    ap.add_argument("--out", default=str(ROOT_DOCS / "encoders.md"), help="the Markdown file to write")
    args = ap.parse_args()
    import onnxruntime as ort

    lines = ["# `python benchmarks/bench_encoders.py`: one run\n"]

    def print(text: str = "", flush: bool = False) -> None:  # noqa: A001 - each line to stdout and to --out
        builtins.print(text, flush=flush)
        lines.append(text)

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "")
    print(
        f"machine: {platform.machine()} {cpu}, {len(os.sched_getaffinity(0))} cores; onnxruntime {ort.__version__} CPU, {args.threads} threads, "
        f"no spinning; legacy torch.onnx exports, hidden 256, 4 layers, float32, batch 1, {SEQ} tokens; "
        f"median of {args.blocks} alternating blocks of {args.calls} back-to-back calls\n"
    )
    print("| model | variant | median ms | vs export | note |\n|---|---|---|---|---|")
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_family(family, args, Path(tmp))
        for name, ms, paired, note in rows:
            ratio = "-" if paired is None else f"{paired:.2f}"
            print(f"| {family} | {name} | {'-' if ms is None else f'{ms:.2f}'} | {ratio} | {note} |", flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
