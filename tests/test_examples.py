"""The examples run as users run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_hf_decoder_example_runs_on_a_falcon_checkpoint_folder(tmp_path):
    """It never split Falcon's fused query_key_value: `WeightError: no weights start with 'model.layers.0.'`."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    cfg = transformers.FalconConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=32,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
        bias=False,
    )
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(cfg)
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "hf_decoder.py"), str(tmp_path / "config.json"), str(tmp_path), str(tmp_path / "d.onnx")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all backends agree" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.split()[:1] in (["numpy"], ["ort-cpu"])]
    assert len(rows) == 2 and all(" PASS " in line for line in rows), proc.stdout


def test_generate_example_runs_and_its_onnx_export_decodes_in_a_plain_loop():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "generate.py")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in a plain onnxruntime loop: the same 16 tokens" in proc.stdout


def test_checkpoint_memory_example_reads_the_weights_from_the_files_on_onnxruntime():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "checkpoint_memory.py")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    tokens = {line.split("tokens ")[1] for line in lines if "prepared in" in line}
    assert len(tokens) == 1 and len([line for line in lines if "prepared in" in line]) >= 2, proc.stdout
    assert "MiB read from the checkpoint files in" in proc.stdout


def test_first_token_example_loads_cold_and_warm_and_gives_the_same_tokens():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "first_token.py")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("load")[0].strip() for line in proc.stdout.splitlines() if " first token " in line]
    assert rows == ["ort-cpu, as stored", "ort-cpu, packed", "packed, cache cold", "packed, cache warm", "numpy"], proc.stdout
    assert "every row gives the same tokens" in proc.stdout
