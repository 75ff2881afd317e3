"""Row-blocked attention for the NumPy interpreter.

The interpreter finds the attention chain

    S = Einsum(Q[.., M, D], K[.., T, D] -> [.., M, T])   then optional Scale, a
    Reshape view to [.., Sq, T], an optional CausalMask, Softmax(-1), a Reshape
    view back, and O = Einsum(P[.., M, T], V[.., T, E] -> [.., M, E])

(both as the builders emit it and in the optimizer's grouped form, where
``M = group * Sq`` folds the query heads of one KV head into GEMM rows) and
runs it block by block over the queries: one GEMM over the visible keys only,
the masked softmax while the block is in cache, then the PV GEMM.  The S x S
scores are never materialised, and a causal prefill skips the masked half of
both GEMMs.  Blocks run on a thread pool with BLAS pinned to one thread per
block (threadpoolctl), since BLAS threads inside pool threads oversubscribe the
cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphc.dims import Dim
from graphc.graph import Graph, Node
from graphc.ops import CausalMask, Einsum, Reshape, Scale, Softmax
from graphc.optimizer.cleanup import only_reader

from .kernels import hidden_keys, run_blocks, softmax_rows_

__all__ = ["BlockedAttention", "find_blocked_attention", "blocked_attention", "GEMM_ROWS"]

GEMM_ROWS = 256
"""Target GEMM rows (group x query rows) per block: measured best on 2 cores for head_dim 128."""


@dataclass(frozen=True)
class BlockedAttention:
    """One attention chain the interpreter runs as a single blocked kernel."""

    anchor: str  # the PV einsum; the kernel's result takes its name
    skipped: frozenset[str]  # chain nodes that are never materialised
    q: str
    k: str
    v: str
    q_perm: tuple[int, ...]  # views that bring Q to [batch.., M, D], K to [batch.., T, D], V to [batch.., T, E]
    k_perm: tuple[int, ...]
    v_perm: tuple[int, ...]
    scale: float | None
    offset: Dim | None
    query_len: Dim  # Sq: the query axis of the softmax's view; GEMM row m is query m % Sq


def _perm(term: str, order: str) -> tuple[int, ...] | None:
    """Axes of ``term`` listed in ``order`` (None unless ``term`` is a permutation of ``order``)."""
    return tuple(term.index(c) for c in order) if sorted(term) == sorted(order) else None


def _roles(spec: str) -> tuple[str, tuple[int, ...], tuple[int, ...], bool] | None:
    """For ``A,B->O`` with O = batch+m+t, one operand on batch+m+d and the other on batch+t+d (any axis order):
    (batch, q_perm, k_perm, q_first) where the perms bring Q to [batch, m, d] and K to [batch, t, d]."""
    a, b, o = spec.replace("->", ",").split(",")
    if len(o) < 2:
        return None
    batch, m, t = o[:-2], o[-2], o[-1]
    for q_term, k_term, q_first in ((a, b, True), (b, a, False)):
        contracted = [c for c in q_term if c not in o]
        if len(contracted) != 1:
            continue
        d = contracted[0]
        qp, kp = _perm(q_term, batch + m + d), _perm(k_term, batch + t + d)
        if qp is not None and kp is not None:
            return batch, qp, kp, q_first
    return None


def _match(g: Graph, softmax: Node) -> BlockedAttention | None:
    if not isinstance(softmax.op, Softmax) or softmax.op.axis not in (-1, g.types[softmax.name].rank - 1):
        return None
    chain: list[Node] = [softmax]
    scale: float | None = None
    offset: Dim | None = None
    node = g.producer(softmax.inputs[0])
    while node is not None and isinstance(node.op, (CausalMask, Reshape, Scale)) and not any(isinstance(c.op, type(node.op)) for c in chain[1:]):
        if isinstance(node.op, CausalMask):
            offset = node.op.offset
        elif isinstance(node.op, Scale):
            scale = node.op.factor
        elif g.types[node.name].shape[-1] != g.types[node.inputs[0]].shape[-1]:
            return None  # a view must keep the key axis
        chain.append(node)
        node = g.producer(node.inputs[0])
    if node is None or not isinstance(node.op, Einsum) or len(node.inputs) != 2:
        return None
    qk = node
    roles = _roles(qk.op.spec)
    if roles is None:
        return None
    batch, q_perm, k_perm, q_first = roles
    readers = g.consumers(softmax.name)
    post: list[Node] = []
    if len(readers) == 1 and isinstance(readers[0].op, Reshape):
        post.append(readers[0])
        readers = g.consumers(readers[0].name)
    if len(readers) != 1 or not isinstance(readers[0].op, Einsum) or len(readers[0].inputs) != 2:
        return None
    pv = readers[0]
    p_in = post[-1].name if post else softmax.name
    if pv.inputs[0] != p_in or g.types[p_in].shape != g.types[qk.name].shape:
        return None
    p_term, v_term, out = pv.op.spec.replace("->", ",").split(",")  # type: ignore[attr-defined]
    if len(p_term) != len(batch) + 2 or len(out) != len(p_term) or out[:-2] != p_term[:-2] or out[-2] != p_term[-2]:
        return None
    e = out[-1]
    v_perm = _perm(v_term, p_term[:-2] + p_term[-1] + e)
    if e in p_term or v_perm is None:
        return None
    ordered = [qk, *chain[::-1], *post]
    if not all(only_reader(g, a.name, b.name) for a, b in zip(ordered, ordered[1:])) or not only_reader(g, p_in, pv.name):
        return None
    q, k = qk.inputs if q_first else qk.inputs[::-1]
    query_len = g.types[softmax.name].shape[-2]
    return BlockedAttention(pv.name, frozenset(n.name for n in ordered), q, k, pv.inputs[1], q_perm, k_perm, v_perm, scale, offset, query_len)


def find_blocked_attention(graph: Graph) -> list[BlockedAttention]:
    """Every attention chain of ``graph`` that the blocked kernel can run."""
    return [m for n in graph.topological_order() if isinstance(n.op, Softmax) and (m := _match(graph, n)) is not None]


def blocked_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    sq: int,
    offset: int | None,
    scale: float | None,
    threads: int | None = None,
) -> np.ndarray:
    """``softmax(scale * q k^T, masked) v`` for ``q [.., G*sq, D]``, ``k [.., T, D]``, ``v [.., T, E]``.

    Row ``m`` of ``q`` is query ``m % sq``; keys ``j > i + offset`` are hidden from
    query ``i`` (no mask when ``offset`` is None); rows that see no key are zeros.
    """
    *batch, rows_total, dim = q.shape
    t_len, e_dim = k.shape[-2], v.shape[-1]
    if rows_total % sq:
        raise ValueError(f"query rows {rows_total} are not a multiple of the query length {sq}")
    groups = rows_total // sq
    q5 = q.reshape(*batch, groups, sq, dim)
    out = np.empty((*batch, groups, sq, e_dim), np.result_type(q, v))
    k_t = np.swapaxes(k, -1, -2)
    rows = max(1, min(sq, GEMM_ROWS // groups))
    neg_inf = np.array(-np.inf, out.dtype)

    def block(i0: int) -> None:
        i1 = min(sq, i0 + rows)
        r = i1 - i0
        c = t_len if offset is None else max(0, min(t_len, i1 + offset))
        ob = out[..., i0:i1, :]
        if c == 0:
            ob[...] = 0
            return
        qb = q5[..., i0:i1, :].reshape(*batch, groups * r, dim)
        s = np.matmul(qb, k_t[..., :c])
        if scale is not None:
            s *= scale
        if offset is not None:
            hidden = hidden_keys(i0, i1, c, offset)
            if hidden.any():
                np.copyto(s.reshape(*batch, groups, r, c), neg_inf, where=hidden)
        softmax_rows_(s)
        ob[...] = np.matmul(s, v[..., :c, :]).reshape(*batch, groups, r, e_dim)

    run_blocks(block, range(0, sq, rows), threads, pin_blas=True)
    return out.reshape(*batch, rows_total, e_dim)
