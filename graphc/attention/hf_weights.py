"""A checkpoint's tensors under graphc's names, family by family (the Llama names: ``model.layers.{i}.self_attn.q_proj.weight`` ...).

Llama, Mistral, Qwen2/3 and Gemma 2 checkpoints already use those names.  The
others are renamed here, fused tensors split in their own layouts:

* **Falcon** ``transformer.h.{i}.self_attention.query_key_value``: per head
  ``[q, k, v]`` (MHA), all queries then one key and one value (multi-query), or per
  KV group ``[queries..., key, value]`` (new decoder architecture);
* **Phi-3** ``self_attn.qkv_proj`` (all queries, all keys, all values) and
  ``mlp.gate_up_proj`` (gate rows, then up rows);
* **GPT-NeoX** ``attention.query_key_value`` (per head ``[q, k, v]``),
  ``embed_in``/``embed_out``/``final_layer_norm``;
* **GPT-2** ``Conv1D`` weights stored ``[in, out]`` (transposed here, a copy),
  ``c_attn`` (queries, keys, values), ``wte``/``wpe``/``ln_f``.

Every function takes the weights mapping and the head geometry and returns a new
mapping; a tensor a family does not know is a :class:`WeightError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from graphc.errors import WeightError

__all__ = ["rename_falcon", "rename_phi3", "rename_gpt_neox", "rename_gpt2", "split_rows"]


_DENSE_LAYER = {
    "mlp.dense_h_to_4h": "mlp.up_proj",
    "mlp.dense_4h_to_h": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}
"""The MLP and norm modules Falcon and GPT-NeoX name alike."""


def split_rows(arr: Any, sizes: list[int]) -> list[Any]:
    """``arr`` cut along its first axis into consecutive blocks of ``sizes`` rows (views)."""
    if sum(sizes) != arr.shape[0]:
        raise WeightError(f"a fused tensor of {arr.shape[0]} rows cannot be split into {sizes}")
    bounds = np.cumsum([0, *sizes])
    return [arr[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _per_head_qkv(arr: Any, heads: int, hd: int) -> tuple[Any, Any, Any]:
    """Rows laid out per head as ``[q, k, v]`` (Falcon MHA, GPT-NeoX)."""
    slots = arr.reshape(heads, 3, hd, *arr.shape[1:])
    return tuple(slots[:, i].reshape(heads * hd, *arr.shape[1:]) for i in range(3))


def _layers(
    weights: Mapping[str, Any], layer_prefix: str, outside: Mapping[str, str], rename: Callable[[str, str, Any], dict[str, Any]], family: str
) -> dict[str, Any]:
    """Apply ``rename(module, kind, arr)`` to each ``{layer_prefix}{i}.{module}.{kind}`` tensor, map ``outside`` names as they are."""
    out: dict[str, Any] = {}
    for name, arr in weights.items():
        if name in outside:
            out[outside[name]] = arr
            continue
        if not name.startswith(layer_prefix):
            if name.endswith(("inv_freq", "masked_bias")):
                continue  # buffers some checkpoints carry
            raise WeightError(f"tensor {name!r}: no graphc name for it in a {family} checkpoint")
        layer, _, rest = name[len(layer_prefix) :].partition(".")
        if not layer.isdigit() or "." not in rest:
            raise WeightError(f"tensor {name!r}: expected {layer_prefix}<layer number>.<module>.<weight or bias> in a {family} checkpoint")
        module, kind = rest.rsplit(".", 1)
        if kind == "inv_freq":
            continue  # a rotary buffer: graphc computes the frequencies from the config
        out.update({f"model.layers.{layer}.{k}": v for k, v in rename(module, kind, arr).items()})
    return out


def rename_falcon(weights: Mapping[str, Any], heads: int, kv: int, hd: int, new_arch: bool) -> dict[str, Any]:
    """Falcon's tensors (``transformer.*``) under graphc's names."""
    group = heads // kv
    modules = {**_DENSE_LAYER, "self_attention.dense": "self_attn.o_proj", "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"}

    def rename(module: str, kind: str, arr: Any) -> dict[str, Any]:
        if module == "self_attention.query_key_value":
            rows = (heads + 2 * kv) * hd  # every layout: the query heads, then one K and one V per KV head
            if heads % kv or np.shape(arr)[0] != rows:
                raise WeightError(
                    f"Falcon {module}.{kind} has {np.shape(arr)[0]} rows; {heads} query heads and {kv} KV heads of {hd} take {rows}"
                    + (f" (and {heads} query heads are not a multiple of {kv} KV heads)" if heads % kv else "")
                )
            if new_arch:
                slots = arr.reshape(kv, group + 2, hd, *arr.shape[1:])
                parts = (slots[:, :group], slots[:, group], slots[:, group + 1])
            elif kv == 1:
                rows = arr.reshape(-1, hd, *arr.shape[1:])
                parts = (rows[:heads], rows[heads], rows[heads + 1])
            else:
                parts = _per_head_qkv(arr, heads, hd)
            return {f"self_attn.{p}.{kind}": part.reshape(-1, *arr.shape[1:]) for p, part in zip(("q_proj", "k_proj", "v_proj"), parts)}
        if module not in modules:
            raise WeightError(f"tensor {module}.{kind}: no graphc name for Falcon module {module!r}")
        return {f"{modules[module]}.{kind}": arr}

    outside = {
        "transformer.ln_f.weight": "model.norm.weight",
        "transformer.ln_f.bias": "model.norm.bias",
        "transformer.word_embeddings.weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
    }
    return _layers(weights, "transformer.h.", outside, rename, "Falcon")


def rename_phi3(weights: Mapping[str, Any], heads: int, kv: int, hd: int, intermediate: int) -> dict[str, Any]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` split; every other name is already graphc's."""
    out: dict[str, Any] = {}
    for name, arr in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            stem = name[: -len("qkv_proj.weight")]
            q, k, v = split_rows(arr, [heads * hd, kv * hd, kv * hd])
            out.update({f"{stem}q_proj.weight": q, f"{stem}k_proj.weight": k, f"{stem}v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            stem = name[: -len("gate_up_proj.weight")]
            gate, up = split_rows(arr, [intermediate, intermediate])
            out.update({f"{stem}gate_proj.weight": gate, f"{stem}up_proj.weight": up})
        else:
            out[name] = arr
    return out


def rename_gpt_neox(weights: Mapping[str, Any], heads: int, hd: int) -> dict[str, Any]:
    """GPT-NeoX's tensors (``gpt_neox.*``, ``embed_out``) under graphc's names."""
    modules = {**_DENSE_LAYER, "attention.dense": "self_attn.o_proj"}

    def rename(module: str, kind: str, arr: Any) -> dict[str, Any]:
        if module == "attention.query_key_value":
            return {f"self_attn.{p}.{kind}": part for p, part in zip(("q_proj", "k_proj", "v_proj"), _per_head_qkv(arr, heads, hd))}
        if module in ("attention.bias", "attention.masked_bias") or kind == "inv_freq":
            return {}
        if module not in modules:
            raise WeightError(f"tensor {module}.{kind}: no graphc name for GPT-NeoX module {module!r}")
        return {f"{modules[module]}.{kind}": arr}

    outside = {
        "gpt_neox.final_layer_norm.weight": "model.norm.weight",
        "gpt_neox.final_layer_norm.bias": "model.norm.bias",
        "gpt_neox.embed_in.weight": "model.embed_tokens.weight",
        "embed_out.weight": "lm_head.weight",  # older checkpoints; transformers 5 writes lm_head
        "lm_head.weight": "lm_head.weight",
    }
    return _layers(weights, "gpt_neox.layers.", outside, rename, "GPT-NeoX")


def rename_gpt2(weights: Mapping[str, Any], d_model: int) -> dict[str, Any]:
    """GPT-2's tensors (``transformer.*``) under graphc's names; its ``Conv1D`` weights ``[in, out]`` are transposed (copied)."""
    modules = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}

    def linear(arr: Any, kind: str) -> Any:
        return np.ascontiguousarray(np.asarray(arr).T) if kind == "weight" else arr

    def rename(module: str, kind: str, arr: Any) -> dict[str, Any]:
        if module == "attn.c_attn":
            parts = split_rows(np.asarray(arr).T if kind == "weight" else arr, [d_model] * 3)
            return {f"self_attn.{p}.{kind}": np.ascontiguousarray(part) for p, part in zip(("q_proj", "k_proj", "v_proj"), parts)}
        if module in ("ln_1", "ln_2"):
            return {f"{'input_layernorm' if module == 'ln_1' else 'post_attention_layernorm'}.{kind}": arr}
        if module == "attn" and kind in ("bias", "masked_bias"):
            return {}  # the causal-mask buffer of older checkpoints
        if module not in modules:
            raise WeightError(f"tensor {module}.{kind}: no graphc name for GPT-2 module {module!r}")
        return {f"{modules[module]}.{kind}": linear(arr, kind)}

    outside = {
        "transformer.ln_f.weight": "model.norm.weight",
        "transformer.ln_f.bias": "model.norm.bias",
        "transformer.wte.weight": "model.embed_tokens.weight",
        "transformer.wpe.weight": "model.embed_positions.weight",
        "lm_head.weight": "lm_head.weight",
    }
    return _layers(weights, "transformer.h.", outside, rename, "GPT-2")
