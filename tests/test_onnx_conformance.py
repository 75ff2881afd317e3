"""ONNX's own backend test cases, imported with graphc.from_onnx and run on graphc's backends.

The 93 (non-expanded) ``Attention`` cases of onnx 1.23 (opsets 23, 24, 25: 3D
and 4D inputs, GQA, masks of every rank and dtype, past/present, the four
``qk_matmul_output_mode`` outputs, softcap, ``softmax_precision``,
``nonpad_kv_seqlen``, sliding windows, fp16/bf16) run on the NumPy
interpreter, on ONNX's reference evaluator and on onnxruntime (graphc's
decomposed export), both as imported and after graphc's optimizer.  The
expected outputs are the ones onnx ships with each case.  The same is done for
``RotaryEmbedding``, ``RMSNormalization`` and ``LayerNormalization``.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

from graphc import optimize
from graphc.onnx_import import from_onnx
from lowering import run

ONNX_TOLERANCE = {"rtol": 1e-3, "atol": 1e-7}  # onnx's backend-test defaults, for float32/float64 outputs
LOW_PRECISION_TOLERANCE = {"rtol": 2e-2, "atol": 2e-2}  # float16/bfloat16 outputs: graphc computes in float32, onnx's reference in the storage dtype


CASE_MODULES = ("attention", "rotaryembedding", "rmsnormalization", "layernormalization")
"""The modules of onnx's node cases this file runs: importing one builds its cases (collect_testcases would build
all 1,884, about 26 s in every test process, to use 139)."""


@functools.lru_cache(maxsize=None)
def _cases() -> dict[str, object]:
    import importlib

    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in CASE_MODULES:
            importlib.import_module(f"onnx.backend.test.case.node.{module}")
    return {c.name: c for c in node_cases._NodeTestCases if "expanded" not in c.name and len(c.model.graph.node) == 1}


def _names(op_type: str) -> list[str]:
    return sorted(n for n, c in _cases().items() if c.model.graph.node[0].op_type == op_type)


ATTENTION_CASES = _names("Attention")


def _check(case_name: str, backend: str, optimized: bool) -> None:
    case = _cases()[case_name]
    g = from_onnx(case.model, strict=True)
    if optimized:
        g = optimize(g).graph
    initializers = {t.name for t in case.model.graph.initializer}
    inputs, expected = case.data_sets[0]
    feeds = {vi.name: x for vi, x in zip([i for i in case.model.graph.input if i.name not in initializers], inputs)}
    got = run(g, feeds, backend=backend)
    for vi, want in zip(case.model.graph.output, expected):
        tol = ONNX_TOLERANCE if want.dtype in (np.float32, np.float64) else LOW_PRECISION_TOLERANCE
        np.testing.assert_allclose(np.asarray(got[vi.name], np.float64), np.asarray(want, np.float64), err_msg=f"{case_name} output {vi.name}", **tol)


def test_all_93_attention_cases_are_collected() -> None:
    assert len(ATTENTION_CASES) == 93
    opsets = {next(o.version for o in _cases()[n].model.opset_import if o.domain in ("", "ai.onnx")) for n in ATTENTION_CASES}
    assert opsets == {23, 24, 25}


@pytest.mark.parametrize("backend", ["numpy", "onnx-reference", "ort-cpu"])
@pytest.mark.parametrize("case_name", ATTENTION_CASES)
def test_attention_case(case_name: str, backend: str) -> None:
    _check(case_name, backend, optimized=False)


@pytest.mark.parametrize("backend", ["numpy", "ort-cpu"])
@pytest.mark.parametrize("case_name", ATTENTION_CASES)
def test_attention_case_optimized(case_name: str, backend: str) -> None:
    _check(case_name, backend, optimized=True)


@pytest.mark.parametrize("case_name", _names("RotaryEmbedding") + _names("RMSNormalization") + _names("LayerNormalization"))
@pytest.mark.parametrize("backend", ["numpy", "ort-cpu"])
def test_rope_and_norm_cases(case_name: str, backend: str) -> None:
    _check(case_name, backend, optimized=True)


def test_gqa_case_uses_consecutive_kv_groups() -> None:
    """The GQA cases pass only with head h -> KV head h // group; with the tile order (h % n_kv) they fail."""
    case = _cases()["test_attention_4d_gqa"]
    (q, k, v), (want,) = case.data_sets[0]
    group = q.shape[1] // k.shape[1]
    tiled_k, tiled_v = np.tile(k, (1, group, 1, 1)), np.tile(v, (1, group, 1, 1))
    s = np.einsum("bhqd,bhkd->bhqk", q, tiled_k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    tiled = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), tiled_v)
    assert not np.allclose(tiled, want, rtol=1e-3, atol=1e-5)
    got = run(from_onnx(case.model), {"Q": q, "K": k, "V": v}, backend="numpy")["Y"]
    np.testing.assert_allclose(got, want, **ONNX_TOLERANCE)


def test_legacy_semantics_mask_before_softcap_and_swapped_modes() -> None:
    """``attention_semantics="legacy"`` reads Attention as onnx <= 1.21 did: masks, then softcap; mode 1 after the masks."""
    case = _cases()["test_attention_4d_with_qk_matmul_softcap"]  # qk_matmul_output_mode=1, softcap=2, float mask
    (q, k, v, mask), _ = case.data_sets[0]
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) / np.sqrt(q.shape[-1]) + mask
    capped = 2.0 * np.tanh(scores / 2.0)
    p = np.exp(capped - capped.max(-1, keepdims=True))
    want_y = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)
    g = from_onnx(case.model, attention_semantics="legacy")
    got = run(g, {"Q": q, "K": k, "V": v, "attn_mask": mask}, backend="numpy")
    np.testing.assert_allclose(got["Y"], want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["qk_matmul_output"], scores, rtol=1e-5, atol=1e-6)  # mode 1 = after the mask, before softcap
    current = run(from_onnx(case.model), {"Q": q, "K": k, "V": v, "attn_mask": mask}, backend="numpy")
    assert not np.allclose(current["Y"], want_y, rtol=1e-3, atol=1e-5)
