"""generate and its CLI under awkward input: no hang on special files, no allocation ahead of need, no silent wrong model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import graphc
from graphc import Visibility
from graphc.attention.hf_lm import causal_lm_config_from_hf
from graphc.errors import InputError, SerializationError
from graphc.weights import load_weights
from lowering import export, generate, prepare, run
from lowering.decode import kv_buffers

from conftest import installed

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 97, "rope_theta": 10000.0}  # fmt: skip
PROMPTS = [[5, 17, 33], [7, 1, 90, 44, 12, 60]]


@pytest.fixture(scope="module")
def lm() -> graphc.Graph:
    return graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_in_place_of_a_weights_file_or_config_is_refused_without_reading(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(SerializationError, match="is a FIFO, not a regular file"):
        load_weights(tmp_path)
    with pytest.raises(SerializationError, match="is a FIFO, not a regular file"):
        load_weights(tmp_path / "model.safetensors")
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(SerializationError, match=r"config .*config.json' is a FIFO"):
        graphc.causal_lm_from_hf(tmp_path / "config.json", {})


def test_the_cache_grows_as_tokens_come_not_as_asked(lm):
    """10**9 tokens asked, an eos after the first: nothing is allocated for the tokens that never come."""
    first = int(generate(lm, PROMPTS, 1).new_tokens[0, 0])
    out = generate(lm, PROMPTS[:1], 10**9, eos_token_id=first)
    assert out.new_tokens.tolist() == [[first]]


def test_a_cache_past_its_first_room_gives_the_same_tokens(lm, monkeypatch):
    gen = sys.modules["lowering.generate"]  # the package's `generate` names the function
    want = generate(lm, PROMPTS, 12).new_tokens  # room for every token from the start
    monkeypatch.setattr(gen, "_FIRST_ROOM", 2)  # the buffers move to larger ones several times
    np.testing.assert_array_equal(generate(lm, PROMPTS, 12).new_tokens, want)
    if installed("ort-cpu"):
        np.testing.assert_array_equal(generate(lm, PROMPTS, 12, backend="ort-cpu").new_tokens, want)


def test_a_full_buffer_moves_to_a_larger_one_and_never_overwrites_a_past_still_seen():
    rng = np.random.default_rng(0)
    steps = [rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(5)]
    past = kv_buffers.allocate(1, 2, 2, 4, np.float32)
    history = []
    for s in steps:
        past = kv_buffers.append(past, s)
        history.append(past)
    np.testing.assert_array_equal(past, np.concatenate(steps, axis=2))
    assert kv_buffers.prefix_buffer(past).shape[2] == 8  # 2 -> 4 -> 8
    again = kv_buffers.append(history[1], steps[0])  # a re-run of step 3 from step 2's past: a copy
    np.testing.assert_array_equal(history[2], np.concatenate(steps[:3], axis=2))
    np.testing.assert_array_equal(again, np.concatenate([*steps[:2], steps[0]], axis=2))


def test_several_eos_ids_stop_each_sequence(lm):
    free = generate(lm, PROMPTS, 6).new_tokens
    eos = [int(free[0, 1]), int(free[1, 2])]
    out = generate(lm, PROMPTS, 6, eos_token_id=eos, pad_token_id=0)
    for row, stop in zip(out.new_tokens.tolist(), (1, 2)):
        first = next(i for i, t in enumerate(row) if t in eos)
        assert first <= stop and all(t == 0 for t in row[first + 1 :]), (row, eos)
    with pytest.raises(InputError, match="eos_token_id must be a token id or a list of them"):
        generate(lm, PROMPTS, 2, eos_token_id=[1, "2"])


def test_a_runner_of_another_model_is_refused(lm):
    other = graphc.causal_lm_graph(causal_lm_config_from_hf({**CONFIG, "num_hidden_layers": 1}), seed=0)
    with pytest.raises(InputError, match=r"prepared for graph 'causal_lm_llama_1', not for this graph 'causal_lm_llama_2' \(its inputs differ"):
        generate(lm, PROMPTS, 2, runner=prepare(other, "numpy"))
    wider = graphc.causal_lm_graph(causal_lm_config_from_hf({**CONFIG, "num_key_value_heads": 4}), seed=0)  # the same name
    with pytest.raises(InputError, match=r"prepared for another graph named 'causal_lm_llama_2', not for this graph .*\(input 'past_key_values"):
        generate(lm, PROMPTS, 2, runner=prepare(wider, "numpy"))
    same_structure = graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0)
    assert generate(lm, PROMPTS, 2, runner=prepare(same_structure, "numpy")).new_tokens.shape == (2, 2)


def test_an_empty_prompt_array_is_refused(lm):
    with pytest.raises(InputError, match=r"both at least 1, got int64\[2, 0\]"):
        generate(lm, np.zeros((2, 0), np.int64), 2)


def _cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    import json

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    cmd = [sys.executable, "-m", "graphc", "generate", "--hf-config", str(tmp_path / "config.json"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_cli_refuses_an_id_past_int64_in_one_line(tmp_path):
    proc = _cli("--prompt-ids", "99999999999999999999999", tmp_path=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "token id 99999999999999999999999 is out of range" in proc.stderr.strip().splitlines()[-1]


def test_cli_refuses_an_unknown_shard_backend_before_starting_workers(tmp_path):
    proc = _cli("--prompt-ids", "1,2", "--shards", "2", "--shard-backend", "bogus", tmp_path=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "distributed" not in proc.stderr
    assert "bogus" in proc.stderr and "numpy" in proc.stderr


def _state(lm: graphc.Graph) -> dict[str, np.ndarray]:
    """The seeded model's weights under transformers' names (a Llama graph's weights carry them)."""
    return {k: v for k, v in lm.initializers.items() if k.endswith(".weight")}


def test_rotary_buffers_of_older_checkpoints_are_ignored_as_transformers_does(lm):
    state = {**_state(lm), "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    rebuilt = graphc.causal_lm_from_hf(CONFIG, state)
    np.testing.assert_array_equal(generate(rebuilt, PROMPTS, 4).new_tokens, generate(lm, PROMPTS, 4).new_tokens)


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("model.layers.x.foo", np.ones(2, np.float32), r"'x' is not a layer number \(expected model.layers.<int>.<name>\)"),
        (7, np.ones(2, np.float32), "weight names must be strings, got int 7"),
    ],
)
def test_bad_weight_names_are_named(lm, name, value, words):
    from graphc.errors import WeightError

    with pytest.raises(WeightError, match=words):
        graphc.causal_lm_from_hf(CONFIG, {**_state(lm), name: value})


@pytest.mark.parametrize("rows, heads, words", [(40, 4, "has 40 rows; 4 query heads and 1 KV heads of 16 take 96"), (96, 3, "take 80")])
def test_a_falcon_query_key_value_of_the_wrong_size_is_named(rows, heads, words):
    from graphc.attention.families.falcon import rename_falcon
    from graphc.errors import WeightError

    weights = {"transformer.h.0.self_attention.query_key_value.weight": np.zeros((rows, 64), np.float32)}
    with pytest.raises(WeightError, match=words):
        rename_falcon(weights, heads, 1, 16, new_arch=False)
    with pytest.raises(WeightError, match=r"expected transformer.h.<layer number>.<module>.<weight or bias>"):
        rename_falcon({"transformer.h.x": np.zeros(2)}, 4, 1, 16, new_arch=False)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda q, k, v: (q.astype(np.float64), k, v), r"q must be a C-contiguous float32 array \[L, rows or keys, D\], got float64"),
        (lambda q, k, v: (q, k[:, ::2], v[:, ::2]), "k must be a C-contiguous float32 array .* strided"),
        (lambda q, k, v: (q, k, np.ones((2, 3, 8), np.float32)), "do not fit"),
    ],
)
def test_the_compiled_decode_kernel_refuses_operands_outside_its_contract(change, words):
    from graphc.errors import ExecutionError
    from lowering.kernels import compiled

    if not compiled.use_compiled():
        pytest.skip("numba is not installed")
    q, k, v = np.ones((2, 4, 16), np.float32), np.ones((2, 8, 16), np.float32), np.ones((2, 8, 8), np.float32)
    with pytest.raises(ExecutionError, match=words):
        compiled.decode_attention(*change(q, k, v), 1, Visibility.causal(0), 1)


def test_a_sharded_runner_refuses_an_unknown_backend_at_once_and_runs_no_more_after_its_client_closed(lm):
    pytest.importorskip("distributed")
    from graphc.errors import BackendError, UnknownNameError
    from lowering.distributed.dask_shards import close_cluster, sharded_runner

    with pytest.raises(UnknownNameError, match="bogus"):
        sharded_runner(lm, 2, backend="bogus")  # no cluster was started for it
    runner = sharded_runner(lm, 2)
    try:
        assert generate(lm, PROMPTS, 2, runner=runner).new_tokens.tolist() == generate(lm, PROMPTS, 2).new_tokens.tolist()
    finally:
        close_cluster(runner.executor.client)
    with pytest.raises(BackendError, match="the Dask client of this sharded runner is closed"):
        generate(lm, PROMPTS, 2, runner=runner)


def test_nan_weights_stop_generation_with_an_error_instead_of_token_0(lm):
    from graphc.errors import ExecutionError

    state = _state(lm)
    state["model.norm.weight"] = np.full_like(state["model.norm.weight"], np.nan)
    broken = graphc.causal_lm_from_hf(CONFIG, state)
    for backend in installed("numpy", "ort-cpu"):
        with pytest.raises(ExecutionError, match=r"step 1: the logits of sequence\(s\) \[0, 1\] are NaN"):
            generate(broken, PROMPTS, 3, backend=backend)


GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 97, "n_positions": 16}


def _step_feeds(g: graphc.Graph, ids: list[int], positions: list[int]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64), "position_ids": np.array([positions])}
    for name in g.inputs:
        if name.startswith("past_key_values."):
            t = g.types[name]
            feeds[name] = np.zeros((1, t.shape[1], 0, t.shape[3]), np.float32)
    return feeds


@pytest.mark.parametrize("which", ["input_ids", "position_ids"])
def test_a_negative_token_or_position_is_an_error_on_every_backend_and_in_the_export(which, tmp_path):
    """A table lookup counts a negative index from the end (ONNX Gather): token -1 would read the last row without a word."""
    from graphc.errors import ExecutionError

    g = graphc.causal_lm_graph(causal_lm_config_from_hf(GPT2), seed=0)
    good = _step_feeds(g, [3, 4], [0, 1])
    bad = {**good, which: np.array([[3, -1]]) if which == "input_ids" else np.array([[0, -1]])}
    table = "model.embed_tokens.weight" if which == "input_ids" else "model.embed_positions.weight"
    rows = g.initializers[table].shape[0]
    for backend in installed("numpy", "ort-cpu", "torch"):
        run(g, good, backend)
        with pytest.raises(ExecutionError, match=f"out of range|out of data bounds|{rows}"):
            run(g, bad, backend)
    if installed("ort-cpu"):
        import onnxruntime as ort

        path = tmp_path / "step.onnx"
        export(g, str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        with pytest.raises(Exception, match="out of data bounds"):
            session.run(None, bad)


def test_a_missing_layer_tensor_is_named_with_its_layer():
    from graphc.attention import decoder_stack_graph
    from graphc.attention.decoder import decoder_weight_shapes
    from graphc.errors import WeightError

    cfg = graphc.attention.decoder_configs_from_hf(
        {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "num_hidden_layers": 2}  # fmt: skip
    )
    weights = {f"model.layers.{i}.{k}": np.zeros(s, np.float32) for i, c in enumerate(cfg) for k, s in decoder_weight_shapes(c).items()}
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightError, match=r"decoder layer 'model.layers.1' weights: missing \['model.layers.1.self_attn.k_proj.weight'\]"):
        decoder_stack_graph(cfg, weights=weights)


def test_a_prompt_row_of_padding_only_is_refused():
    """A row whose attention_mask marks no token has no prompt: transformers attends it to its padding, graphc refuses it."""
    from graphc.attention import causal_lm_graph
    from graphc.attention.hf_lm import causal_lm_config_from_hf

    cfg = causal_lm_config_from_hf({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 50})  # fmt: skip
    lm = causal_lm_graph(cfg, seed=0, logits="last")
    with pytest.raises(InputError, match="attention_mask row 1 marks no token"):
        generate(lm, [[1, 2, 3], [4, 5, 6]], 2, attention_mask=np.array([[1, 1, 1], [0, 0, 0]]))
