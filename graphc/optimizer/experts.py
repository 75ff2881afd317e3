"""Mixture-of-experts weights gathered per token, contracted densely instead.

transformers' ``batched_mm`` experts (the form its MoE layers export in) gather each routed token's expert weights and
run one small product per token::

    w = W[ids]                              # [S, O, I]: a copy of one expert's matrix per (token, expert) pair
    y = einsum("soi,si->so", w, x)          # S matrix-vector products

For a prefill of S pairs that copies S matrices.  With few experts it is cheaper to multiply every token by every
expert in one GEMM and keep, per token, its expert's row::

    d = einsum("eoi,si->seo", W, x)         # [S, E, O]: one GEMM, no copy
    y = reshape(d, [S*E, O])[arange(S)*E + take(arange(E), ids)]

:data:`DENSE_EXPERTS_RULE` makes that rewrite for an einsum reading ``Gather(W, ids)`` of a constant ``W`` on axis 0,
the gathered axis a batch axis of the einsum that leads its output, when ``W`` has at most :data:`DENSE_EXPERTS_MAX`
experts (each token then costs at most that many times its own product, where the gathered form moves a matrix per
token through memory).  The result is exact: every kept row is the product the gathered form computes.  Indices
count from the end when negative, as ``Gather``'s do, and an index outside ``[-E, E)`` is refused as ``Gather``
refuses it (on every backend): each id is gathered from the constant ``arange(E)`` before it picks a row, so an id
past a table shorter than the router's expert count never reads another token's row.
"""

from __future__ import annotations

import numpy as np

from graphc.dims import dim_mul
from graphc.einsum_spec import fresh_labels
from graphc.graph import Graph, Node
from graphc.ops import Binary, Einsum, Op, Reshape
from graphc.rotary import Positions
from graphc.tensor_ops import Gather

from .infra import PassContext, Rule
from .patterns import Miss

__all__ = ["DENSE_EXPERTS_RULE", "DENSE_EXPERTS_MAX"]

DENSE_EXPERTS_MAX = 16
"""The most experts a gathered-weight product is computed densely for."""


def _match(graph: Graph, node: Node, ctx: PassContext) -> tuple[Node, int] | Miss | None:
    if len(node.inputs) != 2:
        return None
    spec = node.op_as(Einsum).parsed
    for pos, name in enumerate(node.inputs):
        gather = graph.producer(name)
        if gather is None or not isinstance(gather.op, Gather) or gather.op.axis != 0 or not graph.is_constant(gather.inputs[0]):
            continue
        ids = gather.inputs[1]
        term, other = spec.inputs[pos], spec.inputs[1 - pos]
        if graph.types[ids].rank != 1 or graph.types[ids].dtype != "int64" or node.inputs.count(name) != 1:
            continue
        if graph.types[gather.inputs[0]].rank != 3:  # [experts, out, in]; a table of rows (an embedding) is no expert
            continue
        experts = graph.types[gather.inputs[0]].shape[0]
        if not (term[0] in other and spec.output[:1] == term[0]):
            return Miss(f"einsum {node.name!r}: its gathered weights' token axis is not a batch axis leading the output")
        if not isinstance(experts, int) or experts > DENSE_EXPERTS_MAX:
            return Miss(f"einsum {node.name!r}: {experts} experts, over {DENSE_EXPERTS_MAX}: the gathered form moves less")
        return node, pos
    return None


def _rewrite(graph: Graph, m: tuple[Node, int], ctx: PassContext) -> str:
    node, pos = m
    spec = node.op_as(Einsum).parsed
    gather = graph.nodes[node.inputs[pos]]
    weights, ids = gather.inputs
    experts = int(graph.types[weights].shape[0])
    term = spec.inputs[pos]
    e = fresh_labels(spec.labels, 1)
    terms = list(spec.inputs)
    terms[pos] = e + term[1:]
    inputs = list(node.inputs)
    inputs[pos] = weights
    dense_out = spec.output[0] + e + spec.output[1:]
    base = node.output

    def add(op: Op, operands: list[str], label: str) -> str:
        return graph.add_node(op, operands, graph.fresh_name(f"{base}_{label}"), before=node.name).name

    dense = add(Einsum(",".join(terms) + "->" + dense_out), inputs, "every_expert")  # [S, E, ...]
    shape = graph.types[dense].shape
    rows = add(Reshape((dim_mul(shape[0], experts), *shape[2:])), [dense], "rows")  # [S*E, ...]
    count = graph.shared_initializer(f"experts_{experts}_int64", np.array(experts, np.int64))
    numbers = graph.shared_initializer(f"experts_arange_{experts}_int64", np.arange(experts, dtype=np.int64))
    wrapped = add(Gather(0), [numbers, ids], "expert")  # Gather's range check and its negative ids, kept
    tokens = add(Positions(0), [ids], "token")
    index = add(Binary("add"), [add(Binary("mul"), [tokens, count], "token_rows"), wrapped], "row")
    graph.redefine(node.name, Gather(0), [rows, index])
    return f"gathered weights {weights!r} ({experts} experts) contracted densely, each token's expert row kept"


DENSE_EXPERTS_RULE = Rule("dense_experts", (Einsum,), _match, _rewrite)
"""``einsum(W[ids], x)`` with few experts -> every expert in one einsum, then each token's expert row."""
