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

``fill`` is ``-inf`` or a finite number at most :data:`FILL_LIMIT`
(``finfo(dtype).min``).  With a finite fill a row whose every key is hidden
does not give zeros: every one of its scores becomes the fill, so its softmax
is uniform over all keys; the split records that as ``empty_rows="mean"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

import numpy as np

from graphc.dims import Dim, dim_add, dim_is_nonnegative, dim_sub, normalize_dim
from graphc.graph import Graph, Node
from graphc.ops import FLOAT_DTYPES, Binary, Cast, Compare, Reshape, Where
from graphc.rotary import Positions
from graphc.tensor_ops import Arange, BroadcastTo, ShapeValues

__all__ = ["MaskSplit", "split_additive_mask", "FILL_LIMIT"]

FILL_LIMIT = -1e30
"""A finite fill hides a key only when it swamps every score: ``s + fill == fill`` for ``|s|`` under half its ulp (1e31
for ``finfo(float32).min``)."""


@dataclass(frozen=True)
class MaskSplit:
    """An additive mask read as a causal offset, a window, the remaining bool conjuncts and what empty rows give."""

    offset: Dim | None  # None: no causal bound (a padding mask alone)
    window: int | None
    keep: tuple[str, ...]  # bool values still to AND (padding); empty when the positions say it all
    empty_rows: str


def _scalar(graph: Graph, value: str) -> np.ndarray | None:
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


def _half_plane(graph: Graph, value: str) -> tuple[str, Dim] | None:
    """``("upper", u)`` for a bool ``j <= i + u`` or ``("lower", l)`` for ``j >= i + l`` (``j`` keys on axis -1, ``i`` queries on -2)."""
    node = graph.producer(value)
    if node is None or not isinstance(node.op, Compare) or node.op.fn == "equal":
        return None
    a, b = (_positions(graph, x) for x in node.inputs)
    if a is None or b is None:
        return None
    fn = node.op.fn
    if (a[0], b[0]) == (-2, -1):  # query op key: flip to key op query
        a, b, fn = b, a, _FLIP[fn]
    if (a[0], b[0]) != (-1, -2):
        return None
    d = dim_sub(b[1], a[1])  # j + a <op> i + b  <=>  j <op> i + d
    return {
        "less_equal": ("upper", d),
        "less": ("upper", dim_sub(d, 1)),
        "greater_equal": ("lower", d),
        "greater": ("lower", dim_add(d, 1)),
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
    """``k`` where ``value`` is ``not k``, written ``Where(k, False, True)`` (an imported ``Not``), else None."""
    node = graph.producer(value)
    if node is None or not isinstance(node.op, Where) or graph.types[value].dtype != "bool":
        return None
    t, f = _scalar(graph, node.inputs[1]), _scalar(graph, node.inputs[2])
    if t is None or f is None or t.dtype != bool or f.dtype != bool:
        return None
    return node.inputs[0] if not t and f else None


def _is_zero(arr: np.ndarray | None) -> bool:
    return arr is not None and str(arr.dtype) in FLOAT_DTYPES and float(arr) == 0.0


def _is_fill(arr: np.ndarray | None) -> TypeGuard[np.ndarray]:
    """A float scalar that hides a key it is added to (``-inf``, or at most :data:`FILL_LIMIT`)."""
    return arr is not None and str(arr.dtype) in FLOAT_DTYPES and float(arr) <= FILL_LIMIT


def _planes(graph: Graph, node: Node) -> tuple[list[tuple[str, Dim]], list[str], np.ndarray] | None:
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
        negated = [("lower", dim_add(d, 1)) if side == "upper" else ("upper", dim_sub(d, 1)) for side, d in (pl for pl in found if pl)]
        return negated, [k for k in kept if k is not None], vx
    return None


def split_additive_mask(graph: Graph, mask: str) -> MaskSplit | None:
    """Read ``mask`` (added to the scores) as :class:`MaskSplit`, or ``None`` when it is not ``Where(keep, 0, fill)``
    (or graphc's own ``Where(hide, fill, 0)``, see :func:`_planes`).

    ``keep`` may hold one causal bound (and one window edge with it) and any other bool conjuncts; without a causal
    bound it is a plain bool mask (BERT's padding)."""
    node = graph.producer(mask)
    while node is not None and isinstance(node.op, BroadcastTo):  # a mask expanded to the scores' shape (optimum's files)
        node = graph.producer(node.inputs[0])
    if node is None or not isinstance(node.op, Where):
        return None
    found = _planes(graph, node)
    if found is None:
        return None
    planes, rest, f = found
    upper = [d for side, d in planes if side == "upper"]
    lower = [d for side, d in planes if side == "lower"]
    if len(upper) > 1 or len(lower) > 1 or (lower and not upper) or not (upper or rest):
        return None
    offset = normalize_dim(upper[0]) if upper else None
    window = None
    if lower and offset is not None:  # (a lower plane comes with an upper one: checked above)
        w = normalize_dim(dim_add(dim_sub(offset, lower[0]), 1))
        if not isinstance(w, int) or w < 1:
            return None
        window = w
    finite = bool(np.isfinite(f))
    empty = "mean" if finite and (rest or offset is None or not dim_is_nonnegative(offset)) else "zero"
    return MaskSplit(offset, window, tuple(rest), empty)
