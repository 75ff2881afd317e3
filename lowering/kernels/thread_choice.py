"""How many threads a run gets: the count asked for, or one, whichever ran work of its kind faster lately.

A decode step is bound by reading the weights, and BLAS splits each of its
products evenly over its threads.  On a quiet machine two threads halve the
step; with another process busy on one of the two cores, the thread that shares
that core finishes its even half late, and the step takes longer than on one
thread (a Qwen2.5-0.5B step in `benchmarks/bench_threads.py`: 687 ms on two threads against 441 on one).  A
prefill's blocked kernels fare the same way: a helper thread that takes a block
and is then put off its core holds the product up for the scheduler's time
slice.  No fixed count is right on both machines, and the load changes while a
model generates.  :class:`ThreadChoice` times the runs themselves: it keeps a
smoothed time for each candidate count, runs the faster one, and now and then
tries the other once, so a load that starts is followed within a few runs and
one that stops within :data:`EXPLORE_MOST`.  The count asked for is a ceiling,
never exceeded.  The NumPy backend keeps one choice for its decode steps (the
BLAS threads) and one per thread count for its blocked kernels
(:func:`shared_choice`, keyed by kernel and shapes, which recur layer after
layer).  ``GRAPHC_ADAPTIVE_THREADS=0`` turns the choice off (always the count
asked for).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["EXPLORE_EVERY", "EXPLORE_MOST", "MAX_KINDS", "SMOOTHING", "ThreadChoice", "TimedChoice", "adaptive_threads_enabled", "shared_choice"]

EXPLORE_EVERY = 16
"""Runs of one kind before the count not chosen is tried again; doubled each time the try loses."""
EXPLORE_MOST = 128
"""The longest gap, in runs, between two tries of the count not chosen."""
SMOOTHING = 0.5
"""Weight of a new time in a candidate's smoothed time."""
MAX_KINDS = 4096
"""Kinds of run a choice remembers; the oldest is forgotten past this (a decode step's attention is a new shape each token)."""

R = TypeVar("R")
C = TypeVar("C", bound=Hashable)


def adaptive_threads_enabled() -> bool:
    """False when ``GRAPHC_ADAPTIVE_THREADS=0``: every run then uses the thread count asked for."""
    return os.environ.get("GRAPHC_ADAPTIVE_THREADS", "1").strip() != "0"


@dataclass
class _Kind(Generic[C]):
    """What one kind of run has shown: runs so far, a smoothed time per candidate, when to try another next."""

    runs: int = 0
    warmed: set[C] = field(default_factory=set)
    smoothed: dict[C, float] = field(default_factory=dict)
    gap: int = EXPLORE_EVERY
    next_try: int = EXPLORE_EVERY
    trying: bool = False


class TimedChoice(Generic[C]):
    """Per kind of run (any hashable key, e.g. a kernel and its shapes), the candidate that ran it faster lately.

    Use :meth:`timed` around a run, or :meth:`pick` before it and :meth:`record` after.  A kind's first run (or each
    candidate's first, with ``warm_up_each``) is a warm-up and is not recorded; each candidate is run until it has a
    time (in the order given), and from there the faster runs.  A chosen candidate that slows below another's last
    time loses at once (a load that starts); the others are tried again after :data:`EXPLORE_EVERY` runs, a gap that
    doubles up to :data:`EXPLORE_MOST` each time the try loses (so a load that stops is found, and a quiet machine pays
    a slow try rarely).
    """

    def __init__(self, candidates: tuple[C, ...], clock: Callable[[], float] = time.perf_counter, warm_up_each: bool = True) -> None:
        """``candidates`` in the order they are first tried; ``clock`` gives seconds (a test passes its own);
        ``warm_up_each``: every candidate's first run of a kind is a warm-up (kernels that compile or allocate on first
        use), else only the kind's first run (thread counts: the first run pays for the kind's allocations)."""
        self.candidates = candidates
        self._clock = clock
        self._warm_up_each = warm_up_each
        self._kinds: dict[Hashable, _Kind[C]] = {}
        self._lock = threading.Lock()

    def _kind(self, key: Hashable) -> _Kind[C]:
        kind = self._kinds.get(key)
        if kind is None:
            if len(self._kinds) >= MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]  # the oldest kind
            kind = self._kinds[key] = _Kind()
        return kind

    def pick(self, key: Hashable) -> C:
        """The candidate for the next run of kind ``key``."""
        with self._lock:
            kind = self._kind(key)
            if len(self.candidates) == 1:
                return self.candidates[0]
            untried = [c for c in self.candidates if c not in kind.smoothed]
            if untried:
                return untried[0]
            best = self._best(kind)
            if kind.runs >= kind.next_try:
                kind.trying = True
                others = [c for c in self.candidates if c != best]
                return others[(kind.runs // max(1, kind.gap)) % len(others)]
            return best

    def record(self, key: Hashable, candidate: C, seconds: float) -> None:
        """Note that a run of kind ``key`` on ``candidate`` took ``seconds`` (a candidate's first run of a kind is dropped)."""
        with self._lock:
            kind = self._kind(key)
            kind.runs += 1
            if candidate not in kind.warmed and (self._warm_up_each or not kind.warmed):  # a first run: page faults, compiles
                kind.warmed.add(candidate)
                return
            old = kind.smoothed.get(candidate)
            kind.smoothed[candidate] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds
            if kind.trying:
                kind.trying = False
                kind.gap = EXPLORE_EVERY if self._best(kind) == candidate else min(2 * kind.gap, EXPLORE_MOST)
                kind.next_try = kind.runs + kind.gap

    def chosen(self, key: Hashable) -> C | None:
        """The candidate with the lowest smoothed time for ``key`` (None before every candidate is timed)."""
        with self._lock:
            kind = self._kinds.get(key)
            if kind is None or any(c not in kind.smoothed for c in self.candidates):
                return None
            return self._best(kind)

    def _best(self, kind: _Kind[C]) -> C:
        return min(self.candidates, key=lambda c: kind.smoothed[c])

    def timed(self, key: Hashable, run: Callable[[C], R]) -> R:
        """``run(candidate)`` on the picked candidate, its time recorded; returns what ``run`` returns."""
        candidate = self.pick(key)
        start = self._clock()
        result = run(candidate)
        self.record(key, candidate, self._clock() - start)
        return result


class ThreadChoice(TimedChoice[int]):
    """Per kind of run, the thread count that ran it faster lately: the count asked for, or one (always the count asked
    for with ``GRAPHC_ADAPTIVE_THREADS=0``)."""

    def __init__(self, threads: int, clock: Callable[[], float] = time.perf_counter) -> None:
        """Candidates ``threads`` and 1 (just 1 when ``threads`` is 1); ``clock`` gives seconds (a test passes its own)."""
        super().__init__((threads, 1) if threads > 1 else (1,), clock, warm_up_each=False)

    def timed(self, key: Hashable, run: Callable[[int], R]) -> R:
        """``run(threads)`` on the picked count, its time recorded; on the count asked for, untimed, with the choice off."""
        if not adaptive_threads_enabled():
            return run(self.candidates[0])
        return super().timed(key, run)


_SHARED: dict[int, ThreadChoice] = {}
_SHARED_LOCK = threading.Lock()


def shared_choice(threads: int) -> ThreadChoice:
    """The process's choice for kernels asked to run on ``threads`` threads (one per count, made on first use): the
    kernels' blocks of one shape recur layer after layer, so what one layer's run showed serves the next."""
    with _SHARED_LOCK:
        if threads not in _SHARED:
            _SHARED[threads] = ThreadChoice(threads)
        return _SHARED[threads]
