"""What a query may see: one value for the causal offset, the sliding window, the user mask and rows that see no key.

Every part of graphc that needs to know which keys a query row sees asks a :class:`Visibility`: the ``Attention``
op carries one, the importer's lazy triangles and the optimizer's mask reading both end in one (through
:class:`KeyBound` half-planes and :meth:`Visibility.from_bounds`), the kernels take its per-row key ranges
(:meth:`Visibility.key_ranges`), the ONNX forms and targets compare its :attr:`Visibility.features` with what they
support, and the reference semantics is :meth:`Visibility.hidden`.

Positions count keys over the past and the new keys together: query ``i`` (the ``offset + i``-th token when a cache of
``offset`` keys precedes it) sees key ``j`` iff ``j <= i + offset`` and, with a window ``W``, ``j > i + offset - W``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .dims import Dim, dim_add, dim_is_nonnegative, dim_sub, eval_dim, normalize_dim
from .errors import OpError

__all__ = ["Visibility", "KeyBound", "VisibilityError", "MASK_KINDS", "EMPTY_ROWS", "FEATURES"]

MASK_KINDS = ("none", "bool", "additive")
"""The user mask an attention takes: none, a bool keep-mask (True keeps a key), or an additive mask or bias (``-inf`` hides)."""

EMPTY_ROWS = ("zero", "mean")
"""What a row that sees no key gives: zeros (ONNX's convention), or the mean of V over every key (what a finite fill such as
transformers' ``finfo(dtype).min`` gives: every score of the row becomes the fill, so its softmax is uniform)."""

FEATURES = {
    "causal": "a causal mask",
    "window": "a sliding window",
    "bool_mask": "a bool mask",
    "additive_mask": "an additive mask",
    "query_mask": "a mask that varies per query row",
    "mean_rows": "rows with no visible key giving the mean of V",
    "unbounded_offset": "a causal offset that may be negative (rows that see no key)",
    "softcap": "a softcap",
}
"""Every feature :attr:`Visibility.features` (and ``Attention.features``) may name, with its description."""


class VisibilityError(OpError):
    """A :class:`Visibility` is malformed, or two cannot be combined into one."""


@dataclass(frozen=True)
class KeyBound:
    """A half-plane of the (query ``i``, key ``j``) grid that a mask keeps: ``j <= i + at`` (``upper``) or ``j >= i + at``."""

    upper: bool
    at: Dim

    def complement(self) -> KeyBound:
        """The keys this bound hides, as the bound that keeps them: ``not (j <= i + u)`` is ``j >= i + u + 1``."""
        return KeyBound(not self.upper, dim_add(self.at, 1) if self.upper else dim_sub(self.at, 1))


def _is_window(w: object) -> bool:
    return bool(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 1)


@dataclass(frozen=True)
class Visibility:
    """Which keys each query row sees.

    ``causal_offset``: ``None`` for no causal mask, else key ``j`` is hidden from query ``i`` when ``j > i + offset``
    (with a KV cache of past length P the offset is P).  ``window`` (with a causal mask): also hides ``j <= i + offset -
    window``, so each query sees its last ``window`` keys.  ``mask``: the kind of user mask the attention takes
    (:data:`MASK_KINDS`; an additive mask is also the slot of a bias such as ALiBi).  ``empty_rows``: what a row that
    sees no key gives (:data:`EMPTY_ROWS`).
    """

    causal_offset: Dim | None = None
    window: int | None = None
    mask: str = "none"
    empty_rows: str = "zero"

    def __post_init__(self) -> None:
        if self.causal_offset is not None:
            if isinstance(self.causal_offset, bool) or not isinstance(self.causal_offset, (int, np.integer, str)):
                raise VisibilityError(f"Visibility: causal_offset must be an int, a dim name or None, got {self.causal_offset!r}")
            object.__setattr__(self, "causal_offset", normalize_dim(self.causal_offset))
        if self.window is not None:
            if not _is_window(self.window):
                raise VisibilityError(f"Visibility: window must be an int >= 1 or None, got {self.window!r}")
            if self.causal_offset is None:
                raise VisibilityError("Visibility: a sliding window needs a causal mask (causal_offset)")
            object.__setattr__(self, "window", int(self.window))
        if self.mask not in MASK_KINDS:
            raise VisibilityError(f"Visibility: mask must be one of {MASK_KINDS}, got {self.mask!r}")
        if self.empty_rows not in EMPTY_ROWS:
            raise VisibilityError(f"Visibility: empty_rows must be one of {EMPTY_ROWS}, got {self.empty_rows!r}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def causal(cls, offset: Dim = 0, window: int | None = None, mask: str = "none", empty_rows: str = "zero") -> Visibility:
        """Causal attention: query ``i`` sees keys ``j <= i + offset`` (and its last ``window`` keys only, with a window)."""
        return cls(offset, window, mask, empty_rows)

    @classmethod
    def from_bounds(cls, bounds: Sequence[KeyBound], mask: str = "none", empty_rows: str = "zero") -> Visibility | None:
        """The visibility the conjunction of ``bounds`` keeps: the tightest upper bound is the causal offset, the tightest
        lower bound the window's edge.  ``None`` when it has no single form: a lower bound without an upper one, bounds
        whose order is not known (symbolic), or a window that keeps no key."""
        uppers = [b.at for b in bounds if b.upper]
        lowers = [b.at for b in bounds if not b.upper]
        upper, lower = _tightest(uppers, smallest=True), _tightest(lowers, smallest=False)
        if (uppers and upper is None) or (lowers and lower is None) or (lower is not None and upper is None):
            return None
        window = None
        if lower is not None and upper is not None:
            w = normalize_dim(dim_add(dim_sub(upper, lower), 1))
            if not isinstance(w, int) or w < 1:
                return None
            window = w
        return cls(upper, window, mask, empty_rows)

    def bounds(self) -> tuple[KeyBound, ...]:
        """The half-planes this visibility keeps by position (none without a causal mask)."""
        if self.causal_offset is None:
            return ()
        upper = KeyBound(True, self.causal_offset)
        if self.window is None:
            return (upper,)
        return upper, KeyBound(False, normalize_dim(dim_add(dim_sub(self.causal_offset, self.window), 1)))

    def __and__(self, other: Visibility) -> Visibility:
        """What a query sees under both: the tighter positional bounds, the masks combined (a bool mask with an additive
        one is an additive mask, ``-inf`` where the bool hides).  A visibility that hides nothing leaves the other as
        it is; otherwise both must agree on what a row with no visible key gives (:class:`VisibilityError`)."""
        if self.hides_nothing_by_itself:
            return other
        if other.hides_nothing_by_itself:
            return self
        if self.empty_rows != other.empty_rows:
            raise VisibilityError(f"one mask gives rows with no visible key the {self.empty_rows} of V, another the {other.empty_rows}")
        kinds = {self.mask, other.mask} - {"none"}
        mask = "none" if not kinds else kinds.pop() if len(kinds) == 1 else "additive"
        both = Visibility.from_bounds(self.bounds() + other.bounds(), mask, self.empty_rows)
        if both is None:
            why = "their order is not known, or together they hide every key"
            raise VisibilityError(f"the causal bounds of {self.describe()} and {other.describe()} have no one form: {why}")
        return both

    def shifted(self, keys: Dim) -> Visibility:
        """The same visibility with ``keys`` more keys in front that every query sees (a past prepended to the keys)."""
        if self.causal_offset is None:
            return self
        return replace(self, causal_offset=normalize_dim(dim_add(self.causal_offset, keys)))

    def at(self, dims: Mapping[str, int]) -> Visibility:
        """This visibility with a symbolic causal offset evaluated under ``dims``."""
        if self.causal_offset is None or isinstance(self.causal_offset, int):
            return self
        return replace(self, causal_offset=eval_dim(self.causal_offset, dims))

    def filled(self, finite: bool) -> Visibility:
        """This visibility under a mask's fill: a finite one (``finfo.min``) leaves a row whose every key it hides uniform,
        the mean of V; ``-inf`` leaves zeros.  The mean only where some row may see no key: elsewhere the two agree, and
        zeros are what every form carries."""
        zero = replace(self, empty_rows="zero")
        return replace(zero, empty_rows="mean") if finite and zero.may_hide_whole_rows() else zero

    def dims(self) -> tuple[Dim, ...]:
        """The dims this visibility holds (its causal offset)."""
        return () if self.causal_offset is None else (self.causal_offset,)

    def map_dims(self, fn: Callable[[Dim], Dim]) -> Visibility:
        """This visibility with ``fn`` applied to its dims (a renamed or substituted symbol)."""
        return self if self.causal_offset is None else replace(self, causal_offset=fn(self.causal_offset))

    # ------------------------------------------------------------------ questions
    @property
    def hides_nothing_by_itself(self) -> bool:
        """No causal mask and no user mask: every query sees every key."""
        return self.causal_offset is None and self.mask == "none"

    @property
    def is_causal(self) -> bool:
        """True with a causal mask."""
        return self.causal_offset is not None

    @property
    def has_mask(self) -> bool:
        """True when a user mask is an input."""
        return self.mask != "none"

    def may_hide_whole_rows(self, queries: Dim | None = None, keys: Dim | None = None) -> bool:
        """True when some query row may see no key: a user mask, a finite fill's mean rows, or a causal offset that may be
        negative; given the ``queries`` and ``keys`` counts, also a window that may start past the last key."""
        return self.empty_rows != "zero" or self.has_mask or "unbounded_offset" in self.features(None, queries, keys)

    def features(self, mask_shape: Sequence[Dim] | None = None, queries: Dim | None = None, keys: Dim | None = None) -> frozenset[str]:
        """The :data:`FEATURES` this visibility uses; ``mask_shape`` (the mask input's shape) adds ``query_mask`` when the
        mask varies per query row; ``queries`` and ``keys`` (the counts) let ``unbounded_offset`` also name a window that
        may start past the last key (the last query sees keys after ``queries - 1 + offset - window``)."""
        out = set()
        if self.causal_offset is not None:
            out.add("causal")
            if not dim_is_nonnegative(self.causal_offset) or not self._window_reaches_keys(queries, keys):
                out.add("unbounded_offset")
        if self.window is not None:
            out.add("window")
        if self.mask != "none":
            out.add(f"{self.mask}_mask")
            if mask_shape is not None and len(mask_shape) >= 2 and normalize_dim(mask_shape[-2]) != 1:
                out.add("query_mask")
        if self.empty_rows == "mean":
            out.add("mean_rows")
        return frozenset(out)

    def _window_reaches_keys(self, queries: Dim | None, keys: Dim | None) -> bool:
        """Whether the last query's window provably holds a key (``keys + window - 1 >= queries + offset``); true without
        a window or without the counts."""
        if self.window is None or queries is None or keys is None or self.causal_offset is None:
            return True
        return dim_is_nonnegative(dim_sub(dim_add(keys, self.window - 1), dim_add(queries, self.causal_offset)))

    def aligned_to(self, past: Dim) -> bool:
        """True when the causal mask is aligned to a cache of ``past`` keys (the offset is the past length)."""
        return self.causal_offset is not None and normalize_dim(self.causal_offset) == normalize_dim(past)

    def keys_are(self, keys: Dim, queries: Dim) -> bool:
        """True when ``keys`` is the ``queries`` plus the causal offset (the last query sees the last key)."""
        return self.causal_offset is not None and normalize_dim(keys) == normalize_dim(dim_add(queries, self.causal_offset))

    def hides_nothing(self, queries: Dim, keys: Dim) -> bool:
        """True when the positional bounds provably hide no key of a ``queries x keys`` grid (static sizes): the first query
        sees the last key, and the last query's window still reaches key 0."""
        if self.causal_offset is None:
            return True
        off = self.causal_offset
        if not (isinstance(keys, int) and isinstance(off, int) and off >= keys - 1):
            return False
        return self.window is None or (isinstance(queries, int) and queries - 1 + off - self.window < 0)

    def describe(self, masks: Sequence[str] = ()) -> str:
        """One line: what the queries see (``masks``: the mask values' names, to name with the mask kind)."""
        parts = [f"causal (offset {self.causal_offset})" if self.causal_offset is not None else "not causal"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.mask != "none":
            named = f" {masks[0]!r}" + (f" and {len(masks) - 1} more" if len(masks) > 1 else "") if masks else ""
            parts.append(f"{self.mask} mask{named}")
        if self.empty_rows != "zero":
            parts.append(f"rows with no visible key: the {self.empty_rows} of V")
        return ", ".join(parts)

    # ------------------------------------------------------------------ semantics
    def key_ranges(self, rows: range | int, keys: int, dims: Mapping[str, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per query row of ``rows``, the keys ``lo <= j < hi`` its position lets it see (int64 arrays; ``lo >= hi``: none)."""
        rows = range(rows) if isinstance(rows, int) else rows
        i = np.arange(rows.start, rows.stop, rows.step, dtype=np.int64)
        if self.causal_offset is None:
            return np.zeros_like(i), np.full_like(i, keys)
        last = i + eval_dim(self.causal_offset, dims or {})  # np.minimum/np.maximum, not np.clip: 3x faster on decode's one row
        hi = np.minimum(np.maximum(last + 1, 0), keys)
        lo = np.zeros_like(i) if self.window is None else np.minimum(np.maximum(last - self.window + 1, 0), keys)
        return lo, hi

    def key_span(self, rows: range, keys: int, dims: Mapping[str, int] | None = None) -> tuple[int, int]:
        """The keys ``lo <= j < hi`` some row of ``rows`` may see (``lo >= hi``: none), for a kernel's row block."""
        if len(rows) == 0:
            return 0, 0
        lo, hi = self.key_ranges(rows, keys, dims)
        return int(lo.min()), int(hi.max())

    def hidden(self, rows: range | int, keys: range | int, dims: Mapping[str, int] | None = None, mask: np.ndarray | None = None) -> np.ndarray:
        """Bool ``[..., rows, keys]``: True where a key is hidden from a query row (the reference).

        ``rows``/``keys``: counts, or ranges of query rows and keys; ``mask``: the user mask (broadcast with the grid):
        a bool mask hides where False, an additive one where it is ``-inf``."""
        rows = range(rows) if isinstance(rows, int) else rows
        keys = range(keys) if isinstance(keys, int) else keys
        lo, hi = self.key_ranges(rows, keys.stop, dims)
        j = np.arange(keys.start, keys.stop, keys.step, dtype=np.int64)[None, :]
        hidden = (j < lo[:, None]) | (j >= hi[:, None])
        if mask is None or self.mask == "none":
            return hidden
        return hidden | (~mask if self.mask == "bool" else np.isneginf(mask))

    def rows_with_no_key(self, out: np.ndarray, hidden: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``out`` (``[..., rows, Dv]``) with what a row that sees no key gives: zeros are already there (a safe softmax);
        the mean of V (``v [..., keys, Dv]``) under ``empty_rows="mean"``."""
        if self.empty_rows != "mean" or hidden.shape[-1] == 0:
            return out
        mean = v.mean(axis=-2, keepdims=True, dtype=np.float64).astype(out.dtype)
        return np.where(hidden.all(axis=-1, keepdims=True), mean, out)


def _tightest(values: list[Dim], smallest: bool) -> Dim | None:
    """The smallest (or largest) of ``values`` when their order is known (``None`` for none, or when it is not)."""
    best: Dim | None = None
    for v in values:
        if best is None:
            best = v
            continue
        diff = dim_sub(v, best)
        if dim_is_nonnegative(diff):
            best = best if smallest else v
        elif dim_is_nonnegative(dim_sub(best, v)):
            best = v if smallest else best
        else:
            return None
    return None if best is None else normalize_dim(best)
