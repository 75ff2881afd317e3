"""Node order and ``If`` branches: the nodes an import converts, in an order where each reads what is defined.

``in_topological_order`` sorts a node list stably; ``chosen_branch`` replaces an ``If`` whose condition is known at
import (a constant, or a graph input fixed by ``from_onnx(..., fixed_inputs=...)``) by the nodes of the branch it
takes.  optimum's merged decoders (``decoder_model_merged.onnx``) hold two steps behind one ``If`` on the
``use_cache_branch`` input: fixing it to ``True`` imports the step over a cache, ``False`` the first step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from ..errors import OnnxImportError
from .context import ONNX_TO_DTYPE, ImportContext, simplify

__all__ = ["in_topological_order", "chosen_branch", "fixed_input_value"]


def in_topological_order(nodes: Sequence[onnx.NodeProto], defined: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` in their own order where each input is defined before its reader, else reordered so (stable: a node
    moves only behind what it reads).  ONNX asks for sorted nodes, but files that onnxruntime runs are not always
    sorted (its float16 converter appends the input ``Cast``s last).  A node whose input nothing defines keeps its
    place at the end, and the import then names the missing value.  Values a node's subgraphs read from the enclosing
    scope count as its inputs."""
    nodes = list(nodes)
    needs = [set(node.input) | _outer_names(node) for node in nodes]
    known = set(defined) | {""}
    for node, need in zip(nodes, needs):
        if not need <= known:
            break
        known.update(node.output)
    else:
        return nodes
    start = set(defined) | {""}
    missing = [need - start for need in needs]  # what each node still waits for
    waiters: dict[str, list[int]] = {}
    for i, names in enumerate(missing):
        for name in names:
            waiters.setdefault(name, []).append(i)
    ready = [i for i, names in enumerate(missing) if not names]  # the earliest ready node goes next: a stable order
    heapq.heapify(ready)
    placed: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        placed.append(i)
        for name in nodes[i].output:
            for j in waiters.pop(name, ()):
                missing[j].discard(name)
                if not missing[j]:
                    heapq.heappush(ready, j)
    left = sorted(set(range(len(nodes))) - set(placed))
    return [nodes[i] for i in placed + left]


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """The names a node's subgraphs (``If``, ``Loop``, ``Scan``) read from outside themselves."""
    found: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            inner = {t.name for t in sub.initializer} | {v.name for v in sub.input} | {o for n in sub.node for o in n.output}
            for n in sub.node:
                found |= (set(n.input) | _outer_names(n)) - inner - {""}
    return found


def chosen_branch(ctx: ImportContext, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The nodes that stand for ``If`` node ``node`` once its condition is known: its branch's initializers as
    ``Constant`` nodes, the branch's nodes in order, and one ``Identity`` a branch output naming the ``If``'s output.
    The branch reads the enclosing graph's values by name, as ONNX lets it.  ``None`` for a condition computed at run
    time over branches that read only their own values (the ``If`` is then carried through opaquely); an error that
    names the input to fix where they read the enclosing graph's."""
    given = ctx.get(node.input[0]) if node.input else None
    cond = simplify(given) if given is not None else None
    if not isinstance(cond, np.ndarray) and not _outer_names(node):
        return None
    if not isinstance(cond, np.ndarray):
        source = node.input[0] if node.input else "?"
        raise ctx.error(
            f"If on condition {source!r}, which is known only at run time; graphc imports one branch: fix it with "
            f"from_onnx(..., fixed_inputs={{{source!r}: True}}) (optimum's merged decoders: True is the step over a cache, False the first step)"
        )
    if cond.size != 1:
        raise ctx.error(f"If condition {node.input[0]!r} holds {cond.size} elements; ONNX takes one")
    branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    taken = "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"
    if taken not in branches:
        raise ctx.error(f"If has no {taken} (attributes: {', '.join(sorted(branches)) or 'none'})")
    branch = branches[taken]
    if len(branch.output) != len(node.output):
        raise ctx.error(f"If's {taken} has {len(branch.output)} outputs for the node's {len(node.output)}")
    prefix = node.name or node.output[0]
    constants = [helper.make_node("Constant", [], [t.name], name=f"{prefix}/{t.name}", value=t) for t in branch.initializer]
    body = in_topological_order(branch.node, set(ctx.env) | {t.name for t in branch.initializer})
    outs = [helper.make_node("Identity", [b.name], [o], name=f"{prefix}/{taken}/{o}") for b, o in zip(branch.output, node.output) if o]
    return [*constants, *body, *outs]


def fixed_input_value(vi: onnx.ValueInfoProto, value: object) -> np.ndarray:
    """``value`` for graph input ``vi`` (``from_onnx``'s ``fixed_inputs``): the input's dtype, a shape its declaration allows."""
    tt = vi.type.tensor_type
    dtype = ONNX_TO_DTYPE.get(tt.elem_type)
    if dtype is None:
        raise OnnxImportError(f"fixed input {vi.name!r} has a type graphc does not support ({onnx.helper.printable_type(vi.type)})")
    try:
        arr = np.asarray(value)
        if arr.dtype != np.dtype(dtype) and not np.array_equal(arr.astype(dtype), arr):
            raise ValueError(f"its values change as {dtype}")
        arr = arr.astype(dtype)
    except (TypeError, ValueError) as e:
        raise OnnxImportError(f"fixed input {vi.name!r}: {value!r} is not a {dtype} value ({e})") from None
    declared = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") else None
    if declared is not None:
        if arr.ndim == 0 and len(declared) == 1 and declared[0] in (1, None):
            arr = arr.reshape(1)  # use_cache_branch: bool[1], given as True
        if arr.ndim != len(declared) or any(d is not None and d != n for d, n in zip(declared, arr.shape)):
            shown = ["?" if d is None else d for d in declared]
            raise OnnxImportError(f"fixed input {vi.name!r} has shape {list(arr.shape)}; the model declares {shown}")
    arr.setflags(write=False)
    return arr
