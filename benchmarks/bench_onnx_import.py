"""onnxruntime on a torch.onnx export, on onnxscript's rewrite of it, and on graphc's re-export of it.

    python benchmarks/bench_onnx_import.py [--repeats N] [--threads T] [--layer mistral-7b|small]

A Mistral-7B-shaped attention layer written the way transformers writes it
(q/k/v/o Linear, RoPE with rotate_half, ``repeat_kv`` as expand + reshape,
additive causal mask from ``full(-inf).triu``, softmax in float32) is exported
with ``torch.onnx.export(dynamo=True)``: once for causal prefill (no cache),
once for a decode step with past_key/past_value.  Each variant of the ONNX
model then runs on onnxruntime CPU in the same process: as exported; after
onnxscript's ``optimizer.optimize`` + ``rewriter.rewrite``; after onnxscript's
``optimize_for_ort`` fusions; after ``graphc optimize`` (grouped MatMuls, no
K/V copy); and graphc with ``--attention auto`` (a fused attention op where
graphc's cost rule picks one for these sizes).  Every variant's output is
checked against torch before it is timed.  Times are medians after one
warm-up; ratios are to the torch export in the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from _common import median_ms

LAYERS = {"mistral-7b": dict(hidden=4096, heads=32, kv_heads=8), "small": dict(hidden=512, heads=8, kv_heads=2)}
CASES = {"causal prefill 1024": dict(seq=1024, past=None), "decode 1 over 4096": dict(seq=1, past=4096)}


def _module(hidden: int, heads: int, kv_heads: int):  # type: ignore[no-untyped-def]
    import torch

    head = hidden // heads

    def rotate_half(x):  # type: ignore[no-untyped-def]
        return torch.cat((-x[..., head // 2 :], x[..., : head // 2]), dim=-1)

    def repeat_kv(x, n):  # type: ignore[no-untyped-def]
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(hidden, heads * head, bias=False)
            self.k_proj = torch.nn.Linear(hidden, kv_heads * head, bias=False)
            self.v_proj = torch.nn.Linear(hidden, kv_heads * head, bias=False)
            self.o_proj = torch.nn.Linear(heads * head, hidden, bias=False)
            self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, head, 2).float() / head)), persistent=False)

        def forward(self, x, past_key=None, past_value=None):  # type: ignore[no-untyped-def]
            b, s, _ = x.shape
            past = past_key.shape[2] if past_key is not None else 0
            q = self.q_proj(x).view(b, s, heads, head).transpose(1, 2)
            k = self.k_proj(x).view(b, s, kv_heads, head).transpose(1, 2)
            v = self.v_proj(x).view(b, s, kv_heads, head).transpose(1, 2)
            freqs = torch.outer(torch.arange(past, past + s, dtype=torch.float32), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            q = q * emb.cos() + rotate_half(q) * emb.sin()
            k = k * emb.cos() + rotate_half(k) * emb.sin()
            if past_key is not None:
                k, v = torch.cat([past_key, k], dim=2), torch.cat([past_value, v], dim=2)
            present_k, present_v = k, v
            k, v = repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads)
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(head)
            t = k.shape[2]
            scores = scores + torch.full((s, t), float("-inf")).triu(t - s + 1)
            p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = self.o_proj(torch.matmul(p, v).transpose(1, 2).reshape(b, s, hidden))
            return (out, present_k, present_v) if past_key is not None else out

    return Attention().eval()


def _export(module, path: Path, feeds: dict, cache: bool) -> None:  # type: ignore[no-untyped-def]
    import torch

    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    shapes = {"x": {0: batch, 1: seq}} | ({"past_key": {0: batch, 2: past}, "past_value": {0: batch, 2: past}} if cache else {})
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names = list(feeds)
    outs = ["out", "present_key", "present_value"] if cache else ["out"]
    torch.onnx.export(
        module, args, str(path), dynamo=True, input_names=names, output_names=outs, dynamic_shapes=shapes, external_data=True, verbose=False
    )


def _variants(path: Path, workdir: Path, sizes: dict[str, int]) -> dict[str, Path]:
    """Every ONNX variant of the exported model, written next to it."""
    import onnx
    import onnx_ir
    import onnxscript.optimizer
    import onnxscript.rewriter
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    import graphc
    from graphc.onnx_import import from_onnx
    from lowering.exporter.onnx_export import export

    out = {"torch.onnx dynamo export": path}
    model = onnx.load(str(path))
    rewritten = onnxscript.rewriter.rewrite(onnxscript.optimizer.optimize(model))
    out["onnxscript optimize + rewrite"] = _save(rewritten, workdir / "onnxscript_rewrite.onnx")
    ir_model = onnx_ir.from_proto(model)
    onnxscript.optimizer.optimize_ir(ir_model)
    fused, counts = optimize_for_ort(ir_model)
    print(f"  onnxscript optimize_for_ort fusions: {', '.join(f'{k} {v}' for k, v in counts.items() if v) or 'none'}")
    out["onnxscript optimize_for_ort"] = _save(onnx_ir.to_proto(fused), workdir / "onnxscript_ort.onnx")
    t0 = time.perf_counter()
    g = graphc.optimize(from_onnx(path), hints=sizes).graph
    export(g, workdir / "graphc.onnx", opset=20, external_data=True)
    out["graphc optimize (grouped MatMul)"] = workdir / "graphc.onnx"
    export(g, workdir / "graphc_auto.onnx", opset=23, attention="auto", sizes=sizes, external_data=True)
    out["graphc optimize, attention auto"] = workdir / "graphc_auto.onnx"
    print(f"  graphc import + optimize + 2 exports: {time.perf_counter() - t0:.1f} s")
    return out


def _save(model, path: Path) -> Path:  # type: ignore[no-untyped-def]
    import onnx

    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def _expands(path: Path) -> int:
    import onnx

    return sum(n.op_type == "Expand" for n in onnx.load(str(path), load_external_data=False).graph.node)


def main() -> None:
    """Export, rewrite and time every variant for both cases; print one table per case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--layer", default="mistral-7b", choices=sorted(LAYERS))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import onnxruntime as ort
    import onnxscript
    import torch

    torch.manual_seed(0)
    dims = LAYERS[args.layer]
    module = _module(**dims)
    head = dims["hidden"] // dims["heads"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; layer {args.layer} (d_model {dims['hidden']}, {dims['heads']}/{dims['kv_heads']} "
        f"heads, "
        f"head_dim {head}), float32, batch 1; onnxruntime {ort.__version__} CPU ({args.threads} threads), torch {torch.__version__}, onnxscript "
        f"{onnxscript.__version__}"
    )
    rng = np.random.default_rng(0)
    for case, c in CASES.items():
        feeds = {"x": rng.standard_normal((1, c["seq"], dims["hidden"]), dtype=np.float32)}
        if c["past"] is not None:
            for name in ("past_key", "past_value"):
                feeds[name] = rng.standard_normal((1, dims["kv_heads"], c["past"], head), dtype=np.float32)
        with torch.no_grad():
            want = module(*(torch.from_numpy(v) for v in feeds.values()))
        want = (want if isinstance(want, tuple) else (want,))[0].numpy()
        sizes = {"batch": 1, "seq": c["seq"]} | ({"past": c["past"]} if c["past"] is not None else {})
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            print(f"\n{case}:")
            _export(module, workdir / "model.onnx", feeds, c["past"] is not None)
            rows = []
            for name, path in _variants(workdir / "model.onnx", workdir, sizes).items():
                opts = ort.SessionOptions()
                opts.intra_op_num_threads = args.threads
                session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
                got = session.run(None, feeds)[0]
                err = float(np.abs(got - want).max())
                if err > 1e-3:
                    raise SystemExit(f"{name}: max abs error {err:.2e} against torch")
                ms = median_ms(lambda f: session.run(None, f), [feeds], args.repeats)
                rows.append((name, _expands(path), ms, err))
            base = rows[0][2]
            print("| variant | Expand left | median ms | vs torch export | max abs err vs torch |\n|---|---|---|---|---|")
            for name, expands, ms, err in rows:
                print(f"| {name} | {expands} | {ms:.1f} | {ms / base:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
