"""Whole causal LMs against transformers: greedy tokens identical to ``generate(do_sample=False)`` and logits at every step.

Each family's ``*ForCausalLM`` is built by transformers from a tiny random config
(norm gains scattered around their unit value, so a wrong offset shows); graphc
builds the model from the config and the ``state_dict`` (``causal_lm_from_hf``)
and generates for a batch of two prompts of different lengths (left-padded, so the
padding mask, the positions and the cache offsets all matter).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import graphc  # noqa: E402
from graphc.attention.hf_lm import causal_lm_config_from_hf  # noqa: E402
from graphc.errors import InputError, WeightError  # noqa: E402
from lowering import generate, left_pad  # noqa: E402

from conftest import installed  # noqa: E402

BASE = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "vocab_size": 96,
    "max_position_embeddings": 128,
}
LLAMA_LIKE = {**BASE, "num_key_value_heads": 2, "head_dim": 8}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA_LIKE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA_LIKE, "sliding_window": 3}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**LLAMA_LIKE, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", LLAMA_LIKE),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**LLAMA_LIKE, "sliding_window": 3, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
               "query_pre_attn_scalar": 12}),
    "falcon-7b": ("FalconConfig", "FalconForCausalLM", {**BASE, "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False}),
    "falcon-40b": ("FalconConfig", "FalconForCausalLM", {**BASE, "num_kv_heads": 2, "new_decoder_architecture": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**LLAMA_LIKE, "sliding_window": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                 "partial_rotary_factor": 0.5}}),
    "gpt_neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**BASE, "use_parallel_residual": False}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_head": 4, "n_layer": 2, "vocab_size": 96, "n_positions": 64}),
}  # fmt: skip
PROMPTS = [[5, 17, 33], [7, 1, 90, 44, 12, 60]]
NEW_TOKENS = 8
TOL = {"atol": 1e-4, "rtol": 1e-3}


def _model(family: str, seed: int = 0):
    config_name, model_name, fields = FAMILIES[family]
    config = getattr(transformers, config_name)(**fields, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or "layernorm" in name:
                unit = 0.0 if family == "gemma2" and not name.endswith("bias") else (0.0 if name.endswith("bias") else 1.0)
                p.copy_(unit + 0.1 * torch.randn_like(p))
            elif family == "gemma2" and "embed" in name:  # scaled by sqrt(hidden) and tied: kept small so the layers decide the tokens
                p.normal_(0.0, 0.3 / 32**0.5)
            else:
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    return config, model


def _state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def _hf_generate(model, prompts=PROMPTS, new=NEW_TOKENS):
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, ids.shape[1] :].numpy(), [step.float().numpy() for step in out.logits]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request):
    config, model = _model(request.param)
    tokens, logits = _hf_generate(model)
    return request.param, config, model, tokens, logits


def _generates_transformers_tokens(g, family: str, want_tokens, want_logits, past: int = 12) -> None:
    """``g`` as built on NumPy and optimized on every backend: transformers' tokens and every step's logits."""
    optimized = graphc.optimize(g, hints={"batch": 2, "seq": 1, "past_seq": past}).graph
    for graph, backends in ((g, ["numpy"]), (optimized, installed("numpy", "ort-cpu", "torch"))):
        for backend in backends:
            got = generate(graph, PROMPTS, NEW_TOKENS, backend=backend, keep_logits=True)
            where = f"{family} {backend} {'optimized' if graph is optimized else 'as built'}"
            np.testing.assert_array_equal(got.new_tokens, want_tokens, err_msg=where)
            assert len(got.logits) == NEW_TOKENS
            for step, (a, b) in enumerate(zip(got.logits, want_logits)):
                np.testing.assert_allclose(a, b, **TOL, err_msg=f"{where} step {step}")


def test_greedy_tokens_and_every_steps_logits_match_transformers(family_case):
    family, config, model, want_tokens, want_logits = family_case
    _generates_transformers_tokens(graphc.causal_lm_from_hf(config, _state(model)), family, want_tokens, want_logits)


def test_llama_weights_keep_their_checkpoint_names():
    """Each layer is written under its checkpoint scope, so a Llama ``state_dict``'s names are the graph's initializer names."""
    config, model = _model("llama")
    state = _state(model)
    g = graphc.causal_lm_from_hf(config, state)
    assert set(state) <= set(g.initializers)
    for name, arr in state.items():
        np.testing.assert_array_equal(g.initializers[name], arr, err_msg=name)


def test_a_fixed_capacity_cache_gives_transformers_tokens_too(family_case):
    """cache="static" (presents written into the cache's slots, every step of one shape) decodes as the growing cache does."""
    family, config, model, want_tokens, want_logits = family_case
    g = graphc.causal_lm_from_hf(config, _state(model), cache="static")
    assert g.types["present.1.value"].shape == g.types["past_key_values.1.value"].shape
    _generates_transformers_tokens(g, f"{family} static cache", want_tokens, want_logits, past=13)


def test_a_fixed_capacity_graph_refuses_more_tokens_than_it_holds():
    config, model = _model("llama")
    g = graphc.causal_lm_from_hf(config, _state(model), cache="static", past=10)
    assert generate(g, PROMPTS, 5).new_tokens.shape == (2, 5)  # 6 prompt positions + 4 written = 10 slots
    with pytest.raises(InputError, match="holds 10 positions"):
        generate(g, PROMPTS, 6)


def test_the_logits_depend_on_the_padding_being_masked(family_case):
    """Guards the test above: without the mask the padded prompt's logits change; the unpadded prompt's do not."""
    family, config, model, want_tokens, want_logits = family_case
    g = graphc.causal_lm_from_hf(config, _state(model))
    ids, _ = left_pad(PROMPTS)
    unmasked = generate(g, ids, 1, keep_logits=True)  # an array without a mask: every slot is a token, padding included
    assert np.abs(unmasked.logits[0][0] - want_logits[0][0]).max() > 1e-2
    np.testing.assert_allclose(unmasked.logits[0][1], want_logits[0][1], **TOL)
    assert len({tuple(row) for row in want_tokens.T}) > 2, "the model repeats one token: the token check above would be weak"


def test_config_reads_the_pieces_around_the_stack():
    lm = causal_lm_config_from_hf(_model("gemma2")[0])
    assert lm.tie_word_embeddings and lm.final_logit_softcap == 3.0 and lm.embedding_scale == pytest.approx(32**0.5)
    lm = causal_lm_config_from_hf(_model("llama")[0])
    assert not lm.tie_word_embeddings and lm.final_logit_softcap is None and lm.embedding_scale is None and lm.vocab_size == 96


def test_last_position_logits_only():
    config, model = _model("qwen3")
    full = graphc.causal_lm_from_hf(config, _state(model))
    last = graphc.causal_lm_from_hf(config, _state(model), logits="last")
    assert last.types["logits"].shape == ("batch", 1, 96)
    a = generate(full, PROMPTS, 4, keep_logits=True)
    b = generate(last, PROMPTS, 4, keep_logits=True, backend=installed("ort-cpu", "numpy")[0])
    np.testing.assert_array_equal(a.new_tokens, b.new_tokens)
    np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), **TOL)


def test_eos_finishes_a_sequence_and_pads_it():
    config, model = _model("llama")
    g = graphc.causal_lm_from_hf(config, _state(model))
    free = generate(g, PROMPTS, NEW_TOKENS)
    eos = int(free.new_tokens[0, 2])
    stopped = generate(g, PROMPTS, NEW_TOKENS, eos_token_id=eos, pad_token_id=0)
    row = stopped.new_tokens[0]
    first = int(np.argmax(row == eos))
    assert first <= 2 and (row[first + 1 :] == 0).all()
    with torch.no_grad():
        ids, mask = left_pad(PROMPTS)
        hf = model.generate(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            eos_token_id=eos,
        )  # fmt: skip
    np.testing.assert_array_equal(stopped.new_tokens, hf[:, ids.shape[1] :].numpy()[:, : stopped.new_tokens.shape[1]])


PARITY_CASES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "falcon": "falcon-40b", "phi3": "phi3", "gpt_neox": "gpt_neox", "gpt2": "gpt2",
}  # fmt: skip
"""Each registered family's case in :func:`test_checkpoint_folder_builds_the_same_model` (transformers' tokens from
``save_pretrained``'s files): a family registered without one fails :func:`test_every_registered_family_has_a_parity_case`."""


def test_every_registered_family_has_a_parity_case():
    from graphc.attention.families import family_names

    assert sorted(family_names()) == sorted(PARITY_CASES)


@pytest.mark.parametrize("family", sorted(PARITY_CASES.values()))
def test_checkpoint_folder_builds_the_same_model(tmp_path, family):
    """save_pretrained's files (tied heads left out, fused tensors, GPT-2's Conv1D layout) give transformers' tokens."""
    config, model = _model(family)
    model.save_pretrained(tmp_path)
    weights = graphc.weights.load_weights(tmp_path)
    from_files = graphc.causal_lm_from_hf(tmp_path / "config.json", weights)
    np.testing.assert_array_equal(generate(from_files, PROMPTS, 4).new_tokens, _hf_generate(model, new=4)[0])


def test_bad_requests_are_named():
    config, model = _model("llama")
    g = graphc.causal_lm_from_hf(config, _state(model))
    with pytest.raises(InputError, match="token ids must be in 0..95"):
        generate(g, [[1, 96]], 2)
    with pytest.raises(InputError, match="max_new_tokens must be an int >= 1"):
        generate(g, PROMPTS, 0)
    with pytest.raises(InputError, match="non-empty"):
        generate(g, [[1], []], 2)
    with pytest.raises(InputError, match="not a causal LM step"):
        generate(graphc.attention_layer_graph(graphc.gqa(32, 4, 2)), PROMPTS, 2)
    state = _state(model)
    del state["lm_head.weight"]
    with pytest.raises(WeightError, match="missing 'lm_head.weight'"):
        graphc.causal_lm_from_hf(config, state)


@pytest.mark.parametrize("family", ["llama", "gemma2", "falcon-7b", "qwen3"])
def test_bfloat16_logits_at_every_step_are_as_close_to_float32_as_transformers_own(family):
    """The low-precision tolerance is transformers' own: at every step graphc's bfloat16 logits sit no farther from the
    float32 model's than transformers' bfloat16 model does (both teacher-forced on graphc's tokens; graphc computes in
    float32 between bfloat16 weights and caches, transformers rounds after every op)."""
    from graphc.weights import load_weights

    config, model = _model(family)
    low = _model(family)[1].to(torch.bfloat16)
    g = graphc.causal_lm_from_hf(config, load_weights(dict(low.state_dict())))
    assert g.types["present.0.key"].dtype == "bfloat16" and g.types["logits"].dtype == "bfloat16"
    got = generate(g, PROMPTS, NEW_TOKENS, backend=installed("ort-cpu", "numpy")[0], keep_logits=True)
    ids, mask = left_pad(PROMPTS)
    seq = torch.from_numpy(np.concatenate([ids, got.new_tokens], axis=1))
    full_mask = np.concatenate([mask, np.ones_like(got.new_tokens)], axis=1)
    positions = torch.from_numpy(np.maximum(full_mask.cumsum(1) - 1, 0))
    with torch.no_grad():
        exact, rounded = (
            m(input_ids=seq, attention_mask=torch.from_numpy(full_mask), position_ids=positions).logits.float().numpy() for m in (model, low)
        )
    at = slice(ids.shape[1] - 1, ids.shape[1] - 1 + NEW_TOKENS)
    exact, rounded, ours = exact[:, at], rounded[:, at], np.stack(got.logits, axis=1)
    scale = np.abs(exact).max()
    ours_err, theirs_err = np.abs(ours - exact).max() / scale, np.abs(rounded - exact).max() / scale
    assert 0 < ours_err <= theirs_err * 1.25 + 1e-3, (family, ours_err, theirs_err)


def test_cli_generate_prints_transformers_tokens_per_backend(tmp_path, capsys):
    from graphc.cli import main

    config, model = _model("mistral")
    model.save_pretrained(tmp_path)
    want, _ = _hf_generate(model)
    argv = ["generate", "--hf-config", str(tmp_path / "config.json"), "--weights", str(tmp_path), "--max-new-tokens", str(NEW_TOKENS)]
    argv += [arg for p in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, p)))]
    assert main([*argv, "--backends", ",".join(installed("numpy", "ort-cpu", "torch"))]) == 0
    out, err = capsys.readouterr()
    assert "tokens (every backend the same):" in out and "tokens/s" in out
    for i, (prompt, new) in enumerate(zip(PROMPTS, want.tolist())):
        assert f"[{i}] {' '.join(map(str, prompt))} | {' '.join(map(str, new))}" in out
    assert "numpy: token 8/8" in err
    assert main(["generate", "--hf-config", str(tmp_path / "config.json"), "--prompt-ids", "1,2", "--layers", "1", "--quiet"]) == 0  # random weights
    assert "1 layers, vocab 96" in capsys.readouterr().out
    assert main([*argv, "--dtype", "bfloat16", "--backends", "numpy", "--quiet"]) == 0  # a float32 checkpoint converted on load
    assert "bfloat16, weights" in capsys.readouterr().out
    assert main([*argv, "--cache", "static", "--backends", ",".join(installed("numpy", "ort-cpu")), "--quiet"]) == 0
    out = capsys.readouterr().out
    for i, (prompt, new) in enumerate(zip(PROMPTS, want.tolist())):
        assert f"[{i}] {' '.join(map(str, prompt))} | {' '.join(map(str, new))}" in out
    if installed("ort-cpu"):  # packed weights: the same tokens
        assert main([*argv, "--backends", "ort-cpu", "--prepack", "--quiet"]) == 0
        out = capsys.readouterr().out
        for i, (prompt, new) in enumerate(zip(PROMPTS, want.tolist())):
            assert f"[{i}] {' '.join(map(str, prompt))} | {' '.join(map(str, new))}" in out


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--prompt-ids", "1,x"], "--prompt-ids takes comma-separated token ids"),
        (["--prompt-ids", "1,96"], "token ids must be in 0..95"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be in 1..65536"),
        (["--prompt-ids", "1", "--backends", "tpu"], "backend"),
        (["--prompt-ids", "1", "--layers", "3"], "n_layers must be an int in 1..2"),
        (["--prompt-ids", "1", "--cuda-graph"], "--cuda-graph is an ort-cuda option"),
        (["--prompt-ids", "1", "--backends", "numpy", "--prepack"], "--prepack is an onnxruntime option"),
        (["--prompt-ids", "1", "--cache", "paged"], "invalid choice"),
    ],
)
def test_cli_generate_user_errors_are_one_line(tmp_path, capsys, extra, fragment):
    from graphc.cli import main

    config, _ = _model("llama")
    (tmp_path / "config.json").write_text(config.to_json_string())
    assert main(["generate", "--hf-config", str(tmp_path / "config.json"), "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2"])
@pytest.mark.parametrize("backend", installed("numpy", "ort-cpu"))
def test_bfloat16_logits_are_no_farther_from_float32_than_transformers_bfloat16(family, backend, tmp_path):
    """A bfloat16 checkpoint (weights that bfloat16 holds exactly, logits of std 2-4): graphc's bfloat16 logits sit no
    farther from the float32 model's than transformers' own bfloat16 model's do (graphc computes in float32 between
    bfloat16 tensors; transformers rounds after every op)."""
    from graphc.attention.hf_lm import causal_lm_from_hf
    from graphc.weights import load_weights
    from lowering import prepare

    names = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "gemma2": "Gemma2Config"}
    cfg = getattr(transformers, names[family])(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * (1.0 if p.ndim == 1 else 0.3)).to(torch.bfloat16).float())
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want32 = model(ids).logits.numpy()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()(ids).logits.float().numpy()
    g = causal_lm_from_hf(tmp_path / "config.json", load_weights(tmp_path), dtype="bfloat16")
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, 12), np.int64), "position_ids": np.arange(12)[None]}
    feeds |= {n: np.zeros((1, 2, 0, 16), "bfloat16") for n in g.inputs if n.startswith("past_key_values.")}
    ours = prepare(g, backend).run(feeds)["logits"].astype(np.float32)
    assert np.abs(ours - want32).max() <= np.abs(theirs - want32).max(), (np.abs(ours - want32).max(), np.abs(theirs - want32).max())


def test_a_tied_config_with_a_different_lm_head_is_untied_as_transformers_does(tmp_path):
    """config.json says tie_word_embeddings but the checkpoint holds an lm_head.weight of other values: transformers
    warns and uses lm_head.weight; graphc must give its logits, not the embedding's (it silently tied them)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import save_file

    from checkpoints import CONFIG, weights
    from graphc.weights import load_weights
    from lowering import run

    config = {**CONFIG, "tie_word_embeddings": True, "architectures": ["LlamaForCausalLM"]}
    state = weights({**config, "tie_word_embeddings": False}, varied=True)
    assert not np.array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    ids = np.array([[1, 5, 9, 13]])
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()(torch.from_numpy(ids)).logits.numpy()
    with pytest.warns(UserWarning, match="they are not tied"):
        lm = graphc.causal_lm_from_hf(tmp_path / "config.json", load_weights(tmp_path), logits="all")
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    feeds = {k: v for k, v in feeds.items() if k in lm.inputs} | {n: np.zeros((1, 2, 0, 8), np.float32) for n in lm.inputs if n.startswith("past")}
    np.testing.assert_allclose(run(lm, feeds, "numpy")["logits"], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("option, value", [("logits", "every"), ("cache", "paged")])
def test_a_choice_the_builder_does_not_offer_is_a_config_error_naming_the_choices(option, value):
    from graphc.errors import AttentionConfigError

    cfg = causal_lm_config_from_hf({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 20})  # fmt: skip
    with pytest.raises(AttentionConfigError, match=rf"{option} must be one of .*got '{value}'"):
        graphc.causal_lm_graph(cfg, seed=0, **{option: value})
