"""``graphc generate``: greedy tokens from a transformers checkpoint on each backend, with prefill time and tokens/s.

The model is built once (:func:`graphc.causal_lm_from_hf`; seeded random weights
without ``--weights``), optimized for the decode step, and generated on every
backend in turn, one at a time: each backend's row says how long it took to
prepare and its peak resident memory (the weights' bytes are in the header).  Every backend must produce the same tokens: the command exits 1
when they differ (after printing them all), 2 on a user error.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from typing import Any

from ..graph import Graph
from ..mapped import distinct_nbytes, release_mapped_pages
from ..memory import format_bytes, reset_resident_peak, resident_peak_bytes
from .common import Progress, UsageError, add_quantize_args, at_least, quantize_options

__all__ = ["add_command", "run"]

MAX_NEW_TOKENS = 1 << 16


def _prompts(items: list[str]) -> list[list[int]]:
    prompts = []
    for item in items:
        try:
            ids = [int(t) for t in item.replace(" ", "").split(",") if t]
        except ValueError:
            raise UsageError(f"--prompt-ids takes comma-separated token ids such as 1,2,3, got {item!r}") from None
        if not ids:
            raise UsageError(f"--prompt-ids {item!r} holds no token id")
        out_of_range = [t for t in ids if not 0 <= t < 2**63]
        if out_of_range:
            raise UsageError(f"--prompt-ids: token id {out_of_range[0]} is out of range (ids are 0 .. the vocabulary size - 1)")
        prompts.append(ids)
    return prompts


@dataclass(frozen=True)
class _Request:
    """What to generate from, read once from the flags and the checkpoint folder (whose files fill what a flag left out)."""

    config: Any  # the transformers config, read once (graphc.attention.hf.HFConfig)
    weights: str | None
    pad_token_id: int
    eos_token_id: Any  # an id, a list of ids, or None
    prompts: list[list[int]]
    texts: list[str]  # the --prompt texts (none for --prompt-ids)
    tokenizer: Any  # the folder's tokenizer with --prompt, else None


def _resolve(args: argparse.Namespace) -> _Request:
    """The prompts as ids, their texts and the tokenizer, with ``--hf-config``, ``--weights``, ``--pad-token-id`` and
    ``--eos-token-id`` taken from a checkpoint folder where they were not given."""
    from ..attention.hf import read_hf_config
    from ..checkpoint import Checkpoint

    folder = Checkpoint(args.checkpoint) if args.checkpoint else None
    if folder is None and not args.hf_config:
        raise UsageError("generate needs a checkpoint folder (graphc generate DIR --prompt ...) or --hf-config CONFIG.json")
    sources = {"pad_token_id": "--pad-token-id", "eos_token_id": "--eos-token-id"}
    ids = {"pad_token_id": args.pad_token_id, "eos_token_id": args.eos_token_id}
    hf_config, weights = args.hf_config, args.weights
    if folder is not None:
        hf_config, weights = hf_config or str(folder.config), weights or str(folder.folder)
        defaults = folder.generation_defaults()
        for field in sources:
            if ids[field] is None:
                ids[field] = defaults[field]
                sources[field] = f"the folder's {field} (generation_config.json or config.json)"
    pad = 0 if ids["pad_token_id"] is None else ids["pad_token_id"]
    config = read_hf_config(hf_config)
    _check_special_ids(pad, ids["eos_token_id"], sources, config)
    if args.chat and not args.prompt:
        raise UsageError("--chat applies the chat template to --prompt TEXT messages; give --prompt")
    if not args.prompt and not args.prompt_ids:
        raise UsageError("generate needs a prompt: --prompt TEXT (with a checkpoint folder's tokenizer) or --prompt-ids 1,2,3")
    tokenizer = None
    texts: list[str] = []
    prompts = _prompts(args.prompt_ids or [])
    if args.prompt:
        if folder is None:
            raise UsageError("--prompt TEXT needs the checkpoint folder (its tokenizer.json): graphc generate DIR --prompt ...")
        tokenizer = folder.tokenizer()
        texts = list(args.prompt)
        encoded = [folder.chat_prompt(t, tokenizer) if args.chat else tokenizer.encode(t) for t in texts]
        if not all(encoded):
            raise UsageError(f"--prompt {texts[[bool(e) for e in encoded].index(False)]!r} gives no token")
        prompts = encoded + prompts
    _warn_past_positions(args, prompts, config)
    return _Request(config, weights, pad, ids["eos_token_id"], prompts, texts, tokenizer)


def _check_special_ids(pad: int, eos: Any, sources: dict[str, str], config: dict[str, Any]) -> None:
    """The pad id must be an id of the model's vocabulary, an eos id an int64; an error names where each came from."""
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return  # the model's own config check names it
    if not 0 <= pad < vocab:  # fed to the model: it must be a row of the embedding table
        raise UsageError(f"{sources['pad_token_id']} {pad} is not a token id of the model's vocabulary (0..{vocab - 1})")
    bad = [i for i in ([eos] if isinstance(eos, int) else list(eos or [])) if not 0 <= i < 2**63]
    if bad:  # an eos past the vocabulary never comes (generation runs to --max-new-tokens), but it must be an int64
        raise UsageError(f"{sources['eos_token_id']} {bad[0]} is not a token id (ids are 0 .. 2**63 - 1)")


def _warn_past_positions(args: argparse.Namespace, prompts: list[list[int]], config: dict[str, Any]) -> None:
    """A prompt (with the tokens asked for) past the model's positions runs on, as transformers does, with a warning."""
    limit = config.get("max_position_embeddings")
    longest = max(map(len, prompts))
    if isinstance(limit, int) and longest + args.max_new_tokens > limit:
        print(
            f"graphc: warning: the longest prompt ({longest} tokens) and --max-new-tokens {args.max_new_tokens} run past the model's "
            f"{limit} positions (max_position_embeddings); tokens past them are unreliable",
            file=sys.stderr,
        )


def _model(args: argparse.Namespace, request: _Request) -> Graph:
    from ..attention.causal_lm import causal_lm_graph
    from ..attention.hf_lm import causal_lm_config_from_hf, causal_lm_from_hf
    from ..quantize import quantize_weights
    from ..weights import load_weights

    cache = "static" if args.cuda_graph else args.cache
    if request.weights:
        weights = load_weights(request.weights)
        lm = causal_lm_from_hf(request.config, weights, n_layers=args.layers, dtype=args.dtype, logits="last", cache=cache)
    else:
        cfg = causal_lm_config_from_hf(request.config, args.layers)
        lm = causal_lm_graph(cfg, seed=args.seed, dtype=args.dtype or "float32", logits="last", cache=cache)
    options = quantize_options(args)
    return lm if options is None else quantize_weights(lm, options)[0]


@dataclass(frozen=True)
class _Row:
    """One backend's generation with what it cost: seconds to prepare, the first (cold) prefill's seconds, peak resident
    bytes while it ran."""

    generation: Any
    prepare_seconds: float
    peak_bytes: int | None
    first_prefill_seconds: float = 0.0

    @property
    def first_token_seconds(self) -> float:
        """From the start of ``prepare`` to the first token's logits: prepare, then the first prefill."""
        return self.prepare_seconds + self.first_prefill_seconds


def _table(rows: list[tuple[str, _Row | str]], graph: Graph, prompts: list[list[int]], new: int) -> str:
    layers = sum(1 for n in graph.inputs if n.endswith(".key"))
    weights = distinct_nbytes(graph.initializers.values())
    lines = [
        f"model {graph.name}: {layers} layers, vocab {graph.types['logits'].shape[-1]}, {graph.types['present.0.key'].dtype}, "
        f"weights {format_bytes(weights)}; {len(prompts)} prompt(s), up to {new} new tokens, greedy",
        f"{'backend':<14}  {'prepare s':>9}  {'first token s':>13}  {'prefill ms':>10}  {'ms/token':>8}  {'tokens/s':>8}  {'peak RSS':>10}  "
        "provider / reason",
        f"{'':<14}  {'':>9}  {'(cold)':>13}  {'(warm)':>10}  {'(median)':>8}  {'(mean)':>8}  {'(x weights)':>10}",
        f"{'-' * 14}  {'-' * 9}  {'-' * 13}  {'-' * 10}  {'-' * 8}  {'-' * 8}  {'-' * 10}  {'-' * 17}",
    ]
    for backend, r in rows:
        if isinstance(r, str):
            lines.append(f"{backend:<14}  {'-':>9}  {'-':>13}  {'-':>10}  {'-':>8}  {'-':>8}  {'-':>10}  {r}")
            continue
        g = r.generation
        peak = "-" if r.peak_bytes is None else f"{format_bytes(r.peak_bytes)}" + (f" {r.peak_bytes / weights:.2f}x" if weights else "")
        lines.append(
            f"{backend:<14}  {r.prepare_seconds:9.2f}  {r.first_token_seconds:13.2f}  {g.prefill_seconds * 1e3:10.2f}  {g.ms_per_token:8.2f}  "
            f"{g.tokens_per_second:8.1f}  {peak:>10}  {g.provider}"
        )
    return "\n".join(lines)


def _shown(rows: list[tuple[str, _Row | str]]) -> tuple[list[tuple[str, Any]], bool, str]:
    """The generations to print (the first alone when every backend agrees), whether they agree, and what agrees:
    ``every backend the same``, the one backend's name, or ``no backend ran``."""
    runs = [(b, r.generation) for b, r in rows if not isinstance(r, str)]
    same = len({tuple(map(tuple, r.new_tokens.tolist())) for _, r in runs}) <= 1
    if not same:
        return runs, False, ""
    return runs[:1], True, "every backend the same" if len(runs) > 1 else runs[0][0] if runs else "no backend ran"


def _tokens(rows: list[tuple[str, _Row | str]], prompts: list[list[int]]) -> tuple[str, bool]:
    runs, same, label = _shown(rows)
    lines = [f"tokens ({label}):" if same else "tokens DIFFER between backends:"]
    for backend, r in runs:
        for i, (prompt, new) in enumerate(zip(prompts, r.new_tokens.tolist())):
            tag = "" if same else f"{backend} "
            lines.append(f"  {tag}[{i}] {' '.join(map(str, prompt))} | {' '.join(map(str, new))}")
    return "\n".join(lines), same


def _text(rows: list[tuple[str, _Row | str]], texts: list[str], tokenizer: Any) -> str:
    """Each text prompt and the text generated for it (per backend when backends differ)."""
    runs, same, label = _shown(rows)
    lines = [f"text ({label if same else 'per backend: tokens DIFFER'}):"]
    for backend, r in runs:
        for i, text in enumerate(texts):
            lines.append(f"  {'' if same else backend + ' '}[{i}] {text}")
            lines.append(f"      => {tokenizer.decode(r.new_tokens[i].tolist())}")
    return "\n".join(lines)


def _warm_and_generate(
    graph: Graph, request: _Request, args: argparse.Namespace, runner: Any, progress: Progress, tag: str
) -> tuple[Any, float]:
    """Two untimed tokens (compiles, allocations, first calls), then the timed generation with progress lines; returns
    it and the first (cold) prefill's seconds."""
    from lowering import generate

    prompts = request.prompts
    options = {"pad_token_id": request.pad_token_id, "eos_token_id": request.eos_token_id, "runner": runner}
    cold = generate(graph, prompts, min(2, args.max_new_tokens), **options).prefill_seconds
    every = max(1, args.max_new_tokens // 4)

    def report(step: int, total: int) -> None:
        if step % every == 0 or step == 1:
            progress(f"{tag}: token {step}/{total}")

    return generate(graph, prompts, args.max_new_tokens, progress=report, **options), cold


def _sharded_row(graph: Graph, request: _Request, args: argparse.Namespace, progress: Progress) -> tuple[str, _Row | str]:
    """The ``--shards N`` row: the model split by KV-head group on N Dask workers (each keeping its part of the cache)."""
    from lowering.distributed.dask_shards import sharded_runner

    from ..errors import BackendUnavailableError

    label = f"sharded x{args.shards}"
    progress(f"{label}: starting {args.shards} Dask workers")
    try:
        start = time.perf_counter()
        with sharded_runner(graph, args.shards, args.shard_backend) as runner:
            prepared = time.perf_counter() - start
            generation, cold = _warm_and_generate(graph, request, args, runner, progress, label)
            return label, _Row(generation, prepared, None, cold)  # workers' memory is theirs
    except BackendUnavailableError as e:
        return label, f"skipped: {e}"


def _backend_row(
    graph: Graph, request: _Request, args: argparse.Namespace, backend: str, sizes: dict[str, int], progress: Progress, tag: str
) -> _Row:
    """Prepare ``backend``, generate, and measure: the peak resident memory counts this backend alone (the pages of the
    mapped checkpoint that an earlier backend read are dropped first, and its runner is gone)."""
    from lowering import prepare
    from lowering.backends.registry import backend_options, decode_options

    gc.collect()
    release_mapped_pages()
    reset_resident_peak()
    start = time.perf_counter()
    chosen = backend_options(backend, tf32=args.tf32 or None, cuda_graph=args.cuda_graph or None, prepack=args.prepack or None)
    options = {**decode_options(backend, sizes, args.threads), **chosen}
    runner = prepare(graph, backend, **options)
    prepared = time.perf_counter() - start
    generation, cold = _warm_and_generate(graph, request, args, runner, progress, tag)
    peak = resident_peak_bytes()
    del runner
    return _Row(generation, prepared, peak, cold)


def run(args: argparse.Namespace) -> int:
    """Generate greedily on every backend; print tokens/s per backend and the tokens."""
    from lowering.backends.registry import unavailable_reason

    from ..optimizer import optimize

    at_least("--max-new-tokens", args.max_new_tokens, 1, MAX_NEW_TOKENS)
    at_least("--layers", args.layers, 1)
    at_least("--threads", args.threads, 1, 4096)
    at_least("--shards", args.shards, 1, 1024)
    if args.shards is not None:
        from lowering.backends.registry import get_backend

        get_backend(args.shard_backend)  # an unknown name is refused before any worker starts
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        raise UsageError(f"--backends needs at least one backend name, got {args.backends!r}")
    for flag, on in (("--tf32", args.tf32), ("--cuda-graph", args.cuda_graph)):
        if on and "ort-cuda" not in backends:
            raise UsageError(f"{flag} is an ort-cuda option; add ort-cuda to --backends")
    if args.prepack and not any(b.startswith("ort-") for b in backends):
        raise UsageError("--prepack is an onnxruntime option; add ort-cpu or ort-cuda to --backends")
    if args.cuda_graph and args.shards is not None:
        raise UsageError("--cuda-graph and --shards do not go together: CUDA graphs replay one process's ort-cuda step")
    request = _resolve(args)
    prompts, texts, tokenizer = request.prompts, request.texts, request.tokenizer
    progress = Progress(sys.stderr, enabled=not args.quiet)
    progress("building the model")
    graph = _model(args, request)
    sizes = {"batch": len(prompts), "seq": 1, "past_seq": max(map(len, prompts)) + args.max_new_tokens // 2}
    if not args.no_optimize:
        progress("optimizing for the decode step")
        graph = optimize(graph, hints=sizes).graph
    rows: list[tuple[str, _Row | str]] = []
    try:
        for k, backend in enumerate(backends, 1):
            reason = unavailable_reason(backend)
            if reason is not None:
                rows.append((backend, f"skipped: {reason}"))
                continue
            tag = f"[{k}/{len(backends)}] {backend}"
            progress(f"{tag}: preparing and warming up")
            rows.append((backend, _backend_row(graph, request, args, backend, sizes, progress, tag)))
        if args.shards is not None:
            rows.append(_sharded_row(graph, request, args, progress))
    finally:
        progress.done()
    print(_table(rows, graph, prompts, args.max_new_tokens))
    ids, same = _tokens(rows, prompts)
    if tokenizer is not None:
        print(_text(rows, texts, tokenizer))
    if tokenizer is None or args.ids or len(texts) < len(prompts):
        print(ids)
    return 0 if same else 1


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``graphc generate``."""
    from ..ops import FLOAT_DTYPES

    g = sub.add_parser("generate", parents=[common], help="greedy text (or tokens) from a transformers checkpoint on each backend, with tokens/s")
    g.add_argument("checkpoint", nargs="?", default=None, metavar="DIR",
                   help="a checkpoint folder (config.json, *.safetensors, tokenizer.json, generation_config.json)")  # fmt: skip
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT", help="a text prompt (the folder's tokenizer); repeat for a batch")
    g.add_argument("--ids", action="store_true", help="with --prompt, print the token ids too")
    g.add_argument("--chat", action="store_true", help="each --prompt is a user message in the checkpoint's chat template (needs jinja2)")
    g.add_argument("--hf-config", default=None, metavar="CONFIG.json", help="the model's transformers config.json (default: DIR's)")
    g.add_argument("--weights", default=None, metavar="PATH", help="safetensors file or checkpoint folder (default: DIR, else seeded random weights)")
    g.add_argument("--layers", type=int, default=None, help="use the first N layers only (default: all)")
    g.add_argument("--prompt-ids", action="append", default=None, metavar="IDS", help="comma-separated token ids; repeat for a batch")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    g.add_argument("--backends", default="ort-cpu", help="comma-separated (default ort-cpu; two or more compare their tokens)")
    g.add_argument("--dtype", default=None, choices=FLOAT_DTYPES, help="compute the model in this storage dtype (default: the checkpoint's)")
    g.add_argument("--pad-token-id", type=int, default=None, help="fills the left of shorter prompts (default: DIR's generation config, else 0)")
    g.add_argument("--eos-token-id", type=int, action="append", default=None,
                   help="a sequence that emits it stops; repeat for several (default: DIR's generation config, else none)")  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights without --weights")
    add_quantize_args(g)
    g.add_argument("--threads", type=int, default=None, help="threads per backend (default: library default)")
    g.add_argument("--no-optimize", action="store_true", help="generate with the graph as built")
    g.add_argument("--tf32", action="store_true", help="let ort-cuda run float32 MatMul in TF32 (default off)")
    g.add_argument("--prepack", action="store_true",
                   help="onnxruntime packs every weight while its session is built, however large (default: only weights "
                        "under 256 MB in float32; larger ones are read as stored): seconds more to load, faster steps after")  # fmt: skip
    g.add_argument("--cache", default="dynamic", choices=("dynamic", "static"),
                   help="the KV cache: dynamic (grows each step, default) or static (fixed capacity, one shape per step)")  # fmt: skip
    g.add_argument("--cuda-graph", action="store_true", help="ort-cuda: a static cache, each one-token step replayed as a CUDA graph")
    g.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="N",
        help="also generate with the model split by KV-head group on N Dask worker processes (needs graphc[distributed])",
    )
    g.add_argument("--shard-backend", default="numpy", metavar="NAME", help="backend of each shard with --shards (default numpy)")
    g.set_defaults(func=run)
