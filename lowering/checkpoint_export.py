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
import os
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
from graphc.folders import copy_replacing, write_replacing
from graphc.quantize import QuantizeOptions, quantize_weights
from graphc.weights import load_weights, read_json_object, require_regular_file

from .exporter.onnx_export import DEFAULT_OPSET, export

__all__ = ["export_checkpoint", "ExportedCheckpoint", "LOADER_FILES", "OUTPUT_FILES"]

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


OUTPUT_FILES = ("model.onnx", "model.onnx.data", "genai_config.json") + LOADER_FILES
"""Every name an export writes into its folder: what ``force`` replaces or removes in an OUT that held another model."""


def export_checkpoint(
    folder: str | Path,
    out: str | Path,
    layers: int | None = None,
    dtype: str | None = None,
    attention: str = "decomposed",
    opset: int | None = None,
    hints: dict[str, int] | None = None,
    device: str = "cpu",
    force: bool = False,
    quantize: QuantizeOptions | None = None,
) -> ExportedCheckpoint:
    """Export the checkpoint in ``folder`` (``save_pretrained``'s layout) as a whole causal LM into the folder ``out``.

    ``layers``: the first N decoder layers only; ``dtype``: convert the weights (default: as stored); ``quantize``: the
    weight matrices (projections, MLP, LM head) quantized in blocks and written as ``MatMulNBits``
    (:func:`graphc.quantize.quantize_weights`); ``attention``,
    ``opset``, ``hints`` and ``device`` (``"cuda"``: float16 computed in float16, fused CUDA attention) as :func:`~lowering.export`.

    ``out`` must be a new or empty folder, or one this function wrote before; one that holds a checkpoint or
    another export is refused unless ``force`` (then the export's names in it are replaced, and the loader files
    the checkpoint lacks are removed, so no other model's tokenizer stays beside this one).  Every file is written
    by replacing its name (a link planted in ``out`` is replaced, never written through); every file copied from
    the checkpoint is read inside it and checked (the tokenizer parses; the ids ``genai_config.json`` names are in
    the vocabulary).
    """
    ckpt = Checkpoint(Path(folder))
    target = _output_folder(ckpt, out, force)
    config = read_hf_config(ckpt.config)
    lm = causal_lm_config_from_hf(config, layers)
    copies = _loader_sources(ckpt)
    genai = _genai_config(ckpt, lm, config)
    graph = causal_lm_from_hf(config, load_weights(ckpt.folder), n_layers=layers, dtype=dtype, logits="all")
    if quantize is not None:
        graph = quantize_weights(graph, quantize)[0]
    optimized = optimize(graph, hints=hints).graph
    target.mkdir(parents=True, exist_ok=True)
    for stale in OUTPUT_FILES:  # only an OUT that force admitted holds any: nothing of another model stays
        if stale not in copies and os.path.lexists(target / stale):
            os.unlink(target / stale)
    model = export(
        optimized, target / "model.onnx", opset=opset or DEFAULT_OPSET, attention=attention, hints=hints, external_data=True, device=device
    )
    for name, source in copies.items():
        if name == "config.json" and layers is not None:
            write_replacing(target / name, json.dumps(_with_layers(read_json_object(source, "config"), layers), indent=2) + "\n")
        else:
            copy_replacing(source, target / name)
    write_replacing(target / "genai_config.json", json.dumps(genai, indent=2) + "\n")
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return ExportedCheckpoint(target / "model.onnx", len(model.graph.node), version, tuple(copies))


def _output_folder(ckpt: Checkpoint, out: str | Path, force: bool) -> Path:
    """The folder ``out`` checked: named, not a file, not the checkpoint, and holding no other model unless ``force``."""
    if not str(out).strip():
        raise ExportError("the export folder's name is empty; name a folder to write (OUT/)")
    target = Path(out)
    if target.suffix == ".onnx" or (target.exists() and not target.is_dir()):
        raise ExportError(f"{target}: a whole-model export writes a folder (model.onnx, its weights and the loaders' files); name a folder")
    if target.exists() and target.resolve() == ckpt.folder.resolve():
        raise ExportError(f"{target}: export into another folder than the checkpoint's own")
    if target.is_dir() and not force:
        held = [name for name in ("config.json", "model.onnx", "genai_config.json") if os.path.lexists(target / name)]
        weights = sorted(p.name for p in target.glob("*.safetensors"))[:1]
        if held or weights:
            raise ExportError(
                f"{target} already holds a model ({', '.join(held + weights)}); name a new or empty folder, or pass --force "
                "(force=True) to replace it"
            )
    return target


def _loader_sources(ckpt: Checkpoint) -> dict[str, Path]:
    """The loader files the checkpoint has, by name, each read inside the checkpoint folder and checked."""
    found = {name: path for name in LOADER_FILES if (path := ckpt.file(name)) is not None}
    for name, path in found.items():
        require_regular_file(path, name)
        if name.endswith(".json"):
            read_json_object(path, name)
    if "tokenizer.json" in found:
        ckpt.tokenizer()  # parses, or names the file
    return found


def _with_layers(doc: dict[str, Any], layers: int) -> dict[str, Any]:
    """The copied config describes the exported model: its first ``layers`` decoder layers."""
    return {k: (layers if k in ("num_hidden_layers", "n_layer", "num_layers") else v) for k, v in doc.items()}


def _genai_config(ckpt: Checkpoint, lm: CausalLMConfig, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """onnxruntime-genai's description of the exported decoder: names, the head counts of the model graphc built
    (read from the config as the model itself was, by its family), search defaults."""
    attention = lm.layers[0].attention
    defaults = ckpt.generation_defaults()
    eos = defaults["eos_token_id"]
    bos = cfg.get("bos_token_id")
    for field, ids in (("eos_token_id", eos), ("pad_token_id", [defaults["pad_token_id"]]), ("bos_token_id", [bos] if bos is not None else [])):
        bad = [i for i in ids if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < lm.vocab_size)]
        if bad:
            raise ExportError(f"{ckpt.folder}: {field} {bad[0]!r} is not a token id of the model's vocabulary (0..{lm.vocab_size - 1})")
    inputs = {name: name for name in ("input_ids", "attention_mask", "position_ids")}
    inputs |= {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    context = cfg.get("max_position_embeddings", cfg.get("n_positions", 2048))
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise ExportError(f"{ckpt.config}: max_position_embeddings must be a positive int (genai_config's context_length), got {context!r}")
    return {
        "model": {
            "bos_token_id": bos if bos is not None else 0,
            "context_length": context,
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

