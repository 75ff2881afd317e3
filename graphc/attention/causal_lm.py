"""Whole causal language models: token embedding, a decoder stack with a KV cache per layer, final norm, LM head.

The graph takes and returns what optimum's ``text-generation-with-past`` exports
take and return, so a decode loop written for those runs graphc's export as it is:

* inputs ``input_ids [batch, seq]`` (int64), ``attention_mask [batch, past_seq + seq]``
  (int64, 1 for a token, 0 for padding), ``position_ids [batch, seq]`` (int64, RoPE
  positions), and per layer ``past_key_values.{i}.key`` / ``past_key_values.{i}.value``
  ``[batch, kv_heads, past_seq, head_dim]`` (``past_seq`` 0 for the prefill);
* outputs ``logits [batch, seq, vocab]`` (``[batch, 1, vocab]`` with ``logits="last"``)
  and ``present.{i}.key`` / ``present.{i}.value`` ``[batch, kv_heads, past_seq + seq, head_dim]``.

Key ``j`` is visible to query ``i`` (cache slot ``past_seq + i``) when ``j <= past_seq + i``
and ``attention_mask[b, j]`` is 1, so left-padded batches decode in one step; a query
row with no visible key (a padding token) gives zeros.  Weight names are transformers'
(``model.embed_tokens.weight``, ``model.layers.{i}...``, ``model.norm.weight``,
``lm_head.weight``), so a Llama-like model's ``state_dict`` is the weights mapping.

With ``cache="static"`` the cache has a fixed capacity, as transformers' ``StaticCache`` and
onnxruntime-genai's shared past/present buffers: ``past_seq`` is the capacity C, the pasts and
presents are both ``[batch, kv_heads, C, head_dim]`` (so a runtime keeps the cache in buffers allocated
once: graphc's onnxruntime runner, two per layer that the steps write in turn), an extra input
``cache_position [seq]`` (int64) names the slots the new tokens are written to, ``attention_mask`` is
``[batch, C]`` (1 for every slot holding a token, the new ones included), and query ``i`` sees slot ``j``
when ``j <= cache_position[i]`` and the mask keeps it.  Every step then has the same shapes, which is
what CUDA graphs need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphc.dims import Dim, dim_add, eval_dim
from graphc.errors import AttentionConfigError, WeightError
from graphc.graph import Graph, Value
from graphc.memory import check_allocation
from graphc.ops import check_dtype
from graphc.tensor_ops import Gather

from .decoder import DecoderConfig, SharedInputs, check_weight, decoder_weight_shapes, init_decoder_weights, write_decoder_stack

__all__ = [
    "CausalLMConfig",
    "causal_lm_graph",
    "causal_lm_weight_shapes",
    "init_causal_lm_weights",
    "LOGITS_KINDS",
    "CACHE_KINDS",
    "cache_input_names",
]

CACHE_KINDS = ("dynamic", "static")
"""``cache="dynamic"``: the presents are the pasts with the new positions appended (``[batch, kv_heads, past_seq + seq,
head_dim]``); ``"static"``: a fixed-capacity cache, the presents have the pasts' shape (see the module doc)."""

LOGITS_KINDS = ("all", "last")
"""``logits="all"``: one row per input position (as optimum's exports); ``"last"``: the last position only, what greedy decoding reads."""


@dataclass(frozen=True)
class CausalLMConfig:
    """A decoder-only language model: its layers, vocabulary and the pieces around the stack.

    ``embedding_scale`` multiplies the token embeddings (Gemma: ``sqrt(hidden_size)``, rounded to the
    model's dtype as transformers does); ``position_embeddings`` ``N`` adds learned absolute position
    embeddings ``model.embed_positions.weight [N, hidden]`` read at ``position_ids`` (GPT-2);
    ``tie_word_embeddings`` uses ``model.embed_tokens.weight`` as the LM head; ``final_logit_softcap``
    ``c`` maps logits to ``c * tanh(logits / c)`` (Gemma 2).
    """

    layers: tuple[DecoderConfig, ...]
    vocab_size: int
    tie_word_embeddings: bool = False
    embedding_scale: float | None = None
    final_logit_softcap: float | None = None
    position_embeddings: int | None = None
    family: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or not all(isinstance(c, DecoderConfig) for c in self.layers):
            raise AttentionConfigError(f"layers must be a non-empty sequence of DecoderConfig, got {self.layers!r}")
        if len({c.attention.d_model for c in self.layers}) != 1:
            raise AttentionConfigError("every layer of a causal LM has the same hidden size")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise AttentionConfigError(f"vocab_size must be an int > 0, got {self.vocab_size!r}")
        n = self.position_embeddings
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise AttentionConfigError(f"position_embeddings must be an int > 0 or None, got {n!r}")
        for name in ("embedding_scale", "final_logit_softcap"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
                raise AttentionConfigError(f"{name} must be a positive number or None, got {v!r}")

    @property
    def d_model(self) -> int:
        """The hidden size."""
        return self.layers[0].attention.d_model

    @property
    def n_layers(self) -> int:
        """The number of decoder layers."""
        return len(self.layers)


def cache_input_names(i: int) -> tuple[str, str]:
    """Layer ``i``'s cache inputs, as optimum names them."""
    return f"past_key_values.{i}.key", f"past_key_values.{i}.value"


def causal_lm_weight_shapes(cfg: CausalLMConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every weight of the model (transformers' names)."""
    d = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    if cfg.position_embeddings is not None:
        shapes["model.embed_positions.weight"] = (cfg.position_embeddings, d)
    for i, layer in enumerate(cfg.layers):
        shapes.update({f"model.layers.{i}.{n}": s for n, s in decoder_weight_shapes(layer).items()})
    shapes["model.norm.weight"] = (d,)
    if cfg.layers[-1].norm == "layer":
        shapes["model.norm.bias"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def init_causal_lm_weights(cfg: CausalLMConfig, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Seeded random weights for the whole model (layer ``i`` drawn with seed ``seed + i``)."""
    shapes = causal_lm_weight_shapes(cfg)
    check_allocation(sum(int(np.prod(s)) for s in shapes.values()) * np.dtype(check_dtype(dtype)).itemsize, f"the weights of a causal LM in {dtype}")
    out: dict[str, np.ndarray] = {}
    for i, layer in enumerate(cfg.layers):
        out.update({f"model.layers.{i}.{n}": a for n, a in init_decoder_weights(layer, seed + i, dtype).items()})
    rng = np.random.default_rng(seed + len(cfg.layers))
    d = cfg.d_model
    out["model.embed_tokens.weight"] = rng.standard_normal((cfg.vocab_size, d), dtype=np.float32).astype(dtype)
    if cfg.position_embeddings is not None:
        out["model.embed_positions.weight"] = (0.1 * rng.standard_normal((cfg.position_embeddings, d), dtype=np.float32)).astype(dtype)
    out["model.norm.weight"] = (1.0 - cfg.layers[-1].norm_offset + 0.1 * rng.standard_normal(d, dtype=np.float32)).astype(dtype)
    if cfg.layers[-1].norm == "layer":
        out["model.norm.bias"] = (0.02 * rng.standard_normal(d, dtype=np.float32)).astype(dtype)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (rng.standard_normal((cfg.vocab_size, d), dtype=np.float32) * d**-0.5).astype(dtype)
    return out


def _check_weights(cfg: CausalLMConfig, weights: Mapping[str, np.ndarray], dtype: str) -> None:
    """The weights outside the layers (the stack checks its own)."""
    shapes = causal_lm_weight_shapes(cfg)
    for name in ("model.embed_tokens.weight", "model.embed_positions.weight", "lm_head.weight"):
        if name not in shapes:
            continue
        if name not in weights:
            hint = " (or tie_word_embeddings=True)" if name == "lm_head.weight" else ""
            raise WeightError(f"causal LM weights: missing {name!r}{hint}")
        check_weight(name, weights[name], shapes[name], dtype)


def _constant(g: Graph, base: str, value: float | int, dtype: str) -> Value:
    return g.constant(g.fresh_name(base), np.array(value, dtype=dtype))


def _no_wrap(g: Graph, index: Value, table: Value, name: str) -> Value:
    """``index`` with every negative entry replaced by the table's row count.

    A table lookup (ONNX ``Gather``) counts a negative index from the end: token
    ``-1`` would silently read the last row.  Made out of range instead, it fails on
    every backend and in the exported model (onnxruntime: "indices element out of data bounds").
    """
    rows = eval_dim(g.types[table.name].shape[0], {})  # a weight: static
    negative = g.compare("less", index, _constant(g, f"{name}_min", 0, "int64"), name=f"{name}_negative")
    return g.where(negative, _constant(g, f"{name}_out_of_range", rows, "int64"), index, name=f"{name}_checked")


def causal_lm_graph(
    cfg: CausalLMConfig,
    weights: Mapping[str, np.ndarray] | None = None,
    batch: Dim = "batch",
    seq: Dim = "seq",
    past: Dim = "past_seq",
    seed: int = 0,
    dtype: str = "float32",
    logits: str = "all",
    name: str | None = None,
    cache: str = "dynamic",
) -> Graph:
    """The whole model as one graph, one step of a decode loop (prefill when ``past`` is 0): see the module doc for its interface.

    ``weights`` maps transformers' names to arrays (default: :func:`init_causal_lm_weights` with ``seed``);
    ``logits`` is one of :data:`LOGITS_KINDS`; ``cache`` one of :data:`CACHE_KINDS`: ``"static"`` gives the step a
    fixed-capacity cache (``past`` is then the capacity), as the module doc describes.
    """
    if logits not in LOGITS_KINDS:
        raise AttentionConfigError(f"logits must be one of {LOGITS_KINDS}, got {logits!r}")
    if cache not in CACHE_KINDS:
        raise AttentionConfigError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
    check_dtype(dtype)
    weights = init_causal_lm_weights(cfg, seed, dtype) if weights is None else weights
    _check_weights(cfg, weights, dtype)
    g = Graph(name or f"causal_lm_{cfg.family or 'decoder'}_{cfg.n_layers}")
    ids = g.input("input_ids", [batch, seq], "int64")
    total = past if cache == "static" else dim_add(past, seq)
    mask = g.input("attention_mask", [batch, total], "int64")
    positions = g.input("position_ids", [batch, seq], "int64")
    slots = g.input("cache_position", [seq], "int64") if cache == "static" else None
    caches: list[tuple[Value, Value]] = []
    for i, layer in enumerate(cfg.layers):
        shape = [batch, layer.attention.n_kv_heads, past, layer.attention.hd]
        key, value = cache_input_names(i)
        caches.append((g.input(key, shape, dtype), g.input(value, shape, dtype)))
    table = g.add_initializer("model.embed_tokens.weight", weights["model.embed_tokens.weight"], copy=False)
    x = g.add_node(Gather(0), [table, _no_wrap(g, ids, table, "input_ids")], "inputs_embeds_BSM")
    if cfg.embedding_scale is not None:
        x = g.mul(x, _constant(g, "embedding_scale", cfg.embedding_scale, dtype), name="scaled_embeds_BSM")
    if cfg.position_embeddings is not None:
        table = g.add_initializer("model.embed_positions.weight", weights["model.embed_positions.weight"], copy=False)
        x = g.add(x, g.add_node(Gather(0), [table, _no_wrap(g, positions, table, "position_ids")], "position_embeds_BSM"), name="embeds_BSM")
    keep = g.compare("greater", mask, _constant(g, "zero", 0, "int64"), name="key_kept_BT")
    padding = g.reshape(keep, [batch, 1, 1, total], name="key_kept_B11T")
    h, presents = write_decoder_stack(g, cfg.layers, x, weights, caches, SharedInputs(padding, None, positions, slots), final_norm=True)
    g.rename_value(h.name, "out_BSM")
    if logits == "last":
        h = g.add_node(Gather(1), [h, g.constant("last_position", np.array([-1], np.int64))], "last_hidden_B1M")
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else g.add_initializer("lm_head.weight", weights["lm_head.weight"], copy=False)
    out_name = "raw_logits" if cfg.final_logit_softcap is not None else "logits"
    y = g.einsum("bsm,vm->bsv", h, head, name=out_name)
    if cfg.final_logit_softcap is not None:
        c = cfg.final_logit_softcap
        y = g.tanh(g.div(y, _constant(g, "softcap", c, dtype)), name="tanh_logits")
        y = g.mul(y, _constant(g, "softcap", c, dtype), name="logits")
    g.output(y)
    for i, layer_presents in enumerate(presents):
        for kind, present in zip(("key", "value"), layer_presents):
            g.rename_value(present.name, f"present.{i}.{kind}")
            g.output(f"present.{i}.{kind}")
    return g
