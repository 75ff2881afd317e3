"""The size guard: graphc refuses to allocate more than a settable cap.

Before graphc allocates weights (builders), random inputs, or runs a graph
(``lowering.run``, ``compare``), it estimates the bytes with its cost model
(inputs, weights and peak live intermediates under the run's sizes) and raises
:class:`~graphc.errors.ResourceLimitError` above the cap, with the estimate and
how to raise the cap, instead of letting NumPy die half-way through.

The cap is, in order: :func:`set_memory_cap`, the ``GRAPHC_MEMORY_CAP``
environment variable (``"64GiB"``, ``"500MB"``, ``"none"`` or a byte count),
or half of this machine's physical memory.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from .errors import GraphcError, ResourceLimitError

__all__ = [
    "memory_cap",
    "set_memory_cap",
    "machine_memory",
    "parse_bytes",
    "format_bytes",
    "check_allocation",
    "graph_run_bytes",
    "live_bytes",
    "DEFAULT_FRACTION",
    "resident_bytes",
    "resident_peak_bytes",
    "reset_resident_peak",
]

DEFAULT_FRACTION = 0.5
"""Share of the machine's physical memory allowed by default."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_CAP: int | None = None
_CAP_SOURCE = "set by set_memory_cap"
_UNLIMITED = -1


def machine_memory() -> int:
    """Physical memory of this machine in bytes (0 when the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def parse_bytes(text: str | int) -> int:
    """``"64GiB"``, ``"1.5 TB"``, ``"4096"`` -> bytes; ``"none"`` -> no cap (-1)."""
    if isinstance(text, bool):
        raise GraphcError(f"a memory size must be an int or text like '64GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise GraphcError(f"a memory size must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise GraphcError(f"a memory size must be an int or text like '64GiB', got {type(text).__name__}")
    if text.strip().lower() in ("none", "unlimited", "off"):
        return _UNLIMITED
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise GraphcError(f"cannot read memory size {text!r}; expected a number with an optional unit ({_UNIT_NAMES}) or 'none'")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def set_memory_cap(cap: int | str | None, source: str = "set by set_memory_cap") -> None:
    """Set the cap in bytes (or text like ``"16GiB"``; ``"none"`` for no cap); ``None`` restores the default.

    ``source`` is how error messages name where the cap came from.
    """
    global _CAP, _CAP_SOURCE
    _CAP = None if cap is None else parse_bytes(cap)
    _CAP_SOURCE = source


def memory_cap() -> int | None:
    """The cap in bytes now in force, or ``None`` when there is none."""
    if _CAP is not None:
        return None if _CAP == _UNLIMITED else _CAP
    env = os.environ.get("GRAPHC_MEMORY_CAP")
    if env:
        try:
            cap = parse_bytes(env)
        except GraphcError as e:
            raise GraphcError(f"GRAPHC_MEMORY_CAP: {e}") from None
        return None if cap == _UNLIMITED else cap
    total = machine_memory()
    return int(total * DEFAULT_FRACTION) if total else None


def _cap_source() -> str:
    if _CAP is not None:
        return _CAP_SOURCE
    if os.environ.get("GRAPHC_MEMORY_CAP"):
        return "from GRAPHC_MEMORY_CAP"
    return f"{DEFAULT_FRACTION:.0%} of this machine's {format_bytes(machine_memory())}"


def check_allocation(nbytes: int, what: str) -> None:
    """Raise :class:`ResourceLimitError` if ``nbytes`` (for ``what``) is above the cap."""
    cap = memory_cap()
    if cap is not None and nbytes > cap:
        raise ResourceLimitError(
            f"{what} would take about {format_bytes(nbytes)}, above graphc's memory cap of {format_bytes(cap)} ({_cap_source()}); "
            "use smaller sizes, or raise the cap with GRAPHC_MEMORY_CAP=SIZE, --memory-cap SIZE or graphc.memory.set_memory_cap(SIZE)",
            nbytes,
            cap,
        )


def live_bytes(graph: Any, nbytes: Callable[[str], int]) -> tuple[int, int]:
    """``(peak, largest)``: the most bytes of values alive at once, walking ``graph`` in order, and the largest result
    of one node.  ``nbytes(value)`` sizes a value; a view (an op that moves no data, a Reshape) costs nothing."""
    order = graph.topological_order()
    last: dict[str, int] = {}
    for i, node in enumerate(order):
        for v in node.inputs:
            last[v] = i
    live = {n: nbytes(n) for n in graph.inputs}
    current = peak = sum(live.values())
    largest = 0
    for i, node in enumerate(order):
        out = sum(nbytes(o) for o in node.outputs) if node.op.moves_data else 0
        largest = max(largest, out)
        for o in node.outputs:
            live[o] = nbytes(o) if out else 0
        current += out
        peak = max(peak, current)
        for v in set(node.inputs):
            if last.get(v) == i and v in live and not graph.is_output(v):
                current -= live.pop(v)
    return peak, largest


def graph_run_bytes(graph: Any, sizes: Mapping[str, int], upcast: bool = False) -> int:
    """Estimated bytes to run ``graph`` with symbols bound by ``sizes``: weights, inputs and peak live intermediates.

    ``upcast`` counts float32/float16 values at float64 (the reference run).
    """
    import numpy as np

    from .dims import DEFAULT_DIM_HINT, dim_symbols, eval_shape

    def nbytes(value: str) -> int:  # an unbound symbol is sized as the cost model sizes it
        t = graph.types[value]
        env = {s: int(sizes.get(s, DEFAULT_DIM_HINT)) for d in t.shape for s in dim_symbols(d)}
        return math.prod(eval_shape(t.shape, env)) * np.dtype(t.dtype).itemsize

    weights = sum(int(a.nbytes) for a in graph.initializers.values())
    total = weights + live_bytes(graph, nbytes)[0]
    return total * 2 if upcast else total


def _status_field(name: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux ``VmRSS``), or None where the OS does not say."""
    return _status_field("VmRSS")


def resident_peak_bytes() -> int | None:
    """This process's peak resident memory since it started or since :func:`reset_resident_peak` (``VmHWM``; elsewhere
    ``ru_maxrss``, which cannot be reset), or None where the OS does not say."""
    peak = _status_field("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
        import sys

        scale = 1 if sys.platform == "darwin" else 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
    except (ImportError, OSError):  # pragma: no cover - no resource module
        return None


def reset_resident_peak() -> bool:
    """Start the peak of :func:`resident_peak_bytes` again from the resident memory now (Linux ``clear_refs``);
    False where the OS cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False
