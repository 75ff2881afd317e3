"""``graphc compare``: run a graph on every backend against the float64 NumPy reference; exit 1 if any disagrees."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .common import Progress, UsageError, at_least
from .source import GraphSource, add_graph_args

__all__ = ["add_command", "run"]


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc compare``."""
    from lowering.compare import DEFAULT_BACKENDS
    from lowering.exporter.targets import ATTENTION_MODES

    c = sub.add_parser("compare", parents=[common], help="run a graph on every backend; exit 1 if any disagrees")
    add_graph_args(c)
    c.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help=f"comma-separated (default {','.join(DEFAULT_BACKENDS)})")
    c.add_argument("--no-optimize", action="store_true", help="run the unoptimized graph on every backend")
    c.add_argument("--repeats", type=int, default=5, help="timed runs per backend after one warm-up (default 5)")
    c.add_argument(
        "--atol", type=float, default=None, help="absolute tolerance (default per output dtype: 1e-4 float32, 1e-2 float16, 8e-2 bfloat16)"
    )
    c.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance (default per output dtype: 1e-3 float32, 1e-2 float16, 8e-2 bfloat16)"
    )
    c.add_argument(
        "--tf32",
        action="store_true",
        help="let ort-cuda run float32 MatMul in TF32 (default off: float32 is float32); float32 tolerance becomes 5e-3 + 1e-2*|ref|",
    )
    c.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="storage dtype of weights and inputs (computed in float32; on ort-cuda float16 contracts in float16)",
    )
    c.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_MODES,
        help="how ONNX backends get attention (default auto: per attention, with the run's sizes)",
    )
    c.add_argument("--threads", type=int, default=None, help="threads per backend (default: library default)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--inputs", metavar="FILE.npz", default=None, help="run on these arrays (numpy .npz keyed by input name) instead of random inputs")
    c.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="N",
        help="also split the graph by KV-head group into N shards and run them on N Dask worker processes (needs graphc[distributed])",
    )
    c.add_argument("--shard-backend", default="numpy", metavar="NAME", help="backend of each shard with --shards (default numpy)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run every backend and compare against the float64 NumPy reference."""
    from lowering.backends.registry import backend_options
    from lowering.compare import MAX_REPEATS, compare

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        raise UsageError(f"--backends needs at least one backend name, got {args.backends!r}")
    at_least("--repeats", args.repeats, 1, MAX_REPEATS)
    at_least("--threads", args.threads, 1, 4096)
    if args.shards is not None:
        at_least("--shards", args.shards, 1, 1024)
    at_least("--atol", args.atol, 0)
    at_least("--rtol", args.rtol, 0)
    source = GraphSource.from_args(args).with_dtype(args.dtype)
    g, sizes = source.build()
    if args.tf32 and "ort-cuda" not in backends:
        raise UsageError("--tf32 asks ort-cuda for TF32 MatMul; add ort-cuda to --backends")
    options = {b: backend_options(b, attention=args.attention, tf32=args.tf32 or None, threads=args.threads) for b in backends}
    inputs = _load_inputs(args.inputs) if args.inputs else None
    progress = Progress(sys.stderr, enabled=not args.quiet)
    try:
        report = compare(
            g,
            inputs=inputs,
            backends=backends,
            optimize=not args.no_optimize,
            repeats=args.repeats,
            atol=args.atol,
            rtol=args.rtol,
            seed=source.seed,
            sizes=sizes,
            options=options,
            progress=progress,
            shards=args.shards,
            shard_backend=args.shard_backend,
            reference_model=source.model if source.model is not None and not source.hf_config else None,
            reference_fixed=source.fixed_inputs,
        )
    finally:
        progress.done()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 0 if report.ok else 1


def _load_inputs(path: str) -> dict[str, np.ndarray]:
    """The arrays of a ``.npz`` file, by name (checked against the graph by ``compare``)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"--inputs {path!r}: cannot read a .npz of arrays: {e}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UsageError(f"--inputs {path!r} holds one array (a .npy); give a .npz of arrays keyed by input name (numpy.savez)")
    try:
        with data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"--inputs {path!r}: cannot read a .npz of arrays: {e}") from None
