"""Converters for ONNX's tensor ops: elementwise, contractions, layout, reductions, masks.

Each converter takes the import context, the node's imported inputs and its
attributes and returns its imported outputs.  Contractions become einsums
(``MatMul`` of ``[..., m, k]`` and ``[..., k, n]`` is ``"...mk,...kn->...mn"``
with one letter per axis), layout ops become Reshape/Transpose/Slice, a scalar
``Mul``/``Div`` becomes ``Scale``, and ``Expand`` of a size-1 axis becomes a
``Repeat`` (which the optimizer turns into a grouped einsum when it is the
KV-head repeat).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..dims import Dim, dim_add, dim_is_nonnegative, dim_max, dim_mul, dim_sub, dim_symbols, format_shape, is_symbol, normalize_dim
from ..errors import GraphcError
from ..ops import (
    UNARY_FUNCTIONS,
    Binary,
    CausalMask,
    Cast,
    Compare,
    Concat,
    Einsum,
    Repeat,
    Reshape,
    Scale,
    Softmax,
    Transpose,
    Unary,
    Where,
    broadcast_shapes,
)
from ..rotary import Positions
from ..tensor_ops import Arange, BroadcastTo, Gather, GatherElements, Reduce, Slice
from ..visibility import Visibility
from .context import Broadcast, Filled, Imported, ImportContext, MaskSum, ONNX_TO_DTYPE, SymInts, Triangle, simplify
from .shapes import as_dims, reshape_target, sym_binary, sym_layout, sym_where
from ..numerics import hides_keys
from .triangles import tri_cast, tri_equal, tri_from_buffer, tri_not, tri_where
from .unify import DimConflict, conflict_in_broadcast

__all__ = ["CORE_CONVERTERS", "Converter", "unary_converter"]

Converter = Callable[[ImportContext, list, dict], list]
LETTERS = string.ascii_letters

_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Max": "max", "Min": "min"}
_COMPARE = {"Less": "less", "LessOrEqual": "less_equal", "Greater": "greater", "GreaterOrEqual": "greater_equal", "Equal": "equal"}


def _scalar(ctx: ImportContext, value: np.ndarray | float, dtype: str) -> str:
    return ctx.constant(np.asarray(value).astype(dtype).reshape(()), "scalar")


# ---------------------------------------------------------------- positions
def _positions_grid(ctx: ImportContext, x: str) -> str:
    """``j - i`` over the last two axes of ``x`` as an int64 ``[S, T]`` tensor (built from the dims: ``x`` itself is not read,
    so scores masked this way stay an attention chain)."""
    shape = ctx.graph.types[x].shape
    rows = ctx.add(Reshape((shape[-2], 1)), [ctx.add(Arange(0, shape[-2]), [], "rows")], "rows_col")
    cols = ctx.add(Arange(0, shape[-1]), [], "cols")
    return ctx.add(Binary("sub"), [cols, rows], "key_minus_query")


def _triangle_against(ctx: ImportContext, tri: Triangle, x: str, fn: str) -> str:
    """``x (fn) Triangle``: a ``CausalMask`` for the usual ``x + triu(-inf, k)``, else ``x (fn)`` the triangle built from positions."""
    xs = ctx.graph.types[x].shape
    if len(xs) < 2 or broadcast_shapes(xs, tri.shape) != xs:
        raise ctx.error(f"a Trilu mask of shape {format_shape(tri.shape)} must broadcast into {x!r} {format_shape(xs)}")
    visible = Visibility.from_bounds([tri.kept()]) if fn == "add" and hides_keys(tri.value) else None
    if visible is not None:
        return ctx.add(CausalMask.of(visible), [x], "causal")
    mask = ctx.tensor(Triangle(np.asarray(tri.value).astype(ctx.graph.types[x].dtype), tri.shape, tri.k, tri.upper))
    return ctx.add(Binary(fn), [x, mask], "t")


def _causal_window(m: MaskSum) -> Visibility | None:
    """What ``m`` lets a query see when it is ``triu(-inf, k1) + tril(-inf, k2)`` (Mistral): keys ``j > i + k1 - 1`` or ``j <= i + k2``
    hidden, a causal mask with a window of ``k1 - 1 - k2``."""
    tris = [p for p in m.parts if isinstance(p, Triangle) and hides_keys(p.value)]
    if len(m.parts) != 2 or len(tris) != 2 or tris[0].upper == tris[1].upper or tris[0].shape != tris[1].shape:
        return None
    visible = Visibility.from_bounds([p.kept() for p in tris])
    return visible if visible is not None and "window" in visible.features() else None


def _terms(v: Imported) -> tuple:
    return v.parts if isinstance(v, MaskSum) else (v,)


def _lazy_operand(ctx: ImportContext, v: Imported, other: Sequence[Dim], dtype: str) -> str:
    """A :class:`Filled` or :class:`Broadcast` operand as the value that broadcasting makes equivalent."""
    other_shape = tuple(other)
    if isinstance(v, Filled):
        if broadcast_shapes(other_shape, v.shape) != tuple(other_shape):  # T5's zero cross-attention bias: its shape counts
            return ctx.tensor(Filled(v.value.astype(dtype), v.shape))
        return _scalar(ctx, v.value, dtype)
    if isinstance(v, Broadcast):
        base = ctx.graph.types[v.name].shape
        if broadcast_shapes(other_shape, base) != broadcast_shapes(other_shape, v.shape):  # BART's positions, [seq] to [batch, seq]
            return ctx.tensor(v)
        return v.name
    return ctx.tensor(v)


def _operands(ctx: ImportContext, a: Imported, b: Imported, fn: str) -> tuple[str, str] | str | MaskSum:
    """Two graph values of one dtype for a broadcasting op (or the finished result, for a Triangle; a sum of masks stays lazy)."""
    masks = (Filled, Triangle, MaskSum)
    if fn == "add" and isinstance(a, masks) and isinstance(b, masks) and (isinstance(a, (Triangle, MaskSum)) or isinstance(b, (Triangle, MaskSum))):
        return MaskSum(_terms(a) + _terms(b))
    if fn == "add" and isinstance(b, MaskSum) and isinstance(a, str):
        a, b = b, a
    if fn == "add" and isinstance(a, MaskSum) and isinstance(b, str):
        window = _causal_window(a)
        if window is not None:  # triu(-inf, k1) + tril(-inf, k2): a causal mask with a sliding window (Mistral)
            return ctx.add(CausalMask.of(window), [b], "causal_window")
        out = b
        for part in a.parts:
            out = _add_mask(ctx, out, part)
        return out
    if isinstance(b, Triangle) and isinstance(a, str):
        return _triangle_against(ctx, b, a, fn)
    if isinstance(a, Triangle) and isinstance(b, str) and fn in ("add", "mul"):
        return _triangle_against(ctx, a, b, fn)
    lazy = (Filled, Broadcast)
    if isinstance(a, lazy) and not isinstance(b, lazy):
        bt = ctx.tensor(b)
        return _lazy_operand(ctx, a, ctx.graph.types[bt].shape, ctx.graph.types[bt].dtype), bt
    if isinstance(b, lazy) and not isinstance(a, lazy):
        at = ctx.tensor(a)
        return at, _lazy_operand(ctx, b, ctx.graph.types[at].shape, ctx.graph.types[at].dtype)
    at, bt = ctx.tensor(a), ctx.tensor(b)
    ta, tb = ctx.graph.types[at].dtype, ctx.graph.types[bt].dtype
    if ta != tb:
        if bt in ctx.graph.initializers and ctx.graph.initializers[bt].size == 1:
            bt = ctx.constant(ctx.graph.initializers[bt].astype(ta), "scalar")
        elif at in ctx.graph.initializers and ctx.graph.initializers[at].size == 1:
            at = ctx.constant(ctx.graph.initializers[at].astype(tb), "scalar")
        else:
            raise ctx.error(f"operands have dtypes {ta} and {tb}; ONNX requires one dtype")
    return at, bt


def _add_mask(ctx: ImportContext, x: Imported, mask: Imported) -> str:
    """``x + mask`` for a lazy mask (a triangle may become a CausalMask, which is then the whole result)."""
    res = _operands(ctx, x, mask, "add")
    if isinstance(res, MaskSum):
        raise ctx.error("an additive mask added to another mask where scores were expected")
    return res if isinstance(res, str) else ctx.add(Binary("add"), list(res), "masked")


# ---------------------------------------------------------------- elementwise
def _binary(ctx: ImportContext, ins: list, attrs: dict, op_type: str) -> list:
    if op_type in ("Max", "Min") and len(ins) != 2:  # variadic: one input is itself, more fold left
        if len(ins) == 1:
            return [ins[0]]
        acc = _binary(ctx, ins[:2], attrs, op_type)[0]
        for x in ins[2:]:
            acc = _binary(ctx, [acc, x], attrs, op_type)[0]
        return [acc]
    folded = sym_binary(op_type, ins)
    if isinstance(folded, SymInts) and op_type in ("Max", "Min") and ctx.aliases:
        folded = SymInts(tuple(ctx.resolve(d) for d in folded.values), folded.scalar, folded.dtype)
    if folded is not None:
        return [folded]
    a, b = ins
    fn = _BINARY[op_type]
    for x, y in ((a, b), (b, a)):  # x * c, c * x, x / c: a Scale
        if (
            isinstance(y, np.ndarray)
            and y.size == 1
            and y.dtype.kind == "f"
            and isinstance(x, str)
            and (op_type == "Mul" or (op_type == "Div" and y is b))
        ):
            factor = float(y.reshape(())) if op_type == "Mul" else 1.0 / float(y.reshape(()))
            if np.isfinite(factor) and ctx.graph.types[x].dtype == str(y.dtype) and y.ndim <= ctx.graph.types[x].rank:
                return [ctx.add(Scale(factor), [x], "scaled")]
    ops = _operands(ctx, a, b, fn)
    if isinstance(ops, (str, MaskSum)):
        return [ops]
    return [ctx.add(Binary(fn), list(ops), op_type.lower())]


def unary_converter(op_type: str) -> Converter | None:
    """The converter of an ONNX op that is a registered unary function (``UNARY_FUNCTIONS``' ``onnx`` spelling), if any."""
    names = [f.name for f in UNARY_FUNCTIONS.values() if f.onnx == op_type]
    if not names:
        return None

    def convert(ctx: ImportContext, ins: list, attrs: dict) -> list:
        dims = as_dims(ins[0]) if op_type == "Neg" and not isinstance(ins[0], np.ndarray) else None
        if dims is not None:  # -seq of a shape computation (T5's ``bias[:, :, -seq:]``) stays a dim
            return [SymInts(tuple(dim_mul(-1, d) for d in dims.values), dims.scalar, dims.dtype)]
        return [ctx.add(Unary(names[0]), [ctx.tensor(ins[0])], op_type.lower())]

    return convert


def _compare(ctx: ImportContext, ins: list, attrs: dict, op_type: str) -> list:
    if op_type == "Equal":
        tri = tri_equal(ins[0], ins[1])
        if tri is not None:
            return [tri]
        folded = sym_binary("Equal", ins)
        if folded is not None:
            return [folded]
    ops = _operands(ctx, ins[0], ins[1], "compare")
    if not isinstance(ops, tuple):  # not reached: only "add" finishes a mask
        raise ctx.error(f"{op_type} of two masks")
    return [ctx.add(Compare(_COMPARE[op_type]), list(ops), op_type.lower())]


def _logical(ctx: ImportContext, ins: list, attrs: dict, op_type: str) -> list:
    if op_type == "Not" and (tri := tri_not(ins[0])) is not None:
        return [tri]
    true, false = ctx.constant(np.array(True), "true"), ctx.constant(np.array(False), "false")
    a = ctx.tensor(ins[0])
    if op_type == "Not":
        return [ctx.add(Where(), [a, false, true], "not")]
    b = ctx.tensor(ins[1])
    return [ctx.add(Where(), [a, b, false] if op_type == "And" else [a, true, b], op_type.lower())]


def _is_nan(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """``IsNaN(x)``: ``x != x``; all False on a softmax, whose fully masked rows graphc defines as zeros, not NaN
    (so sdpa's ``Where(IsNaN(p), 0, p)`` guard folds away and the probabilities reach PV directly)."""
    x = ctx.tensor(ins[0])
    producer = ctx.graph.producer(x)
    if producer is not None and isinstance(producer.op, Softmax):
        return [Filled(np.array(False), ctx.graph.types[x].shape)]
    same = ctx.add(Compare("equal"), [x, x], "is_number")
    return [ctx.add(Where(), [same, ctx.constant(np.array(False), "false"), ctx.constant(np.array(True), "true")], "is_nan")]


def _where(ctx: ImportContext, ins: list, attrs: dict) -> list:
    cond, x, y = ins
    tri = tri_where(cond, x, y)
    if isinstance(tri, Triangle):
        return [tri]
    if tri is not None:  # a tensor with keys hidden on one side of a diagonal: tensor + Triangle(-inf)
        return [_add_mask(ctx, tri[1], tri[2])]
    folded = sym_where(cond, x, y)
    if folded is not None:
        return [folded]
    if isinstance(cond, Filled) or isinstance(cond, np.ndarray) and cond.size == 1:
        pick = x if bool(np.asarray(cond.value if isinstance(cond, Filled) else cond).reshape(())) else y
        try:
            out_shape = broadcast_shapes(broadcast_shapes(cond.shape, ctx.shape_of(x)), ctx.shape_of(y))
        except GraphcError as e:
            raise ctx.error(f"Where operands do not broadcast: {e}") from None
        if tuple(ctx.shape_of(pick)) == tuple(out_shape):  # the other operand does not widen the result
            return [pick]
    c = ctx.tensor(cond, "Where condition")
    if isinstance(x, (Filled, Broadcast)) or isinstance(y, (Filled, Broadcast)):
        shape = ctx.graph.types[c].shape
        dtype = ctx.dtype_of(y if isinstance(x, (Filled, Broadcast)) else x)
        xv = _lazy_operand(ctx, x, shape, dtype) if isinstance(x, (Filled, Broadcast)) else ctx.tensor(x)
        yv = _lazy_operand(ctx, y, shape, dtype) if isinstance(y, (Filled, Broadcast)) else ctx.tensor(y)
    else:
        xv, yv = ctx.tensor(x), ctx.tensor(y)
    return [ctx.add(Where(), [c, xv, yv], "where")]


def _cast(ctx: ImportContext, ins: list, attrs: dict) -> list:
    to = ONNX_TO_DTYPE.get(attrs["to"])
    if to is None:
        raise ctx.error(f"Cast to ONNX type {attrs['to']} has no graphc dtype")
    x = ins[0]
    if isinstance(x, Filled):
        return [Filled(x.value.astype(to), x.shape)]
    if isinstance(x, Triangle):
        return [tri_cast(x, to)]
    x = ctx.tensor(x)
    if ctx.graph.types[x].dtype == to:
        return [x]
    return [ctx.add(Cast(to), [x], "cast")]


# ---------------------------------------------------------------- contractions
def _einsum_matmul(ctx: ImportContext, a: str, b: str) -> str:
    sa, sb = ctx.graph.types[a].shape, ctx.graph.types[b].shape
    if not sa or not sb:
        raise ctx.error("MatMul operands must have rank >= 1")
    va, vb = len(sa) == 1, len(sb) == 1
    ra, rb = (1,) * va + tuple(sa), tuple(sb) + (1,) * vb  # vectors as [1, k] and [k, 1]
    batch = max(len(ra), len(rb)) - 2
    letters = iter(LETTERS)
    out_batch, ta, tb = [], [], []
    pa = (None,) * (batch - (len(ra) - 2)) + tuple(ra[:-2])
    pb = (None,) * (batch - (len(rb) - 2)) + tuple(rb[:-2])
    for x, y in zip(pa, pb):
        ch = next(letters)
        if x is None or y is None or normalize_dim(x) == normalize_dim(y):
            out_batch.append(ch)
            if x is not None:
                ta.append(ch)
            if y is not None:
                tb.append(ch)
        elif x == 1:
            own = next(letters)
            ta.append(own)
            tb.append(ch)
            out_batch.append(ch)
        elif y == 1:
            own = next(letters)
            ta.append(ch)
            tb.append(own)
            out_batch.append(ch)
        else:
            ctx.unify(x, y)
            raise ctx.error(f"MatMul batch dims {x!r} and {y!r} do not broadcast (shapes {format_shape(sa)}, {format_shape(sb)})")
    m, k, n = next(letters), next(letters), next(letters)
    spec_a = "".join(ta) + ("" if va else m) + k
    spec_b = "".join(tb) + k + ("" if vb else n)
    spec_out = "".join(out_batch) + ("" if va else m) + ("" if vb else n)
    return ctx.add(Einsum(f"{spec_a},{spec_b}->{spec_out}"), [a, b], "matmul")


def _matmul(ctx: ImportContext, ins: list, attrs: dict) -> list:
    return [_einsum_matmul(ctx, ctx.tensor(ins[0]), ctx.tensor(ins[1]))]


def _gemm(ctx: ImportContext, ins: list, attrs: dict) -> list:
    a, b = ctx.tensor(ins[0]), ctx.tensor(ins[1])
    spec_a = "km" if attrs.get("transA", 0) else "mk"
    spec_b = "nk" if attrs.get("transB", 0) else "kn"
    y = ctx.add(Einsum(f"{spec_a},{spec_b}->mn"), [a, b], "gemm")
    if attrs.get("alpha", 1.0) != 1.0:
        y = ctx.add(Scale(attrs["alpha"]), [y], "gemm_alpha")
    if len(ins) > 2 and ins[2] is not None:
        c = ins[2]
        if attrs.get("beta", 1.0) != 1.0:
            c = ctx.add(Scale(attrs["beta"]), [ctx.tensor(c)], "gemm_beta")
        y = ctx.add(Binary("add"), [y, ctx.tensor(c)], "gemm_bias")
    return [y]


def _einsum(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """ONNX ``Einsum``: ``...`` becomes explicit letters and an implicit output is spelled out (letters seen once, sorted)."""
    values = [ctx.tensor(x) for x in ins]
    eq = str(attrs["equation"]).replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(values):
        raise ctx.error(f"Einsum equation {eq!r} names {len(terms)} operand(s), the node has {len(values)}")
    if "..." in eq:
        spare = [ch for ch in LETTERS if ch not in eq]
        width = max(ctx.graph.types[v].rank - (len(t) - 3) for t, v in zip(terms, values) if "..." in t)
        fill = "".join(spare[:width])
        terms = [t.replace("...", fill[width - (ctx.graph.types[v].rank - (len(t) - 3)) :]) for t, v in zip(terms, values)]
        rhs = rhs.replace("...", fill)
        if not arrow:
            rhs = fill
    if not arrow:
        counts = {ch: "".join(terms).count(ch) for ch in "".join(terms)}
        rhs += "".join(sorted(ch for ch, n in counts.items() if n == 1 and ch not in rhs))
    for k, term in enumerate(terms):
        values[k], terms[k] = _diagonals(ctx, values[k], term)
    return [ctx.add(Einsum(",".join(terms) + "->" + rhs), values, "einsum")]


def _diagonals(ctx: ImportContext, x: str, term: str) -> tuple[str, str]:
    """An operand whose einsum term repeats a label (``ii``: a diagonal) as that diagonal, gathered exactly: the two
    axes moved last, merged, and every ``n + 1``-th element kept; the term then names the label once, last."""
    while any(term.count(ch) > 1 for ch in term):
        label = next(ch for ch in term if term.count(ch) > 1)
        p, q = term.index(label), term.index(label, term.index(label) + 1)
        shape = ctx.graph.types[x].shape
        n = shape[p]
        if not isinstance(n, int) or shape[q] != n:
            raise ctx.error(
                f"Einsum label {label!r} repeats in {term!r} over axes of sizes {shape[p]} and {shape[q]}; a diagonal needs one static size"
            )
        rest = [a for a in range(len(term)) if a not in (p, q)]
        if rest + [p, q] != list(range(len(term))):
            x = ctx.add(Transpose(tuple(rest + [p, q])), [x], "einsum_diagonal_axes")
        x = ctx.add(Reshape(tuple(shape[a] for a in rest) + (n * n,)), [x], "einsum_diagonal_merge")
        x = ctx.add(Gather(len(rest)), [x, ctx.constant(np.arange(n, dtype=np.int64) * (n + 1), "diagonal")], "einsum_diagonal")
        term = "".join(term[a] for a in rest) + label
    return x, term


def _softmax(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0])
    rank = ctx.graph.types[x].rank
    axis = ctx.axis(attrs.get("axis", -1 if ctx.opset >= 13 else 1), rank, "Softmax axis")
    if ctx.opset < 13 and axis != rank - 1:  # softmax over the axes from `axis` on, flattened into one
        shape = ctx.graph.types[x].shape
        width: Dim = 1
        for d in shape[axis:]:
            width = dim_mul(width, d)
        flat = ctx.add(Reshape(tuple(shape[:axis]) + (width,)), [x], "softmax_flatten")
        return [ctx.add(Reshape(tuple(shape)), [ctx.add(Softmax(-1), [flat], "softmax")], "softmax_unflatten")]
    return [ctx.add(Softmax(axis), [x], "softmax")]


# ---------------------------------------------------------------- layout
def _reshape(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0])
    target = reshape_target(ctx, ctx.graph.types[x].shape, ctx.ints(ins[1], "Reshape shape"), bool(attrs.get("allowzero", 0)))
    if tuple(target) == ctx.graph.types[x].shape:
        return [x]
    return [ctx.add(Reshape(target), [x], "reshape")]


def _flatten(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0])
    shape = ctx.graph.types[x].shape
    axis = ctx.axis(attrs.get("axis", 1), len(shape), "Flatten axis", extra=1)
    from ..dims import dim_prod

    return [ctx.add(Reshape((dim_prod(shape[:axis]), dim_prod(shape[axis:]))), [x], "flatten")]


def _transpose(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0])
    rank = ctx.graph.types[x].rank
    perm = tuple(attrs.get("perm", range(rank - 1, -1, -1)))
    if sorted(perm) != list(range(rank)):
        raise ctx.error(f"Transpose perm {list(perm)} is not a permutation of 0..{rank - 1}")
    if perm == tuple(range(rank)):
        return [x]
    return [ctx.add(Transpose(perm), [x], "transpose")]


def _axes(ctx: ImportContext, ins: list, attrs: dict, what: str) -> tuple[int, ...] | None:
    if len(ins) > 1 and ins[1] is not None:
        return tuple(int(a) for a in ctx.known(ins[1], f"{what} axes").reshape(-1))
    if "axes" in attrs:
        return tuple(int(a) for a in attrs["axes"])
    return None


def _unsqueeze(ctx: ImportContext, ins: list, attrs: dict) -> list:
    if isinstance(ins[0], Filled):
        return [Filled(ins[0].value, _unsqueezed(ctx, ins[0].shape, _axes(ctx, ins, attrs, "Unsqueeze") or ()))]
    x = ctx.tensor(ins[0])
    shape = _unsqueezed(ctx, ctx.graph.types[x].shape, _axes(ctx, ins, attrs, "Unsqueeze") or ())
    return [ctx.add(Reshape(shape), [x], "unsqueeze")]


def _unsqueezed(ctx: ImportContext, shape: Sequence[Dim], axes: Sequence[int]) -> tuple[Dim, ...]:
    out_rank = len(shape) + len(axes)
    where = sorted(ctx.axis(a, out_rank, "Unsqueeze axis") for a in axes)
    if len(set(where)) != len(where):
        raise ctx.error(f"Unsqueeze axes {list(axes)} repeat an axis")
    out = list(shape)
    for a in where:
        out.insert(a, 1)
    return tuple(out)


def _squeeze(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x = ctx.tensor(ins[0])
    shape = ctx.graph.types[x].shape
    axes = _axes(ctx, ins, attrs, "Squeeze")
    drop = {ctx.axis(a, len(shape), "Squeeze axis") for a in axes} if axes is not None else {i for i, d in enumerate(shape) if d == 1}
    for a in drop:
        if shape[a] != 1:
            raise ctx.error(f"Squeeze axis {a} has size {shape[a]!r}, not 1")
    return [ctx.add(Reshape(tuple(d for i, d in enumerate(shape) if i not in drop)), [x], "squeeze")]


def _concat(ctx: ImportContext, ins: list, attrs: dict) -> list:
    present = [x for x in ins if x is not None and not (isinstance(x, np.ndarray) and x.size == 0 and x.ndim == 1)]
    sym = sym_layout(ctx, "Concat", present, attrs)
    if sym is not None:
        return [sym]
    values = [ctx.tensor(x) for x in present]
    if len(values) == 1:
        return values
    return [ctx.add(Concat(ctx.axis(attrs["axis"], ctx.graph.types[values[0]].rank, "Concat axis")), values, "concat")]


def _slice_bounds(size: Dim, start: Dim, stop: Dim) -> tuple[Dim, Dim]:
    """ONNX's clamping of bounds: negative counts from the end, anything past the end is the end.

    A negative bound on a symbolic axis is ``max(size - k, 0)`` (``x[-15:]`` keeps ``size - max(0, size - 15)`` rows:
    fewer than 15 when the axis is shorter).  A non-negative bound on a symbolic axis is taken as given (``cos[:seq]``
    of a table assumed long enough; the run checks it)."""

    def clamp(v: Dim) -> Dim:
        if isinstance(v, int):
            if v >= 1 << 62 or (isinstance(size, int) and v >= size):
                return size
            if v < 0:
                return dim_max(dim_add(size, v), 0)
        elif dim_is_nonnegative(dim_mul(-1, v)) and not dim_is_nonnegative(v):  # -seq: counted from the end
            return dim_max(dim_add(size, v), 0)
        return v

    return clamp(start), clamp(stop)


def _slice(ctx: ImportContext, ins: list, attrs: dict) -> list:
    starts, ends = ctx.ints(ins[1], "Slice starts"), ctx.ints(ins[2], "Slice ends")
    rank = len(ctx.shape_of(ins[0]))
    axes = ctx.ints(ins[3], "Slice axes") if len(ins) > 3 and ins[3] is not None else tuple(range(len(starts)))
    steps = ctx.ints(ins[4], "Slice steps") if len(ins) > 4 and ins[4] is not None else (1,) * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ctx.error(f"Slice starts, ends, axes and steps must have one length, got {len(starts)}, {len(ends)}, {len(axes)}, {len(steps)}")
    tri = ins[0] if isinstance(ins[0], Triangle) else tri_from_buffer(ins[0], ins[0].shape) if isinstance(ins[0], np.ndarray) else None
    if tri is not None and all(normalize_dim(s) == 0 for s in starts) and all(st == 1 for st in steps):
        cut = list(tri.shape)  # a causal buffer cut to the run's length stays a triangle
        for stop, axis in zip(ends, axes):
            a = ctx.axis(axis, rank, "Slice axis")
            cut[a] = _slice_bounds(cut[a], 0, stop)[1]
        return [Triangle(tri.value, tuple(cut), tri.k, tri.upper)]
    x = ctx.tensor(ins[0])
    shape = ctx.graph.types[x].shape
    for start, stop, axis, step in zip(starts, ends, axes, steps):
        if not isinstance(axis, int) or not isinstance(step, int) or step == 0:
            raise ctx.error(f"Slice axis/step must be constants, the step not 0, got axis {axis!r} step {step!r}")
        a = ctx.axis(axis, len(shape), "Slice axis")
        if step < 0:  # backwards: the rows it keeps, gathered
            x = _slice_backwards(ctx, x, a, start, stop, step)
            shape = ctx.graph.types[x].shape
            continue
        lo, hi = (ctx.resolve(d) for d in _slice_bounds(shape[a], start, stop))
        if normalize_dim(lo) == 0 and normalize_dim(hi) == normalize_dim(shape[a]) and step == 1:
            continue
        x = ctx.add(Slice(a, lo, hi, step), [x], "slice")
        shape = ctx.graph.types[x].shape
    return [x]


def _slice_backwards(ctx: ImportContext, x: str, axis: int, start: Dim, stop: Dim, step: int) -> str:
    """``x[start:stop:step]`` along ``axis`` with ``step < 0`` (ONNX's clamping), as a ``Gather`` of the indices it keeps;
    the axis must have a static size."""
    size = ctx.graph.types[x].shape[axis]
    if not isinstance(size, int) or not isinstance(start, int) or not isinstance(stop, int):
        raise ctx.error(f"Slice with step {step} needs a static axis size and static bounds, got axis {axis} of size {size}, [{start}:{stop}]")
    first = min(max(start + size if start < 0 else start, 0), size - 1)  # ONNX: start in [0, size - 1], end in [-1, size - 1]
    last = min(max(stop + size if stop < 0 else stop, -1), size - 1)
    kept = np.arange(first, last, step, dtype=np.int64)
    return ctx.add(Gather(axis), [x, ctx.constant(kept, "slice_rows")], "slice")


def _split(ctx: ImportContext, ins: list, attrs: dict, n_out: int) -> list:
    x = ctx.tensor(ins[0])
    shape = ctx.graph.types[x].shape
    axis = ctx.axis(attrs.get("axis", 0), len(shape), "Split axis")
    if len(ins) > 1 and ins[1] is not None:
        sizes: Sequence[Dim] = ctx.ints(ins[1], "Split sizes")
    elif "split" in attrs:
        sizes = attrs["split"]
    else:
        length = shape[axis]
        if not isinstance(length, int):
            raise ctx.error(f"Split of symbolic axis {length!r} into equal parts needs explicit sizes")
        part = -(-length // n_out)
        sizes = [min(part, length - i * part) for i in range(n_out)]
    if len(sizes) != n_out:
        raise ctx.error(f"Split sizes {list(sizes)} name {len(sizes)} parts for {n_out} outputs")
    if any(isinstance(d, int) and d < 0 for d in sizes):
        raise ctx.error(f"Split sizes {list(sizes)} must be >= 0")
    total = normalize_dim(_dim_sum(sizes))
    if isinstance(total, int) and isinstance(shape[axis], int) and total != shape[axis]:
        raise ctx.error(f"Split sizes {list(sizes)} add up to {total}, axis {axis} has size {shape[axis]}")
    outs: list[str] = []
    start: Dim = 0
    for size in sizes:
        stop = dim_add(start, size)
        outs.append(ctx.add(Slice(axis, start, stop), [x], "split"))
        start = stop
    return outs


def _gather(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x, idx = ctx.tensor(ins[0]), ins[1]
    shape = ctx.graph.types[x].shape
    axis = ctx.axis(attrs.get("axis", 0), len(shape), "Gather axis")
    known = simplify(idx)
    n = shape[axis]
    if isinstance(known, np.ndarray) and known.size and isinstance(n, int):
        if known.dtype.kind not in "iu" or known.min() < -n or known.max() >= n:
            raise ctx.error(f"Gather indices {known.reshape(-1)[:8].tolist()} are out of range for axis {axis} of size {n} (valid: {-n}..{n - 1})")
    return [ctx.add(Gather(axis), [x, ctx.tensor(idx, "Gather indices")], "gather")]


def _gather_elements(ctx: ImportContext, ins: list, attrs: dict) -> list:
    x, idx = ctx.tensor(ins[0]), ctx.tensor(ins[1], "GatherElements indices")
    axis = ctx.axis(attrs.get("axis", 0), ctx.graph.types[x].rank, "GatherElements axis")
    return [ctx.add(GatherElements(axis), [x, idx], "gather_elements")]


def _expand(ctx: ImportContext, ins: list, attrs: dict) -> list:
    target = ctx.ints(ins[1], "Expand shape")
    src = ins[0]
    if isinstance(src, np.ndarray) and src.size == 1:
        return [simplify(Filled(src.reshape(()), tuple(broadcast_shapes(src.shape, tuple(target)))))]
    if isinstance(src, Filled):
        return [simplify(Filled(src.value, broadcast_shapes(src.shape, tuple(target))))]
    x = ctx.tensor(src)
    shape = ctx.graph.types[x].shape
    try:
        out = broadcast_shapes(shape, tuple(1 if d == 1 else d for d in target), "Expand")
    except GraphcError as e:
        conflict = conflict_in_broadcast([shape, tuple(target)], ctx.free)  # a free dim the Expand proves equal to another
        if conflict is not None:
            raise DimConflict(conflict[0], conflict[1], e) from None
        raise ctx.error(str(e)) from None
    if len(out) > len(shape):
        shape = (1,) * (len(out) - len(shape)) + tuple(shape)
        x = ctx.add(Reshape(shape), [x], "expand_rank")
    pending = False
    for axis, (d, o) in enumerate(zip(shape, out)):
        if normalize_dim(d) == normalize_dim(o):
            continue
        if isinstance(o, int):
            x = ctx.add(Repeat(axis, o), [x], "expand")  # a size-1 axis: repeat-interleave is tiling
        else:
            pending = True
    return [Broadcast(x, tuple(out)) if pending else x]


def _tile(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """``Tile``: a size-1 axis repeated a constant number of times is a :class:`Repeat` (the optimizer's repeat_kv
    rules read it); a symbolic count broadcasts; any other axis is copied whole ``r`` times (a new size-1 axis
    before it broadcast to ``r``, then merged: ``out[i] = x[i mod n]``)."""
    x = ctx.tensor(ins[0])
    reps = ctx.ints(ins[1], "Tile repeats")
    if len(reps) != ctx.graph.types[x].rank:
        raise ctx.error(f"Tile repeats has {len(reps)} entries for a rank-{ctx.graph.types[x].rank} input; ONNX needs one per axis")
    for axis, r in enumerate(reps):
        r = ctx.resolve(r)
        shape = ctx.graph.types[x].shape
        if r == 1:
            continue
        if shape[axis] == 1:
            grown = tuple(r if i == axis else d for i, d in enumerate(shape))
            x = ctx.add(Repeat(axis, r) if isinstance(r, int) else BroadcastTo(grown), [x], "tile")
            continue
        split = ctx.add(Reshape((*shape[:axis], 1, *shape[axis:])), [x], "tile_axis")
        copies = ctx.add(BroadcastTo((*shape[:axis], r, *shape[axis:])), [split], "tile_copies")
        x = ctx.add(Reshape((*shape[:axis], dim_mul(r, shape[axis]), *shape[axis + 1 :])), [copies], "tile")
    return [x]


# ---------------------------------------------------------------- constants and shapes
def _shape(ctx: ImportContext, ins: list, attrs: dict) -> list:
    shape = ctx.shape_of(ins[0])
    rank = len(shape)
    start = attrs.get("start", 0)
    end = attrs.get("end", rank)
    return [simplify(SymInts(tuple(shape)[slice(start, end)]))]


def _size(ctx: ImportContext, ins: list, attrs: dict) -> list:
    from ..dims import dim_prod

    return [simplify(SymInts((dim_prod(ctx.shape_of(ins[0])),), True))]


def _constant_of_shape(ctx: ImportContext, ins: list, attrs: dict) -> list:
    value = attrs.get("value")
    value = np.zeros((), np.float32) if value is None else np.asarray(value).reshape(())
    shape = ctx.ints(ins[0], "ConstantOfShape shape")
    return [simplify(Filled(value, tuple(shape)))]


def _range(ctx: ImportContext, ins: list, attrs: dict) -> list:
    start, limit, delta = (as_dims(x) for x in ins)
    if start is None or limit is None or delta is None or delta.values != (1,):
        raise ctx.error("Range with a run-time start, limit or a step other than 1 is not supported")
    length = normalize_dim(dim_sub(limit.values[0], start.values[0]))
    dtype = ctx.dtype_of(ins[0])
    carrier = _length_carrier(ctx, length)
    if carrier is not None:
        pos = ctx.add(Positions(carrier[1], start.values[0]), [carrier[0]], "range")
    else:
        pos = ctx.graph.add_node(Arange(start.values[0], limit.values[0]), [], ctx.graph.fresh_name("range")).name
    return [pos if dtype == "int64" else ctx.add(Cast(dtype), [pos], "range_cast")]


def _length_carrier(ctx: ImportContext, length: Dim) -> tuple[str, int] | None:
    """The value and axis a ``Range`` of ``length`` reads its length from: a graph input's axis of that length; else
    None (an ``Arange`` over the dim) where the inputs' dims give it; else any value's axis of that length.  A value
    computed in the graph is the last choice: reading it would tie the positions to it (a cache ``Concat`` read
    before the attention it feeds)."""
    types, inputs = ctx.graph.types, ctx.graph.inputs
    found = ((name, axis) for name in inputs for axis, d in enumerate(types[name].shape) if normalize_dim(d) == length)
    carrier = next(found, None)
    if carrier is not None or dim_symbols(length) <= {str(d) for name in inputs for d in types[name].shape if is_symbol(d)}:
        return carrier
    computed = ((name, axis) for name, t in types.items() for axis, d in enumerate(t.shape) if normalize_dim(d) == length)
    return next(computed, None)


def _trilu(ctx: ImportContext, ins: list, attrs: dict) -> list:
    k = ctx.ints(ins[1], "Trilu k")[0] if len(ins) > 1 and ins[1] is not None else 0
    upper = bool(attrs.get("upper", 1))
    if isinstance(ins[0], Filled):
        return [Triangle(ins[0].value, ins[0].shape, k, upper)]
    x = ctx.tensor(ins[0])
    shape = ctx.graph.types[x].shape
    if len(shape) < 2:
        raise ctx.error(f"Trilu needs rank >= 2, got {format_shape(shape)}")
    keep = ctx.triangle_keep(shape[-2], shape[-1], k, upper)
    return [ctx.add(Where(), [keep, x, _scalar(ctx, 0, ctx.graph.types[x].dtype)], "trilu")]


def _reduce(ctx: ImportContext, ins: list, attrs: dict, fn: str) -> list:
    x = ctx.tensor(ins[0])
    rank = ctx.graph.types[x].rank
    axes = _axes(ctx, ins, attrs, "Reduce")
    if axes is None or not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return [x]
        axes = tuple(range(rank))
    axes = tuple(ctx.axis(a, rank, "Reduce axis") for a in axes)
    if len(set(axes)) != len(axes):
        raise ctx.error(f"Reduce axes {list(axes)} repeat an axis")
    return [ctx.add(Reduce(fn, axes, bool(attrs.get("keepdims", 1))), [x], f"reduce_{fn}")]


def _identity(ctx: ImportContext, ins: list, attrs: dict) -> list:
    return [ins[0]]


def _dropout(ctx: ImportContext, ins: list, attrs: dict) -> list:
    """Dropout is the identity when its ratio is 0 (whatever its training mode, a run-time input included) or its
    training mode is off; training mode with a ratio above 0 (random) is refused."""
    ratio = simplify(ins[1]) if len(ins) > 1 and ins[1] is not None else np.array(0.5)
    if isinstance(ratio, np.ndarray) and ratio.size == 1 and float(ratio.reshape(-1)[0]) == 0.0:
        return [ins[0]]
    training = ins[2] if len(ins) > 2 else None
    if training is not None:
        mode = simplify(training)
        if not isinstance(mode, np.ndarray):
            raise ctx.error(
                "Dropout's training_mode is a run-time input and its ratio is not a constant 0; graphc imports inference graphs "
                "(export the model in eval mode)"
            )
        if bool(mode.reshape(-1)[0]):
            raise ctx.error("Dropout in training mode is random; graphc imports inference graphs (export the model in eval mode)")
    return [ins[0]]


def _dim_sum(dims: Sequence[Dim]) -> Dim:
    total: Dim = 0
    for d in dims:
        total = dim_add(total, d)
    return total


def _shape_values_first(op_type: str, fn: Converter) -> Converter:
    """``fn``, unless the node computes on shape values: then it is evaluated over dims (:func:`sym_layout`)."""

    def convert(ctx: ImportContext, ins: list, attrs: dict) -> list:
        sym = sym_layout(ctx, op_type, ins, attrs)
        return [sym] if sym is not None else fn(ctx, ins, attrs)

    return convert


def _with(fn: Callable[..., list], *extra: Any) -> Converter:
    return lambda ctx, ins, attrs: fn(ctx, ins, attrs, *extra)


CORE_CONVERTERS: dict[str, Converter] = {
    **{op: _with(_binary, op) for op in _BINARY},
    **{op: _with(_compare, op) for op in _COMPARE},
    **{op: _with(_logical, op) for op in ("And", "Or", "Not")},
    "Where": _where,
    "IsNaN": _is_nan,
    "Cast": _shape_values_first("Cast", _cast),
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Einsum": _einsum,
    "Softmax": _softmax,
    "Reshape": _shape_values_first("Reshape", _reshape),
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Unsqueeze": _shape_values_first("Unsqueeze", _unsqueeze),
    "Squeeze": _shape_values_first("Squeeze", _squeeze),
    "Concat": _concat,
    "Slice": _shape_values_first("Slice", _slice),
    "Gather": _shape_values_first("Gather", _gather),
    "GatherElements": _gather_elements,
    "Expand": _expand,
    "Tile": _tile,
    "Shape": _shape,
    "Size": _size,
    "ConstantOfShape": _constant_of_shape,
    "Range": _range,
    "Trilu": _trilu,
    "ReduceMean": _with(_reduce, "mean"),
    "ReduceSum": _with(_reduce, "sum"),
    "ReduceMax": _with(_reduce, "max"),
    "ReduceMin": _with(_reduce, "min"),
    "Identity": _identity,
    "Dropout": _dropout,
}
"""Standard-domain converters by op type (``Split`` is handled by the driver: its output count comes from the node)."""
SPLIT = _split
