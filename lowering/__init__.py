"""Backends that run graphc graphs, and ONNX export.

``run(graph, inputs, backend=...)`` runs on ``numpy`` (the interpreter, reference
semantics), ``onnx-reference``, ``ort-cpu``, ``ort-cuda`` or ``torch``;
``export(graph, path)`` writes an ONNX model.
"""

from .backends.registry import (
    BACKENDS,
    BackendSpec,
    Runner,
    backend_names,
    get_backend,
    prepare,
    register_backend,
    run,
    unavailable_reason,
    unregister_backend,
)
from .compare import BackendResult, ComparisonReport, compare
from .kernels.contraction import contract, contract_pair, plan_matmul
from .generate import Generation, generate, left_pad
from .backends.inputs import check_inputs, random_inputs
from .decode.kv_cache import ArrayKVCache, KVCache, LMInterface
from .backends.numpy_interpreter import NumpyInterpreter, run_numpy
from .exporter.onnx_export import DEFAULT_OPSET, export
from .exporter.targets import ATTENTION_MODES, NUMPY_TARGET, TORCH_TARGET, onnx_target

__all__ = [
    "run",
    "compare",
    "generate",
    "Generation",
    "left_pad",
    "KVCache",
    "ArrayKVCache",
    "LMInterface",
    "ComparisonReport",
    "BackendResult",
    "BackendSpec",
    "register_backend",
    "unregister_backend",
    "prepare",
    "Runner",
    "BACKENDS",
    "backend_names",
    "get_backend",
    "unavailable_reason",
    "export",
    "ATTENTION_MODES",
    "NUMPY_TARGET",
    "TORCH_TARGET",
    "onnx_target",
    "DEFAULT_OPSET",
    "NumpyInterpreter",
    "run_numpy",
    "check_inputs",
    "random_inputs",
    "contract",
    "contract_pair",
    "plan_matmul",
]
