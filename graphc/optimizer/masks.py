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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeGuard

import numpy as np

from graphc.dims import Dim, dim_add, dim_is_nonnegative, dim_sub, normalize_dim
from graphc.graph import Graph, Node
from graphc.numerics import FILL_LIMIT, hides_keys
from graphc.visibility import KeyBound, Visibility
from graphc.ops import FLOAT_DTYPES, Binary, Cast, Compare, Concat, Reshape, Where
from graphc.rotary import Positions
from graphc.tensor_ops import Arange, BroadcastTo, ShapeValues

__all__ = ["MaskSplit", "split_additive_mask", "FILL_LIMIT"]



@dataclass(frozen=True)
class MaskSplit:
    """An additive mask read as a :class:`Visibility` (its causal offset and window, a bool mask when bool values remain,
    what empty rows give) and those bool values."""

    visibility: Visibility
    keep: tuple[str, ...] = ()  # bool values still to AND (padding); empty when the positions say it all
    hide: str | None = None  # a bool value whose True hides a key besides the positions (transformers' padding before 4.58)

    @staticmethod
    def of(bounds: list[KeyBound], finite_fill: bool, keep: tuple[str, ...] = (), hide: str | None = None) -> MaskSplit | None:
        """The split of a mask that keeps ``bounds`` and ``keep`` (and hides ``hide``), filled with a finite fill or -inf:
        under a finite fill a row with no visible key gives the mean of V wherever some row may see none (another mask
        besides the positions, no causal bound, or one that may be negative), else zeros."""
        vis = Visibility.from_bounds(bounds, "bool" if keep or hide is not None else "none")
        return None if vis is None else MaskSplit(vis, keep, hide).filled(finite_fill)

    def filled(self, finite_fill: bool) -> MaskSplit:
        """This split under a finite fill (``True``) or ``-inf``: what a row with no visible key then gives."""
        vis = self.visibility
        mean = finite_fill and (vis.may_hide_whole_rows() or not vis.is_causal)
        return replace(self, visibility=replace(vis, empty_rows="mean" if mean else "zero"))


def _scalar(graph: Graph, value: str) -> np.ndarray | None:
    """A one-element constant; seen through a widening ``Cast`` of one (a float16 model's mask values, widened where it
    computes in float32), in its own dtype: a float16 fill stays float16's ``finfo.min``."""
    node = graph.producer(value)
    if node is not None and isinstance(node.op, Cast) and node.op.dtype in FLOAT_DTYPES and graph.is_constant(node.inputs[0]):
        arr = graph.initializers[node.inputs[0]]
        return arr.reshape(()) if arr.size == 1 and str(arr.dtype) in FLOAT_DTYPES else None
    if graph.is_constant(value):
        arr = graph.initializers[value]
        return arr.reshape(()) if arr.size == 1 else None
    return None


def _dim_scalar(graph: Graph, value: str) -> Dim | None:
    """An integer constant or one run-time dim (``ShapeValues`` of one value) as a dim."""
    arr = _scalar(graph, value)
    if arr is not None:
        return int(arr) if arr.dtype.kind in "iu" else None
    node = graph.producer(value)
    if node is not None and isinstance(node.op, ShapeValues) and len(node.op.values) == 1:
        return normalize_dim(node.op.values[0])
    return None


def _positions(graph: Graph, value: str, depth: int = 0) -> tuple[int, Dim] | None:
    """``(axis, c)`` when ``value[..., n, ...] == n + c`` along axis ``axis`` (counted from the end) and every other axis has size 1."""
    node = graph.producer(value)
    if node is None or depth > 12:
        return None
    op = node.op
    if isinstance(op, Positions):
        return -1, op.offset
    if isinstance(op, Arange):
        return -1, op.start
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


def _difference(graph: Graph, value: str) -> tuple[tuple[int, Dim], tuple[int, Dim]] | None:
    """The position operands ``(x, y)`` of ``value = x - y`` (a Trilu's ``cols - rows``)."""
    node = graph.producer(value)
    if node is None or not isinstance(node.op, Binary) or node.op.fn != "sub":
        return None
    a, b = (_positions(graph, x) for x in node.inputs)
    return None if a is None or b is None else (a, b)


def _half_plane(graph: Graph, value: str) -> KeyBound | None:
    """The :class:`KeyBound` a bool ``j <= i + u`` or ``j >= i + l`` keeps (``j`` keys on axis -1, ``i`` queries
    on -2); also ``x - y <op> c`` (a Trilu's mask), which is ``x <op> y + c``."""
    node = graph.producer(value)
    if node is None or not isinstance(node.op, Compare) or node.op.fn == "equal":
        return None
    a, b = (_positions(graph, x) for x in node.inputs)
    diff, c = _difference(graph, node.inputs[0]), _dim_scalar(graph, node.inputs[1])
    if diff is not None and c is not None:
        a, b = diff[0], (diff[1][0], dim_add(diff[1][1], c))
    if a is None or b is None:
        return None
    fn = node.op.fn
    if (a[0], b[0]) == (-2, -1):  # query op key: flip to key op query
        a, b, fn = b, a, _FLIP[fn]
    if (a[0], b[0]) != (-1, -2):
        return None
    d = dim_sub(b[1], a[1])  # j + a <op> i + b  <=>  j <op> i + d
    return {
        "less_equal": KeyBound(True, d),
        "less": KeyBound(True, dim_sub(d, 1)),
        "greater_equal": KeyBound(False, d),
        "greater": KeyBound(False, dim_add(d, 1)),
    }[fn]


def _conjuncts(graph: Graph, value: str, out: list[str], depth: int = 0) -> None:
    """Flatten ``And`` (``Where(a, b, False)``, ``Where(True, b, False)``) into its conjuncts."""
    node = graph.producer(value)
    if node is not None and isinstance(node.op, Where) and depth < 16:
        c, x, y = node.inputs
        no, yes = _scalar(graph, y), _scalar(graph, x)
        if no is not None and no.dtype == np.bool_ and not bool(no):
            if yes is None or not (yes.dtype == np.bool_ and bool(yes)):
                _conjuncts(graph, x, out, depth + 1)
            cond = _scalar(graph, c)
            if cond is None or not bool(cond):
                _conjuncts(graph, c, out, depth + 1)
            return
    out.append(value)


def _disjuncts(graph: Graph, value: str, out: list[str], depth: int = 0) -> None:
    """Flatten ``Or`` (``Where(a, True, b)``) into its disjuncts."""
    node = graph.producer(value)
    if node is not None and isinstance(node.op, Where) and depth < 16:
        c, x, y = node.inputs
        yes = _scalar(graph, x)
        if yes is not None and yes.dtype == np.bool_ and bool(yes):
            _disjuncts(graph, c, out, depth + 1)
            _disjuncts(graph, y, out, depth + 1)
            return
    out.append(value)


def _negation(graph: Graph, value: str) -> str | None:
    """``k`` where ``value`` is ``not k``, written ``Where(k, False, True)`` (an imported ``Not``) or
    ``Cast(Where(k, 0, x), bool)`` with ``x`` a nonzero constant (MPT's ``mask.bool()`` of an additive mask), else None."""
    node = graph.producer(value)
    if node is not None and isinstance(node.op, Cast) and node.op.dtype == "bool":
        where = graph.producer(node.inputs[0])
        if where is None or not isinstance(where.op, Where) or graph.types[where.inputs[0]].dtype != "bool":
            return None
        zero, other = _scalar(graph, where.inputs[1]), _scalar(graph, where.inputs[2])
        return where.inputs[0] if zero is not None and other is not None and float(zero) == 0 and float(other) != 0 else None
    if node is None or not isinstance(node.op, Where) or graph.types[value].dtype != "bool":
        return None
    t, f = _scalar(graph, node.inputs[1]), _scalar(graph, node.inputs[2])
    if t is None or f is None or t.dtype != bool or f.dtype != bool:
        return None
    return node.inputs[0] if not t and f else None


def _is_zero(arr: np.ndarray | None) -> bool:
    return arr is not None and str(arr.dtype) in FLOAT_DTYPES and float(arr) == 0.0


def _is_fill(arr: np.ndarray | None) -> TypeGuard[np.ndarray]:
    """A float scalar that hides a key it is added to (:func:`graphc.numerics.hides_keys`): ``-inf``, at most
    :data:`FILL_LIMIT`, or float16's -65504 held as float16 (:func:`_scalar` sees it through the ``Cast`` that widens a
    float16 model's mask where graphc computes in float32): in the file's float16 arithmetic its sum with any score
    under 16 in size is the fill again, so a row it hides whole is uniform (``empty_rows="mean"``)."""
    return arr is not None and hides_keys(arr)


def _planes(graph: Graph, node: Node) -> tuple[list[KeyBound], list[str], np.ndarray] | None:
    """The half-planes a ``Where`` mask keeps, its other bool conjuncts and its fill: ``Where(keep, 0, fill)`` with
    ``keep`` a conjunction, or ``Where(hide, fill, 0)`` with ``hide`` a disjunction of half-planes (graphc's own
    export: ``j > i + offset``, or before the window), each negated into what it keeps."""
    cond, x, y = node.inputs
    vx, vy = _scalar(graph, x), _scalar(graph, y)
    if _is_zero(vx) and _is_fill(vy):
        parts: list[str] = []
        _conjuncts(graph, cond, parts)
        planes = [(p, _half_plane(graph, p)) for p in parts]
        return [pl for _, pl in planes if pl is not None], [p for p, pl in planes if pl is None], vy
    if _is_zero(vy) and _is_fill(vx):
        hidden: list[str] = []
        _disjuncts(graph, cond, hidden)
        found = [_half_plane(graph, p) for p in hidden]
        kept = [_negation(graph, p) for p, pl in zip(hidden, found) if pl is None]
        if any(k is None for k in kept):
            return None  # hiding by anything else would need its negation as a bool mask
        negated = [pl.complement() for pl in found if pl]
        conjuncts: list[str] = []  # ``not (a and b)`` hides: a and b keep (MPT's hide, the negation of the causal & padding keep)
        for k in kept:
            if k is not None:
                _conjuncts(graph, k, conjuncts)
        kept_planes = [(p, _half_plane(graph, p)) for p in conjuncts]
        return negated + [pl for _, pl in kept_planes if pl is not None], [p for p, pl in kept_planes if pl is None], vx
    return None


def _producer_through_broadcasts(graph: Graph, value: str) -> Node | None:
    node = graph.producer(value)
    while node is not None and isinstance(node.op, (BroadcastTo, Reshape)):
        node = graph.producer(node.inputs[0])
    return node


def _hidden_product(graph: Graph, value: str) -> tuple[KeyBound, np.ndarray] | None:
    """``(the bound it keeps, fill)`` when ``value`` (through reshapes and broadcasts) is ``Cast(j >= i + l1) * Where(j >= i + l2, fill, 0)``
    (transformers' causal mask before 4.58: a Trilu of the fill, times the keys after each query's position), which
    hides exactly the keys ``j >= i + l`` with ``l = max(l1, l2)`` (a finite fill: ``0 * -inf`` would be NaN)."""
    node = _producer_through_broadcasts(graph, value)
    if node is None or not isinstance(node.op, Binary) or node.op.fn != "mul":
        return None
    for cast_at in (0, 1):
        cast, where = graph.producer(node.inputs[cast_at]), graph.producer(node.inputs[1 - cast_at])
        if cast is None or where is None or not isinstance(cast.op, Cast) or not isinstance(where.op, Where):
            continue
        first, fill, zero = _half_plane(graph, cast.inputs[0]), _scalar(graph, where.inputs[1]), _scalar(graph, where.inputs[2])
        second = _half_plane(graph, where.inputs[0])
        if first is None or second is None or first.upper or second.upper or not _is_fill(fill) or not _is_zero(zero):
            continue
        if not np.isfinite(fill):  # 0 * -inf is NaN: the product is a mask only for a finite fill
            continue
        if dim_is_nonnegative(dim_sub(first.at, second.at)):  # hidden: j >= i + l for the larger l; kept: its complement
            return first.complement(), fill
        if dim_is_nonnegative(dim_sub(second.at, first.at)):
            return second.complement(), fill
    return None


def _old_transformers_mask(graph: Graph, node: Node) -> MaskSplit | None:
    """transformers' mask before 4.58 (optimum's files): the causal product ``C`` (:func:`_hidden_product`), its padded
    keys filled in place: ``Where(C + pad == 0, fill, C)``, or ``C + Where(C + pad == 0, fill, 0)`` once the fill is
    moved out.  ``C + pad == 0`` holds where ``C`` keeps a key (0) and the attention mask is 0: the keys it hides
    besides the causal ones (where ``C`` hides, ``fill + pad`` is not 0)."""
    if isinstance(node.op, Where):
        equal, fill, causal = node.inputs
    elif isinstance(node.op, Binary) and node.op.fn == "add":
        for at in (0, 1):
            inner = graph.producer(node.inputs[1 - at])
            if inner is not None and isinstance(inner.op, Where) and _is_zero(_scalar(graph, inner.inputs[2])):
                equal, fill, causal = inner.inputs[0], inner.inputs[1], node.inputs[at]
                break
        else:
            return None
    else:
        return None
    found = _hidden_product(graph, causal)
    eq = graph.producer(equal)
    if found is None or not _is_fill(_scalar(graph, fill)) or eq is None or not isinstance(eq.op, Compare) or eq.op.fn != "equal":
        return None
    total = graph.producer(eq.inputs[0])
    if not _is_zero(_scalar(graph, eq.inputs[1])) or total is None or not isinstance(total.op, Binary) or total.op.fn != "add":
        return None
    if causal not in total.inputs:
        return None
    return MaskSplit.of([found[0]], True, hide=equal)


def _adds_unit_axes(graph: Graph, node: Node) -> bool:
    """``node`` is a ``Reshape`` that only puts axes of size 1 in front (``[S, T] -> [1, 1, S, T]``)."""
    if not isinstance(node.op, Reshape):
        return False
    src, dst = graph.types[node.inputs[0]].shape, graph.types[node.name].shape
    return len(dst) >= len(src) and dst[len(dst) - len(src) :] == src and all(d == 1 for d in dst[: len(dst) - len(src)])


def _nested_mask(graph: Graph, node: Node, depth: int) -> MaskSplit | None:
    """The masks transformers 4.x's ``AttentionMaskConverter`` writes (MPT's optimum file), read through what they nest:

    - ``Where(Cast(m, bool), fill, 0)`` hides where the float mask ``m`` (zeros and a finite fill) is nonzero: ``m``'s split;
    - ``Where(hide, fill, c)`` with ``hide`` bool and ``c`` a position mask: ``c``'s causal offset, ``hide`` besides it;
    - ``Concat(zeros[.., P], c)`` along the keys (the past visible to every query): ``c``'s offset moved by ``P``."""
    if depth > 8:
        return None
    if isinstance(node.op, Concat) and len(node.inputs) == 2 and node.op.axis % graph.types[node.name].rank == graph.types[node.name].rank - 1:
        block, rest = node.inputs
        if not _is_zero_block(graph, block):
            return None
        inner = split_additive_mask(graph, rest, depth + 1)
        if inner is None or not inner.visibility.is_causal:
            return None
        return replace(inner, visibility=inner.visibility.shifted(graph.types[block].shape[-1]))
    if isinstance(node.op, Binary) and node.op.fn == "add":  # c + Where(hide, fill, 0): graphc's reading of Where(hide, fill, c)
        for at in (0, 1):
            w = graph.producer(node.inputs[at])
            if w is None or not isinstance(w.op, Where) or not _is_zero(_scalar(graph, w.inputs[2])):
                continue
            found = _hidden_beside(graph, w.inputs[0], w.inputs[1], node.inputs[1 - at], depth)
            if found is not None:
                return found
        return None
    if not isinstance(node.op, Where):
        return None
    cond, x, y = node.inputs
    if not _is_zero(_scalar(graph, y)):
        return _hidden_beside(graph, cond, x, y, depth)
    fill, cast = _scalar(graph, x), graph.producer(cond)  # Where(Cast(m, bool), fill, 0)
    if not _is_fill(fill) or not np.isfinite(fill) or cast is None or not isinstance(cast.op, Cast) or cast.op.dtype != "bool":
        return None
    if str(graph.types[cast.inputs[0]].dtype) not in FLOAT_DTYPES:
        return None
    inner = split_additive_mask(graph, cast.inputs[0], depth + 1)
    if inner is None:
        return None
    return inner.filled(True)  # this fill is finite


def _hidden_beside(graph: Graph, hide: str, fill: str, positions: str, depth: int) -> MaskSplit | None:
    """A bool ``hide`` (not a half-plane) filled with a finite ``fill`` over a position mask ``positions``."""
    f = _scalar(graph, fill)
    if not _is_fill(f) or not np.isfinite(f) or graph.types[hide].dtype != "bool" or _half_plane(graph, hide) is not None:
        return None
    if graph.is_constant(positions) or str(graph.types[positions].dtype) not in FLOAT_DTYPES:
        return None
    inner = split_additive_mask(graph, positions, depth + 1)
    if inner is None or not inner.visibility.is_causal or inner.visibility.has_mask:
        return None
    return MaskSplit(replace(inner.visibility, mask="bool", empty_rows="mean"), hide=hide)


def _is_zero_block(graph: Graph, value: str) -> bool:
    """``value`` is all zeros: a zero constant, or one broadcast."""
    node = graph.producer(value)
    if node is not None and isinstance(node.op, BroadcastTo):
        value = node.inputs[0]
    if not graph.is_constant(value):
        return False
    arr = graph.initializers[value]
    return str(arr.dtype) in FLOAT_DTYPES and arr.size > 0 and not np.any(arr)


def split_additive_mask(graph: Graph, mask: str, depth: int = 0) -> MaskSplit | None:
    """Read ``mask`` (added to the scores) as :class:`MaskSplit`, or ``None`` when it is not ``Where(keep, 0, fill)``
    (or graphc's own ``Where(hide, fill, 0)``, see :func:`_planes`).

    ``keep`` may hold one causal bound (and one window edge with it) and any other bool conjuncts; without a causal
    bound it is a plain bool mask (BERT's padding)."""
    node = graph.producer(mask)
    while node is not None and (isinstance(node.op, BroadcastTo) or _adds_unit_axes(graph, node)):  # expanded or viewed
        node = graph.producer(node.inputs[0])
    if node is None:
        return None
    old = _old_transformers_mask(graph, node)
    if old is not None:
        return old
    nested = _nested_mask(graph, node, depth)
    if nested is not None:
        return nested
    causal = _hidden_product(graph, mask)
    if causal is not None:  # the causal product alone (no padding); its fill is finite
        return MaskSplit.of([causal[0]], True)
    if not isinstance(node.op, Where):
        return None
    found = _planes(graph, node)
    if found is None:
        return None
    planes, rest, f = found
    if not (planes or rest):
        return None
    return MaskSplit.of(planes, bool(np.isfinite(f)), tuple(rest))
