"""``fuse_attention``: recognise scaled dot-product attention once, from einsum semantics.

The rule starts at a ``Softmax`` over the last axis and walks up through the
ops that may sit on the scores (``Scale``, ``CausalMask``, a bool mask written
``Where(mask, s, -inf)``, an additive mask ``s + m``, and ``Reshape`` views that
keep the key axis) to a two-operand einsum, then down from the softmax (through
views) to a second einsum.  Roles come from the labels, not from spec text or
value names:

- QK^T ``A,B->S``: the key label ``t`` is ``S``'s last label and occurs in one
  operand only (that operand is K); the head dim ``d`` is the one label
  contracted; labels shared by Q, K and ``S`` are batch labels (the last one is
  the KV-head axis); labels of Q alone are query rows (group x queries).
- PV ``P,V->O``: ``P`` has the scores' shape, so its labels map position by
  position onto ``S``'s; the key label is contracted against V; V's one free
  label is the value head dim.

So the repeated form (``Repeat`` of K/V, absorbed), the grouped and the folded
forms, any axis order, a scale on Q, K or the scores, and a KV cache
(``Concat`` of past and new keys whose causal offset is the past length) all
become one :class:`~graphc.attention_op.Attention` node with views around it.
Near misses say why (``--explain``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphc.attention_op import Attention
from graphc.dims import Dim, dim_div, dim_prod
from graphc.graph import Graph, Node
from graphc.ops import Binary, CausalMask, Concat, Einsum, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where

from .cleanup import only_reader, remove_if_dead
from .infra import Miss, PassContext, RewritePass, Rule
from .masks import split_additive_mask

__all__ = ["fuse_attention", "FUSE_ATTENTION_RULE", "AttentionMatch"]


@dataclass
class AttentionMatch:
    """A recognised attention chain and how to rebuild it as one op."""

    softmax: Node
    pv: Node
    q: str
    k: str
    v: str
    q_term: str  # Q's labels in the order of ``q``
    k_term: str
    v_term: str  # V's labels, in QK label names (t for the key axis, e for the value dim)
    batch: str  # batch labels (last: KV heads)
    rows: str  # query-row labels (group x queries)
    t: str
    d: str
    e: str
    sizes: dict[str, Dim]
    q_shape: tuple[Dim, ...]  # Q as the op takes it: [batch, query heads, queries, head dim]
    group: int
    scale: float
    offset: Dim | None
    mask: str | None
    mask_kind: str
    past: tuple[str, str] | None
    presents: tuple[str, str] | None
    out_term: str  # PV output labels, in QK label names
    chain: list[str] = field(default_factory=list)  # values of the chain, softmax first (removed when dead)
    window: int | None = None
    softcap: float | None = None
    pv_rows: str = ""  # the query-row labels of the PV output (``rows``, or group and queries when P is a split view)
    empty_rows: str = "zero"  # what a row with no visible key gives (see Attention)
    more_masks: tuple[str, ...] = ()  # further bool masks ANDed onto ``mask``


def _neg_inf_constant(graph: Graph, name: str) -> bool:
    if not graph.is_constant(name):
        return False
    arr = graph.initializers[name]
    return arr.size >= 1 and bool(np.all(np.isneginf(arr)))


def _match(graph: Graph, softmax: Node, ctx: PassContext) -> object:  # noqa: C901 - one pattern, read top to bottom
    rank = graph.types[softmax.name].rank
    if rank < 2 or softmax.op.axis % rank != rank - 1:  # type: ignore[attr-defined]
        return None
    scale, offset, mask, mask_kind = 1.0, None, None, "none"
    empty_rows: str = "zero"
    more_masks: tuple[str, ...] = ()
    window: int | None = None
    cap: float | None = None  # the softcap c of c * tanh(s / c), once its tanh is passed
    view_for_rows: tuple[Dim, ...] | None = None
    chain = [softmax.name]
    x = softmax.inputs[0]
    reader = softmax.name
    while True:
        node = graph.producer(x)
        if node is None:
            return None
        if isinstance(node.op, Einsum):
            break
        if not isinstance(node.op, (Reshape, Scale, CausalMask, Where, Binary, Unary)):
            return None
        if cap is not None and isinstance(node.op, (CausalMask, Where, Binary)):
            return Miss(f"mask {node.name!r} acts before the softcap; attention caps first, then masks")
        if not only_reader(graph, x, reader):
            return Miss(f"{x!r} on the scores is read outside the attention chain")
        op = node.op
        nxt = node.inputs[0]
        if isinstance(op, Reshape):
            if graph.types[node.name].shape[-1:] != graph.types[nxt].shape[-1:]:
                return Miss(f"view {node.name!r} changes the key axis")
        elif isinstance(op, Scale):  # the walk goes up: scales seen so far act after the masks found further up
            scale *= op.factor
        elif isinstance(op, Unary):  # c * tanh(s / c): the scales seen since the masks are c
            if op.fn != "tanh" or cap is not None:
                return None
            if scale <= 0:
                return Miss(f"the scale after {node.name!r} is not a positive softcap")
            cap, scale = scale, 1.0
        elif isinstance(op, CausalMask):
            if scale <= 0:
                return Miss(f"a non-positive scale acts after causal mask {node.name!r}")
            if offset is not None:
                return Miss("two causal masks on one softmax")
            offset, window = op.offset, op.window
            view_for_rows = graph.types[node.name].shape
        elif isinstance(op, Where):
            cond, a, b = node.inputs
            if scale <= 0:
                return Miss(f"a non-positive scale acts after mask {node.name!r}")
            if not _neg_inf_constant(graph, b) or graph.types[cond].dtype != "bool":
                return Miss(f"{node.name!r} is a Where that is not (mask, scores, -inf)")
            if mask is not None and mask_kind != "bool":
                return Miss("a bool mask and an additive mask on one softmax")
            if mask is None:
                mask, mask_kind = cond, "bool"
            else:  # several bool masks (a per-row causal keep and a key padding): ANDed
                more_masks = (*more_masks, cond)
            nxt = a
            view_for_rows = view_for_rows or graph.types[node.name].shape
        else:
            if op.fn != "add":
                return None
            if scale != 1.0:
                return Miss(f"a scale acts after additive mask {node.name!r}, so it would scale the mask too")
            full = graph.types[node.name].shape
            cands = [i for i, v in enumerate(node.inputs) if graph.types[v].shape == full and graph.producer(v) is not None]
            if len(cands) != 1:
                return Miss(f"{node.name!r} adds two score-shaped tensors; cannot tell the mask from the scores")
            pos = cands[0]
            if mask is not None:
                return Miss("more than one user mask on one softmax")
            mask, mask_kind, nxt = node.inputs[1 - pos], "additive", node.inputs[pos]
            view_for_rows = view_for_rows or full
            split = split_additive_mask(graph, mask) if offset is None else None
            if split is not None:  # Where(causal & window & padding, 0, fill): the positions become the op's causal mask
                offset, window, empty_rows = split.offset, split.window, split.empty_rows
                mask, mask_kind, more_masks = (split.keep[0], "bool", split.keep[1:]) if split.keep else (None, "none", ())
        chain.append(node.name)
        reader, x = node.name, nxt
    qk = node
    if not only_reader(graph, x, reader):
        return Miss(f"scores {x!r} are read outside the attention chain")
    spec = qk.op.parsed  # type: ignore[attr-defined]
    if len(spec.inputs) != 2:
        return Miss(f"{qk.name!r} ({spec}) is not a two-operand einsum")
    out = spec.output
    t = out[-1]
    a_term, b_term = spec.inputs
    if (t in a_term) == (t in b_term):
        return Miss(f"in {qk.name!r} ({spec}) the softmax axis label {t!r} is not in exactly one operand")
    qpos = 1 if t in a_term else 0
    q_term, k_term = spec.inputs[qpos], spec.inputs[1 - qpos]
    batch = "".join(c for c in out[:-1] if c in q_term and c in k_term)
    rows = "".join(c for c in out[:-1] if c in q_term and c not in k_term)
    contracted = [c for c in q_term if c not in out]
    if len(contracted) != 1 or contracted[0] not in k_term:
        return Miss(f"{qk.name!r} ({spec}) does not contract exactly one head-dim label between Q and K")
    d = contracted[0]
    if set(k_term) != set(batch + t + d) or set(q_term) != set(batch + rows + d) or len(batch) + len(rows) + 1 != len(out):
        return Miss(f"{qk.name!r} ({spec}) has labels that are neither batch, query, key nor head dim")
    if out[: len(batch)] != batch:
        return Miss(f"{qk.name!r} ({spec}) interleaves query rows with batch labels")
    sizes: dict[str, Dim] = {}
    for term, v in ((q_term, qk.inputs[qpos]), (k_term, qk.inputs[1 - qpos])):
        sizes.update(zip(term, graph.types[v].shape))
    view = view_for_rows or graph.types[softmax.inputs[0]].shape
    n_rows = dim_prod(sizes[c] for c in rows)
    sq = view[-2] if len(view) >= 2 else 1
    group = dim_div(n_rows, sq) if rows else (1 if sq == 1 else None)
    if group is None:
        if offset is not None:
            return Miss(f"the causal mask's query axis ({sq!r}) does not divide the query rows ({n_rows!r})")
        sq, group = n_rows, 1
    # --- down: softmax -> views -> PV
    p_val = softmax.name
    readers = graph.consumers(p_val)
    while len(readers) == 1 and isinstance(readers[0].op, Reshape) and not graph.is_output(p_val):
        chain.insert(0, readers[0].name)
        p_val = readers[0].name
        readers = graph.consumers(p_val)
    if len(readers) != 1 or not isinstance(readers[0].op, Einsum) or not only_reader(graph, p_val, readers[0].name):
        return Miss("the probabilities are not read by one einsum alone")
    pv = readers[0]
    pspec = pv.op.parsed  # type: ignore[attr-defined]
    split = _rows_split(graph.types[p_val].shape, graph.types[qk.name].shape, len(batch), rows, sizes, group, sq)
    merged = _rows_merged(graph.types[p_val].shape, graph.types[qk.name].shape, len(batch), rows, sizes)
    if len(pspec.inputs) != 2 or (graph.types[p_val].shape != graph.types[qk.name].shape and split is None and not merged):
        return Miss(f"{pv.name!r} does not read the probabilities in the scores' shape (or in it with the query rows split into group x queries, "
                    "or merged from group x queries)")
    ppos = pv.inputs.index(p_val)
    p_term, v_term_raw = pspec.inputs[ppos], pspec.inputs[1 - ppos]
    pv_rows = rows
    if split is not None:  # P is [.., group, queries, keys] where the scores are [.., group*queries, keys]
        used = set(out + q_term + k_term + pspec.labels)
        g_label, s_label = [c for c in "GQJKLMNOPRSTUVWXYZ" if c not in used][:2]
        at = len(batch)
        rename = dict(zip(p_term, out[:at] + g_label + s_label + out[at + 1 :]))
        sizes[g_label], sizes[s_label] = split
        pv_rows = g_label + s_label
    elif merged:  # P is [.., group*queries, keys] where the scores are [.., group, queries, keys] (a grouped QK)
        used = set(out + q_term + k_term + pspec.labels)
        m_label = next(c for c in "MGQJKLNOPRSTUVWXYZ" if c not in used)
        at = len(batch)
        rename = dict(zip(p_term, out[:at] + m_label + out[at + len(rows) :]))
        sizes[m_label] = n_rows
        pv_rows = m_label
    else:
        rename = dict(zip(p_term, out))
    if rename[p_term[-1]] != t or p_term[-1] in pspec.output or p_term[-1] not in v_term_raw:
        return Miss(f"{pv.name!r} ({pspec}) does not contract the key axis against V")
    v_free = [c for c in v_term_raw if c not in p_term]
    if len(v_free) != 1 or v_free[0] not in pspec.output:
        return Miss(f"{pv.name!r} ({pspec}) has no single value-dim label")
    e = "E" if "E" not in out + q_term + pv_rows else next(c for c in "ZYXWVU" if c not in out + q_term + pv_rows)
    rename[v_free[0]] = e
    v_term = "".join(rename[c] for c in v_term_raw)
    out_term = "".join(rename.get(c, "?") for c in pspec.output)
    if set(v_term) != set(batch + t + e) or set(out_term) != set(batch + pv_rows + e):
        return Miss(f"{pv.name!r} ({pspec}) mixes labels across the batch, query and value axes")
    sizes[e] = graph.types[pv.inputs[1 - ppos]].shape[v_term.index(e)]
    # --- Q, K, V producers: absorb a scale on Q or K and the KV-head repeat
    q, f = _strip_scale(graph, qk.inputs[qpos], qk.name)
    scale *= f
    k = _unwrap_kv(graph, qk.inputs[1 - qpos], k_term, qk.name, batch, take_scale=True)
    v = _unwrap_kv(graph, pv.inputs[1 - ppos], v_term, pv.name, batch, take_scale=False)
    if isinstance(k, Miss) or isinstance(v, Miss):
        return k if isinstance(k, Miss) else v
    (k, rk, fk), (v, rv, _) = k, v
    scale *= fk
    if rk != rv:
        return Miss(f"K is repeated {rk}x but V {rv}x")
    q_shape = (dim_prod(sizes[c] for c in batch[:-1]), dim_prod([sizes[batch[-1]] if batch else 1, group]), sq, sizes[d])
    if mask is not None and graph.types[mask].rank > 2 and view_for_rows != (*q_shape[:3], sizes[t]):
        return Miss(f"the mask is applied to a {list(view_for_rows or ())} view, not [batch, heads, queries, keys]")
    past = presents = None
    if offset is not None and len(batch) == 2 and k_term == batch + t + d and v_term == batch + t + e:
        kc, vc = graph.producer(k), graph.producer(v)
        if all(c is not None and isinstance(c.op, Concat) and c.op.axis % 4 == 2 and len(c.inputs) == 2 for c in (kc, vc)):
            if graph.types[kc.inputs[0]].shape[2] == offset and _later_readers_ok(graph, (kc, vc), pv):  # type: ignore[union-attr]
                past, presents = (kc.inputs[0], vc.inputs[0]), (kc.name, vc.name)  # type: ignore[union-attr]
                k, v = kc.inputs[1], vc.inputs[1]  # type: ignore[union-attr]
    return AttentionMatch(
        softmax, pv, q, k, v, q_term, k_term, v_term, batch, rows, t, d, e, sizes, q_shape, group * rk, scale, offset, mask, mask_kind,
        past, presents, out_term, chain + [qk.name], window=window, softcap=cap, pv_rows=pv_rows, empty_rows=empty_rows,
        more_masks=tuple(more_masks),
    )


def _rows_split(p_shape: tuple[Dim, ...], s_shape: tuple[Dim, ...], at: int, rows: str, sizes: dict[str, Dim], group: int | None, sq: Dim) -> tuple[Dim, Dim] | None:
    """``(group, queries)`` when ``p_shape`` is the scores' shape with its one query-row axis split into group x queries."""
    if len(rows) != 1 or group is None or len(p_shape) != len(s_shape) + 1:
        return None
    if p_shape[:at] != s_shape[:at] or p_shape[at + 2 :] != s_shape[at + 1 :]:
        return None
    if p_shape[at] != group or p_shape[at + 1] != sq or sizes.get(rows) != dim_prod([group, sq]):
        return None
    return p_shape[at], p_shape[at + 1]


def _rows_merged(p_shape: tuple[Dim, ...], s_shape: tuple[Dim, ...], at: int, rows: str, sizes: dict[str, Dim]) -> bool:
    """Whether ``p_shape`` is the scores' shape with its (several) query-row axes merged into one."""
    if len(rows) < 2 or len(p_shape) != len(s_shape) - len(rows) + 1:
        return False
    return p_shape[:at] == s_shape[:at] and p_shape[at + 1 :] == s_shape[at + len(rows) :] and p_shape[at] == dim_prod(sizes[c] for c in rows)


def _strip_scale(graph: Graph, value: str, reader: str) -> tuple[str, float]:
    p = graph.producer(value)
    if p is not None and isinstance(p.op, Scale) and only_reader(graph, value, reader):
        return p.inputs[0], p.op.factor
    return value, 1.0


def _unwrap_kv(graph: Graph, value: str, term: str, reader: str, batch: str, take_scale: bool) -> tuple[str, int, float] | Miss:
    """K or V below its KV-head ``Repeat`` (and, for K, a ``Scale``), each read only on the way: (value, repeats, scale)."""
    repeats, scale = 1, 1.0
    for _ in range(2):
        p = graph.producer(value)
        if p is None or not only_reader(graph, value, reader):
            break
        if isinstance(p.op, Scale) and take_scale and scale == 1.0:
            scale = p.op.factor
        elif isinstance(p.op, Repeat) and batch and repeats == 1:
            if p.op.axis % len(term) != term.index(batch[-1]):
                return Miss(f"repeat {p.name!r} is not along the KV-head axis")
            repeats = p.op.repeats
        else:
            break
        reader, value = p.name, p.inputs[0]
    return value, repeats, scale


def _later_readers_ok(graph: Graph, concats: tuple[Node, ...], pv: Node) -> bool:
    """The fused op replaces the cache Concats at the PV einsum's place: their other readers must come later."""
    for c in concats:
        for r in graph.consumers(c.name):
            if not isinstance(r.op, (Repeat, Einsum, Scale)) and not graph.is_before(pv.name, r.name):
                return False
    return True


def _to_canonical(graph: Graph, value: str, term: str, order: str, shape: tuple[Dim, ...], anchor: str, label: str) -> str:
    """Transpose ``value`` (labels ``term``) to ``order`` and reshape it to ``shape`` (each only when needed)."""
    perm = tuple(term.index(c) for c in order)
    if perm != tuple(range(len(perm))):
        value = graph.insert_before(anchor, Transpose(perm), [value], f"{value}_{label}").name
    if graph.types[value].shape != shape:
        value = graph.insert_before(anchor, Reshape(shape), [value], f"{value}_{label}").name
    return value


def _rewrite(graph: Graph, m: AttentionMatch, ctx: PassContext) -> str:
    s, anchor, base = m.sizes, m.pv.name, m.pv.name
    b, _, _, d = m.q_shape
    hkv = graph.types[m.k].shape[m.k_term.index(m.batch[-1])] if m.batch else 1
    q = _to_canonical(graph, m.q, m.q_term, m.batch + m.rows + m.d, m.q_shape, anchor, "BHSD")
    k_shape, v_shape = graph.types[m.k].shape, graph.types[m.v].shape
    k = _to_canonical(graph, m.k, m.k_term, m.batch + m.t + m.d, (b, hkv, k_shape[m.k_term.index(m.t)], d), anchor, "BHkvTD")
    v = _to_canonical(graph, m.v, m.v_term, m.batch + m.t + m.e, (b, hkv, v_shape[m.v_term.index(m.t)], s[m.e]), anchor, "BHkvTD")
    mask = m.mask
    for extra in m.more_masks:
        false = graph.add_initializer(graph.fresh_name(f"{base}_false"), np.array(False)).name
        mask = graph.insert_before(anchor, Where(), [mask, extra, false], f"{base}_mask_and").name  # type: ignore[list-item]
    inputs = [q, k, v] + ([mask] if mask else []) + (list(m.past) if m.past else [])
    scale = m.scale * m.softcap if m.softcap is not None else m.scale  # c * tanh(scale * s / c)
    op = Attention(scale, m.offset, m.mask_kind, m.past is not None, m.window, m.softcap, m.empty_rows)
    stem = base.split("_B")[0] if "_B" in base else base
    names = [graph.fresh_name(f"{stem}_BHSD")] + ([graph.fresh_name(f"{p}_fused") for p in m.presents] if m.presents else [])
    outs = graph.add_multi_node(op, inputs, names, before=anchor)
    # back to the PV einsum's layout: [B, Hq, Sq, E] -> [batch..., rows..., E] -> output order
    y = outs[0].name
    natural = m.batch + (m.pv_rows or m.rows) + m.e
    full = tuple(s[c] for c in natural)
    if graph.types[y].shape != full:
        y = graph.insert_before(anchor, Reshape(full), [y], f"{base}_unfused").name
    perm = tuple(natural.index(c) for c in m.out_term)
    if perm != tuple(range(len(perm))):
        y = graph.insert_before(anchor, Transpose(perm), [y], f"{base}_unfused").name
    graph.substitute(m.pv.name, {m.pv.name: y})
    for present, new in zip(m.presents or (), outs[1:]):  # the op now produces the cache under its names
        graph.substitute(present, {present: new})
    for name in m.chain:
        remove_if_dead(graph, name)
    parts = [f"scale={scale:g}", f"group={m.group}"]
    if m.offset is not None:
        parts.append(f"causal offset {m.offset}" + (f", window {m.window}" if m.window is not None else ""))
    if m.softcap is not None:
        parts.append(f"softcap {m.softcap:g}")
    if m.mask:
        parts.append(f"{m.mask_kind} mask {m.mask!r}" + (f" and {len(m.more_masks)} more" if m.more_masks else ""))
    if m.empty_rows != "zero":
        parts.append(f"rows with no visible key give the {m.empty_rows} of V")
    if m.past:
        parts.append("KV cache " + ", ".join(m.past))
    return "attention recognised: " + ", ".join(parts)


FUSE_ATTENTION_RULE = Rule("fuse_attention", (Softmax,), _match, _rewrite)

fuse_attention = RewritePass(
    "fuse_attention",
    "recognise softmax(scale * QK^T + masks) V (repeated, grouped or folded, any axis order) as one Attention op",
    [FUSE_ATTENTION_RULE],
)
