"""``graphc optimize``: optimize a graph, report what changed (and why, with ``--explain``), and save it as JSON or ONNX."""

from __future__ import annotations

import argparse
from typing import Any

from ..optimizer import OPTIMIZERS, PIPELINES, PassContext, optimize, unfused_softmaxes
from ..serialize import save_graph
from .common import UsageError, parse_sizes
from .source import GraphSource, add_graph_args

__all__ = ["add_command", "run"]


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc optimize``."""
    from lowering.exporter.targets import ATTENTION_MODES

    o = sub.add_parser("optimize", parents=[common], help="optimize a graph and report what changed")
    add_graph_args(o)
    o.add_argument("--explain", action="store_true", help="list every rewrite, and rules that did not fire and why")
    o.add_argument("--level", type=int, default=2, choices=sorted(PIPELINES))
    o.add_argument("--optimizer", default="auto", choices=OPTIMIZERS, help="opt_einsum path optimizer")
    o.add_argument("--hint", action="append", default=[], metavar="NAME=INT", help="size of a symbolic dim for cost decisions")
    o.add_argument(
        "--target",
        default=None,
        metavar="NAME",
        help=(
            "also lower for a backend: numpy, reference, torch, onnx-decomposed, onnx-onnx-attention, onnx-ort-gqa, onnx-auto; "
            "with -o X.onnx: ort-cpu or ort-cuda (attention auto)"
        ),
    )
    o.add_argument("--print", action="store_true", help="print the optimized graph")
    o.add_argument(
        "-o",
        "--output",
        default=None,
        help="save the optimized graph: .onnx writes ONNX (the input/output names and dynamic axes kept), anything else JSON",
    )
    o.add_argument(
        "--attention",
        default="decomposed",
        choices=ATTENTION_MODES,
        help="with -o X.onnx: how attention is written (auto: fused where faster for --hint sizes)",
    )
    o.add_argument("--opset", type=int, default=None, help="with -o X.onnx: the ONNX opset (default: the imported model's, at least 18)")
    o.add_argument("--external-data", action="store_true", help="with -o X.onnx: weights in X.onnx.data beside the model")
    o.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Optimize a graph and print the before/after report (and the trace with --explain)."""
    source = GraphSource.from_args(args)
    g, sizes = source.build()
    hints = {**sizes, **parse_sizes(args.hint)}
    target = None
    attention = args.attention
    if args.target in ("ort-cpu", "ort-cuda"):  # the runtime an exported model is for: attention chosen per run sizes
        attention = "auto" if attention == "decomposed" else attention
    elif args.target:
        from lowering.exporter.targets import target_named

        target = target_named(args.target)
    onnx_out = bool(args.output and args.output.endswith(".onnx"))
    if onnx_out and target is not None:
        raise UsageError(
            "--target lowers for a backend inside graphc; to write ONNX for onnxruntime use --attention (and --target ort-cpu/ort-cuda only as a "
            "name for it)"
        )
    out, report = optimize(g, level=args.level, hints=hints, optimizer=args.optimizer, verify=True, target=target)
    print(report.explain() if args.explain else report)
    if args.explain:
        left = unfused_softmaxes(out)
        print(f"\nsoftmax left unfused once attention is recognised: {len(left)}" + "".join(f"\n  {u}" for u in left))
    if args.print:
        print()
        print(out)
    if onnx_out:
        _write_onnx(args, source, out, hints, attention)
    elif args.output:
        save_graph(out, args.output)
        print(f"wrote {args.output}")
    return 0


def _write_onnx(args: argparse.Namespace, source: GraphSource, out: Any, hints: dict[str, int], attention: str) -> None:
    """The optimized graph as ONNX, with the export's own trace under ``--explain``."""
    from lowering.exporter.onnx_export import DEFAULT_OPSET, MIN_OPSET, export

    opset = args.opset or max(_source_opset(source.model) if source.model else DEFAULT_OPSET, MIN_OPSET)
    if attention != "decomposed":
        opset = max(opset, 23)
    lowering = PassContext()  # the export's own lowering, traced: each attention recognised, and the form chosen for it
    device = "cuda" if args.target == "ort-cuda" else "cpu"
    model = export(out, args.output, opset=opset, attention=attention, hints=hints, external_data=args.external_data, ctx=lowering, device=device)
    if args.explain:
        print(f"\nthe ONNX export (attention={attention!r}, opset {opset}):\n{lowering.trace.explain()}")
    print(f"wrote {args.output}: {len(model.graph.node)} nodes, opset {opset}, inputs {', '.join(out.inputs)}, outputs {', '.join(out.outputs)}")


def _source_opset(path: str) -> int:
    """The standard opset an ONNX model was written for (its graph is not loaded again)."""
    import onnx

    from lowering.exporter.onnx_export import DEFAULT_OPSET

    with open(path, "rb") as f:
        model = onnx.load_model(f, load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), DEFAULT_OPSET)
