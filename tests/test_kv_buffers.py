"""KV caches that grow in place on the NumPy backend (lowering.decode.kv_buffers), and that they change no number."""

from __future__ import annotations

import numpy as np

import graphc
from graphc.attention import causal_lm_config_from_hf
from lowering import generate, prepare
from lowering.decode.kv_buffers import allocate, append, prefix_buffer


def test_append_writes_at_the_frontier_and_copies_anywhere_else():
    rng = np.random.default_rng(0)
    past = allocate(2, 3, 10, 4, np.float32)
    a, b, c = (rng.standard_normal((2, 3, n, 4)).astype(np.float32) for n in (4, 1, 2))
    first = append(past, a)
    assert prefix_buffer(first) is past.base and first.shape == (2, 3, 4, 4)
    second = append(first, b)  # at the frontier: in place
    assert np.shares_memory(second, past.base)
    again = append(first, c)  # the same past extended twice (a re-run step): a copy, and the first extension is untouched
    assert not np.shares_memory(again, past.base)
    np.testing.assert_array_equal(again, np.concatenate([a, c], axis=2))
    np.testing.assert_array_equal(second, np.concatenate([a, b], axis=2))
    full = append(second, rng.standard_normal((2, 3, 6, 4)).astype(np.float32))  # past the capacity: a copy
    assert full.shape[2] == 11 and not np.shares_memory(full, past.base)
    plain = np.zeros((2, 3, 4, 4), np.float32)  # an array not made by allocate never grows in place
    assert not np.shares_memory(append(plain[:, :, :2], b), plain)


def _model():
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
              "num_hidden_layers": 2, "vocab_size": 50}  # fmt: skip
    return graphc.optimize(graphc.causal_lm_graph(causal_lm_config_from_hf(config), seed=1), hints={"batch": 1, "seq": 1, "past_seq": 16}).graph


def test_the_numpy_runner_appends_a_step_in_place():
    g = _model()
    runner = prepare(g, "numpy")
    feeds = {"input_ids": np.array([[3, 4, 5]]), "attention_mask": np.ones((1, 3), np.int64), "position_ids": np.arange(3)[None]}
    pasts = {f"past_key_values.{i}.{k}": allocate(1, 2, 8, 16, np.float32) for i in range(2) for k in ("key", "value")}
    out = runner.run({**feeds, **pasts})
    for name, past in pasts.items():
        present = out[name.replace("past_key_values", "present")]
        assert present.shape == (1, 2, 3, 16) and np.shares_memory(present, past.base), name
    step = {"input_ids": np.array([[7]]), "attention_mask": np.ones((1, 4), np.int64), "position_ids": np.array([[3]])}
    nxt = runner.run({**step, **{n: out[n.replace("past_key_values", "present")] for n in pasts}})
    plain = runner.run({**step, **{n: np.array(out[n.replace("past_key_values", "present")]) for n in pasts}})  # contiguous copies
    for name in plain:
        np.testing.assert_allclose(nxt[name], plain[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.shares_memory(nxt["present.0.key"], pasts["past_key_values.0.key"].base)


def test_generate_on_numpy_equals_the_other_backends():
    g = _model()
    prompts = [[1, 2, 3, 4], [9, 8]]
    want = generate(g, prompts, 12, backend="ort-cpu", keep_logits=True)
    got = generate(g, prompts, 12, backend="numpy", keep_logits=True)
    np.testing.assert_array_equal(got.new_tokens, want.new_tokens)
    np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), rtol=1e-4, atol=1e-4)
