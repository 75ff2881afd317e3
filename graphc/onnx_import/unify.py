"""Symbolic dims that a model's ops prove equal: unified at import, checked when the model runs.

Exporters name dims independently: ``attention_mask [batch, total_seq]`` and
``input_ids [batch, seq]`` of a model without a cache, where ``total_seq`` must
equal ``seq`` for the scores and the mask to broadcast; a dynamo export calls the
mask length ``s53`` where it is ``past_seq + seq``; an op graphc carries through
opaquely gets dims of its own (``unk__0``); onnxruntime-genai names a cache
axis ``kv_cache_dim`` that meets a constant 32.  Where two dims meet in a
broadcast, a concat, an einsum label or a MatMul batch axis and differ, and one
of them is a free symbol (a graph input's or an opaque output's, not yet tied
to anything), graphc assumes them equal: the import starts again with that
symbol replaced by the other dim everywhere.  A replaced input dim becomes the
other dim in the graph's declared input shape, so every run checks it
(``lowering.check_inputs`` binds all inputs and refuses sizes that disagree),
and ``graphc info model.onnx`` shows it in the input shapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..dims import Dim, dim_add, dim_mul, dim_prod, dim_sub, dim_symbols, dim_terms, is_symbol, normalize_dim

__all__ = ["DimConflict", "substitute", "conflict_in_broadcast", "conflict_in_pairs", "MAX_UNIFICATIONS"]

MAX_UNIFICATIONS = 64
"""Restarts an import may take to unify dims before it gives up and reports the mismatch."""


class DimConflict(Exception):
    """Two dims that must be equal differ, and at least one of them is a free symbol (internal: the import restarts)."""

    def __init__(self, a: Dim, b: Dim, error: Exception) -> None:
        super().__init__(f"{a!r} vs {b!r}")
        self.a, self.b, self.error = a, b, error


def substitute(d: Dim, aliases: Mapping[str, Dim]) -> Dim:
    """``d`` with every aliased symbol replaced by its dim (aliases may chain; cycles cannot arise, see :func:`choose`)."""
    for _ in range(len(aliases) + 1):
        if not aliases or not (dim_symbols(d) & aliases.keys()):
            return d
        out: Dim = 0
        for syms, coef in dim_terms(d):
            term: Dim = coef
            for s in syms:
                term = dim_mul(term, aliases.get(s, s))
            out = dim_add(out, term)
        d = normalize_dim(out)
    return d


def _free(d: Dim, free: Mapping[str, int]) -> str | None:
    nd = normalize_dim(d)
    return nd if isinstance(nd, str) and is_symbol(nd) and nd in free else None


def conflict_in_pairs(pairs: Iterable[tuple[Dim, Dim]], free: Mapping[str, int]) -> tuple[str, Dim] | None:
    """The first pair of unequal dims (neither 1) of which one is a free symbol, as ``(symbol, what it must equal)``."""
    for x, y in pairs:
        x, y = normalize_dim(x), normalize_dim(y)
        if x == y or x == 1 or y == 1:
            continue
        choice = choose(x, y, free)
        if choice is not None:
            return choice
    return None


def conflict_in_broadcast(shapes: Sequence[Sequence[Dim]], free: Mapping[str, int]) -> tuple[str, Dim] | None:
    """A unifiable conflict among shapes that must broadcast together (aligned from the last axis)."""
    rank = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    pairs = [(a[k], b[k]) for k in range(rank) for i, a in enumerate(padded) for b in padded[i + 1 :]]
    return conflict_in_pairs(pairs, free)


def choose(x: Dim, y: Dim, free: Mapping[str, int]) -> tuple[str, Dim] | None:
    """Which symbol to replace by which dim: a free symbol not in the other dim (no cycle); of two, the one met later.

    ``free`` maps each free symbol to the order in which the import met it (graph inputs first, in order; opaque
    outputs after), so ``input_ids``' ``seq`` survives and ``attention_mask``'s ``total_seq`` is replaced.
    """
    fx, fy = _free(x, free), _free(y, free)
    options = [(sym, other) for sym, other in ((fx, y), (fy, x)) if sym is not None and sym not in dim_symbols(other)]
    if not options:  # expressions: solve x - y = 0 for a free symbol of coefficient +-1 (s15 + s70 = s70 + s89 -> s15 = s89)
        terms = dim_terms(dim_sub(x, y))
        for syms, coef in terms:
            if len(syms) == 1 and syms[0] in free and abs(coef) == 1 and all(syms[0] not in t for t, _ in terms if t != syms):
                rest: Dim = 0
                for t, c in terms:
                    if t != syms:
                        rest = dim_add(rest, dim_mul(-c * coef, dim_prod(t)))
                options.append((syms[0], normalize_dim(rest)))
    if not options:
        return None
    return max(options, key=lambda o: free[o[0]])
