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
from graphc.dims import Dim, dim_div, dim_prod, normalize_dim
from graphc.graph import Graph, Node
from graphc.numerics import FILL_LIMIT
from graphc.ops import FLOAT_DTYPES, Binary, CausalMask, Concat, Einsum, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where
from graphc.tensor_ops import BroadcastTo

from .cleanup import only_reader, remove_if_dead
from .infra import Miss, PassContext, RewritePass, Rule
from .masks import MaskSplit, split_additive_mask

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
    mask_views: dict[str, tuple[Dim, ...]] = field(default_factory=dict)  # masks to view as [batch, heads, ...] first
    mask_view: tuple[tuple[Dim, ...], tuple[Dim, ...]] | None = None  # the masks' view and the op's, when they differ
    more_masks: tuple[str, ...] = ()  # further masks on ``mask``: ANDed (bool), added (additive)
    negate_mask: bool = False  # ``mask`` is bool and hides where True (transformers' padding before 4.58)
    hiding_masks: tuple[tuple[str, bool], ...] = ()  # bool masks added to an additive one as -inf: (value, True hides)
    moved: tuple[str, ...] = ()  # readers of the cache Concats before the PV einsum (a present cut to a window), moved after the op


def _fill_rows(graph: Graph, name: str) -> str | None:
    """What a row of keys all hidden by ``Where(keep, s, name)`` gives: ``"zero"`` for a ``-inf`` fill (graphc's
    rows with no visible key), ``"mean"`` for a finite fill that swamps every score (``finfo.min``: the row's scores
    are all equal, its softmax uniform), ``None`` when ``name`` is no such constant."""
    if not graph.is_constant(name) or str(graph.types[name].dtype) not in FLOAT_DTYPES:
        return None
    arr = graph.initializers[name]
    if arr.size < 1 or not np.all(arr == arr.reshape(-1)[0]):
        return None
    fill = float(arr.reshape(-1)[0])
    return "zero" if np.isneginf(fill) else "mean" if fill <= FILL_LIMIT else None


def _match_fill_first(graph: Graph, node: Node, ctx: PassContext) -> object:
    """``Where(hide, fill, s)`` (MPT's ``scores.masked_fill(hide, finfo.min)``): the fill in the middle."""
    c, a, b = node.inputs
    if graph.types[c].dtype != "bool" or _fill_rows(graph, a) is None or graph.is_constant(b):
        return None
    return node


def _rewrite_fill_first(graph: Graph, node: Node, ctx: PassContext) -> str:
    """``s + Where(hide, fill, 0)``: the same numbers (a fill swamps the score it is added to), and the additive form
    whose hidden half-planes the attention match reads as its causal offset and window."""
    hide, fill, scores = node.inputs
    zero = graph.shared_initializer(f"zero_{graph.types[scores].dtype}", np.array(0, graph.types[scores].dtype))
    bias = graph.insert_before(node.name, Where(), [hide, fill, zero], f"{node.name}_bias").name
    graph.redefine(node.name, Binary("add"), [scores, bias])
    return f"Where(hide, fill, s) read as s + Where(hide, fill, 0) ({bias!r})"


FILL_FIRST_RULE = Rule("where_fill_last", (Where,), _match_fill_first, _rewrite_fill_first)
"""A masked fill of the scores as an additive mask, the form the attention match reads."""


@dataclass
class _Scores:
    """What sits on the scores between QK^T and the softmax, read walking up from the softmax."""

    chain: list[str]  # values passed, softmax first
    scale: float = 1.0
    offset: Dim | None = None
    window: int | None = None
    cap: float | None = None  # the softcap c of c * tanh(s / c), once its tanh is passed
    mask: str | None = None
    mask_kind: str = "none"
    more_masks: tuple[str, ...] = ()
    negate_mask: bool = False
    hiding_masks: tuple[tuple[str, bool], ...] = ()
    empty_rows: str = "zero"
    view_for_rows: tuple[Dim, ...] | None = None  # the shape the masks act on
    split_from: str | None = None  # the additive position mask ``mask`` and ``offset`` were read from
    views: list[tuple[tuple[Dim, ...], tuple[Dim, ...]]] = field(default_factory=list)  # reshapes passed: (input, output)
    mask_views: dict[str, tuple[Dim, ...]] = field(default_factory=dict)  # a mask added below a view: the shape it takes above
    qk: Node | None = None  # the QK^T einsum the walk ends at
    qk_reader: str = ""  # the chain's node that reads the QK^T output


@dataclass
class _Roles:
    """The QK^T einsum's labels by role (see the module doc), with sizes and the query rows' split."""

    qk: Node
    qpos: int
    out: str
    q_term: str
    k_term: str
    batch: str
    rows: str
    t: str
    d: str
    sizes: dict[str, Dim]
    n_rows: Dim
    sq: Dim
    group: int


@dataclass
class _Values:
    """The PV einsum read in QK label names."""

    pv: Node
    ppos: int
    v_term: str
    out_term: str
    pv_rows: str
    e: str


def _match(graph: Graph, softmax: Node, ctx: PassContext) -> object:
    """The attention chain through ``softmax``: the scores walked up to QK^T, P walked down to PV, then Q, K, V."""
    rank = graph.types[softmax.name].rank
    if rank < 2 or softmax.op_as(Softmax).axis % rank != rank - 1:
        return None
    sc = _walk_scores(graph, softmax)
    if sc is None or isinstance(sc, Miss):
        return sc
    assert sc.qk is not None
    if not only_reader(graph, sc.qk.name, sc.qk_reader):
        return Miss(f"scores {sc.qk.name!r} are read outside the attention chain")
    roles = _qk_roles(graph, sc.qk, sc.view_for_rows or graph.types[softmax.inputs[0]].shape, sc.offset)
    if isinstance(roles, Miss):
        return roles
    values = _pv_roles(graph, softmax, sc, roles)
    if isinstance(values, Miss):
        return values
    return _with_operands(graph, softmax, sc, roles, values)


def _walk_scores(graph: Graph, softmax: Node) -> _Scores | Miss | None:
    """Walk up from the softmax through the ops that may sit on the scores to the QK^T einsum."""
    sc = _Scores(chain=[softmax.name])
    x, reader = softmax.inputs[0], softmax.name
    while True:
        node = graph.producer(x)
        if node is None:
            return None
        if isinstance(node.op, Einsum):
            sc.qk, sc.qk_reader = node, reader
            return sc
        if not isinstance(node.op, (Reshape, Scale, CausalMask, Where, Binary, Unary)):
            return None
        if sc.cap is not None and isinstance(node.op, (CausalMask, Where, Binary)):
            return Miss(f"mask {node.name!r} acts before the softcap; attention caps first, then masks")
        if not only_reader(graph, x, reader):
            return Miss(f"{x!r} on the scores is read outside the attention chain")
        nxt = _absorb(graph, node, sc)
        if nxt is None or isinstance(nxt, Miss):
            return nxt
        sc.chain.append(node.name)
        reader, x = node.name, nxt


def _absorb(graph: Graph, node: Node, sc: _Scores) -> str | Miss | None:
    """Fold one op on the scores into ``sc``; returns the scores it reads (walking up)."""
    op = node.op
    if isinstance(op, Reshape):
        if graph.types[node.name].shape[-1:] != graph.types[node.inputs[0]].shape[-1:]:
            return Miss(f"view {node.name!r} changes the key axis")
        sc.views.append((graph.types[node.inputs[0]].shape, graph.types[node.name].shape))
    elif isinstance(op, Scale):  # the walk goes up: scales seen so far act after the masks found further up
        sc.scale *= op.factor
    elif isinstance(op, Unary):  # c * tanh(s / c): the scales seen since the masks are c
        if op.fn != "tanh" or sc.cap is not None:
            return None
        if sc.scale <= 0:
            return Miss(f"the scale after {node.name!r} is not a positive softcap")
        sc.cap, sc.scale = sc.scale, 1.0
    elif isinstance(op, CausalMask):
        if sc.scale <= 0:
            return Miss(f"a non-positive scale acts after causal mask {node.name!r}")
        if sc.empty_rows != "zero":
            return Miss(f"causal mask {node.name!r} hides with -inf, a mask nearer the softmax with a finite fill")
        if sc.offset is not None:
            return Miss("two causal masks on one softmax")
        sc.offset, sc.window = op.offset, op.window
        sc.view_for_rows = graph.types[node.name].shape
    elif isinstance(op, Where):
        return _absorb_bool_mask(graph, node, sc)
    else:
        return _absorb_additive_mask(graph, node, sc)
    return node.inputs[0]


def _absorb_bool_mask(graph: Graph, node: Node, sc: _Scores) -> str | Miss:
    """``Where(mask, s, -inf)``: a bool mask (several are ANDed: a per-row causal keep and a key padding)."""
    cond, a, b = node.inputs
    if sc.scale <= 0:
        return Miss(f"a non-positive scale acts after mask {node.name!r}")
    rows = _fill_rows(graph, b)
    if rows is None or graph.types[cond].dtype != "bool":
        return Miss(f"{node.name!r} is a Where that is not (mask, scores, -inf or a fill that swamps every score)")
    if sc.mask is not None and sc.mask_kind != "bool":
        return Miss("a bool mask and an additive mask on one softmax")
    if (sc.mask is not None or sc.offset is not None) and rows != sc.empty_rows:
        return Miss(f"{node.name!r} fills hidden keys with {graph.initializers[b].reshape(-1)[0]:g}, another mask on the softmax otherwise")
    sc.empty_rows = rows
    if sc.mask is None:
        sc.mask, sc.mask_kind = cond, "bool"
    else:
        sc.more_masks = (*sc.more_masks, cond)
    sc.view_for_rows = sc.view_for_rows or graph.types[node.name].shape
    return a


_MIN_SCALE_THROUGH_MASK = 1e-6
"""A scale after a position mask moves to the scores when at least this: ``finfo.min * c`` still hides a key."""


def _absorb_additive_mask(graph: Graph, node: Node, sc: _Scores) -> str | Miss | None:
    """``s + m``; an exporter's ``Where(causal & window & padding, 0, fill)`` is read back as the op's causal mask."""
    if node.op_as(Binary).fn != "add":
        return None
    full = graph.types[node.name].shape
    cands = [i for i, v in enumerate(node.inputs) if graph.types[v].shape == full and graph.producer(v) is not None]
    if len(cands) == 2 and sc.offset is None:  # a mask expanded to the scores' shape: the one that reads as a position mask
        masks = [i for i in cands if split_additive_mask(graph, node.inputs[i]) is not None]
        cands = [1 - masks[0]] if len(masks) == 1 else cands
    if len(cands) != 1:
        return Miss(f"{node.name!r} adds two score-shaped tensors; cannot tell the mask from the scores")
    pos = cands[0]
    split = split_additive_mask(graph, node.inputs[1 - pos]) if sc.offset is None else None
    if sc.mask is not None and sc.split_from is not None and sc.scale == 1.0 and sc.mask_kind == "bool":
        return _bias_beside_position_mask(graph, node, pos, sc)
    if sc.mask is not None:  # a bias (ALiBi) found nearer the softmax: this add may still be the position mask
        if sc.mask_kind != "additive" or sc.scale != 1.0:
            return Miss("more than one user mask on one softmax")
        if split is None:  # not a position mask: the op's mask is the two added
            seen = _through_views(graph, node.inputs[1 - pos], sc)
            if isinstance(seen, Miss):
                return seen
            sc.more_masks = (*sc.more_masks, node.inputs[1 - pos])
            return node.inputs[pos]
        _positions_beside_bias(sc, split)  # MPT: masked_fill(causal | padding, finfo.min) after the bias
        return node.inputs[pos]
    if sc.scale != 1.0 and (split is None or sc.scale < _MIN_SCALE_THROUGH_MASK):
        # c * (s + Where(keep, 0, fill)) hides the same keys as (c * s) + Where(keep, 0, fill) for c > 0 (fill * c still
        # swamps every score); any other mask would be scaled too
        return Miss(f"a scale acts after additive mask {node.name!r}, so it would scale the mask too")
    sc.mask, sc.mask_kind = node.inputs[1 - pos], "additive"
    sc.view_for_rows = sc.view_for_rows or full
    if split is not None:
        sc.offset, sc.window, sc.empty_rows = split.offset, split.window, split.empty_rows
        sc.mask, sc.mask_kind, sc.more_masks = (split.keep[0], "bool", split.keep[1:]) if split.keep else (None, "none", ())
        if split.hide is not None:
            sc.mask, sc.mask_kind, sc.negate_mask = split.hide, "bool", True
        sc.split_from = node.inputs[1 - pos] if split.keep or split.hide else None
    return node.inputs[pos]


def _bias_beside_position_mask(graph: Graph, node: Node, pos: int, sc: _Scores) -> str | Miss:
    """A bias added further up than a position mask with padding in it (Bloom: ALiBi on the ``[batch*heads]`` scores
    before their view as ``[batch, heads, ...]``, then ``Where(causal & padding, 0, finfo.min)``): the op's additive mask
    is the bias, seen through the views passed since the position mask, with the padding added as ``-inf``
    (:func:`_positions_beside_bias`)."""
    bias = node.inputs[1 - pos]
    seen = _through_views(graph, bias, sc)
    if isinstance(seen, Miss):
        return seen
    keep = (sc.mask, *sc.more_masks) if sc.mask is not None else ()
    hiding = tuple((m, sc.negate_mask) for m in keep)
    sc.mask, sc.mask_kind, sc.more_masks, sc.negate_mask, sc.split_from = None, "additive", (bias,), False, None
    sc.hiding_masks = hiding
    return node.inputs[pos]


def _positions_beside_bias(sc: _Scores, split: MaskSplit) -> None:
    """A position mask on the scores beside a bias (ALiBi): its causal offset and window become the op's, its other
    conjuncts (padding) are added to the bias as ``-inf``.  A row whose every key is hidden then gives what the written
    graph gives with a finite fill (the mean of V over every key: ``split.empty_rows``), and every other row its
    softmax over the visible keys."""
    sc.offset, sc.window, sc.empty_rows = split.offset, split.window, split.empty_rows
    if split.hide is not None:
        sc.hiding_masks = (*sc.hiding_masks, (split.hide, True))
    sc.hiding_masks = (*sc.hiding_masks, *((k, False) for k in split.keep))


def _through_views(graph: Graph, bias: str, sc: _Scores) -> tuple[Dim, ...] | Miss:
    """The shape ``bias``, added below the views passed so far (Bloom's ALiBi on the ``[batch*heads]`` scores), takes
    above them (recorded in ``sc.mask_views`` when it differs); a Miss where a view cannot be followed."""
    shape = graph.types[bias].shape
    for before, after in reversed(sc.views):
        if len(before) == len(shape) and shape[0] == before[0] and len(after) == len(before) + 1 and after[0] != before[0]:
            shape = (*after[:2], *shape[1:])  # the batch*heads axis split into batch, heads
        elif len(before) == len(after) == len(shape) and before == after:
            continue
        else:
            return Miss(f"bias {bias!r} is added in a view the masks cannot follow")
    if shape != graph.types[bias].shape:
        sc.mask_views[bias] = shape
    return shape


def _qk_roles(graph: Graph, qk: Node, view: tuple[Dim, ...], offset: Dim | None) -> _Roles | Miss:
    """Q, K, batch, query-row, key and head-dim labels of the QK^T einsum, and how the rows split into group x queries."""
    spec = qk.op_as(Einsum).parsed
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
    n_rows = dim_prod(sizes[c] for c in rows)
    sq = view[-2] if len(view) >= 2 else 1
    group = dim_div(n_rows, sq) if rows else (1 if sq == 1 else None)
    if group is None:
        if offset is not None:
            return Miss(f"the causal mask's query axis ({sq!r}) does not divide the query rows ({n_rows!r})")
        sq, group = n_rows, 1
    return _Roles(qk, qpos, out, q_term, k_term, batch, rows, t, d, sizes, n_rows, sq, group)


def _pv_roles(graph: Graph, softmax: Node, sc: _Scores, r: _Roles) -> _Values | Miss:
    """Walk down from the softmax through views to the PV einsum and read its labels in QK label names."""
    p_val = softmax.name
    readers = graph.consumers(p_val)
    while len(readers) == 1 and isinstance(readers[0].op, Reshape) and not graph.is_output(p_val):
        sc.chain.insert(0, readers[0].name)
        p_val = readers[0].name
        readers = graph.consumers(p_val)
    if len(readers) != 1 or not isinstance(readers[0].op, Einsum) or not only_reader(graph, p_val, readers[0].name):
        return Miss("the probabilities are not read by one einsum alone")
    pv = readers[0]
    pspec = pv.op_as(Einsum).parsed
    p_shape, s_shape = graph.types[p_val].shape, graph.types[r.qk.name].shape
    split = _rows_split(p_shape, s_shape, len(r.batch), r.rows, r.sizes, r.group, r.sq)
    merged = _rows_merged(p_shape, s_shape, len(r.batch), r.rows, r.sizes)
    if len(pspec.inputs) != 2 or (p_shape != s_shape and split is None and not merged):
        return Miss(
            f"{pv.name!r} does not read the probabilities in the scores' shape (or in it with the query rows split into group x queries, "
            "or merged from group x queries)"
        )
    ppos = pv.inputs.index(p_val)
    p_term, v_term_raw = pspec.inputs[ppos], pspec.inputs[1 - ppos]
    rename, pv_rows = _p_labels(r, p_term, set(pspec.labels), split, merged)
    if rename[p_term[-1]] != r.t or p_term[-1] in pspec.output or p_term[-1] not in v_term_raw:
        return Miss(f"{pv.name!r} ({pspec}) does not contract the key axis against V")
    v_free = [c for c in v_term_raw if c not in p_term]
    if len(v_free) != 1 or v_free[0] not in pspec.output:
        return Miss(f"{pv.name!r} ({pspec}) has no single value-dim label")
    taken = r.out + r.q_term + pv_rows
    e = "E" if "E" not in taken else next(c for c in "ZYXWVU" if c not in taken)
    rename[v_free[0]] = e
    v_term = "".join(rename[c] for c in v_term_raw)
    out_term = "".join(rename.get(c, "?") for c in pspec.output)
    if set(v_term) != set(r.batch + r.t + e) or set(out_term) != set(r.batch + pv_rows + e):
        return Miss(f"{pv.name!r} ({pspec}) mixes labels across the batch, query and value axes")
    r.sizes[e] = graph.types[pv.inputs[1 - ppos]].shape[v_term.index(e)]
    return _Values(pv, ppos, v_term, out_term, pv_rows, e)


def _p_labels(r: _Roles, p_term: str, pv_labels: set[str], split: tuple[Dim, Dim] | None, merged: bool) -> tuple[dict[str, str], str]:
    """P's labels renamed to the scores' (with fresh labels for split or merged query rows), and the PV output's row labels."""
    at = len(r.batch)
    used = set(r.out + r.q_term + r.k_term) | pv_labels
    if split is not None:  # P is [.., group, queries, keys] where the scores are [.., group*queries, keys]
        g_label, s_label = [c for c in "GQJKLMNOPRSTUVWXYZ" if c not in used][:2]
        r.sizes[g_label], r.sizes[s_label] = split
        return dict(zip(p_term, r.out[:at] + g_label + s_label + r.out[at + 1 :])), g_label + s_label
    if merged:  # P is [.., group*queries, keys] where the scores are [.., group, queries, keys] (a grouped QK)
        m_label = next(c for c in "MGQJKLNOPRSTUVWXYZ" if c not in used)
        r.sizes[m_label] = r.n_rows
        return dict(zip(p_term, r.out[:at] + m_label + r.out[at + len(r.rows) :])), m_label
    return dict(zip(p_term, r.out)), r.rows


def _with_operands(graph: Graph, softmax: Node, sc: _Scores, r: _Roles, pv: _Values) -> AttentionMatch | Miss:
    """Q, K, V below a scale on Q or K and the KV-head repeat, and a KV cache ``Concat``: the complete match."""
    q, f = _strip_scale(graph, r.qk.inputs[r.qpos], r.qk.name)
    k_found = _unwrap_kv(graph, r.qk.inputs[1 - r.qpos], r.k_term, r.qk.name, r.batch, take_scale=True)
    v_found = _unwrap_kv(graph, pv.pv.inputs[1 - pv.ppos], pv.v_term, pv.pv.name, r.batch, take_scale=False)
    if isinstance(k_found, Miss):
        return k_found
    if isinstance(v_found, Miss):
        return v_found
    (k, rk, fk), (v, rv, _) = k_found, v_found
    if rk != rv:
        return Miss(f"K is repeated {rk}x but V {rv}x")
    s = r.sizes
    q_shape = (dim_prod(s[c] for c in r.batch[:-1]), dim_prod([s[r.batch[-1]] if r.batch else 1, r.group]), r.sq, s[r.d])
    target = (*q_shape[:3], s[r.t])
    mask_view = None
    first_mask = sc.mask or next(iter([m for m, _ in sc.hiding_masks] + list(sc.more_masks)), None)
    if first_mask is not None and graph.types[first_mask].rank > 2 and sc.view_for_rows != target:
        view = sc.view_for_rows or ()
        same_rows = len(view) == 4 and view[2:] == target[2:] and normalize_dim(dim_prod(view[:2])) == normalize_dim(dim_prod(target[:2]))
        if not (same_rows and sc.mask_kind == "additive"):
            return Miss(f"the mask is applied to a {list(view)} view, not [batch, heads, queries, keys]")
        mask_view = (tuple(view), target)  # Bloom: [batch, heads] masks on [batch*heads] scores, the same rows in order
    past = presents = None
    moved: tuple[str, ...] = ()
    if sc.offset is not None and len(r.batch) == 2 and r.k_term == r.batch + r.t + r.d and pv.v_term == r.batch + r.t + pv.e:
        kc, vc = graph.producer(k), graph.producer(v)
        if kc is not None and vc is not None and all(isinstance(c.op, Concat) and c.op.axis % 4 == 2 and len(c.inputs) == 2 for c in (kc, vc)):
            early = _early_readers(graph, (kc, vc), pv.pv)
            if graph.types[kc.inputs[0]].shape[2] == sc.offset and early is not None:
                past, presents = (kc.inputs[0], vc.inputs[0]), (kc.name, vc.name)
                k, v, moved = kc.inputs[1], vc.inputs[1], early
    return AttentionMatch(
        softmax,
        pv.pv,
        q,
        k,
        v,
        r.q_term,
        r.k_term,
        pv.v_term,
        r.batch,
        r.rows,
        r.t,
        r.d,
        pv.e,
        s,
        q_shape,
        r.group * rk,
        sc.scale * f * fk,
        sc.offset,
        sc.mask,
        sc.mask_kind,
        past,
        presents,
        pv.out_term,
        sc.chain + [r.qk.name],
        window=sc.window,
        moved=moved,
        softcap=sc.cap,
        pv_rows=pv.pv_rows,
        empty_rows=sc.empty_rows,
        more_masks=sc.more_masks,
        negate_mask=sc.negate_mask,
        hiding_masks=sc.hiding_masks,
        mask_views=sc.mask_views,
        mask_view=mask_view,
    )


def _rows_split(
    p_shape: tuple[Dim, ...], s_shape: tuple[Dim, ...], at: int, rows: str, sizes: dict[str, Dim], group: int | None, sq: Dim
) -> tuple[Dim, Dim] | None:
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


def _early_readers(graph: Graph, concats: tuple[Node, ...], pv: Node) -> tuple[str, ...] | None:
    """The fused op replaces the cache Concats at the PV einsum's place: their other readers must come later, or be
    nodes read only later (a sliding-window cache's present, cut from the Concat before the scores), which then move
    after the op.  ``None`` when a reader can do neither."""
    early: list[str] = []
    for c in concats:
        for r in graph.consumers(c.name):
            if isinstance(r.op, (Repeat, Einsum, Scale)) or graph.is_before(pv.name, r.name):
                continue
            if any(not graph.is_before(pv.name, u.name) for o in r.outputs for u in graph.consumers(o)):
                return None
            early.append(r.name)
    return tuple(early)


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
    if m.negate_mask and mask is not None:  # True hides: the op's mask keeps where it is False
        no, yes = graph.shared_initializer("attention_false", np.array(False)), graph.shared_initializer("attention_true", np.array(True))
        mask = graph.insert_before(anchor, Where(), [mask, no, yes], f"{base}_keep").name
    for hider, hides in m.hiding_masks:  # bool masks on an additive one: -inf where they hide
        dtype = graph.types[m.q].dtype
        neg_inf, zero = (graph.shared_initializer(f"attention_{n}_{dtype}", np.array(x, dtype)) for n, x in (("neg_inf", -np.inf), ("zero", 0)))
        hidden = graph.insert_before(anchor, Where(), [hider, *((neg_inf, zero) if hides else (zero, neg_inf))], f"{base}_hidden_keys").name
        mask = hidden if mask is None else graph.insert_before(anchor, Binary("add"), [mask, hidden], f"{base}_mask_sum").name
    for extra in m.more_masks:  # bool masks ANDed, additive ones added
        if extra in m.mask_views:
            extra = graph.insert_before(anchor, Reshape(m.mask_views[extra]), [extra], f"{base}_bias_view").name
        if mask is None:
            mask = extra
        elif m.mask_kind == "additive":
            mask = graph.insert_before(anchor, Binary("add"), [mask, extra], f"{base}_mask_sum").name
        else:
            false = graph.shared_initializer("attention_false", np.array(False))
            mask = graph.insert_before(anchor, Where(), [mask, extra, false], f"{base}_mask_and").name
    if mask is not None and m.mask_view is not None:  # a [batch, heads, S, T] mask for [batch*heads, 1, S, T] scores
        full, target = m.mask_view
        mshape = graph.types[mask].shape
        if len(mshape) >= 2 and mshape[-2] == 1:  # a key mask stays one row
            full, target = (*full[:-2], 1, full[-1]), (*target[:-2], 1, target[-1])
        if mshape != full:
            mask = graph.insert_before(anchor, BroadcastTo(full), [mask], f"{base}_mask_full").name
        mask = graph.insert_before(anchor, Reshape(target), [mask], f"{base}_mask_rows").name
    inputs = [q, k, v] + ([mask] if mask else []) + (list(m.past) if m.past else [])
    scale = m.scale * m.softcap if m.softcap is not None else m.scale  # c * tanh(scale * s / c)
    op = Attention(scale, m.offset, m.mask_kind, m.past is not None, m.window, m.softcap, m.empty_rows)
    stem = base.split("_B")[0] if "_B" in base else base
    names = [graph.fresh_name(f"{stem}_BHSD")] + ([graph.fresh_name(f"{p}_fused") for p in m.presents] if m.presents else [])
    outs = graph.add_multi_node(op, inputs, names, before=anchor)
    for name in m.moved:
        graph.move_before(name, anchor)
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
    if m.mask or m.more_masks or m.hiding_masks:
        masks = [x for x in (m.mask, *(h for h, _ in m.hiding_masks), *m.more_masks) if x is not None]
        parts.append(f"{m.mask_kind} mask {masks[0]!r}" + (f" and {len(masks) - 1} more" if len(masks) > 1 else ""))
    if m.empty_rows != "zero":
        parts.append(f"rows with no visible key give the {m.empty_rows} of V")
    if m.past:
        parts.append("KV cache " + ", ".join(m.past))
    return "attention recognised: " + ", ".join(parts)


FUSE_ATTENTION_RULE = Rule("fuse_attention", (Softmax,), _match, _rewrite)

fuse_attention = RewritePass(
    "fuse_attention",
    "recognise softmax(scale * QK^T + masks) V (repeated, grouped or folded, any axis order) as one Attention op",
    [FILL_FIRST_RULE, FUSE_ATTENTION_RULE],
)
