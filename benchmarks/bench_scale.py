"""Real shapes: 1-2B-parameter checkpoints through graphc and its peers, each runtime alone in its own process.

Each model is a random-weight checkpoint written by transformers' ``save_pretrained``
at a real model's shape (unit-scale embeddings and layers that each add a little to
the residual stream: with transformers' default init every greedy token is the same):

- ``tinyllama-f32``, ``tinyllama-bf16``: TinyLlama-1.1B (22 layers, hidden 2048, 32/4 heads, vocab 32000);
- ``llama3.2-1b-bf16``: Llama-3.2-1B (16 layers, 32/8 heads, vocab 128256, tied embeddings, llama3 RoPE);
- ``qwen2.5-1.5b-bf16``: Qwen2.5-1.5B (28 layers, 12/2 heads, q/k/v biases, vocab 151936, tied);
- ``mistral-7b-bf16`` (not in the default list: run it alone, ``--models mistral-7b-bf16``): Mistral-7B (32 layers,
  32/8 heads): 14.5 GB of bfloat16.

Runtimes, each in a child process of its own (two 4 GB models do not share a
24 GiB machine with room to measure), one after another:

- ``graphc numpy`` / ``graphc ort-cpu``: what ``graphc generate DIR`` runs: ``causal_lm_from_hf`` over the
  memory-mapped folder, ``optimize`` for the decode step, ``lowering.prepare`` (ort-cpu: weights read by
  onnxruntime from the safetensors files, attention forms chosen for decode) and ``lowering.generate``;
- ``graphc ort-cpu packed``: the same with ``prepack=True`` (onnxruntime packs every weight while the session is
  built; graphc's default, for weights this large, reads them as stored);
- ``graphc ort-cpu cold`` / ``graphc ort-cpu warm``: ``graphc ort-cpu`` with ``GRAPHC_WEIGHT_CACHE`` set to a folder
  under ``--work``, emptied before the cold run (the session built and saved: a bfloat16 checkpoint's float32
  conversion; a float32 checkpoint's unpacked session saves nothing) and read by the warm one, then removed;
- ``transformers sdpa``: ``from_pretrained`` in the checkpoint's dtype, ``generate(do_sample=False)``;
- ``optimum ort-cpu``: optimum's ``text-generation-with-past`` export (in its own venv; float32 checkpoints
  only: its export of a bfloat16 one is float32 weights on onnxruntime's CPU kernels anyway), run by the
  same onnxruntime decode loop as ``bench_generate.py``;
- ``genai``: onnxruntime-genai's model builder (``-p fp32 -e cpu``) and its own runtime (float32
  checkpoints only, as optimum).

Per runtime: **load s** (folder in, ready to run: build, optimize, session; exports by optimum and
genai are timed apart when they are made, in "export s", and reused by later runs), **prefill ms** (a
``--prompt``-token prompt in, first token out), **prefill GFLOP/s** (the layers' weight products, ``2 * params *
tokens``, over the prefill) as a share of the machine's **peak** in the dtype the runtime multiplies in
(``_common.matmul_peaks``, measured in the parent before each model: float32 through NumPy's BLAS, bfloat16 through
torch; graphc's NumPy backend multiplies a bfloat16 checkpoint in bfloat16 where the CPU and torch allow,
onnxruntime, optimum and genai in float32), **time to first token** (load + prefill), **ms/token**
(median decode step over ``--blocks`` generations of ``--new`` tokens, back to back), **peak RSS** (the
child's ``VmHWM``) against the weights' bytes, and decode **GB/s** with its **% of the read bandwidth**
(``torch.sum`` over 1 GiB, measured in the same process just before the decode blocks; a step reads every
weight but the input embedding, in the dtype the runtime reads it in: graphc's NumPy backend reads bfloat16
weights as stored, its onnxruntime backend float32 ones, transformers bfloat16).  Tokens: every runtime's greedy
tokens for the timed prompt and, on graphc and transformers, for a left-padded batch of two prompts,
compared with transformers'.

    python benchmarks/bench_scale.py [--models tinyllama-f32,...] [--work DIR] [--prompt 512] [--new 16] [--blocks 3]

writes ``docs/bench/scale.{md,json}``.  Checkpoints, exports and the tools' venvs are made once under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import matmul_peaks, prefill_flops  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tinyllama-f32": ("float32", "LlamaConfig", {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
                      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
    "tinyllama-bf16": ("bfloat16", "LlamaConfig", {}),  # the same config
    "llama3.2-1b-bf16": ("bfloat16", "LlamaConfig", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                         "max_position_embeddings": 131072, "rope_parameters": LLAMA3_ROPE, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}),
    "qwen2.5-1.5b-bf16": ("bfloat16", "Qwen2Config", {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                          "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                          "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    "mistral-7b-bf16": ("bfloat16", "MistralConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
                        "rope_theta": 10000.0, "sliding_window": 4096, "rms_norm_eps": 1e-5}),
}  # fmt: skip
MODELS["tinyllama-bf16"] = ("bfloat16", "LlamaConfig", MODELS["tinyllama-f32"][2])
DEFAULT_MODELS = "tinyllama-f32,tinyllama-bf16,llama3.2-1b-bf16,qwen2.5-1.5b-bf16"
RUNTIMES = (
    "graphc numpy",
    "graphc ort-cpu",
    "graphc ort-cpu packed",
    "graphc ort-cpu cold",
    "graphc ort-cpu warm",
    "transformers sdpa",
    "optimum ort-cpu",
    "genai",
)
BATCH = [[5, 17, 33, 2001, 901], [7, 1, 90, 44, 12, 60, 311, 4, 18]]  # the left-padded parity batch

CHECKPOINT = r"""
import json, sys, torch, transformers
out, dtype, config_name, kwargs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
cfg = getattr(transformers, config_name)(**kwargs, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
with torch.device("meta"):  # built in its dtype: a 7B model in float32 would not fit beside its bfloat16 copy
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
model = model.to_empty(device="cpu").to(getattr(torch, dtype)).eval()
model.tie_weights()  # to_empty gives every parameter its own storage
tied = cfg.tie_word_embeddings
with torch.no_grad():  # greedy tokens vary (with the default init every token is the same): unit-scale embeddings and layers adding
    for name, p in model.named_parameters():  # a little each; a tied head needs small embeddings (else it names the input token)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
        elif "embed" in name:
            p.normal_(0.0, 0.05 if tied else 1.0)
        else:
            p.normal_(0.0, (1.0 if tied else 0.3 if "o_proj" in name or "down_proj" in name else 1.0) * p.shape[-1] ** -0.5)
model.generation_config.eos_token_id = None
model.save_pretrained(out)
"""

TOKENIZER = r"""
import sys, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
out, vocab = sys.argv[1], int(sys.argv[2])
tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0").save_pretrained(out)
"""


def checkpoint(work: Path, model: str) -> Path:
    """The model's ``save_pretrained`` folder (made once)."""
    out = work / "models" / model / "hf"
    if not (out / "config.json").exists():
        dtype, config_name, kwargs = MODELS[model]
        print(f"{model}: writing the checkpoint ...", file=sys.stderr, flush=True)
        work.mkdir(parents=True, exist_ok=True)
        script = work / "scale_checkpoint.py"
        script.write_text(CHECKPOINT)
        subprocess.run([sys.executable, str(script), str(out), dtype, config_name, json.dumps(kwargs)], check=True)
    if not (out / "tokenizer.json").exists():  # onnxruntime-genai's builder wants one: a word-level vocabulary of the model's size
        script = work / "scale_tokenizer.py"
        script.write_text(TOKENIZER)
        subprocess.run([sys.executable, str(script), str(out), str(MODELS[model][2]["vocab_size"])], check=True)
    return out


_PEAK_BEFORE_PROBE = [0]


def _peak() -> int:
    """The process's peak resident bytes, the bandwidth probe's own gigabyte left out."""
    from graphc.memory import resident_peak_bytes

    return max(_PEAK_BEFORE_PROBE[0], resident_peak_bytes() or 0)


def _bandwidth() -> float:
    """GB/s of the best of five ``torch.sum`` passes over 1 GiB; the peak RSS so far is kept and counted again from after the
    probe, so the probe's buffer is not counted as the model's."""
    import torch

    from graphc.memory import reset_resident_peak, resident_peak_bytes

    _PEAK_BEFORE_PROBE[0] = resident_peak_bytes() or 0
    x = torch.ones(1 << 28)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    del x
    reset_resident_peak()
    return (1 << 30) / best / 1e9


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _graphc(hf: Path, backend: str, dtype: str, prompt: list[int], new: int, blocks: int, packed: bool = False) -> dict[str, Any]:
    import graphc
    from lowering.kernels.bf16_gemm import bf16_gemm_description
    from graphc.weights import load_weights
    from lowering import generate, prepare
    from lowering.backends.registry import decode_options

    t0 = time.perf_counter()
    g = graphc.causal_lm_from_hf(hf / "config.json", load_weights(hf), logits="last")
    sizes = {"batch": 1, "seq": 1, "past_seq": len(prompt) + new}
    g = graphc.optimize(g, hints=sizes).graph
    runner = prepare(g, backend, **decode_options(backend, sizes), **({"prepack": True} if packed else {}))
    load = time.perf_counter() - t0
    batch = generate(g, BATCH, new, runner=runner).new_tokens.tolist()
    generate(g, [prompt], 2, runner=runner)  # warm: the prompt's shapes
    bandwidth = _bandwidth()
    runs = [generate(g, [prompt], new, runner=runner) for _ in range(blocks)]
    return {
        "load_s": load,
        "prefill_ms": 1e3 * statistics.median(r.prefill_seconds for r in runs),
        "ms_per_token": statistics.median(r.ms_per_token for r in runs),
        "tokens": runs[-1].new_tokens[0].tolist(),
        "batch_tokens": batch,
        "bandwidth_gbs": bandwidth,
        "provider": runner.provider,
        "weights": getattr(runner, "weights", ""),
        "prefill_dtype": "bfloat16" if backend == "numpy" and dtype == "bfloat16" and bf16_gemm_description() else "float32",
    }


def _transformers(hf: Path, dtype: str, prompt: list[int], new: int, blocks: int) -> dict[str, Any]:
    import torch
    import transformers
    from bench_generate import transformers_runs

    from lowering import left_pad

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="sdpa", dtype=getattr(torch, dtype)).eval()
    load = time.perf_counter() - t0
    ids, mask = left_pad(BATCH)
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    run = transformers_runs(hf, impls=("sdpa",), model=model)["transformers sdpa"]
    provider = f"transformers {transformers.__version__}, torch {torch.__version__}, sdpa, {dtype}"
    return {**_tool(run, load, 0.0, provider, prompt, new, blocks), "batch_tokens": out[:, ids.shape[1] :].tolist(), "prefill_dtype": dtype}


def _tool(run_fn: Any, load: float, export: float, provider: str, prompt: list[int], new: int, blocks: int) -> dict[str, Any]:
    """Warm ``run_fn`` up, measure the read bandwidth, then time ``blocks`` generations of ``new`` tokens."""
    run_fn(prompt, 2)
    bandwidth = _bandwidth()
    times = [run_fn(prompt, new) for _ in range(blocks)]
    return {
        "load_s": load,
        "export_s": export,
        "prefill_ms": 1e3 * statistics.median(t[0][0] for t in times),
        "ms_per_token": 1e3 * statistics.median(statistics.median(t[0][1:]) for t in times),
        "tokens": times[-1][1],
        "bandwidth_gbs": bandwidth,
        "provider": provider,
        "prefill_dtype": "float32",
    }


def worker(runtime: str, hf: Path, work: Path, model: str, prompt: list[int], new: int, blocks: int) -> dict[str, Any]:
    """One runtime on one checkpoint, in this (child) process."""
    import bench_generate as peers

    dtype = MODELS[model][0]
    if runtime.startswith("graphc "):
        out = _graphc(hf, runtime.split()[1], dtype, prompt, new, blocks, packed=runtime.endswith(" packed"))
    elif runtime == "transformers sdpa":
        out = _transformers(hf, dtype, prompt, new, blocks)
    elif runtime == "optimum ort-cpu":
        path = peers.optimum_export(work, model, hf)
        export = peers.export_seconds(path.parent) or 0.0  # timed when it was made (exports are reused)
        t0 = time.perf_counter()
        run = peers.ort_loop(path)
        import onnxruntime

        out = _tool(run, time.perf_counter() - t0, export, f"optimum-onnx 0.1.0 export, onnxruntime {onnxruntime.__version__}", prompt, new, blocks)
    else:
        folder = peers.genai_build(work, model, hf)
        export = peers.export_seconds(folder) or 0.0
        t0 = time.perf_counter()
        run = peers.genai_run(work, folder)
        out = _tool(run, time.perf_counter() - t0, export, "onnxruntime-genai 0.18.0 (fp32, cpu)", prompt, new, blocks)
        out["peak_rss"] = run.peak_rss  # the worker process's, which holds the model
    out.setdefault("peak_rss", _peak())
    return out


def _child(runtime: str, hf: Path, args: argparse.Namespace, model: str, prompt: list[int]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", runtime, "--hf", str(hf), "--work", args.work, "--model-name", model,
           "--prompt", str(args.prompt), "--new", str(args.new), "--blocks", str(args.blocks)]  # fmt: skip
    print(f"{model}: {runtime} ...", file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k != "GRAPHC_WEIGHT_CACHE"}
    cache = Path(args.work) / "session-cache" / model
    if runtime.endswith((" cold", " warm")):  # the session cache: emptied for the cold run, read by the warm one
        if runtime.endswith(" cold"):
            shutil.rmtree(cache, ignore_errors=True)
        env["GRAPHC_WEIGHT_CACHE"] = str(cache)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if runtime.endswith(" warm"):
        shutil.rmtree(cache, ignore_errors=True)  # twice the weights' bytes: not left for the next model
    if r.returncode:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return {"error": (lines[-1] if lines else f"exit {r.returncode}")[:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _read_bytes(hf: Path, compute_f32: bool) -> tuple[int, int]:
    """(bytes of the checkpoint's weights, bytes one decode step reads: every weight but the input embedding, unless tied)."""
    from graphc.weights import load_weights

    w = load_weights(hf)
    total = sum(a.nbytes for a in w.values())
    tied = "lm_head.weight" not in w
    read = sum(a.nbytes * (4 // a.itemsize if compute_f32 else 1) for n, a in w.items() if tied or "embed_tokens" not in n)
    return total, read


def _prefill_rate(r: dict[str, Any], m: dict[str, Any]) -> str:
    dtype = r.get("prefill_dtype", "float32")
    rate = m["prefill_flops"] / (r["prefill_ms"] / 1e3) / 1e9
    peak = m.get("peaks", {}).get(dtype)
    return f"{rate:.0f} ({100 * rate / peak:.0f}% of {peak:.0f}, {dtype})" if peak else f"{rate:.0f} ({dtype})"


def table(results: dict[str, dict[str, Any]], header: str) -> str:
    """The markdown table: one row per model and runtime."""
    columns = ["model", "runtime", "load s", "export s", "prefill ms", "prefill GFLOP/s (% of peak, dtype)", "first token s", "ms/token",
               "tokens/s", "decode GB/s (% of read bw)", "peak RSS GB (x weights)", "tokens = transformers"]  # fmt: skip
    lines = [header, "", "| " + " | ".join(columns) + " |", "| --- | --- |" + " ---: |" * 9 + " --- |"]
    for model, m in results.items():
        want = m["runtimes"].get("transformers sdpa", {})
        for name, r in m["runtimes"].items():
            if "error" in r or "skipped" in r:
                lines.append(f"| {model} | {name} | {r.get('skipped') or 'failed: ' + r['error']} | | | | | | | | | |")
                continue
            reads = m["read_bytes_f32"] if name.startswith(("graphc ort", "optimum", "genai")) else m["read_bytes"]  # they compute on float32 weights
            gbs = reads / (r["ms_per_token"] / 1e3) / 1e9
            same = "-" if name == "transformers sdpa" or "tokens" not in want else ("yes" if r["tokens"] == want["tokens"] else "no")
            if "batch_tokens" in r and "batch_tokens" in want and name != "transformers sdpa":
                same += ", batch " + ("yes" if r["batch_tokens"] == want["batch_tokens"] else "no")
            lines.append(
                f"| {model} | {name} | {r['load_s']:.1f} | {r.get('export_s', 0):.0f} | {r['prefill_ms']:.0f} | {_prefill_rate(r, m)} | "
                f"{r['load_s'] + r['prefill_ms'] / 1e3:.1f} | {r['ms_per_token']:.1f} | {1e3 / r['ms_per_token']:.1f} | "
                f"{gbs:.1f} ({100 * gbs / r['bandwidth_gbs']:.0f}% of {r['bandwidth_gbs']:.1f}) | "
                f"{r['peak_rss'] / 1e9:.2f} ({r['peak_rss'] / m['weight_bytes']:.2f}x) | {same} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--runtimes", default=",".join(RUNTIMES))
    p.add_argument("--work", default="/tmp/graphc-scale", help="checkpoints, exports and the tools' venvs (default /tmp/graphc-scale)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "scale"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hf", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-name", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    import numpy as np

    prompt = np.random.default_rng(0).integers(3, 30000, args.prompt).tolist()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.hf), work, args.model_name, prompt, args.new, args.blocks)))
        return
    results: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        hf = checkpoint(work, model)
        dtype = MODELS[model][0]
        total, read = _read_bytes(hf, False)
        results[model] = {"dtype": dtype, "weight_bytes": total, "read_bytes": read, "read_bytes_f32": _read_bytes(hf, True)[1],
                          "prefill_flops": prefill_flops(hf, args.prompt), "peaks": matmul_peaks(), "runtimes": {}}  # fmt: skip
        for runtime in args.runtimes.split(","):
            if runtime in ("optimum ort-cpu", "genai") and dtype != "float32":
                results[model]["runtimes"][runtime] = {"skipped": "float32 checkpoints only (see the module doc)"}
                continue
            results[model]["runtimes"][runtime] = _child(runtime, hf, args, model, prompt)
        Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")
    import onnxruntime

    header = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
        f"onnxruntime {onnxruntime.__version__}; batch 1, prompt {args.prompt} tokens, {args.new} new tokens, {args.blocks} generations per runtime, "
        "each runtime alone in its own process"
    )
    from bench_generate import write_results

    write_results(args.out, header, table(results, header), results)


if __name__ == "__main__":
    main()
