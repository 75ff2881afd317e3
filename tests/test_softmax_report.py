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
