"""Quantized weights: ``MatMulNBits`` files (4 and 8 bits, every zero-point form, padded K, bias) imported as graph
math, fused into one packed product, equal to onnxruntime on the original file on every backend, and re-exported
with the original's packed bytes (nothing widened); the block layout checked against a NumPy reference written here."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphc import optimize
from graphc.errors import OnnxImportError, OpError
from graphc.onnx_import import from_onnx
from graphc.quantized import DequantizeBlocks, QuantizedMatMul, dequantize_blocks, pack_bits, quantize_blocks, unpack_bits
from lowering import export, run

from conftest import installed


def _reference_weight(packed, scales, zero_points, bits, block_size, k):
    """W[n, j] = (q[n, j] - zero[n, j // block]) * scale[n, j // block], element by element from the bytes."""
    n, blocks, _ = packed.shape
    flat = packed.reshape(n, -1)
    zeros = np.full((n, blocks), 2.0 ** (bits - 1))
    if zero_points is not None and zero_points.dtype == np.uint8:
        rows = zero_points.reshape(n, -1)
        zeros = np.array([[(rows[r, b * bits // 8] >> (b * bits % 8)) & ((1 << bits) - 1) for b in range(blocks)] for r in range(n)], float)
    elif zero_points is not None:
        zeros = zero_points.reshape(n, blocks).astype(float)
    scale = scales.reshape(n, blocks).astype(float)
    w = np.zeros((n, k))
    for r in range(n):
        for j in range(k):
            q = (flat[r, j * bits // 8] >> (j * bits % 8)) & ((1 << bits) - 1)
            w[r, j] = (q - zeros[r, j // block_size]) * scale[r, j // block_size]
    return w


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 4), count=st.integers(1, 9), seed=st.integers(0, 99))
def test_packing_round_trips_low_bits_first(bits, rows, count, seed):
    values = np.random.default_rng(seed).integers(0, 1 << bits, (rows, count)).astype(np.uint8)
    packed = pack_bits(values, bits)
    assert packed.shape == (rows, -(-count * bits // 8))
    if bits == 4:
        assert np.array_equal(packed[:, 0] & 15, values[:, 0])  # the low nibble holds the first value
    np.testing.assert_array_equal(unpack_bits(packed, bits)[:, :count], values)


@pytest.mark.parametrize("bits, symmetric, k", [(4, True, 64), (4, False, 80), (8, True, 40), (8, False, 64)])
def test_dequantize_blocks_is_the_block_formula(bits, symmetric, k):
    w = np.random.default_rng(bits + k).standard_normal((5, k)).astype(np.float32)
    packed, scales, zeros = quantize_blocks(w, bits, 16, symmetric)
    got = dequantize_blocks(packed, scales, zeros, bits, 16, k)
    np.testing.assert_allclose(got, _reference_weight(packed, scales, zeros, bits, 16, k), rtol=1e-6, atol=1e-6)
    assert np.abs(got - w).max() <= np.abs(scales).max() * (1.0 if symmetric else 0.5) + 1e-6  # a step where the top level clips


def _matmul_nbits(bits, block_size, k, n, zero="none", bias=False, rank=3, level=0, seed=0):
    """A one-node ``MatMulNBits`` model of a random weight quantized here, and the weight's parts."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, scales, zeros = quantize_blocks(w, bits, block_size, symmetric=zero == "none")
    if zero == "float":
        zeros = rng.uniform(0, (1 << bits) - 1, scales.size).astype(np.float32)
    names = ["A", "B", "scales", "zero_points" if zero != "none" else "", "", "bias" if bias else ""]
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    inits += [numpy_helper.from_array(zeros, "zero_points")] if zero != "none" else []
    inits += [numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias")] if bias else []
    while names[-1] == "":
        names.pop()
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block_size, accuracy_level=level)
    batch = ["b", "s"][: rank - 1]
    g = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [*batch, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*batch, n])], inits)  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model, packed, scales, zeros


CASES = [
    (4, 32, 64, 24, "none", False, 3),
    (4, 32, 80, 16, "packed", True, 3),  # K padded to 96
    (4, 16, 48, 8, "float", False, 2),
    (8, 32, 64, 24, "packed", False, 3),
    (8, 64, 96, 8, "none", True, 2),
]


@pytest.mark.parametrize("bits, block_size, k, n, zero, bias, rank", CASES)
def test_matmul_nbits_imports_equal_to_onnxruntime_on_every_backend(bits, block_size, k, n, zero, bias, rank):
    model, packed, scales, zeros = _matmul_nbits(bits, block_size, k, n, zero, bias, rank)
    a = np.random.default_rng(1).standard_normal((2, 3, k)[3 - rank :]).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]
    reference = a @ _reference_weight(packed, scales, zeros, bits, block_size, k).T
    if bias:
        reference = reference + numpy_helper.to_array(model.graph.initializer[-1])
    np.testing.assert_allclose(want, reference, rtol=1e-4, atol=1e-4)  # onnxruntime itself is the block formula
    graph = from_onnx(model)
    assert graph.op_counts().get("DequantizeBlocks") == 1
    opt = optimize(graph).graph
    assert opt.op_counts().get("QuantizedMatMul") == 1 and "DequantizeBlocks" not in opt.op_counts()
    assert sum(a.nbytes for a in opt.initializers.values() if a.dtype == np.uint8) == packed.nbytes + (zeros.nbytes if zero == "packed" else 0)
    for backend in installed("numpy", "ort-cpu", "torch", "onnx-reference"):
        if backend == "onnx-reference" and zero == "float":
            continue  # float zero points have no standard DequantizeLinear form (tested below)
        np.testing.assert_allclose(run(opt, {"A": a}, backend)["Y"], want, rtol=1e-5, atol=1e-5, err_msg=backend)
    np.testing.assert_allclose(run(graph, {"A": a}, "numpy")["Y"], want, rtol=1e-5, atol=1e-5)  # unfused: the same numbers


def test_a_reexport_keeps_the_packed_bytes_and_the_accuracy_level(tmp_path):
    model, packed, scales, zeros = _matmul_nbits(4, 32, 80, 16, "packed", level=4)
    opt = optimize(from_onnx(model)).graph
    out = export(opt, tmp_path / "re.onnx")
    (node,) = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (80, 16, 4, 32, 4)
    tensors = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert np.array_equal(tensors[node.input[1]].reshape(-1), packed.reshape(-1))  # the original's bytes
    assert not [t for t in tensors.values() if t.dtype != np.uint8 and t.size >= 80 * 16]  # nothing widened to float
    a = np.random.default_rng(2).standard_normal((1, 2, 80)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]
    got = ort.InferenceSession(str(tmp_path / "re.onnx"), providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_standard_export_is_a_blockwise_dequantize_linear_of_the_same_bytes():
    model, packed, _, _ = _matmul_nbits(4, 32, 64, 8, "packed")
    out = export(optimize(from_onnx(model)).graph, quantized="qdq")
    (dq,) = [n for n in out.graph.node if n.op_type == "DequantizeLinear"]
    data = next(t for t in out.graph.initializer if t.name == dq.input[0])
    assert data.data_type == TensorProto.UINT4 and list(data.dims) == [8, 64] and data.raw_data == packed.tobytes()
    assert not any(n.domain == "com.microsoft" for n in out.graph.node)
    again = optimize(from_onnx(out)).graph  # read back: one packed product over the same bytes
    (node,) = [n for n in again.nodes.values() if isinstance(n.op, QuantizedMatMul)]
    assert again.initializers[node.inputs[1]].tobytes() == packed.tobytes()
    float_zero, *_ = _matmul_nbits(4, 16, 48, 8, "float")
    with pytest.raises(Exception, match="zero points .* are not packed uint8 constants"):
        export(optimize(from_onnx(float_zero)).graph, quantized="qdq")


@pytest.mark.parametrize("level", [0, 4])
def test_onnxruntimes_own_quantizer_output_imports_equal_to_onnxruntime(level):
    """A float MatMul quantized by onnxruntime's matmul_nbits_quantizer (asymmetric, block 32): the file users get.  At
    accuracy_level 4 onnxruntime also quantizes the activations to int8 (blocks of 32 along K): graphc computes the
    exact product of the dequantized weight, so the two differ by at most that rounding, |W| times half an int8 step
    of each activation block (the error budget computed here)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 48])], [w])  # fmt: skip
    quantizer = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), bits=4, block_size=32, accuracy_level=level)
    quantizer.process()
    model = quantizer.model.model
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    x = rng.standard_normal((5, 64)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    opt = optimize(from_onnx(model)).graph
    (node,) = [n for n in opt.nodes.values() if isinstance(n.op, QuantizedMatMul)]
    zero = opt.initializers.get(node.inputs[3]) if len(node.inputs) > 3 else None
    weight = dequantize_blocks(opt.initializers[node.inputs[1]], opt.initializers[node.inputs[2]], zero, 4, 32, 64)
    step = np.repeat(np.abs(x).reshape(5, 2, 32).max(axis=-1) / 127 / 2, 32, axis=1)  # half an int8 step per activation block
    budget = step @ np.abs(weight).T + 1e-4 if level == 4 else 1e-4
    for backend in installed("numpy", "ort-cpu", "onnx-reference"):
        got = run(opt, {"x": x}, backend)["y"]
        assert np.all(np.abs(got - want) <= budget + 1e-4 * np.abs(want)), (backend, np.abs(got - want).max())


def test_act_order_and_bad_layouts_are_refused_by_name():
    model, *_ = _matmul_nbits(4, 32, 64, 8)
    node = model.graph.node[0]
    node.input.extend(["", "g_idx"])
    model.graph.initializer.append(numpy_helper.from_array(np.random.default_rng(0).permutation(64).astype(np.int32) // 32, "g_idx"))
    with pytest.raises(OnnxImportError, match="g_idx reorders the blocks"):
        from_onnx(model)
    with pytest.raises(OpError, match="block_size must be a power of two >= 16"):
        DequantizeBlocks(4, 24, 64)
    with pytest.raises(OpError, match="bits must be 4 or 8"):
        QuantizedMatMul(3, 32, 64)


# ------------------------------------------------------------------ --quantize from a checkpoint folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from checkpoints import write_checkpoint

    config = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "tie_word_embeddings": False}
    return write_checkpoint(tmp_path_factory.mktemp("quantize") / "ckpt", config, varied=True)


@pytest.mark.parametrize("bits, asymmetric", [(4, False), (8, True)])
def test_quantize_weights_reads_every_matrix_quantized_and_the_twin_gives_its_numbers(folder, bits, asymmetric):
    """Every projection, MLP matrix and the LM head read quantized (packed: 1/8 or 1/4 of their float bytes); the
    result equals the float model whose matrices are the dequantized ones (its exact twin) on every backend."""
    import graphc
    from graphc.quantize import QuantizeOptions, quantize_weights
    from graphc.weights import load_weights

    lm = graphc.causal_lm_from_hf(folder / "config.json", load_weights(folder), logits="all")
    quantized, count = quantize_weights(lm, QuantizeOptions(bits, 32, symmetric=not asymmetric))
    assert count == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer and the LM head
    twin = lm.copy()
    for node in quantized.nodes.values():
        if isinstance(node.op, DequantizeBlocks):
            weight = node.name.removesuffix(".dequantized")
            twin.initializers[weight] = node.op.evaluate([quantized.initializers[i] for i in node.inputs], {}).astype(np.float32)
    opt = optimize(quantized).graph
    assert opt.op_counts()["QuantizedMatMul"] == count
    feeds = {"input_ids": np.array([[1, 5, 9, 13]]), "attention_mask": np.ones((1, 4), np.int64), "position_ids": np.arange(4)[None]}
    feeds = {k: v for k, v in feeds.items() if k in opt.inputs}
    feeds |= {n: np.zeros((1, 2, 0, 16), np.float32) for n in opt.inputs if n.startswith("past")}
    want = run(twin, feeds, "numpy")["logits"]
    for backend in installed("numpy", "ort-cpu", "torch"):
        np.testing.assert_allclose(run(opt, feeds, backend)["logits"], want, rtol=1e-4, atol=1e-4, err_msg=backend)


def test_export_quantize_int4_writes_matmulnbits_that_onnxruntime_runs_as_graphc_does(folder, tmp_path, capsys):
    from graphc.cli import main

    out = tmp_path / "int4"
    assert main(["export", str(folder), "-o", str(out), "--quantize", "int4", "--quiet"]) == 0
    model = onnx_load(out / "model.onnx")
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 15 and {helper.get_attribute_value(a) for n in nbits for a in n.attribute if a.name == "bits"} == {4}
    floats = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) == 2 and "rotary" not in t.name]
    assert floats == ["model.embed_tokens.weight"]  # the lookup table alone stays float (untied)
    assert main(["generate", str(folder), "--prompt-ids", "1,5,9,13", "--max-new-tokens", "6", "--backends", "numpy,ort-cpu",
                 "--quantize", "int4", "--quiet"]) == 0  # fmt: skip: exit 0 = both backends give the same tokens
    assert main(["generate", str(folder), "--prompt-ids", "1,5", "--quantize-block-size", "24", "--quantize", "int4", "--quiet"]) == 2
    assert "block_size must be a power of two >= 16" in capsys.readouterr().err
    assert main(["generate", str(folder), "--prompt-ids", "1,5", "--accuracy-level", "4", "--quiet"]) == 2
    assert "go with --quantize" in capsys.readouterr().err
    assert main(["export", "--preset", "mistral-7b", "-o", str(tmp_path / "a.onnx"), "--quantize", "int8"]) == 2


def onnx_load(path):
    import onnx

    return onnx.load(str(path))


# ------------------------------------------------------------------ 8-bit: quantize_dynamic's and optimum's ops


def _one_node(node, inputs, outputs, initializers=(), opset=21):
    g = helper.make_graph([node], "one", inputs, outputs, list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("values", [[-1.5, 0.25, 3.0, 7.1], [0.5, 1.0, 2.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-3.0, -1.0, -0.5, -2.0]])
def test_dynamic_quantize_is_onnxs_formula_and_onnxruntimes_numbers(values):
    from graphc.quantized_int8 import dynamic_quantize

    x = np.array(values, np.float32)
    lo, hi = min(x.min(), 0), max(x.max(), 0)  # the formula of ONNX's DynamicQuantizeLinear, written out
    scale = np.float32((hi - lo) / 255)
    zero = np.clip(np.rint(-lo / scale), 0, 255) if scale else 0
    want_q = np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.uint8) if scale else np.zeros(4, np.uint8)
    q, s, z = dynamic_quantize(x)
    assert np.array_equal(q, want_q) and s == (scale or 1.0) and z == zero  # an all-zero x: scale 1, as onnxruntime gives it
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])
    outs = (("q", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("z", TensorProto.UINT8))
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in outs]
    model = _one_node(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])], outputs)
    for got, want in zip((q, s, z), _ort(model, {"x": x})):
        np.testing.assert_array_equal(got, want)
    for backend in installed("numpy", "ort-cpu", "onnx-reference"):
        got = run(from_onnx(model), {"x": x}, backend)
        for name, want in zip(("q", "s", "z"), _ort(model, {"x": x})):
            if not (backend == "onnx-reference" and name == "s" and not x.any()):  # ONNX's evaluator: 1/255 for an all-zero x
                np.testing.assert_array_equal(got[name], want, err_msg=backend)


@pytest.mark.parametrize("b_dtype, per_column", [(np.int8, False), (np.uint8, True)])
def test_matmul_integer_and_dequantize_linear_equal_onnxruntime(b_dtype, per_column):
    rng = np.random.default_rng(0)
    info = np.iinfo(b_dtype)
    w = rng.integers(info.min, info.max + 1, (16, 6)).astype(b_dtype)
    zero = rng.integers(info.min, info.max + 1, 6 if per_column else ()).astype(b_dtype)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(zero, "wz")]
    node = helper.make_node("MatMulInteger", ["a", "w", "az", "wz"], ["y"])
    ins = [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", 16]), helper.make_tensor_value_info("az", TensorProto.UINT8, [])]
    model = _one_node(node, ins, [helper.make_tensor_value_info("y", TensorProto.INT32, None)], inits)
    feeds = {"a": rng.integers(0, 256, (3, 16)).astype(np.uint8), "az": np.array(7, np.uint8)}
    want = (feeds["a"].astype(np.int64) - 7) @ (w.astype(np.int64) - zero.astype(np.int64))
    np.testing.assert_array_equal(_ort(model, feeds)[0], want)
    opt = optimize(from_onnx(model)).graph
    assert {a.dtype for a in opt.initializers.values()} == {np.dtype(b_dtype)}  # the weight kept 8-bit
    for backend in installed("numpy", "ort-cpu", "onnx-reference", "torch"):
        np.testing.assert_array_equal(run(opt, feeds, backend)["y"], want, err_msg=backend)


@pytest.mark.parametrize("axis, block_size, scale_shape", [(1, 0, []), (0, 0, [4]), (1, 0, [6]), (1, 2, [4, 3])])
def test_dequantize_linear_of_8_bit_data_equals_onnxruntime(axis, block_size, scale_shape):
    rng = np.random.default_rng(1)
    x = rng.integers(-128, 128, (4, 6)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, scale_shape).astype(np.float32)
    zero = rng.integers(-5, 5, scale_shape).astype(np.int8)
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], axis=axis, **({"block_size": block_size} if block_size else {}))
    ins, outs = [helper.make_tensor_value_info("x", TensorProto.INT8, [4, 6])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    model = _one_node(node, ins, outs, [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z")])
    want = _ort(model, {"x": x})[0]
    for backend in installed("numpy", "ort-cpu", "onnx-reference"):
        np.testing.assert_allclose(run(from_onnx(model), {"x": x}, backend)["y"], want, rtol=1e-6, atol=1e-7, err_msg=backend)


@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from([4, 8]), zero=st.sampled_from(["none", "packed", "float"]), rows=st.sampled_from([1, 3, 16, 17, 40]),
       n=st.integers(1, 37), blocks=st.integers(1, 3), pad=st.integers(0, 15), seed=st.integers(0, 99))  # fmt: skip
def test_the_numpy_kernels_read_the_packed_weight_as_the_reference_does(bits, zero, rows, n, blocks, pad, seed):
    """Decode rows through the compiled kernel (numba), prefill rows through blocks dequantized on graphc's threads:
    both the reference semantics (dequantize, then multiply), K padded or not, every zero-point form."""
    from lowering.kernels.quantized import quantized_matmul

    rng = np.random.default_rng(seed)
    k = blocks * 16 - pad
    packed, scales, zeros = quantize_blocks(rng.standard_normal((n, k)).astype(np.float32), bits, 16, symmetric=zero == "none")
    if zero == "float":
        zeros = rng.uniform(0, (1 << bits) - 1, scales.size).astype(np.float32)
    op = QuantizedMatMul(bits, 16, k)
    args = [rng.standard_normal((rows, k)).astype(np.float32), packed, scales] + ([zeros] if zeros is not None else [])
    want = op.evaluate(args, {})
    np.testing.assert_allclose(quantized_matmul(op, args, {}, 2)[0], want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ quantized tables (GatherBlockQuantized)


@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, True)])
def test_gather_block_quantized_imports_equal_to_onnxruntime_and_reexports(bits, symmetric):
    from graphc.quantized import QuantizedGather

    rng = np.random.default_rng(bits)
    table = rng.standard_normal((10, 64)).astype(np.float32)
    packed, scales, zeros = quantize_blocks(table, bits, 32, symmetric)
    inits = [numpy_helper.from_array(packed.reshape(10, -1), "table"), numpy_helper.from_array(scales.reshape(10, -1), "scales")]
    inits += [numpy_helper.from_array(zeros.reshape(10, -1), "zeros")] if zeros is not None else []
    node = helper.make_node("GatherBlockQuantized", ["table", "ids", "scales", *(["zeros"] if zeros is not None else [])], ["y"],
                            domain="com.microsoft", bits=bits, block_size=32, gather_axis=0, quantize_axis=1)  # fmt: skip
    g = helper.make_graph([node], "lookup", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    ids = np.array([[1, 3, 9], [0, 9, 2]])
    want = _ort(model, {"ids": ids})[0]
    np.testing.assert_allclose(want, _reference_weight(packed, scales, zeros, bits, 32, 64)[ids], rtol=1e-6, atol=1e-6)
    opt = optimize(from_onnx(model)).graph
    assert opt.op_counts() == {"QuantizedGather": 1}
    for backend in installed("numpy", "ort-cpu", "onnx-reference", "torch"):
        np.testing.assert_array_equal(run(opt, {"ids": ids}, backend)["y"], want, err_msg=backend)
    assert [n.op_type for n in export(opt).graph.node if n.domain] == ["GatherBlockQuantized"]
    with pytest.raises(Exception, match="outside|out of"):
        run(opt, {"ids": np.array([[10]])}, "numpy")
    assert QuantizedGather(bits, 32, 64).infer  # the op is public


def test_a_tied_table_is_looked_up_from_the_lm_heads_bytes(tmp_path):
    """--quantize on a tied model: the embedding reads the LM head's packed table (GatherBlockQuantized beside
    MatMulNBits, as onnxruntime-genai's builder writes a tied table): the float table is gone."""
    import graphc
    from graphc.attention.hf_lm import causal_lm_config_from_hf
    from graphc.quantize import quantize_weights
    from lowering import generate

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 97, "tie_word_embeddings": True}  # fmt: skip
    lm = graphc.causal_lm_graph(causal_lm_config_from_hf(config), seed=0)
    quantized, _ = quantize_weights(lm)
    assert "model.embed_tokens.weight" not in quantized.initializers and quantized.op_counts()["QuantizedGather"] == 1
    opt = optimize(quantized).graph
    out = export(opt)
    (lookup,) = [n for n in out.graph.node if n.op_type == "GatherBlockQuantized"]
    table = next(n.input[0] for n in out.graph.node if n.output[0] == lookup.input[0])  # the Reshape of the packed table
    assert table in {n.input[1] for n in out.graph.node if n.op_type == "MatMulNBits"}  # the LM head's bytes, written once
    prompts = [[1, 5, 9], [7, 3]]
    np.testing.assert_array_equal(generate(opt, prompts, 5, backend="ort-cpu").new_tokens, generate(opt, prompts, 5).new_tokens)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_blocks_writes_onnxruntimes_own_bytes(symmetric):
    """graphc's round-to-nearest quantizer gives the bytes, scales and zero points of onnxruntime's matmul_nbits_quantizer
    (its blockwise quantizer, which onnxruntime-genai's builder uses too): a symmetric block's scale is signed, its value
    of largest size mapping to -8 exactly."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 96)).astype(np.float32)  # MatMul's B [K, N]: MatMulNBits holds W = B.T
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 96])], [numpy_helper.from_array(w, "w")])  # fmt: skip
    quantizer = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), bits=4, block_size=32, is_symmetric=symmetric)
    quantizer.process()
    held = {t.name: numpy_helper.to_array(t) for t in quantizer.model.model.graph.initializer}
    node = quantizer.model.model.graph.node[0]
    packed, scales, zeros = quantize_blocks(w.T, 4, 32, symmetric)
    assert np.array_equal(held[node.input[1]].reshape(-1), packed.reshape(-1))
    assert np.array_equal(held[node.input[2]].reshape(-1), scales)
    assert (zeros is None) == (len(node.input) < 4) and (zeros is None or np.array_equal(held[node.input[3]].reshape(-1), zeros))


def test_a_quantized_graph_round_trips_through_json(tmp_path):
    from graphc.serialize import load_graph, save_graph

    model, *_ = _matmul_nbits(4, 32, 80, 16, "packed", level=4)
    opt = optimize(from_onnx(model)).graph
    save_graph(opt, tmp_path / "g.json")
    back = load_graph(tmp_path / "g.json")
    (node,) = [n for n in back.nodes.values() if isinstance(n.op, QuantizedMatMul)]
    assert node.op == QuantizedMatMul(4, 32, 80, 4)
    a = np.random.default_rng(0).standard_normal((1, 3, 80)).astype(np.float32)
    np.testing.assert_array_equal(run(back, {"A": a}, "numpy")["Y"], run(opt, {"A": a}, "numpy")["Y"])


@pytest.mark.parametrize("activations, per_channel", [("uint8", False), ("int8", True)])
def test_a_static_qdq_file_imports_equal_to_onnxruntime_with_its_weights_8_bit(activations, per_channel, tmp_path):
    """quantize_static's QDQ format (QuantizeLinear/DequantizeLinear pairs on activations, a DequantizeLinear of the
    8-bit weight, per tensor or per channel): onnxruntime's numbers on every backend, and the weight never folded into
    float (import, optimizer and re-export keep it int8)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"x": np.random.default_rng(i).standard_normal((4, 64)).astype(np.float32)} for i in range(4)])

        def get_next(self):  # noqa: ANN201
            return next(self.batches, None)

    w = numpy_helper.from_array(np.random.default_rng(9).standard_normal((64, 48)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 48])], [w])  # fmt: skip
    import onnx

    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "f.onnx"))
    kind = QuantType.QUInt8 if activations == "uint8" else QuantType.QInt8
    quantize_static(str(tmp_path / "f.onnx"), str(tmp_path / "qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ, activation_type=kind,
                    weight_type=QuantType.QInt8, per_channel=per_channel)  # fmt: skip
    model = onnx.load(str(tmp_path / "qdq.onnx"))
    assert {n.op_type for n in model.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
    x = np.random.default_rng(42).standard_normal((5, 64)).astype(np.float32)
    want = _ort(model, {"x": x})[0]
    opt = optimize(from_onnx(model)).graph
    assert opt.op_counts()["Dequantize"] == 3 and opt.op_counts()["Quantize"] == 2
    assert [a.dtype for a in opt.initializers.values() if a.size == 64 * 48] == [np.int8]
    for backend in installed("numpy", "ort-cpu", "onnx-reference", "torch"):
        np.testing.assert_allclose(run(opt, {"x": x}, backend)["y"], want, rtol=1e-6, atol=1e-6, err_msg=backend)
    assert [t.data_type for t in export(opt).graph.initializer if np.prod(t.dims) == 64 * 48] == [TensorProto.INT8]


@pytest.mark.parametrize("zero_dtype", [TensorProto.UINT8, TensorProto.INT8])
def test_quantize_linear_rounds_half_to_even_and_saturates_as_onnxruntime(zero_dtype):
    x = np.array([-300.0, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.49, 300.0, 127.5], np.float32)
    zero = np.array(3 if zero_dtype == TensorProto.UINT8 else -3, np.uint8 if zero_dtype == TensorProto.UINT8 else np.int8)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
    model = _one_node(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [10])], [helper.make_tensor_value_info("y", zero_dtype, None)],
                      [numpy_helper.from_array(np.array(1.0, np.float32), "s"), numpy_helper.from_array(zero, "z")])  # fmt: skip
    want = _ort(model, {"x": x})[0]
    info = np.iinfo(zero.dtype)
    np.testing.assert_array_equal(want, np.clip(np.rint(x) + zero.astype(np.float32), info.min, info.max).astype(zero.dtype))
    for backend in installed("numpy", "ort-cpu", "onnx-reference"):
        np.testing.assert_array_equal(run(from_onnx(model), {"x": x}, backend)["y"], want, err_msg=backend)


@pytest.mark.parametrize("axis, dtype", [(1, np.int8), (0, np.uint8)])
def test_blockwise_quantize_linear_equals_the_formula_onnxruntime_and_onnxs_evaluator(axis, dtype):
    """QuantizeLinear-21 with ``block_size`` (scales and zero points of x's rank, ``axis`` in blocks of 4, the last block
    short) and its DequantizeLinear: each block its own scale, written out here, and onnxruntime's numbers."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((6, 10)) * 4).astype(np.float32)
    blocks = list(x.shape)
    blocks[axis] = -(-x.shape[axis] // 4)
    scale = rng.uniform(0.02, 0.1, blocks).astype(np.float32)
    info = np.iinfo(dtype)
    zero = rng.integers(info.min // 4, info.max // 4, blocks).astype(dtype)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=axis, block_size=4),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=axis, block_size=4)]  # fmt: skip
    kind = TensorProto.INT8 if dtype == np.int8 else TensorProto.UINT8
    g = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 10])],
                          [helper.make_tensor_value_info("q", kind, [6, 10]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 10])],
                          [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z")])  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    spread = lambda v: np.repeat(v, 4, axis=axis).take(np.arange(x.shape[axis]), axis=axis).astype(np.float32)  # noqa: E731
    q = np.clip(np.rint(x / spread(scale)) + spread(zero), info.min, info.max).astype(dtype)
    y = (q.astype(np.float32) - spread(zero)) * spread(scale)
    want = _ort(model, {"x": x})
    np.testing.assert_array_equal(want[0], q)
    np.testing.assert_allclose(want[1], y, rtol=1e-6)
    graph = optimize(from_onnx(model)).graph
    for backend in installed("numpy", "ort-cpu", "onnx-reference"):
        got = run(graph, {"x": x}, backend)
        np.testing.assert_array_equal(got["q"], q, err_msg=backend)
        np.testing.assert_allclose(got["y"], y, rtol=1e-6, err_msg=backend)


@pytest.mark.parametrize("shared, per_channel", [(False, False), (False, True), (True, True)])
def test_onnxruntimes_fused_int8_products_import_equal_to_onnxruntime(shared, per_channel, tmp_path):
    """The file onnxruntime's optimizer saves from a quantize_dynamic model: one product whose input only it reads becomes
    DynamicQuantizeMatMul (its bias folded in), products sharing an input MatMulIntegerToFloat after one
    DynamicQuantizeLinear.  Each equals onnxruntime on that file and the integer product written here in NumPy; the
    re-export is standard ONNX holding the file's int8 bytes, which ONNX's reference evaluator runs."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(5)
    weights = [rng.standard_normal((64, 24)).astype(np.float32) for _ in range(2 if shared else 1)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]) for i in range(len(weights))]
    nodes.append(helper.make_node("Add", ["p0", "p1" if shared else "bias"], ["y"]))
    inits = [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)]
    inits.append(numpy_helper.from_array(rng.standard_normal(24).astype(np.float32), "bias"))
    g = helper.make_graph(nodes, "f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 24])], inits[:-1] if shared else inits)  # fmt: skip
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / "f.onnx"))
    quantize_dynamic(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), weight_type=QuantType.QInt8, per_channel=per_channel)
    options = ort.SessionOptions()
    options.graph_optimization_level, options.optimized_model_filepath = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, str(tmp_path / "fused.onnx")
    ort.InferenceSession(str(tmp_path / "q.onnx"), options, providers=["CPUExecutionProvider"])
    model = onnx.load(str(tmp_path / "fused.onnx"))
    fused = "MatMulIntegerToFloat" if shared else "DynamicQuantizeMatMul"
    assert [n.op_type for n in model.graph.node].count(fused) == len(weights)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    want = _ort(model, {"x": x})[0]
    held = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    lo, hi = min(x.min(), 0), max(x.max(), 0)  # DynamicQuantizeLinear and the integer product, written out
    x_scale = np.float32((hi - lo) / 255)
    x_zero = np.clip(np.rint(-lo / x_scale), 0, 255)
    xq = np.clip(np.rint(x / x_scale) + x_zero, 0, 255) - x_zero
    reference = held.get("bias", 0) * (not shared)
    for i in range(len(weights)):
        wq = held[f"w{i}_quantized"].astype(np.int64) - held[f"w{i}_zero_point"].astype(np.int64)
        reference = reference + (xq @ wq) * (x_scale * held[f"w{i}_scale"])
    step = 0.01 * float(np.abs(want).max())  # an activation rounded the other way in the last float bit
    np.testing.assert_allclose(want, reference, atol=step, rtol=0)
    opt = optimize(from_onnx(model)).graph
    assert opt.op_counts().get("IntegerMatMul") == len(weights)
    for backend in installed("numpy", "ort-cpu", "onnx-reference"):
        np.testing.assert_allclose(run(opt, {"x": x}, backend)["y"], want, atol=step, rtol=0, err_msg=backend)
    kept = {t.raw_data for t in export(opt).graph.initializer if t.data_type == TensorProto.INT8}
    assert {numpy_helper.from_array(held[f"w{i}_quantized"]).raw_data for i in range(len(weights))} <= kept


@pytest.mark.parametrize("symmetric, k", [(True, 64), (False, 80)])
def test_a_4_bit_qdq_file_imports_kept_4_bit_and_equal_to_onnxruntime(symmetric, k):
    """matmul_nbits_quantizer's QDQ format: ``DequantizeLinear`` of an INT4 (symmetric) or UINT4 weight ``[K, N]`` with
    its zero points, in blocks of 32 down the columns (K = 80: a last block of 16), then ``MatMul``.  graphc reads it
    as one packed product whose values are the file's (each unpacked here and compared), equal to the ONNX reference
    evaluator and to onnxruntime computing it exactly (left to itself, onnxruntime runs such a file as MatMulNBits at
    accuracy level 4: int8 activations); the re-export's MatMulNBits holds 4-bit bytes, nothing widened."""
    from onnx.reference import ReferenceEvaluator
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((k, 24)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 24])], [w])  # fmt: skip
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, quant_format=QuantFormat.QDQ)
    quantizer = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), algo_config=config)
    quantizer.process()
    model = quantizer.model.model
    held = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (data,) = [v for v in held.values() if v.shape == (k, 24)]
    assert str(data.dtype) == ("int4" if symmetric else "uint4")
    x = rng.standard_normal((5, k)).astype(np.float32)
    exact = ort.SessionOptions()
    exact.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    want = ort.InferenceSession(model.SerializeToString(), exact, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    opt = optimize(from_onnx(model)).graph
    (node,) = [n for n in opt.nodes.values() if isinstance(n.op, QuantizedMatMul)]
    packed = opt.initializers[node.inputs[1]]
    assert packed.dtype == np.uint8 and packed.shape == (24, -(-k // 32), 16)
    shift = 8 if symmetric else 0  # a signed value v is held as v + 8, its zero point too
    values = unpack_bits(packed, 4).reshape(24, -1)[:, :k].astype(np.int16) - shift
    np.testing.assert_array_equal(values, data.astype(np.int16).T)
    for backend in installed("numpy", "ort-cpu", "onnx-reference"):
        np.testing.assert_allclose(run(opt, {"x": x}, backend)["y"], want, rtol=1e-5, atol=1e-5, err_msg=backend)
    out = export(opt)
    assert {n.op_type for n in out.graph.node} == {"MatMulNBits"}
    assert all(t.data_type != TensorProto.FLOAT or np.prod(t.dims) <= 24 * 3 for t in out.graph.initializer)


def test_4_bit_data_the_importer_cannot_read_as_a_weight_is_refused_by_name():
    data = helper.make_tensor("q", TensorProto.INT4, [4, 32], np.zeros(128, np.int8).tolist())
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1)
    scale = numpy_helper.from_array(np.ones(4, np.float32), "s")
    model = _one_node(node, [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [data, scale])
    with pytest.raises(OnnxImportError, match="graphc reads a 4-bit weight matrix in blocks along one axis"):
        from_onnx(model)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_blocks_in_row_chunks_gives_the_bytes_of_one_pass(symmetric, monkeypatch):
    """A weight quantized a few rows at a time (as a large table is, to bound the float32 temporaries) gives exactly the
    bytes, scales and zero points of one pass over it."""
    import graphc.quantized as quantized

    w = np.random.default_rng(4).standard_normal((37, 80)).astype(np.float32)
    whole = quantize_blocks(w, 4, 32, symmetric)
    monkeypatch.setattr(quantized, "QUANTIZE_CHUNK_BYTES", 5 * 80 * 4)  # 5 rows a chunk, the last one 2
    chunked = quantize_blocks(w, 4, 32, symmetric)
    for a, b in zip(whole, chunked):
        assert (a is None and b is None) or np.array_equal(a, b)
    assert np.array_equal(dequantize_blocks(chunked[0], chunked[1], chunked[2], 4, 32, 80), dequantize_blocks(*whole, 4, 32, 80))


def test_matmul_integer_of_two_batched_activations_equals_onnxruntime():
    """optimum's int8 export quantizes the rotary product ``inv_freq [B, D, 1] @ positions [B, 1, S]`` too: a
    MatMulInteger whose both operands carry batch axes (numpy.matmul's broadcasting), each with its zero point."""
    rng = np.random.default_rng(6)
    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    ins = [helper.make_tensor_value_info(n, TensorProto.UINT8, s) for n, s in (("a", ["b", 16, 1]), ("b", ["b", 1, "s"]), ("az", []), ("bz", []))]
    model = _one_node(node, ins, [helper.make_tensor_value_info("y", TensorProto.INT32, None)])
    feeds = {"a": rng.integers(0, 256, (2, 16, 1)).astype(np.uint8), "b": rng.integers(0, 256, (2, 1, 5)).astype(np.uint8),
             "az": np.array(3, np.uint8), "bz": np.array(200, np.uint8)}  # fmt: skip
    want = (feeds["a"].astype(np.int64) - 3) @ (feeds["b"].astype(np.int64) - 200)
    np.testing.assert_array_equal(_ort(model, feeds)[0], want)
    graph = from_onnx(model)
    assert graph.types[graph.outputs[0]].shape[1:] == (16, "s")
    for backend in installed("numpy", "ort-cpu", "onnx-reference", "torch"):
        np.testing.assert_array_equal(run(graph, feeds, backend)["y"], want, err_msg=backend)


def test_a_fused_int8_product_whose_input_size_is_a_free_symbol_takes_the_weights_size():
    """onnxruntime's saved files name some sizes afresh (``unk__67``): DynamicQuantizeMatMul's input ``[m, unk]`` times
    a ``[16, 4]`` weight proves ``unk`` is 16, as a float MatMul's would; the product then equals onnxruntime."""
    rng = np.random.default_rng(8)
    w = rng.integers(-128, 128, (16, 4)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.05, np.float32), "s")]
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "s"], ["y"], domain="com.microsoft")
    ins, outs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", "unk"])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    model = _one_node(node, ins, outs, inits)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    x = rng.standard_normal((3, 16)).astype(np.float32)
    want = _ort(model, {"x": x})[0]
    for backend in installed("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(from_onnx(model), {"x": x}, backend)["y"], want, atol=0.01 * float(np.abs(want).max()), err_msg=backend)
