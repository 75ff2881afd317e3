"""The ``torch`` backend: the same DAG interpreted with torch ops (CPU, or CUDA when present).

It sets graphc's results and speed beside the framework users know.  The graph
is lowered for the torch target first, so every recognised attention runs as
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``); einsums
run through ``torch.einsum`` (which dispatches to batched GEMMs); a softmax row
that is entirely masked gives zeros, as in every graphc backend.
"""

from __future__ import annotations

import warnings

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from graphc.attention_op import Attention
from graphc.dims import eval_dim, eval_shape
from graphc.errors import ExecutionError
from graphc.graph import Graph
from graphc.numerics import contiguous
from graphc.ops import Binary, CausalMask, Cast, Compare, Concat, Einsum, Op, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where
from graphc.optimizer import lower
from graphc.rotary import Positions
from graphc.tensor_ops import Gather, GatherElements, Reduce, Slice

from .runner import Runner
from .inputs import check_inputs
from ..exporter.targets import TORCH_TARGET

__all__ = ["prepare_torch"]


def _from_end(index: Any, n: int) -> Any:
    """ONNX's index rule: ``-n <= i < 0`` counts from the end; anything outside ``[-n, n)`` stays out of range, for torch to refuse."""
    return index.where(index >= 0, index + n)


def _kernels(torch: Any) -> dict[type[Op], Callable[..., Any]]:
    dtypes = {
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }

    def unary(op: Unary, a: list[Any], env: dict[str, int]) -> Any:
        path = op.function.torch
        if path is None:  # no torch spelling: the function's NumPy semantics
            return _to_torch(torch, contiguous(op.evaluate([_to_numpy(torch, a[0].cpu())], env))).to(a[0].device)
        fn: Any = torch
        for part in path.split("."):
            fn = getattr(fn, part)
        return fn(a[0])

    def divide(a: Any, b: Any) -> Any:  # graphc's integer div: truncating, 0 for a zero divisor
        if a.dtype.is_floating_point:
            return torch.div(a, b)
        zero = b == 0
        q = torch.div(a, torch.where(zero, torch.ones_like(b), b), rounding_mode="trunc")
        return torch.where(zero, torch.zeros_like(q), q)

    compare = {"less": torch.lt, "less_equal": torch.le, "greater": torch.gt, "greater_equal": torch.ge, "equal": torch.eq}
    binary = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": divide, "max": torch.maximum, "min": torch.minimum, "pow": torch.pow}

    def softmax(op: Softmax, a: list[Any], env: dict[str, int]) -> Any:
        return torch.nan_to_num(torch.softmax(a[0], dim=op.axis), nan=0.0)

    def causal(op: CausalMask, a: list[Any], env: dict[str, int]) -> Any:
        x = a[0]
        hidden = torch.from_numpy(op.visibility.hidden(x.shape[-2], x.shape[-1], env)).to(x.device)
        return x.masked_fill(hidden, float("-inf"))

    def reduce(op: Reduce, a: list[Any], env: dict[str, int]) -> Any:
        axes = list(op.normalized_axes(a[0].dim()))
        fns = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}
        return fns[op.fn](a[0], dim=axes, keepdim=op.keepdims) if axes else a[0].clone()

    return {
        Attention: lambda op, a, env: _attention(torch, op, a, env),
        Einsum: lambda op, a, env: torch.einsum(op.spec, *a),
        Reshape: lambda op, a, env: a[0].reshape(eval_shape(op.shape, env)),
        Transpose: lambda op, a, env: a[0].permute(*op.perm),
        Repeat: lambda op, a, env: torch.repeat_interleave(a[0], op.repeats, dim=op.axis),
        Softmax: softmax,
        Concat: lambda op, a, env: torch.cat(a, dim=op.axis),
        Cast: lambda op, a, env: a[0].to(dtypes[op.dtype]),
        Unary: unary,
        Binary: lambda op, a, env: binary[op.fn](a[0], a[1]),
        Where: lambda op, a, env: torch.where(a[0], a[1], a[2]),
        Compare: lambda op, a, env: compare[op.fn](a[0], a[1]),
        Scale: lambda op, a, env: a[0] * op.factor,
        CausalMask: causal,
        Reduce: reduce,
        Slice: lambda op, a, env: a[0][(slice(None),) * (op.axis % a[0].dim()) + (slice(eval_dim(op.start, env), eval_dim(op.stop, env), op.step),)],
        GatherElements: lambda op, a, env: torch.gather(a[0], op.axis, _from_end(a[1], a[0].shape[op.axis])),
        Gather: lambda op, a, env: torch.index_select(a[0], op.axis, _from_end(a[1], a[0].shape[op.axis]).reshape(-1)).reshape(
            a[0].shape[: op.axis % a[0].dim()] + a[1].shape + a[0].shape[op.axis % a[0].dim() + 1 :]
        ),
        Positions: lambda op, a, env: torch.arange(a[0].shape[op.axis], device=a[0].device) + eval_dim(op.offset, env),
    }


def _attention(torch: Any, op: Attention, a: list[Any], env: dict[str, int]) -> Any:
    """The Attention op as scaled_dot_product_attention (the causal mask and a user mask as one additive bias)."""
    q, k, v = a[:3]
    rest = a[3:]
    mask = rest.pop(0) if op.has_mask else None
    if op.kv_cache:
        k, v = torch.cat([rest[0], k], dim=2), torch.cat([rest[1], v], dim=2)
    sq, sk = q.shape[2], k.shape[2]
    bias = None
    if op.visibility.is_causal:
        hidden = torch.from_numpy(op.visibility.hidden(sq, sk, env)).to(q.device)
        bias = torch.zeros(sq, sk, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
    if mask is not None:
        m = mask if op.mask == "additive" else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        bias = m if bias is None else bias + m
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=op.scale, enable_gqa=k.shape[1] != q.shape[1])
    out = torch.nan_to_num(out, nan=0.0)  # a row with no visible key: zeros
    return (out, k, v) if op.kv_cache else out


def _to_torch(torch: Any, arr: np.ndarray) -> Any:
    """``torch.from_numpy``, plus bfloat16 (ml_dtypes), which torch cannot take directly: same bits, viewed.

    A read-only array is copied: torch tensors are writable (weights go through :func:`_weight`)."""
    if not arr.flags.writeable:
        arr = arr.copy()
    if str(arr.dtype) == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _weight(torch: Any, arr: np.ndarray, dev: Any) -> Any:
    """A weight as a tensor on ``dev`` that shares memory with ``arr`` on the CPU (memory-mapped weights included: the
    interpreter's kernels never write their operands in place, so torch's writable-tensor warning does not apply)."""
    arr = contiguous(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if str(arr.dtype) == "bfloat16" else torch.from_numpy(arr)
    return t.to(dev)


def _to_numpy(torch: Any, t: Any) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("bfloat16")
    return t.numpy()


def prepare_torch(graph: Graph, device: str | None = None, threads: int | None = None, sizes: Any = None) -> Runner:
    """A runner interpreting ``graph`` (lowered for torch) on ``device`` (default: CUDA when available, else CPU)."""
    import torch

    lowered = lower(graph, TORCH_TARGET, sizes)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if threads:
        torch.set_num_threads(threads)
    kernels = _kernels(torch)
    order = lowered.topological_order()
    weights = {k: _weight(torch, v, dev) for k, v in lowered.initializers.items()}

    def fn(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env_dims = check_inputs(graph, inputs)
        env: dict[str, Any] = dict(weights)
        env.update({k: _to_torch(torch, contiguous(v)).to(dev) for k, v in inputs.items()})
        with torch.no_grad():
            for node in order:
                try:
                    kernel = kernels.get(type(node.op))
                    args = [env[i] for i in node.inputs]
                    if kernel is None:  # ShapeValues, Opaque: the op's own NumPy semantics
                        arrays = node.op.evaluate_all([_to_numpy(torch, t.cpu()) for t in args], env_dims)
                        result = tuple(_to_torch(torch, contiguous(r)).to(dev) for r in arrays)
                        result = result if len(node.outputs) > 1 else result[0]
                    else:
                        result = kernel(node.op, args, env_dims)
                    env.update(zip(node.outputs, result if len(node.outputs) > 1 else (result,)))
                except Exception as e:  # noqa: BLE001 - re-raised with the node attached
                    raise ExecutionError(f"torch backend: node {node.name!r} ({node.op}) failed: {type(e).__name__}: {e}", node.name) from e
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return {o: _to_numpy(torch, env[o].cpu()) for o in graph.outputs}

    return Runner("torch", f"torch {torch.__version__} {dev}", graph, fn)
