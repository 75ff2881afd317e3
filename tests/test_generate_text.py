"""Checkpoint folder in, text out: ``graphc generate DIR --prompt TEXT`` against transformers' tokenizer and greedy generate.

The folder is what ``save_pretrained`` writes for a model and its tokenizer; graphc
reads ``tokenizer.json`` with the ``tokenizers`` library and ``generation_config.json``
for the eos and pad ids, and must print the text transformers decodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from onnx import numpy_helper
import pytest

from graphc.checkpoint import Checkpoint
from graphc.cli import main
from graphc.errors import SerializationError

from checkpoints import VOCAB, tokenizer

PROMPTS = ["the cat sat on", "a big red dog ran to the"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("llama_text")
    pytest.importorskip("tokenizers")
    tok, vocab = tokenizer(), len(VOCAB)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=vocab, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # unit-scale weights: greedy tokens that vary (the default init repeats one token)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (1.0 if p.ndim == 1 else 0.3))
    model.save_pretrained(out)
    return out


def _transformers_text(folder: Path, prompt: str, new: int) -> str:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_checkpoint_folder_and_text_prompts_give_transformers_text(folder, capsys):
    argv = ["generate", str(folder), "--max-new-tokens", "8", "--backends", "numpy,ort-cpu", "--quiet"]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "text (every backend the same):" in out and "tokens (" not in out  # text only, unless --ids
    lines = out.splitlines()
    for i, prompt in enumerate(PROMPTS):
        at = lines.index(f"  [{i}] {prompt}")
        assert lines[at + 1] == f"      => {_transformers_text(folder, prompt, 8)}"


def test_ids_are_printed_with_ids_and_match_transformers_tokenizer(folder, capsys):
    import transformers

    assert main(["generate", str(folder), "--prompt", PROMPTS[0], "--ids", "--max-new-tokens", "3", "--backends", "numpy", "--quiet"]) == 0
    out = capsys.readouterr().out
    want = transformers.AutoTokenizer.from_pretrained(folder)(PROMPTS[0]).input_ids
    assert f"  [0] {' '.join(map(str, want))} | " in out


def test_generation_defaults_come_from_the_folder(folder, tmp_path):
    assert Checkpoint(folder).generation_defaults() == {"eos_token_id": [2], "pad_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [2, 9]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"pad_token_id": 0}))
    assert Checkpoint(tmp_path).generation_defaults() == {"eos_token_id": [2, 9], "pad_token_id": 0}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(SerializationError, match="eos_token_id must be a token id or a list of them, got 'two'"):
        Checkpoint(tmp_path).generation_defaults()


def test_text_without_a_tokenizer_or_a_folder_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["generate", str(tmp_path), "--prompt", "hello", "--quiet"]) == 2
    assert "no tokenizer.json; pass token ids with --prompt-ids instead of text" in capsys.readouterr().err
    assert main(["generate", "--hf-config", str(tmp_path / "config.json"), "--prompt", "hello", "--quiet"]) == 2
    assert "--prompt TEXT needs the checkpoint folder" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "hello", "--quiet"]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt-ids", "1,2", "--dtype", "int32", "--quiet"]) == 2
    assert "invalid choice: 'int32'" in capsys.readouterr().err


def test_the_tokenizer_reads_what_transformers_reads(folder):
    import transformers

    tok = Checkpoint(folder).tokenizer()
    fast = transformers.AutoTokenizer.from_pretrained(folder)
    for text in PROMPTS + ["unknown words here", "sun"]:
        ids = tok.encode(text)
        assert ids == fast(text).input_ids
        assert tok.decode(ids) == fast.decode(ids, skip_special_tokens=True)
    assert np.all(np.array(tok.encode("the")) < tok.vocab_size)


@pytest.mark.parametrize("command", [["info"], ["compare", "--layers", "1", "--seq", "4", "--backends", "numpy,ort-cpu"], ["show", "--layers", "1"]])
def test_a_checkpoint_folder_is_taken_where_a_checkpoint_is_meant(folder, command, capsys):
    """``graphc CMD DIR`` is ``graphc CMD --hf-config DIR/config.json --weights DIR``: the same printout."""
    assert main([command[0], str(folder), *command[1:]]) == 0
    by_folder = capsys.readouterr().out
    assert main([command[0], "--hf-config", str(folder / "config.json"), "--weights", str(folder), *command[1:]]) == 0
    by_flags = capsys.readouterr().out
    strip = lambda text: [line.split()[:4] for line in text.splitlines()]  # noqa: E731 - a compare row's timings differ
    assert strip(by_folder) == strip(by_flags)


def test_export_of_a_checkpoint_folder_runs_its_weights(folder, tmp_path, capsys):
    import onnx

    # a folder exports the whole LM into a folder: -o X.onnx (where a new user expects the whole model) is refused by name
    assert main(["export", str(folder), "--layers", "1", "-o", str(tmp_path / "stack.onnx")]) == 2
    assert "name a folder, -o OUT/" in capsys.readouterr().err and not (tmp_path / "stack.onnx").exists()
    argv = ["export", "--hf-config", str(folder / "config.json"), "--weights", str(folder), "--layers", "1", "-o", str(tmp_path / "stack.onnx")]
    assert main(argv) == 0  # the decoder stack alone, asked for by its flags

    model = onnx.load(str(tmp_path / "stack.onnx"))
    from safetensors.numpy import load_file

    stored = load_file(str(folder / "model.safetensors"))
    q = stored["model.layers.0.self_attn.q_proj.weight"]
    found = [numpy_helper.to_array(t) for t in model.graph.initializer if numpy_helper.to_array(t).size == q.size]
    assert any(np.array_equal(a.reshape(-1), q.reshape(-1)) or np.array_equal(a.T.reshape(-1), q.reshape(-1)) for a in found)


def test_a_folder_without_config_is_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["info", str(tmp_path / "empty")]) == 2
    assert "no config.json" in capsys.readouterr().err


def _ort_greedy(model: Path, prompts: list[list[int]], new: int, pad: int) -> list[list[int]]:
    """Greedy decoding as optimum's ORTModelForCausalLM drives an export: left-padded ids, the mask, positions from the
    mask's running sum, the whole prompt first, then one token a step with ``present.*`` fed back as ``past_key_values.*``."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    past = {i.name: i.shape for i in sess.get_inputs() if i.name.startswith("past_key_values.")}
    width = max(len(p) for p in prompts)
    ids = np.array([[pad] * (width - len(p)) + p for p in prompts], np.int64)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], np.int64)
    cache = {n: np.zeros((len(prompts), s[1], 0, s[3]), np.float32) for n, s in past.items()}
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(new):
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **cache}
        results = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: v for k, v in feeds.items() if k in names})))
        token = results["logits"][:, -1].argmax(-1)
        for row, t in zip(out, token):
            row.append(int(t))
        cache = {n: results[n.replace("past_key_values", "present")] for n in past}
        ids, mask = token[:, None].astype(np.int64), np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
    return out


def test_export_of_a_folder_is_the_whole_lm_as_optimum_and_genai_load_it(folder, tmp_path, capsys):
    """``graphc export DIR -o OUT``: model.onnx with optimum's names (run here as optimum drives it) gives graphc
    generate's tokens for a left-padded batch; the loaders' files sit beside it."""
    out = tmp_path / "exported"
    assert main(["export", str(folder), "-o", str(out)]) == 0
    assert "model.onnx" in capsys.readouterr().out
    assert {"model.onnx", "model.onnx.data", "config.json", "generation_config.json", "tokenizer.json", "genai_config.json"} <= {
        p.name for p in out.iterdir()
    }
    genai = json.loads((out / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["num_key_value_heads"] == 2 and genai["search"]["past_present_share_buffer"] is False
    prompts = [[1, 5, 9, 13, 17, 21], [1, 8, 6, 4]]
    assert main(["generate", str(folder), "--prompt-ids", "1,5,9,13,17,21", "--prompt-ids", "1,8,6,4", "--max-new-tokens", "6",
                 "--backends", "numpy", "--eos-token-id", "999"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    want = [[int(t) for t in line.split("|")[1].split()] for line in printed.splitlines() if line.strip().startswith("[") and "|" in line]
    assert _ort_greedy(out / "model.onnx", prompts, 6, pad=0) == want


def test_export_of_a_folder_into_a_file_is_refused(folder, tmp_path):
    from graphc.errors import ExportError
    from lowering.checkpoint_export import export_checkpoint

    with pytest.raises(ExportError, match="writes a folder"):
        export_checkpoint(folder, tmp_path / "model.onnx")


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}the {{ m['content'] }} {% else %}a {{ m['content'] }}"
    "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}was {% endif %}"
)


@pytest.fixture(scope="module")
def chat_folder(folder, tmp_path_factory) -> Path:
    import shutil

    out = tmp_path_factory.mktemp("llama_chat")
    for p in folder.iterdir():
        shutil.copy(p, out / p.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


def test_the_chat_template_gives_transformers_ids(chat_folder):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(chat_folder)
    for text in PROMPTS:
        want = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert Checkpoint(chat_folder).chat_prompt(text) == list(want)


def test_generate_chat_prints_transformers_text(chat_folder, capsys):
    import transformers

    assert main(["generate", str(chat_folder), "--chat", "--prompt", PROMPTS[0], "--max-new-tokens", "6", "--backends", "numpy"]) == 0
    printed = capsys.readouterr().out
    tok = transformers.AutoTokenizer.from_pretrained(chat_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_folder)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip() and text in printed


def test_chat_without_a_template_is_named(folder, capsys):
    assert main(["generate", str(folder), "--chat", "--prompt", "the cat", "--max-new-tokens", "2", "--backends", "numpy"]) == 2
    assert "no chat template" in capsys.readouterr().err
