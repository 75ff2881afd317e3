"""Every softmax fused or explained: what attention recognition leaves alone is listed with the matcher's reason."""

from __future__ import annotations

import numpy as np
import pytest

import graphc
from graphc import Graph
from graphc.cli import main
from graphc.optimizer import optimize, unfused_softmaxes

CFG = graphc.AttentionConfig(32, 4, 2)

BUILT = {
    "layer": lambda: graphc.attention_layer_graph(CFG, seed=0),
    "decode": lambda: graphc.kv_cache_graph(CFG, seed=0),
    "cross": lambda: graphc.cross_attention_graph(CFG, seed=0),
    "bool mask": lambda: graphc.sdpa_graph(CFG, causal=False, mask=True),
    "window": lambda: graphc.attention_layer_graph(CFG.with_(sliding_window=4), seed=0),
    "alibi + padding": lambda: graphc.attention_layer_graph(CFG.with_(alibi=True), seed=0, mask="bool", mask_per_query=False),
    "lm": lambda: graphc.causal_lm_graph(
        graphc.attention.causal_lm_config_from_hf(
            {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 50}  # fmt: skip
        ),
        seed=0,
    ),
}


@pytest.mark.parametrize("kind", BUILT)
def test_every_softmax_of_the_builders_is_part_of_a_recognised_attention(kind):
    g = BUILT[kind]()
    assert unfused_softmaxes(optimize(g).graph) == []
    assert unfused_softmaxes(g) == []  # the unoptimized graph too


def _softmax_of(scores_fn) -> Graph:  # noqa: ANN001
    g = Graph("not_attention")
    x = g.input("x", ["b", 6, 8])
    w = g.constant("w", np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32))
    g.output(scores_fn(g, x, w))
    return g


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda g, x, w: g.softmax(g.einsum("bsd,dc->bsc", x, w)), "not read by one einsum"),  # a classifier head
        (lambda g, x, w: g.softmax(g.einsum("bsd,dc->bsc", x, w), axis=1), "softmax over axis 1"),
        (lambda g, x, w: g.softmax(g.unary("exp", g.einsum("bsd,dc->bsc", x, w))), "Unary(exp)"),
        (lambda g, x, w: g.softmax(x), "a graph input"),
    ],
    ids=["classifier", "axis", "exp-on-scores", "input"],
)
def test_a_softmax_left_alone_says_why(build, reason):
    left = unfused_softmaxes(_softmax_of(build))
    assert len(left) == 1 and reason in left[0].reason, left


def test_the_command_line_lists_them(tmp_path, capsys):
    g = _softmax_of(lambda g, x, w: g.softmax(g.einsum("bsd,dc->bsc", x, w)))
    graphc.save_graph(g, tmp_path / "g.json")
    assert main(["optimize", "--graph", str(tmp_path / "g.json"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "softmax left unfused once attention is recognised: 1" in out and "not read by one einsum" in out
    assert main(["optimize", "--preset", "mistral-7b", "--explain", "--seq", "8"]) == 0
    assert "softmax left unfused once attention is recognised: 0" in capsys.readouterr().out


@pytest.mark.parametrize("per_query", [False, True])
def test_alibi_under_a_padding_mask_is_one_attention_with_the_graphs_numbers(per_query):
    """ALiBi's bias under a bool padding mask (``Where(keep, s + bias, -inf)``): one attention whose additive mask is the
    bias with the hidden keys at ``-inf``; a row whose keys are all padding gives zeros, as the graph does."""
    from graphc.optimizer import KEEP_EVERY_ATTENTION, lower
    from lowering import random_inputs, run

    g = graphc.attention_layer_graph(CFG.with_(alibi=True), seed=0, mask="bool", mask_per_query=per_query)
    optimized = optimize(g).graph
    ops = [n.op for n in lower(optimized, KEEP_EVERY_ATTENTION).nodes.values() if n.op.kind == "Attention"]
    assert [op.visibility for op in ops] == [graphc.Visibility.causal(0, mask="additive")]
    feeds = random_inputs(g, seed=1, batch=2, seq=5)
    feeds["attn_mask"][0, ..., :2] = False  # row 0 left-padded: its first two queries see no key
    want = run(g, feeds, reference=True, compute_dtype="float64")["out_BSM"]
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(optimized, feeds, backend)["out_BSM"], want, rtol=2e-4, atol=2e-5, err_msg=backend)
