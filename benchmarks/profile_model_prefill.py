"""Where a whole model's prefill goes on graphc's NumPy backend (or ort-cpu): each kind of node's time, the weight
products' share of the measured matrix-product peak on their own, and what the other nodes cost.

    python benchmarks/profile_model_prefill.py CHECKPOINT_DIR [--prompt 512] [--runs 3] [--backend numpy|ort-cpu]
        [--out docs/bench/profile_model_prefill.md]

On ort-cpu the times are onnxruntime's own profile of each run (``enable_profiling``), its kernels by op type; the
weight products are its ``FusedMatMul`` (and ``MatMulNBits``) nodes, their flops ``2 * params * tokens`` over the
layers' matrices, the peak the float32 one.

The checkpoint is built as ``graphc generate`` builds it (``causal_lm_from_hf`` over the mapped folder, optimized for
the decode step's sizes, ``prepare(..., "numpy")``) and its prompt (random ids) run once to warm up, then ``--runs``
times with a clock around every node; the table gives each kind of node (op type, an einsum's spec, the first
operand's shape) in the median run, sorted by time.  A weight product's GFLOP/s counts ``2 * rows * in * out``; the
peak is ``_common.matmul_peaks`` in the dtype the products multiply in (float32, or bfloat16 where
:mod:`lowering.kernels.bf16_gemm` runs them).  Writes the table to ``--out``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import graphc
from graphc.ops import Einsum
from graphc.weights import load_weights
from lowering import generate, prepare
from lowering.backends import numpy_interpreter
from lowering.backends.registry import decode_options
from lowering.kernels.bf16_gemm import bf16_gemm_description

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkpoint_args, machine, matmul_peaks, prefill_flops  # noqa: E402


def _kind(op: Any, args: Sequence[Any]) -> str:
    shape = "x".join(str(s) for s in getattr(args[0], "shape", ()))
    return f"{type(op).__name__}{' ' + str(op.parsed) if isinstance(op, Einsum) else ''} [{shape}]"


def _product_flops(op: Any, args: Sequence[Any], weights: set[int]) -> int:
    """``2 * rows * in * out`` for an einsum with a 2-D weight operand, else 0."""
    if not isinstance(op, Einsum) or len(args) != 2 or id(args[1]) not in weights or len(args[1].shape) != 2:
        return 0
    return 2 * int(np.prod(args[0].shape)) * int(args[1].shape[0])


Run = tuple[dict[str, tuple[float, int]], float]
"""One prefill: node kind -> (seconds, calls), and the seconds of the weight products among them."""


def _model(folder: Path, prompt: int) -> tuple[graphc.Graph, dict[str, int], list[int]]:
    """The checkpoint as ``graphc generate`` builds it, optimized for the decode step's ``sizes``, and the prompt's ids."""
    sizes = {"batch": 1, "seq": 1, "past_seq": prompt + 1}
    g = graphc.optimize(graphc.causal_lm_from_hf(folder / "config.json", load_weights(folder), logits="last"), hints=sizes).graph
    return g, sizes, [int(i) for i in np.random.default_rng(0).integers(3, 1000, prompt)]


def profile(folder: Path, prompt: int, runs: int) -> tuple[list[Run], int, str]:
    """The ``runs`` prefills, the weight products' flops in one, and the dtype they multiply in."""
    g, sizes, ids = _model(folder, prompt)
    runner = prepare(g, "numpy", **decode_options("numpy", sizes))
    generate(g, [ids], 1, runner=runner)  # warm: the prompt's shapes, the thread and kernel choices
    weights: set[int] = set()  # the interpreter's own weight arrays (converted or stored forms included)
    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    flops: Counter[str] = Counter()
    plain = numpy_interpreter.NumpyInterpreter._run_node

    def timed(self: Any, op: Any, args: list[Any], dims: Mapping[str, int], threads: int | None = None) -> Any:
        if not weights:
            weights.update(id(w) for w in self._weights.values())
        t0 = time.perf_counter()
        out = plain(self, op, args, dims, threads)
        key = _kind(op, args)
        spent[key] += time.perf_counter() - t0
        calls[key] += 1
        flops[key] += _product_flops(op, args, weights)
        return out

    setattr(numpy_interpreter.NumpyInterpreter, "_run_node", timed)  # a clock around every node, for these runs only
    results: list[Run] = []
    try:
        for _ in range(runs):
            spent.clear(), calls.clear(), flops.clear()
            generate(g, [ids], 1, runner=runner)
            results.append(({k: (spent[k], calls[k]) for k in spent}, sum(spent[k] for k in flops if flops[k])))
    finally:
        setattr(numpy_interpreter.NumpyInterpreter, "_run_node", plain)
    dtype = "bfloat16" if bf16_gemm_description() and any(str(a.dtype) == "bfloat16" for a in g.initializers.values()) else "float32"
    return results, sum(flops.values()), dtype


ORT_PRODUCTS = ("FusedMatMul", "MatMulNBits")
"""The op types of ort-cpu's weight products (attention's own products are plain ``MatMul`` nodes)."""


def profile_ort(folder: Path, prompt: int, runs: int) -> tuple[list[Run], int, str]:
    """As :func:`profile`, on ort-cpu: its kernels' times by op type, from onnxruntime's own profile of each run."""
    import onnxruntime as ort

    plain = ort.SessionOptions

    class Profiled(plain):  # the session graphc builds, with onnxruntime's profiler on
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "prefill")

    g, sizes, ids = _model(folder, prompt)
    setattr(ort, "SessionOptions", Profiled)
    try:
        runner = prepare(g, "ort-cpu", **decode_options("ort-cpu", sizes))
    finally:
        setattr(ort, "SessionOptions", plain)
    for _ in range(1 + runs):  # the first warms up
        generate(g, [ids], 1, runner=runner)
    with open(runner.session.end_profiling()) as f:
        events = json.load(f)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-runs:]
    results: list[Run] = []
    for start, end in spans:
        kinds: dict[str, tuple[float, int]] = {}
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and start <= e["ts"] <= end:
                t, n = kinds.get(e["args"]["op_name"], (0.0, 0))
                kinds[e["args"]["op_name"]] = (t + e["dur"] / 1e6, n + 1)
        results.append((kinds, sum(kinds[k][0] for k in ORT_PRODUCTS if k in kinds)))
    return results, prefill_flops(folder, prompt), "float32"


def _describe(folder: Path) -> str:
    """``llama, 22 layers, hidden 2048, float32``: the checkpoint as its config gives it."""
    config = json.loads((folder / "config.json").read_text())
    dtype = config.get("torch_dtype") or config.get("dtype")
    return f"{config.get('model_type')}, {config.get('num_hidden_layers')} layers, hidden {config.get('hidden_size')}, {dtype}"


def main() -> None:
    """Profile the prefill; print the table and write it to ``--out``."""
    args = checkpoint_args(__doc__, "profile_model_prefill.md", runs=3, backend=("numpy", "ort-cpu"))
    folder = Path(args.checkpoint)
    results, product_flops, dtype = (profile if args.backend == "numpy" else profile_ort)(folder, args.prompt, args.runs)
    totals = [sum(t for t, _ in kinds.values()) for kinds, _ in results]
    median, in_products = results[totals.index(sorted(totals)[len(totals) // 2])]
    total = sum(t for t, _ in median.values())
    peak = matmul_peaks()[dtype]
    lines = [
        "# `python benchmarks/profile_model_prefill.py`: one run\n",
        f"machine: {machine()}; {_describe(folder)}, prompt {args.prompt} tokens, {args.backend}, median of {args.runs} prefills; "
        f"weight products in {dtype}, peak {peak:.0f} GFLOP/s\n",
        f"prefill {1e3 * total:.0f} ms in nodes: the weight products {1e3 * in_products:.0f} ms "
        f"({100 * in_products / total:.0f}%) at {product_flops / in_products / 1e9:.0f} GFLOP/s "
        f"({100 * product_flops / in_products / 1e9 / peak:.0f}% of the peak on their own), the whole prefill "
        f"{100 * product_flops / total / 1e9 / peak:.0f}% of the peak\n",
        "| node kind | calls | ms | share |",
        "|---|---:|---:|---:|",
    ]
    for key, (t, n) in sorted(median.items(), key=lambda kv: -kv[1][0])[:20]:
        lines.append(f"| {key} | {n} | {1e3 * t:.1f} | {100 * t / total:.1f}% |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
