"""Greedy generation with a causal LM graph: prefill, then one step per token with the KV cache carried between steps.

``generate(graph, prompts, max_new_tokens, backend=...)`` runs a graph with the
interface of :func:`graphc.causal_lm_graph` (and of optimum's
``text-generation-with-past`` exports): prompts of different lengths are
left-padded into one batch, ``attention_mask`` marks the padding, positions
count real tokens only (``cumsum(mask) - 1``, as transformers' ``generate``),
and each step feeds the last token of every sequence with the previous step's
``present.*`` as ``past_key_values.*``.  Where the cache lives between steps is the runner's
business (:mod:`lowering.decode.kv_cache`): the loop asks the runner for a cache
(``runner.new_cache``), runs each step through ``runner.step`` and hands the
step's outputs to the cache.  On onnxruntime the cache stays in onnxruntime's
own tensors (``OrtValue`` s, never copied to NumPy); on NumPy it is a buffer per
layer that the attention kernel appends to in place (:mod:`lowering.decode.kv_buffers`);
sharded, each shard keeps its part; elsewhere the arrays a step returns are the
next step's inputs.

A sequence that emits ``eos_token_id`` is finished: it is fed ``pad_token_id``
afterwards and generation stops when every sequence is finished, as
transformers does.  NaN logits (weights holding NaN or inf) raise
:class:`~graphc.errors.ExecutionError`: transformers emits token 0 for them,
graphc refuses to choose.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphc.errors import ExecutionError, InputError
from graphc.graph import Graph

from .backends.registry import prepare
from .backends.runner import DecodeRunner
from .decode.kv_cache import LMInterface

__all__ = ["Generation", "generate", "left_pad", "lm_interface", "LMInterface"]

_FIRST_ROOM = 256
"""New positions a cache is asked to make room for at first (a NumPy buffer doubles as tokens come: nothing is allocated
for tokens an ``eos_token_id`` may never let come)."""


def lm_interface(graph: Graph) -> LMInterface:
    """Check that ``graph`` has a causal LM's inputs and outputs (see :func:`graphc.causal_lm_graph`) and describe them."""
    if not isinstance(graph, Graph):
        raise InputError(f"generate takes a graphc Graph, got {type(graph).__name__}")
    n = sum(1 for name in graph.inputs if name.startswith("past_key_values.") and name.endswith(".key"))
    static = "cache_position" in graph.inputs  # a fixed-capacity cache (graphc.causal_lm_graph(cache="static"))
    want_in = ["input_ids", "attention_mask", "position_ids", *(["cache_position"] if static else [])]
    want_in += [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    want_out = ["logits"] + [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    if n == 0 or sorted(graph.inputs) != sorted(want_in) or sorted(graph.outputs) != sorted(want_out):
        raise InputError(
            f"graph {graph.name!r} is not a causal LM step: generate needs inputs input_ids, attention_mask, position_ids, "
            f"(cache_position,) past_key_values.{{i}}.key/value and outputs logits, present.{{i}}.key/value (as graphc.causal_lm_graph builds); "
            f"it has inputs {graph.inputs[:6]} and outputs {graph.outputs[:4]}"
        )
    caches = [graph.types[f"past_key_values.{i}.key"] for i in range(n)]
    for i, t in enumerate(caches):
        if t.rank != 4 or not all(isinstance(d, int) for d in (t.shape[1], t.shape[3])):
            raise InputError(f"past_key_values.{i}.key must be [batch, kv_heads, past, head_dim] with static heads and head_dim, got {list(t.shape)}")
    vocab = graph.types["logits"].shape[-1]
    if not isinstance(vocab, int):
        raise InputError(f"logits must have a static vocabulary axis, got {list(graph.types['logits'].shape)}")
    heads = tuple(int(t.shape[1]) for t in caches)  # static: checked above
    dims = tuple(int(t.shape[3]) for t in caches)
    return LMInterface(n, heads, dims, caches[0].dtype, vocab, static)


def left_pad(prompts: Sequence[Sequence[int]] | np.ndarray, pad_token_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``attention_mask`` ``[batch, longest]`` (int64) for prompts of any lengths, padded on the left."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2 or prompts.dtype.kind not in "iu" or 0 in prompts.shape:
            raise InputError(f"prompts as an array must be 2-d integers [batch, seq], both at least 1, got {prompts.dtype}{list(prompts.shape)}")
        return prompts.astype(np.int64), np.ones(prompts.shape, np.int64)
    rows = [list(p) for p in prompts]
    if not rows or not all(rows):
        empty = next((i for i, r in enumerate(rows) if not r), None)
        where = f"prompt {empty} is empty" if empty is not None else "no prompt given"
        raise InputError(f"prompts must be a non-empty list of non-empty token id lists: {where}")
    bad = next(((i, t) for i, r in enumerate(rows) for t in r if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
    if bad is not None:
        raise InputError(f"prompt token ids must be ints: prompt {bad[0]} holds {type(bad[1]).__name__} {bad[1]!r}")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_token_id, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = r
        mask[b, width - len(r) :] = 1
    return ids, mask


@dataclass(frozen=True)
class Generation:
    """The result of :func:`generate`: tokens, per-step logits (when kept) and timings."""

    sequences: np.ndarray
    """``[batch, prompt + new]``: the (left-padded) prompts, then the generated tokens."""
    new_tokens: np.ndarray
    """``[batch, new]``: the generated tokens (``pad_token_id`` after a sequence's ``eos_token_id``)."""
    attention_mask: np.ndarray
    logits: tuple[np.ndarray, ...]
    """Per step, the last position's logits ``[batch, vocab]`` (float32); empty unless ``keep_logits``."""
    prefill_seconds: float
    step_seconds: tuple[float, ...]
    backend: str
    provider: str

    @property
    def ms_per_token(self) -> float:
        """Median wall time of one decode step (all sequences of the batch), in ms; 0 without decode steps."""
        return float(np.median(self.step_seconds)) * 1e3 if self.step_seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second over the decode steps (batch x steps / their time)."""
        total = sum(self.step_seconds)
        return self.new_tokens.shape[0] * len(self.step_seconds) / total if total > 0 else 0.0

    def tokens(self) -> list[list[int]]:
        """Per sequence, its prompt (padding removed) and generated tokens."""
        return [[int(t) for t, m in zip(row, mask) if m] for row, mask in zip(self.sequences, self.attention_mask)]


def _last_logits(logits: Any) -> np.ndarray:
    return np.asarray(np.asarray(logits)[:, -1, :], dtype=np.float32)


def _check_finite(logits: np.ndarray, done: np.ndarray, step: int) -> None:
    """NaN logits have no argmax: refuse them rather than emit token 0 (what an argmax over NaN gives, and transformers emits)."""
    bad = np.isnan(logits).any(axis=-1) & ~done
    if bad.any():
        rows = np.flatnonzero(bad).tolist()
        raise ExecutionError(
            f"step {step + 1}: the logits of sequence(s) {rows} are NaN, so no token can be chosen; "
            "the model's weights or the prompt's values hold NaN or inf (check the checkpoint)"
        )


def generate(
    graph: Graph,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    max_new_tokens: int,
    backend: str = "numpy",
    attention_mask: np.ndarray | None = None,
    pad_token_id: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    keep_logits: bool = False,
    runner: DecodeRunner | None = None,
    progress: Callable[[int, int], None] | None = None,
    shards: int | None = None,
    client: Any = None,
    **prepare_options: Any,
) -> Generation:
    """Greedy decoding (the argmax token at every step) of ``max_new_tokens`` tokens per prompt.

    ``prompts``: lists of token ids (any lengths; left-padded with ``pad_token_id``) or an int array
    ``[batch, seq]`` with its ``attention_mask`` (1 token, 0 padding). ``runner``: a runner already
    prepared for ``graph`` (else :func:`~lowering.prepare` with ``backend`` and ``prepare_options``).
    ``eos_token_id``: one id or several (as transformers takes them); a sequence that emits any of them is finished.
    A ``runner`` must have been prepared for a graph of ``graph``'s structure (names, shapes, dtypes; the weights are
    not compared).  ``progress(step, total)`` is called after each step.  ``shards=N`` splits the model by KV-head group
    (:func:`graphc.sharding.shard`) and runs it on ``N`` Dask workers (``client``, or a LocalCluster closed at the
    end), each keeping its part of the KV cache between steps; ``backend`` is then each shard's backend.
    """
    lm = lm_interface(graph)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    ids, mask = left_pad(prompts, pad_token_id)
    if attention_mask is not None:
        mask = np.asarray(attention_mask)
        if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
            raise InputError(f"attention_mask must be 0/1 of the prompts' shape {list(ids.shape)}, got {mask.dtype}{list(mask.shape)}")
        mask = mask.astype(np.int64)
        empty = np.flatnonzero(mask.sum(axis=1) == 0)
        if empty.size:  # transformers attends such a row to its padding (an artefact of its mask fill); graphc refuses it
            raise InputError(f"attention_mask row {int(empty[0])} marks no token: every prompt needs at least one (1 token, 0 padding)")
    if ids.size and (ids.min() < 0 or ids.max() >= lm.vocab_size):
        raise InputError(f"token ids must be in 0..{lm.vocab_size - 1} (the vocabulary), got {int(ids.min())}..{int(ids.max())}")
    eos = _eos_ids(eos_token_id)
    capacity = graph.types["past_key_values.0.key"].shape[2]
    if runner is not None:
        _check_runner(graph, runner)
    if runner is None and shards is not None:
        from .distributed.dask_shards import sharded_runner

        with sharded_runner(graph, shards, backend, client, **prepare_options) as own:
            return _generate(lm, ids, mask, max_new_tokens, own, pad_token_id, eos, keep_logits, progress, capacity)
    runner = runner or prepare(graph, backend, **prepare_options)
    return _generate(lm, ids, mask, max_new_tokens, runner, pad_token_id, eos, keep_logits, progress, capacity)


def _eos_ids(eos_token_id: Any) -> np.ndarray:
    """``eos_token_id`` (None, an int or ints) as an int64 array of ids."""
    if eos_token_id is None:
        return np.zeros(0, np.int64)
    ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple, np.ndarray)) else [eos_token_id]
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < 2**63 for t in ids):
        raise InputError(f"eos_token_id must be a token id or a list of them (non-negative ints), got {eos_token_id!r}")
    return np.array(ids, np.int64)


def _check_runner(graph: Graph, runner: Any) -> None:
    """A runner prepared for another model would compute that model's tokens: refuse it."""
    if not all(callable(getattr(runner, m, None)) for m in ("new_cache", "step", "prepared_for")):
        raise InputError(f"runner must be a lowering Runner or ShardedRunner (new_cache, step, prepared_for), got {type(runner).__name__}")
    if not runner.prepared_for(graph):
        made = getattr(runner, "graph", None)
        made_for = getattr(made, "name", None) or getattr(getattr(runner, "plan", None), "name", "?")
        which = f"graph {made_for!r}" if made_for != graph.name else f"another graph named {made_for!r}"
        differs = f" ({_difference(made, graph)})" if isinstance(made, Graph) else " (a different structure)"
        raise InputError(f"the runner was prepared for {which}, not for this graph {graph.name!r}{differs}; prepare it for this graph")


def _difference(made: Graph, graph: Graph) -> str:
    """The first structural difference between the runner's graph and ``graph``, in words."""
    for kind, a, b in (("inputs", made.inputs, graph.inputs), ("outputs", made.outputs, graph.outputs)):
        if list(a) != list(b):
            extra = sorted(set(b) - set(a)) or sorted(set(a) - set(b))
            return f"its {kind} differ: {len(a)} against {len(b)}" + (f", e.g. {extra[0]!r}" if extra else "")
        for name in a:
            if made.types[name] != graph.types[name]:
                return f"{kind[:-1]} {name!r} is {made.types[name]} there, {graph.types[name]} here"
    return f"{len(made.nodes)} nodes there, {len(graph.nodes)} here" if len(made.nodes) != len(graph.nodes) else "their nodes differ"


class _StepInputs:
    """The non-cache inputs of each step: the prompt first, then each sequence's last token.

    A growing cache takes the mask of every position so far; a fixed-capacity one (``lm.static``) the mask of its
    ``capacity`` slots (1 where a token is, the new ones included) and ``cache_position``, the slots being written."""

    def __init__(self, lm: LMInterface, ids: np.ndarray, mask: np.ndarray, capacity: int) -> None:
        self.static = lm.static
        self.mask = mask  # every position so far (the Generation's mask)
        self.written = ids.shape[1]
        positions = np.maximum(mask.cumsum(1) - 1, 0)
        self.feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        if self.static:
            self.slots = np.zeros((ids.shape[0], capacity), np.int64)
            self.slots[:, : ids.shape[1]] = mask
            self.feeds.update(attention_mask=self.slots, cache_position=np.arange(ids.shape[1], dtype=np.int64))

    def advance(self, token: np.ndarray) -> None:
        """The next step feeds ``token [batch]`` at the next position."""
        batch = token.shape[0]
        self.mask = np.concatenate([self.mask, np.ones((batch, 1), np.int64)], axis=1)
        self.feeds = {"input_ids": token[:, None], "attention_mask": self.mask, "position_ids": self.feeds["position_ids"][:, -1:] + 1}
        if self.static:
            self.slots[:, self.written] = 1
            self.feeds.update(attention_mask=self.slots, cache_position=np.array([self.written], np.int64))
        self.written += 1


def _capacity(lm: LMInterface, graph_capacity: Any, prompt: int, max_new_tokens: int) -> int:
    """Positions the cache makes room for: a fixed-capacity graph's own capacity (checked), else enough to start with."""
    if not lm.static:
        return prompt + min(max_new_tokens, _FIRST_ROOM)
    need = prompt + max_new_tokens - 1  # the last token is sampled, never written
    if isinstance(graph_capacity, int):
        if graph_capacity < need:
            raise InputError(
                f"the graph's fixed-capacity cache holds {graph_capacity} positions; {prompt} prompt + {max_new_tokens - 1} new tokens need {need}"
            )
        return graph_capacity
    return need


def _generate(
    lm: LMInterface,
    ids: np.ndarray,
    mask: np.ndarray,
    max_new_tokens: int,
    runner: DecodeRunner,
    pad_token_id: int,
    eos: np.ndarray,
    keep_logits: bool,
    progress: Callable[[int, int], None] | None,
    graph_capacity: Any = None,
) -> Generation:
    batch = ids.shape[0]
    capacity = _capacity(lm, graph_capacity, ids.shape[1], max_new_tokens)
    cache = runner.new_cache(lm, batch, capacity)
    done = np.zeros(batch, bool)
    new: list[np.ndarray] = []
    kept: list[np.ndarray] = []
    times: list[float] = []
    inputs = _StepInputs(lm, ids, mask, capacity)
    try:
        for step in range(max_new_tokens):
            start = time.perf_counter()
            outputs = runner.step({**inputs.feeds, **cache.feeds()}, cache.outputs)
            cache.advance(outputs)
            logits = _last_logits(outputs["logits"])
            times.append(time.perf_counter() - start)
            _check_finite(logits, done, step)
            token = np.where(done, pad_token_id, logits.argmax(-1)).astype(np.int64)
            new.append(token)
            if keep_logits:
                kept.append(logits)
            if progress is not None:
                progress(step + 1, max_new_tokens)
            if eos.size:
                done |= np.isin(token, eos)
            if done.all() or step + 1 == max_new_tokens:
                break
            inputs.advance(token)
    finally:
        cache.close()
    tokens = np.stack(new, axis=1)
    full_mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
    return Generation(
        np.concatenate([ids, tokens], axis=1), tokens, full_mask, tuple(kept), times[0], tuple(times[1:]), runner.backend, runner.provider
    )
