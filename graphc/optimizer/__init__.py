"""The graphc optimizer: rewrite passes, a pass manager, contraction planning and a cost model."""

from .cleanup import common_subexpression_elimination, dead_code_elimination
from .cost import GraphCost, format_comparison, graph_cost
from .attention import fuse_attention
from .infra import DEFAULT_DIM_HINT, Miss, Pass, PassContext, PassManager, PassResult, RewritePass, Rule, Trace, rewrite_to_fixed_point
from .decompose import decompose_attention
from .legalize import LOWERING_STAGES, REFERENCE_TARGET, Target, legalize, lower
from .patterns import Bindings, Pat, pattern_rule
from .pipeline import PIPELINES, STAGES, OptimizationReport, OptimizationResult, optimize, pipeline, register_rule, unregister_rule
from .planning import OPTIMIZERS, plan_contractions
from .softmax_report import KEEP_EVERY_ATTENTION, UnfusedSoftmax, unfused_softmaxes

__all__ = [
    "optimize",
    "OptimizationResult",
    "OptimizationReport",
    "PIPELINES",
    "STAGES",
    "pipeline",
    "register_rule",
    "Pat",
    "Bindings",
    "pattern_rule",
    "unregister_rule",
    "lower",
    "unfused_softmaxes",
    "UnfusedSoftmax",
    "KEEP_EVERY_ATTENTION",
    "legalize",
    "Target",
    "REFERENCE_TARGET",
    "LOWERING_STAGES",
    "fuse_attention",
    "decompose_attention",
    "PassResult",
    "rewrite_to_fixed_point",
    "Pass",
    "RewritePass",
    "Rule",
    "Miss",
    "PassContext",
    "PassManager",
    "Trace",
    "GraphCost",
    "graph_cost",
    "format_comparison",
    "DEFAULT_DIM_HINT",
    "OPTIMIZERS",
    "plan_contractions",
    "common_subexpression_elimination",
    "dead_code_elimination",
]
