"""Named backends behind one registry, and the ``run`` API.

``numpy``: the interpreter (reference semantics).  ``onnx-reference``: ONNX's
``ReferenceEvaluator`` on the exported model.  ``ort-cpu`` / ``ort-cuda``:
onnxruntime ``InferenceSession`` with the CPU or CUDA execution provider.
``ort-cuda`` checks that the provider is available and, once the session is
built, that it is really in use: a silent fall-back to the CPU is an error.
``torch``: the same DAG interpreted with torch ops (optional dependency).

``prepare(graph, backend, **options)`` builds a reusable runner (for timing);
``run(graph, inputs, backend, **options)`` checks the inputs, then runs once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from graphc.errors import BackendError, BackendUnavailableError, UnknownNameError
from graphc.graph import Graph
from graphc.memory import check_allocation, graph_run_bytes
from graphc.optimizer import lower

from ..kernels.compiled import kernels_description
from ..kernels.bf16_gemm import bf16_gemm_description
from ..kernels.softmax import blas_description

from .inputs import check_inputs
from ..decode.kv_buffers import numpy_cache
from .numpy_interpreter import NumpyInterpreter
from .ort_options import OrtOptions, Sizes
from .runner import Runner
from ..exporter.targets import NUMPY_TARGET, REFERENCE_TARGET

__all__ = [
    "Runner",
    "BackendSpec",
    "BACKENDS",
    "register_backend",
    "unregister_backend",
    "backend_names",
    "get_backend",
    "prepare",
    "run",
    "unavailable_reason",
    "decode_options",
    "backend_options",
    "OrtOptions",
]


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend: how to tell whether it can run here, and how to prepare a graph."""

    name: str
    description: str
    unavailable: Callable[[], str | None]
    prepare: Callable[..., Runner]
    decode: tuple[tuple[str, Any], ...] = ()
    """``prepare`` options a decode loop uses on this backend (onnxruntime: attention forms chosen for the step's sizes)."""
    decode_sizes: bool = False
    """True when a decode loop prepares the backend with the step's sizes (to choose its kernels for them)."""


def _numpy(graph: Graph, compute_dtype: str | None = None, threads: int | None = None, reference: bool = False, sizes: Sizes = None) -> Runner:
    lowered = lower(graph, REFERENCE_TARGET if reference else NUMPY_TARGET, sizes)
    interp = NumpyInterpreter(lowered, compute_dtype=compute_dtype, threads=threads, reference=reference)
    provider = f"numpy {np.__version__}" + (f" ({compute_dtype})" if compute_dtype else "")
    provider += "" if reference else f", {kernels_description()}, {blas_description()}"
    if not (reference or compute_dtype) and any(str(a.dtype) == "bfloat16" for a in graph.initializers.values()):
        bf16 = bf16_gemm_description()
        provider += f", {bf16} for a prefill's bfloat16 weights" if bf16 else ""
    if reference:
        provider += ", reference mode: attention decomposed, no fused kernels"
    return Runner("numpy", provider, graph, interp.run, caches=numpy_cache)


def _export(
    graph: Graph,
    opset: int | None,
    attention: str,
    sizes: Sizes,
    place_weights: Any = None,
    device: str = "cpu",
    quantized: str = "matmulnbits",
    fused_matmul: bool = False,
) -> Any:
    from ..exporter.onnx_export import DEFAULT_OPSET, export

    opts = {"place_weights": place_weights, "device": device, "quantized": quantized, "fused_matmul": fused_matmul}
    return export(graph, opset=opset or DEFAULT_OPSET, attention=attention, sizes=dict(sizes or {}), **opts)


def _reference(graph: Graph, opset: int | None = None, attention: str = "decomposed", sizes: Sizes = None) -> Runner:
    from onnx.reference import ReferenceEvaluator

    if attention == "ort-gqa":
        raise BackendUnavailableError(
            "onnx-reference", "ONNX's reference evaluator cannot run onnxruntime's contrib op com.microsoft.GroupQueryAttention (attention=ort-gqa)"
        )
    model = _export(graph, opset, attention, sizes, quantized="qdq")  # ONNX's evaluator has no contrib ops

    def cannot(e: NotImplementedError) -> BackendUnavailableError:  # an op it has no kernel for (a contrib op carried through)
        return BackendUnavailableError("onnx-reference", f"ONNX's reference evaluator cannot run this model: {str(e).split(', known')[0]}")

    try:
        evaluator = ReferenceEvaluator(model)
    except NotImplementedError as e:
        raise cannot(e) from None

    def fn(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            outs = evaluator.run(None, dict(inputs))
        except NotImplementedError as e:
            raise cannot(e) from None
        return dict(zip(graph.outputs, (np.asarray(o) for o in outs)))

    import onnx

    return Runner("onnx-reference", f"onnx {onnx.__version__} ReferenceEvaluator", graph, fn)


def _ort_missing() -> str | None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed (pip install onnxruntime)"
    return None


def _cuda_missing() -> str | None:
    reason = _ort_missing()
    if reason:
        return reason
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (
            f"CUDAExecutionProvider is not available (providers: {', '.join(ort.get_available_providers())}); "
            'install onnxruntime-gpu in place of onnxruntime: pip uninstall -y onnxruntime && pip install "graphc[cuda]"'
        )
    return None


def _ort(provider: str) -> Callable[..., Runner]:
    """The ``prepare`` of an onnxruntime backend: ``opset`` and ``attention`` for the export, then the fields of
    :class:`OrtOptions` as keywords (its signature is made from them, so the options are defined once; the CUDA-only
    ones are the CUDA provider's alone)."""
    names = [f.name for f in fields(OrtOptions) if provider == "CUDAExecutionProvider" or f.name not in OrtOptions.CUDA_ONLY]

    def prepare_ort(graph: Graph, opset: int | None = None, attention: str = "decomposed", **options: Any) -> Runner:
        from .ort_backend import prepare_ort as build

        unknown = sorted(set(options) - set(names))
        if unknown:
            raise BackendError(f"onnxruntime's {provider} takes option(s) {names}, not {unknown}")
        return build(provider, graph, _export, opset, attention, OrtOptions(**options))

    defaults = OrtOptions()
    head = list(inspect.signature(prepare_ort).parameters.values())[:3]
    keywords = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, n)) for n in names]
    setattr(prepare_ort, "__signature__", inspect.Signature([*head, *keywords], return_annotation=Runner))  # what prepare() reads
    return prepare_ort


def _torch_missing() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return 'torch is not installed (pip install "graphc[torch]")'
    return None


def _torch(graph: Graph, device: str | None = None, threads: int | None = None, sizes: Sizes = None) -> Runner:
    from .torch_backend import prepare_torch

    return prepare_torch(graph, device=device, threads=threads, sizes=sizes)


_ORT_DECODE = ((("attention", "auto"),), True)  # a decode loop's sessions get attention forms chosen for the step's sizes

BACKENDS: dict[str, BackendSpec] = {
    b.name: b
    for b in (
        BackendSpec("numpy", "NumPy interpreter (reference semantics)", lambda: None, _numpy),
        BackendSpec("onnx-reference", "ONNX ReferenceEvaluator on the exported model", lambda: None, _reference),
        BackendSpec("ort-cpu", "onnxruntime, CPUExecutionProvider", _ort_missing, _ort("CPUExecutionProvider"), *_ORT_DECODE),
        BackendSpec("ort-cuda", "onnxruntime, CUDAExecutionProvider", _cuda_missing, _ort("CUDAExecutionProvider"), *_ORT_DECODE),
        BackendSpec("torch", "torch ops interpreting the graph (CPU, or CUDA when present)", _torch_missing, _torch),
    )
}


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) a backend in the registry, e.g. a vendor runtime or a test double."""
    BACKENDS[spec.name] = spec


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend`."""
    get_backend(name)
    del BACKENDS[name]


def backend_names() -> list[str]:
    """Names of the registered backends."""
    return list(BACKENDS)


def get_backend(name: str) -> BackendSpec:
    """The backend registered as ``name``; an unknown name lists the valid ones."""
    if name not in BACKENDS:
        raise UnknownNameError("backend", name, backend_names())
    return BACKENDS[name]


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run on this machine, or ``None`` when it can."""
    return get_backend(name).unavailable()


def prepare(graph: Graph, backend: str = "numpy", **options: Any) -> Runner:
    """Prepare ``graph`` for ``backend``: lower it for the backend's target, export, build sessions.

    ``sizes`` (symbolic dim -> size, when the shapes of the runs are known)
    lets the lowering choose kernels per attention node (``attention="auto"``).
    Raises :class:`BackendUnavailableError` if the backend cannot run here.
    """
    spec = get_backend(backend)
    threads = options.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 4096):
        raise BackendError(f"threads must be an int in 1..4096 (or None for the cores available), got {threads!r}")
    reason = spec.unavailable()
    if reason:
        raise BackendUnavailableError(backend, reason)
    accepted = [p for p in inspect.signature(spec.prepare).parameters if p != "graph"]
    if "sizes" not in accepted:
        options.pop("sizes", None)  # a backend that chooses no kernels by size
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise BackendError(f"backend {backend!r} does not take option(s) {unknown}; it takes {accepted}")
    return spec.prepare(graph, **options)


def backend_options(backend: str, **options: Any) -> dict[str, Any]:
    """Those of ``options`` (the ones not None) that ``backend``'s ``prepare`` takes: one set of command-line options
    routed to each backend by its signature (``attention`` to the ONNX backends, ``tf32`` to ort-cuda ...)."""
    accepted = inspect.signature(get_backend(backend).prepare).parameters
    return {k: v for k, v in options.items() if v is not None and k in accepted}


def decode_options(backend: str, sizes: Mapping[str, int] | None = None, threads: int | None = None) -> dict[str, Any]:
    """The ``prepare`` options of a decode loop on ``backend``: its spec's :attr:`~BackendSpec.decode` options, the step's
    ``sizes`` and ``threads`` where the backend takes them."""
    spec = get_backend(backend)
    accepted = inspect.signature(spec.prepare).parameters
    options = dict(spec.decode)
    if sizes is not None and spec.decode_sizes and "sizes" in accepted:
        options["sizes"] = dict(sizes)
    if threads is not None and "threads" in accepted:
        options["threads"] = threads
    return options


def run(graph: Graph, inputs: Mapping[str, np.ndarray], backend: str = "numpy", **options: Any) -> dict[str, np.ndarray]:
    """Run ``graph`` on ``backend``; ``inputs`` are checked against the graph before anything runs.

    Options: ``numpy``: ``compute_dtype``, ``threads``, ``reference``; ONNX backends: ``opset``,
    ``attention`` (``decomposed``, ``onnx-attention``, ``ort-gqa``, ``auto``);
    onnxruntime: ``threads``, ``isolate`` (run in a worker process, so that a
    crash inside onnxruntime is a :class:`BackendError`); ``ort-cuda``: ``tf32`` (TF32 MatMul; default off),
    ``cuda_graph`` (capture the decode step of an LM with ``cache="static"``);
    ``torch``: ``device``, ``threads``.
    """
    get_backend(backend)
    sizes = check_inputs(graph, inputs)
    upcast = options.get("compute_dtype") == "float64"
    check_allocation(graph_run_bytes(graph, sizes, upcast=upcast), f"running graph {graph.name!r} on {backend}")
    return prepare(graph, backend, **{"sizes": sizes, **options}).run(inputs)
