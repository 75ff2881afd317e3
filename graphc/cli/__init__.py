"""The ``graphc`` command line: one module per command (compare, export, show, optimize, info, generate).

Every command but ``generate`` takes a graph from a preset (``--preset mistral-7b``), from custom head counts
(``--heads 32 --kv-heads 8 --head-dim 128``), from a JSON file (``--graph g.json``), an ONNX model or a checkpoint
folder (:class:`~graphc.cli.source.GraphSource`, read once from the flags).  Each command module has ``add_command``
(its flags) and ``run`` (the command, reading the parsed flags and never writing them).  User errors print one line and
exit 2 (``--debug`` shows the traceback); ``compare`` and ``generate`` exit 1 when backends disagree.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from .. import __version__, memory
from ..errors import GraphcError
from . import compare, export, generate, info, optimize, show
from .common import Parser, UsageError

__all__ = ["main", "main_entry", "build_parser", "COMMANDS"]

COMMANDS = (compare, export, show, optimize, generate, info)
"""The command modules, in the order ``graphc --help`` lists them."""


def _add_common_args(p: argparse.ArgumentParser, default: object) -> None:
    """Flags every subcommand takes before or after its name."""
    p.add_argument("--debug", action="store_true", default=default if default is not None else False, help="show tracebacks on errors")
    p.add_argument("--quiet", action="store_true", default=default if default is not None else False, help="no progress lines on stderr")
    p.add_argument(
        "--memory-cap",
        metavar="SIZE",
        default=default,
        help="refuse runs estimated above SIZE (e.g. 16GiB, 'none'; default: GRAPHC_MEMORY_CAP or half of this machine's memory)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``graphc`` command."""
    p = Parser(prog="graphc", description="An einsum graph compiler for attention: build, optimize, export, compare.")
    p.add_argument("--version", action="version", version=f"graphc {__version__}")
    _add_common_args(p, None)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    common = Parser(add_help=False)
    _add_common_args(common, argparse.SUPPRESS)  # after the subcommand too; SUPPRESS keeps the top-level value
    for command in COMMANDS:
        command.add_command(sub, common)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv``; returns the exit code.

    0: ok; 1: backends disagree; 2: user error (one line on stderr);
    130: interrupted; 141: stdout closed early (``graphc ... | head``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if not args.command:
            raise UsageError("a command is needed: compare, export, show, optimize, info or generate (see graphc --help)")
        if args.memory_cap is not None:
            memory.set_memory_cap(args.memory_cap, "set by --memory-cap")
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except (GraphcError, OSError) as e:
        if debug:
            traceback.print_exc()
        print(f"graphc: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("graphc: interrupted", file=sys.stderr)
        return 130
    finally:
        memory.set_memory_cap(None)


def _one_line(e: BaseException) -> str:
    """The first line of an error; an operating system's error as ``PATH: what went wrong`` (no errno, no repr)."""
    if isinstance(e, OSError) and not isinstance(e, GraphcError) and e.strerror:
        names = [str(n) for n in (e.filename, e.filename2) if n is not None]
        return f"{' -> '.join(names)}: {e.strerror}" if names else e.strerror
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _silence_stdout() -> None:
    """The reader of stdout went away: point stdout at /dev/null so that the interpreter's final flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main_entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
