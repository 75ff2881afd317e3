"""A 7B-class decoder-sized graph end to end: build, optimize, export with external data, load and decode in onnxruntime.

    python benchmarks/bench_stack.py [--preset mistral-7b] [--layers 32] [--out /tmp/graphc_stack]

The stack is ``--layers`` attention layers of the preset with random float32
weights (32 mistral-7b layers hold 5.0 GiB, past protobuf's 2 GiB limit) and a
KV cache per layer.  Each phase prints its wall time and the process's peak
resident memory so far; the onnxruntime phase runs in a child process (so its
peak is its own) and decodes one token over a cache of ``--past`` tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import graphc
from graphc.memory import format_bytes
from lowering.exporter.onnx_export import export

_CHILD = r"""
import json, sys, time
import numpy as np, onnxruntime as ort
path, layers, past, heads, dim, d_model = sys.argv[1], *map(int, sys.argv[2:7])
t0 = time.perf_counter()
so = ort.SessionOptions(); so.log_severity_level = 3
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
load = time.perf_counter() - t0
rng = np.random.default_rng(0)
feeds = {"x_BSM": rng.standard_normal((1, 1, d_model), dtype=np.float32)}
for i in range(layers):
    for kind in ("key", "value"):
        feeds[f"past_{kind}.{i}"] = rng.standard_normal((1, heads, past, dim), dtype=np.float32)
sess.run(None, feeds)
t0 = time.perf_counter(); out = sess.run(["out_BSM"], feeds)[0]; step = time.perf_counter() - t0
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))  # this process's own peak
print(json.dumps({"load_s": load, "decode_ms": 1e3 * step, "peak_rss": hwm,
                  "finite": bool(np.isfinite(out).all())}))
"""


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    """Run the phases and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mistral-7b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument("--out", default="/tmp/graphc_stack")
    args = ap.parse_args()
    cfg = graphc.preset(args.preset)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {format_bytes(graphc.memory.machine_memory())}; numpy {np.__version__}; "
        f"preset {args.preset}, {args.layers} layers with a KV cache, float32"
    )
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    g = graphc.attention_stack_graph(cfg, args.layers, kv_cache=True)
    weights = sum(a.nbytes for a in g.initializers.values())
    print(
        f"build     {time.perf_counter() - t0:7.1f} s   peak RSS {format_bytes(_peak()):>10}   weights {format_bytes(weights)}, {len(g.nodes)} nodes"
    )
    t0 = time.perf_counter()
    opt = graphc.optimize(g, hints={"batch": 1, "seq": 1, "past_seq": args.past}).graph
    del g
    gc.collect()
    print(f"optimize  {time.perf_counter() - t0:7.1f} s   peak RSS {format_bytes(_peak()):>10}   {len(opt.nodes)} nodes")
    t0 = time.perf_counter()
    model_path = out / "stack.onnx"
    export(opt, model_path, external_data=True)
    sizes = (model_path.stat().st_size, (out / "stack.onnx.data").stat().st_size)
    print(
        f"export    {time.perf_counter() - t0:7.1f} s   peak RSS {format_bytes(_peak()):>10}   model {format_bytes(sizes[0])} + data "
        f"{format_bytes(sizes[1])}"
    )
    del opt
    gc.collect()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model_path), str(args.layers), str(args.past), str(cfg.n_kv_heads), str(cfg.hd), str(cfg.d_model)],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(child.stdout)
    print(f"ort load  {r['load_s']:7.1f} s   peak RSS {format_bytes(r['peak_rss']):>10}   (child process)")
    print(f"ort decode{r['decode_ms'] / 1e3:7.3f} s   one token over a {args.past}-token cache in every layer; output finite: {r['finite']}")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
