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

from dataclasses import dataclass, field, replace

import numpy as np

from graphc.attention_op import Attention
from graphc.visibility import Visibility, VisibilityError
from graphc.dims import Dim, dim_div, dim_prod, normalize_dim
from graphc.graph import Graph, Node
from graphc.numerics import FILL_LIMIT
from graphc.ops import FLOAT_DTYPES, Binary, Cast, CausalMask, Concat, Einsum, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where
from graphc.tensor_ops import BroadcastTo

from .cleanup import only_reader, remove_if_dead
from .infra import Miss, PassContext, RewritePass, Rule
from .masks import MaskSplit, split_additive_mask, split_bool_mask, split_masked_bias

__all__ = ["fuse_attention", "FUSE_ATTENTION_RULE", "AttentionMatch"]


@dataclass
class MaskInputs:
    """The values that make the op's user mask, read on the scores (the op's :class:`Visibility` says their kind)."""

    first: str | None = None  # the mask, when one is read (None: only ``more`` or ``hiding`` ones, or none)
    more: tuple[str, ...] = ()  # further masks: ANDed (bool), added (additive)
    negate: bool = False  # ``first`` is bool and hides where True (transformers' padding before 4.58)
    hiding: tuple[tuple[str, bool], ...] = ()  # bool masks added to an additive one as -inf: (value, True hides)
    views: dict[str, tuple[Dim, ...]] = field(default_factory=dict)  # masks to view as [batch, heads, ...] first
    view: tuple[tuple[Dim, ...], tuple[Dim, ...]] | None = None  # the masks' view and the op's, when they differ
    split_from: str | None = None  # the additive position mask ``first`` was read from

    def values(self) -> list[str]:
        """Every mask value, the first one first."""
        return [x for x in (self.first, *(h for h, _ in self.hiding), *self.more) if x is not None]


@dataclass
class AttentionMatch:
    """A recognised attention chain and how to rebuild it as one op."""

    softmax: Node
    roles: _Roles  # the QK^T einsum's labels
    values: _Values  # the PV einsum's labels, in QK label names
    q: str
    k: str
    v: str
    q_shape: tuple[Dim, ...]  # Q as the op takes it: [batch, query heads, queries, head dim]
    group: int
    scale: float
    softcap: float | None
    visibility: Visibility
    masks: MaskInputs
    cache: KVCache | None
    chain: list[str] = field(default_factory=list)  # values of the chain, softmax first (removed when dead)


@dataclass(frozen=True)
class KVCache:
    """A cache read in the chain: K and V concatenated from a past of the causal offset's length."""

    past: tuple[str, str]  # past key, past value
    presents: tuple[str, str]  # the Concats, whose names the op's present outputs take
    moved: tuple[str, ...] = ()  # readers of the Concats before the PV einsum (a present cut to a window), moved after the op


def _constant(graph: Graph, name: str) -> np.ndarray | None:
    """The value of constant ``name``, seen through a ``Cast`` (a low-precision graph's fill widened for float32
    compute), or None."""
    node = graph.producer(name)
    if node is not None and isinstance(node.op, Cast) and graph.is_constant(node.inputs[0]):
        return np.asarray(graph.initializers[node.inputs[0]]).astype(node.op_as(Cast).dtype)
    return np.asarray(graph.initializers[name]) if graph.is_constant(name) else None


def _fill_rows(graph: Graph, name: str) -> str | None:
    """What a row of keys all hidden by ``Where(keep, s, name)`` gives: ``"zero"`` for a ``-inf`` fill (graphc's
    rows with no visible key), ``"mean"`` for a finite fill that swamps every score (``finfo.min``: the row's scores
    are all equal, its softmax uniform), ``None`` when ``name`` is no such constant."""
    arr = _constant(graph, name)
    if arr is None or str(graph.types[name].dtype) not in FLOAT_DTYPES:
        return None
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
    cap: float | None = None  # the softcap c of c * tanh(s / c), once its tanh is passed
    vis: Visibility = Visibility()
    masks: MaskInputs = field(default_factory=MaskInputs)
    view_for_rows: tuple[Dim, ...] | None = None  # the shape the masks act on
    views: list[tuple[tuple[Dim, ...], tuple[Dim, ...]]] = field(default_factory=list)  # reshapes passed: (input, output)
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
        axis = softmax.op_as(Softmax).axis
        return Miss(f"a softmax over axis {axis} of a rank-{rank} value: attention's is over the keys, the last of at least two")
    sc = _walk_scores(graph, softmax)
    if isinstance(sc, Miss):
        return sc
    sc.vis = sc.vis.filled(sc.vis.empty_rows == "mean")  # a finite fill's mean rows only where a row may see no key
    assert sc.qk is not None
    if not only_reader(graph, sc.qk.name, sc.qk_reader):
        return Miss(f"scores {sc.qk.name!r} are read outside the attention chain")
    roles = _qk_roles(graph, sc.qk, sc.view_for_rows or graph.types[softmax.inputs[0]].shape, sc.vis.is_causal)
    if isinstance(roles, Miss):
        return roles
    values = _pv_roles(graph, softmax, sc, roles)
    if isinstance(values, Miss):
        return values
    return _with_operands(graph, softmax, sc, roles, values)


def _walk_scores(graph: Graph, softmax: Node) -> _Scores | Miss:
    """Walk up from the softmax through the ops that may sit on the scores to the QK^T einsum."""
    sc = _Scores(chain=[softmax.name])
    x, reader = softmax.inputs[0], softmax.name
    while True:
        node = graph.producer(x)
        if node is None:
            return Miss(f"the softmax's scores come from {x!r}, {'a graph input' if x in graph.inputs else 'a constant'}, not a QK^T einsum")
        if isinstance(node.op, Einsum):
            sc.qk, sc.qk_reader = node, reader
            return sc
        if not isinstance(node.op, (Reshape, Scale, CausalMask, Where, Binary, Unary)):
            why = "attention's scores come from a QK^T einsum through scales, masks, a softcap and views"
            return Miss(f"{_op_text(node)} {node.name!r} makes the scores; {why}")
        if sc.cap is not None and isinstance(node.op, (CausalMask, Where, Binary)):
            return Miss(f"mask {node.name!r} acts before the softcap; attention caps first, then masks")
        if not only_reader(graph, x, reader):
            return Miss(f"{x!r} on the scores is read outside the attention chain")
        nxt = _absorb(graph, node, sc)
        if nxt is None:
            return Miss(f"{_op_text(node)} {node.name!r} sits on the scores: not a scale, mask, softcap or view attention can take")
        if isinstance(nxt, Miss):
            return nxt
        sc.chain.append(node.name)
        reader, x = node.name, nxt


def _op_text(node: Node) -> str:
    """``Binary(mul)``, ``Unary(exp)``: an op with its function where it has one."""
    fn = getattr(node.op, "fn", None)
    return f"{node.op.kind}({fn})" if fn else node.op.kind


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
        both = _conjunction(sc.vis, op.visibility, f"causal mask {node.name!r} hides with -inf, a mask nearer the softmax with a finite fill")
        if isinstance(both, Miss):
            return both
        sc.vis, sc.view_for_rows = both, graph.types[node.name].shape
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
    if sc.vis.mask == "additive":
        return Miss("a bool mask and an additive mask on one softmax")
    fill = _constant(graph, b)
    why = f"{node.name!r} fills hidden keys with {float(fill.reshape(-1)[0]) if fill is not None else b!r}, another mask on the softmax otherwise"
    split = split_bool_mask(graph, cond)  # an index grid's causal bound among the conjuncts
    part = Visibility(mask="bool", empty_rows=rows) if split is None else Visibility.from_bounds(split[0], "bool" if split[1] else "none", rows)
    both = None if part is None else _conjunction(sc.vis, part, why)
    if both is None or isinstance(both, Miss):
        return both or Miss(f"the position bounds of {cond!r} have no one causal form")
    for value in (cond,) if split is None else split[1]:
        if sc.masks.first is None:
            sc.masks.first = value
        else:
            sc.masks.more = (*sc.masks.more, value)
    sc.vis, sc.view_for_rows = both, sc.view_for_rows or graph.types[node.name].shape
    return a


def _conjunction(a: Visibility, b: Visibility, why: str) -> Visibility | Miss:
    """What a query sees under both, or a Miss saying ``why`` they cannot be one visibility."""
    try:
        return a & b
    except VisibilityError:
        return Miss(why)


_MIN_SCALE_THROUGH_MASK = 1e-6
"""A scale after a position mask moves to the scores when at least this: ``finfo.min * c`` still hides a key."""


def _absorb_additive_mask(graph: Graph, node: Node, sc: _Scores) -> str | Miss | None:
    """``s + m``; an exporter's ``Where(causal & window & padding, 0, fill)`` is read back as the op's causal mask."""
    if node.op_as(Binary).fn != "add":
        return None
    full = graph.types[node.name].shape
    cands = [i for i, v in enumerate(node.inputs) if graph.types[v].shape == full and graph.producer(v) is not None]
    if len(cands) == 2 and not sc.vis.is_causal:  # a mask expanded to the scores' shape: the one that reads as a position mask
        masks = [i for i in cands if split_additive_mask(graph, node.inputs[i]) is not None]
        cands = [1 - masks[0]] if len(masks) == 1 else cands
    if len(cands) == 2:  # a bias as large as the scores (T5's relative positions with the padding): the scores are QK^T's
        products = [i for i in cands if _is_product(graph, node.inputs[i])]
        cands = products if len(products) == 1 else cands
    if len(cands) != 1:
        return Miss(f"{node.name!r} adds two score-shaped tensors; cannot tell the mask from the scores")
    pos = cands[0]
    m = sc.masks
    masked = None if sc.vis.is_causal or m.first is not None or sc.scale != 1.0 else split_masked_bias(graph, node.inputs[1 - pos])
    if masked is not None:  # T5's decoder: Where(causal, bias, fill), the bias the op's additive term
        return _masked_bias(graph, node, pos, sc, *masked)
    split = None if sc.vis.is_causal else split_additive_mask(graph, node.inputs[1 - pos])
    if m.first is not None and (m.split_from is not None or split is None) and sc.scale == 1.0 and sc.vis.mask == "bool":
        return _bias_beside_bool_mask(graph, node, pos, sc)
    if m.first is not None:  # a bias (ALiBi) found nearer the softmax: this add may still be the position mask
        if sc.vis.mask != "additive" or sc.scale != 1.0:
            return Miss("more than one user mask on one softmax")
        if split is None:  # not a position mask: the op's mask is the two added
            seen = _through_views(graph, node.inputs[1 - pos], sc)
            if isinstance(seen, Miss):
                return seen
            m.more = (*m.more, node.inputs[1 - pos])
            return node.inputs[pos]
        _positions_beside_bias(sc, split)  # MPT: masked_fill(causal | padding, finfo.min) after the bias
        return node.inputs[pos]
    if sc.scale != 1.0 and (split is None or sc.scale < _MIN_SCALE_THROUGH_MASK):
        # c * (s + Where(keep, 0, fill)) hides the same keys as (c * s) + Where(keep, 0, fill) for c > 0 (fill * c still
        # swamps every score); any other mask would be scaled too
        return Miss(f"a scale acts after additive mask {node.name!r}, so it would scale the mask too")
    sc.view_for_rows = sc.view_for_rows or full
    if split is None:
        m.first, sc.vis = node.inputs[1 - pos], replace(sc.vis, mask="additive")
        return node.inputs[pos]
    sc.vis = split.visibility
    m.first, m.more = (split.keep[0], split.keep[1:]) if split.keep else (None, ())
    if split.hide is not None:
        m.first, m.negate = split.hide, True
    m.split_from = node.inputs[1 - pos] if split.keep or split.hide else None
    return node.inputs[pos]


def _is_product(graph: Graph, value: str) -> bool:
    """``value`` is a two-operand einsum of values computed from the inputs (the QK^T scores), seen through views and
    scales: a bias (a gathered table, a mask) is not."""
    node = graph.producer(value)
    while node is not None and isinstance(node.op, (Reshape, Transpose, Scale)):
        node = graph.producer(node.inputs[0])
    return node is not None and isinstance(node.op, Einsum) and len(node.inputs) == 2 and not any(graph.is_constant(i) for i in node.inputs)


def _bias_beside_bool_mask(graph: Graph, node: Node, pos: int, sc: _Scores) -> str | Miss:
    """A bias added further up than a bool mask (ALiBi under a padding mask, ``Where(keep, s + bias, fill)``), or than a
    position mask with padding in it (Bloom: ALiBi on the ``[batch*heads]`` scores before their view as ``[batch,
    heads, ...]``, then ``Where(causal & padding, 0, finfo.min)``): the op's additive mask is the bias, seen through the
    views passed since the mask, with the bool masks added as ``-inf`` (:func:`_positions_beside_bias`)."""
    bias = node.inputs[1 - pos]
    seen = _through_views(graph, bias, sc)
    if isinstance(seen, Miss):
        return seen
    m = sc.masks
    keep = (m.first, *m.more) if m.first is not None else ()
    m.hiding = tuple((x, m.negate) for x in keep)
    m.first, m.more, m.negate, m.split_from = None, (bias,), False, None
    sc.vis = replace(sc.vis, mask="additive")
    return node.inputs[pos]


def _masked_bias(graph: Graph, node: Node, pos: int, sc: _Scores, split: MaskSplit, bias: str) -> str | Miss:
    """``s + Where(keep, bias, fill)``: ``bias`` (seen through the views passed) is the op's additive mask, ``keep``'s
    half-planes its causal offset and window, and keep's other conjuncts hide keys beside them."""
    seen = _through_views(graph, bias, sc)
    if isinstance(seen, Miss):
        return seen
    m = sc.masks
    m.first, m.more, m.negate, m.split_from = None, (bias,), False, None
    _positions_beside_bias(sc, split)
    sc.view_for_rows = sc.view_for_rows or graph.types[node.name].shape
    return node.inputs[pos]


def _positions_beside_bias(sc: _Scores, split: MaskSplit) -> None:
    """A position mask on the scores beside a bias (ALiBi): its causal offset and window become the op's, its other
    conjuncts (padding) are added to the bias as ``-inf``.  A row whose every key is hidden then gives what the written
    graph gives with a finite fill (the mean of V over every key: the split's ``empty_rows``), and every other row its
    softmax over the visible keys."""
    sc.vis = replace(split.visibility, mask="additive")
    if split.hide is not None:
        sc.masks.hiding = (*sc.masks.hiding, (split.hide, True))
    sc.masks.hiding = (*sc.masks.hiding, *((k, False) for k in split.keep))


def _through_views(graph: Graph, bias: str, sc: _Scores) -> tuple[Dim, ...] | Miss:
    """The shape ``bias``, added below the views passed so far (Bloom's ALiBi on the ``[batch*heads]`` scores), takes
    above them (recorded in ``sc.masks.views`` when it differs); a Miss where a view cannot be followed."""
    shape = graph.types[bias].shape
    for before, after in reversed(sc.views):
        if len(before) == len(shape) and shape[0] == before[0] and len(after) == len(before) + 1 and after[0] != before[0]:
            shape = (*after[:2], *shape[1:])  # the batch*heads axis split into batch, heads
        elif len(before) == len(after) == len(shape) and before == after:
            continue
        else:
            return Miss(f"bias {bias!r} is added in a view the masks cannot follow")
    if shape != graph.types[bias].shape:
        sc.masks.views[bias] = shape
    return shape


def _qk_roles(graph: Graph, qk: Node, view: tuple[Dim, ...], causal: bool) -> _Roles | Miss:
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
        if causal:
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
    view = _mask_view(graph, sc, (*q_shape[:3], s[r.t]))
    if isinstance(view, Miss):
        return view
    sc.masks.view = view
    cache, k, v = _cache_of(graph, sc, r, pv, k, v)
    return AttentionMatch(
        softmax, r, pv, q, k, v, q_shape, r.group * rk, sc.scale * f * fk, sc.cap, sc.vis, sc.masks, cache, sc.chain + [r.qk.name]
    )


def _mask_view(graph: Graph, sc: _Scores, target: tuple[Dim, ...]) -> tuple[tuple[Dim, ...], tuple[Dim, ...]] | None | Miss:
    """The masks' view and the op's ``[batch, heads, queries, keys]`` when they differ (Bloom: ``[batch, heads]`` masks
    on ``[batch*heads]`` scores, the same rows in order), ``None`` when they do not, a Miss when they cannot be lined up."""
    first_mask = next(iter(sc.masks.values()), None)
    if first_mask is None or graph.types[first_mask].rank <= 2 or sc.view_for_rows == target:
        return None
    view = sc.view_for_rows or ()
    same_rows = len(view) == 4 and view[2:] == target[2:] and normalize_dim(dim_prod(view[:2])) == normalize_dim(dim_prod(target[:2]))
    if not (same_rows and sc.vis.mask == "additive"):
        return Miss(f"the mask is applied to a {list(view)} view, not [batch, heads, queries, keys]")
    return tuple(view), target


def _cache_of(graph: Graph, sc: _Scores, r: _Roles, pv: _Values, k: str, v: str) -> tuple[KVCache | None, str, str]:
    """A KV cache read in the chain (K and V ``Concat``s of a past as long as the causal offset), and the new K and V."""
    if not (sc.vis.is_causal and len(r.batch) == 2 and r.k_term == r.batch + r.t + r.d and pv.v_term == r.batch + r.t + pv.e):
        return None, k, v
    kc, vc = graph.producer(k), graph.producer(v)
    if kc is None or vc is None or not all(isinstance(c.op, Concat) and c.op.axis % 4 == 2 and len(c.inputs) == 2 for c in (kc, vc)):
        return None, k, v
    early = _early_readers(graph, (kc, vc), pv.pv)
    if not sc.vis.aligned_to(graph.types[kc.inputs[0]].shape[2]) or early is None:
        return None, k, v
    return KVCache((kc.inputs[0], vc.inputs[0]), (kc.name, vc.name), early), kc.inputs[1], vc.inputs[1]


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
    r, pv, anchor = m.roles, m.values, m.values.pv.name
    s = r.sizes
    b, _, _, d = m.q_shape
    hkv = graph.types[m.k].shape[r.k_term.index(r.batch[-1])] if r.batch else 1
    q = _to_canonical(graph, m.q, r.q_term, r.batch + r.rows + r.d, m.q_shape, anchor, "BHSD")
    k_shape, v_shape = graph.types[m.k].shape, graph.types[m.v].shape
    k = _to_canonical(graph, m.k, r.k_term, r.batch + r.t + r.d, (b, hkv, k_shape[r.k_term.index(r.t)], d), anchor, "BHkvTD")
    v = _to_canonical(graph, m.v, pv.v_term, r.batch + r.t + pv.e, (b, hkv, v_shape[pv.v_term.index(r.t)], s[pv.e]), anchor, "BHkvTD")
    mask = _op_mask(graph, m, anchor)
    inputs = [q, k, v] + ([mask] if mask else []) + (list(m.cache.past) if m.cache else [])
    scale = m.scale * m.softcap if m.softcap is not None else m.scale  # c * tanh(scale * s / c)
    op = Attention(scale, m.visibility, m.cache is not None, m.softcap)
    stem = anchor.split("_B")[0] if "_B" in anchor else anchor
    names = [graph.fresh_name(f"{stem}_BHSD")] + ([graph.fresh_name(f"{p}_fused") for p in m.cache.presents] if m.cache else [])
    outs = graph.add_multi_node(op, inputs, names, before=anchor)
    for name in m.cache.moved if m.cache else ():
        graph.move_before(name, anchor)
    graph.substitute(anchor, {anchor: _to_pv_layout(graph, m, outs[0].name)})
    for present, new in zip(m.cache.presents if m.cache else (), outs[1:]):  # the op now produces the cache under its names
        graph.substitute(present, {present: new})
    for name in m.chain:
        remove_if_dead(graph, name)
    return "attention recognised: " + _describe(m, scale)


def _op_mask(graph: Graph, m: AttentionMatch, anchor: str) -> str | None:
    """The op's one mask input from the masks read on the scores: bool masks ANDed, additive ones added, bool masks
    beside an additive one as ``-inf``, viewed as ``[batch, heads, queries, keys]``."""
    masks, mask = m.masks, m.masks.first
    if masks.negate and mask is not None:  # True hides: the op's mask keeps where it is False
        no, yes = graph.shared_initializer("attention_false", np.array(False)), graph.shared_initializer("attention_true", np.array(True))
        mask = graph.insert_before(anchor, Where(), [mask, no, yes], f"{anchor}_keep").name
    dtype = graph.types[m.q].dtype
    for hider, hides in masks.hiding:  # bool masks on an additive one: -inf where they hide
        neg_inf, zero = (graph.shared_initializer(f"attention_{n}_{dtype}", np.array(x, dtype)) for n, x in (("neg_inf", -np.inf), ("zero", 0)))
        hidden = graph.insert_before(anchor, Where(), [hider, *((neg_inf, zero) if hides else (zero, neg_inf))], f"{anchor}_hidden_keys").name
        mask = hidden if mask is None else graph.insert_before(anchor, Binary("add"), [mask, hidden], f"{anchor}_mask_sum").name
    for extra in masks.more:  # bool masks ANDed, additive ones added
        if extra in masks.views:
            extra = graph.insert_before(anchor, Reshape(masks.views[extra]), [extra], f"{anchor}_bias_view").name
        if mask is None:
            mask = extra
        elif m.visibility.mask == "additive":
            mask = graph.insert_before(anchor, Binary("add"), [mask, extra], f"{anchor}_mask_sum").name
        else:
            false = graph.shared_initializer("attention_false", np.array(False))
            mask = graph.insert_before(anchor, Where(), [mask, extra, false], f"{anchor}_mask_and").name
    if mask is None or masks.view is None:
        return mask
    full, target = masks.view  # a [batch, heads, S, T] mask for [batch*heads, 1, S, T] scores
    mshape = graph.types[mask].shape
    if len(mshape) >= 2 and mshape[-2] == 1:  # a key mask stays one row
        full, target = (*full[:-2], 1, full[-1]), (*target[:-2], 1, target[-1])
    if mshape != full:
        mask = graph.insert_before(anchor, BroadcastTo(full), [mask], f"{anchor}_mask_full").name
    return graph.insert_before(anchor, Reshape(target), [mask], f"{anchor}_mask_rows").name


def _to_pv_layout(graph: Graph, m: AttentionMatch, y: str) -> str:
    """The op's ``[B, Hq, Sq, E]`` output back in the PV einsum's layout: ``[batch..., rows..., E]``, then its order."""
    r, pv, anchor = m.roles, m.values, m.values.pv.name
    natural = r.batch + (pv.pv_rows or r.rows) + pv.e
    full = tuple(r.sizes[c] for c in natural)
    if graph.types[y].shape != full:
        y = graph.insert_before(anchor, Reshape(full), [y], f"{anchor}_unfused").name
    perm = tuple(natural.index(c) for c in pv.out_term)
    if perm != tuple(range(len(perm))):
        y = graph.insert_before(anchor, Transpose(perm), [y], f"{anchor}_unfused").name
    return y


def _describe(m: AttentionMatch, scale: float) -> str:
    """What the rule recognised, for the trace."""
    parts = [f"scale={scale:g}", f"group={m.group}", m.visibility.describe(m.masks.values())]
    if m.softcap is not None:
        parts.append(f"softcap {m.softcap:g}")
    if m.cache:
        parts.append("KV cache " + ", ".join(m.cache.past))
    return ", ".join(parts)


FUSE_ATTENTION_RULE = Rule("fuse_attention", (Softmax,), _match, _rewrite)

fuse_attention = RewritePass(
    "fuse_attention",
    "recognise softmax(scale * QK^T + masks) V (repeated, grouped or folded, any axis order) as one Attention op",
    [FILL_FIRST_RULE, FUSE_ATTENTION_RULE],
)
