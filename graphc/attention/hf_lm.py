"""Whole causal LMs from transformers checkpoints: ``config.json`` and the tensors of ``model.safetensors``.

``causal_lm_config_from_hf`` reads what sits around the decoder stack (vocabulary,
tied LM head, Gemma's embedding scale and final logit softcap);
``causal_lm_weights_from_hf`` gives the tensors graphc's names (Falcon's, Phi-3's,
GPT-NeoX's and GPT-2's are mapped by their family's module, :mod:`graphc.attention.families`; a tied
checkpoint's ``lm_head.weight`` is dropped, as transformers ties it to the
embedding on load, unless its values differ from the embedding's: transformers then unties them, and so does graphc);
``causal_lm_from_hf``
builds the graph from both.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from graphc.dims import Dim
from graphc.errors import WeightError
from graphc.graph import Graph
from graphc.mapped import release_pages
from graphc.prequantized import apply_prequantized, prequantized_layout, read_prequantized
from graphc.weights import load_weights

from .causal_lm import CausalLMConfig, causal_lm_graph
from .families import get_family
from .hf import decoder_configs_from_hf, decoder_weights_from_hf, read_hf_config
from .hf_fields import flag, int_field

__all__ = ["causal_lm_config_from_hf", "causal_lm_weights_from_hf", "causal_lm_from_hf"]


def causal_lm_config_from_hf(config: Mapping[str, Any] | str | Path | Any, n_layers: int | None = None) -> CausalLMConfig:
    """The :class:`CausalLMConfig` of a transformers model config (its first ``n_layers`` layers, default all)."""
    cfg = read_hf_config(config)
    layers = decoder_configs_from_hf(cfg, n_layers)  # checks model_type first
    family = get_family(cfg["model_type"])
    return CausalLMConfig(
        tuple(layers),
        int_field(cfg, "vocab_size", most=1 << 24),
        tie_word_embeddings=flag(cfg, "tie_word_embeddings", family.tied_by_default),
        family=family.model_type,
        **family.lm_fields(cfg, layers[0].attention.d_model),
    )


def causal_lm_weights_from_hf(weights: Mapping[str, Any], config: Mapping[str, Any] | str | Path | Any) -> dict[str, Any]:
    """A checkpoint's tensors under graphc's causal-LM names (see the module doc)."""
    cfg = read_hf_config(config)
    out = decoder_weights_from_hf(weights, cfg)  # the embeddings and head renamed with the layers
    lm = causal_lm_config_from_hf(cfg)
    if lm.tie_word_embeddings and not _unties(out):
        out.pop("lm_head.weight", None)
    return out


def _unties(weights: Mapping[str, Any]) -> bool:
    """Whether a checkpoint whose config ties the LM head to the embedding holds an ``lm_head.weight`` of other values:
    transformers then does not tie them (it warns) and computes the logits with ``lm_head.weight``, and so does graphc."""
    head, table = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if head is None or table is None or head is table:
        return False
    if np.shape(head) != np.shape(table):
        return True
    head, table = np.asarray(head).reshape(len(head), -1), np.asarray(table).reshape(len(table), -1)
    rows = max(1, (64 << 20) // max(1, head[:1].nbytes))
    for r in range(0, len(head), rows):  # a few rows at a time, each read's pages then leaving the resident set (they stay cached)
        differ = not np.array_equal(head[r : r + rows], table[r : r + rows])
        release_pages(head[r : r + rows])
        release_pages(table[r : r + rows])
        if differ:
            return True
    return False


def _checkpoint_dtype(weights: Mapping[str, Any]) -> str:
    table = weights.get("model.embed_tokens.weight")
    if table is None:
        raise WeightError("the checkpoint has no token embedding (model.embed_tokens.weight, or transformer.word_embeddings.weight for Falcon)")
    return str(getattr(table, "dtype", np.asarray(table).dtype))


def _layer_index(name: str) -> int:
    """The layer a ``model.layers.{i}.*`` tensor belongs to; -1 for tensors outside the layers."""
    if not name.startswith("model.layers."):
        return -1
    index = name.split(".")[2]
    if not index.isdigit():
        raise WeightError(f"tensor {name!r}: {index!r} is not a layer number (expected model.layers.<int>.<name>)")
    return int(index)


def causal_lm_from_hf(
    config: Mapping[str, Any] | str | Path | Any,
    weights: Mapping[str, Any],
    n_layers: int | None = None,
    dtype: str | None = None,
    logits: str = "all",
    batch: Dim = "batch",
    seq: Dim = "seq",
    past: Dim = "past_seq",
    cache: str = "dynamic",
) -> Graph:
    """The whole model of a transformers checkpoint as a :func:`~graphc.attention.causal_lm_graph`.

    ``weights`` maps the checkpoint's tensor names to arrays (:func:`graphc.load_weights` of a
    folder or ``.safetensors`` file, or a ``state_dict``); ``dtype`` defaults to the embedding's, and
    another one converts every floating tensor (a copy).  An AWQ or GPTQ checkpoint's layers are read packed
    (:mod:`graphc.prequantized`).  ``cache="static"``: a fixed-capacity cache (see
    :func:`~graphc.attention.causal_lm_graph`).
    """
    cfg = read_hf_config(config)
    lm = causal_lm_config_from_hf(cfg, n_layers)
    layout = prequantized_layout(cfg)
    if layout is not None:  # AWQ / GPTQ: the builder places stand-ins, then each reads its packed bytes
        weights, packed = read_prequantized(layout, weights, dtype)
        stand_ins = {name: weights[name] for name in packed}
    named = causal_lm_weights_from_hf(weights, cfg)
    if lm.tie_word_embeddings and "lm_head.weight" in named:  # both tables present, with other values: not tied (transformers' rule)
        warnings.warn(
            "config.json ties lm_head.weight to model.embed_tokens.weight but the checkpoint holds both with different values; "
            "as transformers does, they are not tied (the logits use lm_head.weight)",
            stacklevel=2,
        )
        lm = dataclasses.replace(lm, tie_word_embeddings=False)
    stored = _checkpoint_dtype(named)
    if dtype is not None and dtype != stored:
        named = load_weights(named, dtype=dtype)  # every floating tensor converted (a copy)
    dtype = dtype or stored
    wanted = lm.n_layers
    kept = {n: a for n, a in named.items() if _layer_index(n) < wanted}
    graph = causal_lm_graph(lm, kept, batch=batch, seq=seq, past=past, dtype=dtype, logits=logits, cache=cache)
    if layout is None:
        return graph
    return apply_prequantized(graph, packed, {n: a for n, a in stand_ins.items() if _layer_index(n) < wanted})
