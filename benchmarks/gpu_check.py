"""graphc on onnxruntime's CUDA provider, every GPU check in one run (a few minutes on one NVIDIA GPU).

    python benchmarks/gpu_check.py [--out DIR] [--only gemv,core,generate,tests,main,model7b,conformance] [--smoke]

Needs onnxruntime-gpu (CUDAExecutionProvider) and torch with CUDA in the same Python; graphc importable (installed,
or the checkout on PYTHONPATH).  Sections:

- ``main``: the README's main job (``graphc compare --preset mistral-7b --seq 512``), its decode variant
  (``--decode --past 4096``) and a float16 run (``--seq 2048 --dtype float16``), default options: PASS or FAIL per backend.
- ``tests``: the suite's CUDA tests (``pytest -k cuda``).
- ``conformance``: ONNX's Attention backend cases through graphc's import on ort-cuda.
- ``gemv``: one decode-step projection (a 4096 x 14336 float16 weight) as onnxruntime ``MatMul``, ``Gemm(transB=1)``
  and torch ``F.linear``: the weights' read bandwidth a decode step can reach at best.
- ``core``: the attention core of mistral-7b (32 query heads, 8 KV heads, head dim 128) per case: torch SDPA,
  onnxruntime's own fused fp16 ops as hand-written one-node models (``Attention``-23, ``com.microsoft.GroupQueryAttention``)
  and graphc's CUDA export (``device="cuda"``, attention ``auto``), all with inputs and outputs bound on the GPU (IO
  binding to torch CUDA tensors), back to back: best of 3 blocks of 30 calls.  Each row: ms, the max abs error against
  float64, and the nodes onnxruntime placed on the CPU (from its profile).
- ``generate``: ``lowering.generate`` on ort-cuda (KV cache resident on the GPU) of a 2-layer Mistral-7B-shaped float16
  model with random weights: ms/token after 128 and after 2048 prompt tokens, for the growing cache and for the
  fixed-capacity cache with CUDA graphs (alternating), and where a decode step's time goes.
- ``model7b``: all 32 layers of Mistral-7B's shape in float16 (14.5 GB of random weights), both caches: ms/token and
  the weights' read bandwidth it implies, against the device's measured copy bandwidth.

Prints a short table per section and writes everything to ``DIR/gpu_check.json``.  ``--smoke`` runs the code paths
on the CPU at toy sizes (no GPU needed; figures meaningless).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SMOKE = False
RESULTS: dict[str, Any] = {}
H, KV, D = 32, 8, 128  # mistral-7b attention heads
MISTRAL_7B = dict(
    model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False, hidden_act="silu",
)  # fmt: skip


def say(line: str) -> None:
    print(line, flush=True)


def section(name: str, fn: Callable[[], Any]) -> None:
    """Run one section; a failure is reported and the next section runs."""
    say(f"\n== {name} ==")
    t0 = time.perf_counter()
    try:
        RESULTS[name] = fn()
    except Exception as e:  # noqa: BLE001 - report and go on: one run has to say as much as it can
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
        say(f"{name} FAILED: {type(e).__name__}: {str(e)[:400]}")
        traceback.print_exc(limit=4)
    say(f"({name}: {time.perf_counter() - t0:.0f} s)")


def provider() -> str:
    return "CPUExecutionProvider" if SMOKE else "CUDAExecutionProvider"


def torch_device() -> str:
    return "cpu" if SMOKE else "cuda"


def sync() -> None:
    import torch

    if not SMOKE:
        torch.cuda.synchronize()


def alternate(calls: dict[str, Callable[[], object]], rounds: int = 5, n: int = 30) -> dict[str, float]:
    """ms per call of each variant: blocks of ``n`` back-to-back calls, the variants alternating block by block
    (A B C A B C ...) for ``rounds`` rounds; each variant's best block."""
    for call in calls.values():
        for _ in range(5):
            call()
    sync()
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            for _ in range(n):
                call()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t) / n * 1e3)
    return best


def environment() -> dict[str, Any]:
    import onnxruntime as ort
    import torch

    env = {"onnxruntime": ort.__version__, "providers": ort.get_available_providers(), "torch": torch.__version__, "python": sys.version.split()[0]}
    if not SMOKE:
        env["gpu"] = torch.cuda.get_device_name(0)
        x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
        y = torch.empty_like(x)
        ms = alternate({"copy": lambda: y.copy_(x)}, rounds=3, n=20)["copy"]
        env["copy_gb_per_s"] = round(2 * x.numel() * 4 / ms / 1e6)  # bytes read + written
        del x, y
    say(json.dumps(env))
    return env


def run_cli(args: list[str], timeout: int = 600) -> dict[str, Any]:
    """``python -m graphc ARGS`` (or another module), its exit status and the lines that matter."""
    cmd = [sys.executable, *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = (p.stdout + p.stderr).strip().splitlines()
    say(f"$ {' '.join(args)}  -> exit {p.returncode} in {time.perf_counter() - t0:.0f} s")
    keep = [ln for ln in out if any(w in ln for w in ("PASS", "FAIL", "skipped", "passed", "failed", "error", "Error", "tolerance", "|"))]
    for ln in (keep or out)[-14:]:
        say("  " + ln[:220])
    return {"cmd": args, "exit": p.returncode, "lines": out[-60:]}


def main_job() -> list[dict[str, Any]]:
    seq, past, long = ("16", "64", "32") if SMOKE else ("512", "4096", "2048")
    backends = "numpy,ort-cpu" if SMOKE else "numpy,onnx-reference,ort-cpu,ort-cuda,torch"
    runs = [
        ["-m", "graphc", "compare", "--preset", "mistral-7b", "--seq", seq, "--backends", backends],
        ["-m", "graphc", "compare", "--preset", "mistral-7b", "--decode", "--past", past, "--backends", backends.replace("onnx-reference,", "")],
        [
            "-m",
            "graphc",
            "compare",
            "--preset",
            "mistral-7b",
            "--seq",
            long,
            "--dtype",
            "float16",
            "--backends",
            "numpy,ort-cpu" if SMOKE else "numpy,ort-cuda,torch",
        ],
    ]
    return [run_cli(r) for r in runs]


def cuda_tests() -> dict[str, Any]:
    return run_cli(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", "tests/test_onnx_backends.py", "tests/test_cuda.py"], timeout=900)


def conformance() -> dict[str, Any]:
    return run_cli(["benchmarks/onnx_conformance.py", "--backends", "ort-cpu" if SMOKE else "ort-cuda"])


def cpu_placed(session_options: Any, make: Callable[[Any], Any], run: Callable[[Any], object]) -> list[str]:
    """Op types onnxruntime ran on the CPU provider in one profiled run of the session ``make(options)`` builds."""
    session_options.enable_profiling = True
    sess = make(session_options)
    run(sess)
    path = sess.end_profiling()
    events = json.loads(Path(path).read_text())
    os.remove(path)
    on_cpu = Counter(
        e["args"].get("op_name", "?") for e in events if e.get("cat") == "Node" and e.get("args", {}).get("provider") == "CPUExecutionProvider"
    )
    return sorted(on_cpu) if not SMOKE else []


def onnx_fused_models() -> dict[str, Callable[..., Any]]:
    """onnxruntime's own fused fp16 attention as one-node models (the anchor graphc's export is measured against)."""
    from onnx import TensorProto, helper

    def attention23(S: int, T: int, causal: bool) -> Any:
        inputs = [
            helper.make_tensor_value_info("Q", TensorProto.FLOAT16, ["B", H, S, D]),
            helper.make_tensor_value_info("K", TensorProto.FLOAT16, ["B", KV, T, D]),
            helper.make_tensor_value_info("V", TensorProto.FLOAT16, ["B", KV, T, D]),
        ]
        node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=int(causal))
        g = helper.make_graph([node], "attention23", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, ["B", H, S, D])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)

    def gqa(S: int, P: int) -> Any:
        inputs = [
            helper.make_tensor_value_info("query", TensorProto.FLOAT16, ["B", S, H * D]),
            helper.make_tensor_value_info("key", TensorProto.FLOAT16, ["B", S, KV * D]),
            helper.make_tensor_value_info("value", TensorProto.FLOAT16, ["B", S, KV * D]),
            helper.make_tensor_value_info("past_key", TensorProto.FLOAT16, ["B", KV, P, D]),
            helper.make_tensor_value_info("past_value", TensorProto.FLOAT16, ["B", KV, P, D]),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        ]
        outputs = [
            helper.make_tensor_value_info("output", TensorProto.FLOAT16, ["B", S, H * D]),
            helper.make_tensor_value_info("present_key", TensorProto.FLOAT16, ["B", KV, P + S, D]),
            helper.make_tensor_value_info("present_value", TensorProto.FLOAT16, ["B", KV, P + S, D]),
        ]
        names = [i.name for i in inputs] if P else [i.name for i in inputs[:3]] + ["", ""] + [i.name for i in inputs[5:]]
        node = helper.make_node("GroupQueryAttention", names, [o.name for o in outputs], domain="com.microsoft", num_heads=H, kv_num_heads=KV)
        kept = inputs if P else inputs[:3] + inputs[5:]
        g = helper.make_graph([node], "gqa", kept, outputs)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10)

    return {"attention23": attention23, "gqa": gqa}


def bound_session(
    model_bytes: bytes, feeds: dict[str, Any], out_shapes: dict[str, tuple[tuple[int, ...], Any]]
) -> tuple[Callable[[], object], dict, list[str]]:
    """A session over ``model_bytes`` whose inputs and outputs are bound to torch tensors on the device; returns the
    call, the output tensors and the op types the CPU provider ran."""
    import onnxruntime as ort
    import torch

    from lowering.backends.ort_backend import provider_entry

    providers = [provider_entry(provider())] + ([] if SMOKE else ["CPUExecutionProvider"])

    def make(so: Any) -> Any:
        so.log_severity_level = 3
        return ort.InferenceSession(model_bytes, so, providers=providers)

    outs = {n: torch.empty(shape, dtype=dt, device=torch_device()) for n, (shape, dt) in out_shapes.items()}

    def binding(sess: Any) -> Any:
        io = sess.io_binding()
        for name, t in feeds.items():
            if t.dim() == 0:
                io.bind_cpu_input(name, t.cpu().numpy())
            else:
                io.bind_input(name, torch_device(), 0, _np_dtype(t), tuple(t.shape), t.data_ptr())
        for name, t in outs.items():
            io.bind_output(name, torch_device(), 0, _np_dtype(t), tuple(t.shape), t.data_ptr())
        return io

    placed = cpu_placed(ort.SessionOptions(), make, lambda s: s.run_with_iobinding(binding(s)))
    sess = make(ort.SessionOptions())
    io = binding(sess)

    def call() -> object:  # holds the bound tensors: the binding has only their addresses
        sess.run_with_iobinding(io)
        return feeds, outs

    return call, outs, placed


def _np_dtype(t: Any) -> Any:
    import torch

    return {torch.float16: np.float16, torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64}[t.dtype]


def core() -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    import graphc
    from lowering import export

    cfg = graphc.preset("mistral-7b")
    cases = [("decode", 1, 1, 64), ("prefill", 1, 32, 32)] if SMOKE else [
        ("decode", 1, 1, 4096), ("decode", 8, 1, 4096), ("decode", 1, 1, 32768), ("prefill", 1, 1024, 1024), ("prefill", 1, 4096, 4096),
    ]  # fmt: skip
    fused = onnx_fused_models()
    rows = []
    for kind, B, S, T in cases:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (
            torch.randn(shape, generator=gen, dtype=torch.float32).half().to(torch_device()) for shape in ((B, H, S, D), (B, KV, T, D), (B, KV, T, D))
        )
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=S > 1, enable_gqa=True)
        label = f"{kind} B={B} S={S} T={T} fp16"
        variants: dict[str, Callable[[], tuple[Callable[[], object], Any, list[str]]]] = {}
        if not SMOKE:
            variants["torch SDPA"] = lambda: ((lambda: F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=True)), None, [])
        shape_y = ((B, H, S, D), torch.float16)
        variants["onnxruntime Attention-23 (one node)"] = lambda: bound_session(
            fused["attention23"](S, T, S > 1).SerializeToString(), {"Q": q, "K": k, "V": v}, {"Y": shape_y}
        )
        P = T - S
        packed = {
            "query": q.transpose(1, 2).reshape(B, S, H * D).contiguous(),
            "key": k[:, :, P:].transpose(1, 2).reshape(B, S, KV * D).contiguous(),
            "value": v[:, :, P:].transpose(1, 2).reshape(B, S, KV * D).contiguous(),
            **({"past_key": k[:, :, :P].contiguous(), "past_value": v[:, :, :P].contiguous()} if P else {}),
            "seqlens_k": torch.full((B,), T - 1, dtype=torch.int32, device=torch_device()),
            "total_sequence_length": torch.tensor(T, dtype=torch.int32),
        }
        gqa_out = {
            "output": ((B, S, H * D), torch.float16),
            "present_key": ((B, KV, T, D), torch.float16),
            "present_value": ((B, KV, T, D), torch.float16),
        }
        if not SMOKE:
            variants["onnxruntime GroupQueryAttention (one node)"] = lambda: bound_session(fused["gqa"](S, P).SerializeToString(), packed, gqa_out)
        g = graphc.optimize(graphc.sdpa_graph(cfg, batch=B, q_len=S, kv_len=T, causal=True, dtype="float16")).graph

        def graphc_export() -> tuple[Callable[[], object], Any, list[str]]:
            m = export(g, attention="auto", sizes={"batch": B}, device="cuda")
            names = [i.name for i in m.graph.input]
            ops = "+".join(sorted({n.op_type for n in m.graph.node}))
            say(f"  graphc export for CUDA: {len(m.graph.node)} nodes ({ops})")
            return bound_session(m.SerializeToString(), dict(zip(names, (q, k, v))), {m.graph.output[0].name: shape_y})

        variants["graphc export (device=cuda, auto)"] = graphc_export
        made: dict[str, tuple[Callable[[], object], Any]] = {}
        for name, make in variants.items():
            try:
                call, outs, placed = make()
                got = call() if outs is None else (call(), next(iter(outs.values())))[1]
                sync()
                if name.startswith("onnxruntime GroupQuery"):
                    got = got.reshape(B, S, H, D).transpose(1, 2)
                err = (got.double() - ref).abs().max().item()
                rows.append({"case": label, "variant": name, "max_abs_err_vs_f64": err, "cpu_nodes": placed})
                made[name] = call, rows[-1]
            except Exception as e:  # noqa: BLE001
                rows.append({"case": label, "variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
                say(f"  {label} | {name} | {rows[-1]['error']}")
        times = alternate({name: call for name, (call, _) in made.items()})
        for name, (_, row) in made.items():
            row["ms"] = round(times[name], 4)
            say(f"  {label} | {name} | {row['ms']:.3f} ms | err {row['max_abs_err_vs_f64']:.1e} | on CPU: {row['cpu_nodes']}")
    return rows


def lm_config(layers: int) -> Any:
    """Mistral-7B's shape with ``layers`` layers (``--smoke``: a toy width)."""
    from graphc.attention.hf_lm import causal_lm_config_from_hf

    hf = dict(MISTRAL_7B, num_hidden_layers=layers)
    if SMOKE:
        hf.update(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=500)
    return causal_lm_config_from_hf(hf)


def lm_graph(layers: int, weights: dict[str, np.ndarray] | None = None, cache: str = "dynamic", dtype: str = "float16") -> Any:
    import graphc

    return graphc.causal_lm_graph(lm_config(layers), weights, dtype=dtype, logits="last", cache=cache)


CACHES = {"growing cache": ("dynamic", {}), "fixed cache": ("static", {}), "fixed cache + CUDA graphs": ("static", {"cuda_graph": True})}
"""The decode variants timed side by side: the cache each step appends to, and the fixed-capacity cache whose
one-token steps onnxruntime captures as CUDA graphs (``--smoke``: the fixed cache without graphs, on the CPU)."""

APART = " (projections apart)"
"""A variant's name ending so is exported with q/k/v and gate/up as separate MatMuls (``graphc.optimizer.merging`` off):
whether one MatMul over the concatenated weights reads them faster on the GPU."""


@contextlib.contextmanager
def projections_apart(apart: bool) -> Iterator[None]:
    """Within it (``apart=True``), ONNX exports keep each projection its own MatMul."""
    import lowering.exporter.targets as targets
    from graphc.optimizer import Pass

    merge = targets.merge_projections
    if apart:
        targets.merge_projections = Pass("merge_projections", "off (gpu_check)", lambda g, ctx: False)
    try:
        yield
    finally:
        targets.merge_projections = merge


def timed_generation(
    graphs: dict[str, Any], prompt_lengths: list[int], new_tokens: int, rounds: int = 3
) -> list[dict[str, Any]]:
    """``generate`` of each variant (``{name: graph}``, options from :data:`CACHES`) after each prompt length on ort-cuda:
    every runner prepared and warmed first, then all (variant, length) runs alternating for ``rounds`` rounds, each
    run's median ms/token.  Each variant's runner serves every length (a fixed cache's buffers are pooled per shape)."""
    import graphc
    from lowering import generate, prepare
    from lowering.backends.registry import decode_options

    backend = "ort-cpu" if SMOKE else "ort-cuda"
    runs = {}
    failed = []
    for variant, graph in graphs.items():
        sizes = {"batch": 1, "seq": 1, "past_seq": max(prompt_lengths) + new_tokens}
        opt = graphc.optimize(graph, hints=sizes).graph
        options = {} if SMOKE else CACHES[variant.removesuffix(APART)][1]
        t0 = time.perf_counter()
        try:
            with projections_apart(variant.endswith(APART)):
                runner = prepare(opt, backend, **decode_options(backend, sizes), **options)
            prepared = time.perf_counter() - t0
            for n in prompt_lengths:
                prompt = np.random.default_rng(n).integers(0, 500 if SMOKE else 32000, (1, n)).tolist()
                generate(opt, prompt, new_tokens, runner=runner)  # warm-up: kernels chosen, arena grown, graphs captured
                runs[variant, n] = (opt, runner, prompt, prepared)
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others' figures
            say(f"  {variant}: FAILED {type(e).__name__}: {str(e)[:400]}")
            failed.append({"variant": variant, "error": f"{type(e).__name__}: {e}"[:2000]})
            runs = {k: v for k, v in runs.items() if k[0] != variant}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    outs = {}
    for _ in range(rounds):
        for key, (opt, runner, prompt, _) in runs.items():
            outs[key] = generate(opt, prompt, new_tokens, runner=runner)
            times[key].append(outs[key].ms_per_token)
    rows = []
    for (variant, n), out in outs.items():
        row = {"variant": variant, "prompt": n, "new": new_tokens, "ms_per_token": round(float(np.median(times[variant, n])), 3),
               "rounds": [round(t, 3) for t in times[variant, n]], "prefill_ms": round(out.prefill_seconds * 1e3, 1),
               "prepare_s": round(runs[variant, n][3], 1), "provider": out.provider, "tokens": out.new_tokens[0, :8].tolist()}  # fmt: skip
        say(f"  {variant}, prompt {n}: {row['ms_per_token']:.2f} ms/token (rounds {row['rounds']}), prefill {row['prefill_ms']} ms ({out.provider})")
        rows.append(row)
    for n in prompt_lengths:
        tokens = {v: outs[v, n].new_tokens.tolist() for v in graphs if (v, n) in outs}
        same = len({json.dumps(t) for t in tokens.values()}) == 1
        say(f"  prompt {n}: the variants' tokens are {'the same' if same else 'DIFFERENT: ' + json.dumps(tokens)[:300]}")
        rows.append({"prompt": n, "same_tokens": same})
    return rows + failed


def step_profile(graph: Any, past: int) -> dict[str, Any]:
    """Where one decode step's time goes on the CUDA provider: node count, op types by total time, CPU-placed ops."""
    import onnxruntime as ort

    import graphc
    from lowering import export
    from lowering.backends.ort_backend import provider_entry

    sizes = {"batch": 1, "seq": 1, "past_seq": past}
    m = export(graphc.optimize(graph, hints=sizes).graph, attention="auto", sizes=sizes, device="cuda")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_profiling = True
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=[provider_entry(provider()), "CPUExecutionProvider"])
    feeds: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.random.default_rng(0).standard_normal((1, i.shape[1], past, i.shape[3])).astype(np.float16)
    feeds.update(input_ids=np.array([[1]], np.int64), attention_mask=np.ones((1, past + 1), np.int64), position_ids=np.array([[past]], np.int64))
    for _ in range(5):
        sess.run(None, feeds)
    path = sess.end_profiling()
    events = [e for e in json.loads(Path(path).read_text()) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    os.remove(path)
    per_op: Counter[str] = Counter()
    on_cpu: Counter[str] = Counter()
    for e in events:
        per_op[e["args"]["op_name"]] += e["dur"] / 5
        if e["args"].get("provider") == "CPUExecutionProvider":
            on_cpu[e["args"]["op_name"]] += 1 / 5
    ops = Counter(n.op_type for n in m.graph.node)
    summary = {
        "nodes": len(m.graph.node),
        "kernel_us_by_op": {k: round(v) for k, v in per_op.most_common(10)},
        "cpu_ops": {k: round(v, 1) for k, v in on_cpu.items()},
        "kernels_per_step": len(events) / 5,
        "ops": dict(ops.most_common(12)),
    }
    say(f"  step graph: {summary['nodes']} nodes, {summary['kernels_per_step']:.0f} kernels/step; kernel us by op: {summary['kernel_us_by_op']}")
    say(f"  ops on the CPU provider: {summary['cpu_ops']}")
    return summary


def generate_2layer() -> dict[str, Any]:
    graphs = {variant: lm_graph(2, cache=cache) for variant, (cache, _) in CACHES.items()}
    lengths = [16, 64] if SMOKE else [128, 2048]
    rows = timed_generation(graphs, lengths, 8 if SMOKE else 32)
    out: dict[str, Any] = {"rows": rows}
    for variant in CACHES:
        ms = {r["prompt"]: r["ms_per_token"] for r in rows if r.get("variant") == variant and "ms_per_token" in r}
        if len(ms) < 2:
            continue
        out[f"ratio {variant}"] = ratio = ms[lengths[1]] / ms[lengths[0]]
        say(f"  {variant}: ms/token after {lengths[1]} vs after {lengths[0]}: {ratio:.2f}x (target <= 1.2x)")
    out["profile"] = {n: step_profile(graphs["growing cache"], n) for n in lengths}
    return out


def model_7b() -> dict[str, Any]:
    from graphc.attention.causal_lm import init_causal_lm_weights

    layers = 2 if SMOKE else 32
    t0 = time.perf_counter()
    base = init_causal_lm_weights(lm_config(1), 0, "float16")
    weights = {}
    for name, a in base.items():
        if name.startswith("model.layers.0."):
            for i in range(layers):  # distinct bytes per layer (rolled), so no layer shares another's memory
                weights[name.replace("model.layers.0.", f"model.layers.{i}.")] = np.roll(a, i) if i else a
        else:
            weights[name] = a
    total = sum(a.nbytes for a in weights.values())
    say(f"  {layers} layers, {total / 1e9:.2f} GB of float16 weights made in {time.perf_counter() - t0:.0f} s")
    variants = ("growing cache", "fixed cache + CUDA graphs", "fixed cache + CUDA graphs" + APART)
    graphs = {variant: lm_graph(layers, weights, CACHES[variant.removesuffix(APART)][0]) for variant in variants}
    rows = timed_generation(graphs, [128], 16, rounds=2)
    env = RESULTS.get("env", {})
    out: dict[str, Any] = {"weights_gb": total / 1e9, "rows": rows}
    for row in rows:
        if "copy_gb_per_s" in env and "ms_per_token" in row:
            read = total / row["ms_per_token"] / 1e6  # GB/s of weights read per token
            row.update(read_gb_per_s=round(read), fraction=round(read / env["copy_gb_per_s"], 3))
            say(f"  {row['variant']}: weights read at {read:.0f} GB/s = {read / env['copy_gb_per_s']:.0%} of the device copy bandwidth")
    return out


def gemv() -> list[dict[str, Any]]:
    """One decode-step projection, ``[1, 4096]`` times mistral-7b's 4096 x 14336 MLP weight in float16, three ways:
    onnxruntime ``MatMul`` over the weight stored ``[K, N]`` (graphc's ``Transpose`` + ``MatMul`` once onnxruntime folds the
    transpose), onnxruntime ``Gemm(transB=1)`` over the ``[N, K]`` weight as checkpoints store it, and torch's ``F.linear``:
    GB/s of weight read by each, against the device's copy bandwidth."""
    import torch
    import torch.nn.functional as F
    from onnx import TensorProto, helper, numpy_helper

    K, N = (64, 128) if SMOKE else (4096, 14336)
    w = np.random.default_rng(0).standard_normal((N, K), dtype=np.float32).astype(np.float16) * np.float16(K**-0.5)
    x = torch.randn(1, K, dtype=torch.float16, device=torch_device())

    def model(node: Any, weight: np.ndarray) -> bytes:
        g = helper.make_graph(
            [node], "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, K])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, N])], [numpy_helper.from_array(weight, "w")],
        )  # fmt: skip
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()

    out = {"y": ((1, N), torch.float16)}
    matmul, *_ = bound_session(model(helper.make_node("MatMul", ["x", "w"], ["y"]), np.ascontiguousarray(w.T)), {"x": x}, out)
    gemm, *_ = bound_session(model(helper.make_node("Gemm", ["x", "w"], ["y"], transB=1), w), {"x": x}, out)
    tw = torch.from_numpy(w).to(torch_device())
    times = alternate({"ort MatMul [K,N]": matmul, "ort Gemm transB [N,K]": gemm, "torch F.linear": lambda: F.linear(x, tw)}, n=100)
    copy = RESULTS.get("env", {}).get("copy_gb_per_s")
    rows = []
    for name, ms in times.items():
        gbs = w.nbytes / ms / 1e6
        rows.append({"variant": name, "ms": round(ms, 4), "gb_per_s": round(gbs), "of_copy": round(gbs / copy, 2) if copy else None})
        say(f"  [1,{K}] x [{K},{N}] fp16 | {name} | {ms * 1e3:.1f} us | {gbs:.0f} GB/s" + (f" = {gbs / copy:.0%} of copy" if copy else ""))
    return rows


SECTIONS: dict[str, Callable[[], Any]] = {
    "gemv": gemv,
    "generate": generate_2layer,
    "tests": cuda_tests,
    "model7b": model_7b,
    "core": core,
    "main": main_job,
    "conformance": conformance,
}
"""In the order they run (the attention kernels and the decode loop first: what a short run must not miss)."""


def main() -> None:
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for gpu_check.json (default: here)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections (default all: {','.join(SECTIONS)})")
    ap.add_argument("--smoke", action="store_true", help="the code paths on the CPU at toy sizes (no GPU; figures meaningless)")
    ap.add_argument("--budget", type=float, default=None, help="seconds: sections not started by then are skipped (default: no limit)")
    args = ap.parse_args()
    SMOKE = args.smoke
    wanted = [s for s in args.only.split(",") if s]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {unknown}; valid: {', '.join(SECTIONS)}")
    start = time.perf_counter()
    section("env", environment)
    for name in wanted:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            RESULTS[name] = {"skipped": f"past the {args.budget:.0f} s budget"}
            say(f"\n== {name} == skipped: past the {args.budget:.0f} s budget")
            continue
        section(name, SECTIONS[name])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
