"""Quantized models at a real shape: graphc int4 and int8 against graphc float32 (and onnxruntime-genai's int4 model).

One random checkpoint (``--shape qwen2.5-0.5b``: Qwen2.5-0.5B's shape, 24 layers, tied embeddings, float32 1.98 GB;
``tinyllama-1.1b``: TinyLlama-1.1B's, 22 layers, 32 query and 4 KV heads, untied, float32 4.4 GB; each written by
transformers' ``save_pretrained``; ``tiny`` for a quick look), exported by graphc as float32 and with
``--quantize int4`` / ``int8`` (MatMulNBits, block 32, symmetric, ``accuracy_level`` 4 as onnxruntime-genai's CPU
int4 model), with ``--genai``, onnxruntime-genai 0.18's builder (``-p int4 -e cpu``, in its own venv), and with
``--optimum``, optimum's int8 model (its ``text-generation-with-past`` export quantized by ``ORTQuantizer`` with
``AutoQuantizationConfig.avx2(is_static=False)``, what ``optimum-cli onnxruntime quantize --avx2`` writes).  Every
contender runs in its own process, a worker serving one generation per request: the exports in a plain onnxruntime
decode loop (the cache kept in onnxruntime's tensors), graphc's int4 graph on the NumPy backend, genai's model in its
runtime.  Per contender: the seconds to load, the first token after a ``--prompt``-token prompt, the decode ms/token
(median over ``--blocks`` rounds, the contenders alternating), the peak resident memory of its process, and the
weight bytes a token reads beside the read bandwidth measured in this process (NumPy sum over 1 GiB), and how far its
logits for the prompt's last position lie from graphc float32's (the largest difference over the largest float32
logit: what quantization costs).

    python benchmarks/bench_quantized.py [--shape qwen2.5-0.5b] [--work DIR] [--prompt 128] [--new 16] [--blocks 3] [--genai] [--optimum]

needs ``pip install ".[parity,fast]"``; writes ``docs/bench/quantized.{md,json}``.  Checkpoints and exports are made
once under ``--work`` and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
QWEN2 = {"model_type": "qwen2", "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
SHAPES = {
    "qwen2.5-0.5b": {**QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 151936},  # fmt: skip
    "tinyllama-1.1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                       "rms_norm_eps": 1e-5, "tie_word_embeddings": False},  # fmt: skip
    "tiny": {**QWEN2, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
             "vocab_size": 1024},  # fmt: skip
}

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
import numpy as np
kind, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
vocab, wants_logits = int(sys.argv[4]), False
if kind == "genai":
    import onnxruntime_genai as og
    model = og.Model(path)
    def run(prompt, new):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + new, min_length=len(prompt) + new)
        gen = og.Generator(model, params)
        times, tokens, t = [], [], time.perf_counter()
        gen.append_tokens(np.array(prompt, np.int32))
        if wants_logits:  # read only when asked: the timed requests allocate nothing more
            run.first_logits = np.asarray(gen.get_output("logits"), np.float32).reshape(-1)[-vocab:].copy()
        while not gen.is_done():
            gen.generate_next_token()
            times.append(time.perf_counter() - t)
            tokens.append(int(gen.get_next_tokens()[0]))
            t = time.perf_counter()
        return times, tokens
elif kind == "onnx":
    from bench_generate import ort_loop
    from pathlib import Path
    run = ort_loop(Path(path))
else:  # graphc's quantized graph on the NumPy backend
    import graphc
    from graphc.quantize import QuantizeOptions, quantize_weights
    from graphc.weights import load_weights
    from lowering import generate, prepare
    g = graphc.causal_lm_from_hf(path + "/config.json", load_weights(path), logits="last")
    g = graphc.optimize(quantize_weights(g, QuantizeOptions(4, 32))[0]).graph
    runner = prepare(g, "numpy")
    def run(prompt, new):
        r = generate(g, [prompt], new, runner=runner, keep_logits=wants_logits)
        if wants_logits:
            run.first_logits = r.logits[0][0]
        return [r.prefill_seconds, *r.step_seconds], r.new_tokens[0].tolist()
print(json.dumps({"load_s": time.perf_counter() - t0}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    wants_logits = req.get("logits", False)
    times, tokens = run(req["prompt"], req["new"])
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    logits = [float(v) for v in run.first_logits] if wants_logits else None
    print(json.dumps({"times": times, "tokens": tokens, "peak_rss": peak, "logits": logits}), flush=True)
"""


def checkpoint(work: Path, shape: str) -> Path:
    """A checkpoint of ``shape`` with random weights (unit-scale embeddings, small residual updates), made once."""
    out = work / shape / "hf"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    fields = dict(SHAPES[shape])
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else (0.3 if "o_proj" in name or "down_proj" in name else 1.0) * p.shape[-1] ** -0.5)
        if cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)  # tied: to_empty gave the head a table of its own
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    write_tokenizer(out, cfg.vocab_size)
    return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the checkpoint's ids (onnxruntime-genai's builder reads one for a llama checkpoint)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(out)


def graphc_export(hf: Path, out: Path, quantize: str | None) -> tuple[Path, float]:
    """graphc's export of the checkpoint (``quantize``: int4 / int8 at accuracy level 4); the model and the seconds it took."""
    from graphc.quantize import QUANTIZE_CHOICES, QuantizeOptions
    from lowering.checkpoint_export import export_checkpoint

    if not (out / "model.onnx").exists():
        options = QuantizeOptions(QUANTIZE_CHOICES[quantize], 32, True, 4) if quantize else None
        t0 = time.perf_counter()
        export_checkpoint(hf, out, attention="auto", hints={"batch": 1, "seq": 1, "past_seq": 256}, quantize=options, force=True)
        (out / "export_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return out / "model.onnx", float((out / "export_seconds.txt").read_text())


def genai_export(work: Path, hf: Path, out: Path) -> Path:
    """onnxruntime-genai's int4 CPU model of the checkpoint, built in its own venv."""
    sys.path.insert(0, str(HERE))
    from real_exports_corpus import tool_python

    if not (out / "genai_config.json").exists():
        python = tool_python(work, "genai")
        cmd = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", "int4", "-e", "cpu"]
        subprocess.run([*cmd, "-c", str(work / "genai-cache")], check=True, capture_output=True)
    return out


OPTIMUM = r"""
import sys
from optimum.exporters.onnx import main_export
from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig
hf, fp32, out = sys.argv[1:4]
main_export(hf, fp32, task="text-generation-with-past")
ORTQuantizer.from_pretrained(fp32).quantize(save_dir=out, quantization_config=AutoQuantizationConfig.avx2(is_static=False, per_channel=False))
"""


OPTIMUM_STEP = "main_export, then ORTQuantizer with AutoQuantizationConfig.avx2(is_static=False)"


def optimum_export(work: Path, hf: Path, out: Path) -> tuple[Path, float]:
    """optimum's int8 model of the checkpoint (exported, then quantized as ``optimum-cli onnxruntime quantize --avx2``), made
    in its own venv; the model and the seconds both steps took."""
    sys.path.insert(0, str(HERE))
    from real_exports_corpus import tool_python

    model = out / "model_quantized.onnx"
    if not model.exists():
        script = work / "optimum_int8.py"
        script.write_text(OPTIMUM)
        t0 = time.perf_counter()
        subprocess.run([str(tool_python(work, "optimum")), str(script), str(hf), str(out.parent / "optimum-fp32"), str(out)], check=True)
        (out / "export_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return model, float((out / "export_seconds.txt").read_text())


class Worker:
    """A contender in its own process: ``kind`` (onnx, genai, numpy-int4) over ``path``."""

    def __init__(self, kind: str, path: Path, python: str, vocab: int) -> None:
        script = Path(path).parent / "worker.py" if kind != "numpy-int4" else Path(path) / "worker.py"
        script.write_text(WORKER)
        command = [python, str(script), kind, str(path), str(HERE), str(vocab)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.load_s = json.loads(self.proc.stdout.readline())["load_s"]  # type: ignore[union-attr]
        self.peak = 0

    def __call__(self, prompt: list[int], new: int, logits: bool = False) -> tuple[list[float], list[int]]:
        """One generation; ``logits``: also the prompt's last logits (kept in ``self.logits``; that request's memory is
        not counted in the peak)."""
        self.proc.stdin.write(json.dumps({"prompt": prompt, "new": new, "logits": logits}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        reply = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]
        if logits:
            self.logits = np.asarray(reply["logits"], np.float32)
        else:
            self.peak = max(self.peak, reply["peak_rss"])
        return reply["times"], reply["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=60)


def weight_bytes(path: Path) -> int:
    """Bytes of an export's weights (its model and data files)."""
    return sum(p.stat().st_size for p in Path(path).parent.glob("*.onnx*") if p.is_file()) if path.suffix == ".onnx" else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--work", default=str(ROOT / ".bench-quantized"))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--genai", action="store_true", help="also onnxruntime-genai's int4 model (builds its venv on first use)")
    parser.add_argument("--optimum", action="store_true", help="also optimum's int8 model (builds its venv on first use)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "quantized"))
    args = parser.parse_args()
    work = Path(args.work)
    sys.path.insert(0, str(HERE))
    from _common import read_probe

    hf = checkpoint(work, args.shape)
    exports = (("graphc-f32", None), ("graphc-int4", "int4"), ("graphc-int8", "int8"))
    models = {name: graphc_export(hf, work / args.shape / name, q) for name, q in exports}
    vocab = SHAPES[args.shape]["vocab_size"]
    workers = {f"graphc ort-cpu {name.split('-')[1]}": Worker("onnx", path, sys.executable, vocab) for name, (path, _) in models.items()}
    workers["graphc numpy int4"] = Worker("numpy-int4", hf, sys.executable, vocab)
    if args.genai:
        from real_exports_corpus import tool_python

        genai = genai_export(work, hf, work / args.shape / "genai-int4")
        workers["onnxruntime-genai int4"] = Worker("genai", genai, str(tool_python(work, "genai")), vocab)
    notes = []
    if args.optimum:
        try:
            models["optimum-int8"] = optimum_export(work, hf, work / args.shape / "optimum-int8")
            workers["optimum int8"] = Worker("onnx", models["optimum-int8"][0], sys.executable, vocab)
        except subprocess.CalledProcessError as e:  # a quantizer killed for memory is the result at this shape
            why = f"killed by signal {-e.returncode}" if e.returncode < 0 else f"exit status {e.returncode}"
            notes.append(f"optimum int8: not measured, its export and quantization ({OPTIMUM_STEP}) failed: {why}")
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, SHAPES[args.shape]["vocab_size"], args.prompt)]
    names = list(workers)
    for name in names:
        workers[name](prompt, 2)
    first: dict[str, list[float]] = {n: [] for n in names}
    per_token: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    for b in range(args.blocks):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            times, toks = workers[name](prompt, args.new)
            first[name].append(times[0])
            per_token[name].append(statistics.median(times[1:]))
            tokens[name] = toks
    for name in names:  # after the timed rounds: the logits of the prompt's last position
        workers[name](prompt, 1, logits=True)
    bandwidth, read = read_probe(2)
    reads = []
    for _ in range(5):
        t0 = time.perf_counter()
        read({})
        reads.append(time.perf_counter() - t0)
    gbs = (1 << 30) / statistics.median(reads) / 1e9
    rows = {}
    reference = workers["graphc ort-cpu f32"].logits  # the float32 model's logits for the prompt's last position
    for name in names:
        export_name = f"graphc-{name.split()[-1]}" if name.startswith("graphc ort") else "optimum-int8" if name == "optimum int8" else None
        size = weight_bytes(models[export_name][0]) if export_name else None
        ms = 1e3 * statistics.median(per_token[name])
        rows[name] = {
            "load_s": workers[name].load_s,
            "first_token_ms": 1e3 * statistics.median(first[name]),
            "ms_per_token": ms,
            "peak_rss_gb": workers[name].peak / 1e9,
            "weights_gb": size / 1e9 if size else None,
            "read_fraction": (size / 1e9) / (ms / 1e3) / gbs if size else None,
            "export_s": models[export_name][1] if export_name else None,
            "logits_error": float(np.abs(workers[name].logits - reference).max() / np.abs(reference).max()),
            "tokens": tokens[name],
        }
        workers[name].close()
    base = rows["graphc ort-cpu f32"]["ms_per_token"]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        f"{args.shape} ({os.cpu_count()}-core {cpu.removesuffix(' Processor')}, {memory:.0f} GiB), {args.prompt}-token prompt, "
        f"{args.new} new tokens, {args.blocks} rounds alternating; {platform.machine()}, read bandwidth {gbs:.1f} GB/s ({bandwidth})",
        "",
        "| contender | export s | load s | first token ms | decode ms/token | vs graphc float32 | weights GB | of read bandwidth | peak RSS GB "
        "| logits vs float32 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        cells = [
            f"{r['export_s']:.1f}" if r["export_s"] is not None else "-",
            f"{r['load_s']:.1f}",
            f"{r['first_token_ms']:.0f}",
            f"{r['ms_per_token']:.1f}",
            f"{r['ms_per_token'] / base:.2f}x",
            f"{r['weights_gb']:.2f}" if r["weights_gb"] is not None else "-",
            f"{100 * r['read_fraction']:.0f}%" if r["read_fraction"] is not None else "-",
            f"{r['peak_rss_gb']:.2f}",
            f"{100 * r['logits_error']:.1f}%",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    same = rows["graphc numpy int4"]["tokens"] == rows["graphc ort-cpu int4"]["tokens"]
    lines += ["", f"graphc int4 tokens, NumPy against onnxruntime (accuracy level 4: int8 activations there): {'the same' if same else 'differ'}"]
    lines += [f"{note}" for note in notes]
    text = "\n".join(lines)
    print(text)
    Path(args.out + ".md").write_text(f"# `python benchmarks/bench_quantized.py`\n\n{text}\n")
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
