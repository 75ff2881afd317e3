"""Named regression tests for failures found by trying graphc as a new user would and by differential fuzzing.

Each test states the failure it pins; numbers are checked against plain NumPy
written here or against the float64 reference, on every backend that can run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphc
from graphc import AttentionConfig, Graph, optimize
from graphc.errors import BackendError, ResourceLimitError
from graphc.memory import parse_bytes, set_memory_cap
from graphc.ops import integer_divide
from lowering import prepare, random_inputs, run
from lowering.backends.isolated import IsolatedSession
from lowering.exporter.onnx_export import export

BACKENDS = ("numpy", "onnx-reference", "ort-cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _on_every_backend(g: Graph, feeds: dict[str, np.ndarray], want: dict[str, np.ndarray], **tol: float) -> None:
    for graph in (g, optimize(g).graph):
        for backend in BACKENDS:
            got = prepare(graph, backend).run(feeds)
            for name, expected in want.items():
                assert got[name].shape == expected.shape, (backend, name, got[name].shape)
                np.testing.assert_allclose(got[name], expected, err_msg=f"{backend} {name}", **tol)


def _softmax_rows(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x, dtype=np.float64)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx].astype(np.float64)
        if np.isfinite(row).any():
            e = np.exp(row - row[np.isfinite(row)].max())
            out[idx] = e / e.sum()
    return out


def test_constant_additive_mask_with_a_fully_masked_row_gives_zeros_not_nan():
    """A constant -inf row went through the NaN guard unguarded: NaN on ort-cpu and onnx-reference."""
    g = Graph("additive_mask")
    x = g.input("x", [3, 4])
    bias = np.zeros((3, 4), np.float32)
    bias[0] = -np.inf
    bias[2, 1:] = -np.inf
    g.output(g.softmax(g.add(x, g.constant("bias", bias)), name="p"))
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(3, 4) / 7}
    _on_every_backend(g, feeds, {"p": _softmax_rows(feeds["x"] + bias)}, rtol=1e-6, atol=1e-7)


def test_causal_mask_of_a_constant_folded_by_the_optimizer_gives_zeros_not_nan():
    """CausalMask(offset=-1) of a constant was folded into a constant holding -inf; its fully masked row came back NaN."""
    g = Graph("folded_mask")
    x = g.input("x", [3, 3])
    masked = g.causal_mask(g.constant("w", np.ones((3, 3), np.float32)), offset=-1)
    g.output(g.softmax(g.add(x, masked), name="p"))
    assert "CausalMask" not in optimize(g).graph.op_counts()  # folded
    feeds = {"x": np.eye(3, dtype=np.float32)}
    hidden = np.arange(3)[None, :] > np.arange(3)[:, None] - 1
    _on_every_backend(g, feeds, {"p": _softmax_rows(np.where(hidden, -np.inf, feeds["x"] + 1))}, rtol=1e-6, atol=1e-7)


def test_integer_div_truncates_toward_zero_and_gives_zero_for_a_zero_divisor_on_every_backend():
    """int32 div was true division in numpy (a float result) but truncation in onnxruntime; a zero divisor killed onnxruntime."""
    a = np.array([7, -7, 7, -7, 5, 0, -1], np.int32)
    b = np.array([2, 2, -2, -2, 0, 0, 3], np.int32)
    want = np.array([3, -3, -3, 3, 0, 0, 0], np.int32)  # C / ONNX truncation, 0 where b == 0
    np.testing.assert_array_equal(integer_divide(a, b), want)
    g = Graph("int_div")
    g.output(g.div(g.input("a", [7], "int32"), g.input("b", [7], "int32"), name="q"))
    for backend in (*BACKENDS, "torch"):
        try:
            got = prepare(g, backend).run({"a": a, "b": b})["q"]
        except graphc.errors.BackendUnavailableError:
            continue
        assert got.dtype == np.int32, backend
        np.testing.assert_array_equal(got, want, err_msg=backend)


def test_bool_arithmetic_fails_verification():
    """A bool add passed verify() and then failed differently in each backend."""
    g = Graph("bool_add")
    m = g.input("m", [2], "bool")
    with pytest.raises(graphc.errors.DTypeMismatchError, match="operand 0 is bool"):
        g.add(m, m)


def test_constant_folding_keeps_a_rank0_result_rank0():
    """Folding einsum('i,i->') of constants made shape [1] ("cannot replace 'norm' (float32[]) by a constant of float32[1]")."""
    g = Graph("rank0_fold")
    w = g.constant("w", np.array([3.0, 4.0], np.float32))
    norm = g.einsum("i,i->", w, w, name="norm")
    x = g.input("x", [2])
    g.output(g.mul(x, g.sqrt(norm), name="y"))
    out = optimize(g).graph
    assert "norm" not in out.op_counts() and all(out.initializers[n].shape == () for n in out.initializers if out.types[n].rank == 0)
    _on_every_backend(g, {"x": np.array([1.0, -2.0], np.float32)}, {"y": np.array([5.0, -10.0])}, rtol=1e-6)


def test_rank0_initializers_and_outputs_keep_rank0_through_onnx():
    """np.ascontiguousarray turned rank-0 initializers into shape (1,), so onnxruntime returned (1,) outputs."""
    g = Graph("rank0")
    x = g.input("x", [])
    g.output(g.scale(g.add(x, g.constant("w", np.array(2.0, np.float32)), name="y"), 0.5, name="s"))
    model = export(g)
    assert [list(t.dims) for t in model.graph.initializer if t.name == "w"] == [[]]
    _on_every_backend(g, {"x": np.array(3.0, np.float32)}, {"s": np.array(2.5)})


def test_merge_and_split_of_einsum_chains_settle():
    """plan_contractions merged and split the same einsums forever ("did not settle after 10000 rewrites")."""
    g = Graph("merge_split")
    x = g.input("x", [4, 1, 5])
    e2 = g.einsum("abc,adc,adc->", x, x, x, name="e2")
    g.output(g.einsum(",abc,dec->ebdca", e2, x, x, name="e3"))
    xv = np.random.default_rng(0).standard_normal((4, 1, 5)).astype(np.float32)
    want = np.einsum(",abc,dec->ebdca", np.einsum("abc,adc,adc->", xv, xv, xv), xv, xv)
    _on_every_backend(g, {"x": xv}, {"e3": want}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seq", [0, 1])
@pytest.mark.parametrize("batch", [0, 1])
def test_zero_size_dims_run_on_every_backend(batch, seq):
    """Zero-size dims crashed the numpy backend (reshape with -1, max over an empty axis, % 0), compare's own reference."""
    cfg = AttentionConfig(16, 4, 2, head_dim=4)
    g = graphc.sdpa_graph(cfg)
    feeds = random_inputs(g, batch=batch, seq=seq)
    want = run(g, feeds, "numpy", compute_dtype="float64", reference=True)["attn_BHSD"]
    assert want.shape == (batch, 4, seq, 4)
    for graph in (g, optimize(g).graph):
        for backend in BACKENDS:
            np.testing.assert_allclose(prepare(graph, backend, sizes={"batch": batch, "seq": seq}).run(feeds)["attn_BHSD"], want, atol=1e-5)


@pytest.mark.parametrize("shape, axis", [((3, 0), -1), ((0, 3), -1), ((0, 3), 0), ((2, 0, 4), 1)])
def test_softmax_over_zero_size_shapes(shape, axis):
    g = Graph("empty_softmax")
    g.output(g.softmax(g.input("x", list(shape)), axis=axis, name="p"))
    _on_every_backend(g, {"x": np.zeros(shape, np.float32)}, {"p": np.zeros(shape)})


def test_zero_size_contraction_does_not_kill_onnxruntime():
    """einsum('zUq,zU->qU') with zero-size operands must not crash onnxruntime (it has divided by zero there)."""
    g = Graph("empty_contraction")
    a, b = g.input("a", [0, 3, 2]), g.input("b", [0, 3])
    g.output(g.einsum("zUq,zU->qU", a, b, name="y"))
    feeds = {"a": np.zeros((0, 3, 2), np.float32), "b": np.zeros((0, 3), np.float32)}
    _on_every_backend(g, feeds, {"y": np.zeros((2, 3))})


def test_a_crash_inside_onnxruntime_is_a_backend_error_in_isolated_mode():
    """A run that kills onnxruntime's process (a SIGFPE in a kernel) fails that run, not the caller's process."""
    node = helper.make_node("Div", ["a", "b"], ["y"])
    vi = [helper.make_tensor_value_info(n, TensorProto.INT32, [2]) for n in "aby"]
    model = helper.make_model(helper.make_graph([node], "div", vi[:2], vi[2:]), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    session = IsolatedSession(model.SerializeToString(), ["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run({"a": np.array([6, 7], np.int32), "b": np.array([2, 2], np.int32)})[0], [3, 3])
    with pytest.raises(BackendError, match="division by zero"):  # onnxruntime's own error comes back as one
        session.run({"a": np.array([6, 7], np.int32), "b": np.array([0, 0], np.int32)})
    os.kill(session._worker.process.pid, signal.SIGFPE)  # what a kernel's division by zero does
    with pytest.raises(BackendError, match="died .*SIGFPE"):
        session.run({"a": np.array([6, 7], np.int32), "b": np.array([2, 2], np.int32)})
    fresh = IsolatedSession(model.SerializeToString(), ["CPUExecutionProvider"])  # a new worker starts
    np.testing.assert_array_equal(fresh.run({"a": np.array([9, 7], np.int32), "b": np.array([3, 7], np.int32)})[0], [3, 1])


def test_ort_backends_run_isolated_on_request():
    cfg = AttentionConfig(16, 4, 2, head_dim=4)
    g = graphc.sdpa_graph(cfg)
    feeds = random_inputs(g, batch=1, seq=3)
    runner = prepare(g, "ort-cpu", isolate=True)
    assert "worker process" in runner.provider
    np.testing.assert_allclose(runner.run(feeds)["attn_BHSD"], run(g, feeds, "numpy")["attn_BHSD"], atol=1e-5)


def test_size_guard_refuses_before_allocating_and_the_cap_can_be_raised():
    """compare --seq 1000000000 tried to allocate 29.8 TiB and died with a traceback."""
    g = graphc.sdpa_graph(AttentionConfig(16, 4, 2, head_dim=4))
    set_memory_cap("64KiB")
    try:
        with pytest.raises(ResourceLimitError) as info:
            random_inputs(g, batch=4, seq=256)
        assert info.value.nbytes == 4 * 256 * 4 * (4 + 2 + 2) * 4 and info.value.cap == 64 * 1024
        set_memory_cap("none")
        assert random_inputs(g, batch=4, seq=256)["q_BHSD"].shape == (4, 4, 256, 4)
    finally:
        set_memory_cap(None)
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("500MB") == 500 * 10**6


def test_memory_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("GRAPHC_MEMORY_CAP", "1KiB")
    with pytest.raises(ResourceLimitError, match="GRAPHC_MEMORY_CAP"):
        random_inputs(graphc.sdpa_graph(AttentionConfig(16, 4, 2, head_dim=4)), batch=1, seq=64)


def _graphc(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "graphc", *args], capture_output=True, text=True, env=env, timeout=300)


def test_cli_version():
    out = _graphc("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"graphc {graphc.__version__}"


def test_cli_progress_goes_to_stderr_when_stdout_is_not_a_terminal():
    """Long runs printed nothing when stdout was not a terminal."""
    out = _graphc("compare", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--seq", "8", "--backends", "numpy,ort-cpu", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert any("[1/2] numpy: ok in" in line for line in lines) and any("[2/2] ort-cpu: ok in" in line for line in lines), out.stderr
    assert all(line.startswith("graphc: [") for line in lines) and "all backends agree" in out.stdout
    quiet = _graphc("compare", "--heads", "4", "--head-dim", "8", "--seq", "8", "--backends", "numpy", "--repeats", "1", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_cli_into_a_closed_pipe_is_quiet():
    """Piping into head printed "Broken pipe" and a traceback."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = f"{sys.executable} -m graphc optimize --preset llama3-70b --print --explain | head -1"
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.startswith("optimization level 2") and out.stderr == "", out.stderr


def test_random_inputs_are_drawn_in_their_own_dtype():
    """random_inputs drew float64 and then cast: twice the memory of the inputs at the peak."""
    import tracemalloc

    g = Graph("big_input")
    g.input("x", [1024, 1024])
    tracemalloc.start()
    x = random_inputs(g)["x"]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert x.dtype == np.float32 and peak < 1.5 * x.nbytes


def test_robustness_example_runs(capsys):
    import runpy

    runpy.run_path(os.path.join(ROOT, "examples", "robustness.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "EinsumSpecError: node 'einsum'" in out and "ResourceLimitError:" in out and "all backends agree" in out
