"""Attention graph builders: the SDPA core, a full layer, cross-attention and a KV-cache step.

Layouts follow the ONNX ``Attention`` op's 4-D form: queries ``[B, Hq, Sq, D]``,
keys and values ``[B, Hkv, Sk, D]``.  Value names carry their layout
(``q_BHSD``, ``k_BHkvTD``; T is the key axis).  The unoptimized graphs repeat
K/V explicitly with :class:`~graphc.ops.Repeat` (query head h reads KV head
``h // group_size``); the optimizer turns that into a grouped einsum.

Weights follow ``torch.nn.Linear``: ``q_proj.weight`` is ``[n_heads*head_dim, d_model]``
(out, in), ``o_proj.weight`` is ``[d_model, n_heads*head_dim]``; biases are 1-D.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from graphc.dims import Dim, dim_add, dim_sub, normalize_dim
from graphc.errors import WeightError
from graphc.graph import Graph, Value
from graphc.memory import check_allocation
from graphc.ops import FLOAT_DTYPES, CausalMask, check_dtype
from graphc.rotary import Positions
from graphc.tensor_ops import Gather

from .blocks import rms_norm

from .config import AttentionConfig, alibi_slopes

__all__ = [
    "weight_shapes",
    "init_weights",
    "weight_bytes",
    "attention_core",
    "sdpa_graph",
    "attention_layer_graph",
    "cross_attention_graph",
    "cross_kv_graph",
    "kv_cache_graph",
    "attention_stack_graph",
]


def weight_shapes(cfg: AttentionConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the layer's parameters (a bias for each projection where ``cfg.has_bias``)."""
    q, kv = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    shapes: dict[str, tuple[int, ...]] = {
        "q_proj.weight": (q, cfg.d_model),
        "k_proj.weight": (kv, cfg.d_model),
        "v_proj.weight": (kv, cfg.d_model),
        "o_proj.weight": (cfg.d_model, q),
    }
    for proj, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", cfg.d_model)):
        if cfg.has_bias(proj):
            shapes[f"{proj}.bias"] = (n,)
    if cfg.qk_norm_eps is not None:
        shapes.update({"q_norm.weight": (cfg.hd,), "k_norm.weight": (cfg.hd,)})
    return shapes


def init_weights(cfg: AttentionConfig, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Random weights from a seeded RNG, scaled by ``fan_in ** -0.5`` (biases small)."""
    shapes = weight_shapes(cfg)
    check_allocation(
        weight_bytes(cfg, dtype), f"the weights of a {cfg.kind} layer (d_model={cfg.d_model}, {cfg.n_heads} heads of {cfg.hd}) in {dtype}"
    )
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        std = shape[-1] ** -0.5 if name.endswith("proj.weight") else 0.02
        draw = rng.standard_normal(shape, dtype=np.float64 if dtype == "float64" else np.float32)
        draw *= std
        if name.endswith("norm.weight"):  # norm gains scatter around 1
            draw = 1.0 + 5 * draw
        out[name] = draw.astype(dtype, copy=False)
    return out


def weight_bytes(cfg: AttentionConfig, dtype: str = "float32") -> int:
    """Bytes of one layer's weights in ``dtype``."""
    return sum(math.prod(s) for s in weight_shapes(cfg).values()) * np.dtype(check_dtype(dtype)).itemsize


def _check_weights(cfg: AttentionConfig, weights: Mapping[str, np.ndarray], dtype: str) -> None:
    expected = weight_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise WeightError(f"weights are missing {missing}; this config takes {sorted(expected)}")
    if extra:
        raise WeightError(f"unexpected weights {extra}; this config takes {sorted(expected)}")
    for name, shape in expected.items():
        arr = weights[name]
        if not isinstance(arr, np.ndarray):
            raise WeightError(f"weight {name!r} must be a numpy.ndarray, got {type(arr).__name__}")
        if tuple(arr.shape) != shape:
            raise WeightError(f"weight {name!r} has shape {tuple(arr.shape)}, expected {shape} (torch Linear layout: out, in)")
        if str(arr.dtype) != dtype:
            raise WeightError(f"weight {name!r} has dtype {arr.dtype}, expected {dtype}")


def _check_dtype(dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise WeightError(f"attention graphs need a float dtype, one of {FLOAT_DTYPES}; got {dtype!r}")


def attention_core(
    g: Graph,
    cfg: AttentionConfig,
    q: Value,
    k: Value,
    v: Value,
    causal: bool,
    offset: Dim = 0,
    mask: Value | None = None,
) -> Value:
    """Append ``softmax(masks(softcap(scale * q k^T))) v`` to ``g``; returns ``[B, Hq, Sq, D]``.

    K/V are repeated to the query heads by ``Repeat`` (axis 1, ``group_size``)
    when ``group_size > 1``.  ``causal`` masks key j for query i when
    ``j > i + offset`` (and, with ``cfg.sliding_window``, ``j <= i + offset - window``); ``mask`` is a value broadcastable to
    ``[B, Hq, Sq, Sk]``: bool (True keeps a key) or float (added to the scores).
    """
    keys = k  # key positions are read off the KV heads' keys, so the repeat below keeps one reader (the optimizer removes it)
    if cfg.group_size > 1:
        k = g.repeat(k, cfg.group_size, axis=1, name=g.fresh_name("k_rep_BHTD"))
        v = g.repeat(v, cfg.group_size, axis=1, name=g.fresh_name("v_rep_BHTD"))
    s = g.einsum("bhqd,bhkd->bhqk", q, k, name=g.fresh_name("scores_BHST"))
    if cfg.softcap is None:
        s = g.scale(s, cfg.softmax_scale, name=g.fresh_name("scaled_BHST"))
    else:  # softcap * tanh(scale * s / softcap), before any mask
        s = g.tanh(g.scale(s, cfg.softmax_scale / cfg.softcap, name=g.fresh_name("scaled_BHST")), name=g.fresh_name("tanh_BHST"))
        s = g.scale(s, cfg.softcap, name=g.fresh_name("capped_BHST"))
    if cfg.alibi:  # slope_h * j on the scaled scores, [1, H, 1, Sk], keys counted over past and new
        keys = g.cast(g.add_node(Positions(2, 0), [keys], g.fresh_name("key_positions_T")), "float32", name=g.fresh_name("key_positions_f32"))
        slopes = g.constant(g.fresh_name("alibi_slopes"), alibi_slopes(cfg.n_heads))
        bias = g.einsum("h,t->ht", slopes, keys, name=g.fresh_name("alibi_HT"))
        if s.type.dtype != "float32":
            bias = g.cast(bias, s.type.dtype, name=g.fresh_name("alibi_cast"))
        bias = g.reshape(bias, [1, cfg.n_heads, 1, k.type.shape[2]], name=g.fresh_name("alibi_1H1T"))
        s = g.add(s, bias, name=g.fresh_name("alibi_BHST"))
    if causal:
        s = g.add_node(CausalMask(offset, cfg.sliding_window), [s], g.fresh_name("causal_BHST"))
    elif cfg.right_window is not None and cfg.sliding_window is not None:  # a band: a causal mask shifted right by R, widened by R
        band = CausalMask(dim_add(offset, cfg.right_window), cfg.sliding_window + cfg.right_window)
        s = g.add_node(band, [s], g.fresh_name("band_BHST"))
    if mask is not None and mask.type.dtype == "bool":
        neg_inf = g.constant(g.fresh_name("neg_inf"), np.array(-np.inf, dtype=s.dtype))
        s = g.where(mask, s, neg_inf, name=g.fresh_name("masked_BHST"))
    elif mask is not None:  # additive: 0 keeps a key, -inf (or a large negative number) hides it
        s = g.add(s, mask, name=g.fresh_name("masked_BHST"))
    p = g.softmax(s, axis=-1, name=g.fresh_name("probs_BHST"))
    return g.einsum("bhqk,bhkd->bhqd", p, v, name=g.fresh_name("attn_BHSD"))


def sdpa_graph(
    cfg: AttentionConfig,
    batch: Dim = "batch",
    q_len: Dim = "seq",
    kv_len: Dim | None = None,
    causal: bool | None = None,
    mask: bool = False,
    dtype: str = "float32",
    name: str | None = None,
) -> Graph:
    """The attention core alone: inputs ``q [B,Hq,Sq,D]``, ``k``/``v [B,Hkv,Sk,D]``, output ``attn_BHSD [B,Hq,Sq,D]``.

    ``kv_len`` defaults to ``q_len``.  With ``causal`` (default: ``cfg.causal``) and
    ``Sk != Sq`` the mask is aligned bottom-right (offset ``Sk - Sq``), as for a
    KV cache.  ``mask=True`` adds a bool input ``attn_mask [B,1,Sq,Sk]``.
    """
    _check_dtype(dtype)
    kv_len = q_len if kv_len is None else kv_len
    causal = cfg.causal if causal is None else causal
    g = Graph(name or f"sdpa_{cfg.kind.lower()}")
    q = g.input("q_BHSD", [batch, cfg.n_heads, q_len, cfg.hd], dtype)
    k = g.input("k_BHkvTD", [batch, cfg.n_kv_heads, kv_len, cfg.hd], dtype)
    v = g.input("v_BHkvTD", [batch, cfg.n_kv_heads, kv_len, cfg.hd], dtype)
    m = g.input("attn_mask", [batch, 1, q_len, kv_len], "bool") if mask else None
    offset = normalize_dim(dim_sub(kv_len, q_len))
    out = attention_core(g, cfg, q, k, v, causal, offset, m)
    g.output(out)
    return g


def _project(g: Graph, x: Value, prefix: str, cfg: AttentionConfig, seq: Dim, batch: Dim) -> Value:
    """x [B,S,d_model] -> [B,heads,S,D] through ``{prefix}.weight`` (+ bias), a Reshape and a Transpose."""
    tag = prefix[0]
    heads, h = (cfg.n_heads, "H") if tag == "q" else (cfg.n_kv_heads, "Hkv")
    y = g.einsum("bsm,nm->bsn", x, f"{prefix}.weight", name=g.fresh_name(f"{tag}_BSN"))
    if cfg.has_bias(prefix):
        y = g.add(y, f"{prefix}.bias", name=g.fresh_name(f"{tag}_biased_BSN"))
    y = g.reshape(y, [batch, seq, heads, cfg.hd], name=g.fresh_name(f"{tag}_BS{h}D"))
    if cfg.qk_norm_eps is not None and tag in "qk":
        y = rms_norm(g, y, f"{tag}_norm.weight", cfg.qk_norm_eps, cfg.qk_norm_offset, name=g.fresh_name(f"{tag}_normed_BS{h}D"))
    return g.transpose(y, [0, 2, 1, 3], name=g.fresh_name(f"{tag}_B{h}SD"))


MASK_INPUTS = ("none", "bool", "additive")


def mask_input(g: Graph, kind: str, per_query: bool, batch: Dim, q_len: Dim, kv_len: Dim, dtype: str) -> Value | None:
    """The ``attn_mask`` input of a layer (``None`` for ``kind="none"``)."""
    if kind not in MASK_INPUTS:
        raise WeightError(f"mask must be one of {MASK_INPUTS}, got {kind!r}")
    if kind == "none":
        return None
    return g.input("attn_mask", [batch, 1, q_len if per_query else 1, kv_len], "bool" if kind == "bool" else dtype)


def _past_length_mask(g: Graph, cfg: AttentionConfig, q: Value, past_k: Value, k_new: Value, past_lengths: Value, user: Value | None) -> Value:
    """Bool ``[B, 1, Sq, P+Sq]`` for right-padded caches: sequence b's first ``P_b`` cache slots are its past, the
    other past slots are padding, and its new tokens (slots ``P..P+Sq-1``) are tokens ``P_b..P_b+Sq-1``.

    A key is visible when it is valid and, by token position, causal (and inside the window) for the query.
    """
    batch = q.type.shape[0]
    lengths = g.reshape(past_lengths, [batch, 1], name=g.fresh_name("past_lengths_B1"))
    past_slots = g.reshape(
        g.add_node(Positions(2, 0), [past_k], g.fresh_name("past_slot_P")), [1, past_k.type.shape[2]], name=g.fresh_name("past_slot_1P")
    )
    new_index = g.reshape(
        g.add_node(Positions(2, 0), [k_new], g.fresh_name("new_index_S")), [1, k_new.type.shape[2]], name=g.fresh_name("new_index_1S")
    )
    new_tokens = g.add(lengths, new_index, name=g.fresh_name("new_token_BS"))  # P_b + i
    zero = g.constant(g.fresh_name("zero"), np.array(0, np.int64))
    past_tokens = g.add(past_slots, g.mul(lengths, zero), name=g.fresh_name("past_token_BP"))  # slot j is token j, per batch
    token = g.concat([past_tokens, new_tokens], axis=1, name=g.fresh_name("key_token_BT"))
    valid = g.concat(
        [
            g.compare("less", past_slots, lengths, name=g.fresh_name("past_valid_BP")),
            g.compare("greater_equal", new_tokens, zero, name=g.fresh_name("new_valid_BS")),
        ],
        axis=1,
        name=g.fresh_name("key_valid_BT"),
    )
    sk = token.type.shape[1]
    token = g.reshape(token, [batch, 1, 1, sk], name=g.fresh_name("key_token_B11T"))
    keep = g.reshape(valid, [batch, 1, 1, sk], name=g.fresh_name("key_valid_B11T"))
    if cfg.causal:
        query = g.reshape(new_tokens, [batch, 1, q.type.shape[2], 1], name=g.fresh_name("query_token_B1S1"))
        keep = _both(g, keep, g.compare("less_equal", token, query, name=g.fresh_name("causal_keep_B1ST")))
        if cfg.sliding_window is not None:
            start = g.sub(query, g.constant(g.fresh_name("window"), np.array(cfg.sliding_window, np.int64)), name=g.fresh_name("window_start_B1S1"))
            keep = _both(g, keep, g.compare("greater", token, start, name=g.fresh_name("window_keep_B1ST")))
    return _both(g, keep, user)


def _both(g: Graph, a: Value, b: Value | None) -> Value:
    """``a and b`` for bool values (``a`` alone when ``b`` is None)."""
    if b is None:
        return a
    return g.where(a, b, g.shared_initializer("bool_false", np.array(False)), name=g.fresh_name("keep_both"))


def _rotate(
    g: Graph,
    cfg: AttentionConfig,
    x: Value,
    q: Value,
    k: Value,
    offset: Dim,
    lengths: Value | None = None,
    positions: Value | None = None,
) -> tuple[Value, Value]:
    """Rotary embedding of ``q`` and ``k`` ``[B, heads, S, D]`` at positions ``offset + 0..S-1`` (when ``cfg.rope``).

    Positions are counted over the layer input ``x [B, S, M]``, so Q and K keep a single reader each
    (the optimizer moves the attention scale through the rotation into a projection weight).

    With ``lengths`` (each sequence's past length ``P_b``) the new tokens of sequence b sit at ``P_b + 0..S-1``.
    """
    if cfg.rope is None:
        return q, k
    if positions is None and lengths is None:
        positions = g.add_node(Positions(1, offset), [x], g.fresh_name("positions_S"))
    elif positions is None and lengths is not None:
        sq, batch = q.type.shape[2], q.type.shape[0]
        index = g.reshape(g.add_node(Positions(1, 0), [x], g.fresh_name("new_index_S")), [1, sq], name=g.fresh_name("new_index_1S"))
        positions = g.add(g.reshape(lengths, [batch, 1], name=g.fresh_name("past_lengths_B1")), index, name=g.fresh_name("positions_BS"))
    assert positions is not None  # one of the branches above made them
    op = cfg.rope
    return g.add_node(op, [q, positions], g.fresh_name("q_rot_BHSD")), g.add_node(op, [k, positions], g.fresh_name("k_rot_BHkvSD"))


def _project_qkv(g: Graph, cfg: AttentionConfig, x: Value, memory: Value, q_len: Dim, kv_len: Dim, batch: Dim) -> tuple[Value, Value, Value]:
    """Queries from ``x``, keys and values from ``memory`` (``x`` itself for self-attention)."""
    return (
        _project(g, x, "q_proj", cfg, q_len, batch),
        _project(g, memory, "k_proj", cfg, kv_len, batch),
        _project(g, memory, "v_proj", cfg, kv_len, batch),
    )


def _merge_and_project(g: Graph, attn: Value, cfg: AttentionConfig, seq: Dim, batch: Dim) -> Value:
    """[B,Hq,S,D] -> [B,S,Hq*D] -> output projection -> [B,S,d_model]."""
    t = g.transpose(attn, [0, 2, 1, 3], name="attn_BSHD")
    m = g.reshape(t, [batch, seq, cfg.n_heads * cfg.hd], name="attn_BSN")
    if not cfg.has_bias("o_proj"):
        return g.einsum("bsn,mn->bsm", m, "o_proj.weight", name="out_BSM")
    y = g.einsum("bsn,mn->bsm", m, "o_proj.weight", name="proj_BSM")
    return g.add(y, "o_proj.bias", name="out_BSM")


def declare_weights(g: Graph, names: Sequence[str], weights: Mapping[str, np.ndarray]) -> None:
    """Add the initializers ``names`` (relative to ``g``'s current scope), each read from ``weights`` under the
    name the scope gives it: ``q_proj.weight`` inside ``model.layers.3.self_attn.`` is the checkpoint's
    ``model.layers.3.self_attn.q_proj.weight``.  Read-only arrays (memory maps) are shared, not copied."""
    for name in names:
        g.add_initializer(name, weights[g.qualified(name)], copy=False)


def _add_weights(g: Graph, cfg: AttentionConfig, weights: Mapping[str, np.ndarray] | None, seed: int, dtype: str) -> None:
    _check_dtype(dtype)
    if weights is None:
        weights = init_weights(cfg, seed, dtype)
    _check_weights(cfg, weights, dtype)
    for name in weight_shapes(cfg):
        g.add_initializer(name, weights[name], copy=False)  # read-only arrays (memory maps) are shared, not copied


def attention_layer_graph(
    cfg: AttentionConfig,
    batch: Dim = "batch",
    seq: Dim = "seq",
    weights: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    name: str | None = None,
    mask: str = "none",
    mask_per_query: bool = True,
) -> Graph:
    """A full self-attention layer: ``x [B,S,d_model]`` -> Q/K/V projections -> core -> output projection.

    ``weights`` (see :func:`weight_shapes`) default to :func:`init_weights` with ``seed``.
    ``mask``: ``"bool"`` (True keeps a key) or ``"additive"`` adds an input
    ``attn_mask`` of ``[B, 1, S, S]`` (``[B, 1, 1, S]``, a padding mask, with
    ``mask_per_query=False``), applied with the causal mask.
    """
    g = Graph(name or f"attention_{cfg.kind.lower()}")
    _add_weights(g, cfg, weights, seed, dtype)
    x = g.input("x_BSM", [batch, seq, cfg.d_model], dtype)
    g.output(write_self_attention(g, cfg, x, mask_input(g, mask, mask_per_query, batch, seq, seq, dtype)))
    return g


def cross_attention_graph(
    cfg: AttentionConfig,
    batch: Dim = "batch",
    q_len: Dim = "q_len",
    kv_len: Dim = "kv_len",
    weights: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    name: str | None = None,
    mask: str = "none",
    cached_kv: bool = False,
) -> Graph:
    """Cross-attention: queries from ``x [B,Sq,d_model]``, keys/values from ``memory [B,Sk,d_model]``; never causal.

    ``mask``: ``"bool"`` (True keeps a key) or ``"additive"`` adds the encoder's padding mask, an input ``memory_mask
    [B, 1, 1, Sk]``.  ``cached_kv``: the keys and values come in as ``cross_key``/``cross_value [B, Hkv, Sk, D]``
    instead of ``memory`` (a decoder's step, which reads the keys and values :func:`cross_kv_graph` computed once per
    encoder output instead of projecting the encoder output again at every token).
    """
    g = Graph(name or f"cross_attention_{cfg.kind.lower()}")
    _add_weights(g, cfg, weights, seed, dtype)
    x = g.input("x_BSM", [batch, q_len, cfg.d_model], dtype)
    if cached_kv:
        q = _project(g, x, "q_proj", cfg, q_len, batch)
        k, v = (g.input(n, [batch, cfg.n_kv_heads, kv_len, cfg.hd], dtype) for n in ("cross_key", "cross_value"))
    else:
        mem = g.input("memory_BTM", [batch, kv_len, cfg.d_model], dtype)
        q, k, v = _project_qkv(g, cfg, x, mem, q_len, kv_len, batch)
    if mask not in MASK_INPUTS:
        raise WeightError(f"mask must be one of {MASK_INPUTS}, got {mask!r}")
    memory_mask = None if mask == "none" else g.input("memory_mask", [batch, 1, 1, kv_len], "bool" if mask == "bool" else dtype)
    attn = attention_core(g, cfg, q, k, v, causal=False, mask=memory_mask)
    g.output(_merge_and_project(g, attn, cfg, q_len, batch))
    for unused in [n for n in g.initializers if n.startswith(("k_proj.", "v_proj.", "k_norm."))] if cached_kv else []:
        g.remove_initializer(unused)  # the keys and values come projected
    return g


def cross_kv_graph(
    cfg: AttentionConfig,
    batch: Dim = "batch",
    kv_len: Dim = "kv_len",
    weights: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    name: str | None = None,
) -> Graph:
    """The keys and values of cross-attention, computed once per encoder output: ``memory [B,Sk,d_model]`` in,
    ``cross_key``/``cross_value [B,Hkv,Sk,D]`` out (the inputs of :func:`cross_attention_graph` with ``cached_kv``;
    the same ``weights``)."""
    g = Graph(name or f"cross_kv_{cfg.kind.lower()}")
    _add_weights(g, cfg, weights, seed, dtype)
    mem = g.input("memory_BTM", [batch, kv_len, cfg.d_model], dtype)
    k, v = _project(g, mem, "k_proj", cfg, kv_len, batch), _project(g, mem, "v_proj", cfg, kv_len, batch)
    g.rename_value(k.name, "cross_key")
    g.rename_value(v.name, "cross_value")
    g.output("cross_key", "cross_value")
    for unused in [n for n in g.initializers if n.startswith(("q_proj.", "o_proj.", "q_norm."))]:
        g.remove_initializer(unused)  # the queries and the output projection are the step's
    return g


def kv_cache_graph(
    cfg: AttentionConfig,
    batch: Dim = "batch",
    seq: Dim = "seq",
    past: Dim = "past_seq",
    weights: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    name: str | None = None,
    mask: str = "none",
    mask_per_query: bool = True,
    past_lengths: bool = False,
    position_ids: bool = False,
    cache_position: bool = False,
) -> Graph:
    """One step of a layer with a KV cache (prefill when ``past`` is 0, decode when ``seq`` is 1).

    ``mask``/``mask_per_query`` add an ``attn_mask`` input over all ``past + seq`` keys
    (see :func:`attention_layer_graph`).  ``past_lengths`` adds an int64 input
    ``past_lengths [B]`` for a batch of caches of different lengths, each
    right-padded to ``past``: sequence b's past is its first ``P_b`` cache
    slots, its new tokens are tokens ``P_b..P_b+seq-1`` (RoPE positions
    included), padding slots are hidden, and the causal mask and window follow
    token positions, so ragged caches decode in one step.  ``position_ids`` adds
    an int64 input ``position_ids [B, seq]`` that RoPE uses instead (the causal
    mask still follows cache slots).

    Inputs ``x [B,S,d_model]``, ``past_key``/``past_value [B,Hkv,P,D]``; outputs
    ``out_BSM [B,S,d_model]`` then ``present_key``/``present_value [B,Hkv,P+S,D]``.
    Query i (token P+i) sees keys ``j <= i + P`` when ``cfg.causal``.

    ``cache_position`` makes the cache a fixed-capacity one (``P`` is then its capacity): an int64 input
    ``cache_position [S]`` names the slots the new tokens are written to, the presents keep the past's shape
    ``[B,Hkv,P,D]``, query i sees slots ``j <= cache_position[i]``, and ``attn_mask`` covers the P slots.
    """
    g = Graph(name or f"kv_cache_{cfg.kind.lower()}")
    _add_weights(g, cfg, weights, seed, dtype)
    x = g.input("x_BSM", [batch, seq, cfg.d_model], dtype)
    past_k = g.input("past_key", [batch, cfg.n_kv_heads, past, cfg.hd], dtype)
    past_v = g.input("past_value", [batch, cfg.n_kv_heads, past, cfg.hd], dtype)
    m = mask_input(g, mask, mask_per_query, batch, seq, past if cache_position else dim_add(past, seq), dtype)
    lengths = g.input("past_lengths", [batch], "int64") if past_lengths else None
    positions = g.input("position_ids", [batch, seq], "int64") if position_ids else None
    slots = g.input("cache_position", [seq], "int64") if cache_position else None
    g.output(*write_kv_cache_attention(g, cfg, x, past_k, past_v, m, lengths, positions, slots))
    return g


def write_kv_cache_attention(
    g: Graph,
    cfg: AttentionConfig,
    x: Value,
    past_k: Value,
    past_v: Value,
    mask: Value | None = None,
    lengths: Value | None = None,
    positions: Value | None = None,
    cache_position: Value | None = None,
) -> tuple[Value, Value, Value]:
    """Write one KV-cache step of a layer (weights already declared in ``g``'s scope) and return ``out_BSM``,
    ``present_key``, ``present_value``; the arguments are :func:`kv_cache_graph`'s inputs.

    With ``cache_position`` (int64 ``[S]``, the slots the new tokens go to, consecutive) the cache has a fixed
    capacity: the past is ``[B, Hkv, C, D]`` with C the capacity, the new keys and values are written into their
    slots and the presents have the past's shape (``transformers``' static cache); keys are visible by slot
    (``j <= cache_position[i]``) and ``mask`` covers the C slots."""
    if (lengths is not None or cache_position is not None) and mask is not None and mask.type.dtype != "bool":
        raise WeightError("past_lengths and cache_position combine with a bool mask, not an additive one")
    if lengths is not None and cache_position is not None:
        raise WeightError("a step takes past_lengths (ragged caches) or cache_position (a fixed-capacity cache), not both")
    batch, seq = x.type.shape[0], x.type.shape[1]
    past = past_k.type.shape[2]
    q, k_new, v_new = _project_qkv(g, cfg, x, x, seq, seq, batch)
    q, k_new = _rotate(g, cfg, x, q, k_new, offset=past, lengths=lengths, positions=positions)
    if cache_position is not None:
        first = g.add_node(Gather(0), [cache_position, g.shared_initializer("index_first", np.array([0], np.int64))], g.fresh_name("first_slot_1"))
        k = _write_slots(g, past_k, k_new, first, "present_key")
        v = _write_slots(g, past_v, v_new, first, "present_value")
        attn = attention_core(g, cfg, q, k, v, causal=False, mask=_slot_mask(g, cfg, q, past_k, first, mask))
        return _merge_and_project(g, attn, cfg, seq, batch), k, v
    k = g.concat([past_k, k_new], axis=2, name="present_key")
    v = g.concat([past_v, v_new], axis=2, name="present_value")
    if lengths is not None:
        mask = _past_length_mask(g, cfg, q, past_k, k_new, lengths, mask)
    attn = attention_core(g, cfg, q, k, v, cfg.causal and lengths is None, offset=past, mask=mask)
    return _merge_and_project(g, attn, cfg, seq, batch), k, v


def _write_slots(g: Graph, past: Value, new: Value, first: Value, name: str) -> Value:
    """``past [B, H, C, D]`` with slots ``first .. first + S - 1`` replaced by ``new [B, H, S, D]`` (``first``: int64 ``[1]``).

    Every slot is read as ``Where(slot is written, new[slot - first], past[slot])``: one elementwise pass over the cache,
    so the result has the past's shape and may be stored where the past was."""
    slots = g.add_node(Positions(2, 0), [past], g.fresh_name("cache_slot_C"))
    rel = g.sub(slots, first, name=g.fresh_name("slot_from_first_C"))
    new_index = g.add_node(Positions(2, 0), [new], g.fresh_name("new_index_S"))
    last = g.add_node(Gather(0), [new_index, g.shared_initializer("index_last", np.array([-1], np.int64))], g.fresh_name("last_new_1"))
    zero = g.shared_initializer("int64_zero", np.array(0, np.int64))
    after_first = g.compare("greater_equal", rel, zero, name=g.fresh_name("after_first_C"))
    written = _both(g, after_first, g.compare("less_equal", rel, last, name=g.fresh_name("before_last_C")))
    index = g.binary("max", g.binary("min", rel, last, name=g.fresh_name("slot_index_hi_C")), zero, name=g.fresh_name("slot_index_C"))
    taken = g.add_node(Gather(2), [new, index], g.fresh_name("new_at_slot_BHCD"))
    cache_len = past.type.shape[2]
    return g.where(g.reshape(written, [1, 1, cache_len, 1], name=g.fresh_name("written_11C1")), taken, past, name=name)


def _slot_mask(g: Graph, cfg: AttentionConfig, q: Value, past: Value, first: Value, user: Value | None) -> Value:
    """Bool ``[B, 1, S, C]`` for a fixed-capacity cache: query i (slot ``first + i``) sees key slot j when
    ``j <= first + i`` (and inside the window), and where ``user`` (a padding mask over the C slots) keeps it."""
    sq, cache_len = q.type.shape[2], past.type.shape[2]
    query = g.add(first, g.add_node(Positions(2, 0), [q], g.fresh_name("query_index_S")), name=g.fresh_name("query_slot_S"))
    query = g.reshape(query, [1, 1, sq, 1], name=g.fresh_name("query_slot_11S1"))
    key = g.reshape(g.add_node(Positions(2, 0), [past], g.fresh_name("key_slot_C")), [1, 1, 1, cache_len], name=g.fresh_name("key_slot_111C"))
    keep = g.compare("less_equal", key, query, name=g.fresh_name("causal_keep_11SC"))
    if cfg.sliding_window is not None:
        window = g.shared_initializer(f"window_{cfg.sliding_window}", np.array(cfg.sliding_window, np.int64))
        start = g.sub(query, window, name=g.fresh_name("window_start_11S1"))
        keep = _both(g, keep, g.compare("greater", key, start, name=g.fresh_name("window_keep_11SC")))
    return _both(g, keep, user)


def write_self_attention(g: Graph, cfg: AttentionConfig, x: Value, mask: Value | None = None) -> Value:
    """Write a self-attention layer without a cache (weights already declared in ``g``'s scope); returns ``out_BSM``."""
    batch, seq = x.type.shape[0], x.type.shape[1]
    q, k, v = _project_qkv(g, cfg, x, x, seq, seq, batch)
    q, k = _rotate(g, cfg, x, q, k, offset=0)
    attn = attention_core(g, cfg, q, k, v, cfg.causal, 0, mask)
    return _merge_and_project(g, attn, cfg, seq, batch)


def attention_stack_graph(
    cfg: AttentionConfig,
    n_layers: int,
    batch: Dim = "batch",
    seq: Dim = "seq",
    weights: Sequence[Mapping[str, np.ndarray]] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    tie_weights: bool = False,
    name: str | None = None,
    kv_cache: bool = False,
    past: Dim = "past_seq",
) -> Graph:
    """``n_layers`` attention layers in a row, each written under the name scope ``layers.{i}.``.

    Layer ``i``'s weights are named ``layers.{i}.q_proj.weight`` ...; ``weights``
    gives one mapping per layer, else layer ``i`` draws random weights with seed
    ``seed + i``.  ``tie_weights`` builds one layer and shares its (read-only)
    arrays across all layers, as compile-time benchmarks do to stay small.
    With ``kv_cache`` each layer is a :func:`kv_cache_graph` step: inputs
    ``past_key.{i}``/``past_value.{i}``, outputs ``present_key.{i}``/``present_value.{i}``.
    """
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise WeightError(f"n_layers must be a positive int, got {n_layers!r}")
    if weights is not None and len(weights) != n_layers:
        raise WeightError(f"weights has {len(weights)} layer(s), n_layers is {n_layers}")
    if weights is None and not tie_weights:
        check_allocation(n_layers * weight_bytes(cfg, dtype), f"the weights of {n_layers} {cfg.kind} layers in {dtype}")
    g = Graph(name or f"attention_stack_{cfg.kind.lower()}_{n_layers}")
    x = g.input("x_BSM", [batch, seq, cfg.d_model], dtype)
    tied = init_weights(cfg, seed, dtype) if tie_weights and weights is None else None
    for arr in (tied or {}).values():
        arr.setflags(write=False)  # read-only: every layer's initializers share these arrays
    presents: list[tuple[Value, str]] = []
    for i in range(n_layers):
        cache = layer_cache_inputs(g, i, cfg, batch, past, dtype) if kv_cache else None
        with g.scope(f"layers.{i}."):
            _add_weights(g, cfg, tied if tied is not None else None if weights is None else weights[i], seed + i, dtype)
            if cache is not None:
                x, k, v = write_kv_cache_attention(g, cfg, x, *cache)
                presents += [(k, f"present_key.{i}"), (v, f"present_value.{i}")]
            else:
                x = write_self_attention(g, cfg, x)
    name_stack_outputs(g, x, presents)
    return g


def layer_cache_inputs(g: Graph, i: int | None, cfg: AttentionConfig, batch: Dim, past: Dim, dtype: str) -> tuple[Value, Value]:
    """A stack's ``past_key.{i}`` and ``past_value.{i}`` inputs for layer ``i`` (a lone layer's ``past_key`` and ``past_value``: ``i`` None)."""
    suffix = "" if i is None else f".{i}"
    k, v = (g.input(f"past_{kind}{suffix}", [batch, cfg.n_kv_heads, past, cfg.hd], dtype) for kind in ("key", "value"))
    return k, v


def name_stack_outputs(g: Graph, x: Value, presents: Sequence[tuple[Value, str]]) -> None:
    """Name a stack's last hidden state ``out_BSM`` and its caches ``present_*.{i}``, and make them the outputs."""
    g.rename_value(x.name, "out_BSM")
    g.output("out_BSM")
    for value, new in presents:
        g.rename_value(value.name, new)
        g.output(new)
