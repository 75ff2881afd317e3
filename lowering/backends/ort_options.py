"""How an onnxruntime backend builds its sessions, as one value (imported by the registry, which offers the options as
``prepare``'s keywords, and by the backend, which builds from them; this module imports nothing of onnx)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["OrtOptions", "DEFAULT_INLINE_MAX_BYTES", "PREPACK_AUTO_MAX_BYTES", "Sizes", "packing_entry"]

Sizes = Mapping[str, int] | None

DEFAULT_INLINE_MAX_BYTES = 64 << 20
"""Weight bytes an exported model carries inline by default (``lowering.backends.ort_weights`` reads the same value)."""

PREPACK_AUTO_MAX_BYTES = 256 << 20
"""With ``prepack=None``, weights of up to this many bytes in float32 (the dtype onnxruntime's CPU kernels multiply in)
are packed: half a second or less on 2 cores."""


@dataclass(frozen=True)
class OrtOptions:
    """How an onnxruntime backend builds its sessions, defined once: the registry's ``prepare`` takes these as keyword
    arguments (the CLI routes options by that signature) and hands them on as one value.

    ``threads``: intra-op threads; ``sizes``: dim sizes for the export's planning; ``isolate``: the session in a worker
    process; ``spin``: onnxruntime's spinning intra-op threads on; ``inline_weights_max_bytes``: weights up to this many
    bytes in all serialized into the model, larger ones read from the checkpoint or handed over (``None``: any size);
    ``tf32``: TF32 MatMul on CUDA; ``cuda_graph``: the decode step captured as a CUDA graph; ``prepack``: every weight
    packed into onnxruntime's blocked GEMM layout while the session is built (``True``), or none, the products reading
    each weight as stored, memory-mapped from the checkpoint (``False``).  Packing costs 1-2 s a GB of float32
    weights on 2 cores (TinyLlama's 4.4 GB: 6.8-10.4 s to load against 1.2-2.0 s unpacked in ``bench_scale.py``) and
    then runs each step faster (a decode step 6-24% in its runs); ``None`` (default) packs weights of up to
    :data:`PREPACK_AUTO_MAX_BYTES` in float32, where it costs a fraction of a second, and leaves larger ones as stored,
    for a first token in seconds.  A long-lived session of a large model (a server) should pass ``True``
    (``docs/export.md``)."""

    threads: int | None = None
    sizes: Sizes = None
    isolate: bool = False
    spin: bool = False
    inline_weights_max_bytes: int | None = DEFAULT_INLINE_MAX_BYTES
    tf32: bool = False
    cuda_graph: bool = False
    prepack: bool | None = None
    CUDA_ONLY: ClassVar[frozenset[str]] = frozenset({"tf32", "cuda_graph"})
    """The options only the CUDA provider takes (not in ort-cpu's ``prepare``)."""


def packing_entry(prepack: bool) -> tuple[str, str]:
    """The session config entry for ``prepack``: weights packed while the session is built, on all its intra-op
    threads, or none packed (the products read each weight as stored)."""
    return ("session.prepack.enable_parallel", "1") if prepack else ("session.disable_prepacking", "1")
