"""Each ONNX node is checked against its op schema before graphc converts it.

ONNX's own checker (``onnx.checker.check_node``, from the ``onnx.defs``
schemas) refuses a node whose domain the model does not import, an op the
opset does not define, a wrong input or output count, a missing required
attribute, an unknown attribute or one of the wrong type.  On top of it, the
schema's type constraints are checked against the types graphc knows for the
inputs: every input bound to one type parameter (``T`` of ``Add``) has the
same element type, and that type is one the parameter allows; flag attributes
(``keepdims``, ``transA`` ...) are 0 or 1.  Contrib
domains (``com.microsoft``) have no ``onnx.defs`` schema; their converters
check what they read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import checker, defs

from ..errors import OnnxImportError

__all__ = ["SchemaChecker", "onnx_type_string", "FLAG_ATTRIBUTES"]

_GRAPHC_TO_ONNX = {
    "float32": "tensor(float)",
    "float64": "tensor(double)",
    "float16": "tensor(float16)",
    "bfloat16": "tensor(bfloat16)",
    "int32": "tensor(int32)",
    "int64": "tensor(int64)",
    "bool": "tensor(bool)",
}


def onnx_type_string(dtype: str | np.dtype) -> str:
    """``tensor(float)`` for ``float32``: the spelling of an element type in ONNX's schemas."""
    name = str(dtype)
    if name in _GRAPHC_TO_ONNX:
        return _GRAPHC_TO_ONNX[name]
    try:
        code = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(name))
    except (TypeError, KeyError, ValueError):
        return f"tensor({name})"
    return f"tensor({onnx.TensorProto.DataType.Name(code).lower()})"


FLAG_ATTRIBUTES = frozenset(
    {
        "keepdims",
        "noop_with_empty_axes",
        "transA",
        "transB",
        "upper",
        "allowzero",
        "reverse",
        "exclusive",
        "is_causal",
        "select_last_index",
        "ceil_mode",
        "count_include_pad",
        "interleaved",
        "do_rotary",
        "unidirectional",
    }
)
"""Int attributes that are flags: the schemas type them as ints, and runtimes disagree on values other than 0 and 1
(onnxruntime's reductions keep dims only for ``keepdims == 1``), so graphc refuses those values."""


def _checker_context(ir_version: int, opsets: Mapping[str, int]) -> checker.C.CheckerContext:
    ctx = checker.C.CheckerContext()
    ctx.ir_version = max(int(ir_version), 3)
    ctx.opset_imports = {("" if d == "ai.onnx" else d): v for d, v in opsets.items()}
    return ctx


class SchemaChecker:
    """Checks nodes of one model against the schemas of the opsets it imports."""

    def __init__(self, ir_version: int, opsets: Mapping[str, int], runtime_ops: frozenset[str] = frozenset()) -> None:
        self.opsets = dict(opsets)
        self.runtime_ops = runtime_ops  # default-domain ops onnxruntime defines beyond the standard (SimplifiedLayerNormalization)
        self._ctx = _checker_context(ir_version, opsets)
        self._scope = checker.C.LexicalScopeContext()

    def check(self, node: onnx.NodeProto, input_types: Sequence[str | None], where: str) -> None:
        """Raise :class:`OnnxImportError` (prefixed with ``where``) if ``node`` breaks its schema.

        ``input_types`` are the element types of the node's inputs as graphc knows them (``None`` for an omitted one).
        """
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        if (domain or "ai.onnx") not in self.opsets:
            raise OnnxImportError(f"{where}: domain {domain or 'ai.onnx'!r} is not in the model's opset_import ({', '.join(sorted(self.opsets))})")
        if not domain and node.op_type in self.runtime_ops and not _standard(node.op_type, self.opsets["ai.onnx"]):
            return
        try:
            checker.check_node(node, self._ctx, self._scope)
        except (checker.ValidationError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OnnxImportError(f"{where}: not a valid {node.op_type} node under opset {self.opsets.get(domain or 'ai.onnx')}: {first}") from None
        for a in node.attribute:
            if a.name in FLAG_ATTRIBUTES and a.type == onnx.AttributeProto.INT and a.i not in (0, 1):
                raise OnnxImportError(f"{where}: attribute {a.name}={a.i}; it is a flag, 0 or 1 (runtimes read other values differently)")
        if domain not in ("", "ai.onnx.ml"):
            return
        try:
            schema = defs.get_schema(node.op_type, self.opsets[domain or "ai.onnx"], domain)
        except defs.SchemaError:  # the checker accepted it, so nothing to add
            return
        _check_types(schema, input_types, where)


def _standard(op_type: str, opset: int) -> bool:
    try:
        defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return False
    return True


def _check_types(schema: defs.OpSchema, input_types: Sequence[str | None], where: str) -> None:
    formals = list(schema.inputs)
    if not formals:
        return
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    bound: dict[str, tuple[int, str]] = {}
    for k, dtype in enumerate(input_types):
        if dtype is None:
            continue
        formal = formals[min(k, len(formals) - 1)]
        actual = onnx_type_string(dtype)
        param = formal.type_str
        if param in allowed:
            if allowed[param] and actual not in allowed[param]:
                raise OnnxImportError(
                    f"{where}: input {k} ({formal.name}) is {actual}; {schema.name} allows {param} in {', '.join(sorted(allowed[param]))}"
                )
            variadic_mixed = formal.option == defs.OpSchema.FormalParameterOption.Variadic and not formal.is_homogeneous
            if param in bound and bound[param][1] != actual and not variadic_mixed:
                first_k, first_type = bound[param]
                raise OnnxImportError(
                    f"{where}: input {k} ({formal.name}) is {actual} but input {first_k} is {first_type}; {schema.name} needs one type {param} "
                    f"for both"
                )
            bound.setdefault(param, (k, actual))
        elif param.startswith("tensor(") and actual != param and param != "tensor(undefined)":
            raise OnnxImportError(f"{where}: input {k} ({formal.name}) is {actual}; {schema.name} takes {param}")
