"""The ``graphc`` command line: compare, export, show, optimize, info, generate (:mod:`graphc.cli_generate`).

Every subcommand takes a graph from a preset (``--preset mistral-7b``), from
custom head counts (``--heads 32 --kv-heads 8 --head-dim 128``) or from a JSON
file (``--graph g.json``).  User errors print one line and exit 2
(``--debug`` shows the traceback); ``compare`` exits 1 when backends disagree.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import os
import sys
import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any

from . import __version__, memory
from .attention import PRESETS, AttentionConfig, attention_layer_graph, kv_cache_graph, preset, preset_names, sdpa_graph
from .attention.hf import HF_FAMILIES
from .dims import dim_symbols
from .errors import GraphcError
from .folders import write_replacing
from .graph import Graph
from .ops import FLOAT_DTYPES
from .attention_op import Attention
from .cli_common import Parser, Progress, UsageError, add_quantize_args, at_least, quantize_options
from .cli_generate import add_generate
from .optimizer import OPTIMIZERS, PIPELINES, PassContext, Target, lower, optimize
from .serialize import load_graph, save_graph
from .visualize import to_dot, to_svg

__all__ = ["main", "main_entry", "build_parser"]


def _add_common_args(p: argparse.ArgumentParser, default: object) -> None:
    """Flags every subcommand takes before or after its name."""
    p.add_argument("--debug", action="store_true", default=default if default is not None else False, help="show tracebacks on errors")
    p.add_argument("--quiet", action="store_true", default=default if default is not None else False, help="no progress lines on stderr")
    p.add_argument(
        "--memory-cap",
        metavar="SIZE",
        default=default,
        help="refuse runs estimated above SIZE (e.g. 16GiB, 'none'; default: GRAPHC_MEMORY_CAP or half of this machine's memory)",
    )


def _add_graph_args(p: argparse.ArgumentParser, sizes: bool = True) -> None:
    src = p.add_argument_group("graph")
    src.add_argument(
        "model",
        nargs="?",
        default=None,
        help="an ONNX model (.onnx) to import, or a checkpoint folder (config.json, *.safetensors), instead of a preset",
    )
    src.add_argument("--strict", action="store_true", help="with an ONNX model: refuse ops graphc does not model (default: carry them through)")
    src.add_argument(
        "--attention-semantics",
        default="onnx-1.23",
        choices=("onnx-1.23", "legacy"),
        help="with an ONNX model: how Attention nodes are read (legacy: onnx <= 1.21, masks before softcap, qk_matmul_output_mode 1/2 swapped)",
    )
    src.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="with an ONNX model or --graph: size of a symbolic dim (default: batch dims --batch, others --seq)",
    )
    src.add_argument("--preset", help=f"model preset: {', '.join(preset_names())}")
    src.add_argument("--graph", metavar="FILE", help="a graph saved as JSON (graphc.save_graph)")
    src.add_argument("--hf-config", metavar="FILE", help=f"a transformers config.json: a decoder stack of that model ({', '.join(HF_FAMILIES)})")
    src.add_argument("--weights", metavar="PATH", help="with --hf-config: a .safetensors file or a directory of them (memory-mapped; default random)")
    src.add_argument("--layers", type=int, default=None, help="layers of the stack (--hf-config: default all; info: default the preset's)")
    src.add_argument("--heads", type=int, help="custom config: query heads")
    src.add_argument("--kv-heads", type=int, help="custom config: KV heads (default: --heads)")
    src.add_argument("--head-dim", type=int, help="custom config: head dim (default: d_model / heads)")
    src.add_argument("--d-model", type=int, help="custom config: model width (default: heads * head_dim)")
    src.add_argument("--bias", action="store_true", help="custom config: projection biases")
    src.add_argument("--core", action="store_true", help="the attention core only (q, k, v inputs), not the full layer")
    src.add_argument("--decode", action="store_true", help="one decode step over a KV cache (see --past)")
    src.add_argument("--past", type=int, default=4096, help="KV-cache length for --decode (default 4096)")
    src.add_argument("--no-causal", action="store_true", help="build a non-causal graph")
    src.add_argument("--seed", type=int, default=None, help="seed for random weights and inputs (default 0)")
    if sizes:
        src.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
        src.add_argument("--seq", type=int, default=None, help="new tokens (default 512; 1 with --decode)")


def _config(args: argparse.Namespace) -> AttentionConfig:
    if args.hf_config:
        from .attention.hf import attention_config_from_hf

        return attention_config_from_hf(args.hf_config)
    custom = [
        f
        for f, v in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim), ("--d-model", args.d_model))
        if v is not None
    ]
    if args.preset and custom:
        raise UsageError(f"give either --preset or a custom config ({', '.join(custom)}), not both")
    for flag, v in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim), ("--d-model", args.d_model)):
        at_least(flag, v, 1)
    if args.preset:
        cfg = preset(args.preset)
    elif args.heads is not None:
        if args.head_dim is None and args.d_model is None:
            raise UsageError("a custom config needs --head-dim or --d-model")
        head_dim = args.head_dim if args.head_dim is not None else args.d_model // args.heads
        if head_dim < 1:
            raise UsageError(f"--d-model {args.d_model} is smaller than --heads {args.heads}; give --head-dim")
        d_model = args.d_model if args.d_model is not None else args.heads * head_dim
        kv_heads = args.kv_heads if args.kv_heads is not None else args.heads
        cfg = AttentionConfig(d_model, args.heads, kv_heads, head_dim=head_dim, bias=args.bias)
    elif custom:
        raise UsageError(f"{', '.join(custom)} describe a custom config, which needs --heads too")
    else:
        raise UsageError(
            "no graph given: name an ONNX model (MODEL.onnx), or use --preset NAME, --heads N [--kv-heads M --head-dim D], or --graph FILE"
        )
    return cfg.with_(causal=not args.no_causal) if args.no_causal else cfg


def _graph(args: argparse.Namespace) -> tuple[Graph, dict[str, int]]:
    """The graph the arguments describe, and the sizes of its symbolic dims."""
    seq = getattr(args, "seq", None)
    batch = getattr(args, "batch", 1)
    if seq is None:
        seq = 1 if args.decode else 512
    for flag, v, least in (("--batch", batch, 1), ("--seq", seq, 1), ("--past", args.past, 0), ("--seed", args.seed, 0)):
        at_least(flag, v, least)
    if args.weights and not args.hf_config:
        raise UsageError("--weights needs --hf-config (the model config the weights belong to)")
    if args.hf_config:
        return _hf_stack(args, getattr(args, "dtype", "float32")), (
            {"batch": batch, "seq": seq, "past_seq": args.past} if args.decode else {"batch": batch, "seq": seq}
        )
    if args.model is not None or args.graph:
        if args.model is not None and args.graph:
            raise UsageError("give either an ONNX model or --graph, not both")
        g = _import_onnx(args.model, args.strict, args.attention_semantics) if args.model is not None else load_graph(args.graph)
        symbols = {s for n in g.inputs for d in g.types[n].shape for s in dim_symbols(d)}
        defaults = {"batch": batch, "seq": seq, "past_seq": args.past, "q_len": seq, "kv_len": seq}
        sizes = {s: defaults.get(s, batch if "batch" in s.lower() else args.past if "past" in s.lower() else seq) for s in symbols}
        given = _hints(args.dim, "--dim")
        unknown = sorted(set(given) - symbols)
        if unknown:
            raise UsageError(
                f"--dim names {', '.join(unknown)}, which the graph's inputs do not use; its symbolic dims: {', '.join(sorted(symbols)) or 'none'}"
            )
        return g, {**sizes, **given}
    cfg = _config(args)
    dtype = getattr(args, "dtype", "float32")
    if args.decode:
        g = kv_cache_graph(cfg, seed=args.seed, dtype=dtype) if not args.core else sdpa_graph(cfg, q_len="seq", kv_len="past_seq+seq", dtype=dtype)
        return g, {"batch": batch, "seq": seq, "past_seq": args.past}
    g = sdpa_graph(cfg, dtype=dtype) if args.core else attention_layer_graph(cfg, seed=args.seed, dtype=dtype)
    return g, {"batch": batch, "seq": seq}


_SECOND_SOURCES = (
    ("preset", "--preset"),
    ("graph", "--graph"),
    ("hf_config", "--hf-config"),
    ("heads", "--heads"),
    ("kv_heads", "--kv-heads"),
    ("head_dim", "--head-dim"),
    ("d_model", "--d-model"),
    ("bias", "--bias"),
    ("dim", "--dim"),
)
"""Flags that describe a graph of their own (or size an ONNX model's dims): refused beside a checkpoint folder."""


def _open_checkpoint_folder(args: argparse.Namespace) -> None:
    """A checkpoint folder as the positional argument means ``--hf-config DIR/config.json --weights DIR``.

    A flag that names a second graph source beside it is refused, and so is a folder whose weights graphc cannot
    read (``pytorch_model.bin`` only, say) unless ``--seed`` asks for seeded random weights; ``--weights`` given as
    well wins over the folder's."""
    folder = getattr(args, "model", None)
    if folder is None or not os.path.isdir(folder):
        return
    from .checkpoint import Checkpoint

    given = [flag for attr, flag in _SECOND_SOURCES if getattr(args, attr, None)]
    if given:
        raise UsageError(f"{folder} is a checkpoint folder, the graph's source; {', '.join(given)} describe(s) another: drop it")
    ckpt = Checkpoint(folder)
    args.model = None
    args.checkpoint_folder = str(ckpt.folder)
    args.hf_config = str(ckpt.config)
    if hasattr(args, "weights") and not args.weights and args.command != "info":  # info reads the config alone
        if ckpt.has_weights():
            args.weights = str(ckpt.folder)
        elif not getattr(args, "seed_given", False):
            raise UsageError(
                f"{folder} holds no weights graphc reads (model.safetensors, or model.safetensors.index.json and its files; "
                f"found {ckpt.weight_files_seen() or 'none'}); pass --seed N for seeded random weights"
            )


def _import_onnx(path: str, strict: bool, semantics: str = "onnx-1.23") -> Graph:
    if not path.endswith(".onnx") and not os.path.exists(path):
        raise UsageError(f"unexpected argument {path!r}: the positional argument is an ONNX model file (.onnx)")
    from .onnx_import import from_onnx

    return from_onnx(path, strict=strict, attention_semantics=semantics)


def _source_opset(path: str) -> int:
    """The standard opset an ONNX model was written for (its graph is not loaded again)."""
    import onnx

    from lowering.exporter.onnx_export import DEFAULT_OPSET

    with open(path, "rb") as f:
        model = onnx.load_model(f, load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), DEFAULT_OPSET)


def _hf_stack(args: argparse.Namespace, dtype: str = "float32") -> Graph:
    """The decoder stack of ``--hf-config`` (first ``--layers`` layers) with ``--weights`` or seeded random weights."""
    from .attention.decoder import decoder_stack_graph
    from .attention.hf import decoder_configs_from_hf, decoder_weights_from_hf
    from .weights import load_weights

    at_least("--layers", args.layers, 1)
    if args.core:
        raise UsageError("--core builds one attention core; with --hf-config the graph is the decoder stack")
    cfgs = decoder_configs_from_hf(args.hf_config, args.layers)
    weights = None
    if args.weights:
        weights = decoder_weights_from_hf(load_weights(args.weights, dtype=dtype), args.hf_config)  # a copy only when the dtype differs
        weights = {k: v for k, v in weights.items() if k.startswith(("model.layers.", "model.norm."))}
    final = bool(weights and "model.norm.weight" in weights)
    return decoder_stack_graph(cfgs, weights=weights, kv_cache=args.decode, seed=args.seed, dtype=dtype, final_norm=final)


def _write(path: str | None, data: str | bytes) -> None:
    if path is None or path == "-":
        sys.stdout.write(data if isinstance(data, str) else data.decode())
        return
    if not path.strip():
        raise UsageError("-o names the file to write; got an empty name")
    try:
        write_replacing(path, data)
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror}") from None


# ---------------------------------------------------------------- commands


def cmd_compare(args: argparse.Namespace) -> int:
    """Run every backend and compare against the float64 NumPy reference."""
    from lowering.compare import MAX_REPEATS, compare

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        raise UsageError(f"--backends needs at least one backend name, got {args.backends!r}")
    at_least("--repeats", args.repeats, 1, MAX_REPEATS)
    at_least("--threads", args.threads, 1, 4096)
    if args.shards is not None:
        at_least("--shards", args.shards, 1, 1024)
    at_least("--atol", args.atol, 0)
    at_least("--rtol", args.rtol, 0)
    g, sizes = _graph(args)
    options: dict[str, dict[str, Any]] = {}
    if args.tf32 and "ort-cuda" not in backends:
        raise UsageError("--tf32 asks ort-cuda for TF32 MatMul; add ort-cuda to --backends")
    for b in backends:
        if b in ("onnx-reference", "ort-cpu", "ort-cuda"):
            options[b] = {"attention": args.attention}
        if b == "ort-cuda" and args.tf32:
            options[b]["tf32"] = True
        if b in ("ort-cpu", "ort-cuda", "numpy", "torch") and args.threads:
            options.setdefault(b, {})["threads"] = args.threads
    inputs = _load_inputs(args.inputs) if args.inputs else None
    progress = Progress(sys.stderr, enabled=not args.quiet)
    try:
        report = compare(
            g,
            inputs=inputs,
            backends=backends,
            optimize=not args.no_optimize,
            repeats=args.repeats,
            atol=args.atol,
            rtol=args.rtol,
            seed=args.seed,
            sizes=sizes,
            options=options,
            progress=progress,
            shards=args.shards,
            shard_backend=args.shard_backend,
            reference_model=args.model if args.model is not None and not args.hf_config else None,
        )
    finally:
        progress.done()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 0 if report.ok else 1


def _load_inputs(path: str) -> dict[str, np.ndarray]:
    """The arrays of a ``.npz`` file, by name (checked against the graph by ``compare``)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"--inputs {path!r}: cannot read a .npz of arrays: {e}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UsageError(f"--inputs {path!r} holds one array (a .npy); give a .npz of arrays keyed by input name (numpy.savez)")
    try:
        with data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"--inputs {path!r}: cannot read a .npz of arrays: {e}") from None


def cmd_export(args: argparse.Namespace) -> int:
    """Export a graph to ONNX (a checkpoint folder to a folder: the whole causal LM, as optimum and genai load it)."""
    from lowering.exporter.onnx_export import export

    folder = getattr(args, "checkpoint_folder", None)
    if not args.output.strip():
        raise UsageError("-o names the file or folder to write; got an empty name")
    if folder is not None:
        if args.output.endswith(".onnx"):
            raise UsageError(
                f"{folder} exports as a folder (model.onnx, its weights and the files optimum and onnxruntime-genai load): "
                f"name a folder, -o OUT/ (for the decoder stack alone as one file: --hf-config {folder}/config.json)"
            )
        return _export_checkpoint(args, folder)
    if quantize_options(args) is not None:
        raise UsageError("--quantize quantizes a checkpoint folder's model: graphc export DIR -o OUT/ --quantize int4")
    g, _ = _graph(args)
    fused = args.attention != "decomposed"
    hints = _hints(args.hint)
    if not args.no_optimize:
        g = optimize(g, hints=hints).graph
    model = export(g, args.output, opset=args.opset, attention=args.attention, hints=hints, device=args.device)
    ops = sorted({n.op_type for n in model.graph.node})
    print(
        f"wrote {args.output}: {len(model.graph.node)} nodes ({', '.join(ops)}), opset {args.opset}, IR {model.ir_version}"
        + (", attention " + args.attention if fused else "")
        + (", for CUDA" if args.device == "cuda" else "")
    )
    return 0


def _export_checkpoint(args: argparse.Namespace, folder: str) -> int:
    from lowering.checkpoint_export import export_checkpoint

    if args.no_optimize or args.decode or args.core or args.graph:
        raise UsageError(
            "a checkpoint folder exports the whole model (one decode step with its KV cache): drop --no-optimize, --decode, --core, --graph"
        )
    done = export_checkpoint(
        folder,
        args.output,
        layers=args.layers,
        attention=args.attention,
        opset=args.opset,
        hints=_hints(args.hint),
        device=args.device,
        force=args.force,
        quantize=quantize_options(args),
    )
    print(
        f"wrote {args.output}/: model.onnx ({done.nodes} nodes, opset {done.opset}) and model.onnx.data, genai_config.json, "
        f"{', '.join(done.copied)} (loads in optimum's ORTModelForCausalLM and onnxruntime-genai)"
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print a graph as text, DOT or SVG."""
    g, _ = _graph(args)
    title = g.name
    if args.optimized:
        g = optimize(g).graph
        title += " (optimized)"
    if args.format == "text":
        _write(args.output, str(g) + "\n")
    elif args.format == "dot":
        _write(args.output, to_dot(g, title))
    else:
        _write(args.output, to_svg(g, title))
    if args.output and args.output != "-":
        print(f"wrote {args.output}")
    return 0


def _hints(items: Sequence[str], flag: str = "--hint") -> dict[str, int]:
    hints = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise UsageError(f"{flag} takes NAME=INT (e.g. seq=2048), got {item!r}")
        hints[name.strip()] = int(value)
    return hints


def cmd_optimize(args: argparse.Namespace) -> int:
    """Optimize a graph and print the before/after report (and the trace with --explain)."""
    g, sizes = _graph(args)
    hints = {**sizes, **_hints(args.hint)}
    target = None
    device = "cuda" if args.target == "ort-cuda" else "cpu"
    if args.target in ("ort-cpu", "ort-cuda"):  # the runtime an exported model is for: attention chosen per run sizes
        if args.attention == "decomposed":
            args.attention = "auto"
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
    if args.print:
        print()
        print(out)
    if onnx_out:
        from lowering.exporter.onnx_export import DEFAULT_OPSET, MIN_OPSET, export

        opset = args.opset or max(_source_opset(args.model) if args.model else DEFAULT_OPSET, MIN_OPSET)
        if args.attention != "decomposed":
            opset = max(opset, 23)
        lowering = PassContext()  # the export's own lowering, traced: each attention recognised, and the form chosen for it
        model = export(
            out, args.output, opset=opset, attention=args.attention, hints=hints, external_data=args.external_data, ctx=lowering, device=device
        )
        if args.explain:
            print(f"\nthe ONNX export (attention={args.attention!r}, opset {opset}):\n{lowering.trace.explain()}")
        print(f"wrote {args.output}: {len(model.graph.node)} nodes, opset {opset}, inputs {', '.join(out.inputs)}, outputs {', '.join(out.outputs)}")
    elif args.output:
        save_graph(out, args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """Print a config's parameters, KV-cache memory, savings and FLOPs; or, for an ONNX model or a saved graph, what it holds."""
    if args.model is not None or args.graph:
        if args.model is not None and args.graph:
            raise UsageError("give either an ONNX model or --graph, not both")
        g = _import_onnx(args.model, args.strict, args.attention_semantics) if args.model is not None else load_graph(args.graph)
        print(_describe_graph(g, args.model or args.graph))
        return 0
    cfg = _config(args)
    seq = 4096 if args.seq is None else args.seq
    for flag, v in (("--seq", seq), ("--batch", args.batch), ("--layers", args.layers)):
        at_least(flag, v, 1)
    layers = args.layers or (PRESETS[args.preset].n_layers if args.preset else 1)
    if args.preset:
        print(f"{args.preset}: {PRESETS[args.preset].description}, {layers} layers")
    if args.hf_config:
        from .attention.decoder import decoder_weight_shapes
        from .attention.hf import decoder_configs_from_hf

        cfgs = decoder_configs_from_hf(args.hf_config, args.layers)
        layers = len(cfgs)
        params = sum(int(np.prod(s)) for c in cfgs for s in decoder_weight_shapes(c).values())
        windows = sorted({c.attention.sliding_window for c in cfgs}, key=lambda w: (w is None, w or 0))
        print(
            f"{args.hf_config}: {layers} decoder layers, {params:,} parameters in them (no embeddings), MLP {cfgs[0].mlp} {cfgs[0].activation}, "
            f"intermediate {cfgs[0].intermediate_size}, windows {windows}"
        )
    args.dtype = args.dtype or _config_dtype(args.hf_config) or "float16"
    print(cfg.summary(batch=args.batch, seq_len=seq, dtype=args.dtype, n_layers=layers))
    total = cfg.kv_cache_bytes(args.batch, seq, args.dtype, layers)
    mha_total = cfg.with_(n_kv_heads=cfg.n_heads).kv_cache_bytes(args.batch, seq, args.dtype, layers)
    print(f"  KV cache, all {layers} layers: {total / 2**30:.3f} GiB (MHA with the same heads: {mha_total / 2**30:.3f} GiB)")
    return 0


def _config_dtype(config: str | None) -> str | None:
    """The dtype a transformers config says its weights are in (``dtype``, or ``torch_dtype`` in older files), when it is a float one."""
    if not config:
        return None
    from .attention.hf import read_hf_config

    cfg = read_hf_config(config)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return dtype if isinstance(dtype, str) and dtype in FLOAT_DTYPES else None


def _describe_graph(g: Graph, source: str) -> str:
    """What ``graphc info`` prints for a graph: interface, ops, parameters, and what the optimizer recognises."""

    def shape(name: str) -> str:
        t = g.types[name]
        return f"{name} [{', '.join(str(d) for d in t.shape)}] {t.dtype}"

    params = sum(int(a.size) for a in g.initializers.values())
    weight_bytes = sum(int(a.nbytes) for a in g.initializers.values())
    opt = optimize(g).graph
    counts = ", ".join(f"{k} {v}" for k, v in g.op_counts().items())
    after = ", ".join(f"{k} {v}" for k, v in opt.op_counts().items())
    kept = lower(opt, Target("every attention", lambda graph, node, ctx: None))  # recognised, none decomposed
    kinds = Counter(_attention_kind(n.op) for n in kept.topological_order() if isinstance(n.op, Attention))
    lines = [
        f"{source}: graph {g.name!r}, {len(g.nodes)} nodes, {params:,} parameters ({weight_bytes / 2**20:,.1f} MiB)",
        f"  inputs:  {'; '.join(shape(n) for n in g.inputs)}",
        f"  outputs: {'; '.join(shape(n) for n in g.outputs)}",
        f"  ops: {counts}",
        f"  optimized: {len(opt.nodes)} nodes; {after}",
        f"  attention recognised: {sum(kinds.values())}" + "".join(f"\n    {n} x {kind}" for kind, n in kinds.items()),
    ]
    if g.assumptions:  # where an imported model is defined (every run checks it)
        lines.insert(3, f"  defined where: {'; '.join(f'{a} == {b}' for a, b in g.assumptions)} (checked on every run)")
    return "\n".join(lines)


def _attention_kind(op: Attention) -> str:
    """One line of what an ``Attention`` op computes: what the queries see, cache, softcap."""
    parts = [op.visibility.describe()] + (["KV cache"] if op.kv_cache else []) + ([f"softcap {op.softcap:g}"] if op.softcap is not None else [])
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``graphc`` command."""
    p = Parser(prog="graphc", description="An einsum graph compiler for attention: build, optimize, export, compare.")
    p.add_argument("--version", action="version", version=f"graphc {__version__}")
    _add_common_args(p, None)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    common = Parser(add_help=False)
    _add_common_args(common, argparse.SUPPRESS)  # after the subcommand too; SUPPRESS keeps the top-level value

    _add_compare(sub, common)
    _add_export_and_show(sub, common)
    _add_optimize(sub, common)
    add_generate(sub, common)
    i = sub.add_parser("info", parents=[common], help="config, parameter count, KV-cache memory, FLOPs")
    _add_graph_args(i)
    i.add_argument("--dtype", default=None, choices=FLOAT_DTYPES,
                   help="KV-cache dtype (default: a config's own dtype, else float16)")  # fmt: skip
    i.set_defaults(func=cmd_info)
    return p


def _add_compare(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc compare``."""
    from lowering.compare import DEFAULT_BACKENDS
    from lowering.exporter.targets import ATTENTION_MODES

    c = sub.add_parser("compare", parents=[common], help="run a graph on every backend; exit 1 if any disagrees")
    _add_graph_args(c)
    c.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help=f"comma-separated (default {','.join(DEFAULT_BACKENDS)})")
    c.add_argument("--no-optimize", action="store_true", help="run the unoptimized graph on every backend")
    c.add_argument("--repeats", type=int, default=5, help="timed runs per backend after one warm-up (default 5)")
    c.add_argument(
        "--atol", type=float, default=None, help="absolute tolerance (default per output dtype: 1e-4 float32, 1e-2 float16, 8e-2 bfloat16)"
    )
    c.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance (default per output dtype: 1e-3 float32, 1e-2 float16, 8e-2 bfloat16)"
    )
    c.add_argument(
        "--tf32",
        action="store_true",
        help="let ort-cuda run float32 MatMul in TF32 (default off: float32 is float32); float32 tolerance becomes 5e-3 + 1e-2*|ref|",
    )
    c.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="storage dtype of weights and inputs (computed in float32; on ort-cuda float16 contracts in float16)",
    )
    c.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_MODES,
        help="how ONNX backends get attention (default auto: per attention, with the run's sizes)",
    )
    c.add_argument("--threads", type=int, default=None, help="threads per backend (default: library default)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--inputs", metavar="FILE.npz", default=None, help="run on these arrays (numpy .npz keyed by input name) instead of random inputs")
    c.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="N",
        help="also split the graph by KV-head group into N shards and run them on N Dask worker processes (needs graphc[distributed])",
    )
    c.add_argument("--shard-backend", default="numpy", metavar="NAME", help="backend of each shard with --shards (default numpy)")
    c.set_defaults(func=cmd_compare)


def _add_export_and_show(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc export`` and ``graphc show``."""
    from lowering.exporter.onnx_export import DEFAULT_OPSET
    from lowering.exporter.targets import ATTENTION_MODES

    e = sub.add_parser("export", parents=[common], help="export a graph to ONNX")
    _add_graph_args(e, sizes=False)
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
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("show", parents=[common], help="print a graph as text, Graphviz DOT or SVG")
    _add_graph_args(s, sizes=False)
    s.add_argument("--optimized", action="store_true", help="show the graph after optimization")
    s.add_argument("--format", default="text", choices=("text", "dot", "svg"))
    s.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    s.set_defaults(func=cmd_show)


def _add_optimize(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc optimize``."""
    from lowering.exporter.targets import ATTENTION_MODES

    o = sub.add_parser("optimize", parents=[common], help="optimize a graph and report what changed")
    _add_graph_args(o)
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
    o.set_defaults(func=cmd_optimize)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv``; returns the exit code.

    0: ok; 1: backends disagree; 2: user error (one line on stderr);
    130: interrupted; 141: stdout closed early (``graphc ... | head``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if not args.command:
            raise UsageError("a command is needed: compare, export, show, optimize, info or generate (see graphc --help)")
        if args.memory_cap is not None:
            memory.set_memory_cap(args.memory_cap, "set by --memory-cap")
        if hasattr(args, "seed"):  # --seed given asks for seeded random weights where a folder has none
            args.seed_given, args.seed = args.seed is not None, 0 if args.seed is None else args.seed
        _open_checkpoint_folder(args)
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except (GraphcError, OSError) as e:
        if debug:
            traceback.print_exc()
        print(f"graphc: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("graphc: interrupted", file=sys.stderr)
        return 130
    finally:
        memory.set_memory_cap(None)


def _one_line(e: BaseException) -> str:
    """The first line of an error; an operating system's error as ``PATH: what went wrong`` (no errno, no repr)."""
    if isinstance(e, OSError) and not isinstance(e, GraphcError) and e.strerror:
        names = [str(n) for n in (e.filename, e.filename2) if n is not None]
        return f"{' -> '.join(names)}: {e.strerror}" if names else e.strerror
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _silence_stdout() -> None:
    """The reader of stdout went away: point stdout at /dev/null so that the interpreter's final flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main_entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
