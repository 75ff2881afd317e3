"""The reference for a graph imported from ONNX: the original file run by onnxruntime (or ONNX's reference evaluator).

``compare`` on an imported graph must not check graphc's conversion against
itself: the float64 NumPy run of the imported graph would repeat any mistake
the importer made.  :func:`onnx_model_reference` runs the *original* model
instead, matching graphc's inputs and outputs to the model's by position (the
importer keeps their order), on onnxruntime's CPU provider with its graph
rewrites off, or, where onnxruntime refuses the model, on ONNX's reference
evaluator.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx

from graphc.errors import BackendError, GraphcError
from graphc.graph import Graph

__all__ = ["onnx_model_reference", "feeds_for_model", "OnnxReference"]

OnnxReference = tuple[str, Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]]
"""A description of the reference and the function that runs it on graphc's inputs, giving graphc's output names."""


def onnx_model_reference(
    model: str | os.PathLike[str] | onnx.ModelProto, graph: Graph, fixed_inputs: Mapping[str, object] | None = None
) -> OnnxReference:
    """The reference run of the ONNX ``model`` that ``graph`` was imported from; see the module doc.  ``fixed_inputs``:
    the inputs ``from_onnx`` was given values for (fed to the model with those values)."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load_model(str(model), load_external_data=False)
    onnx_inputs, model_feeds = feeds_for_model(proto, graph, fixed_inputs)
    onnx_outputs = [vi.name for vi in proto.graph.output]
    if len(onnx_inputs) != len(graph.inputs) or len(onnx_outputs) != len(graph.outputs):
        raise GraphcError(
            f"graph {graph.name!r} has {len(graph.inputs)} inputs / {len(graph.outputs)} outputs, the ONNX model "
            f"{len(onnx_inputs)} / {len(onnx_outputs)}: it was not imported from this model"
        )
    run, what = _onnxruntime(model)
    if run is None:
        run, what = _reference_evaluator(model)

    def reference(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            results = run(model_feeds(inputs))
        except Exception as e:  # noqa: BLE001 - the runtime's own errors, named
            raise BackendError(f"the reference ({what}) failed on the original model: {type(e).__name__}: {e}") from None
        return {g: np.asarray(r) for g, r in zip(graph.outputs, results)}

    return f"{what} on the original ONNX model (independent of graphc's import)", reference


def feeds_for_model(
    proto: onnx.ModelProto, graph: Graph, fixed_inputs: Mapping[str, object] | None = None
) -> tuple[list[str], Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]]:
    """How graphc's inputs feed the ONNX model ``graph`` was imported from: the model's inputs that graphc's match by
    position (initializers and ``fixed_inputs`` left out), and the function from graphc's inputs to the model's feeds
    (the fixed inputs with the values ``from_onnx`` was given)."""
    from graphc.onnx_import.branches import fixed_input_value

    init = {t.name for t in proto.graph.initializer}
    fixed = dict(fixed_inputs or {})
    given = {vi.name: fixed_input_value(vi, fixed[vi.name]) for vi in proto.graph.input if vi.name in fixed}
    names = [vi.name for vi in proto.graph.input if vi.name not in init and vi.name not in given]
    return names, lambda inputs: {**given, **{o: np.asarray(inputs[g]) for o, g in zip(names, graph.inputs)}}


def _onnxruntime(model: str | os.PathLike[str] | onnx.ModelProto) -> tuple[Callable | None, str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return None, ""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the model as written
    options.log_severity_level = 3
    source = str(Path(model)) if not isinstance(model, onnx.ModelProto) else model.SerializeToString()
    try:
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - e.g. an op onnxruntime lacks: fall back to ONNX's evaluator
        return None, ""
    return (lambda feeds: session.run(None, feeds)), f"onnxruntime {ort.__version__} (CPU, no graph rewrites)"


def _reference_evaluator(model: str | os.PathLike[str] | onnx.ModelProto) -> tuple[Callable, str]:
    from onnx.reference import ReferenceEvaluator

    try:
        evaluator = ReferenceEvaluator(model if isinstance(model, onnx.ModelProto) else str(model))
    except Exception as e:  # noqa: BLE001
        raise BackendError(f"neither onnxruntime nor ONNX's reference evaluator can load the original model: {type(e).__name__}: {e}") from None
    return (lambda feeds: evaluator.run(None, feeds)), f"onnx {onnx.__version__} ReferenceEvaluator"
