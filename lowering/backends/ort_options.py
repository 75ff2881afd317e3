"""How an onnxruntime backend builds its sessions, as one value (imported by the registry, which offers the options as
``prepare``'s keywords, and by the backend, which builds from them; this module imports nothing of onnx)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["OrtOptions", "DEFAULT_INLINE_MAX_BYTES", "Sizes"]

Sizes = Mapping[str, int] | None

DEFAULT_INLINE_MAX_BYTES = 64 << 20
"""Weight bytes an exported model carries inline by default (``lowering.backends.ort_weights`` reads the same value)."""


@dataclass(frozen=True)
class OrtOptions:
    """How an onnxruntime backend builds its sessions, defined once: the registry's ``prepare`` takes these as keyword
    arguments (the CLI routes options by that signature) and hands them on as one value.

    ``threads``: intra-op threads; ``sizes``: dim sizes for the export's planning; ``isolate``: the session in a worker
    process; ``spin``: onnxruntime's spinning intra-op threads on; ``inline_weights_max_bytes``: weights up to this many
    bytes in all serialized into the model, larger ones read from the checkpoint or handed over (``None``: any size);
    ``tf32``: TF32 MatMul on CUDA; ``cuda_graph``: the decode step captured as a CUDA graph."""

    threads: int | None = None
    sizes: Sizes = None
    isolate: bool = False
    spin: bool = False
    inline_weights_max_bytes: int | None = DEFAULT_INLINE_MAX_BYTES
    tf32: bool = False
    cuda_graph: bool = False
    CUDA_ONLY: ClassVar[frozenset[str]] = frozenset({"tf32", "cuda_graph"})
    """The options only the CUDA provider takes (not in ort-cpu's ``prepare``)."""
