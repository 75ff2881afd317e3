"""Whole transformers models exported by torch.onnx import, optimize and run with outputs equal to onnxruntime on the file.

The files are made here from tiny random-weight models (``tests/real_exports.py``): legacy and dynamo exporters,
transformers' sdpa and eager attention, with and without a KV cache.  Each is checked at sizes never traced (batch
1-3, prefill 5-9 tokens, decode over a past of 11-13, a left-padded row) on the NumPy and onnxruntime backends.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from real_exports import ALIBI_FAMILIES, FAMILIES, MOE_FAMILIES, MORE_FAMILIES, export_model, feeds  # noqa: E402

from graphc import optimize  # noqa: E402
from graphc.cli import main  # noqa: E402
from graphc.dims import dim_sub, normalize_dim  # noqa: E402
from graphc.errors import InputError  # noqa: E402
from graphc.onnx_import import from_onnx  # noqa: E402
from graphc.optimizer import Target, lower, unfused_softmaxes  # noqa: E402
from lowering import prepare, run  # noqa: E402
from lowering.exporter.onnx_export import export  # noqa: E402
from lowering.exporter.targets import NUMPY_TARGET  # noqa: E402

SLIDING = {"mistral", "gemma2"}  # families with a sliding window of 16: their caches keep min(past + new, 15) keys
CASES = [
    (f, ex, at, c)
    for f in FAMILIES
    for ex in ("legacy", "dynamo")
    for at in ("sdpa", "eager")
    for c in (False, True)
    if not (f == "bert" and c) and not (f == "gemma2" and at == "sdpa")
]
"""Every family (9 causal LMs and BERT) by both exporters, sdpa and eager attention (Gemma 2 has eager only), with and
without a KV cache (BERT: without)."""
SIZES = {False: [(1, 5, 0, 0), (3, 130, 0, 9)], True: [(1, 1, 100, 0), (2, 1, 260, 5), (3, 7, 13, 2), (2, 30, 5, 9)]}
"""(batch, new tokens, past, left padding of row 0): prefill up to 130 tokens, decode over a past of 100-260, a 7-token
chunk over a past, padded rows that see no key at all (9 > 5 + 1)."""
SLIDING_SIZES = [(1, 1, 15, 0), (2, 1, 7, 3), (3, 7, 8, 2), (2, 30, 0, 9), (1, 40, 15, 0)]
"""A sliding-window cache holds at most 15 keys (the model's own present never holds more): full and partly filled
caches, a chunk over a past, a prefill past the window."""
KEEP_ALL = Target("keep", lambda graph, node, ctx: None)
WINDOWED = {"mistral": {0, 1}, "gemma2": {0}}  # layers with a sliding window of 16


def _ids(case):
    family, exporter, attention, cache = case
    return f"{family}-{exporter}-{attention}-{'cache' if cache else 'nocache'}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_export_imports_with_outputs_equal_to_onnxruntime(case, tmp_path):
    family, exporter, attention, cache = case
    path = export_model(family, exporter, attention, cache, tmp_path / "model.onnx")
    model = onnx.load(str(path), load_external_data=False)
    graph = from_onnx(path)
    optimized = optimize(graph).graph
    # one Attention per layer, its causal mask (offset: the past length) and KV cache understood, padding a bool mask
    lowered = lower(optimized, KEEP_ALL)
    assert unfused_softmaxes(lowered, lowered=True) == []  # every softmax part of a recognised attention
    attention = [n for n in lowered.topological_order() if n.op.kind == "Attention"]
    assert len(attention) == 2
    for layer, node in enumerate(attention):
        op = node.op
        past_len = lowered.types[node.inputs[-2]].shape[2] if cache else 0  # the op's past keys (a sliding cache cut to 15)
        causal = None if family == "bert" else past_len  # BERT: a padding mask alone
        assert (op.visibility.causal_offset, op.kv_cache, op.mask) == (causal, cache, "bool"), (layer, op)
        assert op.visibility.window == (16 if layer in WINDOWED.get(family, ()) else None), (layer, op)
        assert "Repeat" not in {lowered.producer(i).op.kind for i in node.inputs if lowered.producer(i) is not None}  # no K/V copy
    sizes = SLIDING_SIZES if cache and family in SLIDING else SIZES[cache]
    _equals_onnxruntime(path, model, graph, optimized, sizes, ("numpy", "ort-cpu", "torch"))


def _equals_onnxruntime(path, model, graph, optimized, sizes, backends, atol=1e-4, rtol=1e-3) -> None:  # noqa: ANN001
    """``optimized`` on each backend (one runner each, every size) against onnxruntime on the file at ``sizes``."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    runners = {backend: prepare(optimized, backend) for backend in backends}
    for batch, seq, past, pad in sizes:
        f = feeds(model, batch, seq, past, pad)
        want = session.run(None, f)
        mine = {name: f[vi.name] for name, vi in zip(graph.inputs, model.graph.input)}
        for backend, runner in runners.items():
            got = runner.run(mine)
            for name, w in zip(optimized.outputs, want):
                assert got[name].shape == w.shape, (backend, name)
                tol = {"rtol": rtol, "atol": atol(w) if callable(atol) else atol}
                np.testing.assert_allclose(got[name], w, **tol, err_msg=f"{backend} {name} at {batch, seq, past, pad}")


ALIBI_CASES = [(f, ex, c) for f in ALIBI_FAMILIES for ex in ("legacy", "dynamo") for c in (False, True) if (f, ex, c) != ("mpt", "dynamo", True)]
"""MPT and Bloom by both exporters, with and without a cache; not MPT by dynamo with a cache, where torch.export itself
fails (its shape guards on the ALiBi slice, ``s70 + Max(0, -s15 - 2*s70 + 1) == 1``, are inconsistent)."""


@pytest.mark.parametrize("case", ALIBI_CASES, ids=[f"{f}-{ex}-{'cache' if c else 'nocache'}" for f, ex, c in ALIBI_CASES])
def test_alibi_exports_are_one_attention_per_layer_equal_to_onnxruntime(case, tmp_path):
    """MPT masks the scores with ``masked_fill(hide, finfo.min)`` after adding its ALiBi bias, the causal keys and the
    padding in ``hide``; Bloom adds its bias to the ``[batch*heads]`` scores before viewing them as ``[batch, heads, ...]``
    and adding the position mask.  Each layer is one causal ``Attention`` at the past's offset whose additive mask is the
    bias with the padded keys at ``-inf`` and its KV cache its own (Bloom's ``[batch*heads]`` view read back as
    ``[batch, heads]``), equal to onnxruntime on the file at untraced sizes,
    left-padded rows that see no key included (the file gives them the mean of V over every key), on the backends and in
    query chunks (``attention="chunked"``)."""
    family, exporter, cache = case
    path = export_model(family, exporter, "eager", cache, tmp_path / "model.onnx")
    model = onnx.load(str(path), load_external_data=False)
    graph = from_onnx(path)
    optimized = optimize(graph).graph
    lowered = lower(optimized, KEEP_ALL)
    assert unfused_softmaxes(lowered, lowered=True) == []  # every softmax part of a recognised attention
    attention = [n for n in lowered.topological_order() if n.op.kind == "Attention"]
    assert [(n.op.mask, n.op.visibility.empty_rows, n.op.kv_cache) for n in attention] == [("additive", "mean", cache)] * 2, attention
    assert all(lowered.types[n.inputs[0]].shape[1] == 4 for n in attention)  # Bloom's [batch*heads] view read as [batch, 4 heads]
    for n in attention:  # causal at the past's offset (keys minus queries); a key mask: the bias and the padding, no triangle
        keys, queries = lowered.types[n.inputs[1]].shape[2], lowered.types[n.inputs[0]].shape[2]
        past = lowered.types[n.inputs[4]].shape[2] if n.op.kv_cache else normalize_dim(dim_sub(keys, queries))
        assert n.op.visibility.causal_offset == past and lowered.types[n.inputs[3]].shape[-2] == 1, n
    _equals_onnxruntime(path, model, graph, optimized, SIZES[cache], ("numpy", "ort-cpu"))
    _chunked_equals_onnxruntime(path, model, graph, optimized, SIZES[cache])


def _chunked_equals_onnxruntime(path, model, graph, optimized, sizes) -> None:  # noqa: ANN001
    """``optimized`` exported with ``attention="chunked"`` (two query chunks) against onnxruntime on the file."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    chunked = ort.InferenceSession(export(optimized, attention="chunked", sizes={"seq": 100}).SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, past, pad in sizes:
        f = feeds(model, batch, seq, past, pad)
        mine = {name: f[vi.name] for name, vi in zip(graph.inputs, model.graph.input)}
        for got, want in zip(chunked.run(None, {i.name: mine[i.name] for i in chunked.get_inputs()}), session.run(None, f)):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"chunked at {batch, seq, past, pad}")


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_families_cache_exports_are_one_causal_attention_per_layer_equal_to_onnxruntime(family, tmp_path):
    """GPT-J, OPT, GPTBigCode, Phi, StableLM, OLMo, Gemma, Starcoder2 and DeepSeek-V3 exported with their cache (the legacy
    exporter here; ``benchmarks/torch_onnx_corpus.py`` runs both exporters, with and without a cache): each layer one
    causal ``Attention`` at the past's offset with its padding mask, the cache its K/V inputs, equal to onnxruntime at
    sizes never traced.  DeepSeek-V3's cache holds its compressed latents: keys and values are computed from all of
    them each step, so the op has no cache of its own.  Exported as query chunks too (bounds, causal biases and the
    padding mask's chunk biases shared by both layers), equal to onnxruntime."""
    path = export_model(family, "legacy", "eager", True, tmp_path / "model.onnx")
    model = onnx.load(str(path), load_external_data=False)
    graph = from_onnx(path)
    optimized = optimize(graph).graph
    lowered = lower(optimized, KEEP_ALL)
    assert unfused_softmaxes(lowered, lowered=True) == []  # every softmax part of a recognised attention
    ops = [n.op for n in lowered.topological_order() if n.op.kind == "Attention"]
    latent = family == "deepseek_v3"
    assert [(op.visibility.causal_offset, op.kv_cache, op.mask) for op in ops] == [("past_seq", not latent, "bool")] * 2, ops
    _equals_onnxruntime(path, model, graph, optimized, SIZES[True][:3], ("numpy", "ort-cpu"))
    _chunked_equals_onnxruntime(path, model, graph, optimized, SIZES[True][:3])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_mixture_of_experts_exports_import_their_routing_as_written(family, tmp_path):
    """Mixtral, Qwen3-MoE and DeepSeek-V3 with its MoE layer, exported with their cache (transformers' ``batched_mm``
    experts: top-k routing, each token's experts' weights gathered, batched MatMuls, the weighted sum).  The routing
    imports as written (``TopK``, and DeepSeek's group mask a ``ScatterElements``, run by their ONNX semantics), each
    layer's attention is one causal ``Attention``, and the model equals onnxruntime at untraced sizes, so tokens that
    pick other experts than the traced ones included."""
    path = export_model(family, "legacy", "eager", True, tmp_path / "model.onnx")
    model = onnx.load(str(path), load_external_data=False)
    graph = from_onnx(path)
    optimized = optimize(graph).graph
    routing = {n.op.op_type for n in optimized.nodes.values() if n.op.kind == "Opaque"}
    assert "TopK" in routing, routing
    ops = [n.op for n in lower(optimized, KEEP_ALL).topological_order() if n.op.kind == "Attention"]
    latent = family == "deepseek_v3_moe"
    assert [(op.visibility.causal_offset, op.kv_cache, op.mask) for op in ops] == [("past_seq", not latent, "bool")] * 2, ops
    _equals_onnxruntime(path, model, graph, optimized, SIZES[True][:3], ("numpy", "ort-cpu"))


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_sliding_window_cache_past_the_window(family, exporter, tmp_path):
    """Fed a past longer than the window's 15 keys (which the model's own present never holds), onnxruntime fails on
    both files (a mask or an index of the traced length).  graphc refuses with an InputError: the dynamo export cuts
    the past to ``p - max(0, p - 15)`` keys and the input shape says so; the legacy export's graph is defined only
    where ``max(0, past_seq - 15) == 0``, which the imported graph assumes and every run checks."""
    path = export_model(family, exporter, "sdpa" if family == "mistral" else "eager", True, tmp_path / "model.onnx")
    model = onnx.load(str(path), load_external_data=False)
    graph = from_onnx(path)
    optimized = optimize(graph).graph
    long = feeds(model, 1, 1, 20)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error types
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, long)
    why = "past_key_values.0.key" if exporter == "dynamo" else r"defined only where max\(0,past_seq-15\) == 0"
    for backend in ("numpy", "ort-cpu"):
        with pytest.raises(InputError, match=why):
            run(optimized, {name: long[vi.name] for name, vi in zip(graph.inputs, model.graph.input)}, backend=backend)


def test_optimize_cli_reexports_a_real_export(tmp_path, capsys):
    path = export_model("llama", "legacy", "sdpa", True, tmp_path / "model.onnx")
    assert main(["optimize", str(path), "--target", "ort-cpu", "--explain", "-o", str(tmp_path / "opt.onnx")]) == 0
    explained = capsys.readouterr().out
    assert (
        explained.count("attention recognised: scale=") == 2 and "causal (offset past_seq)" in explained and "KV cache past_key_values.0" in explained
    )
    assert explained.count("legalize_attention on") + explained.count("Attention kept for") == 2  # the form chosen for each
    assert main(["info", str(path)]) == 0
    assert "attention recognised: 2\n    2 x causal (offset past_seq), bool mask, KV cache" in capsys.readouterr().out
    model = onnx.load(str(path), load_external_data=False)
    f = feeds(model, 2, 3, 9, 1)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, f)
    got = ort.InferenceSession(str(tmp_path / "opt.onnx"), providers=["CPUExecutionProvider"]).run(None, f)  # same names
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------- six ways to write causal attention in a torch module
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 64


class _Attention(torch.nn.Module):
    def __init__(self, kv_heads: int = HEADS) -> None:
        super().__init__()
        self.kv = kv_heads
        self.q, self.k, self.v = (torch.nn.Linear(32, n * HEAD_DIM) for n in (HEADS, kv_heads, kv_heads))
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))  # nanoGPT's mask buffer

    def heads(self, x):  # noqa: ANN001, ANN201
        b, s, _ = x.shape
        split = lambda t, n: t.view(b, s, n, HEAD_DIM).transpose(1, 2)  # noqa: E731
        return split(self.q(x), HEADS), split(self.k(x), self.kv), split(self.v(x), self.kv)


def _sdpa_causal(self, x):  # noqa: ANN001, ANN202
    q, k, v = self.heads(x)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != HEADS)


def _bool_triu(self, x):  # noqa: ANN001, ANN202
    q, k, v = self.heads(x)
    hidden = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
    return torch.softmax((q @ k.transpose(-1, -2) / HEAD_DIM**0.5).masked_fill(hidden, float("-inf")), -1) @ v


def _nanogpt(self, x):  # noqa: ANN001, ANN202
    q, k, v = self.heads(x)
    s = x.shape[1]
    scores = (q @ k.transpose(-1, -2)) * (1.0 / HEAD_DIM**0.5)
    return torch.softmax(scores.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf")), -1) @ v


def _full_triu(self, x):  # noqa: ANN001, ANN202
    q, k, v = self.heads(x)
    s = x.shape[1]
    return torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5 + torch.full((s, s), float("-inf")).triu(1), -1) @ v


def _repeat_then_sdpa_with_mask(self, x):  # noqa: ANN001, ANN202
    q, k, v = self.heads(x)
    g = HEADS // self.kv
    keep = torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool))
    return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=keep)


FORMS = {
    "sdpa-is-causal": (_sdpa_causal, HEADS),
    "sdpa-is-causal-enable-gqa": (_sdpa_causal, KV_HEADS),
    "bool-triu-masked-fill": (_bool_triu, HEADS),
    "nanogpt-tril-buffer": (_nanogpt, HEADS),
    "full-inf-triu": (_full_triu, HEADS),
    "repeat-interleave-sdpa-mask": (_repeat_then_sdpa_with_mask, KV_HEADS),
}


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_causal_attention_forms_import_with_outputs_equal_to_onnxruntime(form, exporter, tmp_path):
    forward, kv_heads = FORMS[form]
    if exporter == "legacy" and form == "sdpa-is-causal-enable-gqa":
        pytest.skip("torch's legacy exporter has no enable_gqa")
    module = type(form.replace("-", "_"), (_Attention,), {"forward": forward})
    torch.manual_seed(0)
    m = module(kv_heads).eval()
    path = tmp_path / "attention.onnx"
    x = torch.randn(2, 10, 32)
    if exporter == "dynamo":
        d = torch.export.Dim.DYNAMIC
        torch.onnx.export(m, (x,), str(path), dynamo=True, input_names=["x"], output_names=["y"], dynamic_shapes=({0: d, 1: d},), verbose=False)
    else:
        torch.onnx.export(
            m, (x,), str(path), dynamo=False, input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch", 1: "seq"}}, opset_version=18
        )
    graph = from_onnx(path)
    optimized = optimize(graph).graph
    attention = [n.op for n in lower(optimized, NUMPY_TARGET).nodes.values() if n.op.kind == "Attention"]
    assert len(attention) == 1 and attention[0].visibility.causal_offset == 0 and attention[0].mask == "none", attention  # causal, no mask tensor
    for batch, seq in ((1, 1), (3, 7), (2, 33)):
        xs = np.random.default_rng(seq).standard_normal((batch, seq, 32)).astype(np.float32)
        want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": xs})[0]
        for backend in ("numpy", "ort-cpu"):
            got = run(optimized, {graph.inputs[0]: xs}, backend=backend)[optimized.outputs[0]]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{backend} at {batch, seq}")


def test_compare_on_an_export_the_reference_evaluator_cannot_run_is_not_a_disagreement(tmp_path):
    """ONNX's reference evaluator fails on torch.onnx's BERT file itself (its GatherElements over an Expand): the
    onnx-reference row is skipped with that reason, and the backends that run it agree with onnxruntime on the file."""
    from lowering import compare

    path = export_model("bert", "legacy", "eager", False, tmp_path / "model.onnx")
    report = compare(from_onnx(path), backends=["numpy", "onnx-reference", "ort-cpu"], repeats=1, sizes={"batch": 1, "seq": 16},
                     reference_model=path)  # fmt: skip
    rows = {r.backend: r for r in report.results}
    assert rows["onnx-reference"].status == "skipped" and "cannot run the original model either" in rows["onnx-reference"].reason
    assert rows["numpy"].status == rows["ort-cpu"].status == "ok" and report.ok, report


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_int4_export_from_onnxruntimes_quantizer_is_understood_and_equal_to_onnxruntime(family, tmp_path):
    """torch.onnx's cache export quantized to int4 by onnxruntime's matmul_nbits_quantizer (every projection and the LM
    head a MatMulNBits, block 32): one causal attention with its cache per layer, every product kept packed, the numbers
    onnxruntime gives on the file; the re-export's MatMulNBits hold the file's bytes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    path = export_model(family, "dynamo", "sdpa", True, tmp_path / "model.onnx")
    quantizer = MatMulNBitsQuantizer(onnx.load(str(path)), bits=4, block_size=32, accuracy_level=0)
    quantizer.process()
    model = quantizer.model.model
    onnx.save(model, str(tmp_path / "int4.onnx"))
    graph = from_onnx(tmp_path / "int4.onnx")
    optimized = optimize(graph).graph
    products = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert optimized.op_counts().get("QuantizedMatMul") == len(products) >= 15 and "DequantizeBlocks" not in optimized.op_counts()
    attention = [n.op for n in lower(optimized, KEEP_ALL).topological_order() if n.op.kind == "Attention"]
    assert len(attention) == 2 and all(op.kv_cache and op.visibility.causal_offset is not None for op in attention)
    _equals_onnxruntime(tmp_path / "int4.onnx", model, graph, optimized, SIZES[True][:2], ("numpy", "ort-cpu"))
    packed = {t.name: t.raw_data for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8}
    out = export(optimized)
    kept = {t.raw_data for t in out.graph.initializer if t.data_type == onnx.TensorProto.UINT8}
    assert set(packed.values()) <= kept


@pytest.mark.parametrize("weight_type, fused", [("int8", False), ("uint8", False), ("int8", True)])
def test_an_int8_export_from_quantize_dynamic_is_understood_and_equal_to_onnxruntime(weight_type, fused, tmp_path):
    """torch.onnx's cache export through onnxruntime's quantize_dynamic (DynamicQuantizeLinear + MatMulInteger per
    projection, the embedding table a DequantizeLinear), and (``fused``) the file onnxruntime's optimizer saves from it
    (DynamicQuantizeMatMul, MatMulIntegerToFloat, FusedMatMul, QuickGelu): one causal attention with its cache per
    layer, onnxruntime's numbers, and the re-export's 8-bit weights the file's."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = export_model("llama", "dynamo", "sdpa", True, tmp_path / "model.onnx")
    quantize_dynamic(str(path), str(tmp_path / "int8.onnx"), weight_type=QuantType.QInt8 if weight_type == "int8" else QuantType.QUInt8)
    if fused:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(tmp_path / "fused.onnx")
        ort.InferenceSession(str(tmp_path / "int8.onnx"), options, providers=["CPUExecutionProvider"])
        (tmp_path / "fused.onnx").replace(tmp_path / "int8.onnx")
    model = onnx.load(str(tmp_path / "int8.onnx"))
    graph = from_onnx(tmp_path / "int8.onnx")
    optimized = optimize(graph).graph
    products = sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat") for n in model.graph.node)
    assert optimized.op_counts().get("IntegerMatMul") == products >= 15
    assert fused == any(n.domain == "com.microsoft" for n in model.graph.node)
    attention = [n.op for n in lower(optimized, KEEP_ALL).topological_order() if n.op.kind == "Attention"]
    assert len(attention) == 2 and all(op.kv_cache and op.visibility.causal_offset is not None for op in attention)
    # an activation quantized on the fly rounds the other way where graphc's float differs from onnxruntime's in the last
    # bit: one int8 step of that activation, times its weights, on the outputs it reaches; 1% of the output's range
    within_a_step = lambda want: 0.01 * float(np.abs(want).max())  # noqa: E731
    _equals_onnxruntime(tmp_path / "int8.onnx", model, graph, optimized, SIZES[True][:2], ("numpy", "ort-cpu"), atol=within_a_step, rtol=0)
    eight_bit = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
    held = {t.raw_data for t in model.graph.initializer if t.data_type in eight_bit and len(t.dims) == 2}
    assert held <= {t.raw_data for t in export(optimized).graph.initializer if t.data_type in eight_bit}


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_a_float16_export_equals_onnxruntime_and_its_causal_masks_are_read(exporter, tmp_path):
    """A cache export converted to float16 (onnxruntime's float16 converter: weights, inputs and the mask's fill become
    float16, the fill float16's -65504): onnxruntime's numbers on every size, padded rows included.  Both exporters'
    causal masks are read as the causal offset with its cache: the legacy exporter's masked_fill of a triangle and the
    dynamo exporter's Where over position comparisons, each filled with -65504 seen through the Cast that widens it
    where graphc computes in float32 (in the file's float16 arithmetic that fill swamps any score under 16, so a row
    it hides whole is uniform: the op's empty_rows "mean").  Every row equals ONNX's reference evaluator, which
    computes the file's float16 ops in float16; onnxruntime computes the float16 chain in float32, so it differs on the
    query rows that see no key (padding), and equals graphc on every other row."""
    from onnx.reference import ReferenceEvaluator
    from onnxruntime.transformers.float16 import convert_float_to_float16

    path = export_model("llama", exporter, "sdpa", True, tmp_path / "model.onnx")
    model = convert_float_to_float16(onnx.load(str(path)), keep_io_types=False)
    onnx.save(model, str(tmp_path / "f16.onnx"))
    graph = from_onnx(tmp_path / "f16.onnx")
    optimized = optimize(graph).graph
    attention = [n.op for n in lower(optimized, KEEP_ALL).topological_order() if n.op.kind == "Attention"]
    assert len(attention) == 2 and all(op.kv_cache and op.visibility.causal_offset is not None for op in attention)
    session = ort.InferenceSession(str(tmp_path / "f16.onnx"), providers=["CPUExecutionProvider"])
    reference = ReferenceEvaluator(model)
    runners = {backend: prepare(optimized, backend) for backend in ("numpy", "ort-cpu")}
    for batch, seq, past, pad in SIZES[True]:
        f = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in feeds(model, batch, seq, past, pad).items()}
        strict, want = reference.run(None, f), session.run(None, f)
        mine = {name: f[vi.name] for name, vi in zip(graph.inputs, model.graph.input)}
        for backend, runner in runners.items():
            got = runner.run(mine)
            for name, w, r in zip(optimized.outputs, want, strict):
                err = f"{backend} {name} at {batch, seq, past, pad}"
                np.testing.assert_allclose(got[name].astype(np.float32), r.astype(np.float32), rtol=1e-2, atol=2e-3, err_msg=err)
                padding = (0, slice(0, max(pad - past, 0))) if w.ndim == 3 else (0, slice(None), slice(past, max(pad, past)))
                mine_seen, w_seen = got[name].astype(np.float32), w.astype(np.float32)  # the new padding tokens' rows aside
                mine_seen[padding], w_seen[padding] = 0, 0
                np.testing.assert_allclose(mine_seen, w_seen, rtol=1e-2, atol=2e-3, err_msg=err)


def test_a_static_qdq_export_runs_on_every_backend_equal_to_onnxruntime(tmp_path):
    """torch.onnx's cache export through onnxruntime's quantize_static (QDQ pairs on every product's inputs, calibrated
    on two prompts): graphc's numbers on the NumPy backend and on onnxruntime (where onnxruntime's QDQ propagation, at
    the opset graphc exports, would write a QuantizeLinear it then rejects: graphc turns that pass off), within the
    file's own rounding (an activation rounded the other way: 2% of the output's range); every weight kept int8."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    path = export_model("llama", "legacy", "eager", True, tmp_path / "model.onnx")
    model = onnx.load(str(path))
    prompts = iter([feeds(model, 1, n, 0, 0) for n in (5, 9)])

    class Prompts(CalibrationDataReader):
        def get_next(self):  # noqa: ANN201
            return next(prompts, None)

    quantize_static(str(path), str(tmp_path / "qdq.onnx"), Prompts(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul", "Gemm"])
    model = onnx.load(str(tmp_path / "qdq.onnx"))
    graph = from_onnx(tmp_path / "qdq.onnx")
    optimized = optimize(graph).graph
    assert optimized.op_counts().get("Quantize", 0) >= 10
    within = lambda want: 0.02 * float(np.abs(want).max())  # noqa: E731
    _equals_onnxruntime(tmp_path / "qdq.onnx", model, graph, optimized, SIZES[True][:2], ("numpy", "ort-cpu"), atol=within, rtol=0)
    eight_bit = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
    held = {t.raw_data for t in model.graph.initializer if t.data_type in eight_bit and len(t.dims) == 2}
    assert held and held <= {t.raw_data for t in export(optimized).graph.initializer if t.data_type in eight_bit}
