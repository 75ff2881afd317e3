"""What each backend runs natively: the :class:`~graphc.optimizer.Target` of every backend and ONNX mode.

A target's attention policy looks at one ``Attention`` node (and the sizes
known for the run) and keeps it for the backend's kernel or says why it is
decomposed.  Adding a backend means adding its target here.
"""

from __future__ import annotations


import numpy as np

from graphc.attention_op import Attention
from graphc.dims import dim_add
from graphc.errors import ExportError, UnknownNameError
from graphc.graph import Graph, Node
from graphc.optimizer import REFERENCE_TARGET, PassContext, Target
from graphc.optimizer.merging import merge_projections

from ..kernels.attention_kernel import is_key_mask_shape
from .cuda_kernels import cuda_lacks_kernel
from .norm_form import fuse_layer_norm, fuse_rms_norm
from .forms import (
    ChunkedCausalAttention,
    OnnxAttention,
    OrtGroupQueryAttention,
    as_form,
    attention_features,
    past_length,
    unsupported,
)

__all__ = [
    "ATTENTION_MODES",
    "DEVICES",
    "CUDA_GQA_MIN_QUERIES",
    "AUTO_MIN_QUERY_ROWS",
    "AUTO_MIN_CHUNKED_SCORES",
    "NUMPY_TARGET",
    "TORCH_TARGET",
    "onnx_target",
    "REFERENCE_TARGET",
    "target_named",
    "TARGET_NAMES",
]

ATTENTION_MODES = ("decomposed", "onnx-attention", "ort-gqa", "chunked", "auto")
AUTO_MIN_QUERY_ROWS = 64
AUTO_MIN_CHUNKED_SCORES = 2**18
"""``auto`` chunks a causal prefill whose scores (batch x query heads x queries x keys) hold at least this many
elements, in :func:`~lowering.exporter.forms.causal_chunks` chunks; a smaller one runs as grouped MatMuls (each chunk
costs some twenty small ops).

From an A/B of the two forms on the hidden-256 exports ``benchmarks/bench_real_exports.py`` times (2 cores, graphc /
export, grouped MatMuls vs query chunks, one run): at 512 tokens (1-2M score elements) chunks win everywhere (Llama
0.72 vs 0.48, OPT 0.99 vs 0.88, GPT-J 1.01 vs 0.90); at 256 tokens (256-512K) they tie or win by a few percent; at 128
tokens with 4 heads (64K) grouped MatMuls win by 10-15%.  Chunks take an additive key mask too (ALiBi's bias per
head, padding at ``-inf``; Bloom at 512 tokens: 0.89x the export, grouped MatMuls 1.01x), its chunk slices made once
and read by every layer; a mask per query row stays grouped."""


def _numpy_policy(graph: Graph, node: Node, ctx: PassContext) -> str | None:
    features = attention_features(graph, node)
    if features & {"additive_mask", "query_mask"} or ("bool_mask" in features and not is_key_mask_shape(graph.types[node.inputs[3]].shape)):
        return "the blocked kernel takes a bool key mask [B, 1, 1, T] (padding) only, not a per-query or additive mask"
    return "the blocked kernel gives empty rows zeros, not the mean of V" if "mean_rows" in features else None


NUMPY_TARGET = Target("numpy", _numpy_policy, description="row-blocked attention kernel, GEMM contractions")


def _torch_policy(graph: Graph, node: Node, ctx: PassContext) -> str | None:
    features = attention_features(graph, node)
    if features & {"window", "softcap"}:
        return "scaled_dot_product_attention has no sliding window or softcap"
    if "mean_rows" in features:
        return "scaled_dot_product_attention gives a row with no visible key zeros, not the mean of V"
    return None


TORCH_TARGET = Target("torch", _torch_policy, description="torch scaled_dot_product_attention")


def _rows_per_kv_head(graph: Graph, node: Node, ctx: PassContext) -> int | None:
    q, k = graph.types[node.inputs[0]].shape, graph.types[node.inputs[1]].shape
    sq = ctx.known_size(q[2])
    if sq is None or not isinstance(q[1], int) or not isinstance(k[1], int):
        return None
    return sq * (q[1] // max(k[1], 1))


def _score_elements(graph: Graph, node: Node, ctx: PassContext) -> int:
    """Batch x query heads x queries x keys (past included) under the known sizes (an unknown batch counts 1);
    0 when the heads, queries or keys are unknown."""
    q, k = graph.types[node.inputs[0]].shape, graph.types[node.inputs[1]].shape
    keys = dim_add(past_length(graph, node), k[2])
    sizes = [ctx.known_size(q[0]) or 1] + [ctx.known_size(d) for d in (q[1], q[2], keys)]
    known = [x for x in sizes if x is not None]
    return int(np.prod(known)) if len(known) == len(sizes) else 0


DEVICES = ("cpu", "cuda")
"""What an ONNX export is for: onnxruntime's CPU or CUDA execution provider (:func:`onnx_target`)."""

CUDA_GQA_MIN_QUERIES = 2048
"""On CUDA, ``auto`` carries a causal self-attention (no cache, no mask) of at least this many queries as
``com.microsoft.GroupQueryAttention`` (its flash kernel), a shorter one and every decode step as the standard
``Attention`` op.  From onnxruntime 1.31.1's own fp16 kernels on an H200 (hand-written one-node models, mistral-7b
heads; ``benchmarks/gpu_check.py``, docs/gpu.md): prefill of 1024 tokens 0.084 ms (Attention-23) vs 0.097
(GroupQueryAttention), of 4096 tokens 0.540 vs 0.433."""


def _cuda_auto_policy(graph: Graph, node: Node, ctx: PassContext, opset: int) -> str | type[Attention]:
    """``auto`` on CUDA: a fused op wherever one carries a float16 node; float32 keeps grouped MatMuls (onnxruntime's
    fused CUDA attention kernels are half-precision kernels)."""
    if graph.types[node.inputs[0]].dtype == "float32":
        return "auto (cuda): float32 attention runs as grouped MatMuls; the fused CUDA kernels are half-precision kernels"
    queries = ctx.known_size(graph.types[node.inputs[0]].shape[2])
    long_prefill = queries is not None and queries >= CUDA_GQA_MIN_QUERIES and not node.op_as(Attention).kv_cache
    gqa_fits = unsupported(OrtGroupQueryAttention, graph, node, ctx, opset) is None
    if long_prefill and gqa_fits:
        return OrtGroupQueryAttention
    reason = unsupported(OnnxAttention, graph, node, ctx, opset)
    if reason is None:
        return OnnxAttention
    return OrtGroupQueryAttention if gqa_fits else f"auto (cuda): {reason}"


_NAMED_FORMS = {"onnx-attention": OnnxAttention, "ort-gqa": OrtGroupQueryAttention, "chunked": ChunkedCausalAttention}


def onnx_target(mode: str, opset: int, device: str = "cpu") -> Target:
    """The target of ONNX export in ``mode`` (one of :data:`ATTENTION_MODES`) at ``opset`` for ``device`` (one of
    :data:`DEVICES`): its policy gives each kept ``Attention`` its form (:mod:`lowering.exporter.forms`), or the reason
    it is decomposed.  LayerNorms become ONNX's ``LayerNormalization`` (:mod:`lowering.exporter.norm_form`).
    For ``"cuda"``, projections of one value (q/k/v, gate/up) become one ``MatMul`` over their
    concatenated weights (:mod:`graphc.optimizer.merging`), a float16 or bfloat16 graph computes in its dtype where GPU kernels do
    (``low_precision="storage"``; a bfloat16 op onnxruntime has no CUDA kernel for, in float32: :mod:`lowering.exporter.cuda_kernels`),
    RMS norms become one op (:mod:`lowering.exporter.norm_form`), and ``auto`` picks onnxruntime's fused CUDA kernels
    (:data:`CUDA_GQA_MIN_QUERIES`)."""
    if mode not in ATTENTION_MODES:
        raise UnknownNameError("attention mode", mode, ATTENTION_MODES)
    if device not in DEVICES:
        raise UnknownNameError("export device", device, DEVICES)
    cuda = device == "cuda"
    passes = (merge_projections, fuse_rms_norm, fuse_layer_norm) if cuda else (fuse_layer_norm,)
    precision, suffix = ("storage", "-cuda") if cuda else ("float32", "")
    gaps = cuda_lacks_kernel if cuda else None
    if mode == "decomposed":
        return Target(f"onnx-decomposed{suffix}", description="MatMul/Softmax nodes", low_precision=precision, passes=passes, lacks_kernel=gaps)
    if mode in _NAMED_FORMS:  # asked for by name: an attention it cannot carry is an error
        form = _NAMED_FORMS[mode]

        def policy(graph: Graph, node: Node, ctx: PassContext) -> str | type[Attention] | Attention | None:
            reason = unsupported(form, graph, node, ctx, opset)
            if reason:
                raise ExportError(f"attention={mode!r} cannot carry {node.name!r}: {reason}; use attention='auto' to fall back")
            return as_form(form, graph, node, ctx)

    elif cuda:

        def policy(graph: Graph, node: Node, ctx: PassContext) -> str | type[Attention] | Attention | None:
            return _cuda_auto_policy(graph, node, ctx, opset)

    else:

        def policy(graph: Graph, node: Node, ctx: PassContext) -> str | type[Attention] | Attention | None:
            rows = _rows_per_kv_head(graph, node, ctx)
            if rows is None:
                return "auto: the query length is not known (give sizes), so the grouped MatMul form is kept"
            if rows < AUTO_MIN_QUERY_ROWS:
                return f"auto: {rows} query row(s) per KV head, under {AUTO_MIN_QUERY_ROWS}: grouped MatMuls are faster"
            if unsupported(ChunkedCausalAttention, graph, node, ctx, opset) is None:
                if {"additive_mask", "query_mask"} <= attention_features(graph, node):
                    return "auto: an additive mask per query row costs query chunks passes over it; grouped MatMuls add it once"
                scores = _score_elements(graph, node, ctx)
                if scores < AUTO_MIN_CHUNKED_SCORES:
                    return f"auto: {scores} score elements, under {AUTO_MIN_CHUNKED_SCORES}: one grouped MatMul pass beats query chunks"
                return as_form(ChunkedCausalAttention, graph, node, ctx)  # faster than the fused op on causal prefill
            return unsupported(OnnxAttention, graph, node, ctx, opset) or OnnxAttention

    def kernel(graph: Graph, node: Node, ctx: PassContext) -> str:
        rows = _rows_per_kv_head(graph, node, ctx)
        chunks = f"{node.op.chunks} chunks" if isinstance(node.op, ChunkedCausalAttention) else ""
        return ", ".join(x for x in ("" if rows is None else f"{rows} query rows per KV head", chunks) if x)

    where = " for CUDA" if cuda else ""
    description = f"ONNX export{where}, attention={mode}"
    return Target(f"onnx-{mode}{suffix}", policy, description=description, kernel=kernel, low_precision=precision, passes=passes, lacks_kernel=gaps)


TARGET_NAMES = ("numpy", "reference", "torch", *(f"onnx-{m}" for m in ATTENTION_MODES), *(f"onnx-{m}-cuda" for m in ATTENTION_MODES))


def target_named(name: str, opset: int = 23) -> Target:
    """The target called ``name`` (one of :data:`TARGET_NAMES`); an unknown name lists the valid ones."""
    fixed = {"numpy": NUMPY_TARGET, "reference": REFERENCE_TARGET, "torch": TORCH_TARGET}
    if name in fixed:
        return fixed[name]
    if name.startswith("onnx-") and name[5:] in ATTENTION_MODES:
        return onnx_target(name[5:], opset)
    if name.startswith("onnx-") and name.endswith("-cuda") and name[5:-5] in ATTENTION_MODES:
        return onnx_target(name[5:-5], opset, device="cuda")
    raise UnknownNameError("target", name, TARGET_NAMES)
