"""Quantized weights as graph math: 4- and 8-bit integers in blocks, each block with its own scale and zero point.

The layout is onnxruntime's ``MatMulNBits`` (what onnxruntime-genai's model builder and onnxruntime's
``matmul_nbits_quantizer`` write for CPUs): a weight ``W [N, K]`` is stored row by row in blocks of ``block_size``
values along ``K``, as ``uint8 [N, blocks, block_size * bits / 8]`` (4 bits: two values a byte, the low nibble
first); ``scales [N * blocks]`` (or ``[N, blocks]``) in the float dtype of the result; ``zero_points`` optional,
either ``uint8`` packed as the values are (``[N * ceil(blocks * bits / 8)]``, each row padded to a whole byte) or
float ``[N * blocks]``; without them the zero point is ``2 ** (bits - 1)`` (8 for 4 bits).  Then::

    W[n, k] = (q[n, k] - zero_point[n, k // block_size]) * scale[n, k // block_size]

- :class:`DequantizeBlocks` computes ``W`` (the reference semantics: NumPy, and any backend without a kernel);
- :class:`QuantizedGather` is ``W[ids]`` reading only the gathered rows (a quantized embedding table);
- :class:`QuantizedMatMul` is ``x @ W.T`` with ``W`` left packed: the optimizer's ``quantized_matmul`` rule makes
  one from ``einsum(x, DequantizeBlocks(...))``, the ONNX export writes it back as ``com.microsoft.MatMulNBits``
  (its ``accuracy_level`` kept) or, for runtimes without onnxruntime's contrib ops, as a standard
  ``DequantizeLinear`` of the same bytes (``UINT4``/``UINT8``, block-wise) and a ``MatMul``.

The packed bytes are never widened in the graph: the memory model counts them, and a re-export writes them as read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .dims import Dim, format_shape, normalize_dim
from .einsum_spec import EinsumSpec
from .errors import DTypeMismatchError, OpError, ShapeMismatchError
from .mapped import release_pages
from .ops import FLOAT_DTYPES, Dims, Op, TensorType, register_op

__all__ = [
    "DequantizeBlocks",
    "QuantizedMatMul",
    "QuantizedGather",
    "unpack_bits",
    "pack_bits",
    "dequantize_blocks",
    "quantize_blocks",
    "block_zero_points",
    "zero_point_rows",
    "reads_weight_rows",
]


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """The unsigned ``bits``-bit values in the bytes of ``packed`` along its last axis, the low bits first (uint8)."""
    packed = np.asarray(packed, np.uint8)
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = np.arange(per, dtype=np.uint8) * bits
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` (unsigned, < 2**bits) packed along the last axis, the low bits first; the axis padded with zeros to a
    whole byte."""
    values = np.asarray(values, np.uint8)
    if bits == 8:
        return values
    per = 8 // bits
    pad = -values.shape[-1] % per
    if pad:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], pad), np.uint8)], axis=-1)
    grouped = values.reshape(*values.shape[:-1], -1, per).astype(np.uint16)
    shifts = np.arange(per, dtype=np.uint16) * bits
    return (grouped << shifts).sum(axis=-1).astype(np.uint8)


def dequantize_blocks(
    packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int, block_size: int, k: int
) -> np.ndarray:
    """``W [N, K]`` of ``MatMulNBits``' packed ``B`` (see the module doc), in the dtype of ``scales``."""
    n, blocks = packed.shape[0], packed.shape[1]
    q = unpack_bits(packed.reshape(n, blocks, -1), bits).reshape(n, blocks, block_size).astype(np.float32)
    scale = np.asarray(scales).reshape(n, blocks, 1).astype(np.float32)
    zero = block_zero_points(zero_points, n, blocks, bits)[..., None]
    w = ((q - zero) * scale).reshape(n, blocks * block_size)[:, :k]
    return w.astype(np.asarray(scales).dtype)


def block_zero_points(zero_points: np.ndarray | None, n: int, blocks: int, bits: int) -> np.ndarray:
    """Every block's zero point as float32 ``[N, blocks]``: the default ``2**(bits-1)``, packed uint8 bytes unpacked
    (each row padded to a whole byte), or the floats given."""
    if zero_points is None:
        return np.full((n, blocks), 1 << (bits - 1), np.float32)
    rows = zero_point_rows(zero_points, n, blocks)
    return unpack_bits(rows, bits)[:, :blocks].astype(np.float32) if rows.dtype == np.uint8 else rows.astype(np.float32)


def zero_point_rows(zero_points: np.ndarray, n: int, blocks: int) -> np.ndarray:
    """Zero points one row a weight row (packed uint8 ``[N, bytes]``, or float ``[N, blocks]``), so rows can be taken."""
    z = np.asarray(zero_points)
    return z.reshape(n, -1) if z.dtype == np.uint8 else z.reshape(n, blocks)


QUANTIZE_CHUNK_BYTES = 64 << 20
"""float32 bytes of weight rows :func:`quantize_blocks` quantizes at a time."""


def quantize_blocks(
    w: np.ndarray, bits: int = 4, block_size: int = 32, symmetric: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Round-to-nearest quantization of ``W [N, K]`` in ``MatMulNBits``' layout: ``(packed, scales, zero_points)``.

    ``symmetric``: ``scale = w_e / -2**(bits-1)`` per block, ``w_e`` its value of largest size (so it maps to the
    lowest level exactly, as onnxruntime's blockwise quantizer and onnxruntime-genai's builder do: the scale may be
    negative), and the default zero point (none returned); else ``scale = (max - min) / (2**bits - 1)`` and a rounded
    zero point per block, packed.  Values round half to even.  Rows are quantized :data:`QUANTIZE_CHUNK_BYTES` of float32
    at a time, so the temporaries stay that small whatever the weight's size (a memory-mapped 150k-row table), and the
    pages of rows read from a mapped checkpoint leave the resident set once quantized."""
    n, k = np.shape(w)
    rows = max(1, QUANTIZE_CHUNK_BYTES // (4 * max(k, 1)))
    if n > rows:
        parts = [quantize_blocks(w[r : r + rows], bits, block_size, symmetric) for r in range(0, n, rows)]
        zero_points = None if symmetric else np.concatenate([p[2] for p in parts if p[2] is not None])
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), zero_points
    held, w = w, np.asarray(w, np.float32)
    blocks = -(-k // block_size)
    padded = np.zeros((n, blocks * block_size), np.float32)
    padded[:, :k] = w
    grouped = padded.reshape(n, blocks, block_size)
    top = (1 << bits) - 1
    if symmetric:  # the value of largest size maps to -2**(bits-1) exactly (onnxruntime's blockwise quantizer: a signed scale)
        extreme = np.take_along_axis(grouped, np.abs(grouped).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        scale = extreme / -(1 << (bits - 1))
        zero = np.full((n, blocks), 1 << (bits - 1), np.float32)
    else:
        lo, hi = np.minimum(grouped.min(axis=-1), 0), np.maximum(grouped.max(axis=-1), 0)
        scale = (hi - lo) / top
        zero = np.clip(np.round(-lo / np.where(scale == 0, 1, scale)), 0, top)
    safe = np.where(scale == 0, 1, scale)[..., None]
    q = np.clip(np.round(grouped / safe + zero[..., None]), 0, top).astype(np.uint8)
    packed = pack_bits(q.reshape(n, blocks, block_size), bits)
    zero_points = None if symmetric else pack_bits(zero.astype(np.uint8), bits).reshape(-1)
    release_pages(np.asarray(held))  # rows read from a mapped checkpoint leave the resident set (they stay in the page cache)
    return packed, scale.astype(np.float32).reshape(-1), zero_points


def reads_weight_rows(spec: EinsumSpec) -> bool:
    """Whether a two-operand einsum is ``x[..., K] . W[N, K] -> [..., N]``: the product ``x @ W.T`` a
    :class:`QuantizedMatMul` computes (and a linear layer's, with ``W`` stored as transformers stores it)."""
    if len(spec.inputs) != 2:
        return False
    x_term, w_term = spec.inputs
    return len(w_term) == 2 and bool(x_term) and x_term[-1] == w_term[1] and spec.output == x_term[:-1] + w_term[0] and w_term[1] not in x_term[:-1]


def _check_layout(op: str, bits: int, block_size: int, k: int) -> None:
    if bits not in (4, 8):
        raise OpError(f"{op}: bits must be 4 or 8, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise OpError(f"{op}: block_size must be a power of two >= 16 (MatMulNBits' rule), got {block_size!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OpError(f"{op}: k (the weight's input size) must be an int >= 1, got {k!r}")


def _check_level(op: str, level: int) -> None:
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 4:
        raise OpError(f"{op}: accuracy_level must be an int in 0..4, got {level!r}")


def _static_size(shape: Sequence[Dim]) -> int | None:
    """The element count of ``shape`` when every dim is known, else None."""
    dims = [normalize_dim(d) for d in shape]
    return math.prod(d for d in dims if isinstance(d, int)) if all(isinstance(d, int) for d in dims) else None


def _infer_weight(op: str, ins: Sequence[TensorType], bits: int, block_size: int, k: int) -> tuple[Dim, str]:
    """Check ``(packed, scales[, zero_points])`` against the layout; return ``N`` and the result's dtype."""
    if len(ins) not in (2, 3):
        raise OpError(f"{op}: takes the packed weight, its scales and optional zero points, got {len(ins)} operand(s)")
    packed, scales = ins[0], ins[1]
    blocks = -(-k // block_size)
    blob = block_size * bits // 8
    if packed.dtype != "uint8" or packed.rank != 3 or normalize_dim(packed.shape[1]) != blocks or normalize_dim(packed.shape[2]) != blob:
        raise ShapeMismatchError(
            f"{op}: the packed weight must be uint8 [N, {blocks}, {blob}] for K={k}, block_size={block_size}, bits={bits}; "
            f"got {packed.dtype}{format_shape(packed.shape)}"
        )
    n = packed.shape[0]
    if scales.dtype not in FLOAT_DTYPES:
        raise DTypeMismatchError(f"{op}: scales must be float, got {scales.dtype}")
    count = _static_size(scales.shape)
    if isinstance(n, int) and count is not None and count != n * blocks:
        raise ShapeMismatchError(f"{op}: scales hold {count} values, the weight has {n} x {blocks} blocks")
    if len(ins) == 3:
        zero = ins[2]
        width = -(-blocks * bits // 8)
        zcount = _static_size(zero.shape)
        if zero.dtype == "uint8":
            if isinstance(n, int) and zcount is not None and zcount != n * width:
                raise ShapeMismatchError(f"{op}: packed zero points hold {zcount} bytes, the weight needs {n} x {width}")
        elif zero.dtype != scales.dtype:
            raise DTypeMismatchError(f"{op}: zero points must be uint8 (packed) or {scales.dtype} like the scales, got {zero.dtype}")
    return n, scales.dtype


@dataclass(frozen=True)
class _BlockwiseProduct(Op):
    """What the ops over a packed weight share: its layout (``bits``, ``block_size``, ``k``), onnxruntime's
    ``accuracy_level`` for its product, and how many operands they take."""

    bits: int
    block_size: int
    k: int
    accuracy_level: int = 0
    arity: ClassVar[int | None] = None
    operand_counts: ClassVar[tuple[int, int]] = (2, 3)
    operand_names: ClassVar[str] = "packed, scales[, zero_points]"
    folds: ClassVar[bool] = False  # the weight stays packed: never folded into its float values

    def __post_init__(self) -> None:
        _check_layout(self.kind, self.bits, self.block_size, self.k)
        _check_level(self.kind, self.accuracy_level)

    def check_arity(self, n: int) -> None:
        if n not in self.operand_counts:
            raise OpError(f"{self.kind}: takes {self.operand_counts[0]} or {self.operand_counts[1]} operands ({self.operand_names}), got {n}")


@register_op
@dataclass(frozen=True)
class DequantizeBlocks(_BlockwiseProduct):
    """``W [N, K]`` from ``MatMulNBits``' packed weight, scales and optional zero points (see the module doc);
    ``accuracy_level``: the one the weight's product asks onnxruntime for (kept for :class:`QuantizedMatMul`)."""

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        n, dtype = _infer_weight("DequantizeBlocks", ins, self.bits, self.block_size, self.k)
        return TensorType((n, self.k), dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        zero = args[2] if len(args) == 3 else None
        return dequantize_blocks(args[0], args[1], zero, self.bits, self.block_size, self.k)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Two per weight (subtract the zero point, scale)."""
        return 2 * math.prod(out_shapes[0])


@register_op
@dataclass(frozen=True)
class QuantizedMatMul(_BlockwiseProduct):
    """``x [..., K] @ W.T -> [..., N]`` with ``W`` kept packed (``MatMulNBits``); operands ``x, packed, scales[,
    zero_points]``.  ``accuracy_level`` is onnxruntime's (0: as the inputs, 4: activations quantized to int8)."""

    operand_counts: ClassVar[tuple[int, int]] = (3, 4)
    operand_names: ClassVar[str] = "x, packed, scales[, zero_points]"

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        x = ins[0]
        n, dtype = _infer_weight("QuantizedMatMul", ins[1:], self.bits, self.block_size, self.k)
        if x.rank < 1 or normalize_dim(x.shape[-1]) != self.k:
            raise ShapeMismatchError(f"QuantizedMatMul: x {format_shape(x.shape)} must end in K={self.k}")
        if x.dtype != dtype:
            raise DTypeMismatchError(f"QuantizedMatMul: x is {x.dtype}, the scales {dtype}; they must match")
        return TensorType((*x.shape[:-1], n), dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        zero = args[3] if len(args) == 4 else None
        w = dequantize_blocks(args[1], args[2], zero, self.bits, self.block_size, self.k)
        compute = np.float64 if args[0].dtype == np.float64 else np.float32
        return np.matmul(args[0].astype(compute), w.astype(compute).T).astype(args[0].dtype)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """A multiply-add per weight per row of ``x``."""
        return 2 * math.prod(out_shapes[0]) * self.k


@register_op
@dataclass(frozen=True)
class QuantizedGather(Op):
    """Rows of a packed table, dequantized: ``table[ids]`` for ``table [V, K]`` in ``MatMulNBits``' layout (operands
    ``packed [V, blocks, blob], ids, scales[, zero_points]``) -> ``[*ids.shape, K]``; only the gathered rows are read
    (onnxruntime's ``GatherBlockQuantized``: a quantized embedding table, tied to the LM head or not).  Ids count from
    the end when negative and must lie in ``[-V, V)``, as ``Gather``'s."""

    bits: int
    block_size: int
    k: int
    arity: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        _check_layout("QuantizedGather", self.bits, self.block_size, self.k)

    def check_arity(self, n: int) -> None:
        if n not in (3, 4):
            raise OpError(f"QuantizedGather: takes 3 or 4 operands (packed, ids, scales[, zero_points]), got {n}")

    def infer(self, ins: Sequence[TensorType]) -> TensorType:
        ids = ins[1]
        if ids.dtype not in ("int32", "int64"):
            raise DTypeMismatchError(f"QuantizedGather: ids must be int32 or int64, got {ids.dtype}")
        _, dtype = _infer_weight("QuantizedGather", [ins[0], *ins[2:]], self.bits, self.block_size, self.k)
        return TensorType((*ids.shape, self.k), dtype)

    def evaluate(self, args: Sequence[np.ndarray], dims: Dims) -> np.ndarray:
        packed, ids, scales = args[0], np.asarray(args[1]), np.asarray(args[2])
        rows, blocks = packed.shape[0], packed.shape[1]
        if ids.size and (ids.min() < -rows or ids.max() >= rows):
            raise OpError(f"QuantizedGather: ids span {int(ids.min())}..{int(ids.max())}, outside [-{rows}, {rows}) of the table's rows")
        flat = np.where(ids < 0, ids + rows, ids).reshape(-1)
        zero = zero_point_rows(args[3], rows, blocks)[flat] if len(args) == 4 else None
        w = dequantize_blocks(packed[flat], scales.reshape(rows, blocks)[flat], zero, self.bits, self.block_size, self.k)
        return w.reshape(*ids.shape, self.k)

    def flops(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> int:
        """Two per value read."""
        return 2 * math.prod(out_shapes[0])
