"""What an attention mask built from positions means: causal offset, sliding window and the rest.

Exporters hand attention one additive mask, ``Where(keep, 0, fill)``, where
``keep`` is a conjunction (``And``, imported as ``Where(a, b, False)``) of
comparisons of key positions with query positions (the causal triangle and a
sliding window's lower edge) and of whatever else the model masks (padding,
from ``attention_mask``).  :func:`split_additive_mask` reads that structure
back: each comparison of ``j + a`` (key positions along the scores' last axis)
with ``i + b`` (query positions along the one before) is a half-plane
``j <= i + u`` or ``j >= i + l``; one upper bound is the causal offset, one
lower bound the window, and the other conjuncts stay a bool mask (an encoder's
padding mask alone becomes that bool mask).

``fill`` is ``-inf`` or a finite number at most :data:`FILL_LIMIT` (``finfo(dtype).min`` of float32 or bfloat16).
With a finite fill a row whose every key is hidden does not give zeros: every one of its scores becomes the fill, so its softmax
is uniform over all keys; the split records that as ``empty_rows="mean"``.

Each exporter idiom is a :class:`~graphc.optimizer.patterns.Pat` with named bindings below (in the way onnxscript's
``ort_fusions`` read a causal mask), checked and turned into a :class:`MaskSplit` by a small function beside it; only the
position arithmetic (``j + c`` along an axis, :func:`_positions`) walks producers by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from graphc.dims import Dim, dim_add, dim_is_nonnegative, dim_sub, normalize_dim
from graphc.graph import Graph, Node
from graphc.numerics import FILL_LIMIT, hides_keys
from graphc.ops import FLOAT_DTYPES, Binary, Cast, Compare, Concat, Reshape, Unary, Where
from graphc.rotary import Positions
from graphc.tensor_ops import Arange, BroadcastTo, ShapeValues
from graphc.visibility import KeyBound, Visibility

from .patterns import Bindings, Pat, one_element

__all__ = ["MaskSplit", "split_additive_mask", "split_bool_mask", "split_masked_bias", "FILL_LIMIT"]


@dataclass(frozen=True)
class MaskSplit:
    """An additive mask read as a :class:`Visibility` (its causal offset and window, a bool mask when bool values remain,
    what empty rows give) and those bool values."""

    visibility: Visibility
    keep: tuple[str, ...] = ()  # bool values still to AND (padding); empty when the positions say it all
    hide: str | None = None  # a bool value whose True hides a key besides the positions (transformers' padding before 4.58)

    @staticmethod
    def of(bounds: list[KeyBound], finite_fill: bool, keep: tuple[str, ...] = (), hide: str | None = None) -> MaskSplit | None:
        """The split of a mask that keeps ``bounds`` and ``keep`` (and hides ``hide``), filled with a finite fill or -inf
        (:meth:`Visibility.filled`)."""
        vis = Visibility.from_bounds(bounds, "bool" if keep or hide is not None else "none")
        return None if vis is None else MaskSplit(vis, keep, hide).filled(finite_fill)

    def filled(self, finite_fill: bool) -> MaskSplit:
        """This split under a finite fill (``True``) or ``-inf``: what a row with no visible key then gives."""
        return replace(self, visibility=self.visibility.filled(finite_fill))


# ------------------------------------------------------------------ constants and leaves


def _is_zero(arr: np.ndarray) -> bool:
    return str(arr.dtype) in FLOAT_DTYPES and float(arr) == 0.0


def _is_finite_fill(arr: np.ndarray) -> bool:
    return hides_keys(arr) and bool(np.isfinite(arr))


def _is_bool(graph: Graph, value: str) -> bool:
    return graph.types[value].dtype == "bool"


def _is_float(graph: Graph, value: str) -> bool:
    return str(graph.types[value].dtype) in FLOAT_DTYPES


def _is_zero_array(graph: Graph, value: str) -> bool:
    """A constant of zeros (any shape): the past's block of a mask every query sees."""
    if not graph.is_constant(value):
        return False
    arr = graph.initializers[value]
    return str(arr.dtype) in FLOAT_DTYPES and arr.size > 0 and not np.any(arr)


ZERO = Pat.const(where=_is_zero)
"""A float 0."""
FILL = Pat.const("fill", where=hides_keys)
"""A fill that hides a key it is added to (:func:`graphc.numerics.hides_keys`): ``-inf``, ``finfo.min``."""
FINITE_FILL = Pat.const("fill", where=_is_finite_fill)
FALSE = Pat.const(where=lambda a: a.dtype == np.bool_ and not bool(a))
TRUE = Pat.const(where=lambda a: a.dtype == np.bool_ and bool(a))


def _binary(fn: str, *inputs: Pat, name: str | None = None, commutative: bool = False) -> Pat:
    return Pat.op(Binary, where=lambda op: op.fn == fn, inputs=inputs, name=name, commutative=commutative)


def _last_axis_concat(graph: Graph, node: Node) -> bool:
    rank = graph.types[node.name].rank
    return len(node.inputs) == 2 and node.op_as(Concat).axis % rank == rank - 1


def _adds_unit_axes(graph: Graph, node: Node) -> bool:
    """``node`` is a ``BroadcastTo``, or a ``Reshape`` that only puts axes of size 1 in front (``[S, T] -> [1, 1, S, T]``)."""
    if isinstance(node.op, BroadcastTo):
        return True
    src, dst = graph.types[node.inputs[0]].shape, graph.types[node.name].shape
    return len(dst) >= len(src) and dst[len(dst) - len(src) :] == src and all(d == 1 for d in dst[: len(dst) - len(src)])


# ------------------------------------------------------------------ the idioms, as patterns

AND = Pat.op(Where, inputs=(Pat.var("a"), Pat.var("b"), FALSE))
"""``a and b``: ``Where(a, b, False)`` (an imported ``And``)."""
OR = Pat.op(Where, inputs=(Pat.var("a"), TRUE, Pat.var("b")))
"""``a or b``: ``Where(a, True, b)`` (an imported ``Or``)."""
NOT = Pat.any(
    Pat.op(Where, inputs=(Pat.var("k"), FALSE, TRUE), check=lambda g, n: g.types[n.name].dtype == "bool"),  # an imported Not
    Pat.op(  # MPT's mask.bool() of an additive mask: Cast(Where(k, 0, x), bool) with x a nonzero constant
        Cast,
        where=lambda op: op.dtype == "bool",
        inputs=(Pat.op(Where, inputs=(Pat.var("k", _is_bool), Pat.const(where=lambda a: float(a) == 0), Pat.const(where=lambda a: float(a) != 0))),),
    ),
)
"""``not k``."""
COMPARE = Pat.op(Compare, where=lambda op: op.fn != "equal", name="compare", inputs=(Pat.var("a"), Pat.var("b")))
"""A comparison of key positions with query positions (:func:`_half_plane`)."""
DIFFERENCE = _binary("sub", Pat.var("x"), Pat.var("y"))
"""``x - y``: a Trilu's ``cols - rows``."""
ABS_BAND = Pat.op(
    Compare,
    where=lambda op: op.fn in ("less_equal", "less"),
    name="compare",
    inputs=(Pat.op(Unary, where=lambda op: op.fn == "abs", inputs=(DIFFERENCE,)), Pat.var("c")),
)
"""``|x - y| <= c`` of key and query positions: a band of keys around each query (ModernBERT's local attention)."""
SHAPE_DIM = Pat.op(ShapeValues, where=lambda op: len(op.values) == 1, name="shape")
"""One run-time dim."""
KEEP_MASK = Pat.op(Where, inputs=(Pat.var("keep"), ZERO, FILL))
"""``Where(keep, 0, fill)``: the exporters' additive mask, ``keep`` a conjunction of half-planes and padding."""
HIDE_MASK = Pat.op(Where, inputs=(Pat.var("hide"), FILL, ZERO))
"""``Where(hide, fill, 0)``: graphc's own export, ``hide`` a disjunction of half-planes (or the negation of a keep)."""
CAUSAL_PRODUCT = Pat.through(
    (BroadcastTo, Reshape),
    _binary(
        "mul",
        Pat.op(Cast, inputs=(Pat.var("first"),)),
        Pat.op(Where, inputs=(Pat.var("second"), FINITE_FILL, ZERO)),
        commutative=True,
    ),
)
"""transformers' causal mask before 4.58: ``Cast(j >= i + l1) * Where(j >= i + l2, fill, 0)`` (a finite fill: ``0 * -inf``
would be NaN), seen through its expansions."""
PADDED_EQUAL = Pat.any(
    Pat.op(Compare, where=lambda op: op.fn == "equal", inputs=(_binary("add", Pat.var(), Pat.var(), name="total"), ZERO)), name="equal"
)
"""``C + pad == 0``: where the causal product ``C`` keeps a key and the attention mask is 0 (a padded key)."""
OLD_TRANSFORMERS_MASK = Pat.any(
    Pat.op(Where, inputs=(PADDED_EQUAL, FILL, Pat.var("causal"))),
    _binary("add", Pat.var("causal"), Pat.op(Where, inputs=(PADDED_EQUAL, FILL, ZERO)), commutative=True),
)
"""transformers' mask before 4.58 (optimum's files): ``Where(C + pad == 0, fill, C)``, or ``C + Where(C + pad == 0, fill,
0)`` once the fill is moved out."""
ZERO_BLOCK = Pat.through((BroadcastTo,), Pat.var(check=_is_zero_array))
"""A block of zeros (broadcast or not)."""
PAST_BLOCK = Pat.op(Concat, name="concat", check=_last_axis_concat, inputs=(ZERO_BLOCK, Pat.var("rest")))
"""``Concat(zeros[.., P], c)`` along the keys: the past visible to every query, then the mask ``c``."""
_FILLED_HIDE = Pat.op(Where, inputs=(Pat.var("hide"), Pat.var("fill"), ZERO))
HIDDEN_BESIDE = (
    _binary("add", _FILLED_HIDE, Pat.var("positions")),
    _binary("add", Pat.var("positions"), _FILLED_HIDE),
    Pat.op(Where, inputs=(Pat.var("hide"), Pat.var("fill"), Pat.var("positions", lambda g, v: not _is_zero_value(g, v)))),
)
"""A bool ``hide`` filled over a position mask: ``c + Where(hide, fill, 0)`` (graphc's reading of the next) or
``Where(hide, fill, c)``."""
FLOAT_MASK_HIDDEN = Pat.op(Where, inputs=(Pat.op(Cast, where=lambda op: op.dtype == "bool", inputs=(Pat.var("m", _is_float),)), FINITE_FILL, ZERO))
"""``Where(Cast(m, bool), fill, 0)``: hidden where the float mask ``m`` (zeros and a finite fill) is nonzero."""
MASKED_BIAS = Pat.op(Where, inputs=(Pat.var("keep", _is_bool), Pat.var("bias", _is_float), FILL))
"""T5's decoder: its relative-position bias where the causal mask keeps a key, the fill elsewhere."""
MASK_VALUE = Pat.through((BroadcastTo, Reshape), Pat.var("mask"), check=_adds_unit_axes)
"""A mask as the scores take it, expanded or viewed with unit axes in front."""


def _is_zero_value(graph: Graph, value: str) -> bool:
    arr = one_element(graph, value)
    return arr is not None and _is_zero(arr)


def _match(pat: Pat, graph: Graph, value: str) -> Bindings | None:
    got = pat.match(graph, value)
    return got if isinstance(got, dict) else None


# ------------------------------------------------------------------ positions


def _dim_scalar(graph: Graph, value: str) -> Dim | None:
    """An integer constant or one run-time dim (``ShapeValues`` of one value) as a dim."""
    arr = one_element(graph, value)
    if arr is not None:
        return int(arr) if arr.dtype.kind in "iu" else None
    b = _match(SHAPE_DIM, graph, value)
    return normalize_dim(b["shape"].op.values[0]) if b else None


def _positions(graph: Graph, value: str, depth: int = 0) -> tuple[int, Dim] | None:
    """``(axis, c)`` when ``value[..., n, ...] == n + c`` along axis ``axis`` (counted from the end) and every other axis has size 1."""
    node = graph.producer(value)
    if node is None or depth > 12:
        return None
    op: Any = node.op
    if isinstance(op, (Positions, Arange)):
        return -1, op.offset if isinstance(op, Positions) else op.start
    if isinstance(op, Cast) and op.dtype in ("int64", "int32"):
        return _positions(graph, node.inputs[0], depth + 1)
    if isinstance(op, Reshape):
        inner = _positions(graph, node.inputs[0], depth + 1)
        shape = graph.types[value].shape
        big = [i for i, d in enumerate(shape) if d != 1]
        if inner is None or len(big) != 1 or shape[big[0]] != graph.types[node.inputs[0]].shape[inner[0]]:
            return None
        return big[0] - len(shape), inner[1]
    if isinstance(op, Binary) and op.fn in ("add", "sub"):
        for pos in (0, 1) if op.fn == "add" else (0,):
            inner, c = _positions(graph, node.inputs[pos], depth + 1), _dim_scalar(graph, node.inputs[1 - pos])
            if inner is not None and c is not None:
                return inner[0], dim_add(inner[1], c) if op.fn == "add" else dim_sub(inner[1], c)
    return None


_FLIP = {"less": "greater", "less_equal": "greater_equal", "greater": "less", "greater_equal": "less_equal"}


def _half_plane(graph: Graph, value: str) -> KeyBound | None:
    """The :class:`KeyBound` a bool ``j <= i + u`` or ``j >= i + l`` keeps (``j`` keys on axis -1, ``i`` queries
    on -2), seen through its expansions; also ``x - y <op> c`` (a Trilu's mask), which is ``x <op> y + c``."""
    b = _match(COMPARE, graph, _unexpanded(graph, value))
    if b is None:
        return None
    a, q = _positions(graph, b["a"]), _positions(graph, b["b"])
    diff, c = _match(DIFFERENCE, graph, b["a"]), _dim_scalar(graph, b["b"])
    if diff is not None and c is not None:
        x, y = _positions(graph, diff["x"]), _positions(graph, diff["y"])
        if x is not None and y is not None:
            a, q = x, (y[0], dim_add(y[1], c))
    if a is None or q is None:
        return None
    fn = b["compare"].op.fn
    if (a[0], q[0]) == (-2, -1):  # query op key: flip to key op query
        a, q, fn = q, a, _FLIP[fn]
    if (a[0], q[0]) != (-1, -2):
        return None
    d = dim_sub(q[1], a[1])  # j + a <op> i + b  <=>  j <op> i + d
    return {
        "less_equal": KeyBound(True, d),
        "less": KeyBound(True, dim_sub(d, 1)),
        "greater_equal": KeyBound(False, d),
        "greater": KeyBound(False, dim_add(d, 1)),
    }[fn]


def _band(graph: Graph, value: str) -> list[KeyBound] | None:
    """The two :class:`KeyBound` s of :data:`ABS_BAND`: ``|(j + a) - (i + b)| <= c`` keeps ``i + d - c <= j <= i + d + c``
    with ``d = b - a`` (``c - 1`` for ``<``)."""
    b = _match(ABS_BAND, graph, _unexpanded(graph, value))
    if b is None:
        return None
    c, x, y = _dim_scalar(graph, b["c"]), _positions(graph, b["x"]), _positions(graph, b["y"])
    if c is None or x is None or y is None or {x[0], y[0]} != {-1, -2}:
        return None
    key, query = (x, y) if x[0] == -1 else (y, x)
    d, w = dim_sub(query[1], key[1]), c if b["compare"].op.fn == "less_equal" else dim_sub(c, 1)
    return [KeyBound(True, dim_add(d, w)), KeyBound(False, dim_sub(d, w))]


# ------------------------------------------------------------------ conjunctions


def _unexpanded(graph: Graph, value: str) -> str:
    """``value`` before the expansions (``BroadcastTo``, unit axes in front) that do not change which key a query sees."""
    b = _match(MASK_VALUE, graph, value)
    return b["mask"] if b is not None else value


def _conjuncts(graph: Graph, value: str, out: list[str], depth: int = 0) -> None:
    """Flatten ``And`` (``Where(a, b, False)``, ``Where(True, b, False)``) into its conjuncts (through expansions)."""
    b = _match(AND, graph, _unexpanded(graph, value)) if depth < 16 else None
    if b is None:
        out.append(value)
        return
    yes = one_element(graph, b["b"])
    if yes is None or not (yes.dtype == np.bool_ and bool(yes)):
        _conjuncts(graph, b["b"], out, depth + 1)
    cond = one_element(graph, b["a"])
    if cond is None or not bool(cond):
        _conjuncts(graph, b["a"], out, depth + 1)


def _disjuncts(graph: Graph, value: str, out: list[str], depth: int = 0) -> None:
    """Flatten ``Or`` (``Where(a, True, b)``) into its disjuncts."""
    b = _match(OR, graph, value) if depth < 16 else None
    if b is None:
        out.append(value)
        return
    _disjuncts(graph, b["a"], out, depth + 1)
    _disjuncts(graph, b["b"], out, depth + 1)


def _read_conjuncts(graph: Graph, parts: list[str]) -> tuple[list[KeyBound], list[str]]:
    """The key bounds among conjuncts ``parts`` (a half-plane, or a band's two) and the conjuncts that are neither."""
    bounds: list[KeyBound] = []
    rest: list[str] = []
    for p in parts:
        plane = _half_plane(graph, p)
        found = [plane] if plane is not None else _band(graph, p)
        bounds += found or []
        rest += [] if found else [p]
    return bounds, rest


def _planes(graph: Graph, value: str) -> tuple[list[KeyBound], list[str], np.ndarray] | None:
    """The half-planes a ``Where`` mask keeps, its other bool conjuncts and its fill: :data:`KEEP_MASK` with ``keep`` a
    conjunction, or :data:`HIDE_MASK` with ``hide`` a disjunction of half-planes (graphc's own export: ``j > i +
    offset``, or before the window), each negated into what it keeps."""
    b = _match(KEEP_MASK, graph, value)
    if b is not None:
        parts: list[str] = []
        _conjuncts(graph, b["keep"], parts)
        bounds, rest = _read_conjuncts(graph, parts)
        return bounds, rest, b["fill"]
    b = _match(HIDE_MASK, graph, value)
    if b is None:
        return None
    hidden: list[str] = []
    _disjuncts(graph, b["hide"], hidden)
    found = [_half_plane(graph, p) for p in hidden]
    negations = [_match(NOT, graph, p) for p, pl in zip(hidden, found) if pl is None]
    if any(n is None for n in negations):
        return None  # hiding by anything else would need its negation as a bool mask
    conjuncts: list[str] = []  # ``not (a and b)`` hides: a and b keep (MPT's hide, the negation of the causal & padding keep)
    for n in negations:
        if n is not None:
            _conjuncts(graph, n["k"], conjuncts)
    kept, rest = _read_conjuncts(graph, conjuncts)
    return [pl.complement() for pl in found if pl] + kept, rest, b["fill"]


def split_bool_mask(graph: Graph, keep: str) -> tuple[list[KeyBound], tuple[str, ...]] | None:
    """A bool keep-mask (``Where(keep, scores, fill)``) read as the half-planes among its conjuncts and the other
    conjuncts (padding): an index grid's ``j <= i`` (a decoder's causal mask written without an attention mask, as
    dynamo writes BART's and Whisper's) is a causal bound.  ``None`` when no conjunct is a half-plane."""
    parts: list[str] = []
    _conjuncts(graph, keep, parts)
    bounds, rest = _read_conjuncts(graph, parts)
    return (bounds, tuple(rest)) if bounds else None


def split_masked_bias(graph: Graph, value: str) -> tuple[MaskSplit, str] | None:
    """:data:`MASKED_BIAS` added to the scores, read as ``(the split of its keep-mask, the bias)``: the op's additive
    term is the bias, its causal offset and window come from the keep-mask's half-planes, the other conjuncts hide keys
    beside them.  ``None`` when ``value`` is not that form or its keep-mask holds no half-plane."""
    b = _match(MASKED_BIAS, graph, _unexpanded(graph, value))
    if b is None or graph.is_constant(b["bias"]):
        return None
    found = split_bool_mask(graph, b["keep"])
    split = None if found is None else MaskSplit.of(found[0], bool(np.all(np.isfinite(b["fill"]))), found[1])
    return None if split is None else (split, b["bias"])


# ------------------------------------------------------------------ transformers' older masks


def _hidden_product(graph: Graph, value: str) -> tuple[KeyBound, np.ndarray] | None:
    """``(the bound it keeps, fill)`` for :data:`CAUSAL_PRODUCT`, which hides exactly the keys ``j >= i + l`` with
    ``l = max(l1, l2)``, so keeps ``j <= i + l - 1``."""
    b = _match(CAUSAL_PRODUCT, graph, value)
    if b is None:
        return None
    first, second = _half_plane(graph, b["first"]), _half_plane(graph, b["second"])
    if first is None or second is None or first.upper or second.upper:
        return None
    if dim_is_nonnegative(dim_sub(first.at, second.at)):  # hidden: j >= i + l for the larger l; kept: its complement
        return first.complement(), b["fill"]
    if dim_is_nonnegative(dim_sub(second.at, first.at)):
        return second.complement(), b["fill"]
    return None


def _old_transformers_mask(graph: Graph, value: str) -> MaskSplit | None:
    """:data:`OLD_TRANSFORMERS_MASK`: the causal product ``C`` (:func:`_hidden_product`) with its padded keys filled in
    place.  ``C + pad == 0`` holds where ``C`` keeps a key and the attention mask is 0: the keys it hides besides the
    causal ones (where ``C`` hides, ``fill + pad`` is not 0)."""
    b = _match(OLD_TRANSFORMERS_MASK, graph, value)
    if b is None or b["causal"] not in b["total"].inputs:
        return None
    found = _hidden_product(graph, b["causal"])
    return None if found is None else MaskSplit.of([found[0]], True, hide=b["equal"])


# ------------------------------------------------------------------ masks nested in masks


def _nested_mask(graph: Graph, value: str, depth: int) -> MaskSplit | None:
    """The masks transformers 4.x's ``AttentionMaskConverter`` writes (MPT's optimum file), read through what they nest:

    - :data:`PAST_BLOCK`: the inner mask's causal offset moved by the past's length;
    - :data:`HIDDEN_BESIDE`: the position mask's causal offset, ``hide`` besides it;
    - :data:`FLOAT_MASK_HIDDEN`: hidden where the float mask ``m`` is nonzero, ``m``'s split."""
    if depth > 8:
        return None
    b = _match(PAST_BLOCK, graph, value)
    if b is not None:
        inner = split_additive_mask(graph, b["rest"], depth + 1)
        if inner is None or not inner.visibility.is_causal:
            return None
        return replace(inner, visibility=inner.visibility.shifted(graph.types[b["concat"].inputs[0]].shape[-1]))
    for pat in HIDDEN_BESIDE:
        b = _match(pat, graph, value)
        found = None if b is None else _hidden_beside(graph, b["hide"], b["fill"], b["positions"], depth)
        if found is not None:
            return found
    b = _match(FLOAT_MASK_HIDDEN, graph, value)
    inner = None if b is None else split_additive_mask(graph, b["m"], depth + 1)
    return None if inner is None else inner.filled(True)  # this fill is finite


def _hidden_beside(graph: Graph, hide: str, fill: str, positions: str, depth: int) -> MaskSplit | None:
    """A bool ``hide`` (not a half-plane) filled with a finite ``fill`` over a position mask ``positions``."""
    f = one_element(graph, fill)
    if f is None or not _is_finite_fill(f) or not _is_bool(graph, hide) or _half_plane(graph, hide) is not None:
        return None
    if graph.is_constant(positions) or not _is_float(graph, positions):
        return None
    inner = split_additive_mask(graph, positions, depth + 1)
    if inner is None or not inner.visibility.is_causal or inner.visibility.has_mask:
        return None
    return MaskSplit(replace(inner.visibility, mask="bool", empty_rows="mean"), hide=hide)


# ------------------------------------------------------------------ the reader


def split_additive_mask(graph: Graph, mask: str, depth: int = 0) -> MaskSplit | None:
    """Read ``mask`` (added to the scores) as :class:`MaskSplit`, or ``None`` when it is none of the idioms above.

    ``keep`` may hold one causal bound (and one window edge with it) and any other bool conjuncts; without a causal
    bound it is a plain bool mask (BERT's padding)."""
    value = _unexpanded(graph, mask)
    if graph.producer(value) is None:
        return None
    found = _old_transformers_mask(graph, value) or _nested_mask(graph, value, depth)
    if found is not None:
        return found
    causal = _hidden_product(graph, mask)
    if causal is not None:  # the causal product alone (no padding); its fill is finite
        return MaskSplit.of([causal[0]], True)
    planes = _planes(graph, value)
    if planes is None or not (planes[0] or planes[1]):
        return None
    bounds, rest, fill = planes
    return MaskSplit.of(bounds, bool(np.isfinite(fill)), tuple(rest))
