"""``graphc export``: a graph to ONNX, or a checkpoint folder to a folder (the whole causal LM, as optimum and
onnxruntime-genai load it)."""

from __future__ import annotations

import argparse
from typing import Any

from ..optimizer import optimize
from .common import UsageError, add_quantize_args, parse_sizes, quantize_options
from .source import GraphSource, add_graph_args

__all__ = ["add_command", "run"]


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc export``."""
    from lowering.exporter.onnx_export import DEFAULT_OPSET
    from lowering.exporter.targets import ATTENTION_MODES

    e = sub.add_parser("export", parents=[common], help="export a graph to ONNX")
    add_graph_args(e, sizes=False)
    e.add_argument("-o", "--output", required=True, help="the .onnx file to write (from a checkpoint folder: a folder, the whole LM)")
    e.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    e.add_argument(
        "--attention", default="decomposed", choices=ATTENTION_MODES, help="auto: fused op per attention where it is faster for --hint sizes"
    )
    e.add_argument("--hint", action="append", default=[], metavar="NAME=INT", help="size of a symbolic dim (e.g. seq=1024) for --attention auto")
    e.add_argument("--no-optimize", action="store_true")
    e.add_argument("--force", action="store_true", help="from a checkpoint folder: export into an OUT that holds another model (its files replaced)")
    add_quantize_args(e)
    e.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the onnxruntime provider the model is for (cuda: float16 computed in float16, onnxruntime's fused CUDA attention with auto)",
    )
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export a graph to ONNX (a checkpoint folder to a folder: the whole causal LM, as optimum and genai load it)."""
    from lowering.exporter.onnx_export import export

    source = GraphSource.from_args(args)
    if not args.output.strip():
        raise UsageError("-o names the file or folder to write; got an empty name")
    if source.checkpoint_folder is not None:
        if args.output.endswith(".onnx"):
            raise UsageError(
                f"{source.checkpoint_folder} exports as a folder (model.onnx, its weights and the files optimum and onnxruntime-genai load): "
                f"name a folder, -o OUT/ (for the decoder stack alone as one file: --hf-config {source.checkpoint_folder}/config.json)"
            )
        return _export_checkpoint(args, source, source.checkpoint_folder)
    if quantize_options(args) is not None:
        raise UsageError("--quantize quantizes a checkpoint folder's model: graphc export DIR -o OUT/ --quantize int4")
    g, _ = source.build()
    hints = parse_sizes(args.hint)
    if not args.no_optimize:
        g = optimize(g, hints=hints).graph
    model = export(g, args.output, opset=args.opset, attention=args.attention, hints=hints, device=args.device)
    ops = sorted({n.op_type for n in model.graph.node})
    print(
        f"wrote {args.output}: {len(model.graph.node)} nodes ({', '.join(ops)}), opset {args.opset}, IR {model.ir_version}"
        + (", attention " + args.attention if args.attention != "decomposed" else "")
        + (", for CUDA" if args.device == "cuda" else "")
    )
    return 0


def _export_checkpoint(args: argparse.Namespace, source: GraphSource, folder: str) -> int:
    from lowering.checkpoint_export import export_checkpoint

    if args.no_optimize or source.decode or source.core or source.graph:
        raise UsageError(
            "a checkpoint folder exports the whole model (one decode step with its KV cache): drop --no-optimize, --decode, --core, --graph"
        )
    done = export_checkpoint(
        folder,
        args.output,
        layers=source.layers,
        attention=args.attention,
        opset=args.opset,
        hints=parse_sizes(args.hint),
        device=args.device,
        force=args.force,
        quantize=quantize_options(args),
    )
    print(
        f"wrote {args.output}/: model.onnx ({done.nodes} nodes, opset {done.opset}) and model.onnx.data, genai_config.json, "
        f"{', '.join(done.copied)} (loads in optimum's ORTModelForCausalLM and onnxruntime-genai)"
    )
    return 0
