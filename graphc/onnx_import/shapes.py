"""Shape computations evaluated at import time: ``Shape``, ``Gather``, ``Concat``, arithmetic on dims.

Exporters compute reshape targets at run time (``Shape -> Gather -> Unsqueeze
-> Concat -> Reshape``).  graphc evaluates those chains over symbolic dims
(:class:`~graphc.onnx_import.context.SymInts`), so the imported ``Reshape``
carries ``[batch, seq, 32, 128]`` and the optimizer sees a static head split.
Each function returns ``None`` when its operands are not all shape values,
and the caller then converts the node as a tensor op.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..dims import Dim, dim_add, dim_div, dim_is_nonnegative, dim_max, dim_min, dim_mul, dim_prod, dim_sub, normalize_dim
from .context import ONNX_TO_DTYPE, Imported, ImportContext, SymInts, simplify

__all__ = ["as_dims", "sym_binary", "sym_where", "sym_layout", "reshape_target", "symbolic_quotient"]


def as_dims(v: Imported | None) -> SymInts | None:
    """``v`` as :class:`SymInts` when it is a small int tensor known at import time (symbolically or exactly)."""
    if isinstance(v, SymInts):
        return v
    if isinstance(v, np.ndarray) and v.dtype.kind in "iu" and v.ndim <= 1 and v.size <= 64:
        return SymInts(tuple(int(x) for x in v.reshape(-1)), v.ndim == 0)
    if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.ndim <= 1 and v.size <= 64:
        wide = v.astype(np.float64)  # float16 cannot hold 2**53
        if np.all(np.abs(wide) < 2**53) and np.all(wide == np.round(wide)):
            return SymInts(tuple(int(x) for x in v.reshape(-1)), v.ndim == 0, str(v.dtype))
    return None


def _broadcast(a: SymInts, b: SymInts) -> tuple[Sequence[Dim], Sequence[Dim], bool]:
    n = max(len(a.values), len(b.values))
    av = a.values * n if len(a.values) == 1 else a.values
    bv = b.values * n if len(b.values) == 1 else b.values
    return av, bv, a.scalar and b.scalar


def sym_binary(op_type: str, ins: Sequence[Imported | None]) -> Imported | None:
    """Arithmetic and comparisons on dims (``Add``, ``Sub``, ``Mul``, ``Div``, ``Max``, ``Min``, ``Equal``); ``None`` when not decidable."""
    a, b = (as_dims(x) for x in ins[:2])
    if a is None or b is None or isinstance(ins[0], np.ndarray) and isinstance(ins[1], np.ndarray):
        return None
    if len(a.values) not in (1, len(b.values)) and len(b.values) != 1:
        return None
    av, bv, scalar = _broadcast(a, b)
    out: list[Dim] = []
    for x, y in zip(av, bv):
        if op_type == "Add":
            out.append(dim_add(x, y))
        elif op_type == "Sub":
            out.append(dim_sub(x, y))
        elif op_type == "Mul":
            out.append(dim_mul(x, y))
        elif op_type == "Div":
            q = symbolic_quotient(x, y)
            if q is None:
                return None
            out.append(q)
        elif op_type in ("Max", "Min"):
            x, y = normalize_dim(x), normalize_dim(y)
            if x == y:
                out.append(x)
            elif isinstance(x, int) and isinstance(y, int):
                out.append(max(x, y) if op_type == "Max" else min(x, y))
            else:
                out.append(dim_max(x, y) if op_type == "Max" else dim_min(x, y))
        elif op_type == "Equal":
            x, y = normalize_dim(x), normalize_dim(y)
            if x == y:
                out.append(1)
            elif isinstance(x, int) and isinstance(y, int):
                out.append(0)
            elif isinstance(x, int) and x < 0 and dim_is_nonnegative(y) or isinstance(y, int) and y < 0 and dim_is_nonnegative(x):
                out.append(0)  # a size is never negative (exporters compare shapes with -1)
            else:
                return None
        else:
            return None
    if op_type == "Equal":
        arr = np.array(out, bool)
        return arr.reshape(()) if scalar else arr
    return simplify(SymInts(tuple(out), scalar, a.dtype if a.dtype == b.dtype else "int64"))


def sym_where(cond: Imported | None, x: Imported | None, y: Imported | None) -> Imported | None:
    """``Where`` with a known condition over shape values (``Where(shape == -1, 1, shape)``)."""
    a, b = as_dims(x), as_dims(y)
    if not isinstance(cond, np.ndarray) or a is None or b is None or isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        return None
    n = max(cond.size, len(a.values), len(b.values))
    picks = np.broadcast_to(cond.reshape(-1), (n,))
    av = a.values * n if len(a.values) == 1 else a.values
    bv = b.values * n if len(b.values) == 1 else b.values
    if len(av) != n or len(bv) != n:
        return None
    return simplify(SymInts(tuple(p if c else q for c, p, q in zip(picks, av, bv)), a.scalar and b.scalar and cond.ndim == 0))


def symbolic_quotient(a: Dim, b: Dim) -> Dim | None:
    """``a / b`` when it is exact: an int, or a polynomial whose every term divides by a monomial ``b``."""
    a, b = normalize_dim(a), normalize_dim(b)
    if b == 1:
        return a
    if isinstance(a, int) and isinstance(b, int):
        return a // b if b and a % b == 0 else None
    k = dim_div(a, b)
    if k is not None:
        return k
    from ..dims import dim_terms

    bt = dim_terms(b)
    if len(bt) != 1:
        return None
    bsyms, bcoef = bt[0]
    out: Dim = 0
    for syms, coef in dim_terms(a):
        rest = list(syms)
        for s in bsyms:
            if s not in rest:
                return None
            rest.remove(s)
        if coef % bcoef:
            return None
        out = dim_add(out, dim_mul(coef // bcoef, dim_prod(rest)))
    return out


def sym_layout(ctx: ImportContext, op_type: str, ins: Sequence[Imported | None], attrs: dict) -> Imported | None:
    """``Gather``/``Slice``/``Concat``/``Unsqueeze``/``Squeeze``/``Reshape``/``Cast``/``Identity`` on shape values."""
    first = as_dims(ins[0]) if ins else None
    if op_type == "Concat":
        maybe = [as_dims(x) for x in ins if x is not None]
        parts = [p for p in maybe if p is not None]
        if len(parts) != len(maybe) or all(isinstance(x, np.ndarray) for x in ins if x is not None):
            return None
        if any(p.scalar for p in parts):
            raise ctx.error("Concat of a rank-0 shape value; Concat needs rank >= 1")
        ctx.axis(attrs.get("axis"), 1, "Concat axis")  # shape values are 1-D: axis 0 or -1
        return simplify(SymInts(tuple(d for p in parts for d in p.values)))
    if first is None or isinstance(ins[0], np.ndarray) and op_type not in ("Gather",):
        return None
    if op_type == "Gather":
        if not isinstance(ins[0], SymInts):
            return None
        idx = ctx.known(ins[1], "Gather indices")
        n = len(first.values)
        if first.scalar:
            raise ctx.error("Gather from a rank-0 shape value; Gather needs rank >= 1")
        ctx.axis(attrs.get("axis", 0), 1, "Gather axis")
        if idx.ndim > 1:
            return None
        if idx.dtype.kind not in "iu" or (idx.size and (idx.min() < -n or idx.max() >= n)):
            raise ctx.error(f"Gather indices {idx.reshape(-1)[:8].tolist()} are out of range for a shape of {n} values (valid: {-n}..{n - 1})")
        picked = tuple(first.values[int(i)] for i in idx.reshape(-1))
        return simplify(SymInts(picked, idx.ndim == 0))
    if op_type == "Slice":
        starts, ends = ctx.ints(ins[1], "Slice starts"), ctx.ints(ins[2], "Slice ends")
        steps = ctx.ints(ins[4], "Slice steps") if len(ins) > 4 and ins[4] is not None else (1,)
        axes = ctx.ints(ins[3], "Slice axes") if len(ins) > 3 and ins[3] is not None else (0,)
        if first.scalar or not len(starts) == len(ends) == len(axes) == len(steps) == 1:
            return None
        ctx.axis(axes[0], 1, "Slice axis")
        if not all(isinstance(x, int) for x in (*starts, *ends, *steps)) or steps[0] == 0:
            return None
        return simplify(SymInts(first.values[slice(int(starts[0]), int(ends[0]), int(steps[0]))]))
    if op_type == "Unsqueeze":
        return SymInts(first.values) if first.scalar else None
    if op_type == "Squeeze":
        return SymInts(first.values, True) if len(first.values) == 1 else None
    if op_type == "Reshape":
        target = ctx.ints(ins[1], "Reshape shape")
        if len(first.values) != 1 and len(target) == 0:
            return None
        return SymInts(first.values, len(target) == 0)
    if op_type in ("Cast", "Identity"):
        if op_type == "Identity":
            return first
        to = ONNX_TO_DTYPE.get(attrs.get("to", 0))
        return SymInts(first.values, first.scalar, to) if to is not None and to != "bool" else None
    return None


def reshape_target(ctx: ImportContext, in_shape: Sequence[Dim], target: Sequence[Dim], allowzero: bool) -> tuple[Dim, ...]:
    """Resolve ONNX ``Reshape``'s ``0`` (copy the input dim) and ``-1`` (the remaining size) over symbolic dims."""
    out: list[Dim] = []
    infer_at = None
    for i, d in enumerate(target):
        d = normalize_dim(d) if not (isinstance(d, int) and d < 0) else d
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise ctx.error(f"Reshape: target dim {i} is 0 (copy), but the input has rank {len(in_shape)}")
            out.append(in_shape[i])
        elif isinstance(d, int) and d == -1:
            if infer_at is not None:
                raise ctx.error(f"Reshape: target {list(target)} has more than one -1")
            infer_at = i
            out.append(-1)
        elif isinstance(d, int) and d < 0:
            raise ctx.error(f"Reshape: target dim {i} is {d}; sizes must be >= -1")
        else:
            out.append(d)
    if infer_at is None:
        return tuple(out)
    known = [d for i, d in enumerate(out) if i != infer_at]
    numerator = list(in_shape)
    denominator: list[Dim] = []
    for d in known:  # cancel equal factors first: [b, s, 4096] -> [b, s, -1, 128]
        nd = normalize_dim(d)
        match = next((j for j, x in enumerate(numerator) if normalize_dim(x) == nd), None)
        if match is not None:
            numerator.pop(match)
        else:
            denominator.append(nd)
    q = symbolic_quotient(dim_prod(numerator), dim_prod(denominator))
    if q is None:
        # view(batch, -1) with batch taken from another input: the axes before the -1 (and after it, from the end)
        # keep their place, so a free symbol there is the input's dim (unified, and checked when the model runs)
        for i in range(min(infer_at, len(in_shape))):
            ctx.unify(out[i], in_shape[i], atoms=False)
        for i in range(1, min(len(out) - infer_at, len(in_shape))):
            ctx.unify(out[-i], in_shape[-i], atoms=False)
        raise ctx.error(f"Reshape: cannot infer the -1 in {list(target)} from input shape {list(in_shape)} symbolically")
    out[infer_at] = q
    return tuple(out)
