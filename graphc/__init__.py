"""graphc: an einsum computation-graph compiler for attention.

Build attention layers (MHA, MQA, GQA) as typed DAGs of einsum and elementwise
nodes, optimize them (above all: GQA's KV-head repeat becomes a grouped einsum),
and run them on NumPy, the ONNX reference evaluator or onnxruntime.
"""

from . import errors, memory, quantized, quantized_int8, weights  # noqa: F401 - the quantized modules register their ops
from .attention_op import Attention
from .visibility import KeyBound, Visibility, VisibilityError
from .attention import (
    PRESETS,
    AttentionConfig,
    CausalLMConfig,
    attention_layer_graph,
    attention_stack_graph,
    causal_lm_from_hf,
    causal_lm_graph,
    cross_attention_graph,
    cross_kv_graph,
    encoder_from_hf,
    gqa,
    init_weights,
    kv_cache_graph,
    mha,
    mqa,
    preset,
    preset_names,
    sdpa_graph,
)
from .dims import Dim
from .einsum_spec import parse_einsum
from .graph import Graph, Node, Value
from .ops import TensorType
from .rotary import Positions, Rotary
from .opaque import Opaque
from .tensor_ops import Gather, Reduce, ShapeValues, Slice
from .optimizer import OptimizationReport, graph_cost, optimize
from .optimizer.decompose import decompose_attention
from .serialize import load_graph, save_graph

__version__ = "0.1.0"

__all__ = [
    "errors",
    "memory",
    "weights",
    "Graph",
    "Node",
    "Value",
    "TensorType",
    "Attention",
    "Visibility",
    "KeyBound",
    "VisibilityError",
    "decompose_attention",
    "Positions",
    "Rotary",
    "Opaque",
    "Reduce",
    "Gather",
    "ShapeValues",
    "Slice",
    "Dim",
    "parse_einsum",
    "save_graph",
    "load_graph",
    "optimize",
    "OptimizationReport",
    "graph_cost",
    "AttentionConfig",
    "PRESETS",
    "preset",
    "preset_names",
    "mha",
    "mqa",
    "gqa",
    "init_weights",
    "sdpa_graph",
    "attention_layer_graph",
    "attention_stack_graph",
    "cross_attention_graph",
    "cross_kv_graph",
    "kv_cache_graph",
    "CausalLMConfig",
    "causal_lm_graph",
    "causal_lm_from_hf",
    "encoder_from_hf",
    "__version__",
]
