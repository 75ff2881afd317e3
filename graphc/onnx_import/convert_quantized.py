"""Quantized ONNX ops as graphc's quantized graph math (:mod:`graphc.quantized`), the packed bytes kept as read.

- ``com.microsoft.MatMulNBits`` (onnxruntime-genai's int4 models, onnxruntime's ``matmul_nbits_quantizer``): ``A [..., K]``
  times ``B`` packed ``[N, blocks, blob]`` with ``scales`` and optional ``zero_points`` and ``bias``, as
  ``einsum(A, DequantizeBlocks(B, scales[, zero_points]))`` (+ bias); the optimizer fuses it back into one
  :class:`~graphc.quantized.QuantizedMatMul`, so attention is recognised through the projections and the export
  writes ``MatMulNBits`` again.  4 and 8 bits, any block size, with or without zero points (packed uint8 or float);
  ``accuracy_level`` is kept.  A ``g_idx`` that is not the blocks in order (act-order GPTQ) is refused by name.
"""

from __future__ import annotations

import numpy as np

from ..ops import Binary, Einsum
from ..quantized import DequantizeBlocks
from .context import ImportContext, simplify
from .convert_core import Converter

__all__ = ["QUANTIZED_CONVERTERS"]

LETTERS = "abcdefghij"


def _matmul_nbits(ctx: ImportContext, ins: list, attrs: dict) -> list:
    k, n = int(attrs["K"]), int(attrs["N"])
    bits, block_size = int(attrs.get("bits", 4)), int(attrs["block_size"])
    level = int(attrs.get("accuracy_level", 0))
    a = ctx.tensor(ins[0], "MatMulNBits input A")
    packed, scales = (ctx.known(ins[i], f"MatMulNBits {what}") for i, what in ((1, "B"), (2, "scales")))
    if packed.dtype != np.uint8:
        raise ctx.error(f"MatMulNBits B must be uint8 (packed {bits}-bit values), got {packed.dtype}")
    blocks = -(-k // block_size)
    blob = block_size * bits // 8
    if packed.size != n * blocks * blob:
        raise ctx.error(f"MatMulNBits B holds {packed.size} bytes; N={n}, K={k}, bits={bits}, block_size={block_size} need {n} x {blocks} x {blob}")
    operands = [ctx.constant(packed.reshape(n, blocks, blob), "B", quantized=True), ctx.tensor(np.asarray(scales), "scales")]
    zero = simplify(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    if zero is not None:
        zero = ctx.known(zero, "MatMulNBits zero_points")
        operands.append(ctx.constant(zero, "zero_points", quantized=True) if zero.dtype == np.uint8 else ctx.tensor(zero, "zero_points"))
    g_idx = simplify(ins[4]) if len(ins) > 4 and ins[4] is not None else None
    if g_idx is not None:
        order = np.arange(k) // block_size
        if not (isinstance(g_idx, np.ndarray) and g_idx.size == k and np.array_equal(g_idx.reshape(-1), order)):
            raise ctx.error("MatMulNBits g_idx reorders the blocks (act-order GPTQ); graphc reads weights whose blocks are in order")
    weight = ctx.add(DequantizeBlocks(bits, block_size, k, level), operands, "dequantized")
    rank = ctx.graph.types[a].rank
    batch = LETTERS[: rank - 1]
    y = ctx.add(Einsum(f"{batch}k,nk->{batch}n"), [a, weight], "matmul_nbits")
    bias = ins[5] if len(ins) > 5 else None
    if bias is not None:
        y = ctx.add(Binary("add"), [y, ctx.tensor(bias, "bias")], "matmul_nbits_bias")
    return [y]


QUANTIZED_CONVERTERS: dict[tuple[str, str], Converter] = {("com.microsoft", "MatMulNBits"): _matmul_nbits}
"""Quantized-op converters by (domain, op type)."""
