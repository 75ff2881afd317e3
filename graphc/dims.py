"""Symbolic dimensions.

A dimension (:data:`Dim`) is either a non-negative ``int`` or a string naming a
polynomial over symbols with integer coefficients, for example ``"batch"``,
``"past_seq+seq"`` or ``"4*seq"``.  Strings are kept in a canonical form, so two
dimensions are equal exactly when their canonical strings are equal.  Symbols are
bound to integers at run time (:func:`bind_shape`) and expressions evaluated
(:func:`eval_dim`).  Sums and products are what attention graphs mostly need: a
concatenation adds, a head split or merge multiplies.  ``min(a,b)`` and ``max(a,b)``
are atoms inside the polynomial (a factor like a symbol): a sliding-window cache
keeps ``min(past_seq+seq,15)`` keys.  An atom's arguments are canonical dims and
an atom that can be decided (``max(seq,0)`` is ``seq``) is simplified away.
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
    "dim_min",
    "dim_max",
    "dim_substitute",
    "min_max_args",
    "dim_atoms",
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
_ATOM = re.compile(r"(min|max)\(")
_MAX_TEXT, _MAX_NESTING, _MAX_ARGS = 4096, 16, 16
"""Bounds on a dim expression (a model file's ``dim_param`` is one): real ones are a few terms and one or two atoms."""

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
    text = re.sub(r"\s+", "", d)
    if not text:
        raise DimError("dimension expression is empty")
    if len(text) > _MAX_TEXT:
        raise DimError(f"dimension expression of {len(text)} characters; graphc reads at most {_MAX_TEXT}: {text[:60]!r}...")
    poly: _Poly = {}
    for sign, term in _split_terms(text, d):
        tpoly: _Poly = {(): sign}
        for factor in _split_top(term, "*"):
            tpoly = _poly_mul(tpoly, _parse_factor(factor, d))
        for k, v in tpoly.items():
            poly[k] = poly.get(k, 0) + v
    return {k: v for k, v in poly.items() if v}


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _split_terms(text: str, d: Dim) -> list[tuple[int, str]]:
    """The signed terms of ``text`` (split at ``+``/``-`` outside parentheses)."""
    terms, depth, start, sign = [], 0, 0, 1
    if text[0] in "+-":
        sign, start = (-1 if text[0] == "-" else 1), 1
    for i in range(start, len(text)):
        ch = text[i]
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            raise DimError(f"unbalanced ')' in dimension expression {d!r}")
        if depth > _MAX_NESTING:
            raise DimError(f"min/max nested more than {_MAX_NESTING} deep in dimension expression {str(d)[:60]!r}...")
        if ch in "+-" and depth == 0:
            terms.append((sign, text[start:i]))
            sign, start = (-1 if ch == "-" else 1), i + 1
    if depth:
        raise DimError(f"unbalanced '(' in dimension expression {d!r}")
    terms.append((sign, text[start:]))
    if any(not t for _, t in terms):
        raise DimError(f"cannot parse dimension expression {d!r}")
    return terms


def _parse_factor(factor: str, d: Dim) -> _Poly:
    if factor.isdigit():
        return {(): int(factor)} if int(factor) else {}
    if _SYMBOL.match(factor):
        return {(factor,): 1}
    m = _ATOM.match(factor)
    if m and factor.endswith(")"):
        args = _split_top(factor[m.end() : -1], ",")
        if len(args) > _MAX_ARGS:
            raise DimError(f"{m.group(1)} of {len(args)} arguments in dimension expression {str(d)[:60]!r}...; graphc reads at most {_MAX_ARGS}")
        if len(args) >= 2 and all(args):
            return _min_max_poly(m.group(1), [_normalize_text(x) for x in args])
    raise DimError(f"bad factor {factor!r} in dimension expression {d!r}; expected a symbol name, an integer, min(a,b,...) or max(a,b,...)")


def _poly_mul(pa: _Poly, pb: _Poly) -> _Poly:
    out: _Poly = {}
    for ka, va in pa.items():
        for kb, vb in pb.items():
            key = tuple(sorted(ka + kb))
            out[key] = out.get(key, 0) + va * vb
    return {k: v for k, v in out.items() if v}


def _min_max_poly(kind: str, args: Sequence[Dim]) -> _Poly:
    """``min(...)``/``max(...)`` of canonical dims as a polynomial: nested atoms of the same kind flattened, an argument
    that can never be the result (``min(s+15,15)`` is ``15``) dropped, one atom left only where the order is not known."""
    flat: list[Dim] = []
    for x in args:
        inner = min_max_args(x)
        flat.extend(inner[1] if inner is not None and inner[0] == kind else (x,))
    keep: list[Dim] = []
    for i, x in enumerate(flat):
        # x is dropped when another argument is never worse than it (of two equal arguments, the first stays)
        beaten = any(
            j != i and dim_is_nonnegative(dim_sub(x, y) if kind == "min" else dim_sub(y, x)) and (x != y or j < i) for j, y in enumerate(flat)
        )
        if not beaten:
            keep.append(x)
    if len(keep) == 1:
        return _parse(keep[0])
    if len(keep) > _MAX_ARGS:
        raise DimError(f"{kind} of {len(keep)} dims that cannot be ordered; graphc keeps at most {_MAX_ARGS}")
    return {(f"{kind}({','.join(sorted(str(x) for x in keep))})",): 1}


def _min_max(kind: str, args: Sequence[Dim]) -> Dim:
    return _format(_min_max_poly(kind, [normalize_dim(x) for x in args]))


def _atom_args(factor: str) -> tuple[str, tuple[Dim, ...]] | None:
    """``(kind, arguments)`` for a ``min``/``max`` factor, else ``None`` (a plain symbol)."""
    m = _ATOM.match(factor)
    if not m:
        return None
    return m.group(1), tuple(_normalize_text(x) for x in _split_top(factor[m.end() : -1], ","))


def min_max_args(d: Dim) -> tuple[str, tuple[Dim, ...]] | None:
    """``("min" | "max", arguments)`` when ``d`` is exactly one ``min(...)``/``max(...)`` atom, else ``None``."""
    terms = _parse(d) if isinstance(d, str) else {}
    if len(terms) != 1:
        return None
    ((key, coef),) = terms.items()
    return _atom_args(key[0]) if coef == 1 and len(key) == 1 else None


def dim_atoms(d: Dim) -> list[str]:
    """The ``min``/``max`` atoms of ``d``, outermost first, each once (``["max(0,s-15)"]`` for ``s-max(0,s-15)``)."""
    out: list[str] = []
    for key in _parse(d):
        for f in key:
            atom = _atom_args(f)
            if atom is not None and f not in out:
                out.append(f)
                out.extend(a for x in atom[1] for a in dim_atoms(x) if a not in out)
    return out


def _factor_symbols(factor: str) -> frozenset[str]:
    atom = _atom_args(factor)
    return frozenset({factor}) if atom is None else frozenset(s for x in atom[1] for s in dim_symbols(x))


def _factor_value(factor: str, env: Mapping[str, int], d: Dim) -> int:
    atom = _atom_args(factor)
    if atom is None:
        if factor not in env:
            raise DimError(f"symbolic dimension {factor!r} (in {d!r}) is not bound; bound: {sorted(env) or 'none'}")
        return env[factor]
    kind, args = atom
    values = [eval_dim(x, env) for x in args]
    return min(values) if kind == "min" else max(values)


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
    return _format(_poly_mul(_parse(a), _parse(b)))


def dim_min(a: Dim, b: Dim) -> Dim:
    """The canonical dimension ``min(a, b)`` (``a`` or ``b`` itself where one is never larger)."""
    return _min_max("min", (a, b))


def dim_max(a: Dim, b: Dim) -> Dim:
    """The canonical dimension ``max(a, b)`` (``a`` or ``b`` itself where one is never smaller)."""
    return _min_max("max", (a, b))


def dim_substitute(d: Dim, values: Mapping[str, Dim]) -> Dim:
    """``d`` with each symbol in ``values`` replaced by its dim (inside ``min``/``max`` atoms too), simplified; a key may
    also be a whole atom (``{"max(0,s-15)": 0}``)."""
    out: Dim = 0
    for syms, coef in _parse(d).items():
        term: Dim = coef
        for f in syms:
            atom = _atom_args(f)
            if atom is None or f in values:
                term = dim_mul(term, values.get(f, f))
            else:
                term = dim_mul(term, _min_max(atom[0], [dim_substitute(x, values) for x in atom[1]]))
        out = dim_add(out, term)
    return normalize_dim(out)


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
    """Return the symbol names that occur in ``d`` (inside ``min``/``max`` too)."""
    return frozenset(s for key in _parse(d) for f in key for s in _factor_symbols(f))


def is_symbol(d: Dim) -> bool:
    """True when ``d`` is a single bare symbol such as ``"seq"`` (bindable from an input)."""
    return isinstance(d, str) and bool(_SYMBOL.match(d.strip()))


def is_static(shape: Sequence[Dim]) -> bool:
    """True when every dimension of ``shape`` is an ``int``."""
    return all(isinstance(normalize_dim(d), int) for d in shape)


def dim_is_nonnegative(d: Dim) -> bool:
    """True when ``d`` is provably >= 0 for every binding of its symbols (sizes, so >= 0).

    A polynomial without ``min``/``max`` is when every coefficient is.  A ``min``/``max`` term is taken apart:
    ``r + k*max(a,b)`` (``k > 0``) is at least ``r + k*a`` and at least ``r + k*b``, so one of those suffices;
    ``r + k*min(a,b)`` needs both (and the other way round for ``k < 0``): ``s - max(0,s-15)`` is non-negative.
    """
    return _nonnegative(_parse(d))


def _nonnegative(poly: _Poly, depth: int = 0) -> bool:
    return _nonnegative_cached(tuple(sorted(poly.items())), depth)


@lru_cache(maxsize=65536)
def _nonnegative_cached(items: tuple[tuple[tuple[str, ...], int], ...], depth: int) -> bool:
    poly = dict(items)
    for key, k in items:
        atoms = [f for f in key if _ATOM.match(f)]
        if not atoms:
            continue
        if len(atoms) > 1 or depth >= _MAX_NONNEGATIVE_DEPTH:
            return False  # a product of atoms, or nested too deep: not decided (the answer stays "not proven")
        others = tuple(g for g in key if g != atoms[0])  # symbols, >= 0
        parsed = _atom_args(atoms[0])
        if parsed is None:  # not reached: atoms match _ATOM
            return False
        kind, args = parsed
        rest = {m: c for m, c in poly.items() if m != key}

        def with_arg(x: Dim) -> bool:
            combined = dict(rest)
            for m, c in _poly_mul({others: k}, _parse(x)).items():
                combined[m] = combined.get(m, 0) + c
            return _nonnegative({m: c for m, c in combined.items() if c}, depth + 1)

        return all(map(with_arg, args)) if (kind == "min") == (k > 0) else any(map(with_arg, args))
    return all(v >= 0 for v in poly.values())


_MAX_NONNEGATIVE_DEPTH = 6


def eval_dim(d: Dim, env: Mapping[str, int]) -> int:
    """Evaluate ``d`` with symbols bound by ``env``; an unbound symbol raises :class:`DimError`."""
    total = 0
    for syms, coef in _parse(d).items():
        term = coef
        for f in syms:
            term *= _factor_value(f, env, d)
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
                elif any(s in _factor_symbols(f) for f in syms):
                    break  # s inside min/max: left to another dim
                else:
                    term = c
                    for f in syms:
                        term *= _factor_value(f, env, d)
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
