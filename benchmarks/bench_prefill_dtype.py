"""A bfloat16 checkpoint's prefill on the NumPy backend: its weight products in bfloat16 (where the CPU has the
instructions and torch is installed) against float32 products, beside transformers, and the machine's measured
matrix-product peak in each dtype.

    python benchmarks/bench_prefill_dtype.py CHECKPOINT_DIR [--prompt 512] [--blocks 3] [--out docs/bench/prefill_dtype.md]

The checkpoint's weights are read as bfloat16 (``load_weights(..., dtype="bfloat16")``, a float32 checkpoint converted
once), the whole model built with ``dtype="bfloat16"`` and optimized.  Rows: ``numpy, bfloat16 GEMMs``
(:mod:`lowering.kernels.bf16_gemm`), ``numpy, float32 GEMMs`` (``GRAPHC_BF16_MATMUL=0``: each weight block widened,
BLAS in float32), ``transformers sdpa`` (``from_pretrained(dtype=torch.bfloat16)``).  Each times the prompt's prefill
(random ids) in alternating blocks, median of the blocks; GFLOP/s counts the weight products' ``2 * params * tokens``
multiply-adds (attention's excluded), and the peaks are a 512 x 2048 x 5632 product: NumPy's BLAS in float32, torch in
bfloat16.  Writes the table to ``--out``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkpoint_args, lm_feeds, machine, matmul_peaks  # noqa: E402


def main() -> None:
    """Time each row; print the table and write it to ``--out``."""
    args = checkpoint_args(__doc__, "prefill_dtype.md", blocks=3)
    import torch
    import transformers

    import graphc
    from graphc.weights import load_weights
    from lowering import prepare
    from lowering.kernels.bf16_gemm import bf16_gemm_description
    from lowering.kernels.softmax import blas_description

    folder = args.checkpoint
    built = graphc.causal_lm_from_hf(f"{folder}/config.json", load_weights(folder, dtype="bfloat16"), logits="last", dtype="bfloat16")
    graph = graphc.optimize(built).graph
    params = sum(a.size for n, a in graph.initializers.items() if a.ndim == 2 and "embed" not in n)
    feeds = lm_feeds(graph, args.prompt)
    runner = prepare(graph, "numpy")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    tokens = torch.from_numpy(feeds["input_ids"])

    def float32_products() -> Any:
        os.environ["GRAPHC_BF16_MATMUL"] = "0"
        try:
            return runner.run(feeds)
        finally:
            os.environ.pop("GRAPHC_BF16_MATMUL")

    def hf() -> Any:
        with torch.no_grad():
            return model(tokens).logits

    rows = {"numpy, bfloat16 GEMMs": lambda: runner.run(feeds), "numpy, float32 GEMMs": float32_products, "transformers sdpa": hf}
    times: dict[str, list[float]] = {k: [] for k in rows}
    for fn in rows.values():
        fn()
    for _ in range(args.blocks):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    peaks = matmul_peaks()
    peak32, peak16 = peaks["float32"], peaks["bfloat16"]
    flops = 2 * params * args.prompt
    lines = [
        "# `python benchmarks/bench_prefill_dtype.py`: one run\n",
        f"machine: {machine()}, {blas_description()}; "
        f"{bf16_gemm_description() or 'no bfloat16 GEMMs'}; {graph.name} in bfloat16, {params / 1e6:.0f} M weight-product parameters, "
        f"prompt {args.prompt}; measured peaks: float32 {peak32:.0f} GFLOP/s (NumPy's BLAS), bfloat16 {peak16:.0f} GFLOP/s (torch)\n",
        "| runtime | prefill s | weight GFLOP/s | share of the peak of its dtype |",
        "|---|---|---|---|",
    ]
    for name, ts in times.items():
        s = float(np.median(ts))
        peak = peak32 if "float32" in name else peak16
        lines.append(f"| {name} | {s:.2f} | {flops / s / 1e9:.0f} | {flops / s / 1e9 / peak:.0%} |")
    print("\n".join(lines))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
