"""Symbolic dims that a model's ops prove equal: unified at import, checked when the model runs.

Exporters name dims independently: ``attention_mask [batch, total_seq]`` and
``input_ids [batch, seq]`` of a model without a cache, where ``total_seq`` must
equal ``seq`` for the scores and the mask to broadcast; a dynamo export calls the
mask length ``s53`` where it is ``past_seq + seq``; an op graphc carries through
opaquely gets dims of its own (``unk__0``); onnxruntime-genai names a cache
axis ``kv_cache_dim`` that meets a constant 32.  Where two dims meet in a
broadcast, a concat, an einsum label or a MatMul batch axis and differ, and one
of them is a free symbol (a graph input's or an opaque output's, not yet tied
to anything), graphc assumes them equal, in one import pass: the node that met
them is converted again after the symbol is replaced by the other dim in
everything imported so far (``Graph.map_dims`` on shapes and op attributes, and
the importer's lazy shape values) and in every dim declared later.  When an
earlier ``Div`` or ``Equal`` of shape values could not be decided with the old
symbol (``(b*t) / b2`` before ``b2`` is ``b``), the import goes back to that node
(a checkpoint of its state there) and converts on from it.  A replaced input dim becomes the
other dim in the graph's declared input shape, so every run checks it
(``lowering.check_inputs`` binds all inputs and refuses sizes that disagree),
and ``graphc info model.onnx`` shows it in the input shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from ..dims import (
    Dim,
    dim_add,
    dim_atoms,
    dim_mul,
    dim_prod,
    dim_sub,
    dim_substitute,
    dim_symbols,
    dim_terms,
    is_symbol,
    min_max_args,
    normalize_dim,
)

__all__ = ["DimConflict", "substitute", "conflict_in_broadcast", "conflict_in_pairs", "MAX_UNIFICATIONS"]

MAX_UNIFICATIONS = 64
"""Unifications one import may make before it gives up and reports the mismatch."""


class DimConflict(Exception):
    """Two dims that must be equal differ, and at least one of them is a free symbol (internal: the import unifies them)."""

    def __init__(self, a: Dim, b: Dim, error: Exception) -> None:
        super().__init__(f"{a!r} vs {b!r}")
        self.a, self.b, self.error = a, b, error


def substitute(d: Dim, aliases: Mapping[str, Dim]) -> Dim:
    """``d`` with every aliased symbol or ``min``/``max`` atom replaced by its dim (aliases may chain; cycles cannot
    arise, see :func:`choose`)."""
    for _ in range(len(aliases) + 1):
        if not aliases or not (dim_symbols(d) & aliases.keys() or set(dim_atoms(d)) & aliases.keys()):
            return d
        d = dim_substitute(d, aliases)
    return d


def _free(d: Dim, free: Mapping[str, int]) -> str | None:
    nd = normalize_dim(d)
    return nd if isinstance(nd, str) and is_symbol(nd) and nd in free else None


def conflict_in_pairs(
    pairs: Iterable[tuple[Dim, Dim]], free: Mapping[str, int], atoms: bool = True, broadcast: bool = False
) -> tuple[str, Dim] | None:
    """The first pair of unequal dims (neither 1) of which one is a free symbol, as ``(symbol, what it must equal)``;
    with ``atoms``, else a ``min``/``max`` atom and the argument that makes them equal (where onnxruntime would fail on
    unequal dims: a broadcast, a concat; not a Reshape's ``-1``, which any size satisfies)."""
    for x, y in pairs:
        x, y = normalize_dim(x), normalize_dim(y)
        if x == y or x == 1 or y == 1:
            continue
        choice = choose(x, y, free, atoms, broadcast)
        if choice is not None:
            return choice
    return None


def conflict_in_broadcast(shapes: Sequence[Sequence[Dim]], free: Mapping[str, int]) -> tuple[str, Dim] | None:
    """A unifiable conflict among shapes that must broadcast together (aligned from the last axis)."""
    rank = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    pairs = [(a[k], b[k]) for k in range(rank) for i, a in enumerate(padded) for b in padded[i + 1 :]]
    return conflict_in_pairs(pairs, free, broadcast=True)


def choose(x: Dim, y: Dim, free: Mapping[str, int], atoms: bool = True, broadcast: bool = False) -> tuple[str, Dim] | None:
    """Which symbol to replace by which dim: a free symbol not in the other dim (no cycle); of two, the one met later.

    ``free`` maps each free symbol to the order in which the import met it (graph inputs first, in order; opaque
    outputs after), so ``input_ids``' ``seq`` survives and ``attention_mask``'s ``total_seq`` is replaced.
    """
    fx, fy = _free(x, free), _free(y, free)
    options = [(sym, other) for sym, other in ((fx, y), (fy, x)) if sym is not None and sym not in dim_symbols(other)]
    if not options:  # expressions: solve x - y = 0 for a free symbol of coefficient +-1 (s15 + s70 = s70 + s89 -> s15 = s89),
        # after dividing out a factor every term shares (2*unk = 2*batch*seq -> unk = batch*seq: a mixture-of-experts' top-2 rows)
        terms = dim_terms(dim_sub(x, y))
        common = math.gcd(*(abs(c) for _, c in terms)) if terms else 1
        terms = [(t, c // common) for t, c in terms] if common > 1 else terms
        for syms, coef in terms:
            if len(syms) == 1 and syms[0] in free and abs(coef) == 1 and all(syms[0] not in t for t, _ in terms if t != syms):
                rest: Dim = 0
                for t, c in terms:
                    if t != syms:
                        rest = dim_add(rest, dim_mul(-c * coef, dim_prod(t)))
                if syms[0] not in dim_symbols(rest):  # s = max(0, s-15) + t is no solution
                    options.append((syms[0], normalize_dim(rest)))
    if not options:  # the same expression of two free symbols (s - max(0,s-15) vs t - max(0,t-15)): s = t
        for a in sorted(dim_symbols(x) - dim_symbols(y)):
            for b in sorted(dim_symbols(y) - dim_symbols(x)):
                if a in free and b in free and normalize_dim(dim_substitute(x, {a: b})) == y:
                    options.append((a, b) if free[a] > free[b] else (b, a))
    if not options:
        return _assumed_atom(x, y, broadcast) if atoms else None
    return max(options, key=lambda o: free[o[0]])


def _assumed_atom(x: Dim, y: Dim, broadcast: bool = False) -> tuple[str, Dim] | None:
    """A ``min``/``max`` atom and the argument it must equal for ``x == y`` (``s+t`` vs ``s-max(0,s-15)+t``: the
    model is defined only where ``max(0,s-15)`` is ``0``, which the graph then assumes and every run checks).

    In a ``broadcast`` an argument that makes either side 1 comes first: MPT slices its ALiBi bias's one query row
    from ``max(0, 1-s)``, which leaves one row (broadcast over the ``s`` queries) wherever ``s >= 1``, not ``s`` rows."""
    candidates = []
    for atom in dim_atoms(x) + dim_atoms(y):
        found = min_max_args(atom)
        candidates += [(atom, arg) for arg in (found[1] if found is not None else ())]
    if broadcast:
        for atom, arg in candidates:
            if 1 in (normalize_dim(dim_substitute(x, {atom: arg})), normalize_dim(dim_substitute(y, {atom: arg}))):
                return atom, arg
    for atom, arg in candidates:
        if normalize_dim(dim_substitute(x, {atom: arg})) == normalize_dim(dim_substitute(y, {atom: arg})):
            return atom, arg
    return None
