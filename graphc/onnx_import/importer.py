"""``from_onnx``: an ONNX model as a graphc graph.

One pass over the nodes in order.  Each node is converted by the converter of
its op type (:mod:`.convert_core`, :mod:`.convert_fused`), unless all its
inputs are known at import time: then ONNX's own reference evaluator computes
it (so any standard op can appear in a constant or shape computation).  An op
with no converter becomes an :class:`~graphc.opaque.Opaque` node carrying the
output types ONNX shape inference gives it (``strict=True`` refuses it
instead).  Inputs keep their names and dims (``dim_param`` becomes a symbol),
outputs their names, and every value that maps one-to-one keeps its ONNX name.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..dims import Dim, dim_symbols, is_symbol, normalize_dim
from ..errors import GraphcError, OnnxImportError, UnknownNameError
from ..memory import check_allocation
from ..graph import Graph
from ..opaque import Opaque
from ..ops import UNARY_FUNCTIONS, Reshape
from .branches import chosen_branch, fixed_input_value, in_topological_order
from .context import ONNX_TO_DTYPE, Imported, ImportContext, simplify
from .convert_contrib import CONTRIB_CONVERTERS
from .convert_core import CORE_CONVERTERS, SPLIT, unary_converter
from .convert_fused import FUSED_CONVERTERS
from .convert_quantized import QUANTIZED_CONVERTERS
from .loading import read_model
from .schema import SchemaChecker
from .unify import DimConflict, substitute

__all__ = ["from_onnx", "supported_ops", "ATTENTION_SEMANTICS"]

_NAME_BAD = re.compile(r"[^A-Za-z0-9_.:/\-]")
_FOLD_LIMIT = 1 << 22  # elements: larger constant results stay lazy (a causal mask over 4096 keys is 16 M)
_NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "DequantizeLinear"}
"""Ops never run at import: random ones, and dequantization (a quantized weight stays quantized)."""


def supported_ops() -> dict[str, list[str]]:
    """The op types graphc converts, by domain (anything else imports as an opaque node)."""
    unary = (f.onnx for f in UNARY_FUNCTIONS.values() if f.onnx)
    std = sorted({*CORE_CONVERTERS, *unary, "Split", "Constant", *(k for (d, k) in FUSED_CONVERTERS if d == "")})
    contrib = {**FUSED_CONVERTERS, **CONTRIB_CONVERTERS, **QUANTIZED_CONVERTERS}
    return {"ai.onnx": std, "com.microsoft": sorted(k for (d, k) in contrib if d == "com.microsoft")}


def _clean_name(name: str) -> str:
    name = _NAME_BAD.sub("_", name)
    return name if name and re.match(r"[A-Za-z_/]", name) else f"v_{name}"


def _dim(d: onnx.TensorShapeProto.Dimension, fallback: str) -> Dim:
    if d.HasField("dim_value"):
        return int(d.dim_value)
    if d.HasField("dim_param") and d.dim_param:
        try:
            dim = normalize_dim(d.dim_param.replace(" ", ""))
            if isinstance(dim, int):  # dim_param "2" names a size, whatever it is at run time
                return "d_" + _clean_name(d.dim_param).replace(".", "_").replace(":", "_").replace("/", "_").replace("-", "_")
            return dim
        except GraphcError:
            return _clean_name(d.dim_param).replace(".", "_").replace(":", "_").replace("/", "_").replace("-", "_")
    return fallback


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, onnx.TensorProto):
            v = numpy_helper.to_array(v)
        elif isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode() for x in v]
        out[a.name] = v
    return out


def _constant(ctx: ImportContext, attrs: dict) -> np.ndarray:
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if key in attrs:
            arr = np.asarray(attrs[key])
            return arr.astype(np.float32) if key.startswith("value_float") else arr.astype(np.int64) if key.startswith("value_int") else arr
    raise ctx.error(f"Constant with attribute(s) {sorted(attrs)} is not supported (value, value_float(s), value_int(s))")


def _fold_elements(node: onnx.NodeProto, arrays: list[np.ndarray | None]) -> int | None:
    """The element count a folded node would produce, for the ops whose output can dwarf their inputs; ``None`` when unknown.

    Checked before the reference evaluator runs, so a ``ConstantOfShape([2**20, 2**20])`` is never allocated.
    """

    def count(shape: object) -> int:
        n = 1
        for d in np.asarray(shape).reshape(-1).tolist():
            n *= max(int(d), 0)
        return n

    op = node.op_type
    try:
        if op == "ConstantOfShape" and arrays[0] is not None:
            return count(arrays[0])
        if op == "Expand" and arrays[0] is not None and arrays[1] is not None:
            dims = [int(d) for d in arrays[1].reshape(-1)]
            src = list(arrays[0].shape)
            width = max(len(dims), len(src))
            dims, src = [1] * (width - len(dims)) + dims, [1] * (width - len(src)) + src
            return count([max(a, b) for a, b in zip(dims, src)])
        if op == "Range" and all(a is not None for a in arrays[:3]):
            start, limit, delta = (float(np.asarray(a).reshape(-1)[0]) for a in arrays[:3])
            return int(max(np.ceil((limit - start) / delta), 0)) if delta else None
        if op == "Tile" and arrays[0] is not None and arrays[1] is not None:
            return arrays[0].size * count(arrays[1])
        if op == "MatMul" and arrays[0] is not None and arrays[1] is not None and arrays[0].ndim >= 2 and arrays[1].ndim >= 2:
            a, b = arrays[0].shape, arrays[1].shape
            return count([*np.broadcast_shapes(a[:-2], b[:-2]), a[-2], b[-1]])
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    return None


def _safe_to_propagate(model: onnx.ModelProto) -> bool:
    """Whether ONNX's shape inference may propagate values: it computes ``Range``/``ConstantOfShape``/``Expand``
    outputs in full (a ``Range(0, 3e9)`` takes 24 GB there), so a model with a large one is inferred without it."""
    known: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and t.data_type in (
            onnx.TensorProto.INT64,
            onnx.TensorProto.INT32,
            onnx.TensorProto.FLOAT,
            onnx.TensorProto.DOUBLE,
        ):
            if int(np.prod(t.dims, dtype=np.int64)) <= 64:
                known[t.name] = numpy_helper.to_array(t)
    for vi in model.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > _FOLD_LIMIT:
                return False
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.output:
            try:
                value = np.asarray(next(iter(_attrs(node).values())))
            except Exception:  # noqa: BLE001 - a malformed Constant is reported when it is converted
                continue
            if value.size <= 64:
                known[node.output[0]] = value
        elif node.op_type in ("Range", "ConstantOfShape", "Expand", "Tile"):
            estimate = _fold_elements(node, [known.get(i) for i in node.input])
            if estimate is not None and estimate > _FOLD_LIMIT:
                return False
    return True


def _fold(ctx: ImportContext, node: onnx.NodeProto, arrays: list[np.ndarray | None]) -> list[np.ndarray] | None:
    """Run one standard node on known arrays with ONNX's reference evaluator; ``None`` when it cannot or the result would be large."""
    from onnx.reference import ReferenceEvaluator

    estimate = _fold_elements(node, arrays)
    if estimate is not None and estimate > _FOLD_LIMIT:
        return None  # converted as a lazy value or a graph op; errors, if any, are then about shapes, not memory

    names = [f"i{k}" if a is not None else "" for k, a in enumerate(arrays)]
    outs = [f"o{k}" for k in range(len(node.output))]
    n = helper.make_node(node.op_type, names, outs, **{a.name: helper.get_attribute_value(a) for a in node.attribute})
    inputs = [
        helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)) for nm, a in zip(names, arrays) if a is not None
    ]
    g = helper.make_graph([n], "fold", inputs, [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outs])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", ctx.opset)])
    try:
        results = ReferenceEvaluator(model).run(None, {nm: a for nm, a in zip(names, arrays) if a is not None})
    except Exception:  # noqa: BLE001 - the node then converts as a tensor op, whose errors are ours
        return None
    return [np.asarray(r) for r in results]


_OUTPUT_LIKE_INPUT = {("", "ScatterND"): 0, ("", "ScatterElements"): 0, ("", "Scatter"): 0}
"""Ops graphc carries as opaque whose output has the shape and dtype of one input (the data a scatter writes into)."""


def _opaque(ctx: ImportContext, node: onnx.NodeProto, opsets: Mapping[str, int]) -> list[Imported]:
    where = f"{node.domain or 'ai.onnx'}::{node.op_type}"
    if ctx.strict:
        raise ctx.error(f"graphc does not model {where} (strict import: pass strict=False / drop --strict to carry it through as an opaque node)")
    shapes, dtypes = [], []
    like = _OUTPUT_LIKE_INPUT.get((node.domain, node.op_type))
    for k, out in enumerate(node.output):
        if like is not None and k == 0:  # the output is its data input's shape: the file's own value_info may say otherwise
            data = ctx.graph.types[ctx.tensor(ctx.get(node.input[like]), f"input {like}")]
            shapes.append(data.shape)
            dtypes.append(data.dtype)
            continue
        t = ctx.onnx_types.get(out)
        tt = t.tensor_type if t is not None and t.HasField("tensor_type") else None
        if tt is None or tt.elem_type not in ONNX_TO_DTYPE or not tt.HasField("shape"):
            reason = _schema_refusal(ctx, node, opsets)
            if reason is not None:
                raise ctx.error(f"{where} does not fit its inputs, as ONNX's schema says: {reason}")
            raise ctx.error(
                f"{where} is not modelled by graphc and ONNX shape inference gives no type for its output {out!r}; declare it in value_info"
            )
        shapes.append(tuple(ctx.declare_dim(_dim(d, f"{_clean_name(out)}_dim{a}")) for a, d in enumerate(tt.shape.dim)))
        dtypes.append(ONNX_TO_DTYPE[tt.elem_type])
    proto = onnx.NodeProto(op_type=node.op_type, domain=node.domain)
    proto.attribute.extend(node.attribute)
    slots = tuple(k for k, i in enumerate(node.input) if i)
    inputs = [ctx.tensor(ctx.get(node.input[k]), f"input {k}") for k in slots]
    op = Opaque(
        node.op_type,
        node.domain,
        opsets.get(node.domain or "ai.onnx", 1),
        base64.b64encode(proto.SerializeToString()).decode(),
        tuple(shapes),
        tuple(dtypes),
        slots,
    )
    names = [ctx.graph.fresh_name(_clean_name(o)) for o in node.output]
    ctx.notes.append(f"{node.name or node.output[0]}: {where} kept as an opaque node")
    return [v.name for v in ctx.graph.add_multi_node(op, inputs, names)]


def _schema_refusal(ctx: ImportContext, node: onnx.NodeProto, opsets: Mapping[str, int]) -> str | None:
    """Why ONNX's own shape inference refuses ``node`` on the inputs it gets here (TopK's k past its axis, GatherND's
    batch_dims past a rank ...), or None when it does not (then the output's type is merely unknown)."""
    inputs, initializers = [], []
    for name in (i for i in node.input if i):
        value = ctx.env.get(name)
        if isinstance(value, np.ndarray):
            initializers.append(numpy_helper.from_array(np.asarray(value), name))
        elif isinstance(value, str) and value in ctx.graph.types:
            t = ctx.graph.types[value]
            dims = [d if isinstance(d, int) else str(d) for d in t.shape]
            inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), dims))
        else:
            return None
    g = helper.make_graph([node], "one_node", inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o], initializers)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid(d if d != "ai.onnx" else "", v) for d, v in opsets.items()])
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as e:  # noqa: BLE001 - the inference error's text is the reason
        lines = str(e).strip().splitlines()
        text = lines[0].rsplit("] ", 1)[-1].strip() if lines else ""
        return text or None
    return None


ATTENTION_SEMANTICS = ("onnx-1.23", "legacy")
"""How an ONNX ``Attention`` node is read: ``onnx-1.23`` (softcap before the masks, ``qk_matmul_output_mode`` 1 = after softcap,
2 = after the masks, causal aligned bottom-right with ``nonpad_kv_seqlen``) or ``legacy`` (onnx <= 1.21: masks before softcap,
modes 1 and 2 swapped, causal top-left with ``nonpad_kv_seqlen``)."""


def from_onnx(
    source: onnx.ModelProto | str | os.PathLike[str],
    strict: bool = False,
    name: str | None = None,
    attention_semantics: str = "onnx-1.23",
    fixed_inputs: Mapping[str, object] | None = None,
    dims: Mapping[str, int] | None = None,
) -> Graph:
    """Import an ONNX model (a path or a ``ModelProto``) as a graphc :class:`~graphc.graph.Graph`.

    Raises :class:`~graphc.errors.OnnxImportError` naming the file, node or
    value at fault.  ``strict=True`` makes an op graphc does not model an
    error (else it is carried through as an opaque node).
    ``attention_semantics`` selects how ``Attention`` nodes are read (see
    :data:`ATTENTION_SEMANTICS`; models written for onnx <= 1.21 may want ``"legacy"``).
    ``fixed_inputs`` gives graph inputs a value at import (they are constants of the graph, no longer inputs): an
    ``If`` on one imports the branch it takes (optimum's ``decoder_model_merged.onnx``: ``{"use_cache_branch": True}``
    is the step over a cache, ``False`` the first step).
    ``dims`` gives symbolic dims of the graph inputs a size (``{"height": 224, "width": 224}``): a Conv over a symbolic
    image, which graphc carries opaquely, then has a static output that meets the position table (optimum's ViT and
    CLIP vision files); the graph takes inputs of that size only.
    """
    if attention_semantics not in ATTENTION_SEMANTICS:
        raise UnknownNameError("attention semantics", str(attention_semantics), ATTENTION_SEMANTICS)
    model, mapped = read_model(source)
    with _static_input_dims(model, dict(dims or {})):
        return _from_model(model, mapped, strict, name, attention_semantics, dict(fixed_inputs or {}))


@contextmanager
def _static_input_dims(model: onnx.ModelProto, dims: dict[str, int]) -> Iterator[None]:
    """The graph inputs' dims named in ``dims`` given those sizes while the model imports (restored after: the model may be the caller's)."""
    for key, size in dims.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise OnnxImportError(f"dims[{key!r}] is {size!r}; a size is an int >= 1")
    named = [d for vi in model.graph.input for d in vi.type.tensor_type.shape.dim if d.HasField("dim_param") and d.dim_param in dims]
    unknown = sorted(set(dims) - {d.dim_param for d in named})
    if unknown:
        declared = sorted({d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim if d.HasField("dim_param")})
        names = ", ".join(map(repr, unknown))
        raise OnnxImportError(f"dims names {names}, which no graph input declares (their symbolic dims: {', '.join(declared) or 'none'})")
    params = [d.dim_param for d in named]
    for d, param in zip(named, params):
        d.dim_value = int(dims[param])
    try:
        yield
    finally:
        for d, param in zip(named, params):
            d.dim_param = param


def _from_model(
    model: onnx.ModelProto, mapped: Mapping[str, np.ndarray], strict: bool, name: str | None, attention_semantics: str, fixed: dict[str, object]
) -> Graph:
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=_safe_to_propagate(model))
    except Exception:  # noqa: BLE001 - shape inference is only a source of types for opaque nodes
        inferred = model
    schemas = SchemaChecker(model.ir_version, opsets, frozenset(k for (d, k) in FUSED_CONVERTERS if d == ""))
    g = Graph(_clean_name(name or model.graph.name or "imported"))
    ctx = ImportContext(g, opsets["ai.onnx"], strict, attention_semantics)
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        ctx.onnx_types[vi.name] = vi.type
    try:
        _import_graph(ctx, model, opsets, schemas, mapped, fixed)
    except DimConflict as c:  # met outside a node's conversion (the graph's outputs): not unified
        raise ctx.error(str(c.error)) from None
    except OnnxImportError:
        raise
    except GraphcError as e:
        raise ctx.error(str(e)) from None
    aliases = ctx.aliases
    for key, value in aliases.items():
        if not is_symbol(key):  # a min/max atom the model's shapes assume equal to one of its arguments: every run checks it
            others = {k: v for k, v in aliases.items() if k != key}
            g.assume(substitute(key, others), substitute(value, others))
    g.verify()
    return g


def _dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    """A ``sparse_initializer`` as the dense array it stands for (ONNX: indices as linear positions ``[NNZ]`` or as
    coordinates ``[NNZ, rank]``; every other element 0)."""
    name = sparse.values.name
    try:
        values = numpy_helper.to_array(sparse.values)
        indices = numpy_helper.to_array(sparse.indices).astype(np.int64) if sparse.HasField("indices") else np.zeros((0,), np.int64)
        shape = tuple(int(d) for d in sparse.dims)
        size = int(np.prod(shape, dtype=np.int64))
        if indices.ndim == 2:
            if indices.shape[1] != len(shape):
                raise ValueError(f"coordinates of rank {indices.shape[1]} for a tensor of rank {len(shape)}")
            indices = np.ravel_multi_index(tuple(indices.T), shape) if indices.size else indices.reshape(0)
        if values.shape != (indices.size,) or (indices.size and (indices.min() < 0 or indices.max() >= size)):
            raise ValueError(f"{values.size} values at {indices.size} positions in {size} elements")
        check_allocation(size * values.dtype.itemsize, f"sparse initializer {name!r} made dense")
        dense = np.zeros(size, values.dtype)
        dense[indices] = values
    except (ValueError, TypeError) as e:
        raise OnnxImportError(f"sparse initializer {name!r} cannot be read: {e}") from None
    dense = dense.reshape(shape)
    dense.setflags(write=False)
    return dense


def _read_initializers(ctx: ImportContext, model: onnx.ModelProto, mapped: Mapping[str, np.ndarray]) -> set[str]:
    """The model's initializers (dense and sparse) into the value map, read-only; returns their names."""
    init_names = set()
    for t in model.graph.initializer:
        try:
            arr = mapped[t.name] if t.name in mapped else numpy_helper.to_array(t)
            arr.setflags(write=False)  # graphs keep read-only arrays without copying them
            ctx.env[t.name] = arr
            ctx.array_names[id(arr)] = t.name
        except Exception as e:  # noqa: BLE001 - a malformed tensor
            raise OnnxImportError(f"initializer {t.name!r} cannot be read: {e}") from None
        init_names.add(t.name)
    for sparse in model.graph.sparse_initializer:
        arr = _dense(sparse)
        ctx.env[arr_name := sparse.values.name] = arr
        ctx.array_names[id(arr)] = arr_name
        init_names.add(arr_name)
    return init_names


def _import_graph(
    ctx: ImportContext,
    model: onnx.ModelProto,
    opsets: Mapping[str, int],
    schemas: SchemaChecker,
    mapped: Mapping[str, np.ndarray],
    fixed: dict[str, object],
) -> None:
    g = ctx.graph
    init_names = _read_initializers(ctx, model, mapped)
    unknown = sorted(set(fixed) - {vi.name for vi in model.graph.input if vi.name not in init_names})
    if unknown:
        inputs = [vi.name for vi in model.graph.input if vi.name not in init_names]
        raise OnnxImportError(f"fixed input(s) {', '.join(map(repr, unknown))} are not graph inputs of the model (its inputs: {', '.join(inputs)})")
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        if vi.name in fixed:
            ctx.env[vi.name] = fixed_input_value(vi, fixed[vi.name])
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or tt.elem_type not in ONNX_TO_DTYPE:
            raise OnnxImportError(
                f"graph input {vi.name!r} has a type graphc does not support ({onnx.helper.printable_type(vi.type)}); supported: "
                f"{', '.join(ONNX_TO_DTYPE.values())}"
            )
        if not tt.HasField("shape"):
            raise OnnxImportError(f"graph input {vi.name!r} declares no shape; graphc needs the rank")
        shape = tuple(
            ctx.declare_dim(_dim(d, f"{_clean_name(vi.name)}_dim{a}".replace("/", "_").replace(".", "_").replace(":", "_").replace("-", "_")))
            for a, d in enumerate(tt.shape.dim)
        )
        ctx.env[vi.name] = g.add_input(_clean_name(vi.name), shape, ONNX_TO_DTYPE[tt.elem_type]).name
    bound = {v for v in ctx.env.values() if isinstance(v, str)}
    nodes, index = in_topological_order(model.graph.node, set(ctx.env)), 0
    while index < len(nodes):  # one pass; a unification converts the node again (or goes back to a Div it decides)
        node = ctx.node = nodes[index]
        branch = chosen_branch(ctx, node) if node.op_type == "If" and node.domain in ("", "ai.onnx") else None
        if branch is not None:  # the branch its known condition takes, in its place
            nodes[index : index + 1] = branch
            continue
        ins = [ctx.get(i) for i in node.input]
        here = ctx.checkpoint(index, node.op_type, ins)
        try:
            schemas.check(node, [ctx.dtype_of(x) if x is not None else None for x in ins], ctx.where())
            _convert_node(ctx, node, ins, opsets, bound)
            ctx.note_unfolded(here, ins, [ctx.env.get(o) for o in node.output if o])
            index += 1
        except DimConflict as c:  # two dims the model proves equal: unify them in what is imported so far
            index = ctx.unify_conflict(c, here)
        except GraphcError as e:
            hint = _opaque_dims_hint(ctx, str(e))
            if hint:
                raise OnnxImportError(f"{e}; {hint}") from None
            raise
        except Exception as e:  # noqa: BLE001 - a node the converter did not expect: named, never a raw traceback
            raise ctx.error(f"graphc cannot convert this node ({type(e).__name__}: {e})") from None
    ctx.node = None
    outputs = []
    for vi in model.graph.output:
        v = ctx.get(vi.name)
        value = ctx.tensor(v, f"graph output {vi.name!r}")
        if value in g.inputs or value in g.initializers or value in outputs:  # an output must be computed by a node
            value = ctx.add(Reshape(g.types[value].shape), [value], "output")
        want = _clean_name(vi.name)
        if value != want and want not in g.types and value not in g.inputs and value not in g.initializers:
            g.rename_value(value, want)
            value = want
        outputs.append(value)
    g.output(*outputs)


def _opaque_dims_hint(ctx: ImportContext, message: str) -> str:
    """What to do when ``message`` names dims of an opaque node's output (a Conv over a symbolic image) that nothing
    ties to the graph inputs' dims; ``""`` when it names none."""
    inputs = [n for n in ctx.graph.inputs]
    at_inputs = {s for n in inputs for d in ctx.graph.types[n].shape for s in dim_symbols(d)}
    opaque = sorted(s for s in ctx.free if s not in at_inputs and re.search(rf"(?<![A-Za-z0-9_]){re.escape(s)}(?![A-Za-z0-9_])", message))
    if not opaque:
        return ""
    return (
        f"{', '.join(map(repr, opaque))} {'is a dim' if len(opaque) == 1 else 'are dims'} of an op graphc carries opaquely, not tied to the "
        f"inputs' dims ({', '.join(sorted(at_inputs)) or 'none'}): give those sizes, from_onnx(..., dims={{'height': 224, ...}}) "
        "or --static-dim NAME=INT"
    )


def _convert_node(ctx: ImportContext, node: onnx.NodeProto, ins: list, opsets: Mapping[str, int], bound: set[str]) -> None:
    attrs = _attrs(node)
    domain = node.domain if node.domain not in ("", "ai.onnx") else ""
    before = len(ctx.graph.types)
    if domain == "" and node.op_type == "Constant":
        outs: list[Imported] = [_constant(ctx, attrs)]
    elif (
        domain == ""
        and node.op_type not in _NEVER_FOLD
        and ins
        and all(simplify(x) is None or isinstance(simplify(x), np.ndarray) for x in ins)
        and any(x is not None for x in ins)
    ):
        arrays = [a if isinstance(a, np.ndarray) else None for a in (simplify(x) if x is not None else None for x in ins)]
        folded = _fold(ctx, node, arrays)
        if folded is not None and all(a.size <= _FOLD_LIMIT for a in folded):
            outs = list(folded)
        else:
            outs = _convert(ctx, node, domain, ins, attrs, opsets)
    else:
        outs = _convert(ctx, node, domain, ins, attrs, opsets)
    if len(outs) < len([o for o in node.output if o]):
        raise ctx.error(f"graphc computes {len(outs)} of this node's {len(node.output)} outputs; the others are not supported")
    created = len(ctx.graph.types) > before
    for onnx_name, v in zip(node.output, outs):
        if not onnx_name:
            continue
        if created and isinstance(v, str) and v != onnx_name and ctx.graph.producer(v) is not None:
            want = _clean_name(onnx_name)
            if want not in ctx.graph.types and not ctx.graph.is_output(v) and v not in bound:  # a value bound before (Identity) keeps its name
                ctx.graph.rename_value(v, want)
                v = want
        ctx.env[onnx_name] = v
        if isinstance(v, str):
            bound.add(v)


def _convert(ctx: ImportContext, node: onnx.NodeProto, domain: str, ins: list, attrs: dict, opsets: Mapping[str, int]) -> list[Imported]:
    if domain == "" and node.op_type == "Split":
        return SPLIT(ctx, ins, attrs, len(node.output))
    conv = (CORE_CONVERTERS.get(node.op_type) or unary_converter(node.op_type)) if domain == "" else None
    if conv is None:
        conv = FUSED_CONVERTERS.get((domain, node.op_type)) or CONTRIB_CONVERTERS.get((domain, node.op_type))
        conv = conv or QUANTIZED_CONVERTERS.get((domain, node.op_type))
    if conv is None:
        return _opaque(ctx, node, opsets)
    return conv(ctx, ins, attrs)
