"""T5's relative position bias as graph nodes: each (query, key) pair's distance put in a bucket, the bucket's learned
per-head value added to the unscaled scores.

Buckets as transformers' ``T5Attention._relative_position_bucket`` computes them: the distance ``j - i`` (query ``i``
counted after ``past`` cached positions); bidirectional (an encoder) halves the buckets and gives keys after the query
the upper half, causal (a decoder) keeps only the distance back; distances under half the buckets each get their own,
longer ones share logarithmically wider buckets up to ``max_distance``, and everything beyond the last.  The log is
taken of ``max(distance, 1)``: the small distances that would take ``log(0)`` use their exact bucket anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from graphc.dims import Dim, dim_add
from graphc.errors import WeightError
from graphc.graph import Graph, Value
from graphc.tensor_ops import Arange, Gather

from .blocks import _const
from .builders import declare_weights, init_weights, weight_shapes, write_self_attention
from .config import AttentionConfig

__all__ = ["RelativePositionBias", "relative_attention_graph", "write_relative_position_bias"]


@dataclass(frozen=True)
class RelativePositionBias:
    """T5's bucketing: ``buckets`` (``relative_attention_num_buckets``), ``max_distance``
    (``relative_attention_max_distance``) and whether keys after the query count (an encoder: ``True``)."""

    buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    def __post_init__(self) -> None:
        exact = self.buckets // (2 if self.bidirectional else 1) // 2
        if exact < 1 or self.max_distance <= exact:
            raise WeightError(
                f"relative position buckets {self.buckets} (bidirectional={self.bidirectional}) and max_distance {self.max_distance}: "
                f"need at least one exact bucket per side and a max_distance beyond them"
            )


def _buckets(g: Graph, spec: RelativePositionBias, queries: Dim, keys: Dim, past: Dim) -> Value:
    """The int64 bucket of every (query, key) pair, ``[queries, keys]``."""
    i = g.reshape(g.add_node(Arange(past, dim_add(past, queries)), [], g.fresh_name("query_positions")), [queries, 1], name=g.fresh_name("query_col"))
    j = g.add_node(Arange(0, keys), [], g.fresh_name("key_positions"))
    distance = g.sub(j, i, name=g.fresh_name("relative_QK"))
    zero = _const(g, "zero", 0, "int64")
    buckets = spec.buckets
    if spec.bidirectional:
        buckets //= 2
        after = g.cast(g.compare("greater", distance, zero), "int64", name=g.fresh_name("key_after_QK"))
        offset: Value | None = g.mul(after, _const(g, "upper_half", buckets, "int64"), name=g.fresh_name("upper_QK"))
        distance = g.binary("max", distance, g.neg(distance), name=g.fresh_name("distance_QK"))
    else:
        offset = None
        distance = g.binary("max", g.neg(distance), zero, name=g.fresh_name("distance_back_QK"))
    exact = buckets // 2
    small = g.compare("less", distance, _const(g, "exact", exact, "int64"), name=g.fresh_name("small_QK"))
    wide = g.cast(g.binary("max", distance, _const(g, "one", 1, "int64")), "float32", name=g.fresh_name("distance_f32"))
    factor = (buckets - exact) / math.log(spec.max_distance / exact)
    logs = g.scale(g.unary("log", g.scale(wide, 1.0 / exact)), factor, name=g.fresh_name("log_buckets_QK"))
    large = g.add(_const(g, "exact", exact, "int64"), g.cast(logs, "int64"), name=g.fresh_name("large_QK"))
    large = g.binary("min", large, _const(g, "last", buckets - 1, "int64"), name=g.fresh_name("large_capped_QK"))
    bucket = g.where(small, distance, large, name=g.fresh_name("bucket_QK"))
    return bucket if offset is None else g.add(bucket, offset, name=g.fresh_name("bucket_QK"))


def write_relative_position_bias(g: Graph, spec: RelativePositionBias, table: str, queries: Dim, keys: Dim, past: Dim = 0) -> Value:
    """The bias ``[1, heads, queries, keys]`` that T5 adds to its scores: ``table`` (``relative_attention_bias.weight``,
    ``[buckets, heads]``) gathered at each pair's bucket; query ``i`` sits at position ``past + i``."""
    heads = g.types[g.value(table).name].shape[1]
    bias = g.add_node(Gather(0), [table, _buckets(g, spec, queries, keys, past)], g.fresh_name("relative_bias_QKH"))
    bias = g.transpose(bias, [2, 0, 1], name=g.fresh_name("relative_bias_HQK"))
    return g.reshape(bias, [1, heads, queries, keys], name=g.fresh_name("relative_bias_1HQK"))


def relative_attention_graph(
    cfg: AttentionConfig,
    spec: RelativePositionBias,
    weights: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    batch: Dim = "batch",
    seq: Dim = "seq",
    dtype: str = "float32",
) -> Graph:
    """A self-attention layer with T5's relative position bias: ``x_BSM`` -> ``out_BSM``.  ``weights``: the layer's
    (``q_proj.weight`` ...) and ``relative_attention_bias.weight`` ``[buckets, heads]`` (default random).  T5 does
    not scale its scores (``AttentionConfig(scale=1.0)``); ``cfg.causal`` for a decoder's self-attention, whose
    ``spec`` is then not bidirectional."""
    table = "relative_attention_bias.weight"
    if weights is None:
        rng = np.random.default_rng(seed)
        weights = {**init_weights(cfg, seed, dtype), table: (0.1 * rng.standard_normal((spec.buckets, cfg.n_heads))).astype(dtype)}
    if table not in weights or tuple(weights[table].shape) != (spec.buckets, cfg.n_heads):
        raise WeightError(f"{table} must be [{spec.buckets}, {cfg.n_heads}] (buckets, heads)")
    g = Graph("relative_attention")
    x = g.input("x_BSM", [batch, seq, cfg.d_model], dtype)
    declare_weights(g, [*weight_shapes(cfg), table], weights)
    bias = write_relative_position_bias(g, spec, table, seq, seq)
    g.output(write_self_attention(g, cfg, x, bias if dtype == "float32" else g.cast(bias, dtype)))
    return g
