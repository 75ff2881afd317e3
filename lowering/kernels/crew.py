"""Helper threads that work beside the calling thread, and stay awake for a moment after each call.

A decode call splits its KV heads over the cores.  Handing a share to a
sleeping thread costs the time the operating system takes to wake it: 50-100
us on a virtual machine, more than half of a 2 MiB decode.  A :class:`Crew`'s
helpers busy-wait (GIL released, with the compiled tier's
:func:`~lowering.kernels._numba_attention.spin_until`) for :data:`SPIN_READS` reads of
a shared counter, about 0.1 ms, after each call before they sleep, so calls
made back to back (layer after layer, token after token) find them awake; a
helper that sleeps is woken through a condition variable as before.  Without
the compiled tier the helpers do not spin.

One call at a time per crew: a second thread (or a block that itself asks for
helpers) runs its blocks on its own thread instead of waiting.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["SPIN_READS", "Crew", "crew", "use_spin"]

SpinWait = Callable[[np.ndarray, int, int, int], int]

SPIN_READS = 500_000
"""Reads of the shared counter a helper (or the caller waiting for its helpers) makes before it sleeps: about 0.1 ms."""

_POSTED, _FINISHED = 0, 1


class Crew:
    """``helpers`` daemon threads that each run the caller's ``work`` once per :meth:`run`, beside the caller."""

    def __init__(self, helpers: int, spin: SpinWait | None) -> None:
        """Start the threads; ``spin`` is the compiled busy wait (None: sleep at once)."""
        self.helpers = helpers
        self._spin = spin
        self._counters = np.zeros(2, np.int64)  # calls posted, helper runs finished (read by the busy waits)
        self._cond = threading.Condition()
        self._busy = threading.Lock()
        self._work: Callable[[], None] = lambda: None
        self._errors: list[BaseException] = []
        for i in range(helpers):
            threading.Thread(target=self._serve, name=f"graphc-crew-{i}", daemon=True).start()

    def _wait(self, index: int, target: int) -> None:
        """Until ``counters[index] >= target``: a bounded busy wait, then the condition variable."""
        if self._spin is not None and self._spin(self._counters, index, target, SPIN_READS) >= target:
            return
        with self._cond:
            while self._counters[index] < target:
                self._cond.wait()

    def _serve(self) -> None:
        seen = 0
        while True:
            self._wait(_POSTED, seen + 1)
            seen += 1
            try:
                self._work()
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                self._errors.append(e)
            with self._cond:
                self._counters[_FINISHED] += 1
                self._cond.notify_all()

    def run(self, work: Callable[[], None]) -> bool:
        """Run ``work`` on the caller's thread and on every helper; returns False (nothing run) when the crew is busy with another call.

        ``work`` must share its blocks out itself (every thread runs it once);
        the first error of any thread is raised after all have finished.
        """
        if not self._busy.acquire(blocking=False):
            return False
        try:
            self._work, self._errors = work, []
            target = int(self._counters[_FINISHED]) + self.helpers
            with self._cond:
                self._counters[_POSTED] += 1
                self._cond.notify_all()
            try:
                work()
            finally:
                self._wait(_FINISHED, target)
            if self._errors:
                raise self._errors[0]
            return True
        finally:
            self._busy.release()


_CREWS: dict[int, Crew] = {}
_CREWS_LOCK = threading.Lock()
_SPIN_PROVIDER: list[Callable[[], SpinWait | None]] = []


def use_spin(provider: Callable[[], SpinWait | None]) -> None:
    """Where crews made from now on get their busy wait (:mod:`lowering.kernels.compiled` registers its own when imported)."""
    _SPIN_PROVIDER[:] = [provider]


def crew(threads: int) -> Crew:
    """The process's crew of ``threads - 1`` helpers (made on first use; a forked child makes its own)."""
    with _CREWS_LOCK:
        if threads not in _CREWS:
            _CREWS[threads] = Crew(threads - 1, _SPIN_PROVIDER[0]() if _SPIN_PROVIDER else None)
        return _CREWS[threads]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_CREWS.clear)  # the helper threads do not survive a fork
