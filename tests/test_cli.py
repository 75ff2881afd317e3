"""The graphc command line: every subcommand, exit codes, error paths, and a deliberately wrong backend."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from graphc.cli import main
from graphc.graph import Graph
from graphc.ops import Concat, Repeat
from lowering import BackendSpec, NumpyInterpreter, Runner, register_backend, unavailable_reason, unregister_backend

SMALL = ["--heads", "4", "--kv-heads", "2", "--head-dim", "4"]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info(capsys):
    code, out, _ = _run(capsys, "info", "--preset", "falcon-7b")
    assert code == 0
    assert "falcon-7b: Falcon 7B (MQA, 71 query heads), 32 layers" in out
    assert "MQA: d_model=4544, heads=71, kv_heads=1, head_dim=64, group_size=71" in out
    # 2 x 1 head x 64 x 2 bytes x 32 layers per token
    assert "8,192 bytes/token" in out and "KV saving vs MHA: 98.6%" in out


def test_compare_all_backends_agree(capsys):
    code, out, _ = _run(capsys, "compare", *SMALL, "--seq", "8", "--batch", "2", "--repeats", "1")
    assert code == 0, out
    rows = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("numpy", "onnx-reference", "ort-cpu", "ort-cuda", "torch")
    }
    for backend in ("numpy", "onnx-reference", "ort-cpu"):
        assert " PASS " in rows[backend], rows[backend]
    cuda_reason = unavailable_reason("ort-cuda")
    if cuda_reason:
        assert " skipped " in rows["ort-cuda"] and "CUDAExecutionProvider is not available" in rows["ort-cuda"]
    assert "all backends agree" in out and "inputs x_BSM[2, 8, 16]" in out


def test_compare_json_decode_and_fused(capsys):
    code, out, _ = _run(
        capsys, "compare", *SMALL, "--decode", "--past", "6", "--backends", "numpy,ort-cpu", "--attention", "auto", "--repeats", "1", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["ok"] is True and report["input_shapes"]["past_key"] == [1, 2, 6, 4]
    assert [r["status"] for r in report["results"]] == ["ok", "ok"]
    assert report["results"][0]["max_abs_err"] < 1e-5


@pytest.fixture
def tiled_backend():
    """A deliberately wrong backend: K/V repeated in tile order (query head h reads KV head h % n_kv)."""

    def prepare(graph: Graph) -> Runner:
        g = graph.copy()
        for node in list(g.nodes.values()):
            if isinstance(node.op, Repeat):
                g.redefine(node.name, Concat(node.op.axis), [node.inputs[0]] * node.op.repeats)
        return Runner("tiled", "numpy, tile head order", graph, NumpyInterpreter(g).run)

    register_backend(BackendSpec("tiled", "wrong on purpose", lambda: None, prepare))
    yield "tiled"
    unregister_backend("tiled")


def test_compare_flags_a_wrong_backend_and_exits_1(capsys, tiled_backend):
    code, out, _ = _run(capsys, "compare", *SMALL, "--seq", "5", "--no-optimize", "--backends", f"numpy,{tiled_backend}", "--repeats", "1")
    assert code == 1
    tiled_row = next(line for line in out.splitlines() if line.startswith("tiled"))
    assert " FAIL " in tiled_row and "outputs differ beyond tolerance" in tiled_row
    assert "DISAGREE: tiled" in out
    numpy_row = next(line for line in out.splitlines() if line.startswith("numpy"))
    assert " PASS " in numpy_row


def test_export(capsys, tmp_path):
    path = tmp_path / "attn.onnx"
    code, out, _ = _run(capsys, "export", "--preset", "mistral-7b", "-o", str(path))
    assert code == 0 and f"wrote {path}" in out and "MatMul" in out
    model = onnx.load(str(path))
    assert "Expand" not in {n.op_type for n in model.graph.node}  # optimized: no K/V repeat
    fused = tmp_path / "fused.onnx"
    code, out, err = _run(capsys, "export", *SMALL, "-o", str(fused), "--attention", "onnx-attention")
    assert code == 0 and "attention onnx-attention" in out
    assert "Attention" in {n.op_type for n in onnx.load(str(fused)).graph.node}


def test_show_text_dot_and_svg(capsys, tmp_path):
    code, before, _ = _run(capsys, "show", *SMALL, "--core")
    assert code == 0 and "Repeat[axis=1, repeats=2](k_BHkvTD)" in before
    code, after, _ = _run(capsys, "show", *SMALL, "--core", "--optimized")
    assert code == 0 and "Repeat" not in after and 'Einsum[spec="bacd,bakd->back"]' in after
    code, dot, _ = _run(capsys, "show", *SMALL, "--core", "--format", "dot")
    assert code == 0 and dot.startswith('digraph "sdpa_gqa"')
    assert 'fillcolor="#ff9f9f", label="Repeat[axis=1, repeats=2]' in dot  # Repeat nodes are red
    assert '"k_BHkvTD" -> "k_rep_BHTD" [label="float32[batch,2,seq,4]"]' in dot
    svg = tmp_path / "g.svg"
    code, out, err = _run(capsys, "show", *SMALL, "--core", "--format", "svg", "-o", str(svg))
    if code == 0:
        assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
    else:
        assert code == 2 and "Graphviz 'dot' program" in err


def test_optimize_explain_and_round_trip(capsys, tmp_path):
    path = tmp_path / "opt.json"
    code, out, _ = _run(capsys, "optimize", *SMALL, "--decode", "--past", "128", "--explain", "-o", str(path))
    assert code == 0
    assert "group_kv/fuse_repeat_kv on k_rep_BHTD" in out and "repeated K/V bytes" in out and "did not fire:" in out
    code, out, _ = _run(capsys, "compare", "--graph", str(path), "--backends", "numpy,ort-cpu", "--past", "3", "--repeats", "1")
    assert code == 0 and "all backends agree" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--preset", "gpt-9"], "unknown preset 'gpt-9'; valid presets: llama2-7b"),
        (["compare", "--graph", "/nonexistent/g.json"], "cannot read graph file"),
        (["compare", *SMALL, "--seq", "0"], "--seq must be >= 1, got 0"),
        (["compare", *SMALL, "--backends", "numpy,tpu"], "unknown backend 'tpu'"),
        (["compare", "--heads", "6", "--kv-heads", "4", "--head-dim", "2"], r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"),
        (["compare", "--seq", "abc", *SMALL], "argument --seq: invalid int value: 'abc'"),
        (["optimize", *SMALL, "--hint", "seq"], "--hint takes NAME=INT"),
        (["info"], "no graph given"),
        ([], "a command is needed"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_user_errors_print_one_line_and_exit_2(capsys, argv, message):
    import re

    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("graphc: error: ")
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(capsys):
    code, _, err = _run(capsys, "--debug", "compare", "--preset", "gpt-9")
    assert code == 2 and "Traceback" in err and "UnknownNameError" in err


def test_python_dash_m_graphc():
    proc = subprocess.run([sys.executable, "-m", "graphc", "info", "--preset", "llama2-70b"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "heads=64, kv_heads=8" in proc.stdout


@pytest.mark.parametrize("mode", ["onnx-attention", "ort-gqa", "auto"])
def test_compare_runs_fused_modes_on_the_optimized_graph(capsys, mode):
    code, out, _ = _run(
        capsys,
        "compare",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "8",
        "--seq",
        "80",
        "--backends",
        "numpy,onnx-reference,ort-cpu",
        "--attention",
        mode,
        "--repeats",
        "1",
    )
    assert code == 0 and "all backends agree" in out and "(optimized)" in out and "attention decomposed" in out
    if mode == "ort-gqa":
        assert "skipped" in out and "GroupQueryAttention" in out  # the reference evaluator cannot run contrib ops


def test_compare_core_decode_binds_the_past_length(capsys):
    code, out, _ = _run(
        capsys,
        "compare",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "8",
        "--core",
        "--decode",
        "--past",
        "9",
        "--backends",
        "numpy,onnx-reference,ort-cpu",
        "--repeats",
        "1",
    )
    assert code == 0 and "all backends agree" in out


def test_svg_without_the_dot_program_is_one_line(monkeypatch, capsys):
    """The graphviz Python package without Graphviz's dot raised a raw ExecutableNotFound."""
    import sys
    import types

    import graphc.visualize as visualize

    class ExecutableNotFound(RuntimeError):
        pass

    def pipe(self, format):  # noqa: A002 - graphviz's own argument name
        raise ExecutableNotFound("failed to execute PosixPath('dot')")

    fake = types.SimpleNamespace(Source=type("Source", (), {"__init__": lambda self, dot: None, "pipe": pipe}))
    monkeypatch.setitem(sys.modules, "graphviz", fake)
    monkeypatch.setattr(visualize.shutil, "which", lambda name: None)
    assert main(["show", "--preset", "mistral-7b", "--core", "--format", "svg"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Graphviz 'dot' program" in err[0]


def test_info_describes_an_onnx_model(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "m.onnx"))
    assert main(["info", str(tmp_path / "m.onnx")]) == 0
    out = capsys.readouterr().out
    assert "12 parameters" in out and "x [b, 4] float32" in out and "y [b, 3] float32" in out


def test_info_prints_per_projection_biases(capsys):
    assert main(["info", "--preset", "qwen2-7b"]) == 0
    assert "bias=q_proj,k_proj,v_proj" in capsys.readouterr().out


def test_hf_config_help_lists_every_family(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    assert "falcon" in capsys.readouterr().out


def test_info_prints_the_cache_dtype_of_the_config(tmp_path, capsys):
    """A checkpoint's KV cache is in its own dtype (transformers 5 writes ``dtype``, older files ``torch_dtype``); presets default to float16."""
    import json

    from graphc.cli import main as cli_main

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 97}  # fmt: skip
    for field, dtype in (("dtype", "bfloat16"), ("torch_dtype", "float32")):
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps({**config, field: dtype}))
        assert cli_main(["info", "--hf-config", str(path)]) == 0
        assert f"KV cache ({dtype}, 2 layer(s)): {2 * 2 * 2 * 16 * (2 if dtype == 'bfloat16' else 4):,} bytes/token" in capsys.readouterr().out
    assert cli_main(["info", "--preset", "mistral-7b"]) == 0
    assert "KV cache (float16," in capsys.readouterr().out


def test_commands_read_their_flags_and_never_write_them(monkeypatch, tmp_path, capsys):
    """Each command reads the parsed flags once (a checkpoint folder resolved into a GraphSource, generate's folder
    defaults into its request) and never writes into them: here a write fails the command."""
    import argparse

    import graphc.cli as cli
    from checkpoints import write_checkpoint

    class Frozen(argparse.Namespace):
        def __setattr__(self, name, value):  # noqa: ANN001, ANN204
            raise AssertionError(f"a command wrote {name!r} back into its parsed flags")

    real = cli.build_parser

    def frozen_parser():  # noqa: ANN202
        parser = real()
        parse = parser.parse_args

        def parse_args(argv):  # noqa: ANN001, ANN202
            frozen = Frozen()
            frozen.__dict__.update(vars(parse(argv)))
            return frozen

        parser.parse_args = parse_args
        return parser

    monkeypatch.setattr(cli, "build_parser", frozen_parser)
    folder = str(write_checkpoint(tmp_path / "ckpt"))
    for argv in (
        ["info", folder],
        ["optimize", *SMALL, "--target", "ort-cpu", "--seq", "8"],
        ["show", folder, "--layers", "1"],
        ["compare", folder, "--layers", "1", "--seq", "3", "--backends", "numpy", "--repeats", "1"],
        ["generate", folder, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--backends", "numpy"],
    ):
        assert cli.main(argv) == 0, (argv, capsys.readouterr().err)
    capsys.readouterr()
