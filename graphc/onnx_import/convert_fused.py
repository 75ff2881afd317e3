"""Converters for fused ONNX ops: ``Attention`` (opsets 23-25), RoPE, the norms, and the products and activations
onnxruntime's graph optimizer fuses in the files it saves (``com.microsoft.FusedMatMul``, ``QuickGelu``, ``FastGelu``).

Each fused op is decomposed into graphc's einsum and elementwise ops with the
semantics of ONNX's reference implementation (onnx 1.23), so the optimizer can
rewrite the parts (the GQA repeat becomes a grouped einsum) and recognise the
attention again for the backend that runs it.  The choices where ONNX
releases differ are listed in ``docs/onnx-import.md``.
"""

from __future__ import annotations

import numpy as np

from ..dims import Dim, dim_prod, is_static, normalize_dim
from ..ops import (
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    Binary,
    CausalMask,
    Cast,
    Compare,
    Concat,
    Einsum,
    Repeat,
    Reshape,
    Scale,
    Softmax,
    Transpose,
    Unary,
    Where,
)
from ..rotary import Positions
from ..tensor_ops import Arange, Gather, Reduce, Slice
from .context import ONNX_TO_DTYPE, ImportContext, Imported
from .convert_core import Converter, _einsum_matmul, _positions_grid

__all__ = ["FUSED_CONVERTERS"]


def _const(ctx: ImportContext, value: float | bool | int, dtype: str) -> str:
    return ctx.constant(np.asarray(value).astype(dtype).reshape(()), "c")


def _split_heads(ctx: ImportContext, x: str, heads: int, what: str) -> str:
    """``[B, S, H*D] -> [B, H, S, D]``."""
    b, s, hidden = ctx.graph.types[x].shape
    if not isinstance(hidden, int) or hidden % heads:
        raise ctx.error(f"Attention: {what} hidden size {hidden!r} does not split into {heads} heads")
    y = ctx.add(Reshape((b, s, heads, hidden // heads)), [x], f"{what}_BSHD")
    return ctx.add(Transpose((0, 2, 1, 3)), [y], f"{what}_BHSD")


def _hide(ctx: ImportContext, scores: str, keep: str) -> str:
    """``scores`` with ``-inf`` wherever the bool ``keep`` is False."""
    dtype = ctx.graph.types[scores].dtype
    return ctx.add(Where(), [keep, scores, _const(ctx, -np.inf, dtype)], "masked")


def _attention(ctx: ImportContext, ins: list, attrs: dict) -> list:
    ins = ins + [None] * (7 - len(ins))
    q, k, v = (ctx.tensor(x, what) for x, what in zip(ins[:3], ("Q", "K", "V")))
    mask, past_k, past_v, nonpad = ins[3], ins[4], ins[5], ins[6]
    rank = ctx.graph.types[q].rank
    if rank == 3:
        if "q_num_heads" not in attrs or "kv_num_heads" not in attrs:
            raise ctx.error("Attention with 3D inputs needs the q_num_heads and kv_num_heads attributes")
        for key in ("q_num_heads", "kv_num_heads"):
            if attrs[key] < 1:
                raise ctx.error(f"Attention {key}={attrs[key]}; head counts must be >= 1")
        if attrs["q_num_heads"] % attrs["kv_num_heads"]:
            raise ctx.error(f"Attention q_num_heads={attrs['q_num_heads']} is not a multiple of kv_num_heads={attrs['kv_num_heads']}")
        q = _split_heads(ctx, q, attrs["q_num_heads"], "q")
        k = _split_heads(ctx, k, attrs["kv_num_heads"], "k")
        v = _split_heads(ctx, v, attrs["kv_num_heads"], "v")
    elif rank != 4:
        raise ctx.error(f"Attention inputs must be 3D or 4D, got rank {rank}")
    if (past_k is None) != (past_v is None):
        raise ctx.error("Attention: past_key and past_value must be given together")
    if past_k is not None and nonpad is not None:
        raise ctx.error("Attention: nonpad_kv_seqlen cannot be combined with past_key/past_value")
    dtype = ctx.graph.types[q].dtype
    if dtype not in FLOAT_DTYPES:
        raise ctx.error(f"Attention: Q must be a float tensor, got {dtype}")
    batch, n_heads, sq, head = ctx.graph.types[q].shape
    past_len: Dim = 0
    if past_k is not None:
        pk, pv = ctx.tensor(past_k, "past_key"), ctx.tensor(past_v, "past_value")
        past_len = ctx.graph.types[pk].shape[2]
        k = ctx.add(Concat(2), [pk, k], "key_with_past")
        v = ctx.add(Concat(2), [pv, v], "value_with_past")
    present_k, present_v = k, v
    n_kv = ctx.graph.types[k].shape[1]
    total = ctx.graph.types[k].shape[2]
    if n_heads != n_kv:
        if not (isinstance(n_heads, int) and isinstance(n_kv, int) and n_heads % n_kv == 0):
            raise ctx.error(f"Attention: {n_heads!r} query heads do not group over {n_kv!r} KV heads")
        k = ctx.add(Repeat(1, n_heads // n_kv), [k], "key_repeated")  # head h reads KV head h // group
        v = ctx.add(Repeat(1, n_heads // n_kv), [v], "value_repeated")
    scale = attrs.get("scale")
    if scale is None:
        if not isinstance(head, int):
            raise ctx.error(f"Attention: the default scale needs a static head size, got {head!r}")
        scale = 1.0 / float(np.sqrt(head))
    scores = ctx.add(Einsum("bhsd,bhtd->bhst"), [q, k], "qk")
    scores = ctx.add(Scale(scale), [scores], "qk_scaled")
    qk_raw = scores
    softcap = attrs.get("softcap", 0.0)
    legacy = ctx.attention_semantics == "legacy"
    if not legacy:  # onnx >= 1.22: softcap, then the masks
        scores = _softcap(ctx, scores, softcap)
    qk_capped = scores
    scores = _masks(ctx, scores, attrs, mask, total, dtype, past_len, nonpad, sq, batch, legacy)
    qk_bias = scores
    if legacy:  # onnx <= 1.21: the masks, then softcap; mode 1 is after the masks, mode 2 after softcap
        scores = _softcap(ctx, scores, softcap)
        qk_capped, qk_bias = qk_bias, scores
    precision = attrs.get("softmax_precision")
    soft_in = scores
    if precision is not None and ONNX_TO_DTYPE.get(precision, dtype) != dtype:
        soft_in = ctx.add(Cast(ONNX_TO_DTYPE[precision]), [scores], "qk_softmax_precision")
    probs = ctx.add(Softmax(-1), [soft_in], "probs")
    if ctx.graph.types[probs].dtype != dtype:
        probs = ctx.add(Cast(dtype), [probs], "probs_cast")
    out = ctx.add(Einsum("bhst,bhtd->bhsd"), [probs, v], "attn")
    if rank == 3:
        dv = ctx.graph.types[out].shape[3]
        out = ctx.add(Transpose((0, 2, 1, 3)), [out], "attn_BSHD")
        out = ctx.add(Reshape((batch, sq, dim_prod([n_heads, dv]))), [out], "attn_BSN")
    mode = attrs.get("qk_matmul_output_mode", 0)
    qk_out = {0: qk_raw, 1: qk_capped, 2: qk_bias, 3: probs}.get(mode)
    if qk_out is None:
        raise ctx.error(f"Attention: qk_matmul_output_mode must be 0..3, got {mode}")
    return [out, present_k, present_v, qk_out]


def _softcap(ctx: ImportContext, scores: str, softcap: float) -> str:
    if not softcap or softcap <= 0:
        return scores
    capped = ctx.add(Unary("tanh"), [ctx.add(Scale(1.0 / softcap), [scores], "qk_over_cap")], "qk_tanh")
    return ctx.add(Scale(softcap), [capped], "qk_capped")


def _masks(
    ctx: ImportContext,
    scores: str,
    attrs: dict,
    mask: Imported | None,
    total: Dim,
    dtype: str,
    past_len: Dim,
    nonpad: Imported | None,
    sq: Dim,
    batch: Dim,
    legacy: bool,
) -> str:
    """The attention mask, causal mask, window and key padding on the scores (each hides with -inf or adds)."""
    if mask is not None:
        m = ctx.tensor(mask, "attn_mask")
        m = _pad_mask(ctx, m, total)
        if ctx.graph.types[m].dtype == "bool":
            scores = _hide(ctx, scores, m)
        else:
            if ctx.graph.types[m].dtype != dtype:
                m = ctx.add(Cast(dtype), [m], "attn_mask_cast")
            scores = ctx.add(Binary("add"), [scores, m], "qk_masked")
    scores = _causal_and_window(ctx, scores, attrs, past_len, None if legacy else nonpad, sq, batch)
    if nonpad is not None:
        lengths = ctx.tensor(nonpad, "nonpad_kv_seqlen")
        lengths = _as_int64(ctx, lengths)
        cols = ctx.add(Arange(0, ctx.graph.types[scores].shape[3]), [], "key_positions")
        keep = ctx.add(Compare("less"), [cols, ctx.add(Reshape((batch, 1, 1, 1)), [lengths], "nonpad_BHSK")], "key_is_real")
        scores = _hide(ctx, scores, keep)
    return scores


def _as_int64(ctx: ImportContext, x: str) -> str:
    return x if ctx.graph.types[x].dtype == "int64" else ctx.add(Cast("int64"), [x], "as_int64")


def _pad_mask(ctx: ImportContext, m: str, total: Dim) -> str:
    """A mask shorter than the keys is padded with "hidden" (``False`` / ``-inf``), as ONNX specifies."""
    shape = ctx.graph.types[m].shape
    last = normalize_dim(shape[-1])
    if last == normalize_dim(total) or last == 1:
        return m
    if not (isinstance(last, int) and isinstance(total, int)) or not is_static(shape[:-1]):
        raise ctx.error(f"Attention: attn_mask has {last!r} keys but the keys number {total!r}; padding is supported for static shapes")
    dtype = ctx.graph.types[m].dtype
    fill = np.full(tuple(int(d) for d in shape[:-1]) + (total - last,), False if dtype == "bool" else -np.inf, dtype)  # static: checked above
    return ctx.add(Concat(-1), [m, ctx.constant(fill, "attn_mask_pad")], "attn_mask_padded")


def _causal_and_window(ctx: ImportContext, scores: str, attrs: dict, past_len: Dim, nonpad: Imported | None, sq: Dim, batch: Dim) -> str:
    """The causal mask and sliding window, aligned bottom-right: query i sits at position ``offset + i``."""
    causal = bool(attrs.get("is_causal", 0))
    left, right = attrs.get("left_window_size", -1), attrs.get("right_window_size", -1)
    if not causal and left < 0 and right < 0:
        return scores
    if nonpad is None:  # one offset for the batch: the past length (0 without a cache)
        if causal and right < 0:
            return ctx.add(CausalMask(past_len, left + 1 if left >= 0 else None), [scores], "causal")
        diff = _positions_grid(ctx, scores)  # j - i
        keep = None
        offset = _dim_const(ctx, past_len)
        rel = ctx.add(Binary("sub"), [diff, offset], "key_minus_position")  # j - (i + P)
        conds = []
        if causal:
            conds.append(("less_equal", 0))
        if left >= 0:
            conds.append(("greater_equal", -left))
        if right >= 0:
            conds.append(("less_equal", right))
        for fn, bound in conds:
            c = ctx.add(Compare(fn), [rel, _const(ctx, bound, "int64")], "window_keep")
            keep = c if keep is None else ctx.add(Where(), [keep, c, _const(ctx, False, "bool")], "window_keep")
        assert keep is not None
        return _hide(ctx, scores, keep)
    lengths = _as_int64(ctx, ctx.tensor(nonpad, "nonpad_kv_seqlen"))  # per batch: offset[b] = nonpad[b] - S
    offset = ctx.add(Binary("sub"), [lengths, _dim_const(ctx, sq)], "query_offset")
    offset = ctx.add(Reshape((batch, 1, 1, 1)), [offset], "query_offset_B111")
    diff = _positions_grid(ctx, scores)
    rel = ctx.add(Binary("sub"), [diff, offset], "key_minus_position")
    keep = None
    conds = (
        ([("less_equal", 0)] if causal else []) + ([("greater_equal", -left)] if left >= 0 else []) + ([("less_equal", right)] if right >= 0 else [])
    )
    for fn, bound in conds:
        c = ctx.add(Compare(fn), [rel, _const(ctx, bound, "int64")], "window_keep")
        keep = c if keep is None else ctx.add(Where(), [keep, c, _const(ctx, False, "bool")], "window_keep")
    assert keep is not None
    return _hide(ctx, scores, keep)


def _dim_const(ctx: ImportContext, d: Dim) -> str:
    from .context import SymInts

    return ctx.tensor(SymInts((normalize_dim(d),), True), "dim")


# ---------------------------------------------------------------- norms
def _rms(ctx: ImportContext, x: str, axis: int, eps: float, stash: str) -> tuple[str, str]:
    """``x * rsqrt(mean(x^2) + eps)`` over axes ``axis..`` computed in ``stash``; returns (normalized, inv_std)."""
    rank = ctx.graph.types[x].rank
    axes = tuple(range(axis % rank, rank))
    xs = x if ctx.graph.types[x].dtype == stash else ctx.add(Cast(stash), [x], "norm_in")
    sq = ctx.add(Binary("mul"), [xs, xs], "norm_sq")
    mean = ctx.add(Reduce("mean", axes, True), [sq], "norm_mean_sq")
    inv = ctx.add(
        Unary("reciprocal"),
        [ctx.add(Unary("sqrt"), [ctx.add(Binary("add"), [mean, _const(ctx, eps, stash)], "norm_var_eps")], "norm_std")],
        "norm_inv_std",
    )
    return ctx.add(Binary("mul"), [xs, inv], "normalized"), inv


def _finish_norm(ctx: ImportContext, y: str, dtype: str, scale: Imported | None, bias: Imported | None = None) -> str:
    if ctx.graph.types[y].dtype != dtype:
        y = ctx.add(Cast(dtype), [y], "norm_out")
    y = ctx.add(Binary("mul"), [y, ctx.tensor(scale, "scale")], "norm_scaled")
    if bias is not None:
        y = ctx.add(Binary("add"), [y, ctx.tensor(bias, "bias")], "norm_biased")
    return y


def _stash(ctx: ImportContext, attrs: dict, dtype: str) -> str:
    stash = ONNX_TO_DTYPE.get(attrs.get("stash_type", 1), "float32")
    return stash if dtype in LOW_PRECISION_DTYPES or stash != "float32" else dtype


def _rms_norm(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0], "X")
    dtype = ctx.graph.types[x].dtype
    y, inv = _rms(ctx, x, attrs.get("axis", -1), attrs.get("epsilon", 1e-5), _stash(ctx, attrs, dtype))
    return [_finish_norm(ctx, y, dtype, ins[1]), inv]


def _layer_norm(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0], "X")
    dtype = ctx.graph.types[x].dtype
    stash = _stash(ctx, attrs, dtype)
    rank = ctx.graph.types[x].rank
    axes = tuple(range(attrs.get("axis", -1) % rank, rank))
    xs = x if dtype == stash else ctx.add(Cast(stash), [x], "norm_in")
    mean = ctx.add(Reduce("mean", axes, True), [xs], "norm_mean")
    centered = ctx.add(Binary("sub"), [xs, mean], "norm_centered")
    y, inv = _rms(ctx, centered, attrs.get("axis", -1), attrs.get("epsilon", 1e-5), stash)
    return [_finish_norm(ctx, y, dtype, ins[1], ins[2] if len(ins) > 2 else None), mean, inv]


def _skip_simplified(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.add(Binary("add"), [ctx.tensor(ins[0], "input"), ctx.tensor(ins[1], "skip")], "skip_sum")
    if len(ins) > 3 and ins[3] is not None:
        x = ctx.add(Binary("add"), [x, ctx.tensor(ins[3], "bias")], "skip_bias_sum")
    dtype = ctx.graph.types[x].dtype
    y, inv = _rms(ctx, x, -1, attrs.get("epsilon", 1e-5), "float32" if dtype in LOW_PRECISION_DTYPES else dtype)
    mean = ctx.add(Reduce("mean", (-1,), True), [x], "skip_mean")
    return [_finish_norm(ctx, y, dtype, ins[2]), mean, inv, x]


def _skip_layer_norm(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """com.microsoft ``SkipLayerNormalization(input, skip, gamma, beta?, bias?)``: LayerNorm of ``input + skip (+ bias)``,
    computed in float32 for low-precision inputs as onnxruntime does; outputs, mean, 1/std and the sum."""
    x = ctx.add(Binary("add"), [ctx.tensor(ins[0], "input"), ctx.tensor(ins[1], "skip")], "skip_sum")
    if len(ins) > 4 and ins[4] is not None:
        x = ctx.add(Binary("add"), [x, ctx.tensor(ins[4], "bias")], "skip_bias_sum")
    dtype = ctx.graph.types[x].dtype
    stash = "float32" if dtype in LOW_PRECISION_DTYPES else dtype
    xs = x if dtype == stash else ctx.add(Cast(stash), [x], "norm_in")
    mean = ctx.add(Reduce("mean", (-1,), True), [xs], "skip_mean")
    y, inv = _rms(ctx, ctx.add(Binary("sub"), [xs, mean], "norm_centered"), -1, attrs.get("epsilon", 1e-12), stash)
    return [_finish_norm(ctx, y, dtype, ins[2], ins[3] if len(ins) > 3 else None), mean, inv, x]


# ---------------------------------------------------------------- rotary
def _rotate(ctx: ImportContext, x: str, cos: str, sin: str, rot_dim: int, interleaved: bool) -> str:
    """Rotate the first ``rot_dim`` features of ``x [B, S, N, D]`` by ``cos``/``sin`` ``[B, S, 1, rot_dim/2]``."""
    head = ctx.graph.types[x].shape[-1]
    x_rot = x if rot_dim == head else ctx.add(Slice(3, 0, rot_dim), [x], "rope_rot")
    half = rot_dim // 2
    if interleaved:
        x1 = ctx.add(Slice(3, 0, rot_dim, 2), [x_rot], "rope_even")
        x2 = ctx.add(Slice(3, 1, rot_dim, 2), [x_rot], "rope_odd")
    else:
        x1 = ctx.add(Slice(3, 0, half), [x_rot], "rope_x1")
        x2 = ctx.add(Slice(3, half, rot_dim), [x_rot], "rope_x2")
    mul = lambda a, b: ctx.add(Binary("mul"), [a, b], "rope_mul")  # noqa: E731
    real = ctx.add(Binary("sub"), [mul(cos, x1), mul(sin, x2)], "rope_real")
    imag = ctx.add(Binary("add"), [mul(sin, x1), mul(cos, x2)], "rope_imag")
    if interleaved:
        shape = ctx.graph.types[real].shape
        pair = ctx.add(
            Concat(4), [ctx.add(Reshape(shape + (1,)), [real], "rope_r1"), ctx.add(Reshape(shape + (1,)), [imag], "rope_i1")], "rope_pairs"
        )
        rotated = ctx.add(Reshape(shape[:3] + (rot_dim,)), [pair], "rope_interleaved")
    else:
        rotated = ctx.add(Concat(3), [real, imag], "rope_rotated")
    if rot_dim == head:
        return rotated
    return ctx.add(Concat(3), [rotated, ctx.add(Slice(3, rot_dim, head), [x], "rope_pass")], "rope_out")


def _rope_tables(ctx: ImportContext, cos_cache: Imported, sin_cache: Imported, positions: str | None) -> tuple[str, str]:
    cos, sin = ctx.tensor(cos_cache, "cos_cache"), ctx.tensor(sin_cache, "sin_cache")
    if positions is not None:
        cos = ctx.add(Gather(0), [cos, positions], "rope_cos")
        sin = ctx.add(Gather(0), [sin, positions], "rope_sin")
    b, s, half = ctx.graph.types[cos].shape
    return ctx.add(Reshape((b, s, 1, half)), [cos], "rope_cos_BS1D"), ctx.add(Reshape((b, s, 1, half)), [sin], "rope_sin_BS1D")


def _rope(ctx: ImportContext, x: str, cos_cache: Imported, sin_cache: Imported, positions: str | None, attrs: dict, heads_first: bool) -> str:
    shape = ctx.graph.types[x].shape
    if len(shape) == 4:  # heads-first [B, N, S, D] (ONNX) or [B, S, N, D]
        xs = ctx.add(Transpose((0, 2, 1, 3)), [x], "rope_BSND") if heads_first else x
    elif len(shape) == 3:
        heads = attrs.get("num_heads", 0)
        width = shape[2]
        if not heads or not isinstance(width, int) or width % heads:
            raise ctx.error(f"RotaryEmbedding on 3D input {list(shape)} needs num_heads dividing the hidden size (num_heads={heads})")
        xs = ctx.add(Reshape((shape[0], shape[1], heads, width // heads)), [x], "rope_BSND")
    else:
        raise ctx.error(f"RotaryEmbedding input must be 3D or 4D, got rank {len(shape)}")
    head = ctx.graph.types[xs].shape[3]
    rot_dim = attrs.get("rotary_embedding_dim", 0) or head
    if not isinstance(rot_dim, int):
        raise ctx.error(f"RotaryEmbedding needs a static head size or rotary_embedding_dim, got {rot_dim!r}")
    cos, sin = _rope_tables(ctx, cos_cache, sin_cache, positions)
    if ctx.graph.types[cos].shape[3] != rot_dim // 2:
        raise ctx.error(
            f"RotaryEmbedding: cos/sin caches have {ctx.graph.types[cos].shape[3]!r} entries per position, rotary_embedding_dim/2 is {rot_dim // 2}"
        )
    y = _rotate(ctx, xs, cos, sin, rot_dim, bool(attrs.get("interleaved", 0)))
    if len(shape) == 3:
        return ctx.add(Reshape(shape), [y], "rope")
    return ctx.add(Transpose((0, 2, 1, 3)), [y], "rope") if heads_first else y


def _rotary_onnx(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0], "X")
    positions = ctx.tensor(ins[3], "position_ids") if len(ins) > 3 and ins[3] is not None else None
    return [_rope(ctx, x, ins[1], ins[2], positions, attrs, heads_first=True)]


def _rotary_ms(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0], "input")
    pos = ctx.tensor(ins[1], "position_ids")
    shape = ctx.graph.types[x].shape
    if ctx.graph.types[pos].rank == 1:  # one offset for every sequence: positions offset + arange(S)
        seq_axis = 2 if len(shape) == 4 else 1
        base = ctx.add(Positions(seq_axis), [x], "rope_positions")
        pos = ctx.add(
            Binary("add"), [ctx.add(Reshape((1, shape[seq_axis])), [base], "rope_positions_1S"), _as_int64(ctx, pos)], "rope_positions_offset"
        )
        pos = ctx.add(Reshape((1, shape[seq_axis])), [pos], "rope_positions_BS")
    return [_rope(ctx, x, ins[2], ins[3], _as_int64(ctx, pos), attrs, heads_first=len(shape) == 4)]


def _gelu(ctx: ImportContext, ins: list, attrs: dict) -> list:
    return [_gelu_of(ctx, ctx.tensor(ins[0]), attrs.get("approximate", "none") == "tanh")]


def _fast_gelu(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """``com.microsoft.FastGelu(X, bias?)``: the tanh approximation of GELU of ``X + bias``."""
    x = ctx.tensor(ins[0])
    if len(ins) > 1 and ins[1] is not None:
        x = ctx.add(Binary("add"), [x, ctx.tensor(ins[1], "FastGelu bias")], "fast_gelu_in")
    return [_gelu_of(ctx, x, True)]


def _gelu_of(ctx: ImportContext, x: str, tanh: bool) -> str:
    """GELU of ``x``: ``x * (1 + erf(x / sqrt 2)) / 2``, or (``tanh``) its tanh approximation."""
    dtype = ctx.graph.types[x].dtype
    if tanh:
        inner = ctx.add(
            Binary("add"),
            [x, ctx.add(Scale(0.044715), [ctx.add(Binary("mul"), [x, ctx.add(Binary("mul"), [x, x], "x2")], "x3")], "gelu_c")],
            "gelu_in",
        )
        t = ctx.add(Unary("tanh"), [ctx.add(Scale(float(np.sqrt(2 / np.pi))), [inner], "gelu_s")], "gelu_t")
    else:
        t = ctx.add(Unary("erf"), [ctx.add(Scale(float(1 / np.sqrt(2))), [x], "gelu_s")], "gelu_t")
    one_plus = ctx.add(Binary("add"), [t, _const(ctx, 1.0, dtype)], "gelu_1p")
    return ctx.add(Scale(0.5), [ctx.add(Binary("mul"), [x, one_plus], "gelu_x")], "gelu")  # 0.5 * (x * (1 + t)): the order onnxruntime fuses


def _fused_matmul(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """``com.microsoft.FusedMatMul``: ``alpha * op(A) @ op(B)``, ``op`` swapping the last two axes where ``transA`` /
    ``transB`` say (the batch-transposing forms are refused by name)."""
    if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
        raise ctx.error("FusedMatMul with transBatchA/transBatchB: graphc reads the forms that transpose only the last two axes")
    operands = []
    for v, flag in ((ins[0], "transA"), (ins[1], "transB")):
        x = ctx.tensor(v)
        rank = ctx.graph.types[x].rank
        if attrs.get(flag, 0) and rank >= 2:
            x = ctx.add(Transpose((*range(rank - 2), rank - 1, rank - 2)), [x], "fused_matmul_t")
        operands.append(x)
    y = _einsum_matmul(ctx, *operands)
    alpha = float(attrs.get("alpha", 1.0))
    return [y if alpha == 1.0 else ctx.add(Scale(alpha), [y], "fused_matmul_alpha")]


def _quick_gelu(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """``com.microsoft.QuickGelu``: ``x * sigmoid(alpha * x)`` (``alpha`` 1: the SiLU onnxruntime fuses under this name)."""
    x = ctx.tensor(ins[0])
    alpha = float(attrs.get("alpha", 1.702))
    inner = x if alpha == 1.0 else ctx.add(Scale(alpha), [x], "quick_gelu_alpha")
    return [ctx.add(Binary("mul"), [x, ctx.add(Unary("sigmoid"), [inner], "quick_gelu_sigmoid")], "quick_gelu")]


FUSED_CONVERTERS: dict[tuple[str, str], Converter] = {
    ("", "Attention"): _attention,
    ("", "RMSNormalization"): _rms_norm,
    ("", "SimplifiedLayerNormalization"): _rms_norm,
    ("", "LayerNormalization"): _layer_norm,
    ("", "RotaryEmbedding"): _rotary_onnx,
    ("", "Gelu"): _gelu,
    ("com.microsoft", "RotaryEmbedding"): _rotary_ms,
    ("com.microsoft", "SimplifiedLayerNormalization"): _rms_norm,
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): _skip_simplified,
    ("com.microsoft", "SkipLayerNormalization"): _skip_layer_norm,
    ("com.microsoft", "FusedMatMul"): _fused_matmul,
    ("com.microsoft", "QuickGelu"): _quick_gelu,
    ("com.microsoft", "FastGelu"): _fast_gelu,
}
"""Fused-op converters by (domain, op type); ``""`` is the standard domain."""
