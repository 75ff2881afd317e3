"""The ``torch`` backend: the same DAG interpreted with torch ops (CPU, or CUDA when present).

It sets graphc's results and speed beside the framework users know.  Einsums
run through ``torch.einsum`` (which dispatches to batched GEMMs); a softmax row
that is entirely masked gives zeros, as in every graphc backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from graphc.dims import eval_dim, eval_shape
from graphc.errors import ExecutionError
from graphc.graph import Graph
from graphc.ops import Binary, CausalMask, Cast, Concat, Einsum, Op, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where

from .backends import Runner
from .inputs import check_inputs

__all__ = ["prepare_torch"]


def _kernels(torch: Any) -> dict[type[Op], Callable[..., Any]]:
    dtypes = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
    unary = {"exp": torch.exp, "neg": torch.neg, "tanh": torch.tanh, "sqrt": torch.sqrt, "reciprocal": torch.reciprocal, "relu": torch.relu, "sigmoid": torch.sigmoid}
    binary = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "max": torch.maximum}

    def softmax(op: Softmax, a: list[Any], env: dict[str, int]) -> Any:
        return torch.nan_to_num(torch.softmax(a[0], dim=op.axis), nan=0.0)

    def causal(op: CausalMask, a: list[Any], env: dict[str, int]) -> Any:
        x = a[0]
        sq, sk = x.shape[-2], x.shape[-1]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(eval_dim(op.offset, env) + 1)
        return x.masked_fill(hidden, float("-inf"))

    return {
        Einsum: lambda op, a, env: torch.einsum(op.spec, *a),
        Reshape: lambda op, a, env: a[0].reshape(eval_shape(op.shape, env)),
        Transpose: lambda op, a, env: a[0].permute(*op.perm),
        Repeat: lambda op, a, env: torch.repeat_interleave(a[0], op.repeats, dim=op.axis),
        Softmax: softmax,
        Concat: lambda op, a, env: torch.cat(a, dim=op.axis),
        Cast: lambda op, a, env: a[0].to(dtypes[op.dtype]),
        Unary: lambda op, a, env: unary[op.fn](a[0]),
        Binary: lambda op, a, env: binary[op.fn](a[0], a[1]),
        Where: lambda op, a, env: torch.where(a[0], a[1], a[2]),
        Scale: lambda op, a, env: a[0] * op.factor,
        CausalMask: causal,
    }


def prepare_torch(graph: Graph, device: str | None = None, threads: int | None = None) -> Runner:
    """A runner interpreting ``graph`` with torch on ``device`` (default: CUDA when available, else CPU)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if threads:
        torch.set_num_threads(threads)
    kernels = _kernels(torch)
    order = graph.topological_order()
    weights = {k: torch.from_numpy(np.array(v)).to(dev) for k, v in graph.initializers.items()}

    def fn(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env_dims = check_inputs(graph, inputs)
        env: dict[str, Any] = dict(weights)
        env.update({k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in inputs.items()})
        with torch.no_grad():
            for node in order:
                try:
                    env[node.name] = kernels[type(node.op)](node.op, [env[i] for i in node.inputs], env_dims)
                except Exception as e:  # noqa: BLE001 - re-raised with the node attached
                    raise ExecutionError(f"torch backend: node {node.name!r} ({node.op}) failed: {type(e).__name__}: {e}", node.name) from e
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return {o: env[o].cpu().numpy() for o in graph.outputs}

    return Runner("torch", f"torch {torch.__version__} {dev}", graph, fn)
