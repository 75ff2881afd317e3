"""transformers configs are read into typed, validated fields: a wrong type or value names the field, never a traceback,
a truncated number or a hang."""

from __future__ import annotations

import json
import time

import pytest

from graphc.attention import decoder_configs_from_hf
from graphc.cli import main
from graphc.errors import AttentionConfigError, GraphcError

BASE = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "sliding_window": 16,
    },
    "gemma2": {
        "model_type": "gemma2",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "sliding_window": 8,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "falcon": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "multi_query": True},
}

CASES = [
    ("llama", {"rope_theta": "abc"}, "rope_theta"),
    ("llama", {"rope_theta": -1.0}, "rope_theta"),
    ("llama", {"rope_scaling": "linear"}, "rope_scaling.*must be an object"),
    ("llama", {"rope_scaling": {"rope_type": "linear"}}, "lacks 'factor'"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
    ("llama", {"rope_scaling": {"rope_type": 3}}, "rope_type must be a string"),
    ("llama", {"hidden_size": "64"}, "hidden_size"),
    ("llama", {"hidden_size": 64.0}, "hidden_size"),
    ("llama", {"num_attention_heads": 0}, "num_attention_heads"),
    ("llama", {"num_key_value_heads": True}, "num_key_value_heads"),
    ("llama", {"intermediate_size": -4}, "intermediate_size"),
    ("llama", {"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ("llama", {"hidden_act": "foo"}, "hidden_act"),
    ("llama", {"hidden_act": 3}, "hidden_act"),
    ("llama", {"attention_bias": "yes"}, "attention_bias"),
    ("llama", {"partial_rotary_factor": 2.0}, "partial_rotary_factor"),
    ("llama", {"num_hidden_layers": 10**8}, "num_hidden_layers.*1..1024"),
    ("llama", {"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ("mistral", {"sliding_window": "abc"}, "sliding_window"),
    ("mistral", {"sliding_window": 4.7}, "sliding_window"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("mistral", {"layer_types": 5}, "layer_types"),
    ("mistral", {"layer_types": ["sliding_attention", "global"]}, "layer_types"),
    ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ("gemma2", {"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
    ("gemma2", {"hidden_activation": "foo"}, "hidden_activation"),
    ("falcon", {"activation": "foo"}, "activation"),
    ("falcon", {"multi_query": "no"}, "multi_query"),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn"),
]


@pytest.mark.parametrize("family, change, words", CASES, ids=[f"{f}-{next(iter(c))}-{i}" for i, (f, c, _) in enumerate(CASES)])
def test_bad_config_fields_are_named(family, change, words):
    cfg = {**BASE[family], **change}
    t0 = time.perf_counter()
    with pytest.raises(GraphcError, match=words):
        decoder_configs_from_hf(cfg)
    assert time.perf_counter() - t0 < 5  # num_hidden_layers: 10**8 hung


@pytest.mark.parametrize("family", sorted(BASE))
def test_the_valid_configs_build(family):
    assert len(decoder_configs_from_hf(BASE[family])) == 2


def test_a_sliding_window_is_never_truncated():
    assert decoder_configs_from_hf(BASE["mistral"])[0].attention.sliding_window == 16
    with pytest.raises(AttentionConfigError, match="must be int, got float 4.7"):
        decoder_configs_from_hf({**BASE["mistral"], "sliding_window": 4.7})


@pytest.mark.parametrize("change", [{"rope_theta": "abc"}, {"num_hidden_layers": 10**8}, {"sliding_window": 4.7, "model_type": "mistral"}])
def test_cli_info_prints_one_line_and_exits_2(tmp_path, capsys, change):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE["llama"], **change}))
    assert main(["info", "--hf-config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graphc: error:"), err
