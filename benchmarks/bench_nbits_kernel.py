"""The NumPy backend's 4-bit decode kernel alone: packed bytes a second on one thread, against the read bandwidth.

For each weight shape of Qwen2.5-0.5B (``--shape``: ``N x K`` pairs), one row of activations times a random packed
weight in ``MatMulNBits``' layout (block 32, symmetric) through :func:`lowering.kernels._numba_linear.nbits_rows`,
``--repeats`` calls back to back in each of ``--blocks`` blocks (the fastest block reported), beside float32 BLAS's
product with the same weight widened (what the bytes would cost unpacked) and the read bandwidth this process
measures (NumPy sum over 1 GiB).  What it shows: whether the kernel is bound by memory or by unpacking.

    python benchmarks/bench_nbits_kernel.py [--blocks 5] [--repeats 20]

needs ``pip install ".[fast]"`` (numba); writes ``docs/bench/nbits_kernel.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHAPES = ((896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896))
"""Qwen2.5-0.5B's products (N x K): Q and O, K and V, gate and up, down, the tied LM head."""


def _fastest(fn, blocks: int, repeats: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from threadpoolctl import threadpool_limits

    from _common import read_probe
    from graphc.quantized import dequantize_blocks, quantize_blocks
    from lowering.kernels._numba_linear import nbits_rows

    rng = np.random.default_rng(0)
    bandwidth, read = read_probe(1)
    gbs = (1 << 30) / _fastest(lambda: read({}), 3, 1) / 1e9
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [f"{os.cpu_count()}-core {cpu} ({memory:.0f} GiB), one thread; read bandwidth {gbs:.1f} GB/s ({bandwidth})", ""]
    lines.append("| N x K | packed MB | kernel ms | packed GB/s | G weights/s | of read bandwidth | float32 BLAS ms |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, k in SHAPES:
        packed, scales, _ = quantize_blocks(rng.standard_normal((n, k)).astype(np.float32), 4, 32, True)
        blocks = k // 32
        x = rng.standard_normal((1, k)).astype(np.float32)
        pairs = x.reshape(1, blocks * 16, 2)
        x_lo, x_hi = np.ascontiguousarray(pairs[..., 0]), np.ascontiguousarray(pairs[..., 1])
        xsum = x.reshape(1, blocks, 32).sum(axis=-1)
        scales2 = scales.reshape(n, blocks)
        zeros = np.ascontiguousarray(scales2 * 8)
        flat, out = packed.reshape(n, -1), np.empty((1, n), np.float32)
        kernel = _fastest(lambda: nbits_rows(x_lo, x_hi, xsum, flat, scales2, zeros, 0, n, out), args.blocks, args.repeats)  # noqa: B023
        want = x @ dequantize_blocks(packed, scales, None, 4, 32, k).T
        assert np.allclose(out, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))
        w = dequantize_blocks(packed, scales, None, 4, 32, k)
        with threadpool_limits(1):
            blas = _fastest(lambda: x @ w.T, args.blocks, args.repeats)  # noqa: B023
        rate = packed.nbytes / kernel / 1e9
        lines.append(f"| {n} x {k} | {packed.nbytes / 1e6:.2f} | {1e3 * kernel:.3f} | {rate:.2f} | {n * k / kernel / 1e9:.1f} | "
                     f"{100 * rate / gbs:.0f}% | {1e3 * blas:.3f} |")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    (HERE.parent / "docs" / "bench" / "nbits_kernel.md").write_text(f"# `python benchmarks/bench_nbits_kernel.py`\n\n{text}\n")


if __name__ == "__main__":
    main()
