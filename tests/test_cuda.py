"""ort-cuda: what an export for CUDA is (checked here on any machine) and what it computes (on a machine with a GPU).

The structure runs everywhere: a float16 graph exported for CUDA keeps its contractions and attention in float16
(no Cast around them), the CUDA attention policy picks onnxruntime's fused kernels per shape, float32 on CUDA asks
for float32 MatMul (TF32 off), and the decode step runs through an IO binding (here on CPU ``OrtValue`` s).  The
numbers of a CUDA export are checked on the CPU provider too (onnxruntime's CPU kernels take float16), against
float64.  The tests named ``*cuda*`` that need a GPU skip without ``CUDAExecutionProvider``;
``benchmarks/gpu_check.py`` runs them on a GPU with the speed checks.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graphc
from graphc.attention.hf_lm import causal_lm_config_from_hf
from graphc.errors import BackendError, UnknownNameError
from graphc.ops import Binary, Compare
from lowering import export, generate, prepare, random_inputs, run
from lowering.backends.ort_backend import OrtKVCache, provider_entry
from lowering.backends.registry import decode_options
from lowering.compare import TF32_TOLERANCE, TOLERANCES, compare
from lowering.generate import lm_interface
from lowering.exporter.cuda_kernels import cuda_lacks_kernel, element_types, kernel_gaps

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDAExecutionProvider is not available (onnxruntime-gpu on a machine with an NVIDIA GPU)")
MISTRAL = graphc.preset("mistral-7b")
TINY_LM = dict(
    model_type="mistral", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    head_dim=16, vocab_size=300, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, sliding_window=None,
)  # fmt: skip


def _core(q_len: int, kv_len: int, dtype: str = "float16", batch: int = 1) -> graphc.Graph:
    return graphc.optimize(graphc.sdpa_graph(MISTRAL, batch=batch, q_len=q_len, kv_len=kv_len, causal=True, dtype=dtype)).graph


def _producers(model) -> dict[str, str]:
    return {o: n.op_type for n in model.graph.node for o in n.output}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("q_len, kv_len, fused", [(1, 4096, "Attention"), (1024, 1024, "Attention"), (4096, 4096, "GroupQueryAttention")])
def test_cuda_export_runs_low_precision_attention_in_its_dtype_with_the_fused_kernel_per_shape(q_len, kv_len, fused, dtype):
    model = export(_core(q_len, kv_len, dtype), device="cuda", attention="auto")
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops[fused] == 1 and "MatMul" not in ops, ops
    float_casts = [n for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i != 6]  # int32 lengths are GQA's own inputs
    assert not float_casts
    node = next(n for n in model.graph.node if n.op_type == fused)
    made_by = _producers(model)
    assert all(made_by.get(i) != "Cast" for i in node.input[:3])  # no Cast pair around the fused op
    assert not [n for n in model.graph.node if n.op_type == "Cast" and set(n.input) & set(node.output)]
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    assert {types[n] for n in types} == {onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))}  # in and out in the graph's dtype
    assert not kernel_gaps(model)


def test_cpu_export_of_the_same_graph_computes_in_float32():
    ops = Counter(n.op_type for n in export(_core(1, 4096), attention="auto").graph.node)
    assert ops["Cast"] >= 2 and "Attention" not in ops  # grouped MatMuls in float32 between float16 tensors


def test_cuda_policy_keeps_float32_attention_as_grouped_matmuls():
    from graphc.optimizer import PassContext

    ctx = PassContext()
    model = export(_core(1024, 1024, "float32"), device="cuda", attention="auto", ctx=ctx)
    ops = {n.op_type for n in model.graph.node}
    assert "Attention" not in ops and "GroupQueryAttention" not in ops and "MatMul" in ops
    assert "float32 attention runs as grouped MatMuls" in ctx.trace.explain()


def test_unknown_export_device_is_refused():
    with pytest.raises(UnknownNameError, match="unknown export device 'tpu'.*cpu, cuda"):
        export(_core(1, 8), device="tpu")


def test_storage_precision_layer_is_within_the_float16_tolerance_of_float64():
    """The mistral-7b layer exported for CUDA, run by onnxruntime's CPU kernels in float16, against float64."""
    g = graphc.optimize(graphc.attention_layer_graph(MISTRAL, seed=0, dtype="float16"), hints={"batch": 1, "seq": 128}).graph
    feeds = random_inputs(g, batch=1, seq=128)
    want = run(g, feeds, "numpy", compute_dtype="float64")["out_BSM"].astype(np.float64)
    model = export(g, device="cuda", attention="auto", sizes={"batch": 1, "seq": 128})
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Attention"] == 1
    made_by = _producers(model)
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    assert all(made_by.get(i) != "Cast" for i in attention.input[:3])  # float16 from the rotary products straight in
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0].astype(np.float64)
    atol, rtol = TOLERANCES["float16"]
    err = np.abs(got - want)
    assert np.all(err <= atol + rtol * np.abs(want)), float(err.max())
    assert err.max() > 1e-4  # float16 rounding is really there: the check is not vacuous
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 4 * 2.0**-10  # a few float16 epsilons, norm-wise


def test_cuda_lm_step_norms_are_one_fused_op_each_with_float32_statistics():
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), dtype="float16", logits="last")
    sizes = {"batch": 1, "seq": 1, "past_seq": 16}
    opt = graphc.optimize(g, hints=sizes).graph
    model = export(opt, device="cuda", attention="auto", sizes=sizes)
    norms = [n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization"]
    assert len(norms) == 2 * TINY_LM["num_hidden_layers"] + 1  # two per layer and the final norm
    assert all({a.name: a.i for a in n.attribute if a.type == 2}["stash_type"] == 1 for n in norms)  # float32 inside
    assert not [n for n in model.graph.node if n.op_type in ("ReduceSumSquare", "Sqrt", "Reciprocal")]
    made_by = _producers(model)
    assert all(made_by.get(n.input[0]) != "Cast" for n in norms)  # float16 in, no widening Cast
    cpu = Counter(n.op_type for n in export(opt, attention="auto", sizes=sizes).graph.node)
    assert "SimplifiedLayerNormalization" not in cpu and cpu["ReduceSumSquare"] == len(norms)  # the CPU export keeps the pieces
    assert len(model.graph.node) < 0.75 * sum(cpu.values())  # fewer kernels a decode step launches (162 vs 231 here)


def test_cuda_export_imports_back_to_the_same_numbers():
    from graphc.onnx_import import from_onnx

    g = graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=2, logits="last")
    sizes = {"batch": 2, "seq": 3, "past_seq": 4}
    model = export(graphc.optimize(g, hints=sizes).graph, device="cuda", attention="auto", sizes=sizes)
    back = from_onnx(model)
    feeds = random_inputs(g, seed=4, **sizes)
    want = run(g, feeds, "numpy", compute_dtype="float64")
    got = run(back, feeds, "numpy")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-3, atol=1e-4, err_msg=name)


def test_storage_precision_lm_logits_match_float64_on_cpu_kernels():
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), dtype="float16", logits="last")
    sizes = {"batch": 2, "seq": 5, "past_seq": 3}
    opt = graphc.optimize(g, hints=sizes).graph
    feeds = random_inputs(g, seed=3, **sizes)
    want = run(g, feeds, "numpy", compute_dtype="float64")["logits"].astype(np.float64)
    model = export(opt, device="cuda", attention="auto", sizes=sizes)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))
    atol, rtol = TOLERANCES["float16"]
    assert np.all(np.abs(got["logits"].astype(np.float64) - want) <= atol + rtol * np.abs(want))


def test_float32_on_cuda_is_float32_unless_tf32_is_asked_for():
    assert provider_entry("CUDAExecutionProvider") == ("CUDAExecutionProvider", {"use_tf32": "0"})
    assert provider_entry("CUDAExecutionProvider", tf32=True) == ("CUDAExecutionProvider", {"use_tf32": "1"})
    assert provider_entry("CPUExecutionProvider") == "CPUExecutionProvider"
    with pytest.raises(BackendError, match=r"'ort-cpu' does not take option\(s\) \['tf32'\]"):  # a CUDA option, not in ort-cpu's signature
        prepare(_core(1, 8, "float32"), "ort-cpu", tf32=True)


def test_compare_states_the_tf32_tolerance_when_tf32_is_asked_for():
    g = graphc.sdpa_graph(graphc.AttentionConfig(16, 2, 1, head_dim=8))
    report = compare(g, sizes={"batch": 1, "seq": 4}, backends=["numpy", "ort-cuda"], repeats=1, options={"ort-cuda": {"tf32": True}})
    assert (report.atol, report.rtol) == TF32_TOLERANCE
    assert "tolerance |err| <= 0.005 + 0.01*|ref|" in str(report)
    plain = compare(g, sizes={"batch": 1, "seq": 4}, backends=["numpy"], repeats=1)
    assert (plain.atol, plain.rtol) == TOLERANCES["float32"]


def test_decode_steps_run_through_an_io_binding_with_the_cache_left_in_ortvalues():
    g = graphc.optimize(graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=1, logits="last")).graph
    runner = prepare(g, "ort-cpu", **decode_options("ort-cpu", {"batch": 1, "seq": 1, "past_seq": 8}))
    seen = []
    step = runner.stepper
    assert step is not None

    def spy(inputs, keep):
        seen.append({k: type(v).__name__ for k, v in inputs.items()})
        return step(inputs, keep)

    runner.stepper = spy
    out = generate(g, [[3, 1, 4, 1, 5]], 4, runner=runner)
    want = generate(g, [[3, 1, 4, 1, 5]], 4, backend="numpy")
    assert out.tokens() == want.tokens()
    assert all(v == "OrtValue" for k, v in seen[-1].items() if k.startswith("past_key_values"))
    assert seen[-1]["input_ids"] == "ndarray"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_bfloat16_cache_stays_onnxruntime_bfloat16_tensors_between_steps(cache):
    """onnxruntime's Python API takes no bfloat16 arrays, so a bfloat16 model's interface is float32, but for its cache:
    the pasts and presents stay bfloat16 ``OrtValue`` s from step to step (on the GPU under CUDA), never NumPy; ``run``
    moves bfloat16 arrays in and out through a binding.  Tokens equal the NumPy backend's, presents within a bfloat16 step."""
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=1, dtype="bfloat16", logits="last", cache=cache)
    runner = prepare(g, "ort-cpu", **decode_options("ort-cpu", {"batch": 2, "seq": 1, "past_seq": 12}))
    step, seen = runner.stepper, []
    assert step is not None

    def spy(inputs, keep):
        outs = step(inputs, keep)
        seen.append({k: v.data_type() for k, v in (*inputs.items(), *outs.items()) if k.startswith(("past_key_values", "present"))})
        assert outs["logits"].dtype.name == "bfloat16"
        return outs

    runner.stepper = spy
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    assert generate(g, prompts, 6, runner=runner).tokens() == generate(g, prompts, 6, backend="numpy").tokens()
    assert all(set(s.values()) == {"tensor(bfloat16)"} for s in seen), seen[:2]
    feeds = random_inputs(g, seed=2, batch=2, seq=3, past_seq=12 if cache == "static" else 4)
    if cache == "static":
        feeds["cache_position"] = np.arange(4, 7, dtype=np.int64)
    want, got = run(g, feeds, "numpy"), runner.run(feeds)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=8e-3, atol=8e-3, err_msg=name)


def test_a_fixed_capacity_cache_is_two_buffers_the_steps_write_in_turn():
    """cache="static": each step reads one buffer per layer and writes the other; the addresses never change."""
    g = graphc.optimize(graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=1, logits="last", cache="static")).graph
    assert g.types["present.0.key"].shape == g.types["past_key_values.0.key"].shape
    runner = prepare(g, "ort-cpu", **decode_options("ort-cpu", {"batch": 2, "seq": 1, "past_seq": 12}))
    step, seen = runner.stepper, []
    assert step is not None

    def spy(inputs, keep):
        seen.append((inputs["past_key_values.0.key"].data_ptr(), keep["present.0.key"].data_ptr()))
        return step(inputs, keep)

    runner.stepper = spy
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    got = generate(g, prompts, 6, runner=runner, keep_logits=True)
    want = generate(graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=1, logits="last"), prompts, 6, keep_logits=True)
    assert got.tokens() == want.tokens()
    for a, b in zip(got.logits, want.logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)
    buffers = {seen[0][0], seen[0][1]}
    assert len(buffers) == 2 and all({read, written} == buffers and read != written for read, written in seen)
    assert [read for read, _ in seen[1:]] == [written for _, written in seen[:-1]]  # what one step writes, the next reads
    seen.clear()
    assert generate(g, prompts, 6, runner=runner).tokens() == want.tokens()  # the same buffers again, their old values hidden
    assert {seen[0][0], seen[0][1]} == buffers
    assert generate(g, [[7, 7]], 3, runner=runner).tokens() == generate(g, [[7, 7]], 3, backend="numpy").tokens()  # another shape


def test_cuda_graphs_need_ort_cuda_and_a_fixed_capacity_cache():
    lm = causal_lm_config_from_hf(TINY_LM)
    with pytest.raises(BackendError, match=r"'ort-cpu' does not take option\(s\) \['cuda_graph'\]"):  # a CUDA option
        prepare(graphc.causal_lm_graph(lm, seed=1, cache="static"), "ort-cpu", cuda_graph=True)
    if HAS_CUDA:
        with pytest.raises(BackendError, match="cache='static'"):
            prepare(graphc.causal_lm_graph(lm, seed=1), "ort-cuda", cuda_graph=True)


def test_the_replay_path_binds_fixed_buffers_and_gives_the_same_tokens():
    """The CUDA-graph step's binding (small inputs and logits in buffers that keep their addresses), run on the CPU provider."""
    from lowering.backends.ort_backend import _ort_step

    g = graphc.optimize(graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=1, logits="last", cache="static")).graph
    runner = prepare(g, "ort-cpu")
    runner.stepper = _ort_step(runner.session, [o.name for o in runner.session.get_outputs()], "cpu", graphs=True)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    for batch in (prompts, prompts[:1], prompts):  # one graph per batch shape, each with its own buffers
        got, want = generate(g, batch, 6, runner=runner, keep_logits=True), generate(g, batch, 6, backend="numpy", keep_logits=True)
        assert got.tokens() == want.tokens()
        for a, b in zip(got.logits, want.logits):  # each step's logits its own: the fixed output buffer is copied out
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)


@needs_cuda
def test_ort_cuda_cuda_graphs_replay_the_decode_step_with_the_same_tokens():
    g = graphc.optimize(graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=1, logits="last", cache="static")).graph
    runner = prepare(g, "ort-cuda", cuda_graph=True)
    assert runner.provider.endswith("with CUDA graphs"), runner.provider
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    for batch in (prompts, prompts[:1], prompts, [[5, 5, 5, 5, 5, 5, 5, 5, 5]]):  # graphs per shape, replayed when the shape comes back
        assert generate(g, batch, 8, runner=runner).tokens() == generate(g, batch, 8, backend="ort-cpu").tokens(), batch


@needs_cuda
def test_ort_cuda_main_job_layer_passes_with_default_options():
    g = graphc.attention_layer_graph(MISTRAL, seed=0)
    report = compare(g, sizes={"batch": 1, "seq": 128}, backends=["ort-cuda"], repeats=1)
    assert report.ok, str(report)
    assert (report.atol, report.rtol) == TOLERANCES["float32"]


@needs_cuda
@pytest.mark.parametrize("q_len, kv_len", [(1, 512), (256, 256), (2048, 2048)])
def test_ort_cuda_float16_core_within_tolerance_and_nothing_on_the_cpu(q_len, kv_len):
    g = _core(q_len, kv_len)
    feeds = random_inputs(g, seed=2)
    want = run(g, feeds, "numpy", compute_dtype="float64")
    got = run(g, feeds, "ort-cuda", attention="auto")
    atol, rtol = TOLERANCES["float16"]
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float64), want[name].astype(np.float64), atol=atol, rtol=rtol)
    so = ort.SessionOptions()
    so.enable_profiling = True
    session = ort.InferenceSession(
        export(g, device="cuda", attention="auto").SerializeToString(), so, providers=[provider_entry("CUDAExecutionProvider")]
    )
    session.run(None, feeds)
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    os.remove(profile)
    on_cpu = {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["args"].get("provider") == "CPUExecutionProvider"}
    assert not on_cpu & {"Attention", "GroupQueryAttention", "MatMul", "Softmax"}, on_cpu


@needs_cuda
def test_ort_cuda_bfloat16_lm_step_within_tolerance_and_nothing_on_the_cpu():
    from graphc.optimizer.precision import widen_interface

    g = graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), dtype="bfloat16", logits="last", seed=0)
    sizes = {"batch": 2, "seq": 5, "past_seq": 8}
    opt = graphc.optimize(g, hints=sizes).graph
    feeds = random_inputs(g, seed=3, **sizes)
    want = run(g, feeds, "numpy", compute_dtype="float64")["logits"].astype(np.float64)
    got = run(opt, feeds, "ort-cuda", attention="auto")["logits"].astype(np.float64)
    atol, rtol = TOLERANCES["bfloat16"]
    assert np.all(np.abs(got - want) <= atol + rtol * np.abs(want)), float(np.abs(got - want).max())
    so = ort.SessionOptions()
    so.enable_profiling = True
    model = export(widen_interface(opt), device="cuda", attention="auto", sizes=sizes)
    session = ort.InferenceSession(model.SerializeToString(), so, providers=[provider_entry("CUDAExecutionProvider")])
    wide = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in feeds.items()}
    session.run(None, {i.name: wide[i.name] for i in session.get_inputs()})
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    os.remove(profile)
    on_cpu = {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["args"].get("provider") == "CPUExecutionProvider"}
    assert not on_cpu & {"MatMul", "Softmax", "SimplifiedLayerNormalization", "Mul", "Add", "Where", "Sigmoid"}, on_cpu


@needs_cuda
def test_ort_cuda_generate_keeps_the_cache_on_the_gpu_and_matches_cpu_tokens():
    g = graphc.optimize(graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), seed=1, logits="last")).graph
    runner = prepare(g, "ort-cuda", **decode_options("ort-cuda", {"batch": 2, "seq": 1, "past_seq": 8}))
    assert isinstance(runner.new_cache(lm_interface(g), 2, 8), OrtKVCache)
    step, seen = runner.stepper, []
    assert step is not None

    def spy(inputs, keep):
        seen.append({k: v.device_name().lower() for k, v in inputs.items() if k.startswith("past_key_values")})
        outs = step(inputs, keep)
        seen.append({k: v.device_name().lower() for k, v in outs.items() if k in keep})
        return outs

    runner.stepper = spy
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    assert generate(g, prompts, 6, runner=runner).tokens() == generate(g, prompts, 6, backend="ort-cpu").tokens()
    assert all(set(s.values()) == {"cuda"} for s in seen[1:]), seen[:3]  # after the (empty) first pasts: on the GPU


def test_cli_exports_for_cuda_and_refuses_tf32_without_ort_cuda(tmp_path, capsys):
    from graphc.cli import main

    out = tmp_path / "layer.onnx"
    args = ["export", "--heads", "8", "--kv-heads", "2", "--head-dim", "16", "-o", str(out), "--attention", "auto"]
    assert main([*args, "--device", "cuda", "--hint", "seq=1", "--hint", "batch=1"]) == 0
    assert "for CUDA" in capsys.readouterr().out and out.exists()
    assert main(["compare", "--heads", "8", "--kv-heads", "2", "--head-dim", "16", "--seq", "4", "--backends", "numpy", "--tf32"]) == 2
    assert "--tf32 asks ort-cuda for TF32 MatMul; add ort-cuda to --backends" in capsys.readouterr().err


def _bfloat16_as_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every bfloat16 tensor, type and Cast made float16 (finite fills clipped to float16's range): onnxruntime's
    CPU provider has float16 kernels but no bfloat16 ones, so this runs the bfloat16 export's graph on the CPU."""
    from onnx import TensorProto, numpy_helper

    def narrow(t: onnx.TensorProto) -> onnx.TensorProto:
        a = np.clip(numpy_helper.to_array(t).astype(np.float32), -65504, 65504).astype(np.float16)
        return numpy_helper.from_array(a, t.name)

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.data_type == TensorProto.BFLOAT16:
            t.CopyFrom(narrow(t))
    for v in (*out.graph.input, *out.graph.output, *out.graph.value_info):
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    for n in out.graph.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.BFLOAT16:
                a.i = TensorProto.FLOAT16
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.BFLOAT16:
                a.t.CopyFrom(narrow(a.t))
    return out


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_bfloat16_lm_step_for_cuda_computes_in_bfloat16_with_a_cuda_kernel_for_every_node(cache):
    """A bfloat16 LM exported for CUDA: MatMuls, norms and the cache in bfloat16, every node one onnxruntime's CUDA provider
    runs on its dtypes, and its graph (run in float16 by the CPU provider) gives the float64 logits."""
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(TINY_LM), dtype="bfloat16", logits="last", cache=cache, seed=0)
    sizes = {"batch": 2, "seq": 5, "past_seq": 8}
    model = export(graphc.optimize(g, hints=sizes).graph, device="cuda", attention="auto", sizes=sizes)
    assert not kernel_gaps(model)
    elem = element_types(model)
    bf16 = onnx.TensorProto.BFLOAT16
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and elem[n.input[1]] == bf16]  # 8 a layer (q/k/v as one, gate/up as one)
    assert len(matmuls) == 1 + 8 * TINY_LM["num_hidden_layers"] and all(elem[n.output[0]] == bf16 for n in matmuls)
    assert all(elem[n.output[0]] == bf16 for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    assert {elem[o] for o in elem if o.startswith("present")} == {bf16}
    feeds = random_inputs(g, seed=3, **sizes)
    if cache == "static":
        feeds["cache_position"] = np.arange(3, 8, dtype=np.int64)
    want = run(g, feeds, "numpy", compute_dtype="float64")["logits"].astype(np.float64)
    session = ort.InferenceSession(_bfloat16_as_float16(model).SerializeToString(), providers=["CPUExecutionProvider"])
    wide = {k: v.astype(np.float16) if v.dtype.name == "bfloat16" else v for k, v in feeds.items()}
    got = session.run(["logits"], {i.name: wide[i.name] for i in session.get_inputs()})[0].astype(np.float64)
    atol, rtol = TOLERANCES["bfloat16"]
    assert np.all(np.abs(got - want) <= atol + rtol * np.abs(want)), float(np.abs(got - want).max())


def test_a_bfloat16_comparison_runs_in_float32_on_cuda_and_kernel_gaps_names_one_left_in_bfloat16():
    g = graphc.Graph("compare")
    x, y = g.input("x", ["n"], "bfloat16"), g.input("y", ["n"], "bfloat16")
    g.output(g.where(g.compare("less", x, y), x, y, name="smaller"))
    model = export(g, device="cuda")
    less = next(n for n in model.graph.node if n.op_type == "Less")
    assert _producers(model)[less.input[0]] == "Cast" and not kernel_gaps(model)  # widened to float32 first
    bare = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Less", ["a", "b"], ["c"], name="lt")],
            "g",
            [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.BFLOAT16, [2]) for n in "ab"],
            [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [2])],
        )
    )
    assert kernel_gaps(bare) == ["lt (Less)"]
    assert cuda_lacks_kernel(Compare("less"), "bfloat16") and not cuda_lacks_kernel(Compare("less"), "float16")
    assert not cuda_lacks_kernel(Binary("add"), "bfloat16")


def _rms_norm_graph(eps_input: bool = False, share_inv_rms: bool = False) -> graphc.Graph:
    g = graphc.Graph("rms_norm")
    x = g.input("x", ["batch", 16], "float16")
    eps = g.input("eps", [], "float16") if eps_input else g.constant("eps", np.array(1e-5, np.float16))
    w = g.constant("w", (1 + 0.1 * np.random.default_rng(0).standard_normal(16)).astype(np.float16))
    inv = g.reciprocal(g.sqrt(g.add(g.scale(g.einsum("bc,bc->b", x, x), 1 / 16), eps)), name="inv_rms")
    g.output(g.einsum("bc,c->bc", g.einsum("b,bc->bc", inv, x), w, name="y"))
    if share_inv_rms:
        g.output(inv)
    return g


@pytest.mark.parametrize("variant", ["fused", "epsilon is an input", "inv_rms read twice"])
def test_rms_norm_fuses_only_where_the_pattern_is_whole(variant):
    g = _rms_norm_graph(eps_input=variant == "epsilon is an input", share_inv_rms=variant == "inv_rms read twice")
    model = export(g, device="cuda")
    fused = [n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization"]
    assert len(fused) == (variant == "fused"), [n.op_type for n in model.graph.node]
    feeds = {"x": (3 * np.random.default_rng(1).standard_normal((4, 16))).astype(np.float16)}
    if variant == "epsilon is an input":
        feeds["eps"] = np.array(1e-5, np.float16)
    want = run(g, feeds, "numpy", compute_dtype="float64")["y"].astype(np.float64)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(["y"], feeds)[0].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
