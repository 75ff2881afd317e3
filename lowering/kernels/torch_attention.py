"""A prefill's attention core on graphc's kernel or torch's SDPA, whichever this machine runs faster.

graphc's row-blocked kernel (:mod:`lowering.kernels.attention_kernel`) is a GEMM, a masked softmax and a GEMM per
block, on NumPy's BLAS and ufuncs; torch's ``scaled_dot_product_attention`` is a fused flash kernel.  Which is faster
depends on the machine, not only on its instructions: on one 2-core AMD EPYC with AVX-512 graphc's kernel took 0.47x
torch's time for a 1024-token causal prefill at mistral-7b's shape, on a 2-core Intel Xeon with AVX-512 1.5x, and held
to AVX2 1.2x (``benchmarks/bench_speed.py``, ``--avx2``; docs/export.md has the runs).  So the
NumPy backend times both on a plain prefill's first calls of each shape and keeps the faster
(:class:`~lowering.kernels.thread_choice.TimedChoice`: a layer's attention repeats layer after layer, so the choice is
made within the first prefill and tried again now and then), once torch is loaded in the process (by a bfloat16
model's products, or by the caller; importing it for this would put torch's import into a first prefill). A plain
prefill: no user mask, no window, no softcap, a causal mask aligned at key 0 or none, :data:`MIN_QUERY_ROWS` queries
or more, float32; anything else, and every call without torch, runs graphc's kernel. ``GRAPHC_TORCH_ATTENTION=1``
sends every plain prefill to torch, ``0`` none.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Callable

import numpy as np

from graphc.visibility import Visibility

from .thread_choice import TimedChoice

__all__ = ["MIN_QUERY_ROWS", "attention_on_the_faster_kernel", "plain_prefill", "torch_attention"]

MIN_QUERY_ROWS = 64
"""Queries from which a prefill's attention may go to torch (decode and short chunks stay on graphc's kernels)."""


_KERNELS: TimedChoice[str] = TimedChoice(("graphc", "torch"))


def plain_prefill(q: np.ndarray, k: np.ndarray, visibility: Visibility, softcap: float | None) -> bool:
    """True for an attention call torch's SDPA computes as graphc does: a plain float32 prefill (see the module doc)."""
    if softcap is not None or visibility.has_mask or visibility.window is not None or q.dtype != np.float32:
        return False
    if visibility.causal_offset is not None and visibility.causal_offset != 0:  # SDPA's causal mask starts at key 0
        return False
    causal_fits = visibility.causal_offset is None or k.shape[-2] >= q.shape[-2]  # non-causal: query rows may hold a folded group
    return q.shape[-2] >= MIN_QUERY_ROWS and causal_fits


def attention_on_the_faster_kernel(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    visibility: Visibility,
    softcap: float | None,
    threads: int | None,
    graphcs: Callable[[], np.ndarray],
) -> np.ndarray:
    """``graphcs()`` (graphc's kernel on these operands) or :func:`torch_attention`, as the module doc says."""
    setting = os.environ.get("GRAPHC_TORCH_ATTENTION", "auto").strip().lower()
    # torch loaded already (a bfloat16 model's products, the caller's own import): importing it here would put torch's
    # import into the first prefill, which costs more than the attention it might save
    loaded = "torch" in sys.modules if setting != "1" else importlib.util.find_spec("torch") is not None
    if setting == "0" or not loaded or not plain_prefill(q, k, visibility, softcap):
        return graphcs()

    def run(kernel: str) -> np.ndarray:
        return torch_attention(q, k, v, visibility.is_causal, threads) if kernel == "torch" else graphcs()

    if setting == "1":
        return run("torch")
    return _KERNELS.timed(("attention", q.shape, k.shape, q.dtype.str, visibility.is_causal), run)


def torch_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, threads: int | None) -> np.ndarray:
    """``softmax(q k^T [causal]) v`` on torch's SDPA for ``q [B, Hq, S, D]`` (already scaled), ``k``/``v [B, Hkv, T, D]``;
    query head ``h`` reads KV head ``h // (Hq // Hkv)``.  Without a causal mask, query rows that hold a folded group
    (``S`` a multiple of ``T``) are handed over as that many heads of ``T`` rows each, the shape torch's kernel is fast on."""
    import torch

    b, hq, rows, d = q.shape
    folds = rows // k.shape[2] if not causal and k.shape[2] and rows > k.shape[2] and rows % k.shape[2] == 0 else 1
    with warnings.catch_warnings():  # a KV cache's buffer may be read-only: torch reads it, never writes
        warnings.simplefilter("ignore", UserWarning)
        tq, tk, tv = (torch.from_numpy(a) for a in (q.reshape(b, hq * folds, rows // folds, d), k, v))
    if threads:
        torch.set_num_threads(threads)
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=1.0, enable_gqa=tq.shape[1] != tk.shape[1])
    return out.numpy().reshape(b, hq, rows, v.shape[-1])
