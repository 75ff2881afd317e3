"""``decompose_attention``: the one decomposition of the ``Attention`` op into grouped einsums and elementwise ops.

Used by legalisation for every backend without a kernel for a node, and as the reference lowering the kernels are
checked against.  The chain never copies K/V: Q is viewed as ``[B, Hkv, G*Sq, D]`` so QK^T and PV are one batched
GEMM per KV head.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from graphc.attention_op import Attention, attention_group_size
from graphc.dims import Dim, dim_mul
from graphc.errors import GraphError
from graphc.graph import Graph
from graphc.numerics import lowest
from graphc.ops import Binary, CausalMask, Compare, Concat, Einsum, Op, Reshape, Scale, Softmax, Unary, Where
from graphc.tensor_ops import BroadcastTo, Reduce


__all__ = ["decompose_attention"]


def decompose_attention(graph: Graph, node_name: str) -> str:
    """Replace the ``Attention`` node ``node_name`` by einsum and elementwise nodes; returns a description.

    The chain is the grouped form with the group folded into the GEMM rows: Q is
    viewed as ``[B, Hkv, G*Sq, D]``, so QK^T and PV are each one batched GEMM per
    KV head and K/V are never copied; the scale goes on Q (never larger than the
    scores, and no pass over a KV cache); the scores are viewed as
    ``[B, Hkv, G, Sq, Sk]`` for the masks and softmax.  The outputs keep their
    names.
    """
    node = graph.nodes[node_name]
    op = node.op
    if not isinstance(op, Attention):
        raise GraphError(f"decompose_attention: {node_name!r} is a {op.kind}, not Attention")
    ins = list(node.inputs)
    q, k, v = ins[:3]
    rest = ins[3:]
    mask = rest.pop(0) if op.has_mask else None
    base = node.outputs[0]

    def add(o: Op, inputs: Sequence[str], label: str) -> str:
        return graph.insert_before(node_name, o, inputs, f"{base}_{label}").name

    if op.kv_cache:
        k = add(Concat(2), [rest[0], k], "present_key")
        v = add(Concat(2), [rest[1], v], "present_value")
    b, hq, sq, _ = graph.types[q].shape
    hkv, sk = graph.types[k].shape[1], graph.types[k].shape[2]
    dv = graph.types[v].shape[3]
    g = attention_group_size(hq, hkv) or 1
    q_scale = op.scale / op.softcap if op.softcap is not None else op.scale  # the softcap's 1/c rides on Q too
    if q_scale != 1.0:
        q = add(Scale(q_scale), [q], "q_scaled")
    if g == 1:
        s = add(Einsum("bhqd,bhkd->bhqk"), [q, k], "scores_BHST")
    else:
        rows = dim_mul(g, sq)
        qm = add(Reshape((b, hkv, rows, graph.types[q].shape[3])), [q], "q_BHkvMD")
        s = add(Einsum("bnmd,bnkd->bnmk"), [qm, k], "scores_BHkvMT")
        s = add(Reshape((b, hkv, g, sq, sk)), [s], "scores_BHkvGST")
    if op.softcap is not None:
        s = add(Scale(op.softcap), [add(Unary("tanh"), [s], "capped")], "softcapped")
    s, empty = _apply_masks(graph, op, s, mask, g, hkv, add)
    dtype = graph.types[s].dtype
    p = add(Softmax(-1), [s], "probs")
    if empty is not None:  # the rows' value: zeros, or the mean of V over every key
        row_value = graph.shared_initializer(f"attention_zero_{dtype}", np.zeros((), dtype))
        if "mean_rows" in op.features():
            row_value = add(Reduce("mean", (2,)), [v], "v_mean")  # [B, Hkv, 1, Dv]
            row_value = add(Reshape((b, hkv, 1, 1, dv)), [row_value], "v_mean_5d") if g > 1 else row_value
        if g > 1 and graph.types[empty].rank == 4:
            empty = _grouped_mask(graph, empty, g, hkv, add)
    if g == 1:
        out = add(Einsum("bhqk,bhkd->bhqd"), [p, v], "attn_BHSD")
        if empty is not None:
            out = add(Where(), [empty, row_value, out], "attn_BHSD_rows")
    else:
        p = add(Reshape((b, hkv, dim_mul(g, sq), sk)), [p], "probs_BHkvMT")
        o = add(Einsum("bnmk,bnkd->bnmd"), [p, v], "attn_BHkvMD")
        if empty is not None:
            o5 = add(Reshape((b, hkv, g, sq, dv)), [o], "attn_BHkvGSD")
            o = add(Where(), [empty, row_value, o5], "attn_BHkvGSD_rows")
        out = add(Reshape((b, hq, sq, dv)), [o], "attn_BHSD")
    replacements = {node.outputs[0]: out}
    if op.kv_cache:
        replacements.update({node.outputs[1]: k, node.outputs[2]: v})
    graph.substitute(node_name, replacements)
    return f"decomposed into grouped einsums (group {g}, no K/V copy)"


_WIDE_FILL = ("float32", "float64")
"""Dtypes whose finite fill absorbs any score: ``s + lowest == lowest`` for ``|s| < 1e31`` (float32), so a row whose
every key is hidden holds the fill alone, its softmax is uniform, and it gives the mean of V with no guard."""


def _apply_masks(graph: Graph, op: Attention, s: str, mask: str | None, g: int, hkv: Dim, add) -> tuple[str, str | None]:  # noqa: ANN001
    """The causal mask, window and user mask on the scores ``s``; returns the masked scores and, when some row may see
    no key, a bool ``[.., Sq, 1]`` marking such rows (they take the op's empty-row value).  A bool mask's rows that
    should give the mean of V need no marking in :data:`_WIDE_FILL` dtypes: the finite fill makes them uniform."""
    sq, sk = graph.types[s].shape[-2:]
    dtype = graph.types[s].dtype
    empty = None  # [mb, mh|1, Sq, 1]: rows with no visible key, when some may have none
    vis = op.visibility
    causal = CausalMask.of(vis) if vis.is_causal else None
    wide_mean = "mean_rows" in vis.features() and dtype in _WIDE_FILL
    if vis.mask == "additive" and causal is not None and wide_mean and mask is not None:
        # one bias [mb, mh, Sq, Sk] that every layer shares: the mask plus the causal -inf, raised to the finite fill (a
        # row hidden whole is then uniform, the mean of V over every key): two passes over it, no broadcast copy
        fill = graph.shared_initializer(f"attention_fill_{dtype}", lowest(dtype))
        zero = graph.shared_initializer(f"attention_zero_{dtype}", np.zeros((), dtype))
        causal_bias = add(causal, [add(BroadcastTo((1, 1, sq, sk)), [zero], "causal_rows")], "causal_bias")
        bias = add(Binary("max"), [add(Binary("add"), [mask, causal_bias], "bias_causal"), fill], "bias")
        return add(Binary("add"), [s, _grouped_mask(graph, bias, g, hkv, add)], "masked"), None
    if vis.mask == "bool" or (vis.mask == "none" and vis.may_hide_whole_rows(sq, sk)):
        # one additive bias [mb, mh, Sq, Sk]: 0 where visible, finfo.min where hidden (finite: no NaN rows, so no guard)
        fill = graph.shared_initializer(f"attention_fill_{dtype}", lowest(dtype))
        zero = graph.shared_initializer(f"attention_zero_{dtype}", np.zeros((), dtype))
        mshape = (1,) * (4 - graph.types[mask].rank) + graph.types[mask].shape if mask is not None else (1, 1, 1, 1)
        bias = add(Where(), [mask, zero, fill], "bias") if mask is not None else zero
        bias = add(BroadcastTo((mshape[0], mshape[1], sq, sk)), [bias], "bias_rows")
        if causal is not None:
            bias = add(Binary("max"), [add(causal, [bias], "bias_causal"), fill], "bias_causal_filled")
        if not wide_mean:
            empty = add(Compare("less"), [add(Reduce("max", (-1,)), [bias], "bias_row_max"), zero], "empty_rows")
        s = add(Binary("add"), [s, _grouped_mask(graph, bias, g, hkv, add)], "masked")
    else:
        if causal is not None:
            s = add(causal, [s], "causal")
        if mask is not None:
            s = add(Binary("add"), [s, _grouped_mask(graph, mask, g, hkv, add)], "masked")
        if "mean_rows" in vis.features():  # an additive mask's -inf rows: found on the scores
            neg_inf = graph.shared_initializer(f"attention_neg_inf_{dtype}", np.array(-np.inf, dtype))
            empty = add(Compare("equal"), [add(Reduce("max", (-1,)), [s], "row_max"), neg_inf], "empty_rows")  # already grouped
    return s, empty


def _grouped_mask(graph: Graph, mask: str, g: int, hkv: Dim, add) -> str:  # noqa: ANN001
    """View a mask broadcastable to ``[B, Hq, Sq, Sk]`` as one broadcastable to ``[B, Hkv, G, Sq, Sk]``."""
    shape = (1,) * (4 - graph.types[mask].rank) + graph.types[mask].shape
    if g == 1:
        return mask if shape == graph.types[mask].shape else add(Reshape(shape), [mask], "mask_4d")
    mb, mh, msq, msk = shape
    heads = (1, 1) if mh == 1 else (hkv, g)
    return add(Reshape((mb, *heads, msq, msk)), [mask], "mask_grouped")
