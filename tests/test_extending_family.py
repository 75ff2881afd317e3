"""A model family of one's own in one file: subclass Family, override what differs from Llama, register it.

The toy family below ("toyllama") writes Llama's model under other tensor names
(``blocks.{i}.wq`` ...), calls its width ``d_model`` in ``config.json``, scales its
embeddings by 2 and ties its head.  graphc builds it from its own config and
tensors, and its logits are Llama's computed by hand from the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from graphc.attention import AttentionConfig, causal_lm_config_from_hf, causal_lm_from_hf, init_causal_lm_weights
from graphc.attention.families import Family, family_names, get_family, register_family, unregister_family
from graphc.errors import UnknownNameError
from lowering import generate, run

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 97, "rope_theta": 10000.0, "tie_word_embeddings": True}  # fmt: skip
NAMES = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
         "mlp.gate_proj.weight": "w1", "mlp.up_proj.weight": "w3", "mlp.down_proj.weight": "w2", "input_layernorm.weight": "norm_a",
         "post_attention_layernorm.weight": "norm_m"}  # fmt: skip


@dataclass(frozen=True)
class ToyLlama(Family):
    """Llama under other names, with embeddings times 2."""

    def lm_fields(self, cfg: Mapping[str, Any], d_model: int) -> dict[str, Any]:
        return {"embedding_scale": 2.0}

    def rename(self, weights: Mapping[str, Any], cfg: Mapping[str, Any], attention: AttentionConfig) -> dict[str, Any]:
        back = {v: k for k, v in NAMES.items()}
        out = {"model.embed_tokens.weight": weights["tok"], "model.norm.weight": weights["final_norm"]}
        for name, arr in weights.items():
            if name.startswith("blocks."):
                _, layer, short = name.split(".")
                out[f"model.layers.{layer}.{back[short]}"] = arr
        return out


@pytest.fixture()
def toy():
    register_family(ToyLlama("toyllama", tied_by_default=True, aliases=(("d_model", "hidden_size"),)))
    yield
    unregister_family("toyllama")


def _toy_checkpoint(llama_weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {"tok": llama_weights["model.embed_tokens.weight"], "final_norm": llama_weights["model.norm.weight"]}
    for name, arr in llama_weights.items():
        if name.startswith("model.layers."):
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            out[f"blocks.{layer}.{NAMES[rest]}"] = arr
    return out


def test_a_registered_family_builds_from_its_own_config_and_tensor_names(toy):
    weights = init_causal_lm_weights(causal_lm_config_from_hf(LLAMA), seed=3)
    toy_config = {**{k: v for k, v in LLAMA.items() if k != "hidden_size"}, "model_type": "toyllama", "d_model": 64}
    model = causal_lm_from_hf(toy_config, _toy_checkpoint(weights))
    assert "toyllama" in family_names() and causal_lm_config_from_hf(toy_config).embedding_scale == 2.0
    # the same model with the embedding table doubled by hand, built as Llama: the toy's scale is the only difference
    doubled = {**weights, "model.embed_tokens.weight": weights["model.embed_tokens.weight"] * 2}
    tied_head = causal_lm_from_hf(LLAMA, doubled)
    feeds = {"input_ids": np.array([[5, 17, 33]]), "attention_mask": np.ones((1, 3), np.int64), "position_ids": np.arange(3)[None]}
    for name in model.inputs:
        if name.startswith("past_key_values."):
            feeds[name] = np.zeros((1, 2, 0, 16), np.float32)
    got = run(model, feeds, "numpy")["logits"]
    # doubling the table doubles the tied head's logits too: undo that on the Llama side
    want_hidden = run(tied_head, feeds, "numpy")["logits"] / 2
    np.testing.assert_allclose(got, want_hidden, rtol=1e-5, atol=1e-5)
    tokens = generate(model, [[5, 17, 33], [7, 1]], 4).new_tokens
    assert tokens.shape == (2, 4)
    np.testing.assert_array_equal(tokens, generate(model, [[5, 17, 33], [7, 1]], 4, backend="ort-cpu").new_tokens)


def test_an_unregistered_family_is_refused_with_the_registered_names(toy):
    unregister_family("toyllama")
    with pytest.raises(UnknownNameError, match=r"model_type.*'toyllama'.*llama"):
        causal_lm_config_from_hf({**LLAMA, "model_type": "toyllama"})
    with pytest.raises(UnknownNameError):
        get_family("toyllama")
