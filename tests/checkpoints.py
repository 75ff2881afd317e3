"""A tiny Llama checkpoint folder written without transformers: graphc's seeded weights under transformers' names,
a WordLevel ``tokenizer.json`` and the JSON files ``save_pretrained`` writes beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import graphc
from graphc.attention.hf_lm import causal_lm_config_from_hf

WORDS = "the cat sat on a mat and dog ran to big red house in sun was very happy small bird sang song".split()
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": len(VOCAB),
    "bos_token_id": 1,
    "eos_token_id": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def weights(config: dict[str, Any] | None = None, varied: bool = False) -> dict[str, np.ndarray]:
    """Seeded weights of the model ``config`` describes, by their transformers names; ``varied``: unit-scale ones
    (norms near 1, matrices of 0.3 standard deviation), so greedy tokens vary from step to step."""
    lm = graphc.causal_lm_graph(causal_lm_config_from_hf(config or CONFIG), seed=0)
    out = {k: np.ascontiguousarray(v) for k, v in lm.initializers.items() if k.endswith(".weight")}
    if varied:
        rng = np.random.default_rng(0)
        varied_weight = lambda v: 1.0 + 0.1 * rng.standard_normal(v.shape) if v.ndim == 1 else 0.3 * rng.standard_normal(v.shape)  # noqa: E731
        out = {k: varied_weight(v).astype(v.dtype) for k, v in out.items()}
    return out


def tokenizer() -> Any:
    """A ``tokenizers`` WordLevel tokenizer over :data:`VOCAB` that adds ``<s>`` in front."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def write_tokenizer(path: Path) -> None:
    """:func:`tokenizer` as ``tokenizer.json``."""
    tokenizer().save(str(path))


def write_checkpoint(folder: Path, config: dict[str, Any] | None = None, safetensors: bool = True, varied: bool = False) -> Path:
    """``folder`` as ``save_pretrained`` lays a model and its tokenizer out (``safetensors=False``: no weights file;
    ``varied``: see :func:`weights`)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **(config or {})}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    write_tokenizer(folder / "tokenizer.json")
    if safetensors:
        save_file(weights(config, varied), str(folder / "model.safetensors"))
    return folder
