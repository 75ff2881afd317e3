"""optimum's encoder, vision and seq2seq exports, made in optimum's own virtual environment and checked with graphc here.

optimum-onnx 0.1.0 needs transformers < 4.58, so its venv is made under ``--work`` (once, as
``real_exports_corpus.py`` makes it).  There, tiny random-weight models (hidden 64, 2 layers, 4 heads) are saved
and exported by ``optimum.exporters.onnx.main_export``: ``feature-extraction`` for BERT, RoBERTa, DistilBERT, ViT
and CLIP's vision tower, ``text2text-generation-with-past`` for T5 and BART and
``automatic-speech-recognition-with-past`` for Whisper (an encoder, a decoder, a decoder over a cache and the merged
decoder each).  Here each file is imported (ViT and CLIP with ``dims={"height": 32, "width": 32}``; a merged decoder
once per branch, ``fixed_inputs={"use_cache_branch": ...}``), optimized, and run by graphc (numpy, and onnxruntime
on graphc's export) against onnxruntime on the file at sizes never traced (batch 3, 9 tokens, 11 encoder positions,
a past of 13, the first row padded).  One table row per file and branch; the table goes to ``--out``::

    python benchmarks/optimum_encoder_corpus.py [--work DIR] [--families bert,vit,...] [--out docs/bench/optimum_encoders.md]
"""

from __future__ import annotations

import argparse
import builtins
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine  # noqa: E402
from bench_real_exports import ROOT_DOCS  # noqa: E402
from real_exports_corpus import tool_python  # noqa: E402

FAMILIES = ("bert", "roberta", "distilbert", "vit", "clip_vision", "t5", "bart", "whisper")
IMAGE = 32
WHISPER_POSITIONS = 1500
"""Whisper's encoder positions (its mel input is fixed at twice as many frames, as optimum's dummy inputs assume)."""
SIZES = {"batch_size": 3, "sequence_length": 9, "encoder_sequence_length": 11, "decoder_sequence_length": 9, "past_decoder_sequence_length": 13}

GENERATOR = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers as tf
from optimum.exporters.onnx import main_export
from tokenizers import Tokenizer, models, pre_tokenizers
out, family = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
small = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, hidden_size=64)
seq2seq = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=100)
build = {
    "bert": lambda: (tf.BertModel(tf.BertConfig(**small, vocab_size=100)), "feature-extraction"),
    "roberta": lambda: (tf.RobertaModel(tf.RobertaConfig(**small, vocab_size=100)), "feature-extraction"),
    "distilbert": lambda: (tf.DistilBertModel(tf.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=100)),
                           "feature-extraction"),
    "vit": lambda: (tf.ViTModel(tf.ViTConfig(**small, image_size=32, patch_size=8)), "feature-extraction"),
    "clip_vision": lambda: (tf.CLIPVisionModel(tf.CLIPVisionConfig(**small, image_size=32, patch_size=8)), "feature-extraction"),
    "t5": lambda: (tf.T5ForConditionalGeneration(tf.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=100,
                                                             decoder_start_token_id=0)), "text2text-generation-with-past"),
    "bart": lambda: (tf.BartForConditionalGeneration(tf.BartConfig(**seq2seq, max_position_embeddings=256)), "text2text-generation-with-past"),
    "whisper": lambda: (tf.WhisperForConditionalGeneration(tf.WhisperConfig(**seq2seq, num_mel_bins=16, max_source_positions=1500,
                        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
                        "automatic-speech-recognition-with-past"),
}
model, task = build[family]()
hf = os.path.join(out, "hf")
model.eval().save_pretrained(hf)
tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(100)}, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0").save_pretrained(hf)
main_export(hf, output=os.path.join(out, "onnx"), task=task)
"""


def export(work: Path, family: str) -> tuple[list[Path], str]:
    """optimum's ONNX files of ``family`` (made once under ``work``), or ``([], why not)``."""
    out = work / "models" / f"{family}-optimum-encoders"
    files = sorted((out / "onnx").glob("*.onnx"))
    if files:
        return files, ""
    script = work / "generate_encoders.py"
    script.write_text(GENERATOR)
    r = subprocess.run([str(tool_python(work, "optimum")), str(script), str(out), family], capture_output=True, text=True)
    files = sorted((out / "onnx").glob("*.onnx"))
    if r.returncode or not files:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return [], (lines[-1] if lines else "no model written")[:160]
    return files, ""


def feeds(path: Path, use_cache: bool | None) -> dict[str, np.ndarray]:
    """Inputs for every graph input of ``path`` at :data:`SIZES` (a step over a cache: one new token); masks with the first
    row's first two positions padded."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(0)
    whisper = "whisper" in str(path)
    sizes = {**SIZES, "encoder_sequence_length": WHISPER_POSITIONS if whisper else SIZES["encoder_sequence_length"], "height": IMAGE, "width": IMAGE}
    out: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else sizes.get(d.dim_param, 3 if "channels" in d.dim_param else 7) for d in tt.shape.dim]
        if path.stem == "decoder_with_past_model" and vi.name in ("input_ids", "decoder_input_ids"):
            shape[1] = 1
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if vi.name == "use_cache_branch":
            continue
        if vi.name == "input_features":
            shape[2] = 2 * WHISPER_POSITIONS
        if "mask" in vi.name:
            value = np.ones(shape, dtype)
            value[0, :2] = 0
        elif dtype == np.int64:
            value = rng.integers(0, 2 if "token_type" in vi.name else 100, shape).astype(dtype)
        else:
            value = rng.standard_normal(shape).astype(dtype)
        out[vi.name] = value
    return out


def check(path: Path, use_cache: bool | None) -> str:
    """One table row: import, attention blocks and their visibility, softmaxes left, and the error against onnxruntime."""
    import onnxruntime as ort

    from graphc.onnx_import import from_onnx
    from graphc.optimizer import KEEP_EVERY_ATTENTION, lower, optimize, unfused_softmaxes
    from lowering import run

    branch = "" if use_cache is None else f" (use_cache_branch={int(use_cache)})"
    label = path.parent.parent.name.removesuffix("-optimum-encoders") + "/" + path.name + branch
    f = feeds(path, use_cache)
    fixed = None if use_cache is None else {"use_cache_branch": use_cache}
    dims = {"height": IMAGE, "width": IMAGE} if "pixel_values" in f else None
    try:
        graph = from_onnx(path, fixed_inputs=fixed, dims=dims)
    except Exception as e:  # noqa: BLE001 - the row says why
        return f"| {label} | no: {str(e)[:140]} | | | | |"
    optimized = optimize(graph).graph
    kept = lower(optimized, KEEP_EVERY_ATTENTION)
    ops = [n.op for n in kept.topological_order() if n.op.kind == "Attention"]
    kinds: dict[str, int] = {}
    for op in ops:
        kinds[op.visibility.describe()] = kinds.get(op.visibility.describe(), 0) + 1
    left = unfused_softmaxes(kept, lowered=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = session.run(None, {**f, **({} if use_cache is None else {"use_cache_branch": np.array([use_cache])})})
    errors = []
    for backend in ("numpy", "ort-cpu"):
        got = run(optimized, f, backend)
        errors.append(max(float(np.max(np.abs(got[n] - w))) if w.size else 0.0 for n, w in zip(optimized.outputs, want)))
    seen = "; ".join(f"{n} x {k}" for k, n in kinds.items())
    return f"| {label} | yes | {len(ops)}: {seen} | {len(left)} | {errors[0]:.1e} | {errors[1]:.1e} |"


def main() -> None:
    """Export every family, check every file; print the table and write it to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=".bench-quantized", help="where the optimum venv and the exports live (reused)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", default=str(ROOT_DOCS / "optimum_encoders.md"), help="the Markdown file to write")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import onnxruntime as ort

    lines = ["# `python benchmarks/optimum_encoder_corpus.py`: one run\n"]

    def print(text: str = "", flush: bool = True) -> None:  # noqa: A001 - each line to stdout and to --out
        builtins.print(text, flush=flush)
        lines.append(text)

    work = Path(args.work).resolve()
    print(f"machine: {machine()}; optimum-onnx 0.1.0 exports (its venv: "
          f"transformers < 4.58), checked with onnxruntime {ort.__version__}; sizes {json.dumps(SIZES)}\n")  # fmt: skip
    print("| file | imports | attention blocks | softmax left | numpy max err | ort-cpu max err |\n|---|---|---|---|---|---|")
    for family in args.families.split(","):
        files, why = export(work, family)
        if not files:
            print(f"| {family} | export failed: {why} | | | | |")
        for path in files:
            for use_cache in ([True, False] if "merged" in path.name else [None]):
                print(check(path, use_cache))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
