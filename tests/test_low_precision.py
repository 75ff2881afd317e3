"""bfloat16/float16 weights on the NumPy backend: read in their stored precision, never held as a float32 copy.

Each kernel is checked against NumPy in float64 on the float32 values of the
weight (the widening is exact), and the whole model against the interpreter
that holds float32 copies (the former behaviour) and against onnxruntime.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphc
from graphc.attention.hf_lm import causal_lm_config_from_hf
from graphc.einsum_spec import parse_einsum
from graphc.errors import ExecutionError, OpError
from graphc.tensor_ops import Gather
from graphc.optimizer import lower
from lowering import generate, prepare
from lowering.kernels import compiled, low_precision
from lowering.backends import numpy_interpreter
from lowering.kernels.bf16_gemm import MIN_ROWS, bf16_gemm_description
from lowering.kernels.low_precision import StoredWeight, contract_stored, stored_operand
from lowering.backends.numpy_interpreter import NumpyInterpreter
from lowering.exporter.targets import NUMPY_TARGET

from conftest import installed

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 97, "rope_theta": 10000.0}  # fmt: skip
PROMPTS = [[5, 17, 33], [7, 1, 90, 44, 12, 60]]
needs_compiled = pytest.mark.skipif(not compiled.use_compiled(), reason="compiled kernels off")


def _weight(rows: int, cols: int, dtype: str, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.dtype(dtype))


def _tolerance(x: np.ndarray, w32: np.ndarray) -> np.ndarray:
    """float32 sums of K products: a few ulps of the sum of magnitudes."""
    return 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w32).astype(np.float64).T) + 1e-30


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 37), k=st.integers(1, 70), threads=st.integers(1, 3))
def test_the_compiled_bfloat16_kernel_equals_float64_on_the_widened_weight(m, n, k, threads):
    w = _weight(n, k, "bfloat16", seed=m * 1000 + n)
    x = np.random.default_rng(k).standard_normal((m, k)).astype(np.float32)
    got = compiled.bf16_matmul(x, w.view(np.uint16), threads)
    w32 = w.astype(np.float32)
    want = x.astype(np.float64) @ w32.astype(np.float64).T
    assert np.all(np.abs(got - want) <= _tolerance(x, w32))


@pytest.mark.parametrize("change, words", [
    (lambda x, w: (x.astype(np.float64), w), "x must be a C-contiguous float32 array"),
    (lambda x, w: (x[:, ::2], w[:, ::2]), "x must be a C-contiguous float32 array"),
    (lambda x, w: (x, w.astype(np.float32)), "w must be the C-contiguous uint16 bits"),
    (lambda x, w: (x, w[:, :3]), "w must be the C-contiguous uint16 bits"),
    (lambda x, w: (x[:, :4].copy(), w), "do not fit"),
])  # fmt: skip
@needs_compiled
def test_the_compiled_bfloat16_kernel_refuses_operands_outside_its_contract(change, words):
    x, w = change(np.ones((2, 6), np.float32), _weight(5, 6, "bfloat16").view(np.uint16))
    with pytest.raises(ExecutionError, match=words):
        compiled.bf16_matmul(x, w, 1)


SPECS = ["bsm,nm->bsn", "nm,bsm->bsn", "bsm,nm->bns", "bsm,nm->nsb", "m,nm->n", "abcm,nm->acnb"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("rows", [1, 3, 40])  # compiled kernel (bfloat16), and blocked conversion + BLAS past COMPILED_MAX_ROWS
def test_a_linear_einsum_over_a_stored_weight_equals_the_float32_copy(spec, dtype, rows):
    s = parse_einsum(spec)
    p = next(i for i in (0, 1) if stored_operand(s, i))
    sizes = {"b": 2, "s": rows, "m": 24, "n": 70, "a": 2, "c": 3}
    if len(s.inputs[1 - p]) == 1:
        sizes["m"] = 24
    x = np.random.default_rng(3).standard_normal([sizes[c] for c in s.inputs[1 - p]]).astype(np.float32)
    w = _weight(sizes["n"], sizes["m"], dtype)
    operands: list = [None, None]
    operands[p], operands[1 - p] = StoredWeight(w), x
    got = contract_stored(s, operands, threads=2)
    dense = [None, None]
    dense[p], dense[1 - p] = w.astype(np.float64), x.astype(np.float64)
    want = np.einsum(spec, *dense)
    assert got.shape == want.shape and got.dtype == np.float32
    if dtype == "bfloat16" and x.size // sizes["m"] >= MIN_ROWS and bf16_gemm_description() is not None:
        # a prefill's product in bfloat16 (lowering.kernels.bf16_gemm): x rounded to bfloat16 as well, the sum rounded once
        dense[1 - p] = x.astype("bfloat16").astype(np.float64)
        np.testing.assert_allclose(got, np.einsum(spec, *dense), rtol=1e-2, atol=2e-2)
        return
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_prefill_product_in_bfloat16_where_the_cpu_has_it_and_float32_when_turned_off(monkeypatch):
    """The bfloat16 GEMM path against the float32 one on the same operands: within bfloat16's rounding, and
    ``GRAPHC_BF16_MATMUL=0`` gives the float32 numbers exactly."""
    w = _weight(300, 64, "bfloat16")
    x = np.random.default_rng(4).standard_normal((64, 64)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    if bf16_gemm_description() is not None:
        np.testing.assert_allclose(contract_stored(parse_einsum("sm,nm->sn"), [x, StoredWeight(w)], threads=2), want, rtol=2e-2, atol=5e-2)
    monkeypatch.setenv("GRAPHC_BF16_MATMUL", "0")
    assert bf16_gemm_description() is None
    np.testing.assert_allclose(contract_stored(parse_einsum("sm,nm->sn"), [x, StoredWeight(w)], threads=2), want, rtol=1e-4, atol=1e-4)


def test_only_a_linear_layers_matrix_is_a_stored_operand():
    assert stored_operand(parse_einsum("bsm,nm->bsn"), 1)
    assert not stored_operand(parse_einsum("bsm,nm->bsn"), 0)
    assert not stored_operand(parse_einsum("bsm,mn->bsn"), 1)  # contracted label first: a transposed read
    assert not stored_operand(parse_einsum("bsm,bm->bs"), 1)  # a batch label, not a kept one
    assert not stored_operand(parse_einsum("bsm,nm->bs"), 1)  # n summed away


def test_an_embedding_lookup_reads_rows_of_the_stored_table():
    w = _weight(11, 6, "bfloat16")
    idx = np.array([[0, 10, -1], [3, 3, 4]])
    np.testing.assert_array_equal(StoredWeight(w).take(Gather(0), idx), w.astype(np.float32)[idx])
    with pytest.raises(OpError, match=r"Gather: index out of range for axis 0 of size 11 \(indices span 11..11\)"):
        StoredWeight(w).take(Gather(0), np.array([11]))


@pytest.fixture(scope="module")
def bf16_lm() -> graphc.Graph:
    return graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0, dtype="bfloat16")


def test_a_bfloat16_model_holds_no_float32_copy_of_its_matrices(bf16_lm, monkeypatch):
    monkeypatch.setattr(numpy_interpreter, "MIN_STORED_BYTES", 0)
    interp = NumpyInterpreter(lower(bf16_lm, NUMPY_TARGET))
    held = interp._weights.values()
    stored = [w for w in held if isinstance(w, StoredWeight)]
    matrices = [a for a in bf16_lm.initializers.values() if a.ndim == 2]
    assert len(stored) == len(matrices)  # every projection, the embedding table and the LM head
    assert not any(isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2 and w.size >= 64 * 64 for w in held)


@pytest.mark.parametrize("kernels", ["auto", "numpy"])
def test_a_bfloat16_model_generates_the_tokens_and_logits_of_its_float32_copy(bf16_lm, monkeypatch, kernels):
    monkeypatch.setenv("GRAPHC_KERNELS", kernels)
    monkeypatch.setattr(numpy_interpreter, "MIN_STORED_BYTES", 1 << 62)
    copied = generate(bf16_lm, PROMPTS, 6, runner=prepare(bf16_lm, "numpy"), keep_logits=True)
    monkeypatch.setattr(numpy_interpreter, "MIN_STORED_BYTES", 0)
    stored = generate(bf16_lm, PROMPTS, 6, runner=prepare(bf16_lm, "numpy"), keep_logits=True)
    np.testing.assert_array_equal(stored.new_tokens, copied.new_tokens)
    for a, b in zip(stored.logits, copied.logits):  # bfloat16 values rounded at other points: within a bfloat16 step of the logits' scale
        b32 = b.astype(np.float32)
        np.testing.assert_allclose(a.astype(np.float32), b32, rtol=0, atol=2 ** -7 * float(np.abs(b32).max()))
    if installed("ort-cpu"):
        on_ort = generate(bf16_lm, PROMPTS, 6, runner=prepare(bf16_lm, "ort-cpu"))
        np.testing.assert_array_equal(stored.new_tokens, on_ort.new_tokens)


def test_a_float16_model_runs_its_matrices_from_the_stored_weights(monkeypatch):
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=1, dtype="float16")
    calls = []
    real = low_precision.stored_matmul
    monkeypatch.setattr(low_precision, "stored_matmul", lambda x, w, t: calls.append(w.stored.dtype) or real(x, w, t))
    monkeypatch.setattr(numpy_interpreter, "MIN_STORED_BYTES", 0)
    stored = generate(g, PROMPTS, 4, runner=prepare(g, "numpy"))
    assert calls and set(calls) == {np.dtype("float16")}
    monkeypatch.setattr(numpy_interpreter, "MIN_STORED_BYTES", 1 << 62)
    np.testing.assert_array_equal(stored.new_tokens, generate(g, PROMPTS, 4, runner=prepare(g, "numpy")).new_tokens)


def test_float64_compute_and_the_reference_mode_keep_float_copies(bf16_lm, monkeypatch):
    monkeypatch.setattr(numpy_interpreter, "MIN_STORED_BYTES", 0)
    lowered = lower(bf16_lm, NUMPY_TARGET)
    for interp in (NumpyInterpreter(lowered, compute_dtype="float64"), NumpyInterpreter(lowered, reference=True)):
        assert not any(isinstance(w, StoredWeight) for w in interp._weights.values())


def test_bfloat16_bits_widen_exactly():
    w = np.array([[1.0], [-2.5], [3.0e38], [-0.0], [np.inf], [1e-40], [np.nan]], ml_dtypes.bfloat16)
    if not compiled.use_compiled():
        pytest.skip("compiled kernels off")
    got = compiled.bf16_matmul(np.ones((1, 1), np.float32), w.view(np.uint16), 1)
    np.testing.assert_array_equal(got[0], w.astype(np.float32)[:, 0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_layer_with_a_padding_mask_is_one_attention_on_numpy(dtype):
    """The graph computes in float32 between low-precision values, so its -inf fill reaches the mask's Where through a
    Cast: still a fill, and the layer is one Attention for the NumPy kernel, equal to the float32 layer's numbers."""
    cfg = graphc.gqa(64, 8, 2)
    layer = graphc.attention_layer_graph(cfg, seed=1, dtype=dtype, mask="bool", mask_per_query=False)
    lowered = lower(graphc.optimize(layer).graph, NUMPY_TARGET, {"batch": 2, "seq": 40})
    assert lowered.op_counts().get("Attention") == 1 and "Softmax" not in lowered.op_counts()
    rng = np.random.default_rng(2)
    keep = np.ones((2, 1, 1, 40), bool)
    keep[0, ..., :5] = False
    x = rng.standard_normal((2, 40, 64)).astype(np.float32)
    got = prepare(layer, "numpy").run({"x_BSM": x.astype(dtype), "attn_mask": keep})["out_BSM"].astype(np.float32)
    wide_weights = {k: v.astype(np.float32) for k, v in layer.initializers.items() if k.endswith(".weight")}
    wide = graphc.attention_layer_graph(cfg, weights=wide_weights, mask="bool", mask_per_query=False)
    want = prepare(wide, "numpy", compute_dtype="float64").run({"x_BSM": x.astype(dtype).astype(np.float32), "attn_mask": keep})["out_BSM"]
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
