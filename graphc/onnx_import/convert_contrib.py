"""onnxruntime's ``com.microsoft`` attention ops as graphc decompositions.

- ``GroupQueryAttention``: Q/K/V ``[B, S, heads*D]`` (or packed QKV), a
  ``[B, kv_heads, P, D]`` cache, ``seqlens_k`` (each row's total length
  ``L_b`` - 1), optional rotary from ``cos_cache``/``sin_cache``, ``softcap``
  and ``local_window_size``.  Row ``b``'s past is ``max(L_b - S, 0)`` tokens
  (0 in a prompt, whose rows onnxruntime reads right-padded: ``L_b`` real
  tokens of ``S``), its queries and new keys at the positions after it.  The
  import builds an ONNX ``Attention`` over ``concat(cache, new)``, causal at
  offset ``P``, with a bool mask for what differs per row (the cache slots the
  row holds, its real new keys, the window in positions), so the optimizer
  recognises one causal ``Attention`` with its KV cache; where every row's past
  fills the cache the mask only holds the window.  The present is written as
  onnxruntime writes it: the row's past slots, then its new keys, then zeros
  (a ragged batch, left-padded by onnxruntime-genai's mask, has rows whose new
  keys sit before slot ``P``).
  With ``sliding_window_cache=1`` the cache is a rolling one of ``C`` slots,
  ``C`` = ``local_window_size`` (onnxruntime-genai's layout; the import
  unifies the cache length with the window, so a run checks it): it holds row
  ``b``'s last ``min(past_b, C)`` tokens in its first slots, the keys are those
  and the new ones, and the present is the last ``C`` of them (its first ``C``
  slots while it holds fewer; onnxruntime leaves the slots past those
  unspecified, graphc writes zeros).
- ``MultiHeadAttention``: Q/K/V ``[B, S, heads*D]``, optional additive
  ``attention_bias`` and ``past_key``/``past_value``, ``unidirectional``
  (causal, offset by the past length); ``key_padding_mask`` and packed
  inputs are refused with a clear error.
"""

from __future__ import annotations

import numpy as np

from ..dims import Dim, dim_add, dim_prod, normalize_dim
from ..ops import Binary, Cast, Compare, Reshape, Transpose, Where
from ..rotary import Positions
from ..tensor_ops import Arange, BroadcastTo, Gather, GatherElements, ShapeValues, Slice
from .context import ImportContext, Imported
from .convert_core import Converter
from .convert_fused import _as_int64, _attention, _rotate, _split_heads

__all__ = ["CONTRIB_CONVERTERS"]


def _bsnd(ctx: ImportContext, x: str, heads: int, what: str) -> str:
    """``[B, S, heads*D] -> [B, S, heads, D]``."""
    b, s, hidden = ctx.graph.types[x].shape
    if not isinstance(hidden, int) or hidden % heads:
        raise ctx.error(f"{what} hidden size {hidden!r} does not split into {heads} heads")
    return ctx.add(Reshape((b, s, heads, hidden // heads)), [x], f"{what}_BSND")


GQA_ATTRIBUTES = frozenset(
    {
        "num_heads",
        "kv_num_heads",
        "scale",
        "softcap",
        "local_window_size",
        "do_rotary",
        "rotary_interleaved",
        "smooth_softmax",
        "sliding_window_cache",
        "qk_output",
    }
)
"""GroupQueryAttention's attributes the import reads (or refuses by value); any other is refused by name, never ignored."""


def _write_after_rows_past(
    ctx: ImportContext, fulls: tuple[str, str], news: tuple[str, str], row_past: str, names: tuple[str, str] = ("present_key", "present_value")
) -> list[str]:
    """Present K and V from ``concat(past, new)`` (``fulls``): ``present[b, :, j]`` is ``past[b, :, j]`` for
    ``j < row_past[b]``, then ``new[b]``, then zeros (length ``P + S``).  Where every row's past fills the cache
    (``row_past[b] = P``) this is ``concat(past, new)`` itself."""
    b, _, total, _ = ctx.graph.types[fulls[0]].shape
    s = ctx.graph.types[news[0]].shape[2]
    slot = ctx.add(Reshape((1, 1, total, 1)), [ctx.add(Arange(0, total), [], "present_slots")], "present_slots4")
    new_len = ctx.add(ShapeValues((s,), scalar=True), [], "new_len")
    start = ctx.add(Reshape((b, 1, 1, 1)), [row_past], "row_past4")
    is_past = ctx.add(Compare("less"), [slot, start], "slot_is_past")
    is_new = ctx.add(Compare("less"), [slot, ctx.add(Binary("add"), [start, new_len], "new_end")], "slot_before_end")
    offset = ctx.add(Binary("sub"), [slot, start], "new_slot")  # j - past_b: 0.. on the new keys
    zero, last = ctx.constant(np.array(0, np.int64), "zero"), ctx.add(ShapeValues((dim_add(s, -1),), scalar=True), [], "last_new")
    clipped = ctx.add(Binary("min"), [ctx.add(Binary("max"), [offset, zero], "lo"), last], "hi")
    presents = []
    for full, new, what in zip(fulls, news, names):
        index = ctx.add(BroadcastTo(ctx.graph.types[full].shape), [clipped], f"{what}_index")
        moved = ctx.add(GatherElements(2), [new, index], f"{what}_moved")
        zeros = ctx.constant(np.zeros((), np.dtype(ctx.graph.types[new].dtype)), "zero")
        presents.append(ctx.add(Where(), [is_past, full, ctx.add(Where(), [is_new, moved, zeros], f"{what}_tail")], what))
    return presents


def _gqa(ctx: ImportContext, ins: list, attrs: dict) -> list:
    ins = ins + [None] * (12 - len(ins))
    heads, kv_heads = attrs.get("num_heads"), attrs.get("kv_num_heads")
    if not heads or not kv_heads:
        raise ctx.error("GroupQueryAttention needs num_heads and kv_num_heads")
    for slot, what in ((9, "position_ids"), (10, "attention_bias"), (11, "head_sink")):
        if ins[slot] is not None:
            raise ctx.error(f"GroupQueryAttention: input {what} is not supported by graphc's import")
    if attrs.get("smooth_softmax", 0):
        raise ctx.error("GroupQueryAttention: smooth_softmax=1 is not supported by graphc's import")
    if attrs.get("qk_output", 0):
        raise ctx.error("GroupQueryAttention: qk_output (the scores as an extra output) is not supported by graphc's import")
    rolling = bool(attrs.get("sliding_window_cache", 0))
    if rolling and (ins[3] is None or attrs.get("local_window_size", -1) <= 0):
        raise ctx.error("GroupQueryAttention: sliding_window_cache=1 needs past_key/past_value and a local_window_size > 0")
    unknown = sorted(set(attrs) - GQA_ATTRIBUTES)
    if unknown:
        raise ctx.error(
            f"GroupQueryAttention: attribute(s) {', '.join(unknown)} are not known to graphc's import (known: {', '.join(sorted(GQA_ATTRIBUTES))})"
        )
    q = ctx.tensor(ins[0], "query")
    if ins[1] is None:  # packed [Q | K | V]
        hidden = ctx.graph.types[q].shape[2]
        if not isinstance(hidden, int):
            raise ctx.error(f"GroupQueryAttention: a packed query needs a static hidden size, got {hidden!r}")
        d = hidden // (heads + 2 * kv_heads)
        k = ctx.add(Slice(2, heads * d, (heads + kv_heads) * d), [q], "key_packed")
        v = ctx.add(Slice(2, (heads + kv_heads) * d, hidden), [q], "value_packed")
        q = ctx.add(Slice(2, 0, heads * d), [q], "query_packed")
    else:
        k, v = ctx.tensor(ins[1], "key"), ctx.tensor(ins[2], "value")
    seqlens = ctx.tensor(ins[5], "seqlens_k")
    if ctx.graph.types[seqlens].dtype != "int32":
        raise ctx.error(f"GroupQueryAttention: seqlens_k must be int32 (as onnxruntime's kernel takes it), got {ctx.graph.types[seqlens].dtype}")
    lengths = ctx.add(Binary("add"), [_as_int64(ctx, seqlens), ctx.constant(np.array(1, np.int64), "one")], "total_lengths")
    new_len = ctx.add(ShapeValues((ctx.graph.types[q].shape[1],), scalar=True), [], "new_len")
    zero = ctx.constant(np.array(0, np.int64), "zero")
    row_past = ctx.add(Binary("max"), [ctx.add(Binary("sub"), [lengths, new_len], "row_past_signed"), zero], "row_past")
    if attrs.get("do_rotary", 0):
        if ins[7] is None or ins[8] is None:
            raise ctx.error("GroupQueryAttention with do_rotary=1 needs cos_cache and sin_cache")
        interleaved = bool(attrs.get("rotary_interleaved", 0))
        q = _gqa_rotary(ctx, q, heads, row_past, ins[7], ins[8], interleaved, "q")
        k = _gqa_rotary(ctx, k, kv_heads, row_past, ins[7], ins[8], interleaved, "k")
    q4, k4, v4 = (ctx.add(Transpose((0, 2, 1, 3)), [_bsnd(ctx, x, n, w)], f"{w}_BHSD") for x, n, w in _heads_of(q, k, v, heads, kv_heads))
    fused = {"is_causal": 1, "softcap": attrs.get("softcap", 0.0)}
    if attrs.get("scale"):
        fused["scale"] = attrs["scale"]
    window = attrs.get("local_window_size", -1)
    past = (ctx.tensor(ins[3], "past_key"), ctx.tensor(ins[4], "past_value")) if ins[3] is not None else None
    held, capacity = row_past, ""
    if past is not None and rolling:  # the cache holds the row's last min(past, capacity) tokens in its first slots
        _check_capacity(ctx, ctx.graph.types[past[0]].shape[2], window)
        capacity = ctx.add(ShapeValues((ctx.graph.types[past[0]].shape[2],), scalar=True), [], "cache_capacity")
        held = ctx.add(Binary("min"), [row_past, capacity], "row_past_in_cache")
    visible = _gqa_visible(ctx, q4, past, lengths, row_past, held, window)
    y, full_k, full_v, _ = _current_semantics(ctx, [q4, k4, v4, visible, *(past or (None, None))], fused)
    if past is None:
        return [_merge_heads(ctx, y), k4, v4]
    if not rolling:
        return [_merge_heads(ctx, y), *_write_after_rows_past(ctx, (full_k, full_v), (k4, v4), held)]
    keys = _write_after_rows_past(ctx, (full_k, full_v), (k4, v4), held, ("keys", "values"))
    rows_keys = ctx.add(Binary("add"), [held, new_len], "row_keys")  # the row's past in the cache, then its new keys
    return [_merge_heads(ctx, y), *_last_slots(ctx, (keys[0], keys[1]), rows_keys, ctx.graph.types[past[0]].shape[2], capacity)]


def _gqa_visible(ctx: ImportContext, q4: str, past: tuple[str, str] | None, lengths: str, row_past: str, held: str, window: int) -> str:
    """Which keys of ``[cache | new]`` each query of row ``b`` sees, beyond the causal mask at offset ``P`` (the cache
    length) that the ``Attention`` op applies: the row's ``held`` cache slots and its real new keys (all ``S`` after a
    past; ``L_b`` in a prompt, whose rows onnxruntime reads right-padded), within the window of positions.

    Row ``b``'s queries sit at positions ``row_past + i``, its cache slot ``j`` holds position ``row_past - held + j``
    and new key ``t`` position ``row_past + t``: in slot terms (new key ``t`` at slot ``P + t``) the causal mask at
    offset ``P`` is the row's own causal mask, so ``[B, 1, S, P + S]`` booleans say the rest exactly."""
    b, _, s, _ = ctx.graph.types[q4].shape
    p = ctx.graph.types[past[0]].shape[2] if past is not None else 0
    total = dim_add(p, s)
    slot = ctx.add(Reshape((1, 1, 1, total)), [ctx.add(Arange(0, total), [], "key_slots")], "key_slots4")
    row = ctx.add(Reshape((1, 1, s, 1)), [ctx.add(Arange(0, s), [], "query_steps")], "query_steps4")
    held4, past4 = (ctx.add(Reshape((b, 1, 1, 1)), [x], f"{x}4") for x in (held, row_past))
    cache_len = ctx.add(ShapeValues((p,), scalar=True), [], "cache_len")
    new_slot = ctx.add(Binary("sub"), [slot, cache_len], "new_slot")  # t = j - P on the new keys, negative on the cache
    real_new = ctx.add(Reshape((b, 1, 1, 1)), [ctx.add(Binary("sub"), [lengths, row_past], "row_new")], "row_new4")
    in_cache = ctx.add(Compare("less"), [slot, held4], "slot_held")
    cache_slot = ctx.add(Compare("less"), [slot, cache_len], "slot_in_cache")
    new_real = ctx.add(Compare("less"), [new_slot, real_new], "new_is_real")
    false = ctx.constant(np.array(False), "false")
    visible = ctx.add(Where(), [cache_slot, in_cache, new_real], "key_visible")
    if window is None or window <= 0:
        return ctx.add(BroadcastTo((b, 1, s, total)), [visible], "visible")
    position = ctx.add(
        Where(), [in_cache, ctx.add(Binary("sub"), [ctx.add(Binary("add"), [slot, past4], "slot_plus_past"), held4], "cache_pos"),
                  ctx.add(Binary("add"), [new_slot, past4], "new_pos")], "key_pos",
    )  # fmt: skip
    distance = ctx.add(Binary("sub"), [ctx.add(Binary("add"), [row, past4], "query_pos"), position], "distance")
    in_window = ctx.add(Compare("less"), [distance, ctx.constant(np.array(window, np.int64), "window")], "in_window")
    return ctx.add(Where(), [visible, in_window, false], "visible")


def _check_capacity(ctx: ImportContext, capacity: Dim, window: int) -> None:
    """A rolling cache has as many slots as the window (onnxruntime refuses fewer and, with more, keeps the last window
    of keys in the first slots): a free capacity dim is unified with the window, so every run checks it."""
    ctx.unify(capacity, window)
    if normalize_dim(capacity) != window:
        raise ctx.error(
            f"GroupQueryAttention: sliding_window_cache=1 with a cache of {capacity!r} slots; graphc's import models a rolling cache "
            f"of exactly local_window_size ({window}) slots, the layout onnxruntime-genai writes"
        )


def _last_slots(ctx: ImportContext, fulls: tuple[str, str], lengths: str, capacity: Dim, cap: str) -> list[str]:
    """A rolling cache's present: row ``b``'s keys ``[max(L_b - C, 0), ... + C)`` of ``[past | new | zeros]`` (its last
    ``C`` keys once it holds that many, else its first ``C`` slots); ``cap`` holds ``C`` as a tensor."""
    b = ctx.graph.types[fulls[0]].shape[0]
    slots = ctx.add(Reshape((1, 1, capacity, 1)), [ctx.add(Arange(0, capacity), [], "cache_slots")], "cache_slots4")
    zero = ctx.constant(np.array(0, np.int64), "zero")
    start = ctx.add(Binary("max"), [ctx.add(Binary("sub"), [lengths, cap], "row_overflow"), zero], "row_first_kept")
    index = ctx.add(Binary("add"), [slots, ctx.add(Reshape((b, 1, 1, 1)), [start], "row_first_kept4")], "kept_slots")
    out = []
    for full, what in zip(fulls, ("present_key", "present_value")):
        shape = ctx.graph.types[full].shape
        kept = ctx.add(BroadcastTo((shape[0], shape[1], capacity, shape[3])), [index], f"{what}_kept_index")
        out.append(ctx.add(GatherElements(2), [full, kept], what))
    return out


def _heads_of(q: str, k: str, v: str, heads: int, kv_heads: int) -> list[tuple[str, int, str]]:
    """(value, heads, tag) of the query, key and value."""
    return [(q, heads, "q"), (k, kv_heads, "k"), (v, kv_heads, "v")]


def _gqa_rotary(ctx: ImportContext, x: str, heads: int, start: str, cos: Imported, sin: Imported, interleaved: bool, what: str) -> str:
    """RoPE at positions ``start[b] + i`` (each row's new tokens follow its past; a prompt starts at 0)."""
    xs = _bsnd(ctx, x, heads, what)
    b, s = ctx.graph.types[xs].shape[:2]
    pos = ctx.add(Binary("add"), [ctx.add(Reshape((b, 1)), [start], "rope_start_B1"), ctx.add(Positions(1), [xs], "rope_steps")], "rope_positions")
    cos_t, sin_t = ctx.tensor(cos, "cos_cache"), ctx.tensor(sin, "sin_cache")
    cos_g = ctx.add(Reshape((b, s, 1, ctx.graph.types[cos_t].shape[1])), [ctx.add(Gather(0), [cos_t, pos], "rope_cos")], "rope_cos_BS1D")
    sin_g = ctx.add(Reshape((b, s, 1, ctx.graph.types[sin_t].shape[1])), [ctx.add(Gather(0), [sin_t, pos], "rope_sin")], "rope_sin_BS1D")
    half = ctx.graph.types[cos_t].shape[1]
    if not isinstance(half, int):
        raise ctx.error(f"GroupQueryAttention: cos_cache needs a static rotary size, got {half!r}")
    y = _rotate(ctx, xs, cos_g, sin_g, 2 * half, interleaved)
    return ctx.add(Reshape(ctx.graph.types[x].shape), [y], f"{what}_rotated")


def _mha(ctx: ImportContext, ins: list, attrs: dict) -> list:
    ins = ins + [None] * (10 - len(ins))
    heads = attrs.get("num_heads")
    if not heads:
        raise ctx.error("MultiHeadAttention needs num_heads")
    if ins[1] is None or ins[2] is None or ctx.graph.types[ctx.tensor(ins[1], "key")].rank != 3:
        raise ctx.error(
            "MultiHeadAttention: packed QKV/KV and BNSH key/value inputs are not supported by graphc's import; give 3D query, key and value"
        )
    if ins[3] is not None:
        raise ctx.error("MultiHeadAttention: the bias input is not supported by graphc's import (add it to Q/K/V before the op)")
    if ins[4] is not None:
        raise ctx.error("MultiHeadAttention: key_padding_mask is not supported by graphc's import; pass an additive attention_bias instead")
    q, k, v = (_split_heads(ctx, ctx.tensor(x, w), heads, w) for x, w in ((ins[0], "q"), (ins[1], "k"), (ins[2], "v")))
    fused = {"is_causal": int(attrs.get("unidirectional", 0))}
    if attrs.get("scale"):
        fused["scale"] = attrs["scale"]
    bias = ins[5]
    if bias is not None:
        bias = ctx.tensor(bias, "attention_bias")
        if ctx.graph.types[bias].dtype != ctx.graph.types[q].dtype:
            bias = ctx.add(Cast(ctx.graph.types[q].dtype), [bias], "attention_bias_cast")
    y, pk, pv, _ = _current_semantics(ctx, [q, k, v, bias, ins[6], ins[7]], fused)
    return [_merge_heads(ctx, y), pk, pv]


def _current_semantics(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """The ONNX Attention decomposition with onnx 1.23's semantics, whatever ``attention_semantics`` the import reads ONNX nodes with."""
    saved, ctx.attention_semantics = ctx.attention_semantics, "onnx-1.23"
    try:
        return _attention(ctx, ins, attrs)
    finally:
        ctx.attention_semantics = saved


def _merge_heads(ctx: ImportContext, y: str) -> str:
    """``[B, H, S, D] -> [B, S, H*D]``."""
    b, h, s, d = ctx.graph.types[y].shape
    return ctx.add(Reshape((b, s, dim_prod([h, d]))), [ctx.add(Transpose((0, 2, 1, 3)), [y], "attn_BSHD")], "attn_BSN")


CONTRIB_CONVERTERS: dict[tuple[str, str], Converter] = {
    ("com.microsoft", "GroupQueryAttention"): _gqa,
    ("com.microsoft", "MultiHeadAttention"): _mha,
}
"""onnxruntime contrib attention converters by (domain, op type)."""
