"""A checkpoint folder exported as the whole causal LM, in the folder layout optimum and onnxruntime-genai load.

``export_checkpoint(DIR, OUT)`` writes ``OUT/model.onnx`` (embedding to LM head, one decode step: ``input_ids``,
``attention_mask``, ``position_ids`` and ``past_key_values.{i}.key/value`` in; ``logits [batch, seq, vocab]`` and
``present.{i}.key/value`` out; symbolic batch, sequence and past lengths) with its weights streamed to
``OUT/model.onnx.data`` (any size: no protobuf holds them), and beside it what the loaders read:

- the checkpoint's ``config.json``, ``generation_config.json`` and tokenizer files, copied: optimum's
  ``ORTModelForCausalLM.from_pretrained(OUT)`` loads the folder as its own export (the same input and output names);
- ``genai_config.json``: onnxruntime-genai's ``og.Model(OUT)`` runs the same file with a cache that grows by
  concatenation (``past_present_share_buffer: false``) where genai knows the ``model_type``.

``benchmarks/check_export_loaders.py`` checks both loaders' greedy tokens against ``graphc generate``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from graphc import optimize
from graphc.attention import CausalLMConfig
from graphc.attention.hf import read_hf_config
from graphc.attention.hf_lm import causal_lm_config_from_hf, causal_lm_from_hf
from graphc.checkpoint import Checkpoint
from graphc.errors import ExportError
from graphc.weights import load_weights

from .onnx_export import DEFAULT_OPSET, export

__all__ = ["export_checkpoint", "ExportedCheckpoint", "LOADER_FILES"]

LOADER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
"""The checkpoint's files copied beside the model (those it has)."""


@dataclass(frozen=True)
class ExportedCheckpoint:
    """What :func:`export_checkpoint` wrote: the model, its node count, the opset, and the files copied beside it."""

    model: Path
    nodes: int
    opset: int
    copied: tuple[str, ...]


def export_checkpoint(
    folder: str | Path,
    out: str | Path,
    layers: int | None = None,
    dtype: str | None = None,
    attention: str = "decomposed",
    opset: int | None = None,
    hints: dict[str, int] | None = None,
    device: str = "cpu",
) -> ExportedCheckpoint:
    """Export the checkpoint in ``folder`` (``save_pretrained``'s layout) as a whole causal LM into the folder ``out``.

    ``layers``: the first N decoder layers only; ``dtype``: convert the weights (default: as stored); ``attention``,
    ``opset``, ``hints`` and ``device`` (``"cuda"``: float16 computed in float16, fused CUDA attention) as :func:`~lowering.export`.
    """
    ckpt = Checkpoint(Path(folder))
    target = Path(out)
    if target.suffix == ".onnx" or (target.exists() and not target.is_dir()):
        raise ExportError(f"{target}: a whole-model export writes a folder (model.onnx, its weights and the loaders' files); name a folder")
    if target.resolve() == ckpt.folder.resolve():
        raise ExportError(f"{target}: export into another folder than the checkpoint's own")
    target.mkdir(parents=True, exist_ok=True)
    graph = causal_lm_from_hf(ckpt.config, load_weights(ckpt.folder), n_layers=layers, dtype=dtype, logits="all")
    optimized = optimize(graph, hints=hints).graph
    model = export(
        optimized, target / "model.onnx", opset=opset or DEFAULT_OPSET, attention=attention, hints=hints, external_data=True, device=device
    )
    copied = tuple(name for name in LOADER_FILES if _copy(ckpt.folder / name, target / name))
    if layers is not None:
        _set_layers(target / "config.json", layers)
    genai = _genai_config(ckpt, causal_lm_config_from_hf(ckpt.config, layers), read_hf_config(ckpt.config))
    (target / "genai_config.json").write_text(json.dumps(genai, indent=2) + "\n")
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return ExportedCheckpoint(target / "model.onnx", len(model.graph.node), version, copied)


def _copy(source: Path, dest: Path) -> bool:
    if not source.is_file():
        return False
    shutil.copyfile(source, dest)
    return True


def _set_layers(config: Path, layers: int) -> None:
    """The copied config describes the exported model: its first ``layers`` decoder layers."""
    doc = json.loads(config.read_text())
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in doc:
            doc[key] = layers
    config.write_text(json.dumps(doc, indent=2) + "\n")


def _genai_config(ckpt: Checkpoint, lm: CausalLMConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """onnxruntime-genai's description of the exported decoder: names, the head counts of the model graphc built
    (read from the config as the model itself was, by its family), search defaults."""
    attention = lm.layers[0].attention
    defaults = ckpt.generation_defaults()
    eos = defaults["eos_token_id"]
    inputs = {name: name for name in ("input_ids", "attention_mask", "position_ids")}
    inputs |= {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    context = cfg.get("max_position_embeddings", cfg.get("n_positions", 2048))
    return {
        "model": {
            "bos_token_id": cfg["bos_token_id"] if isinstance(cfg.get("bos_token_id"), int) else 0,
            "context_length": context if isinstance(context, int) else 2048,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": attention.hd,
                "hidden_size": attention.d_model,
                "inputs": inputs,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
                "num_attention_heads": attention.n_heads,
                "num_hidden_layers": len(lm.layers),
                "num_key_value_heads": attention.n_kv_heads,
            },
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": defaults["pad_token_id"],
            "type": str(cfg["model_type"]),
            "vocab_size": lm.vocab_size,
        },
        "search": {
            "do_sample": False,
            "max_length": context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,  # the exported step concatenates its cache: no shared fixed-size buffer
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }

