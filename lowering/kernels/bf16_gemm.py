"""A prefill's bfloat16 weight products in bfloat16, where the CPU has instructions for them.

A CPU with ``amx_bf16`` or ``avx512_bf16`` multiplies bfloat16 matrices several times faster than float32 ones (on
the 2-core Xeon of the benchmarks: 1.5 TFLOP/s against 0.29 for a 512 x 2048 x 5632 product through torch).  NumPy's
BLAS has no bfloat16 GEMM, so the NumPy backend hands such products to torch's CPU kernels (oneDNN) when torch is
installed: the activations rounded to bfloat16 (as transformers' bfloat16 run has them), the weight as the checkpoint
stores it (no copy: torch reads the mapped bytes), products accumulated in float32 by the kernel and rounded to
bfloat16 once, then widened back.  Rows of fewer than :data:`MIN_ROWS` (a decode step) keep graphc's compiled kernel,
which reads the weight at the memory's speed.  ``GRAPHC_BF16_MATMUL=0`` turns this off (float32 products, as
without the instructions).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import warnings

import numpy as np

__all__ = ["MIN_ROWS", "bf16_gemm_description", "bf16_linear"]

MIN_ROWS = 17
"""Rows from which a bfloat16 weight's product runs in bfloat16 (fewer: the decode kernel)."""
_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def _torch_version() -> str | None:
    """torch's installed version, read from its metadata: torch's slow import is paid by a first product, not by a load."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def bf16_gemm_description() -> str | None:
    """What runs a prefill's bfloat16 products (``torch 2.13.0 bfloat16 GEMMs (amx_bf16)``), or None where they run in
    float32: no instructions for them, no torch, or ``GRAPHC_BF16_MATMUL=0``."""
    if os.environ.get("GRAPHC_BF16_MATMUL", "1") == "0":
        return None
    found = [f for f in _FLAGS if f in _cpu_flags()]
    version = _torch_version() if found else None
    return None if version is None else f"torch {version} bfloat16 GEMMs ({found[0]})"


def bf16_linear(x: np.ndarray, weight: np.ndarray, threads: int | None) -> np.ndarray:
    """``x [M, K] @ weight [N, K].T`` in bfloat16 on torch's kernels, as float32 ``[M, N]``; ``weight`` bfloat16."""
    import torch

    with warnings.catch_warnings():  # a mapped checkpoint is read-only: torch reads it, never writes
        warnings.simplefilter("ignore", UserWarning)
        w = torch.from_numpy(weight.view(np.uint16)).view(torch.bfloat16)
    if threads:
        torch.set_num_threads(threads)
    with torch.no_grad():
        y = torch.nn.functional.linear(torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16), w)
    return y.to(torch.float32).numpy()
