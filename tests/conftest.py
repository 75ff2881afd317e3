"""Shared test helpers: which optional backends this machine has."""

from __future__ import annotations

from lowering import unavailable_reason


def installed(*backends: str) -> list[str]:
    """The given backends that can run here (optional ones such as ``torch`` drop out when not installed)."""
    return [b for b in backends if unavailable_reason(b) is None]
