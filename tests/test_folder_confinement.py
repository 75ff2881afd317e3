"""Nothing outside the folders graphc was given is read or written: links planted in a checkpoint or an export folder
are refused by name (reads) or replaced (writes); an export folder holding another model is refused unless forced;
a folder whose weights graphc cannot read never becomes a model with seeded random weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from graphc.checkpoint import Checkpoint
from graphc.cli import main
from graphc.errors import ExportError, SerializationError
from graphc.folders import confined, replacing, write_replacing
from lowering.checkpoint_export import export_checkpoint

from checkpoints import write_checkpoint, write_tokenizer

CANARY = b"outside the folders graphc was given\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    return write_checkpoint(tmp_path_factory.mktemp("confined") / "ckpt")


@pytest.fixture
def canary(tmp_path) -> Path:
    path = tmp_path / "outside" / "canary.txt"
    path.parent.mkdir()
    path.write_bytes(CANARY)
    return path


def _copy_of(ckpt: Path, folder: Path) -> Path:
    folder.mkdir()
    for p in ckpt.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    return folder


# ------------------------------------------------------------------ writes replace names


def test_replacing_replaces_a_link_and_leaves_its_target_alone(tmp_path, canary):
    link = tmp_path / "model.onnx.data"
    link.symlink_to(canary)
    write_replacing(link, b"new")
    assert canary.read_bytes() == CANARY and not link.is_symlink() and link.read_bytes() == b"new"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with replacing(path) as f:
            f.write(b"half")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


@pytest.mark.parametrize("planted", ["model.onnx.data", "model.onnx", "config.json", "tokenizer.json", "genai_config.json"])
def test_export_never_writes_through_a_link_planted_in_out(ckpt, tmp_path, canary, planted):
    out = tmp_path / "out"
    out.mkdir()
    (out / planted).symlink_to(canary)
    force = planted in ("model.onnx", "config.json", "genai_config.json")  # these make OUT hold a model: --force to reuse it
    export_checkpoint(ckpt, out, force=force)
    assert canary.read_bytes() == CANARY
    assert not (out / planted).is_symlink()
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32


# ------------------------------------------------------------------ reads stay inside the checkpoint


LOADER_NAMES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "special_tokens_map.json"]


@pytest.mark.parametrize("name", LOADER_NAMES)
def test_export_refuses_a_loader_file_that_links_out_of_the_checkpoint(ckpt, tmp_path, canary, name):
    folder = _copy_of(ckpt, tmp_path / "ckpt")
    if (folder / name).exists():
        (folder / name).unlink()
    (folder / name).symlink_to(canary)
    with pytest.raises(SerializationError, match=rf"{name}.*is a link to .*canary.txt.*outside the checkpoint folder"):
        export_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out" / name).exists()


@pytest.mark.parametrize("command", [["info"], ["generate", "--prompt", "the cat", "--max-new-tokens", "1", "--backends", "numpy"]])
def test_info_and_generate_refuse_a_config_that_links_out(ckpt, tmp_path, canary, command, capsys):
    folder = _copy_of(ckpt, tmp_path / "ckpt")
    outside = canary.parent / "config.json"
    outside.write_text((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside)
    assert main([command[0], str(folder), *command[1:]]) == 2
    assert "outside the checkpoint folder" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"])
def test_generate_refuses_tokenizer_files_that_link_out(ckpt, tmp_path, canary, name, capsys):
    folder = _copy_of(ckpt, tmp_path / "ckpt")
    outside = canary.parent / name
    if name == "tokenizer.json":
        write_tokenizer(outside)
    elif name == "chat_template.jinja":
        outside.write_text("{{ messages[0]['content'] }}")
    else:
        outside.write_text("{}")
    if (folder / name).exists():
        (folder / name).unlink()
    (folder / name).symlink_to(outside)
    assert main(["generate", str(folder), "--chat", "--prompt", "the cat", "--max-new-tokens", "1", "--backends", "numpy"]) == 2
    err = capsys.readouterr().err
    assert name in err and "outside the checkpoint folder" in err


def test_a_link_inside_the_folder_and_a_cache_snapshot_link_are_read(tmp_path):
    snapshot = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "1234").write_text("{}")
    (snapshot / "config.json").symlink_to(blobs / "1234")
    assert confined(snapshot, "config.json", "test").name == "config.json"
    with pytest.raises(SerializationError, match="leaves the folder"):
        confined(snapshot, "../../blobs/1234", "test")


# ------------------------------------------------------------------ the export folder


def test_an_out_that_holds_a_checkpoint_is_refused_and_force_leaves_no_other_models_files(ckpt, tmp_path, capsys):
    other = _copy_of(ckpt, tmp_path / "other")
    (other / "chat_template.jinja").write_text("another model's template")
    before = (other / "config.json").read_bytes()
    assert main(["export", str(ckpt), "-o", str(other)]) == 2
    assert "already holds a model (config.json" in capsys.readouterr().err and (other / "config.json").read_bytes() == before
    plain = _copy_of(ckpt, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    out = tmp_path / "out"
    export_checkpoint(ckpt, out)
    (out / "chat_template.jinja").write_text("stale")  # a file the checkpoint does not have, left from another export
    with pytest.raises(ExportError, match="already holds a model"):
        export_checkpoint(ckpt, out)
    assert main(["export", str(ckpt), "-o", str(out), "--force"]) == 0
    assert not (out / "chat_template.jinja").exists() and (out / "model.onnx").is_file()


@pytest.mark.parametrize("output", ["", " "])
def test_an_empty_output_name_is_refused(ckpt, output, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(ckpt), "-o", output]) == 2
    assert "empty name" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_a_binary_tokenizer_is_refused_before_anything_is_written(ckpt, tmp_path):
    folder = _copy_of(ckpt, tmp_path / "ckpt")
    (folder / "tokenizer.json").write_bytes(bytes(range(256)))
    with pytest.raises(SerializationError, match="tokenizer"):
        export_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "file, field, value, words",
    [
        ("generation_config.json", "eos_token_id", 10**30, "eos_token_id 10{30}"),
        ("generation_config.json", "pad_token_id", 10**30, "pad_token_id 10{30}"),
        ("config.json", "bos_token_id", -3, "bos_token_id -3 is not a token id"),
        ("config.json", "max_position_embeddings", 2048.5, "max_position_embeddings must be a positive int"),
    ],
)
def test_genai_config_takes_only_ids_of_the_vocabulary_and_an_int_context(ckpt, tmp_path, file, field, value, words):
    folder = _copy_of(ckpt, tmp_path / "ckpt")
    doc = json.loads((folder / file).read_text())
    (folder / file).write_text(json.dumps({**doc, field: value}))
    with pytest.raises((ExportError, SerializationError), match=words):
        export_checkpoint(folder, tmp_path / "out")


# ------------------------------------------------------------------ weights graphc cannot read, flags beside a folder


def test_a_folder_without_readable_weights_is_refused_unless_seeded(ckpt, tmp_path, capsys):
    folder = _copy_of(ckpt, tmp_path / "ckpt")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    assert main(["optimize", str(folder), "-o", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert "holds no weights graphc reads" in err and "pytorch_model.bin" in err and "--seed" in err
    assert not (tmp_path / "x.onnx").exists()
    assert main(["optimize", str(folder), "--seed", "3", "-o", str(tmp_path / "x.onnx")]) == 0


def test_an_index_into_a_subfolder_gives_the_checkpoints_weights(ckpt, tmp_path, capsys):
    import onnx
    from onnx import numpy_helper
    from safetensors.numpy import load_file

    folder = _copy_of(ckpt, tmp_path / "ckpt")
    (folder / "shards").mkdir()
    (folder / "model.safetensors").rename(folder / "shards" / "model-1.safetensors")
    names = load_file(str(folder / "shards" / "model-1.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "shards/model-1.safetensors" for k in names}}))
    assert main(["export", "--quiet", str(folder), "-o", str(tmp_path / "out")]) == 0
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    stored = names["model.layers.0.self_attn.q_proj.weight"]
    arrays = [numpy_helper.to_array(t, str(tmp_path / "out")) for t in model.graph.initializer]
    flat = stored.reshape(-1)
    assert any(a.size == stored.size and (np.array_equal(a.reshape(-1), flat) or np.array_equal(a.T.reshape(-1), flat)) for a in arrays)


SECOND_SOURCES = [["--preset", "llama3-8b"], ["--graph", "g.json"], ["--heads", "8"], ["--dim", "batch=3"], ["--hf-config", "c.json"]]


@pytest.mark.parametrize("flags", SECOND_SOURCES)
def test_a_second_graph_source_beside_a_folder_is_refused(ckpt, flags, capsys):
    assert main(["info", str(ckpt), *flags]) == 2
    err = capsys.readouterr().err
    assert "is a checkpoint folder" in err and flags[0] in err


def test_inputs_given_as_one_npy_array_are_named(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros(3))
    assert main(["compare", "--preset", "mistral-7b", "--seq", "4", "--inputs", str(tmp_path / "x.npy")]) == 2
    assert "holds one array (a .npy); give a .npz" in capsys.readouterr().err


def test_checkpoint_reads_special_tokens_from_the_map_as_transformers_does(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "<|end|>"}))
    assert Checkpoint(folder).special_tokens() == {"bos_token": "<s>", "eos_token": "<|end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "added_tokens_decoder": {}}))
    assert Checkpoint(folder).special_tokens() == {"eos_token": "</s>"}  # transformers reads no map then
    assert os.path.exists(folder / "special_tokens_map.json")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("pad_token_id", 10**30, "the folder's pad_token_id .generation_config.json or config.json. 10{30} is not a token id"),
        ("eos_token_id", 2.0, "eos_token_id must be a token id or a list of them, got 2.0"),
        ("eos_token_id", 10**30, r"the folder's eos_token_id .* 10{30} is not a token id \(ids are 0 .. 2\*\*63 - 1\)"),
    ],
)
def test_generate_names_a_special_id_outside_the_vocabulary(ckpt, tmp_path, field, value, words, capsys):
    folder = _copy_of(ckpt, tmp_path / "ckpt")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0, field: value}))
    assert main(["generate", str(folder), "--prompt", "the cat", "--max-new-tokens", "1", "--backends", "numpy", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and __import__("re").search(words, err), err


def test_a_prompt_past_the_models_positions_runs_with_a_warning(ckpt, capsys):
    prompt = " ".join(["the cat sat on a mat"] * 10)  # 61 tokens, with 8 new past the 64 positions
    assert main(["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "8", "--backends", "numpy", "--quiet"]) == 0
    assert "run past the model's 64 positions (max_position_embeddings)" in capsys.readouterr().err
