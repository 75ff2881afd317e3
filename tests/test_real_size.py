"""The real-size path at a size that runs in seconds: a checkpoint transformers writes (``save_pretrained``), mapped
by graphc, generated on NumPy and on onnxruntime whose session reads the weights from the safetensors files (the path a
model past protobuf's 2 GiB takes; here the in-memory threshold is lowered to 0 to take it), every backend's greedy
tokens equal to transformers' ``generate``.  The same check at TinyLlama-1.1B's size (22 layers, 4.4 GB) is
``python benchmarks/real_size_check.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import installed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from real_size_check import PROMPTS, check, write_checkpoint  # noqa: E402

SMALL = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
         "vocab_size": 2048, "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip


def test_a_checkpoint_read_from_its_files_generates_transformers_tokens_on_every_backend(tmp_path):
    want = write_checkpoint(tmp_path / "ckpt", SMALL, PROMPTS, 12)
    assert min(len(set(row)) for row in want.tolist()) > 4  # the tokens vary, so equal tokens mean something
    backends = installed("numpy", "ort-cpu")
    assert check(tmp_path / "ckpt", want, PROMPTS, 12, backends, inline_max=0) == dict.fromkeys(backends, True)
