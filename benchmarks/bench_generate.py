"""Greedy generation, one checkpoint, every runtime users pick: graphc against transformers, optimum and onnxruntime-genai.

For each model (a tiny Mistral and a Mistral-7B-shaped 2-layer model, random weights,
float32) the script makes one checkpoint folder and from it:

- **graphc numpy**: ``causal_lm_from_hf`` + ``optimize``, run by ``lowering.generate`` (NumPy backend);
- **graphc ort-cpu**: the same graph exported to ONNX (attention forms chosen for the decode step),
  run by onnxruntime in the decode loop below;
- **optimum ort-cpu**: ``optimum-cli export onnx --task text-generation-with-past`` of the folder
  (optimum-onnx 0.1.0, in its own venv: it needs transformers < 4.58), run by the *same* decode loop
  and session options as graphc's export: only the ONNX file differs;
- **genai**: onnxruntime-genai 0.18's model builder (``-p fp32 -e cpu``, its fused
  ``GroupQueryAttention`` and ``SkipSimplifiedLayerNormalization``), run by its own runtime
  (``og.Generator``) in its own venv, in a worker process that serves one generation per request;
- **transformers eager / sdpa**: ``model.generate(do_sample=False)``, timed by a logits processor.

Method: every runtime generates ``--new`` tokens after a ``--prompt``-token prompt (batch 1), once to warm
up, then ``--blocks`` times, the runtimes alternating (A B C ... A B C ..., the order rotating each round)
so a noisy stretch hits all.  "first token" is prompt in -> first token out; "ms/token" the median over
blocks of each block's median time per later token (a decode step: forward, argmax, cache handed on, back
to back).  Every runtime's tokens are compared with transformers eager's.

    python benchmarks/bench_generate.py [--models tiny,mistral-7b-2l] [--work DIR] [--blocks 3]

writes ``docs/bench/generate.{md,json}``.  The tools' venvs and the exported models are made once under
``--work`` and reused.
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
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_exports_corpus import tool_python  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny": {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1024},
    "mistral-7b-2l": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000},
}
COMMON = {"num_hidden_layers": 2, "max_position_embeddings": 4096, "rope_theta": 1000000.0, "sliding_window": None, "rms_norm_eps": 1e-5}

CHECKPOINT = r"""
import json, sys, torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
out, kwargs = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(0)
cfg = transformers.MistralConfig(**kwargs)
model = transformers.MistralForCausalLM(cfg).eval()
with torch.no_grad():  # wider than the 0.02 default init, so the greedy tokens vary
    for name, p in model.named_parameters():
        if "norm" not in name:
            p.normal_(0.0, 0.5 * p.shape[-1] ** -0.5)
model.save_pretrained(out)
tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0").save_pretrained(out)
"""

OPTIMUM = r"""
import sys
from optimum.exporters.onnx import main_export
main_export(sys.argv[1], output=sys.argv[2], task="text-generation-with-past")
"""

GENAI_WORKER = r"""
import json, sys, time
import numpy as np
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
print(json.dumps({"ready": og.__version__}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    prompt, new = np.array(req["prompt"], np.int32), req["new"]
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new, min_length=len(prompt) + new)
    gen = og.Generator(model, params)
    times, tokens = [], []
    t0 = time.perf_counter()
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
        times.append(time.perf_counter() - t0)
        tokens.append(int(gen.get_next_tokens()[0]))
        t0 = time.perf_counter()
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps({"times": times, "tokens": tokens, "peak_rss": peak}), flush=True)
"""

EXPORT_SECONDS = "export_seconds.txt"
"""Written beside an export when it is made: its wall time (the venv's creation excluded)."""
Run = Callable[[list[int], int], tuple[list[float], list[int]]]
"""A runtime: (prompt, new tokens) -> (seconds per token, the first including the prompt, tokens)."""


def _script(work: Path, name: str, text: str) -> Path:
    path = work / name
    path.write_text(text)
    return path


def checkpoint(work: Path, model: str) -> Path:
    """The model's checkpoint folder (made once, in the optimum venv: its transformers writes a config every tool reads)."""
    out = work / "models" / model / "hf"
    if not (out / "config.json").exists():
        python = tool_python(work, "optimum")
        kwargs = {**MODELS[model], **COMMON}
        subprocess.run([str(python), str(_script(work, "checkpoint.py", CHECKPOINT)), str(out), json.dumps(kwargs)], check=True)
    return out


def optimum_export(work: Path, model: str, hf: Path) -> Path:
    """optimum's ``text-generation-with-past`` export of the checkpoint."""
    out = work / "models" / model / "optimum"
    if not (out / "model.onnx").exists():
        print(f"optimum: exporting {model} ...", file=sys.stderr, flush=True)
        python = tool_python(work, "optimum")
        t0 = time.perf_counter()
        subprocess.run([str(python), str(_script(work, "optimum_export.py", OPTIMUM)), str(hf), str(out)], check=True)
        (out / EXPORT_SECONDS).write_text(f"{time.perf_counter() - t0:.2f}\n")
    return out / "model.onnx"


def genai_build(work: Path, model: str, hf: Path) -> Path:
    """onnxruntime-genai's model builder output for the checkpoint (fp32, CPU)."""
    out = work / "models" / model / "genai"
    if not (out / "genai_config.json").exists():
        print(f"onnxruntime-genai: building {model} ...", file=sys.stderr, flush=True)
        python = tool_python(work, "genai")
        cmd = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", "fp32", "-e", "cpu"]
        t0 = time.perf_counter()
        subprocess.run([*cmd, "-c", str(work / "genai-cache")], check=True, capture_output=True)
        (out / EXPORT_SECONDS).write_text(f"{time.perf_counter() - t0:.2f}\n")
    return out


def export_seconds(folder: Path) -> float | None:
    """How long the export in ``folder`` took when it was made (exports are made once and reused), if recorded."""
    path = folder / EXPORT_SECONDS
    return float(path.read_text()) if path.exists() else None


def ort_loop(path: Path) -> Run:
    """A decode loop over an optimum-style ONNX file (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.*``):
    the cache stays in onnxruntime's tensors between steps (``run_with_ort_values``); intra-op threads do not spin."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    wants_positions = any(i.name == "position_ids" for i in sess.get_inputs())

    def run(prompt: list[int], new: int) -> tuple[list[float], list[int]]:
        def value(a: np.ndarray) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_numpy(a)

        cache = {p.name: value(np.zeros((1, p.shape[1], 0, p.shape[3]), np.float32)) for p in pasts}
        ids = np.array([prompt], np.int64)
        mask, positions = np.ones_like(ids), np.arange(len(prompt), dtype=np.int64)[None]
        times, tokens = [], []
        for _ in range(new):
            t0 = time.perf_counter()
            feeds = {"input_ids": value(ids), "attention_mask": value(mask), **cache}
            if wants_positions:
                feeds["position_ids"] = value(positions)
            outs = sess.run_with_ort_values(names, feeds)
            last = outs[0].numpy()[0, -1]
            if not tokens:
                run.first_logits = last.copy()  # type: ignore[attr-defined]  # the prompt's last position: what a quality check reads
            token = int(last.argmax())
            cache = {n.replace("present", "past_key_values"): v for n, v in zip(names[1:], outs[1:])}
            times.append(time.perf_counter() - t0)
            tokens.append(token)
            ids, positions = np.array([[token]], np.int64), positions[:, -1:] + 1
            mask = np.ones((1, mask.shape[1] + 1), np.int64)
        return times, tokens

    return run


def graphc_runs(hf: Path, sizes: dict[str, int], work: Path, model: str) -> dict[str, Run]:
    """graphc's model of the checkpoint on NumPy (``lowering.generate``) and its ONNX export in :func:`ort_loop`."""
    import graphc
    from graphc.weights import load_weights
    from lowering import export, generate, prepare

    g = graphc.causal_lm_from_hf(hf / "config.json", load_weights(hf), logits="last")
    g = graphc.optimize(g, hints=sizes).graph
    path = work / "models" / model / "graphc" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    export(g, path, attention="auto", sizes=sizes, external_data=True)
    runner = prepare(g, "numpy")

    def numpy_run(prompt: list[int], new: int) -> tuple[list[float], list[int]]:
        r = generate(g, [prompt], new, runner=runner)
        return [r.prefill_seconds, *r.step_seconds], r.new_tokens[0].tolist()

    return {"graphc numpy": numpy_run, "graphc ort-cpu": ort_loop(path)}


def transformers_runs(hf: Path, impls: tuple[str, ...] = ("eager", "sdpa"), model: object = None) -> dict[str, Run]:
    """transformers' ``generate`` (eager and sdpa attention, or ``impls``; ``model`` already loaded); a logits processor stamps each token."""
    import torch
    import transformers

    runs: dict[str, Run] = {}
    for impl in impls:
        if model is None or len(impls) > 1:
            model = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation=impl, dtype=torch.float32).eval()

        def run(prompt: list[int], new: int, model=model) -> tuple[list[float], list[int]]:  # noqa: ANN001
            stamps: list[float] = []

            class Stamp(transformers.LogitsProcessor):
                def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
                    stamps.append(time.perf_counter())
                    return scores

            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                    logits_processor=transformers.LogitsProcessorList([Stamp()]),
                )
            times = np.diff([t0, *stamps]).tolist()
            return times, out[0, len(prompt) :].tolist()

        runs[f"transformers {impl}"] = run
    return runs


def genai_run(work: Path, folder: Path) -> Run:
    """onnxruntime-genai's own runtime, in a worker process of its venv serving one generation per request."""
    proc = subprocess.Popen(
        [str(tool_python(work, "genai")), str(_script(work, "genai_worker.py", GENAI_WORKER)), str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    json.loads(proc.stdout.readline())  # type: ignore[union-attr]

    def run(prompt: list[int], new: int) -> tuple[list[float], list[int]]:
        proc.stdin.write(json.dumps({"prompt": prompt, "new": new}) + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        reply = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        run.peak_rss = reply.get("peak_rss", 0)  # type: ignore[attr-defined]
        return reply["times"], reply["tokens"]

    return run


def measure(runs: dict[str, Run], prompt: list[int], new: int, blocks: int) -> dict[str, dict[str, object]]:
    """Warm up each runtime, then ``blocks`` alternating rounds; first-token and per-token figures as the module doc says."""
    names = list(runs)
    for name in names:
        runs[name](prompt, min(new, 4))
    first: dict[str, list[float]] = {n: [] for n in names}
    per_token: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    for b in range(blocks):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            times, toks = runs[name](prompt, new)
            first[name].append(times[0])
            per_token[name].append(statistics.median(times[1:]))
            tokens[name] = toks
    out = {}
    for name in names:
        ms = 1e3 * statistics.median(per_token[name])
        out[name] = {"first_token_ms": 1e3 * statistics.median(first[name]), "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "tokens": tokens[name]}
    return out


def table(results: dict[str, dict[str, dict[str, object]]], header: str) -> str:
    """The markdown table of every model's runtimes, ratios to graphc ort-cpu, and whether the tokens match transformers eager."""
    lines = [header, "", "| model | runtime | first token ms | ms/token | tokens/s | ms/token vs graphc ort-cpu | tokens = transformers eager |"]
    lines.append("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for model, rows in results.items():
        ours = rows["graphc ort-cpu"]["ms_per_token"]
        want = rows.get("transformers eager", {}).get("tokens")
        for name, r in rows.items():
            same = "-" if want is None or name == "transformers eager" else ("yes" if r["tokens"] == want else "no")
            lines.append(
                f"| {model} | {name} | {r['first_token_ms']:.2f} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | "
                f"{r['ms_per_token'] / ours:.2f}x | {same} |"  # type: ignore[operator]
            )
    return "\n".join(lines)


def write_results(out: str, header: str, text: str, results: object) -> None:
    """Print the table ``text`` and write it to ``OUT.md``, with ``header`` and ``results`` to ``OUT.json``."""
    print(text)
    Path(out + ".md").write_text(text + "\n")
    Path(out + ".json").write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--work", default="/tmp", help="where the tools' venvs and the exported models live (default /tmp)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=32, help="generated tokens per run (default 32)")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--runtimes", default=None, help="comma-separated subset of the runtimes (default all)")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "generate"), help="writes OUT.md and OUT.json")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    work = Path(args.work)
    prompt = np.random.default_rng(0).integers(3, 1000, args.prompt).tolist()
    results: dict[str, dict[str, dict[str, object]]] = {}
    for model in args.models.split(","):
        hf = checkpoint(work, model)
        sizes = {"batch": 1, "seq": 1, "past_seq": args.prompt + args.new // 2}
        runs = graphc_runs(hf, sizes, work, model)
        runs["optimum ort-cpu"] = ort_loop(optimum_export(work, model, hf))
        runs["genai"] = genai_run(work, genai_build(work, model, hf))
        runs.update(transformers_runs(hf))
        if args.runtimes:
            runs = {n: r for n, r in runs.items() if n in args.runtimes.split(",")}
        print(f"{model}: timing {', '.join(runs)} ...", file=sys.stderr, flush=True)
        results[model] = measure(runs, prompt, args.new, args.blocks)
    import onnxruntime
    import torch
    import transformers

    header = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}; optimum-onnx 0.1.0 and onnxruntime-genai 0.18.0 in their "
        f"own venvs; batch 1, prompt {args.prompt} tokens, {args.new} new tokens, float32, {args.blocks} alternating blocks"
    )
    write_results(args.out, header, table(results, header), results)


if __name__ == "__main__":
    main()
