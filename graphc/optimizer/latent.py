"""Multi-head latent attention (DeepSeek-V2/V3's MLA) in its absorbed form: multi-query attention over the latents.

MLA caches one compressed latent ``c [B, 1, T, r]`` per token (and one shared rotary key ``k_rot [B, 1, T, dr]``);
its keys and values are projected from every cached latent each step::

    kv = c @ W_b                      # [B, 1, T, H*(dn+dv)]
    k  = concat(kv[.., :dn], repeat(k_rot, H))      # [B, H, T, dn+dr]
    v  = kv[.., dn:]                  # [B, H, T, dv]
    o  = softmax(q k^T + masks) v

which costs ``T*r*H*(dn+dv)`` multiply-adds a step however few queries there are.  The weights absorb into the
queries and the output instead (``q_n k_n^T = (q_n W_k^T) c^T``, ``p v = (p c) W_v``)::

    q' = concat(q[.., :dn] @ W_k^T, q[.., dn:])     # [B, H, S, r+dr]
    k' = concat(c, k_rot)                          # [B, 1, T, r+dr]: one KV head
    o  = (softmax(q' k'^T + masks) c) @ W_v

which is multi-query attention (one KV head of width ``r+dr``, values the latent itself) followed by a per-head
projection: ``fuse_attention`` then sees one ``Attention`` whose K/V are the cache.  :data:`ABSORB_LATENT_RULE` makes
that rewrite on the scores einsum when the hints say it costs fewer multiply-adds (decode: a few queries over a long
cache; a long prefill keeps the projected form, as DeepSeek's own inference code does).  The scale stays the
original one (``1/sqrt(dn+dr)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphc.einsum_spec import fresh_labels
from graphc.graph import Graph, Node
from graphc.ops import Concat, Einsum, Op, Repeat, Reshape, Transpose
from graphc.tensor_ops import Slice

from .infra import PassContext, Rule
from .patterns import Miss

__all__ = ["ABSORB_LATENT_RULE", "LatentProjection", "latent_projection"]


@dataclass(frozen=True)
class LatentProjection:
    """``value[b, h, t, :] = latent[b, 0, t, :] @ weight[:, h, start:stop]``: heads projected from a one-head latent."""

    latent: str
    weight: np.ndarray  # [r, H, width of every head's projection]
    source: str  # the projected heads before the slice ([B, H, T, width])
    start: int
    stop: int


def latent_projection(graph: Graph, value: str) -> LatentProjection | None:
    """How ``value`` is projected from a one-head latent, or None: a Slice of the last axis of ``Transpose[0,2,1,3]``
    of ``Reshape [B, T, H, width]`` of ``latent [B, 1, T, r] @ W`` with ``W`` a constant ``[r, H*width]``."""
    cut = graph.producer(value)
    if cut is None or not isinstance(cut.op, Slice) or cut.op.step != 1 or cut.op.axis % 4 != 3:
        return None
    if not (isinstance(cut.op.start, int) and isinstance(cut.op.stop, int)):
        return None
    source = cut.inputs[0]
    turn = graph.producer(source)
    if turn is None or not isinstance(turn.op, Transpose) or tuple(turn.op.perm) != (0, 2, 1, 3):
        return None
    split = graph.producer(turn.inputs[0])
    if split is None or not isinstance(split.op, Reshape):
        return None
    project = graph.producer(split.inputs[0])
    if project is None or not isinstance(project.op, Einsum) or len(project.inputs) != 2 or not graph.is_constant(project.inputs[1]):
        return None
    spec = project.op_as(Einsum).parsed
    x, w = spec.inputs
    if len(x) != 4 or spec.output != x[:3] + (w.replace(x[3], "")) or sorted(w) != sorted(x[3] + spec.output[3]):
        return None
    latent = project.inputs[0]
    b, one, t, r = graph.types[latent].shape
    b2, t2, heads, width = graph.types[split.output].shape
    if one != 1 or (b2, t2) != (b, t) or not (isinstance(heads, int) and isinstance(width, int) and isinstance(r, int)):
        return None
    weight = np.asarray(graph.initializers[project.inputs[1]])
    weight = weight if w[0] == x[3] else weight.T  # [r, H*width]
    if weight.shape != (r, heads * width):
        return None
    return LatentProjection(latent, weight.reshape(r, heads, width), source, int(cut.op.start), int(cut.op.stop))


@dataclass(frozen=True)
class _Match:
    scores: Node
    key: LatentProjection
    value: LatentProjection
    value_name: str
    rotary: str  # [B, 1, T, dr]
    heads: int


def _scores_layout(node: Node) -> bool:
    """``q [B,H,S,D] , k [B,H,T,D] -> [B,H,S,T]``."""
    spec = node.op_as(Einsum).parsed
    if len(spec.inputs) != 2:
        return False
    q, k = spec.inputs
    return len(q) == len(k) == 4 and q[:2] == k[:2] and q[3] == k[3] and spec.output == q[:3] + k[2]


def _reads_heads(reader: Node, value: str) -> bool:
    """A two-operand einsum reading ``value`` ``[B, H, T, dv]`` once, keeping its head and width axes (only ``value``
    has the width): the width can then come from a per-head projection after the einsum."""
    if not isinstance(reader.op, Einsum) or len(reader.inputs) != 2 or reader.inputs.count(value) != 1:
        return False
    spec = reader.op_as(Einsum).parsed
    pos = reader.inputs.index(value)
    term, other = spec.inputs[pos], spec.inputs[1 - pos]
    return len(term) == 4 and term[1] in spec.output and term[3] in spec.output and term[3] not in other


def _match(graph: Graph, node: Node, ctx: PassContext) -> _Match | Miss | None:
    if not _scores_layout(node):
        return None
    concat = graph.producer(node.inputs[1])
    if concat is None or not isinstance(concat.op, Concat) or concat.op.axis % 4 != 3 or len(concat.inputs) != 2:
        return None
    nope, rot = concat.inputs
    key = latent_projection(graph, nope)
    if key is None:
        return None
    repeat = graph.producer(rot)
    heads = graph.types[nope].shape[1]
    if repeat is not None and isinstance(repeat.op, Repeat) and repeat.op.axis % 4 == 1 and graph.types[repeat.inputs[0]].shape[1] == 1:
        shared, copies = repeat.inputs[0], repeat.op.repeats
    elif graph.types[rot].shape[1] == 1:  # one head: nothing to repeat
        shared, copies = rot, 1
    else:
        return Miss(f"scores {node.name!r}: keys projected from a latent, but the rest of each key is not one head repeated")
    if key.start != 0 or key.stop != graph.types[nope].shape[3]:
        return Miss(f"scores {node.name!r}: the keys' latent part is not the first columns of each head's projection")
    key_cut = graph.producer(nope)
    values = [
        (name, p)
        for n in graph.consumers(key.source)
        if key_cut is None or n.name != key_cut.name
        for name in n.outputs
        if (p := latent_projection(graph, name)) is not None and p.latent == key.latent
    ]
    if len(values) != 1:
        return Miss(f"scores {node.name!r}: keys projected from a latent, but not one value projected beside them")
    value_name, value = values[0]
    if not all(_reads_heads(n, value_name) for n in graph.consumers(value_name)):
        return Miss(f"scores {node.name!r}: the latent's values are read by something other than an einsum keeping their heads")
    if not (heads == copies == key.weight.shape[1] == graph.types[value_name].shape[1]):
        return Miss(f"scores {node.name!r}: the keys' heads, the repeated rotary key and the values disagree")
    if graph.is_output(value_name) or graph.is_output(node.inputs[1]):
        return Miss(f"scores {node.name!r}: the projected keys or values are graph outputs")
    if graph.types[shared].shape[:3] != graph.types[key.latent].shape[:3]:
        return Miss(f"scores {node.name!r}: the rotary key and the latent cover other tokens")
    m = _Match(node, key, value, value_name, shared, int(heads))
    projected, absorbed = _costs(graph, m, ctx)
    if absorbed >= projected:
        return Miss(f"scores {node.name!r}: for these sizes the projected form costs fewer multiply-adds than the absorbed one")
    return m


def _costs(graph: Graph, m: _Match, ctx: PassContext) -> tuple[int, int]:
    """Multiply-adds of the projected and of the absorbed form under the hints."""
    b, h, s, _ = (ctx.size(d) for d in graph.types[m.scores.inputs[0]].shape)
    t = ctx.size(graph.types[m.key.latent].shape[2])
    r = m.key.weight.shape[0]
    dn, dv = m.key.stop - m.key.start, m.value.stop - m.value.start
    dr = ctx.size(graph.types[m.rotary].shape[3])
    projected = b * (t * r * h * (dn + dv) + s * t * h * (dn + dr) + s * t * h * dv)
    absorbed = b * (s * h * dn * r + s * t * h * (r + dr) + s * t * h * r + s * h * r * dv)
    return projected, absorbed


def _rewrite(graph: Graph, m: _Match, ctx: PassContext) -> str:
    node, heads = m.scores, m.heads
    at = node.name
    base = node.output
    q = node.inputs[0]
    dn, r = m.key.stop - m.key.start, m.key.weight.shape[0]
    dq = graph.types[q].shape[3]

    def add(op: Op, inputs: list[str], label: str) -> str:
        return graph.add_node(op, inputs, graph.fresh_name(f"{base}_{label}"), before=at).name

    w_k = graph.add_initializer(graph.fresh_name(f"{base}_absorbed_key.weight"), np.ascontiguousarray(m.key.weight[:, :, m.key.start : m.key.stop]))
    q_nope = add(Slice(3, 0, dn), [q], "q_nope")
    q_rot = add(Slice(3, dn, dq), [q], "q_rot")
    q_latent = add(Einsum("bhsd,rhd->bhsr"), [q_nope, w_k.name], "q_latent")
    q_abs = add(Concat(3), [q_latent, q_rot], "q_absorbed")
    key = add(Concat(3), [m.key.latent, m.rotary], "key_absorbed")  # [B, 1, T, r+dr]: one KV head
    keys = add(Repeat(1, heads), [key], "key_heads")  # grouped away by fuse_repeat_kv: no copy
    graph.redefine(at, node.op, [q_abs, keys])
    w_v = graph.add_initializer(
        graph.fresh_name(f"{base}_absorbed_value.weight"), np.ascontiguousarray(m.value.weight[:, :, m.value.start : m.value.stop])
    )
    latent_heads = add(Repeat(1, heads), [m.key.latent], "value_heads")
    for reader in list(graph.consumers(m.value_name)):
        spec = reader.op_as(Einsum).parsed
        pos = reader.inputs.index(m.value_name)
        term = spec.inputs[pos]  # [B, H, T, dv] in this reader's letters
        lat = fresh_labels(spec.labels, 1)
        terms = list(spec.inputs)
        terms[pos] = term[:3] + lat
        inner_out = spec.output.replace(term[3], lat)
        inputs = list(reader.inputs)
        inputs[pos] = latent_heads
        inner = graph.add_node(Einsum(",".join(terms) + "->" + inner_out), inputs, graph.fresh_name(f"{reader.output}_latent"), before=reader.name)
        graph.redefine(reader.name, Einsum(f"{inner_out},{lat}{term[1]}{term[3]}->{spec.output}"), [inner.name, w_v.name])
    return (
        f"multi-head latent attention absorbed: {heads} query heads over one KV head of width {r}+"
        f"{graph.types[m.rotary].shape[3]} (the latent {m.key.latent!r} and its rotary key), values the latent, "
        f"then each head's value projection"
    )


ABSORB_LATENT_RULE = Rule("absorb_latent_attention", (Einsum,), _match, _rewrite)
"""Scores over keys projected from a one-head latent -> multi-query scores over the latent (see the module doc)."""
