"""T5's relative position bias built by graphc equals transformers' ``T5Attention``: the buckets and bias at lengths
past ``max_distance`` (bidirectional, and causal over a past), and a whole self-attention layer with it, which the
optimizer reads as one ``Attention`` with the bias as its additive term."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
from conftest import INSTALLED  # noqa: E402
from transformers.models.t5.modeling_t5 import T5Attention  # noqa: E402

from graphc import AttentionConfig, Graph, Visibility  # noqa: E402
from graphc.attention.relative import RelativePositionBias, relative_attention_graph, write_relative_position_bias  # noqa: E402
from graphc.errors import WeightError  # noqa: E402
from graphc.optimizer import KEEP_EVERY_ATTENTION, lower, optimize  # noqa: E402
from lowering import run  # noqa: E402

pytestmark = pytest.mark.transformers


def _t5_attention(decoder: bool) -> T5Attention:
    cfg = tf.T5Config(d_model=64, d_kv=16, num_heads=4, relative_attention_num_buckets=32, relative_attention_max_distance=128, is_decoder=decoder)
    torch.manual_seed(0)
    return T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).eval()


@pytest.mark.parametrize("bidirectional, past, queries", [(True, 0, 300), (False, 0, 300), (False, 40, 7), (False, 200, 1)])
def test_buckets_and_bias_equal_transformers(bidirectional, past, queries):
    att = _t5_attention(decoder=not bidirectional)
    keys = past + queries
    with torch.no_grad():
        want = att.compute_bias(queries, keys, past_seen_tokens=past).numpy()
    g = Graph("bias")
    g.add_initializer("table", att.relative_attention_bias.weight.detach().numpy())
    out = write_relative_position_bias(g, RelativePositionBias(32, 128, bidirectional), "table", queries, keys, past)
    g.output(out)
    for backend in INSTALLED:
        np.testing.assert_array_equal(run(g, {}, backend)[out.name], want, err_msg=backend)


@pytest.mark.parametrize("decoder", [False, True])
def test_a_self_attention_layer_with_the_bias_equals_t5_attention(decoder):
    att = _t5_attention(decoder)
    names = {"q_proj.weight": att.q, "k_proj.weight": att.k, "v_proj.weight": att.v, "o_proj.weight": att.o}
    weights = {k: m.weight.detach().numpy() for k, m in names.items()}
    weights["relative_attention_bias.weight"] = att.relative_attention_bias.weight.detach().numpy()
    cfg = AttentionConfig(64, 4, 4, causal=decoder, scale=1.0)
    graph = relative_attention_graph(cfg, RelativePositionBias(32, 128, bidirectional=not decoder), weights)
    x = np.random.default_rng(1).standard_normal((2, 150, 64)).astype(np.float32)
    mask = torch.triu(torch.full((150, 150), torch.finfo(torch.float32).min), 1)[None, None] if decoder else None
    with torch.no_grad():
        want = att(torch.from_numpy(x), mask=mask)[0].numpy()
    optimized = optimize(graph).graph
    (op,) = [n.op for n in lower(optimized, KEEP_EVERY_ATTENTION).topological_order() if n.op.kind == "Attention"]
    assert op.visibility == (Visibility(causal_offset=0, mask="additive") if decoder else Visibility(mask="additive"))
    for backend in INSTALLED:
        np.testing.assert_allclose(run(optimized, {"x_BSM": x}, backend)[graph.outputs[0]], want, rtol=1e-4, atol=1e-4, err_msg=backend)


def test_buckets_that_leave_no_exact_range_are_refused():
    with pytest.raises(WeightError, match="need at least one exact bucket per side"):
        RelativePositionBias(buckets=2, max_distance=128, bidirectional=True)
    with pytest.raises(WeightError, match="and a max_distance beyond them"):
        RelativePositionBias(buckets=32, max_distance=8, bidirectional=False)
