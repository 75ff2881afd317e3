"""Saving graphs to JSON and loading them back (no pickle, no eval).

The document is plain JSON: inputs, initializers (raw little-endian bytes in
base64), nodes with their op kind, typed attributes, operand names and declared
output type, and outputs.  Loading validates every field and then runs
:meth:`~graphc.graph.Graph.verify`; anything malformed raises
:class:`~graphc.errors.SerializationError` (or a verification error naming the
node) instead of a traceback from deep inside ``json`` or NumPy.
"""

from __future__ import annotations

import base64
import json
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

from .errors import CycleError, DuplicateNameError, GraphcError, SerializationError
from .graph import Graph, Node
from .numerics import contiguous
from .ops import OP_TYPES, Op, TensorType, payload_fields

__all__ = ["graph_to_dict", "graph_from_dict", "save_graph", "load_graph", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def _op_to_dict(op: Op) -> dict[str, Any]:
    return {"kind": op.kind, "attrs": op.attributes()}


def graph_to_dict(graph: Graph, include_weights: bool = True) -> dict[str, Any]:
    """Return ``graph`` as a JSON-ready dict; ``include_weights=False`` keeps only initializer types."""
    inits = []
    for name in sorted(graph.initializers):
        arr = graph.initializers[name]
        entry: dict[str, Any] = {"name": name, "dtype": str(arr.dtype), "shape": list(arr.shape)}
        if include_weights:
            entry["data"] = base64.b64encode(contiguous(arr).astype(arr.dtype.newbyteorder("<")).tobytes()).decode("ascii")
        inits.append(entry)
    doc = {
        "format": "graphc",
        "version": FORMAT_VERSION,
        "name": graph.name,
        "inputs": [{"name": n, "shape": list(graph.types[n].shape), "dtype": graph.types[n].dtype} for n in graph.inputs],
        "initializers": inits,
        "nodes": [_node_to_dict(graph, node) for node in graph.topological_order()],
        "outputs": list(graph.outputs),
    }
    if graph.assumptions:
        doc["assumptions"] = [[a, b] for a, b in graph.assumptions]
    return doc


def _node_to_dict(graph: Graph, node: Node) -> dict[str, Any]:
    def typ(name: str) -> dict[str, Any]:
        return {"shape": list(graph.types[name].shape), "dtype": graph.types[name].dtype}

    d: dict[str, Any] = {"name": node.name, "op": _op_to_dict(node.op), "inputs": list(node.inputs)}
    if len(node.outputs) == 1:
        d["type"] = typ(node.name)
    else:
        d["outputs"] = [{"name": o, "type": typ(o)} for o in node.outputs]
    return d


_JSON_NAMES: dict[type, str] = {str: "string", list: "array", dict: "object"}


def _req(d: Any, key: str, typ: type, where: str) -> Any:
    if not isinstance(d, dict):
        raise SerializationError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if key not in d:
        raise SerializationError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ):
        raise SerializationError(f"{where}: field {key!r} must be a JSON {_JSON_NAMES[typ]}, got {type(v).__name__}")
    return v


def _op_from_dict(d: Any, where: str) -> Op:
    kind = _req(d, "kind", str, where)
    attrs = _req(d, "attrs", dict, where)
    if kind not in OP_TYPES:
        raise SerializationError(f"{where}: unknown op kind {kind!r}; valid kinds: {', '.join(OP_TYPES)}")
    cls = OP_TYPES[kind]
    names = {f.name for f in payload_fields(cls)}
    required = {f.name for f in payload_fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    if not required <= set(attrs) <= names:
        raise SerializationError(f"{where}: op {kind} takes attributes {sorted(names)} (required: {sorted(required)}), got {sorted(attrs)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}
    try:
        return cls(**kwargs)
    except GraphcError as e:
        raise SerializationError(f"{where}: invalid {kind} attributes: {e}") from None
    except (TypeError, ValueError) as e:
        raise SerializationError(f"{where}: invalid {kind} attributes {attrs}: {e}") from None


def _type(d: Any, where: str) -> TensorType:
    shape = _req(d, "shape", list, where)
    dtype = _req(d, "dtype", str, where)
    try:
        return TensorType(tuple(shape), dtype)
    except GraphcError as e:
        raise SerializationError(f"{where}: {e}") from None


def graph_from_dict(doc: Any) -> Graph:
    """Rebuild a graph from :func:`graph_to_dict` output and verify it."""
    if not isinstance(doc, dict) or doc.get("format") != "graphc":
        raise SerializationError('not a graphc graph document (expected a JSON object with "format": "graphc")')
    if doc.get("version") != FORMAT_VERSION:
        raise SerializationError(f"unsupported graphc format version {doc.get('version')!r}; this graphc reads version {FORMAT_VERSION}")
    g = Graph(_req(doc, "name", str, "graph"))
    try:
        for i, d in enumerate(_req(doc, "inputs", list, "graph")):
            t = _type(d, f"inputs[{i}]")
            g.add_input(_req(d, "name", str, f"inputs[{i}]"), t.shape, t.dtype)
        for i, d in enumerate(_req(doc, "initializers", list, "graph")):
            where = f"initializers[{i}]"
            t = _type(d, where)
            if "data" not in d:
                raise SerializationError(f"{where}: no 'data' (the graph was saved without weights)")
            try:
                raw = base64.b64decode(_req(d, "data", str, where), validate=True)
                arr = np.frombuffer(raw, dtype=np.dtype(t.dtype).newbyteorder("<")).astype(t.dtype).reshape(tuple(int(d) for d in t.shape))
            except (ValueError, TypeError) as e:
                raise SerializationError(f"{where}: data does not decode to {t}: {e}") from None
            g.add_initializer(_req(d, "name", str, where), arr)
        pending = []
        for i, d in enumerate(_req(doc, "nodes", list, "graph")):
            where = f"nodes[{i}]"
            name = _req(d, "name", str, where)
            op = _op_from_dict(_req(d, "op", dict, where), f"{where} ({name!r})")
            inputs = _req(d, "inputs", list, where)
            if not all(isinstance(x, str) for x in inputs):
                raise SerializationError(f"{where}: 'inputs' must be a list of value names")
            if "outputs" in d:
                outs = _req(d, "outputs", list, where)
                names = [_req(o, "name", str, f"{where}.outputs") for o in outs]
                types = [_type(_req(o, "type", dict, f"{where}.outputs"), where) for o in outs]
            else:
                names, types = [name], [_type(_req(d, "type", dict, where), where)]
            pending.append((where, op, inputs, names, types))
        for where, op, inputs, names, types in _dependency_order(pending):
            g.add_multi_node(op, inputs, names, types)
        outputs = _req(doc, "outputs", list, "graph")
        if not all(isinstance(x, str) for x in outputs):
            raise SerializationError("graph: 'outputs' must be a list of value names")
        g.outputs = list(outputs)
        for i, pair in enumerate(doc.get("assumptions", [])):
            if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in pair):
                raise SerializationError(f"assumptions[{i}] must be a pair of dims [a, b], got {pair!r}")
            g.assume(*pair)
    except SerializationError:
        raise
    except GraphcError as e:
        raise type(e)(f"while loading graph {g.name!r}: {e}") from None
    g.verify()
    return g


def _dependency_order(
    pending: list[tuple[str, Op, list[str], list[str], list[TensorType]]],
) -> list[tuple[str, Op, list[str], list[str], list[TensorType]]]:
    """The nodes of a document in an order where each reads only what came before (file order kept where valid)."""
    producer: dict[str, int] = {}
    for k, p in enumerate(pending):
        for n in p[3]:
            if n in producer:
                raise DuplicateNameError(f"{p[0]}: value {n!r} is already produced by {pending[producer[n]][0]}; every value has one producer")
            producer[n] = k
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(pending)))
    for k, p in enumerate(pending):
        dag.add_edges_from((producer[i], k) for i in p[2] if i in producer)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        names = [pending[a][3][0] for a, _ in cycle]
        raise CycleError(f"graph has a cycle: {' -> '.join(names)} -> {names[0]}")
    return [pending[k] for k in nx.lexicographical_topological_sort(dag)]


def save_graph(graph: Graph, path: str | Path, include_weights: bool = True) -> None:
    """Write ``graph`` as JSON to ``path``."""
    text = json.dumps(graph_to_dict(graph, include_weights), indent=1)
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise SerializationError(f"cannot write graph file {str(path)!r}: {e.strerror or e}") from None


def load_graph(path: str | Path) -> Graph:
    """Read a graph written by :func:`save_graph`; errors name the file and the field."""
    if not isinstance(path, (str, Path)):
        raise SerializationError(f"load_graph takes a file path, got {type(path).__name__} {path!r}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SerializationError(f"cannot read graph file {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SerializationError(f"{path}: not a graphc JSON graph (not UTF-8 text: byte {e.start} is {e.object[e.start]:#04x})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SerializationError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise SerializationError(f"{path}: JSON nested too deeply to be a graphc graph") from None
    return graph_from_dict(doc)
