"""Recognising the attention core and emitting it as one fused ONNX op.

The recognised pattern is the core as the builders emit it (before grouping)::

    scores = Einsum("bhqd,bhkd->bhqk")(q, k')      k' = Repeat(axis=1, g)(k) or k
    x      = Scale(f)(scores)                      optional
    x      = CausalMask(offset)(x)                 optional
    p      = Softmax(-1)(x)
    out    = Einsum("bhqk,bhkd->bhqd")(p, v')      v' = Repeat(axis=1, g)(v) or v

with every intermediate read only inside the pattern.  When K and V are
``Concat(axis=2)(past, new)`` and the causal offset is the past length, the
cache is handed to the fused op, which then produces ``present_key`` and
``present_value`` itself.  The fused op groups heads itself, so fused export
starts from the unoptimized graph (the optimizer's grouped form is exported
decomposed).

Modes: ``onnx-attention`` (the standard ``Attention`` op, opset 23+; its
``is_causal`` aligns top-left, and with ``past_key`` it offsets by the past
length), ``ort-gqa`` (``com.microsoft.GroupQueryAttention``: always causal,
3-D packed heads; onnxruntime rejects batch > 1 when both a past and several
new tokens are given), ``auto`` (fused when the query has at least
:data:`AUTO_MIN_QUERY_ROWS` rows per KV head under the hints, else decomposed:
measured on 2 cores, a decode step runs faster as grouped MatMuls than through
either fused op).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphc.dims import Dim, dim_add, normalize_dim
from graphc.errors import ExportError
from graphc.graph import Graph, Node
from graphc.optimizer.cleanup import mask_hides_nothing, only_reader
from graphc.optimizer.infra import PassContext
from graphc.ops import CausalMask, Concat, Einsum, Repeat, Scale, Softmax

if TYPE_CHECKING:
    from .onnx_export import OnnxBuilder

__all__ = ["ATTENTION_MODES", "AttentionMatch", "find_attention_cores", "emit_fused", "match_attention_core", "AUTO_MIN_QUERY_ROWS"]

ATTENTION_MODES = ("decomposed", "onnx-attention", "ort-gqa", "auto")
AUTO_MIN_QUERY_ROWS = 64


@dataclass(frozen=True)
class AttentionMatch:
    """One recognised attention core and how to emit it."""

    mode: str
    anchor: str  # the PV einsum: the fused op's output takes its name
    absorbed: frozenset[str]  # nodes the fused op replaces
    q: str
    k: str
    v: str
    past_k: str | None
    past_v: str | None
    present_k: str | None
    present_v: str | None
    causal: bool
    scale: float
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q_shape: tuple[Dim, ...]
    kv_len: Dim


def _canonical_qk(spec: str) -> bool:
    a, c, o = spec.replace("->", ",").split(",")
    return len(o) == 4 and len(a) == 4 and a[:3] == o[:3] and c == o[:2] + o[3] + a[3] and a[3] not in o


def _canonical_pv(spec: str) -> bool:
    p, v, o = spec.replace("->", ",").split(",")
    return len(o) == 4 and len(p) == 4 and p[:3] == o[:3] and v == o[:2] + p[3] + o[3] and p[3] not in o


def match_attention_core(g: Graph, softmax: Node) -> AttentionMatch | str:
    """Match the core around ``softmax``; a string says why it does not match."""
    if not isinstance(softmax.op, Softmax) or softmax.op.axis not in (-1, 3) or g.types[softmax.name].rank != 4:
        return "softmax is not over the last axis of a 4-D tensor"
    absorbed = [softmax.name]
    x = softmax.inputs[0]
    node = g.producer(x)
    offset: Dim | None = None
    scale = 1.0
    if node is not None and isinstance(node.op, CausalMask):
        offset = None if mask_hides_nothing(g, node) else node.op.offset  # e.g. one query over the whole cache
        absorbed, x = absorbed + [node.name], node.inputs[0]
        node = g.producer(x)
    if node is not None and isinstance(node.op, Scale):
        scale, absorbed, x = node.op.factor, absorbed + [node.name], node.inputs[0]
        node = g.producer(x)
    if node is None or not isinstance(node.op, Einsum) or len(node.inputs) != 2 or not _canonical_qk(node.op.spec):
        return "the softmax input is not scale/mask of a bhqd,bhkd->bhqk einsum"
    qk = node
    readers = g.consumers(softmax.name)
    if len(readers) != 1 or not isinstance(readers[0].op, Einsum) or readers[0].inputs[0] != softmax.name or not _canonical_pv(readers[0].op.spec):
        return "the probabilities are not read by one bhqk,bhkd->bhqd einsum"
    pv = readers[0]
    chain = [qk.name, *absorbed[::-1]]  # qk -> scale -> mask -> softmax, each read only by the next
    absorbed.append(qk.name)
    for a, b in zip(chain, chain[1:]):
        if not only_reader(g, a, b):
            return f"{a!r} is read outside the attention core"
    q, k_src, v_src = qk.inputs[0], qk.inputs[1], pv.inputs[1]

    def unrepeat(v: str, reader: str) -> tuple[str, int]:
        n = g.producer(v)
        if n is not None and isinstance(n.op, Repeat) and n.op.axis % 4 == 1 and only_reader(g, v, reader):
            absorbed.append(n.name)
            return n.inputs[0], n.op.repeats
        return v, 1

    k, gk = unrepeat(k_src, qk.name)
    v, gv = unrepeat(v_src, pv.name)
    qs, ks = g.types[q].shape, g.types[k].shape
    hq, hkv, d = qs[1], ks[1], qs[3]
    if not all(isinstance(n, int) for n in (hq, hkv, d)) or gk != gv or hq != hkv * gk:  # type: ignore[operator]
        return "head counts are symbolic or K and V are repeated differently"
    past_k = past_v = present_k = present_v = None
    kv_len = ks[2]
    kc, vc = g.producer(k), g.producer(v)
    if (
        offset is not None
        and kc is not None
        and vc is not None
        and all(isinstance(n.op, Concat) and n.op.axis % 4 == 2 and len(n.inputs) == 2 for n in (kc, vc))
        and normalize_dim(offset) == normalize_dim(g.types[kc.inputs[0]].shape[2])
    ):
        past_k, k, present_k = kc.inputs[0], kc.inputs[1], kc.name
        past_v, v, present_v = vc.inputs[0], vc.inputs[1], vc.name
        absorbed += [kc.name, vc.name]
    elif offset is not None and normalize_dim(offset) != 0:
        return f"causal offset {offset!r} is neither 0 nor the length of a concatenated past; the fused ops align the mask top-left"
    return AttentionMatch(
        mode="",
        anchor=pv.name,
        absorbed=frozenset(absorbed + [pv.name]),
        q=q,
        k=k,
        v=v,
        past_k=past_k,
        past_v=past_v,
        present_k=present_k,
        present_v=present_v,
        causal=offset is not None,
        scale=scale,
        n_heads=int(hq),
        n_kv_heads=int(hkv),
        head_dim=int(d),
        q_shape=qs,
        kv_len=kv_len,
    )


def find_attention_cores(g: Graph, mode: str, opset: int, hints: dict[str, int]) -> list[AttentionMatch]:
    """Every attention core to emit fused under ``mode`` (none for ``decomposed``)."""
    if mode == "decomposed":
        return []
    found: list[AttentionMatch] = []
    reasons = []
    for node in g.topological_order():
        if not isinstance(node.op, Softmax):
            continue
        m = match_attention_core(g, node)
        if isinstance(m, str):
            reasons.append(f"{node.name!r}: {m}")
            continue
        chosen = mode
        if mode == "auto":
            rows = PassContext(hints=hints).size(m.q_shape[2]) * (m.n_heads // m.n_kv_heads)
            if rows < AUTO_MIN_QUERY_ROWS:
                continue
            chosen = "onnx-attention"
        if chosen == "ort-gqa" and not m.causal:
            raise ExportError(
                f"attention core at {m.anchor!r}: GroupQueryAttention is causal only, and this core has no causal mask "
                "(a mask that hides no key counts as none); for decode, export the KV-cache graph, whose cache it takes as past"
            )
        if chosen == "ort-gqa" and not m.past_k and normalize_dim(m.q_shape[2]) != normalize_dim(m.kv_len):
            raise ExportError(f"attention core at {m.anchor!r}: GroupQueryAttention without a past cache needs as many keys as queries")
        if chosen == "onnx-attention" and opset < 23:
            if mode == "auto":
                continue
            raise ExportError(f"attention core at {m.anchor!r}: the Attention op needs opset 23 or later, got opset {opset}")
        found.append(AttentionMatch(**{**m.__dict__, "mode": chosen}))
    if not found and mode in ("onnx-attention", "ort-gqa"):
        detail = "; ".join(reasons) or "the graph has no softmax"
        raise ExportError(f"attention={mode!r}: no attention core recognised ({detail}); fused export starts from the unoptimized graph")
    return found


def emit_fused(b: "OnnxBuilder", m: AttentionMatch) -> None:
    """Emit the fused op for ``m``; its outputs take the names of the nodes it replaces."""
    outputs = [m.anchor] + ([m.present_k, m.present_v] if m.present_k else [])  # type: ignore[list-item]
    if m.mode == "onnx-attention":
        inputs = [m.q, m.k, m.v] + (["", m.past_k, m.past_v] if m.past_k else [])  # type: ignore[list-item]
        b.nodes.append(_node(b, "Attention", inputs, outputs, is_causal=int(m.causal), scale=m.scale))
        return
    # ort-gqa: [B,H,S,D] -> [B,S,H*D] packed, then back
    batch, sq = m.q_shape[0], m.q_shape[2]

    def pack(x: str, heads: int, seq: Dim) -> str:
        t = b.op("Transpose", [x], base=f"{x}_BSHD", perm=[0, 2, 1, 3])
        return b.reshape(t, [batch, seq, heads * m.head_dim])

    k_len = b.graph.types[m.k].shape[2]
    total = m.kv_len if not m.past_k else dim_add(b.graph.types[m.past_k].shape[2], k_len)
    total32 = b.op("Cast", [b.dim(total)], base="total_len", to=6)
    seqlens = b.op("Cast", [b.op("Expand", [b.op("Sub", [b.dim(total), b.dim(1)]), b.dim(batch)])], base="seqlens_k", to=6)
    inputs = [pack(m.q, m.n_heads, sq), pack(m.k, m.n_kv_heads, k_len), pack(m.v, m.n_kv_heads, k_len)]
    inputs += [m.past_k or "", m.past_v or "", seqlens, total32]
    packed_out = b.fresh(f"{m.anchor}_BSN")
    outs = [packed_out] + ([m.present_k, m.present_v] if m.present_k else [])  # type: ignore[list-item]
    b.nodes.append(
        _node(b, "GroupQueryAttention", inputs, outs, domain="com.microsoft", num_heads=m.n_heads, kv_num_heads=m.n_kv_heads, scale=m.scale)
    )
    y = b.reshape(packed_out, [batch, sq, m.n_heads, m.head_dim])
    b.op("Transpose", [y], m.anchor, perm=[0, 2, 1, 3])


def _node(b: "OnnxBuilder", op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs: object):
    from onnx import helper

    return helper.make_node(op_type, inputs, outputs, name=b.fresh(f"n_{outputs[0]}"), domain=domain, **attrs)
