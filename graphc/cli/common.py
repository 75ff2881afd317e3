"""Pieces every ``graphc`` subcommand shares: the usage error, the parser that raises it, range checks, ``NAME=INT`` sizes,
writing an output, progress lines."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from ..errors import GraphcError
from ..folders import write_replacing

if TYPE_CHECKING:
    from ..quantize import QuantizeOptions

__all__ = ["UsageError", "Parser", "at_least", "parse_sizes", "write_output", "Progress", "add_quantize_args", "quantize_options"]


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


def parse_sizes(items: Sequence[str], flag: str = "--hint") -> dict[str, int]:
    """``NAME=INT`` items (``--hint``, ``--dim``) as sizes by name."""
    sizes = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise UsageError(f"{flag} takes NAME=INT (e.g. seq=2048), got {item!r}")
        sizes[name.strip()] = int(value)
    return sizes


def write_output(path: str | None, data: str | bytes) -> None:
    """``data`` to stdout (``path`` None or ``-``) or into the file ``path`` (replaced, never written through a link)."""
    if path is None or path == "-":
        sys.stdout.write(data if isinstance(data, str) else data.decode())
        return
    if not path.strip():
        raise UsageError("-o names the file to write; got an empty name")
    try:
        write_replacing(path, data)
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror}") from None


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    """``--quantize int4|int8`` and its options (export and generate from a checkpoint folder)."""
    q = p.add_argument_group("quantization (from a checkpoint folder)")
    q.add_argument("--quantize", choices=("int4", "int8"), default=None,
                   help="quantize the weight matrices (projections, MLP, LM head) in blocks: onnxruntime's MatMulNBits")  # fmt: skip
    q.add_argument("--quantize-block-size", type=int, default=None, metavar="N", help="values a block, a power of two >= 16 (default 32)")
    q.add_argument("--quantize-asymmetric", action="store_true", help="a zero point per block (default: symmetric, as genai's builder)")
    q.add_argument("--accuracy-level", type=int, default=None, choices=(0, 1, 2, 3, 4),
                   help="onnxruntime's MatMulNBits accuracy level (4: activations quantized to int8, faster; default 0: as computed)")  # fmt: skip


def quantize_options(args: argparse.Namespace) -> QuantizeOptions | None:
    """The :class:`~graphc.quantize.QuantizeOptions` the flags ask for (its defaults where a flag is not given), or None
    without ``--quantize``."""
    from ..quantize import QUANTIZE_CHOICES, QuantizeOptions

    flags = {"block_size": getattr(args, "quantize_block_size", None), "accuracy_level": getattr(args, "accuracy_level", None)}
    given: dict[str, Any] = {k: v for k, v in flags.items() if v is not None}
    if getattr(args, "quantize_asymmetric", False):
        given["symmetric"] = False
    if getattr(args, "quantize", None) is None:
        if given:
            raise UsageError("--quantize-block-size, --quantize-asymmetric and --accuracy-level go with --quantize int4|int8")
        return None
    try:
        return QuantizeOptions(bits=QUANTIZE_CHOICES[args.quantize], **given)
    except GraphcError as e:
        raise UsageError(f"--quantize-block-size: {e}") from None


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
