"""Run one graph on several backends and compare numbers and speed.

The reference is the NumPy interpreter in float64, in reference mode
(attention decomposed into einsums, no fused kernel: independent of the
kernels it checks), on the *unoptimized* graph, so a comparison also checks
the optimizer.  Each backend runs the optimized
graph (unless ``optimize=False``), once to warm up, then ``repeats`` timed
times.  A backend that cannot run here is reported as skipped with the reason;
one that fails is reported as an error; one whose outputs differ beyond
``atol + rtol * |reference|`` fails the comparison.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from graphc.errors import BackendError, BackendUnavailableError, GraphcError
from graphc.dims import check_sizes
from graphc.graph import Graph
from graphc.memory import check_allocation, graph_run_bytes

from .backends.registry import backend_names, get_backend, prepare
from .backends.inputs import format_sizes, check_inputs, random_inputs, symbol_bindings
from .kernels.softmax import default_threads

__all__ = ["compare", "ComparisonReport", "BackendResult", "DEFAULT_BACKENDS", "MAX_REPEATS", "TOLERANCES", "TF32_TOLERANCE", "default_tolerance"]

DEFAULT_BACKENDS = ("numpy", "onnx-reference", "ort-cpu", "ort-cuda", "torch")
MAX_REPEATS = 10_000


@dataclass
class BackendResult:
    """One backend's outcome: ``status`` is ``ok``, ``mismatch``, ``skipped`` or ``error``."""

    backend: str
    status: str
    provider: str | None = None
    reason: str | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    worst_output: str | None = None
    median_ms: float | None = None
    p90_ms: float | None = None
    peak_mib: float | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None

    @property
    def passed(self) -> bool | None:
        """True/False for backends that ran, None for skipped ones."""
        return None if self.status == "skipped" else self.status == "ok"


@dataclass
class ComparisonReport:
    """Per-backend results against the float64 NumPy reference."""

    graph: str
    reference: str
    optimized: bool
    atol: float
    rtol: float
    repeats: int
    input_shapes: dict[str, list[int]]
    results: list[BackendResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every backend that ran agreed with the reference."""
        return all(r.status in ("ok", "skipped") for r in self.results) and any(r.status == "ok" for r in self.results)

    @property
    def failed(self) -> list[str]:
        """Backends that disagreed or raised."""
        return [r.backend for r in self.results if r.status in ("mismatch", "error")]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def __str__(self) -> str:
        head = ("backend", "status", "max abs err", "max rel err", "median ms", "p90 ms", "peak MiB", "provider / reason")
        rows = [head]
        for r in self.results:
            rows.append(
                (
                    r.backend,
                    {"ok": "PASS", "mismatch": "FAIL", "error": "ERROR", "skipped": "skipped"}[r.status],
                    _num(r.max_abs_err, "{:.2e}"),
                    _num(r.max_rel_err, "{:.2e}"),
                    _num(r.median_ms, "{:.2f}"),
                    _num(r.p90_ms, "{:.2f}"),
                    _num(r.peak_mib, "{:.1f}"),
                    r.reason if r.status != "ok" and r.reason else (r.provider or ""),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
        lines = []
        for k, row in enumerate(rows):
            cells = [c.ljust(w) if i in (0, 1) else c.rjust(w) for i, (c, w) in enumerate(zip(row[:-1], widths))]
            lines.append("  ".join(cells + [row[-1]]).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(head[-1]))
        shapes = ", ".join(f"{k}{v}" for k, v in self.input_shapes.items())
        verdict = "all backends agree" if self.ok else f"DISAGREE: {', '.join(self.failed) or 'no backend ran'}"
        title = f"graph {self.graph} ({'optimized' if self.optimized else 'unoptimized'}), inputs {shapes}"
        footer = f"reference: {self.reference}; tolerance |err| <= {self.atol:g} + {self.rtol:g}*|ref|; {verdict}"
        return "\n".join([title, *lines, footer])


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


TOLERANCES = {"float64": (1e-4, 1e-3), "float32": (1e-4, 1e-3), "float16": (1e-2, 1e-2), "bfloat16": (8e-2, 8e-2)}
"""Default ``(atol, rtol)`` per output dtype, against the float64 reference.

float32: float32 arithmetic, far under 1e-3 of the reference.  float16: a float16 graph computed as GPU kernels
compute it (contractions and attention in float16 with float32 accumulation, every intermediate rounded to float16;
``lowering.exporter.targets.onnx_target(..., device="cuda")``) differs from the float64 reference by that rounding:
on the mistral-7b layer at 512 tokens, at most 4.2e-3 (outputs up to 3.5; 1.5e-3 norm-wise), which the old
``(1e-3, 4e-3)`` failed 3.3-fold and even float32 computation between float16 tensors failed 1.4-fold.  The bound
allows about 2.4x that (``tests/test_precision.py`` pins it).  bfloat16 keeps 3 fewer mantissa bits: 8x float16's."""

TF32_TOLERANCE = (5e-3, 1e-2)
"""``(atol, rtol)`` of float32 outputs when onnxruntime's CUDA provider is asked for TF32 MatMul (``tf32=True``): TF32
keeps float16's 10-bit mantissa, so float16's bound (measured on the mistral-7b layer at 512 tokens: 3.25e-3)."""


def default_tolerance(graph: Graph) -> tuple[float, float]:
    """The loosest :data:`TOLERANCES` entry among the graph's float outputs (float32's when there are none)."""
    tols = [TOLERANCES[graph.types[o].dtype] for o in graph.outputs if graph.types[o].dtype in TOLERANCES]
    return (max(t[0] for t in tols), max(t[1] for t in tols)) if tols else TOLERANCES["float32"]


def _errors(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], atol: float, rtol: float) -> tuple[float, float, str, bool]:
    worst_abs, worst_rel, worst, ok = 0.0, 0.0, "", True
    for name, ref in want.items():
        if name not in got:
            return float("inf"), float("inf"), name, False
        a = np.asarray(got[name], np.float64)
        if a.shape != ref.shape:
            return float("inf"), float("inf"), name, False
        diff = np.abs(a - ref)
        if np.isnan(a).any() != np.isnan(ref).any():
            return float("nan"), float("nan"), name, False
        err = float(np.nanmax(diff)) if diff.size else 0.0
        rel = err / max(float(np.nanmax(np.abs(ref))) if ref.size else 0.0, 1e-30)
        ok &= bool(np.all((diff <= atol + rtol * np.abs(ref)) | np.isnan(ref)))
        if err >= worst_abs:
            worst_abs, worst = err, name
        worst_rel = max(worst_rel, rel)
    return worst_abs, worst_rel, worst, ok


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def compare(
    graph: Graph,
    inputs: Mapping[str, np.ndarray] | None = None,
    backends: Sequence[str] = DEFAULT_BACKENDS,
    optimize: bool = True,
    repeats: int = 5,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    sizes: Mapping[str, int] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    hints: Mapping[str, int] | None = None,
    progress: Callable[[str], None] | None = None,
    shards: int | None = None,
    shard_backend: str = "numpy",
    reference_model: Any = None,
    reference_fixed: Mapping[str, object] | None = None,
) -> ComparisonReport:
    """Compare ``backends`` on ``graph`` against the float64 NumPy reference.

    ``inputs`` default to seeded random arrays with symbolic dims sized by ``sizes``; ``options`` maps a backend name to
    its options (for example ``{"ort-cpu": {"threads": 2}}``); ``hints`` size dims for the optimizer.
    ``atol``/``rtol`` default per output dtype (:data:`TOLERANCES`; :data:`TF32_TOLERANCE` where ``{"tf32": True}``).
    ``progress`` is called with a line of text at each step (with each backend's elapsed time when it finishes).  The
    float64 reference run is checked against the memory cap (:mod:`graphc.memory`) before anything is allocated.
    ``shards``: also split the graph by KV-head group (:func:`graphc.sharding.shard`) and run the shards with
    ``shard_backend`` on a Dask LocalCluster of that many workers (a ``sharded`` row; skipped with the install line when
    dask is absent).  ``reference_model``: the ONNX model (path or ``ModelProto``) ``graph`` was imported from; the
    reference is then that model run by onnxruntime (or ONNX's reference evaluator), not graphc's own import
    (:mod:`lowering.backends.onnx_reference`), fed ``reference_fixed`` too (``from_onnx``'s ``fixed_inputs``).
    """
    atol, rtol = _check_arguments(graph, backends, repeats, atol, rtol, options)
    plan = None
    from graphc.sharding import shard

    if shards is not None:
        get_backend(shard_backend)
        plan = shard(graph, shards)  # a shard count that does not divide the heads fails before anything runs
    defaulted, (inputs, bindings) = inputs is None, _inputs(graph, inputs, sizes, seed)
    say = progress or (lambda _: None)
    run_graph = graph
    if optimize:
        from graphc.optimizer import optimize as _optimize

        say("optimizing")
        run_graph = _optimize(graph, hints=hints or bindings).graph
    reference, run_reference = _reference(graph, reference_model, bindings, reference_fixed)
    say(f"reference: {reference.split(' (')[0]}")
    t0 = time.perf_counter()
    want = _run_reference(run_reference, inputs, bindings if defaulted else None)
    say(f"reference done in {time.perf_counter() - t0:.1f}s")
    report = ComparisonReport(
        graph=graph.name,
        reference=reference,
        optimized=optimize,
        atol=atol,
        rtol=rtol,
        repeats=repeats,
        input_shapes={k: list(v.shape) for k, v in inputs.items()},
    )
    for i, name in enumerate(backends, 1):
        say(f"[{i}/{len(backends)}] {name}: preparing and running {repeats + 1} time(s)")
        t0 = time.perf_counter()
        opts = {"sizes": bindings, **dict((options or {}).get(name, {}))}
        result = _excused(_run_backend(run_graph, name, opts, inputs, want, repeats, atol, rtol), reference_model, graph, inputs, reference_fixed)
        report.results.append(result)
        say(f"[{i}/{len(backends)}] {name}: {result.status} in {time.perf_counter() - t0:.1f}s")
    if plan is not None:
        plan = shard(run_graph, plan.n) if run_graph is not graph else plan
        say(f"sharded x{plan.n}: starting {plan.n} Dask workers, placing the weights")
        t0 = time.perf_counter()
        opts = {"sizes": bindings, **dict((options or {}).get(shard_backend, {}))}
        opts.setdefault("threads", max(1, default_threads() // plan.n))
        report.results.append(_run_sharded(plan, shard_backend, opts, inputs, want, repeats, atol, rtol))
        say(f"sharded x{plan.n}: {report.results[-1].status} in {time.perf_counter() - t0:.1f}s")
    return report


def _run_reference(
    run_reference: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]], inputs: Mapping[str, np.ndarray], defaulted: Mapping[str, int] | None
) -> dict[str, np.ndarray]:
    """The reference's outputs; where it fails on random inputs sized by ``defaulted``, the error says so."""
    try:
        return run_reference(inputs)
    except GraphcError as e:
        if not defaulted:
            raise
        raise BackendError(
            f"{e} (the inputs were random, their symbolic dims sized {format_sizes(defaulted)}: give each dim its size, "
            "sizes={...} or graphc compare --dim NAME=INT)"
        ) from None


def _inputs(
    graph: Graph, inputs: Mapping[str, np.ndarray] | None, sizes: Mapping[str, int] | None, seed: int
) -> tuple[Mapping[str, np.ndarray], dict[str, int]]:
    """The inputs (seeded random ones sized by ``sizes`` when none are given) and the sizes of the graph's symbols,
    after checking that the float64 reference fits the memory cap."""
    if inputs is None:
        bindings = symbol_bindings(graph, **check_sizes(sizes, "sizes"))
        _check_reference_memory(graph, bindings)
        return random_inputs(graph, seed=seed, **bindings), bindings
    bindings = check_inputs(graph, inputs)
    _check_reference_memory(graph, bindings)
    return inputs, bindings


def _check_arguments(
    graph: Graph,
    backends: Sequence[str],
    repeats: int,
    atol: float | None,
    rtol: float | None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[float, float]:
    """Refuse bad ``compare`` arguments before anything runs; returns the tolerances (defaults per output dtype, and
    :data:`TF32_TOLERANCE` at least where a backend's options ask for TF32)."""
    if any(dict(o).get("tf32") for o in (options or {}).values()):
        tf32 = [max(a, b) for a, b in zip(default_tolerance(graph), TF32_TOLERANCE)]
        atol, rtol = (tf32[0] if atol is None else atol), (tf32[1] if rtol is None else rtol)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= MAX_REPEATS:
        raise GraphcError(f"repeats must be an int in 1..{MAX_REPEATS}, got {repeats!r}")
    default_atol, default_rtol = default_tolerance(graph)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    for what, tol in (("atol", atol), ("rtol", rtol)):
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0 or tol == float("inf"):
            raise GraphcError(f"{what} must be a finite number >= 0, got {tol!r}")
    if isinstance(backends, str) or not backends:
        raise GraphcError(f"backends must be a non-empty list of names ({', '.join(backend_names())}), got {backends!r}")
    for b in backends:
        get_backend(b)  # unknown names fail before anything runs
    return float(atol), float(rtol)


def _reference(
    graph: Graph, reference_model: Any, bindings: Mapping[str, int], fixed: Mapping[str, object] | None = None
) -> tuple[str, Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]]:
    """What the backends are checked against, and how to run it: the imported ONNX model's own run, else NumPy float64."""
    if reference_model is not None:
        from .backends.onnx_reference import onnx_model_reference

        return onnx_model_reference(reference_model, graph, fixed)

    def run_reference(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return prepare(graph, "numpy", compute_dtype="float64", reference=True, sizes=bindings).run(feeds)

    return "numpy float64 on the unoptimized graph, attention decomposed (no fused kernel)", run_reference


def _run_sharded(
    plan: Any,
    backend: str,
    opts: dict[str, Any],
    inputs: Mapping[str, np.ndarray],
    want: Mapping[str, np.ndarray],
    repeats: int,
    atol: float,
    rtol: float,
) -> BackendResult:
    from .distributed.dask_shards import sharded_runner

    name = f"sharded x{plan.n} ({backend})"
    try:
        runner = sharded_runner(plan, backend=backend, **opts)
    except BackendUnavailableError as e:
        return BackendResult(name, "skipped", reason=e.reason)
    try:
        got = runner.run(inputs)
        times, sent, received, shard_ms = [], 0, 0, []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.run(inputs)
            times.append(1e3 * (time.perf_counter() - t0))
            sent, received = runner.last.bytes_sent, runner.last.bytes_received
            shard_ms = [1e3 * sum(s) for s in zip(*runner.last.shard_s)]
    except GraphcError as e:
        return BackendResult(name, "error", reason=f"{type(e).__name__}: {e}")
    finally:
        runner.close()  # the cluster it started goes with it
    where = (
        f"dask, {plan.n} worker processes; per call sent {sent / 2**20:.2f} MiB, received {received / 2**20:.2f} MiB; "
        f"shard ms {'/'.join(f'{t:.1f}' for t in shard_ms)}"
    )
    return _result(name, where, got, want, atol, rtol, times, bytes_sent=sent, bytes_received=received)


def _result(
    name: str,
    provider: str | None,
    got: Mapping[str, np.ndarray],
    want: Mapping[str, np.ndarray],
    atol: float,
    rtol: float,
    times: list[float],
    **extra: Any,
) -> BackendResult:
    """A backend's row: errors against the reference, PASS/FAIL, median and p90 of ``times`` (ms)."""
    err, rel, worst, ok = _errors(got, want, atol, rtol)
    return BackendResult(
        name,
        "ok" if ok else "mismatch",
        provider=provider,
        reason=None if ok else f"outputs differ beyond tolerance (worst: {worst})",
        max_abs_err=err,
        max_rel_err=rel,
        worst_output=worst,
        median_ms=statistics.median(times),
        p90_ms=float(np.percentile(times, 90)),
        **extra,
    )


def _check_reference_memory(graph: Graph, bindings: Mapping[str, int]) -> None:
    what = f"the float64 reference run of graph {graph.name!r} with {format_sizes(bindings)}"
    check_allocation(graph_run_bytes(graph, bindings, upcast=True), what)


def _excused(
    result: BackendResult, reference_model: Any, graph: Graph, inputs: Mapping[str, np.ndarray], fixed_inputs: Mapping[str, object] | None = None
) -> BackendResult:
    """``onnx-reference`` failing on an imported model that ONNX's reference evaluator cannot run in its original form
    either is no disagreement: the row is skipped with the evaluator's own error."""
    if result.backend != "onnx-reference" or result.status != "error" or reference_model is None:
        return result
    import onnx
    from onnx.reference import ReferenceEvaluator

    from .backends.onnx_reference import feeds_for_model

    proto = reference_model if isinstance(reference_model, onnx.ModelProto) else onnx.load_model(str(reference_model))
    try:
        ReferenceEvaluator(proto).run(None, feeds_for_model(proto, graph, fixed_inputs)[1](inputs))
    except Exception as e:  # noqa: BLE001 - the evaluator's own failure, quoted
        reason = f"ONNX's reference evaluator cannot run the original model either ({type(e).__name__}: {str(e)[:160]})"
        return BackendResult(result.backend, "skipped", provider=result.provider, reason=reason)
    return result


def _run_backend(
    graph: Graph,
    name: str,
    opts: dict[str, Any],
    inputs: Mapping[str, np.ndarray],
    want: Mapping[str, np.ndarray],
    repeats: int,
    atol: float,
    rtol: float,
) -> BackendResult:
    try:
        runner = prepare(graph, name, **opts)
    except BackendUnavailableError as e:
        return BackendResult(name, "skipped", reason=e.reason)
    except GraphcError as e:
        return BackendResult(name, "error", reason=f"{type(e).__name__}: {e}")
    try:
        got = runner.run(inputs)  # warm-up, and the numbers compared
        times = _timed(lambda: runner.run(inputs), repeats)
    except BackendUnavailableError as e:  # it cannot run this graph (an op it has no kernel for): no disagreement
        return BackendResult(name, "skipped", provider=runner.provider, reason=e.reason)
    except GraphcError as e:
        return BackendResult(name, "error", provider=runner.provider, reason=f"{type(e).__name__}: {e}")
    peak = None
    if name == "numpy":
        tracemalloc.start()
        runner.run(inputs)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return _result(name, runner.provider, got, want, atol, rtol, times, peak_mib=peak)
