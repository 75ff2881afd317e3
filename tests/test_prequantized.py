"""AWQ and GPTQ checkpoints read packed: each layer's integers repacked into MatMulNBits' layout without going through
float weights, every projection one packed product, the logits transformers gives on the float twin (each weight
dequantized here, in NumPy, by the format's formula), and the export's MatMulNBits bytes the values the checkpoint
holds.  The checkpoints are written here by packers that follow AutoAWQ's and AutoGPTQ's own loops."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checkpoints import CONFIG, write_checkpoint

from graphc import optimize
from graphc.attention.hf_lm import causal_lm_from_hf
from graphc.errors import WeightError
from graphc.quantized import QuantizedMatMul, unpack_bits
from graphc.weights import load_weights
from lowering import run

BITS, GROUP = 4, 32
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _quantize(w: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit groups of ``W [N, K]`` along K: ``q [K, N]``, ``zeros [groups, N]``, ``scales [groups, N]``."""
    n, k = w.shape
    g = w.T.reshape(k // GROUP, GROUP, n)
    lo, hi = g.min(axis=1), g.max(axis=1)
    scales = ((hi - lo) / 15).astype(np.float32)
    zeros = rng.integers(1, 15, scales.shape)  # any zero point a quantizer may pick, 0 and 15 aside (GPTQ's zero - 1 wraps)
    q = np.clip(np.rint(g / scales[:, None, :]) + zeros[:, None, :], 0, 15).reshape(k, n)
    return q.astype(np.int64), zeros.astype(np.int64), scales


def _pack_gptq(q: np.ndarray, zeros: np.ndarray, less_one: bool) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's pack: ``qweight[i, n]`` holds rows ``8 i .. 8 i + 7`` of ``q [K, N]``, ``qzeros[g, j]`` columns
    ``8 j .. 8 j + 7`` of the zero points (less one in the ``gptq`` format)."""
    k, n = q.shape
    qweight = np.zeros((k // 8, n), np.uint32)
    for i in range(k // 8):
        for j in range(8):
            qweight[i] |= q[8 * i + j].astype(np.uint32) << (4 * j)
    z = (zeros - 1) & 15 if less_one else zeros
    qzeros = np.zeros((z.shape[0], n // 8), np.uint32)
    for col in range(n // 8):
        for j in range(8):
            qzeros[:, col] |= z[:, 8 * col + j].astype(np.uint32) << (4 * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def _pack_awq(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoAWQ's ``gemm`` pack: word ``col`` of a row holds columns ``8 col + order_map[i]`` at bits ``4 i``."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(values: np.ndarray) -> np.ndarray:
        words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                words[:, col] |= values[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
        return words.view(np.int32)

    return pack(q), pack(zeros)


def _prompt_feeds(graph, ids=np.array([[1, 5, 9, 4, 7, 3]], np.int64)) -> dict[str, np.ndarray]:  # noqa: B008
    """A prompt's inputs with an empty cache."""
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    for name in graph.inputs[3:]:
        t = graph.types[name]
        feeds[name] = np.zeros((1, t.shape[1], 0, t.shape[3]), np.float32)
    return feeds


def _write(tmp_path, method: str, fmt: str = "gptq") -> tuple:
    """An AWQ or GPTQ checkpoint of a seeded llama, its float twin (each weight dequantized here), and each
    projection's ``q [K, N]``."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    float_folder = write_checkpoint(tmp_path / "float", SHAPE, varied=True)
    weights = dict(load_weights(float_folder))
    twin, packed, values = dict(weights), {}, {}
    for name in [n for n in weights if n.endswith(".weight") and any(p in n for p in PROJECTIONS)]:
        layer = name[: -len(".weight")]
        q, zeros, scales = _quantize(np.asarray(weights[name]), rng)
        rows = np.arange(q.shape[0]) // GROUP
        twin[name] = ((q - zeros[rows]) * scales[rows]).T.astype(np.float32)  # W [N, K] by the format's formula
        qweight, qzeros = _pack_awq(q, zeros) if method == "awq" else _pack_gptq(q, zeros, fmt == "gptq")
        packed |= {f"{layer}.qweight": qweight, f"{layer}.qzeros": qzeros, f"{layer}.scales": scales}
        if method == "gptq":
            packed[f"{layer}.g_idx"] = rows.astype(np.int32)
        values[name] = q
    folder = write_checkpoint(tmp_path / method, SHAPE, safetensors=False)
    quant = {"quant_method": method, "bits": BITS, "group_size": GROUP}
    quant |= {"version": "gemm", "zero_point": True} if method == "awq" else {"desc_act": False, "sym": False, "checkpoint_format": fmt}
    config = json.loads((folder / "config.json").read_text()) | {"quantization_config": quant}
    (folder / "config.json").write_text(json.dumps(config))
    held = {k: v for k, v in weights.items() if k not in values} | packed
    save_file({k: np.ascontiguousarray(v) for k, v in held.items()}, str(folder / "model.safetensors"))  # safetensors writes memory order
    twin_folder = write_checkpoint(tmp_path / "twin", SHAPE, safetensors=False)
    save_file({k: np.ascontiguousarray(v) for k, v in twin.items()}, str(twin_folder / "model.safetensors"))
    return folder, twin_folder, values


@pytest.mark.parametrize("method, fmt", [("awq", ""), ("gptq", "gptq"), ("gptq", "gptq_v2")])
def test_a_prequantized_checkpoint_runs_packed_with_the_float_twins_logits(method, fmt, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder, twin_folder, values = _write(tmp_path, method, fmt)
    graph = causal_lm_from_hf(folder / "config.json", load_weights(folder))
    opt = optimize(graph).graph
    products = [n for n in opt.nodes.values() if isinstance(n.op, QuantizedMatMul)]
    assert len(products) == len(values) == 7 * SHAPE["num_hidden_layers"] and "DequantizeBlocks" not in opt.op_counts()
    floats = [a for a in opt.initializers.values() if a.dtype == np.float32 and a.ndim == 2 and a.size >= 64 * 64]
    assert all(a.shape[0] == CONFIG["vocab_size"] for a in floats)  # the tables alone stay float
    held = {unpack_bits(opt.initializers[n.inputs[1]], 4).reshape(len(opt.initializers[n.inputs[1]]), -1).tobytes() for n in products}
    assert held == {np.ascontiguousarray(q.T).astype(np.uint8).tobytes() for q in values.values()}  # the checkpoint's values, K along each row
    ids = _prompt_feeds(graph)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(twin_folder, torch_dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    feeds = _prompt_feeds(graph, ids)
    for backend in ("numpy", "ort-cpu"):
        got = run(opt, feeds, backend)[opt.outputs[0]]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=backend)


def test_the_export_of_an_awq_checkpoint_writes_its_values_as_matmulnbits(tmp_path):
    import onnx
    import onnxruntime as ort

    from lowering.checkpoint_export import export_checkpoint

    folder, _, values = _write(tmp_path, "awq")
    out = export_checkpoint(folder, tmp_path / "out")
    model = onnx.load(str(out.model))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == len(values)
    held = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    exported = {unpack_bits(held[n.input[1]], 4).reshape(held[n.input[1]].shape[0], -1).tobytes() for n in nbits}
    assert {np.ascontiguousarray(q.T).astype(np.uint8).tobytes() for q in values.values()} == exported
    session = ort.InferenceSession(str(out.model), providers=["CPUExecutionProvider"])
    feeds = _prompt_feeds(optimize(causal_lm_from_hf(folder / "config.json", load_weights(folder))).graph)
    want = run(optimize(causal_lm_from_hf(folder / "config.json", load_weights(folder))).graph, feeds, "numpy")["logits"]
    np.testing.assert_allclose(session.run(["logits"], feeds)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_method": "bitsandbytes"}, "graphc reads AWQ and GPTQ checkpoints"),
        ({"version": "gemv"}, "graphc reads AutoAWQ's gemm layout"),
        ({"bits": 3}, "graphc reads 4-bit AWQ"),
        ({"group_size": 64}, r"must hold 2 group\(s\) of 64"),
    ],
)
def test_a_layout_graphc_does_not_read_is_refused_by_name(change, message, tmp_path):
    folder, _, _ = _write(tmp_path, "awq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] |= change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match=message):
        causal_lm_from_hf(folder / "config.json", load_weights(folder))


def test_act_order_gptq_is_refused_by_name(tmp_path):
    from safetensors.numpy import save_file

    folder, _, _ = _write(tmp_path, "gptq")
    weights = dict(load_weights(folder))
    name = next(n for n in weights if n.endswith(".g_idx"))
    weights[name] = np.asarray(weights[name])[::-1].copy()
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(folder / "model.safetensors"))
    with pytest.raises(WeightError, match="g_idx reorders the groups"):
        causal_lm_from_hf(folder / "config.json", load_weights(folder))


def test_row_slices_of_a_stand_in_read_their_rows_packed():
    """A family that splits a fused projection (Phi-3's ``qkv_proj``) places row slices of the stand-in: each slice
    reads the packed bytes, scales and zero points of its own rows (the dequantized rows of the whole weight)."""
    import graphc
    from graphc.prequantized import PrequantizedLayout, apply_prequantized, read_prequantized

    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (64, 96))  # [K, N]
    zeros, scales = rng.integers(0, 16, (2, 96)), rng.uniform(0.01, 0.1, (2, 96)).astype(np.float32)
    qweight, qzeros = _pack_gptq(q, zeros, less_one=False)
    layout = PrequantizedLayout("gptq", 4, 32)
    weights, packed = read_prequantized(layout, {"qkv.qweight": qweight, "qkv.qzeros": qzeros, "qkv.scales": scales})
    stand_in = weights["qkv.weight"]
    g = graphc.Graph("split")
    x = g.add_input("x", (3, 64), "float32")
    parts = (("q", slice(0, 32)), ("k", slice(32, 64)), ("v", slice(64, 96)))
    placed = {name: g.add_initializer(f"{name}.weight", stand_in[rows], copy=False) for name, rows in parts}
    g.output(*[g.add_node(graphc.ops.Einsum("bk,nk->bn"), [x, w], name) for name, w in placed.items()])
    g = apply_prequantized(g, packed, {"qkv.weight": stand_in})
    whole = ((q - zeros[np.arange(64) // 32]) * scales[np.arange(64) // 32]).T  # W [N, K] by the format's formula
    xs = rng.standard_normal((3, 64)).astype(np.float32)
    got = run(optimize(g).graph, {"x": xs}, "numpy")
    for name, rows in parts:
        np.testing.assert_allclose(got[name], xs @ whole[rows].T, rtol=1e-5, atol=1e-5, err_msg=name)
