"""Quantized ONNX ops as graphc's quantized graph math (:mod:`graphc.quantized`), the packed bytes kept as read.

- ``com.microsoft.MatMulNBits`` (onnxruntime-genai's int4 models, onnxruntime's ``matmul_nbits_quantizer``): ``A [..., K]``
  times ``B`` packed ``[N, blocks, blob]`` with ``scales`` and optional ``zero_points`` and ``bias``, as
  ``einsum(A, DequantizeBlocks(B, scales[, zero_points]))`` (+ bias); the optimizer fuses it back into one
  :class:`~graphc.quantized.QuantizedMatMul`, so attention is recognised through the projections and the export
  writes ``MatMulNBits`` again.  4 and 8 bits, any block size, with or without zero points (packed uint8 or float);
  ``accuracy_level`` is kept.  A ``g_idx`` that is not the blocks in order (act-order GPTQ) is refused by name.
- ``com.microsoft.GatherBlockQuantized`` (onnxruntime-genai's quantized embedding table, tied to the LM head or not):
  :class:`~graphc.quantized.QuantizedGather`, the table in the same block layout, only the gathered rows read.
- ``QuantizeLinear`` / ``DequantizeLinear`` pairs of 8-bit data (``quantize_static``'s QDQ files) as
  :class:`~graphc.quantized_int8.Quantize` / :class:`~graphc.quantized_int8.Dequantize`.
- ``DequantizeLinear`` of a 4-bit (``INT4``/``UINT4``) weight in blocks along either axis (``matmul_nbits_quantizer``'s
  QDQ format, graphc's own ``quantized="qdq"`` export) as :class:`~graphc.quantized.DequantizeBlocks` of the same
  values packed in its layout (a signed value ``v`` held as ``v + 8`` with its zero point, so nothing is widened),
  fused with the product that reads it as the ``MatMulNBits`` case is.
- ``DynamicQuantizeLinear`` and ``MatMulInteger`` (onnxruntime's ``quantize_dynamic``, optimum's int8 export) as
  :class:`~graphc.quantized_int8.DynamicQuantize` and :class:`~graphc.quantized_int8.IntegerMatMul`, the 8-bit weight
  and its zero point kept as the file holds them.
- ``com.microsoft.DynamicQuantizeMatMul`` and ``com.microsoft.MatMulIntegerToFloat`` (what onnxruntime's graph
  optimizer makes of those pairs, in the files it saves): the same two ops, the product's ``Cast`` to float, the
  scales' product and the bias, so the re-export writes standard ONNX that any runtime reads.
"""

from __future__ import annotations

import numpy as np

from ..ops import QUANTIZED_DTYPES, Binary, Cast, Einsum, Transpose
from ..quantized import DequantizeBlocks, QuantizedGather, pack_bits
from ..quantized_int8 import Dequantize, DynamicQuantize, IntegerMatMul, Quantize
from .context import ImportContext, simplify
from .convert_core import Converter

__all__ = ["QUANTIZED_CONVERTERS"]

LETTERS = "abcdefghij"
FOUR_BIT_DTYPES = ("int4", "uint4")
"""ONNX's 4-bit types as NumPy reads them (``ml_dtypes``), one value a byte; graphc holds them packed."""


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
    operands = [ctx.constant(packed.reshape(n, blocks, blob), "B"), ctx.tensor(np.asarray(scales), "scales")]
    if len(ins) > 3 and ins[3] is not None:
        operands.append(ctx.tensor(ctx.known(ins[3], "MatMulNBits zero_points"), "zero_points"))
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


def _gather_block_quantized(ctx: ImportContext, ins: list, attrs: dict) -> list:
    bits, block_size = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    data = ctx.known(ins[0], "GatherBlockQuantized data")
    if data.dtype != np.uint8 or data.ndim != 2:
        raise ctx.error(f"GatherBlockQuantized data must be a uint8 table [rows, packed columns], got {data.dtype}{list(data.shape)}")
    if int(attrs.get("gather_axis", 0)) != 0 or int(attrs.get("quantize_axis", 1)) not in (1, -1):
        raise ctx.error("GatherBlockQuantized: graphc reads a table gathered on axis 0 and quantized along its last axis (an embedding table)")
    rows, k = data.shape[0], data.shape[1] * 8 // bits
    if k % block_size:
        raise ctx.error(f"GatherBlockQuantized: {k} columns are not whole blocks of {block_size}")
    blocks = k // block_size
    operands = [ctx.constant(data.reshape(rows, blocks, block_size * bits // 8), "data"), ctx.tensor(ins[1], "indices")]
    operands.append(ctx.tensor(ctx.known(ins[2], "GatherBlockQuantized scales"), "scales"))
    if len(ins) > 3 and ins[3] is not None:
        operands.append(ctx.tensor(ctx.known(ins[3], "GatherBlockQuantized zero_points"), "zero_points"))
    return [ctx.add(QuantizedGather(bits, block_size, k), operands, "gathered")]


def _dynamic_quantize(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0], "DynamicQuantizeLinear input")
    names = [ctx.graph.fresh_name(f"{x}_{part}") for part in ("quantized", "scale", "zero_point")]
    return [v.name for v in ctx.graph.add_multi_node(DynamicQuantize(), [x], names)]


def _matmul_integer(ctx: ImportContext, ins: list, attrs: dict) -> list:
    operands = [ctx.tensor(v, what) for v, what in zip(ins, ("A", "B", "a_zero_point", "b_zero_point")) if v is not None]
    if len(ins) > 3 and ins[2] is None and ins[3] is not None:
        operands.insert(2, ctx.constant(np.zeros((), ctx.graph.types[operands[0]].dtype), "a_zero_point"))
    return [ctx.add(IntegerMatMul(), operands, "matmul_integer")]


def _integer_product_to_float(ctx: ImportContext, a: str, a_scale: str, a_zero: str | None, ins: list, op_type: str) -> str:
    """``Cast(MatMulInteger(a, B, a_zero, b_zero), float) * (a_scale * b_scale) + bias``, with ``ins`` holding ``B,
    b_scale, b_zero_point, bias`` (the last two optional)."""
    b, b_scale, b_zero, bias = (ins + [None] * 4)[:4]
    zeros = [a_zero if a_zero is not None else ctx.constant(np.zeros((), ctx.graph.types[a].dtype), "a_zero_point")]
    zeros += [ctx.tensor(b_zero, f"{op_type} b_zero_point")] if b_zero is not None else []
    product = ctx.add(IntegerMatMul(), [a, ctx.tensor(b, f"{op_type} B"), *zeros], "matmul_integer")
    scale = ctx.add(Binary("mul"), [a_scale, ctx.tensor(b_scale, f"{op_type} b_scale")], "product_scale")
    dtype = ctx.graph.types[scale].dtype
    y = ctx.add(Binary("mul"), [ctx.add(Cast(dtype), [product], "product_float"), scale], op_type.lower())
    return y if bias is None else ctx.add(Binary("add"), [y, ctx.tensor(bias, f"{op_type} bias")], f"{op_type.lower()}_bias")


def _dynamic_quantize_matmul(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """``DynamicQuantizeMatMul(A, B, b_scale, b_zero_point?, bias?)``: ``A`` quantized as ``DynamicQuantizeLinear`` does."""
    quantized, scale, zero = _dynamic_quantize(ctx, ins[:1], {})
    return [_integer_product_to_float(ctx, quantized, scale, zero, list(ins[1:]), "DynamicQuantizeMatMul")]


def _matmul_integer_to_float(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """``MatMulIntegerToFloat(A, B, a_scale, b_scale, a_zero_point?, b_zero_point?, bias?)``."""
    padded = list(ins) + [None] * (7 - len(ins))
    a = ctx.tensor(padded[0], "MatMulIntegerToFloat A")
    a_zero = ctx.tensor(padded[4], "MatMulIntegerToFloat a_zero_point") if padded[4] is not None else None
    a_scale = ctx.tensor(padded[2], "MatMulIntegerToFloat a_scale")
    return [_integer_product_to_float(ctx, a, a_scale, a_zero, [padded[1], padded[3], padded[5], padded[6]], "MatMulIntegerToFloat")]


def _dequantize_four_bits(ctx: ImportContext, data: np.ndarray, ins: list, attrs: dict) -> str:
    """A block-wise ``DequantizeLinear`` of a 4-bit ``[rows, cols]`` constant as ``DequantizeBlocks`` over the axis the
    blocks run along (transposed back where that is axis 0)."""
    axis, block_size = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
    if data.ndim != 2 or axis not in (0, 1, -1, -2) or not block_size:
        raise ctx.error(f"DequantizeLinear of 4-bit data {list(data.shape)} (axis {axis}, block_size {block_size}): graphc reads a 4-bit "
                        "weight matrix in blocks along one axis")  # fmt: skip
    along_rows = axis % 2 == 0  # blocks run down the columns: W [K, N] as matmul_nbits_quantizer's QDQ format holds it
    values = data.astype(np.int16).T if along_rows else data.astype(np.int16)
    scales = ctx.known(ins[1], "DequantizeLinear x_scale")
    zero = ctx.known(ins[2], "DequantizeLinear x_zero_point").astype(np.int16) if len(ins) > 2 and ins[2] is not None else None
    if along_rows:
        scales, zero = scales.T, (zero.T if zero is not None else None)
    n, k = values.shape
    blocks = -(-k // block_size)
    if scales.shape != (n, blocks) or (zero is not None and zero.shape != (n, blocks)):
        raise ctx.error(f"DequantizeLinear: 4-bit data {list(data.shape)} in blocks of {block_size} takes scales (and zero points) of "
                        f"{blocks} block(s) along axis {axis}, got {list(scales.shape)}")  # fmt: skip
    if str(data.dtype) == "int4":  # signed nibbles as MatMulNBits' unsigned ones: v + 8, the zero point likewise (default 8)
        values, zero = values + 8, (zero + 8 if zero is not None else None)
    elif zero is None:
        zero = np.zeros((n, blocks), np.int16)  # ONNX's default zero point for unsigned data is 0, MatMulNBits' is 8
    padded = np.zeros((n, blocks * block_size), np.uint8)
    padded[:, :k] = values
    operands = [ctx.constant(pack_bits(padded.reshape(n, blocks, block_size), 4), "B")]
    operands.append(ctx.tensor(np.ascontiguousarray(scales).reshape(-1), "scales"))
    if zero is not None:
        operands.append(ctx.constant(pack_bits(zero.astype(np.uint8), 4).reshape(-1), "zero_points"))
    weight = ctx.add(DequantizeBlocks(4, block_size, k, 0), operands, "dequantized")
    return ctx.add(Transpose((1, 0)), [weight], "dequantized_t") if along_rows else weight


def _dequantize_linear(ctx: ImportContext, ins: list, attrs: dict) -> list:
    data = simplify(ins[0])
    if isinstance(data, np.ndarray) and str(data.dtype) in FOUR_BIT_DTYPES:
        return [_dequantize_four_bits(ctx, data, ins, attrs)]
    x = ctx.tensor(ins[0], "DequantizeLinear input")
    if ctx.graph.types[x].dtype not in (*QUANTIZED_DTYPES, "int32"):
        raise ctx.error(f"DequantizeLinear of {ctx.graph.types[x].dtype} data: graphc reads 8-bit (int8/uint8) and int32 data and 4-bit weights")
    operands = [x, ctx.tensor(ins[1], "x_scale")] + ([ctx.tensor(ins[2], "x_zero_point")] if len(ins) > 2 and ins[2] is not None else [])
    return [ctx.add(Dequantize(int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))), operands, "dequantized")]


def _quantize_linear(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0], "QuantizeLinear input")
    zero = ctx.tensor(ins[2], "y_zero_point") if len(ins) > 2 and ins[2] is not None else None
    dtype = ctx.graph.types[zero].dtype if zero is not None else {2: "uint8", 3: "int8"}.get(int(attrs.get("output_dtype", 2)))
    if dtype not in QUANTIZED_DTYPES:
        raise ctx.error(f"QuantizeLinear to {dtype}: graphc quantizes to int8 or uint8 (per tensor, per axis or in blocks)")
    operands = [x, ctx.tensor(ins[1], "y_scale")] + ([zero] if zero is not None else [])
    return [ctx.add(Quantize(dtype, int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))), operands, "quantized")]


QUANTIZED_CONVERTERS: dict[tuple[str, str], Converter] = {
    ("", "QuantizeLinear"): _quantize_linear,
    ("com.microsoft", "GatherBlockQuantized"): _gather_block_quantized,
    ("", "DequantizeLinear"): _dequantize_linear,
    ("com.microsoft", "MatMulNBits"): _matmul_nbits,
    ("", "DynamicQuantizeLinear"): _dynamic_quantize,
    ("", "MatMulInteger"): _matmul_integer,
    ("com.microsoft", "DynamicQuantizeMatMul"): _dynamic_quantize_matmul,
    ("com.microsoft", "MatMulIntegerToFloat"): _matmul_integer_to_float,
}
"""Quantized-op converters by (domain, op type)."""
