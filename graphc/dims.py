"""Symbolic dimensions.

A dimension (:data:`Dim`) is either a non-negative ``int`` or a string naming a
polynomial over symbols with integer coefficients, for example ``"batch"``,
``"past_seq+seq"`` or ``"4*seq"``.  Strings are kept in a canonical form, so two
dimensions are equal exactly when their canonical strings are equal.  Symbols are
bound to integers at run time (:func:`bind_shape`) and expressions evaluated
(:func:`eval_dim`).  Only sums and products occur in attention graphs: a
concatenation adds, a head split or merge multiplies.
"""

from __future__ import annotations

import re
from functools import lru_cache
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .errors import DimError

__all__ = [
    "DEFAULT_DIM_HINT",
    "MAX_SIZE",
    "check_sizes",
    "Dim",
    "Shape",
    "normalize_dim",
    "normalize_shape",
    "dim_add",
    "dim_sub",
    "dim_mul",
    "dim_prod",
    "dim_div",
    "eval_dim",
    "eval_shape",
    "dim_symbols",
    "dim_terms",
    "is_symbol",
    "is_static",
    "dim_is_nonnegative",
    "bind_shape",
    "bind_shapes",
    "format_shape",
]

Dim = int | str
Shape = tuple[Dim, ...]
DEFAULT_DIM_HINT = 512
"""Size assumed for a symbolic dim without a hint when costs or memory are estimated."""

MAX_SIZE = 2**48
"""The largest static size of one axis graphc accepts in a declared shape (far past any real tensor)."""

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TERM = re.compile(r"\s*([+-])?\s*([^+-]+)")

# A polynomial: monomial (sorted tuple of symbols, repeats allowed) -> coefficient.
_Poly = dict[tuple[str, ...], int]


def _parse(d: Dim) -> _Poly:
    if isinstance(d, bool):
        raise DimError(f"dimension must be an int or a symbol expression, got bool {d!r}")
    if isinstance(d, int):
        return {(): d} if d else {}
    if not isinstance(d, str):
        raise DimError(f"dimension must be an int or a symbol expression, got {type(d).__name__} {d!r}")
    return dict(_parse_text(d))


@lru_cache(maxsize=65536)
def _parse_text(d: str) -> tuple[tuple[tuple[str, ...], int], ...]:
    return tuple(_parse_uncached(d).items())


def _parse_uncached(d: Dim) -> _Poly:
    if isinstance(d, int):
        return {(): d} if d else {}
    if not isinstance(d, str):
        raise DimError(f"dimension must be an int or a symbol expression, got {type(d).__name__} {d!r}")
    text = d.strip()
    if not text:
        raise DimError("dimension expression is empty")
    poly: _Poly = {}
    pos = 0
    while pos < len(text):
        m = _TERM.match(text, pos)
        if not m or m.end() == pos:
            raise DimError(f"cannot parse dimension expression {d!r}")
        sign = -1 if m.group(1) == "-" else 1
        coef, syms = sign, []
        for factor in m.group(2).split("*"):
            factor = factor.strip()
            if factor.isdigit():
                coef *= int(factor)
            elif _SYMBOL.match(factor):
                syms.append(factor)
            else:
                raise DimError(f"bad factor {factor!r} in dimension expression {d!r}; expected a symbol name or an integer")
        key = tuple(sorted(syms))
        poly[key] = poly.get(key, 0) + coef
        pos = m.end()
    return {k: v for k, v in poly.items() if v}


def _format(poly: _Poly) -> Dim:
    terms = sorted(poly.items(), key=lambda kv: (len(kv[0]) == 0, kv[0]))
    if not terms:
        return 0
    if len(terms) == 1 and terms[0][0] == ():
        return terms[0][1]
    parts = []
    for syms, coef in terms:
        body = "*".join(syms)
        if not syms:
            text = str(abs(coef))
        elif abs(coef) == 1:
            text = body
        else:
            text = f"{abs(coef)}*{body}"
        sign = "-" if coef < 0 else "+"
        parts.append((sign, text))
    out = ("-" if parts[0][0] == "-" else "") + parts[0][1]
    for sign, text in parts[1:]:
        out += sign + text
    return out


def normalize_dim(d: Dim) -> Dim:
    """Return the canonical form of ``d``: an ``int``, or a canonical expression string."""
    if isinstance(d, int) and not isinstance(d, bool):
        return d
    if isinstance(d, str):
        return _normalize_text(d)
    if isinstance(d, np.integer):
        return int(d)
    return _format(_parse(d))


@lru_cache(maxsize=65536)
def _normalize_text(d: str) -> Dim:
    return _format(_parse(d))


def normalize_shape(shape: Iterable[Dim]) -> Shape:
    """Return ``shape`` as a tuple of canonical dimensions; negative ints are rejected."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise DimError(f"a shape must be a list of dims (ints or symbol expressions), got {type(shape).__name__} {shape!r}")
    out = []
    for d in shape:
        nd = normalize_dim(d)
        if isinstance(nd, int) and nd < 0:
            raise DimError(f"dimension {d!r} in shape {tuple(shape)!r} is negative")
        if isinstance(nd, int) and nd > MAX_SIZE:
            raise DimError(f"dimension {d!r} in shape {tuple(shape)!r} exceeds {MAX_SIZE} (2**48), the largest axis graphc accepts")
        out.append(nd)
    return tuple(out)


def dim_add(a: Dim, b: Dim) -> Dim:
    """Return the canonical dimension ``a + b``."""
    pa, pb = _parse(a), _parse(b)
    for k, v in pb.items():
        pa[k] = pa.get(k, 0) + v
    return _format({k: v for k, v in pa.items() if v})


def dim_sub(a: Dim, b: Dim) -> Dim:
    """Return the canonical dimension ``a - b`` (may be negative for some bindings)."""
    return dim_add(a, dim_mul(-1, b))


def dim_mul(a: Dim, b: Dim) -> Dim:
    """Return the canonical dimension ``a * b``."""
    pa, pb = _parse(a), _parse(b)
    out: _Poly = {}
    for ka, va in pa.items():
        for kb, vb in pb.items():
            key = tuple(sorted(ka + kb))
            out[key] = out.get(key, 0) + va * vb
    return _format({k: v for k, v in out.items() if v})


def dim_div(a: Dim, b: Dim) -> int | None:
    """The integer ``k`` with ``a == k * b`` (``4*seq / seq`` is 4), or ``None`` when there is none."""
    pa, pb = _parse(a), _parse(b)
    if not pb:
        return None
    if not pa:
        return 0
    mono, coef = next(iter(sorted(pb.items())))
    if pa.get(mono, 0) % coef:
        return None
    k = pa.get(mono, 0) // coef
    return k if k > 0 and normalize_dim(dim_mul(k, b)) == normalize_dim(a) else None


def dim_prod(dims: Iterable[Dim]) -> Dim:
    """Return the canonical product of ``dims`` (1 for none)."""
    out: Dim = 1
    for d in dims:
        out = dim_mul(out, d)
    return out


def dim_terms(d: Dim) -> list[tuple[tuple[str, ...], int]]:
    """The polynomial terms of ``d`` as ``[(symbols, coefficient), ...]`` in a stable order."""
    return sorted(_parse(d).items())


def dim_symbols(d: Dim) -> frozenset[str]:
    """Return the symbol names that occur in ``d``."""
    return frozenset(s for key in _parse(d) for s in key)


def is_symbol(d: Dim) -> bool:
    """True when ``d`` is a single bare symbol such as ``"seq"`` (bindable from an input)."""
    return isinstance(d, str) and bool(_SYMBOL.match(d.strip()))


def is_static(shape: Sequence[Dim]) -> bool:
    """True when every dimension of ``shape`` is an ``int``."""
    return all(isinstance(normalize_dim(d), int) for d in shape)


def dim_is_nonnegative(d: Dim) -> bool:
    """True when ``d`` is provably >= 0 for every binding (all coefficients non-negative)."""
    return all(v >= 0 for v in _parse(d).values())


def eval_dim(d: Dim, env: Mapping[str, int]) -> int:
    """Evaluate ``d`` with symbols bound by ``env``; an unbound symbol raises :class:`DimError`."""
    total = 0
    for syms, coef in _parse(d).items():
        term = coef
        for s in syms:
            if s not in env:
                raise DimError(f"symbolic dimension {s!r} (in {d!r}) is not bound; bound: {sorted(env) or 'none'}")
            term *= env[s]
        total += term
    return total


def eval_shape(shape: Sequence[Dim], env: Mapping[str, int]) -> tuple[int, ...]:
    """Evaluate every dimension of ``shape`` with :func:`eval_dim`."""
    return tuple(eval_dim(d, env) for d in shape)


def bind_shape(shape: Sequence[Dim], actual: Sequence[int], env: dict[str, int], what: str) -> None:
    """Bind the bare symbols of ``shape`` to ``actual`` in ``env`` and check every other dimension.

    Bare symbols are bound first (a symbol bound earlier must agree); then every
    dimension whose symbols are all bound must evaluate to the actual size.
    ``what`` names the value in error messages.  Use :func:`bind_shapes` to also
    solve symbols that occur only inside expressions (``past_seq`` in ``past_seq+seq``).
    """
    bind_shapes([(shape, actual, what)], env)


def bind_shapes(items: Sequence[tuple[Sequence[Dim], Sequence[int], str]], env: dict[str, int], require_all: bool = False) -> None:
    """Bind the symbols of several ``(shape, actual, what)`` triples in ``env``.

    Bare symbols bind directly; a symbol that occurs only inside an expression is
    solved when it is the one unbound symbol of a term linear in it
    (``past_seq+seq = 12`` with ``seq = 4`` gives ``past_seq = 8``).  Every dim
    is then checked.  With ``require_all`` a symbol that cannot be solved raises
    :class:`DimError` naming it and the dims it occurs in.
    """
    pending: list[tuple[Dim, int, str, int]] = []
    for shape, actual, what in items:
        if len(shape) != len(actual):
            raise DimError(f"{what}: expected rank {len(shape)} (shape {format_shape(shape)}), got rank {len(actual)} (shape {tuple(actual)})")
        for axis, (d, n) in enumerate(zip(shape, actual)):
            if is_symbol(d):
                s = str(d).strip()
                if s in env and env[s] != n:
                    raise DimError(f"{what}: symbolic dimension {s!r} is {n} here but was bound to {env[s]} earlier")
                env[s] = int(n)
            pending.append((d, int(n), what, axis))
    progress = True
    while progress:
        progress = False
        for d, n, what, axis in pending:
            unknown = [s for s in dim_symbols(d) if s not in env]
            if len(unknown) != 1:
                continue
            (s,) = unknown
            coef, rest = 0, 0
            for syms, c in _parse(d).items():
                if s in syms:
                    if syms != (s,):
                        break  # not linear in s (s*s or s*t): left to another dim
                    coef += c
                else:
                    term = c
                    for t in syms:
                        term *= env[t]
                    rest += term
            else:
                if coef and (n - rest) % coef == 0 and (n - rest) // coef >= 0:
                    env[s] = (n - rest) // coef
                    progress = True
                    continue
                raise DimError(f"{what}: axis {axis} is {n}, which no size of {s!r} makes equal to {d!r} (bound: {dict(sorted(env.items()))})")
    for d, n, what, axis in pending:
        if all(s in env for s in dim_symbols(d)):
            if eval_dim(d, env) != n:
                raise DimError(f"{what}: axis {axis} must be {d!r} = {eval_dim(d, env)}, got {n}")
        elif require_all:
            missing = sorted(s for s in dim_symbols(d) if s not in env)
            raise DimError(
                f"{what}: cannot size symbol(s) {missing} of dim {d!r} (axis {axis}) from the input shapes; bound: "
                f"{dict(sorted(env.items())) or 'none'}"
            )


def format_shape(shape: Sequence[Dim]) -> str:
    """Format a shape as ``[batch,32,seq,128]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def check_sizes(sizes: Mapping[str, object] | None, what: str = "sizes") -> dict[str, int]:
    """Validate a mapping of symbol name to size (an int >= 0) and return it as a plain dict.

    Raises :class:`DimError` naming the entry and what was expected, so a typo
    like ``{"seq": "abc"}`` fails where it is given, not deep inside a pass.
    """
    if sizes is None:
        return {}
    if not isinstance(sizes, Mapping):
        raise DimError(f"{what} must be a mapping from symbol name to int, got {type(sizes).__name__}")
    out: dict[str, int] = {}
    for name, value in sizes.items():
        if not isinstance(name, str) or not _SYMBOL.fullmatch(name):
            raise DimError(f"{what}: {name!r} is not a symbol name (a letter or underscore, then letters, digits, underscores)")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise DimError(f"{what}: size of {name!r} must be an int, got {type(value).__name__} {value!r}")
        if value < 0:
            raise DimError(f"{what}: size of {name!r} must be >= 0, got {value}")
        out[name] = int(value)
    return out
