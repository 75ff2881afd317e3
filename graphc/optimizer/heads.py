"""Attention recognised in a model's own layout, brought to the op's: heads unflattened, the KV cache taken in.

Some models compute attention over a ``[batch*heads]`` axis (Bloom's ``baddbmm`` on ``[B*H, S, D]``), so the
recognised :class:`~graphc.attention_op.Attention` has batch 1 and ``batch*heads`` heads: a symbolic head count no
fused form or query chunking can carry, and K/V that reach it through a view of their ``[B, H, T, D]`` cache
``Concat``.  Two rules bring such an op to the standard layout, where the rest of graphc reads it as any other:

- ``unflatten_heads``: an ``Attention`` whose Q, K, V (and mask) are views ``[B, H, ...] -> [1, B*H, ...]`` runs on the
  ``[B, H, ...]`` tensors themselves, its output viewed back;
- ``absorb_kv_cache``: an ``Attention`` whose K and V are ``Concat(past, new)`` along the keys, with its causal offset
  the past's length, becomes the op with a KV cache (``kv_cache=True``), its present the ``Concat``'s value.
"""

from __future__ import annotations

from dataclasses import replace

from graphc.attention_op import Attention
from graphc.dims import Dim, dim_mul, normalize_dim
from graphc.graph import Graph, Node
from graphc.ops import Concat, Reshape

from .cleanup import remove_if_dead
from .infra import Miss, PassContext, Rule

__all__ = ["UNFLATTEN_HEADS_RULE", "ABSORB_KV_CACHE_RULE"]


def _plain_attention(node: Node) -> Attention | None:
    return node.op if type(node.op) is Attention else None


def _unflattened(graph: Graph, value: str, batch: Dim | None) -> tuple[str, Dim] | None:
    """``(x, batch)`` when ``value`` is ``Reshape(x)`` from ``x [B, H, R, C]`` to ``[1, B*H, R, C]`` with ``H`` static (and
    ``B`` the ``batch`` given, when one is)."""
    node = graph.producer(value)
    if node is None or not isinstance(node.op, Reshape):
        return None
    x = node.inputs[0]
    src, dst = graph.types[x].shape, graph.types[value].shape
    if len(src) != 4 or len(dst) != 4 or dst[0] != 1 or src[2:] != dst[2:] or not isinstance(src[1], int):
        return None
    if normalize_dim(dim_mul(src[0], src[1])) != normalize_dim(dst[1]) or (batch is not None and normalize_dim(src[0]) != normalize_dim(batch)):
        return None
    return x, src[0]


def _match_unflatten(graph: Graph, node: Node, ctx: PassContext) -> object:
    op = _plain_attention(node)
    if op is None or op.kv_cache or graph.types[node.inputs[0]].shape[0] != 1:
        return None
    q = _unflattened(graph, node.inputs[0], None)
    if q is None:
        return None
    parts = [q]
    for value in node.inputs[1:3]:
        found = _unflattened(graph, value, q[1])
        if found is None:
            return Miss(f"{node.name!r} runs over a [batch*heads] view of Q, but {value!r} is no such view of [batch, heads, ...]")
        parts.append(found)
    mask = None
    if op.has_mask:
        m = node.inputs[3]
        mshape = graph.types[m].shape
        if len(mshape) < 3 or (len(mshape) == 3 and mshape[0] == 1) or (len(mshape) == 4 and mshape[:2] == (1, 1)):
            mask = m  # the same for every batch row and head: it broadcasts over [batch, heads] as it did
        else:
            found = _unflattened(graph, m, q[1])
            if found is None:
                return Miss(f"{node.name!r} runs over a [batch*heads] view, but its mask {m!r} is no view of [batch, heads, ...]")
            mask = found[0]
    return node, [p[0] for p in parts] + ([mask] if mask is not None else [])


def _rewrite_unflatten(graph: Graph, m: tuple[Node, list[str]], ctx: PassContext) -> str:
    node, inputs = m
    out = node.outputs[0]
    y = graph.insert_before(node.name, node.op, inputs, f"{out}_heads").name
    flat = graph.insert_before(node.name, Reshape(graph.types[out].shape), [y], f"{out}_flat").name
    graph.substitute(node.name, {out: flat})
    for value in node.inputs:
        remove_if_dead(graph, value)
    heads = graph.types[inputs[0]].shape[1]
    return f"attention over [batch*heads] runs on [batch, {heads}, ...]: its heads are static"


UNFLATTEN_HEADS_RULE = Rule("unflatten_heads", (Attention,), _match_unflatten, _rewrite_unflatten)
"""Attention over a ``[batch*heads]`` view runs on the ``[batch, heads, ...]`` tensors (Bloom)."""


def _cache_concat(graph: Graph, value: str) -> Node | None:
    node = graph.producer(value)
    if node is None or not isinstance(node.op, Concat) or len(node.inputs) != 2 or graph.types[value].rank != 4 or node.op.axis % 4 != 2:
        return None
    return node


def _match_cache(graph: Graph, node: Node, ctx: PassContext) -> object:
    op = _plain_attention(node)
    if op is None or op.kv_cache or not op.visibility.is_causal:
        return None
    kc, vc = _cache_concat(graph, node.inputs[1]), _cache_concat(graph, node.inputs[2])
    if kc is None or vc is None:
        return None
    past = graph.types[kc.inputs[0]].shape[2]
    if not op.visibility.aligned_to(past) or graph.types[vc.inputs[0]].shape[2] != past:
        why = f"its visibility ({op.visibility.describe()}) is not offset by the past's length"
        return Miss(f"{node.name!r} reads K/V concatenated from a cache, but {why}")
    for c in (kc, vc):  # the present must not be read before the op that will produce it
        if any(not graph.is_before(node.name, r.name) and r.name != node.name for r in graph.consumers(c.name)):
            return Miss(f"the cache {c.name!r} is read before attention {node.name!r}")
    return node, kc, vc


def _rewrite_cache(graph: Graph, m: tuple[Node, Node, Node], ctx: PassContext) -> str:
    node, kc, vc = m
    op = node.op_as(Attention)
    mask = [node.inputs[3]] if op.has_mask else []
    inputs = [node.inputs[0], kc.inputs[1], vc.inputs[1], *mask, kc.inputs[0], vc.inputs[0]]
    names = [graph.fresh_name(f"{node.outputs[0]}_cached"), graph.fresh_name(f"{kc.name}_fused"), graph.fresh_name(f"{vc.name}_fused")]
    outs = graph.add_multi_node(replace(op, kv_cache=True), inputs, names, before=node.name)
    graph.substitute(node.name, {node.outputs[0]: outs[0].name})
    for concat, present in ((kc, outs[1]), (vc, outs[2])):
        graph.substitute(concat.name, {concat.name: present.name})
    return f"the KV cache {kc.inputs[0]!r}, {vc.inputs[0]!r} taken into the op ({op.visibility.describe()})"


ABSORB_KV_CACHE_RULE = Rule("absorb_kv_cache", (Attention,), _match_cache, _rewrite_cache)
"""``Attention`` over ``Concat(past, new)`` K/V at the past's offset becomes the op with its KV cache."""
