"""Checkpoints quantized before graphc reads them: AWQ and GPTQ safetensors, as transformers holds them.

A checkpoint whose ``config.json`` has a ``quantization_config`` of ``quant_method`` ``"awq"`` (AutoAWQ's ``gemm``
layout) or ``"gptq"`` (AutoGPTQ's and GPTQModel's ``gptq`` / ``gptq_v2`` layouts) stores each quantized linear layer
``X`` as integers packed into int32 words, with a float scale and an integer zero point per group of ``group_size``
input features::

    X.qweight  int32      GPTQ: [K / per, N], values along K;  AWQ: [K, N / per], values along N in the order 0 2 4 6 1 3 5 7
    X.qzeros   int32      [groups, N / per] (along N; AWQ in its order; GPTQ's ``gptq`` layout holds zero - 1)
    X.scales   float      [groups, N]
    X.g_idx    int32 [K]  (GPTQ) the group of each input feature

    W[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]        (per = 32 / bits values a word, the low bits first)

:func:`read_prequantized` repacks each layer's integers into ``MatMulNBits``' layout (:mod:`graphc.quantized`:
``[N, blocks, block_size * bits / 8]``, blocks of ``group_size`` along ``K``) with integer operations only, never
through float weights, and gives the builder a stand-in for ``X.weight``: a read-only ``[N, K]`` view of ``N``
numbers (no memory of its own) that the family's builder places as it places any weight, row slices included (a
fused ``qkv_proj`` split into Q, K and V).  :func:`apply_prequantized` then reads every stand-in in the built graph
as ``DequantizeBlocks`` of its rows' packed bytes, which :func:`graphc.optimize` fuses into
:class:`~graphc.quantized.QuantizedMatMul`.  A stand-in the builder copied or read other than as a linear layer's
weight is refused by name, as are act-order GPTQ (groups out of order), AWQ layouts other than ``gemm``, and other
quantization methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import WeightError
from .graph import Graph
from .ops import Einsum
from .quantized import DequantizeBlocks, pack_bits, reads_weight_rows

__all__ = ["PrequantizedLayout", "PackedLinear", "prequantized_layout", "read_prequantized", "apply_prequantized", "PREQUANTIZED_METHODS"]

PREQUANTIZED_METHODS = ("awq", "gptq")
"""The ``quantization_config.quant_method`` values graphc reads."""

_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
"""AutoAWQ's ``gemm`` layout: the word's value ``i`` belongs to column ``8 c + _AWQ_ORDER[i]`` of its group of 8."""


@dataclass(frozen=True)
class PrequantizedLayout:
    """How a checkpoint's linear layers were quantized: ``method`` (``awq`` / ``gptq``), ``bits``, ``group_size``
    (``-1``: one group for all of ``K``) and, for GPTQ, whether its zero points are stored less one (the ``gptq``
    checkpoint format; ``gptq_v2`` stores them as they are)."""

    method: str
    bits: int
    group_size: int
    zeros_less_one: bool = False


@dataclass(frozen=True)
class PackedLinear:
    """One layer's weight ``W [N, K]`` in ``MatMulNBits``' layout (see :mod:`graphc.quantized`)."""

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    bits: int
    block_size: int
    k: int


def prequantized_layout(config: Mapping[str, Any]) -> PrequantizedLayout | None:
    """The layout ``config["quantization_config"]`` describes, None without one; a method or layout graphc does not
    read is refused by name."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise WeightError(f"config.json: quantization_config must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method not in PREQUANTIZED_METHODS:
        methods = ", ".join(PREQUANTIZED_METHODS)
        raise WeightError(f"config.json: quant_method {q.get('quant_method')!r}: graphc reads AWQ and GPTQ checkpoints ({methods})")
    bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
    if bits not in ((4,) if method == "awq" else (4, 8)) or not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise WeightError(f"config.json: {method} with bits {bits!r} and group_size {group!r}: graphc reads 4-bit AWQ and 4- or 8-bit GPTQ")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise WeightError(f"config.json: AWQ version {q.get('version')!r}: graphc reads AutoAWQ's gemm layout")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise WeightError(f"config.json: GPTQ checkpoint_format {fmt!r}: graphc reads 'gptq' and 'gptq_v2'")
    return PrequantizedLayout(method, int(bits), int(group), zeros_less_one=method == "gptq" and fmt == "gptq")


def read_prequantized(
    layout: PrequantizedLayout, weights: Mapping[str, Any], dtype: str | None = None
) -> tuple[dict[str, Any], dict[str, PackedLinear]]:
    """``weights`` with each quantized layer's tensors replaced by a stand-in ``X.weight`` (in ``dtype``, default the
    scales'), and each layer's packed weight by the stand-in's name."""
    out = {name: value for name, value in weights.items() if not name.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    packed: dict[str, PackedLinear] = {}
    for name in weights:
        if not name.endswith(".qweight"):
            continue
        layer = name[: -len(".qweight")]
        linear = _repack(layout, layer, weights)
        n = linear.packed.shape[0]
        stand_in = np.broadcast_to(np.zeros(n, dtype or linear.scales.dtype)[:, None], (n, linear.k))
        out[f"{layer}.weight"] = stand_in
        packed[f"{layer}.weight"] = linear
    if not packed:
        raise WeightError(f"config.json says the checkpoint is {layout.method.upper()}-quantized, but it holds no *.qweight tensor")
    return out, packed


def _tensor(weights: Mapping[str, Any], name: str, dtype: Any = None) -> np.ndarray:
    if name not in weights:
        raise WeightError(f"the checkpoint has {name.rsplit('.', 1)[0]}.qweight but no {name}")
    arr = np.asarray(weights[name])
    if dtype is not None and arr.dtype != dtype:
        raise WeightError(f"{name} is {arr.dtype}, expected {np.dtype(dtype)}")
    return arr


def _unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """The unsigned ``bits``-bit values of int32 ``words [..., W]`` as uint8 ``[..., W * 32 / bits]``, the low bits first."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    values = (words.view(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return values.astype(np.uint8).reshape(*words.shape[:-1], words.shape[-1] * per)


def _repack(layout: PrequantizedLayout, layer: str, weights: Mapping[str, Any]) -> PackedLinear:
    """Layer ``layer``'s AWQ / GPTQ tensors as :class:`PackedLinear` (integer operations only)."""
    bits, per = layout.bits, 32 // layout.bits
    qweight, qzeros = _tensor(weights, f"{layer}.qweight", np.int32), _tensor(weights, f"{layer}.qzeros", np.int32)
    scales = _tensor(weights, f"{layer}.scales")
    if scales.dtype.kind != "f" and str(scales.dtype) != "bfloat16":
        raise WeightError(f"{layer}.scales is {scales.dtype}, expected a float dtype")
    if layout.method == "awq":  # [K, N / 8] along N in AWQ's order
        k, n = qweight.shape[0], qweight.shape[1] * per
        reorder = (np.arange(n).reshape(-1, per)[:, np.argsort(_AWQ_ORDER)]).reshape(-1)
        q = _unpack_words(qweight, bits)[:, reorder].T  # [N, K]
        zeros = _unpack_words(qzeros, bits)[:, reorder]  # [groups, N]
    else:  # [K / per, N] along K
        k, n = qweight.shape[0] * per, qweight.shape[1]
        q = _unpack_words(np.ascontiguousarray(qweight.T), bits)  # [N, K]
        zeros = _unpack_words(qzeros, bits)[:, :n]
        if layout.zeros_less_one:  # AutoGPTQ's stored zero - 1, read back as it reads it: (z + 1) mod 2**bits
            zeros = ((zeros.astype(np.uint16) + 1) & ((1 << bits) - 1)).astype(np.uint8)
    group = k if layout.group_size == -1 else layout.group_size
    groups = -(-k // group)
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise WeightError(f"{layer}: qweight holds a [{n}, {k}] weight; scales {list(scales.shape)} and qzeros {list(zeros.shape)} "
                          f"must hold {groups} group(s) of {group} x {n}")  # fmt: skip
    if f"{layer}.g_idx" in weights:
        g_idx = np.asarray(weights[f"{layer}.g_idx"]).reshape(-1)
        if g_idx.size != k or not np.array_equal(g_idx, np.arange(k) // group):
            raise WeightError(f"{layer}.g_idx reorders the groups (GPTQ with desc_act / act-order); graphc reads weights whose groups are in order")
    DequantizeBlocks(bits, group, k)  # MatMulNBits' block rules (a power of two >= 16), named
    padded = np.zeros((n, groups * group), np.uint8)
    padded[:, :k] = q
    return PackedLinear(
        packed=pack_bits(padded.reshape(n, groups, group), bits),
        scales=np.ascontiguousarray(scales.T).reshape(-1),
        zero_points=pack_bits(np.ascontiguousarray(zeros.T), bits).reshape(-1),
        bits=bits,
        block_size=group,
        k=k,
    )


def _stand_in_rows(arr: np.ndarray, bases: Mapping[int, tuple[str, int, int]]) -> tuple[str, np.ndarray] | None:
    """``(layer weight, rows)`` when ``arr`` is a view of rows of a stand-in (whose memory ``bases`` maps by address)."""
    if arr.ndim != 2 or arr.strides[1] != 0 or arr.size == 0:
        return None
    address = arr.__array_interface__["data"][0]
    for start, (name, length, itemsize) in bases.items():
        if start <= address < start + length * itemsize:
            first, step = (address - start) // itemsize, arr.strides[0] // itemsize
            return name, first + step * np.arange(arr.shape[0])
    return None


def _read_only(arr: np.ndarray) -> np.ndarray:
    """``arr`` contiguous and read-only, so the graph keeps it without a copy."""
    out = np.ascontiguousarray(arr)
    out.setflags(write=False)
    return out


def apply_prequantized(graph: Graph, packed: Mapping[str, PackedLinear], stand_ins: Mapping[str, np.ndarray]) -> Graph:
    """``graph`` (built from :func:`read_prequantized`'s weights, ``stand_ins`` by layer weight name) with every
    stand-in read as ``DequantizeBlocks`` of its rows' packed bytes (see the module doc)."""
    bases = {stand_in.__array_interface__["data"][0]: (name, stand_in.shape[0], stand_in.itemsize) for name, stand_in in stand_ins.items()}
    used: set[str] = set()
    for name, arr in list(graph.initializers.items()):
        hit = _stand_in_rows(arr, bases)
        if hit is None:
            continue
        layer, rows = hit
        linear = packed[layer]
        dtype = str(arr.dtype)
        full = rows.size == linear.packed.shape[0] and np.array_equal(rows, np.arange(rows.size))
        operands = [
            linear.packed if full else linear.packed[rows],
            (linear.scales if full else linear.scales.reshape(linear.packed.shape[0], -1)[rows].reshape(-1)).astype(dtype),
            linear.zero_points if full else linear.zero_points.reshape(linear.packed.shape[0], -1)[rows].reshape(-1),
        ]
        names = [graph.add_initializer(graph.fresh_name(f"{name}.{part}"), _read_only(v), copy=False).name
                 for part, v in zip((f"q{linear.bits}", "scales", "zero_points"), operands)]  # fmt: skip
        for reader in graph.consumers(name):
            if not (isinstance(reader.op, Einsum) and list(reader.inputs[1:]) == [name] and reads_weight_rows(reader.op_as(Einsum).parsed)):
                raise WeightError(f"{layer} is quantized, but the graph reads it in {reader.op.kind} {reader.name!r}, not as a linear layer's weight")
            op = DequantizeBlocks(linear.bits, linear.block_size, linear.k)
            weight = graph.add_node(op, names, graph.fresh_name(f"{name}.dequantized"), before=reader.name).name
            graph.redefine(reader.name, reader.op, [reader.inputs[0], weight])
        graph.remove_initializer(name)
        used.add(layer)
    lost = sorted(set(stand_ins) - used)
    if lost:
        raise WeightError(f"{lost[0]} is quantized, but the model's builder copied it instead of placing it (its family is not read quantized)")
    graph.verify()
    return graph
