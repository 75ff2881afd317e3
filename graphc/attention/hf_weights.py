"""Helpers for renaming a checkpoint's tensors to graphc's names (the Llama names: ``model.layers.{i}.self_attn.q_proj.weight`` ...).

Llama, Mistral, Qwen2/3 and Gemma 2 checkpoints already use those names.  The
other families' modules (:mod:`graphc.attention.families`) rename theirs with
these helpers, fused tensors split in their own layouts:

* **Falcon** ``transformer.h.{i}.self_attention.query_key_value``: per head
  ``[q, k, v]`` (MHA), all queries then one key and one value (multi-query), or per
  KV group ``[queries..., key, value]`` (new decoder architecture);
* **Phi-3** ``self_attn.qkv_proj`` (all queries, all keys, all values) and
  ``mlp.gate_up_proj`` (gate rows, then up rows);
* **GPT-NeoX** ``attention.query_key_value`` (per head ``[q, k, v]``),
  ``embed_in``/``embed_out``/``final_layer_norm``;
* **GPT-2** ``Conv1D`` weights stored ``[in, out]`` (transposed here, a copy),
  ``c_attn`` (queries, keys, values), ``wte``/``wpe``/``ln_f``.

Each family's ``rename`` takes the weights mapping and the head geometry and returns a new
mapping; a tensor a family does not know is a :class:`WeightError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from graphc.errors import WeightError

__all__ = ["DENSE_LAYER", "split_rows", "per_head_qkv", "rename_layers", "renamed_module"]


DENSE_LAYER = {
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


def per_head_qkv(arr: Any, heads: int, hd: int) -> tuple[Any, Any, Any]:
    """Rows laid out per head as ``[q, k, v]`` (Falcon MHA, GPT-NeoX)."""
    slots = arr.reshape(heads, 3, hd, *arr.shape[1:])
    return tuple(slots[:, i].reshape(heads * hd, *arr.shape[1:]) for i in range(3))


def renamed_module(modules: Mapping[str, str], module: str, kind: str, arr: Any, family: str) -> dict[str, Any]:
    """``{graphc name: arr}`` for a layer tensor whose module ``modules`` maps one to one; an unknown module is a :class:`WeightError`."""
    if module not in modules:
        raise WeightError(f"tensor {module}.{kind}: no graphc name for {family} module {module!r}")
    return {f"{modules[module]}.{kind}": arr}


def rename_layers(
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
