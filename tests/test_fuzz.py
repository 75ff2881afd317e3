"""Differential fuzzing: random graphs on the float64 oracle vs numpy (before and after optimize), onnx-reference, ort-cpu.

``GRAPHC_FUZZ=ci`` (the default) runs 530 examples in all, seconds on 2 cores; ``GRAPHC_FUZZ=long`` runs
2,000 and ``GRAPHC_FUZZ=nightly`` 10,000
(``GRAPHC_FUZZ=long python -m pytest tests/test_fuzz.py``).  onnxruntime runs in a worker process, so a crash in it fails one
example with the signal's name instead of killing the run.  A failure is shrunk
by hypothesis; shrunk failures found so far are pinned below as explicit
examples (and as named tests in ``test_regressions.py``).
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, example, given, settings

from graphc import Graph
from fuzzing import Case, attention_graphs, check_differential, einsum_chains, einsum_dags, int_graphs

PROFILES = {"ci": (300, 80, 100, 50), "long": (1200, 300, 350, 150), "nightly": (6000, 1500, 1750, 750)}
_PROFILE = os.environ.get("GRAPHC_FUZZ", "ci")
if _PROFILE not in PROFILES:
    raise ValueError(f"GRAPHC_FUZZ must be one of {sorted(PROFILES)}, got {_PROFILE!r}")
DAG_EXAMPLES, CHAIN_EXAMPLES, ATTENTION_EXAMPLES, INT_EXAMPLES = PROFILES[_PROFILE]


def _fuzz_settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _folded_causal_mask() -> Case:
    """A causal mask of a constant with offset -1 (row 0 fully masked): folded to a constant holding -inf."""
    g = Graph("folded_mask")
    x = g.input("x", [3, 3])
    scores = g.add(x, g.causal_mask(g.constant("w", np.ones((3, 3), np.float32)), offset=-1, name="cm"), name="s")
    g.output(g.softmax(scores, name="p"))
    return Case(g, {"x": np.arange(9, dtype=np.float32).reshape(3, 3)}, {})


def _rank0_constant() -> Case:
    g = Graph("rank0")
    x = g.input("x", [])
    g.output(g.scale(g.add(x, g.constant("w", np.array(2.0, np.float32)), name="y"), 0.5, name="s"))
    return Case(g, {"x": np.array(3.0, np.float32)}, {})


def _empty_softmax() -> Case:
    g = Graph("empty_softmax")
    x = g.input("x", [5, 0, 4])
    g.output(g.softmax(x, name="p"))
    return Case(g, {"x": np.zeros((5, 0, 4), np.float32)}, {})


def _scalar_transpose() -> Case:
    g = Graph("scalar_transpose")
    x = g.input("x", [])
    g.output(g.transpose(g.neg(x, name="n"), (), name="t"))
    return Case(g, {"x": np.array(1.5, np.float32)}, {})


def _empty_contraction() -> Case:
    g = Graph("empty_contraction")
    a, b = g.input("a", [0, 3, 2]), g.input("b", [0, 3])
    g.output(g.einsum("zUq,zU->qU", a, b, name="y"))
    return Case(g, {"a": np.zeros((0, 3, 2), np.float32), "b": np.zeros((0, 3), np.float32)}, {})


def _integer_division() -> Case:
    g = Graph("int_div")
    a, b = g.input("a", [6], "int32"), g.input("b", [6], "int32")
    g.output(g.div(a, b, name="q"))
    return Case(g, {"a": np.array([7, -7, 7, -7, 5, 0], np.int32), "b": np.array([2, 2, -2, -2, 0, 0], np.int32)}, {})


@_fuzz_settings(DAG_EXAMPLES)
@given(einsum_dags())
@example(_folded_causal_mask())
@example(_rank0_constant())
@example(_empty_softmax())
@example(_scalar_transpose())
@example(_empty_contraction())
def test_random_einsum_dags_agree_on_every_backend(case: Case) -> None:
    check_differential(case)


def _merge_split_loop() -> Case:
    """Merging these einsums and splitting the result undid each other forever (two cost models disagreed)."""
    g = Graph("merge_split")
    x = g.input("x", [4, 1, 5])
    e2 = g.einsum("abc,adc,adc->", x, x, x, name="e2")
    g.output(g.einsum(",abc,dec->ebdca", e2, x, x, name="e3"))
    return Case(g, {"x": np.random.default_rng(0).standard_normal((4, 1, 5)).astype(np.float32)}, {})


@_fuzz_settings(CHAIN_EXAMPLES)
@given(einsum_chains())
@example(_merge_split_loop())
def test_random_einsum_chains_agree_on_every_backend(case: Case) -> None:
    check_differential(case)


@_fuzz_settings(ATTENTION_EXAMPLES)
@given(attention_graphs())
def test_random_attention_graphs_agree_on_every_backend(case: Case) -> None:
    check_differential(case, atol=1e-4, rtol=1e-3)


@_fuzz_settings(INT_EXAMPLES)
@given(int_graphs())
@example(_integer_division())
def test_random_integer_graphs_agree_on_every_backend(case: Case) -> None:
    check_differential(case)
