"""Pieces every ``graphc`` subcommand shares: the usage error, the parser that raises it, range checks, progress lines."""

from __future__ import annotations

import argparse
import time
from typing import NoReturn, TextIO

from .errors import GraphcError

__all__ = ["UsageError", "Parser", "at_least", "Progress"]


class UsageError(GraphcError):
    """A command-line mistake (bad flag combination, unreadable number)."""


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are :class:`UsageError` (one line, exit 2) instead of usage text and ``sys.exit``."""

    def error(self, message: str) -> NoReturn:  # argparse would print usage and exit itself
        """Raise the message as a :class:`UsageError`."""
        raise UsageError(message)


def at_least(flag: str, value: int | float | None, least: int | float, most: int | float | None = None) -> None:
    """A usage error unless ``value`` (when given) lies in ``least..most``."""
    if value is None:
        return
    if value != value or value < least or (most is not None and value > most):  # value != value: NaN
        bound = f">= {least}" if most is None else f"in {least}..{most}"
        raise UsageError(f"{flag} must be {bound}, got {value}")


class Progress:
    """Progress of a long run on stderr: one rewritten line on a terminal, plain lines otherwise."""

    def __init__(self, stream: TextIO, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self.started = time.perf_counter()

    def __call__(self, message: str) -> None:
        """Print ``message`` with the time since the start."""
        if not self.enabled:
            return
        stamp = f"[{time.perf_counter() - self.started:6.1f}s]"
        if self.tty:
            print(f"\r\033[K{stamp} {message}", end="", file=self.stream, flush=True)
        else:
            print(f"graphc: {stamp} {message}", file=self.stream, flush=True)

    def done(self) -> None:
        """Clear the terminal line (plain lines stay)."""
        if self.enabled and self.tty:
            print("\r\033[K", end="", file=self.stream, flush=True)
