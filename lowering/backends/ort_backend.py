"""The onnxruntime backends (``ort-cpu``, ``ort-cuda``): export, sessions, and the guards around them.

A graph is exported once per runner (:func:`lowering.exporter.onnx_export.export`) and
run by an ``InferenceSession``, in this process or, with ``isolate=True``, in
the worker process of :mod:`lowering.backends.isolated`.  Weights past
``inline_weights_max_bytes`` are not serialized into the model: the session
reads them from the checkpoint's own files or receives them as ``OrtValue`` s
(:mod:`lowering.backends.ort_weights`), so models of any size load, in about the memory
of their weights.

onnxruntime's extended graph rewrites fuse a Transpose into ``MatMul``
(``com.microsoft.FusedMatMul`` with ``transBatchA``), and some releases (1.30
among them) divide by zero inside that kernel when a transposed operand has a
zero-size axis: the process dies with SIGFPE.  A run whose contractions have a
zero-size operand under the run's sizes therefore uses a second session built
with the basic rewrites only; every other run uses the fully optimized one.  A graph whose contractions have a size
only the data gives (an imported ``NonZero``'s count: the tokens one expert of a mixture gets) always uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto

from graphc.dims import Shape, dim_symbols, eval_shape, is_static
from graphc.errors import BackendError, InputError
from graphc.graph import Graph
from graphc.mapped import distinct_nbytes
from graphc.ops import Einsum
from graphc.optimizer.precision import widen_interface

from .inputs import check_inputs
from .ort_weights import SessionWeights, host_ortvalue, plan_session_weights
from ..decode.kv_cache import ArrayKVCache, LMInterface, zeros_cache
from .ort_options import PREPACK_AUTO_MAX_BYTES, OrtOptions, packing_entry
from .ort_session_cache import cache_root, commit, entry_for, load_options, ready, save_into, write_entry
from .runner import Runner, StepFn

__all__ = ["prepare_ort", "contraction_shapes", "has_empty_contraction", "OrtKVCache", "provider_entry", "DEVICE_OF_PROVIDER", "bfloat16_cache"]

DEVICE_OF_PROVIDER = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}
"""Where each execution provider keeps its tensors: the device of its decode cache and of the export's target."""


def provider_entry(provider: str, tf32: bool = False, cuda_graph: bool = False) -> str | tuple[str, dict[str, str]]:
    """The ``providers`` entry of ``provider`` as graphc runs it: onnxruntime's CUDA provider computes float32 MatMul in
    TF32 unless told ``use_tf32=0``, so float32 is float32 there unless ``tf32`` asks otherwise; ``cuda_graph`` turns on
    its CUDA graphs (capture once, replay each step)."""
    if provider == "CUDAExecutionProvider":
        options = {"use_tf32": "1" if tf32 else "0"}
        if cuda_graph:
            options["enable_cuda_graph"] = "1"
        return provider, options
    return provider


_PROTOBUF_LIMIT = 2**31 - 1


def contraction_shapes(graph: Graph) -> list[Shape]:
    """The (symbolic) shapes of every einsum operand and result in ``graph``."""
    shapes = []
    for node in graph.topological_order():
        if isinstance(node.op, Einsum):
            shapes += [graph.types[v].shape for v in (*node.inputs, node.name)]
    return shapes


def has_empty_contraction(shapes: list[Shape], dims: Mapping[str, int]) -> bool:
    """True when one of ``shapes`` has a zero-size axis with symbols bound by ``dims``."""
    return any(0 in eval_shape(s, dims) for s in shapes)


def _check_provider(name: str, provider: str, used: list[str]) -> None:
    if provider not in used:
        raise BackendError(f"{name}: onnxruntime fell back to {used} instead of {provider}; refusing to report CPU results as {name}")


class _Sessions:
    """The runner's sessions: fully optimized, and (built on first need) basic rewrites only."""

    def __init__(
        self,
        name: str,
        graph: Graph,
        model: Callable[[], bytes],
        weights: SessionWeights,
        provider: str,
        options: OrtOptions,
        bfloat16_io: bool = False,
        cache: Path | None = None,
    ) -> None:
        self.name, self.graph, self.provider = name, graph, provider
        self._model, self.cache = model, cache
        self._model_bytes: bytes | None = None
        self.threads, self.isolate, self.spin, self.prepack = options.threads, options.isolate, options.spin, bool(options.prepack)
        self.weights = weights
        self.tf32, self.cuda_graph, self.note = options.tf32, options.cuda_graph, ""
        self.bfloat16_io = bfloat16_io
        self.built: dict[bool, Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]] = {}
        self.native: Any = None
        self.outputs: list[str] = []
        self.description = ""
        try:
            self.session(False)
        except BackendError as e:
            if not options.cuda_graph or "capture" not in str(e).lower():
                raise
            self.cuda_graph, self.note = False, f"; CUDA graphs off: {str(e).splitlines()[0][-200:]}"  # onnxruntime refused to capture this model
            self.session(False)

    @property
    def model(self) -> bytes:
        """The exported model, serialized on first need (a session loaded from the cache needs none)."""
        if self._model_bytes is None:
            self._model_bytes = self._model()
        return self._model_bytes

    @property
    def disabled_optimizers(self) -> list[str]:
        return disabled_optimizers(self.graph)

    @property
    def providers(self) -> list[Any]:
        """The ``providers`` list of the sessions (the CPU provider after CUDA's, for the ops CUDA lacks)."""
        entry = provider_entry(self.provider, self.tf32, self.cuda_graph)
        return [entry] if self.provider == "CPUExecutionProvider" else [entry, "CPUExecutionProvider"]

    def session(self, basic: bool) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
        if basic in self.built:
            return self.built[basic]
        if self.isolate:
            from .isolated import IsolatedSession

            isolated = IsolatedSession(
                self.model, self.providers, self.threads, basic_optimizations=basic, weights_folder=self.weights.folder, prepack=self.prepack
            )
            used, version, self.outputs = isolated.providers, isolated.version, isolated.outputs
            run: Callable[[Mapping[str, np.ndarray]], list[np.ndarray]] = isolated.run
        else:
            import onnxruntime as ort

            sess = self._local(basic)
            used, version = sess.get_providers(), ort.__version__
            self.outputs = [o.name for o in sess.get_outputs()]
            out_names = list(self.outputs)
            options = None
            if self.cuda_graph:  # a plain run is never captured: only the decode step's replays are
                options = ort.RunOptions()
                options.add_run_config_entry("gpu_graph_id", "-1")
            if self.bfloat16_io:  # bfloat16 arrays in and out: onnxruntime's Python API converts none, a binding moves their bytes
                run = functools.partial(_bound_run, sess, out_names, options=options)
            else:
                run = lambda inputs: sess.run(out_names, dict(inputs), options)  # noqa: E731
            if not basic:
                self.native = sess
        _check_provider(self.name, self.provider, used)
        if not self.description:
            graphs = " with CUDA graphs" if self.cuda_graph else self.note
            self.description = f"onnxruntime {version} {used[0]}" + (" (worker process)" if self.isolate else "") + graphs
        self.built[basic] = run
        return run

    def _options(self, basic: bool) -> Any:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        if self.threads:
            so.intra_op_num_threads = self.threads
        if not self.spin:  # idle pool threads sleep instead of spinning: NumPy's and torch's pools in the same process keep their cores
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry(*packing_entry(self.prepack))
        if basic:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        return so

    def _local(self, basic: bool) -> Any:
        """An ``InferenceSession`` in this process: loaded from the session cache, or built (and saved there).  A build
        that fails on the placeholder of a weight shared from memory (a rewrite of onnxruntime's read its bytes) is
        done again with the weights handed over (:mod:`lowering.backends.ort_weights`)."""
        import onnxruntime as ort

        so = self._options(basic)
        entry = None if basic else self.cache
        cached = ready(entry)
        own = entry is not None and not cached and self.weights.in_memory  # onnxruntime's save would read the placeholders
        staging = save_into(so, entry) if entry is not None and not cached and not own else None
        source = load_options(so, entry) if cached and entry is not None else self.model  # the export places the weights
        handed = [] if cached else self.weights.session_options(so)
        try:
            sess = ort.InferenceSession(source, so, providers=self.providers, disabled_optimizers=self.disabled_optimizers)
        except Exception as e:  # noqa: BLE001
            if os.devnull in str(e) and self.weights.hand_shared():
                return self._local(basic)
            raise BackendError(f"onnxruntime could not load graph {self.graph.name!r} for {self.name}: {e}") from e
        del handed  # onnxruntime copied them
        sess.graphc_weights = self.weights  # the conversions it reads in place live as long as the session
        if staging is not None and entry is not None:
            commit(staging, entry)
        elif own and entry is not None:
            write_entry(entry, self.model, {**self.weights.shared, **self.weights.handed})
        self.note += "; the session loaded from the cache" if cached else "; the session saved to the cache" if staging or own else ""
        return sess


def disabled_optimizers(graph: Graph) -> list[str]:
    """onnxruntime's QDQ propagation is off for a graph that quantizes activations (``Quantize``): at opset 21 and
    later it writes a ``QuantizeLinear`` whose ``output_dtype`` contradicts its zero point and then rejects the
    model (as it rejects ``quantize_static``'s own files converted to opset 21)."""
    return ["QDQPropagationTransformer"] if "Quantize" in graph.op_counts() else []


def bfloat16_cache(graph: Graph) -> frozenset[str]:
    """The pasts and presents of a causal LM step (``past_key_values.*``, ``present.*``) that are bfloat16: kept so at
    onnxruntime's interface, so a decode loop holds them as onnxruntime's own tensors (on the GPU under CUDA)."""
    names = [n for n in (*graph.inputs, *graph.outputs) if n.startswith(("past_key_values.", "present."))]
    return frozenset(n for n in names if graph.types[n].dtype == "bfloat16")


def _to_numpy(value: Any) -> np.ndarray:
    """A host ``OrtValue`` as a NumPy array (a copy; bfloat16 read as its bits)."""
    if value.data_type() != "tensor(bfloat16)":
        return np.asarray(value.numpy())
    import ctypes

    shape = tuple(value.shape())
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, "bfloat16")
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(value.data_ptr()))
    return bits.copy().reshape(shape).view("bfloat16")


def _bound_run(session: Any, names: list[str], inputs: Mapping[str, np.ndarray], options: Any = None) -> list[np.ndarray]:
    """One run through an IO binding, every output copied to host memory: arrays of any dtype in and out."""
    io = session.io_binding()
    held = {k: host_ortvalue(v) for k, v in inputs.items()}  # alive until the run is done
    for k, v in held.items():
        io.bind_ortvalue_input(k, v)
    for n in names:
        io.bind_output(n, "cpu")
    session.run_with_iobinding(io, options)
    return [_to_numpy(o) for o in io.get_outputs()]


def _narrowed(step: StepFn, names: frozenset[str], inputs: Mapping[str, Any], keep: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.astype("bfloat16") if k in names else v) for k, v in step(inputs, keep).items()}


def _packing_decided(options: OrtOptions, graph: Graph) -> OrtOptions:
    """``options`` with ``prepack`` True or False: ``None`` packs weights of up to ``PREPACK_AUTO_MAX_BYTES`` in float32."""
    if options.prepack is not None and not isinstance(options.prepack, bool):
        raise BackendError(f"prepack must be True, False or None (packed when the weights are small), got {options.prepack!r}")
    if options.prepack is not None:
        return options
    float32_bytes = distinct_nbytes(graph.initializers.values(), min_itemsize=4)  # what onnxruntime's CPU kernels multiply with
    return dataclasses.replace(options, prepack=float32_bytes <= PREPACK_AUTO_MAX_BYTES)


def _checked(options: OrtOptions, name: str, device: str, graph: Graph) -> OrtOptions:
    """``options`` checked for backend ``name`` on ``device``, with ``prepack`` decided (:func:`_packing_decided`)."""
    limit, tf32, cuda_graph = options.inline_weights_max_bytes, options.tf32, options.cuda_graph
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise BackendError(f"inline_weights_max_bytes must be a non-negative int or None, got {limit!r}")
    if not isinstance(tf32, bool) or (tf32 and device != "cuda"):
        raise BackendError(f"tf32 (TF32 MatMul on onnxruntime's CUDA provider) must be a bool, True only on ort-cuda; got {tf32!r} on {name}")
    if not isinstance(cuda_graph, bool) or (cuda_graph and (device != "cuda" or "cache_position" not in graph.inputs or options.isolate)):
        raise BackendError(
            f"cuda_graph must be a bool, True only on ort-cuda (in this process) for a causal LM with a fixed-capacity cache "
            f"(graphc.causal_lm_graph(..., cache='static'): a cache_position input); got {cuda_graph!r} on {name} for graph {graph.name!r}"
        )
    return _packing_decided(options, graph)


def _model_and_cache(proto: Any, weights: SessionWeights, root: Path | None, graph: Graph, prepack: bool) -> tuple[Callable[[], bytes], Path | None]:
    """The exported model's bytes, made on first need (a session loaded from the cache converts and serializes
    nothing), and its entry in the session cache under ``root`` (:mod:`lowering.backends.ort_session_cache`), keyed
    before any weight is converted; the key's bytes are the model's unless weights are converted.

    A session that neither packs nor converts a weight has no entry: it reads the checkpoint's files as they are, and a
    saved copy of them would only be read back."""
    keyed = None if root is None or not (prepack or weights.widen) else proto.SerializeToString()
    cache = None
    if root is not None and keyed is not None:
        folder = None if weights.widen else weights.folder  # a conversion's folder is new each time; its arrays are keyed instead
        settings = [*disabled_optimizers(graph), f"prepack={prepack}"]
        cache = entry_for(root, keyed, [*weights.handed.values(), *weights.low.values()], folder, settings)

    def model() -> bytes:
        if weights.widen:
            weights.widen_casts(proto)
            return proto.SerializeToString()
        return keyed if keyed is not None else proto.SerializeToString()

    return model, cache


def prepare_ort(
    provider: str,
    graph: Graph,
    export: Callable[..., Any],
    opset: int | None = None,
    attention: str = "decomposed",
    options: OrtOptions = OrtOptions(),  # noqa: B008 - frozen
) -> Runner:
    """Export ``graph`` and build its session: a :class:`~lowering.backends.runner.Runner`, as every backend returns
    (``options``: :class:`~lowering.backends.registry.OrtOptions`).

    On CUDA the model is exported for CUDA (float16 contractions and attention in float16, onnxruntime's fused
    kernels; :func:`lowering.exporter.targets.onnx_target`), float32 MatMul runs in float32 unless ``tf32=True``,
    and a decode loop's cache stays on the GPU (:class:`OrtKVCache`).

    ``spin=False`` (default) turns off onnxruntime's spinning intra-op threads, which otherwise
    compete with NumPy's and torch's thread pools in the same process (``compare`` runs them all).
    ``inline_weights_max_bytes``: weights up to this many bytes in all are serialized into the model; larger ones
    are read from the checkpoint's files or handed over (:mod:`lowering.backends.ort_weights`); ``None`` inlines any size
    (up to protobuf's 2 GiB).

    ort-cpu's projections are exported as ``FusedMatMul(transB=1)`` over the weights as stored.  ``prepack=False``
    leaves them unpacked, so the session is built in a fraction of a second and its products read the memory-mapped
    checkpoint; ``prepack=True`` has onnxruntime pack every weight for its GEMM while the session is built, on all its
    threads (seconds for a 1B model; each step faster after: ``docs/export.md``); ``None`` (default) packs weights of
    up to :data:`~lowering.backends.ort_options.PREPACK_AUTO_MAX_BYTES` in float32 and leaves larger ones as stored.

    ``cuda_graph=True`` (ort-cuda, a causal LM with a fixed-capacity cache: ``graphc.causal_lm_graph(cache="static")``)
    captures the one-token decode step as a CUDA graph and replays it, the cache kept in two fixed buffers per layer; where
    onnxruntime refuses to capture the model, the runner's ``provider`` says so and the steps run uncaptured.
    """
    name = "ort-cuda" if provider == "CUDAExecutionProvider" else "ort-cpu"
    device = DEVICE_OF_PROVIDER.get(provider, "cpu")
    options = _checked(options, name, device, graph)
    isolate, sizes, limit = options.isolate, options.sizes, options.inline_weights_max_bytes
    kept = frozenset() if isolate else bfloat16_cache(graph)  # a bfloat16 decode cache stays onnxruntime's tensors
    bf16_in = [n for n in graph.inputs if graph.types[n].dtype == "bfloat16" and n not in kept]
    bf16_out = {n for n in graph.outputs if graph.types[n].dtype == "bfloat16" and n not in kept}
    root = None if isolate else cache_root(provider)
    weights = plan_session_weights(
        graph.initializers,
        limit,
        allow_handed=not isolate,
        widen=provider == "CPUExecutionProvider",
        in_memory=not isolate and (root is None or not options.prepack),  # a packed session is saved by onnxruntime: from files
        packed=bool(options.prepack),
    )
    exported = widen_interface(graph, keep=kept) if bf16_in or bf16_out else graph
    proto = export(exported, opset, attention, sizes, weights, device, fused_matmul=provider == "CPUExecutionProvider")
    if weights.inline_bytes >= _PROTOBUF_LIMIT:
        raise BackendError(
            f"{name}: graph {graph.name!r} carries {weights.inline_bytes / 2**30:.2f} GiB of weights inline, past protobuf's 2 GiB limit; "
            "lower inline_weights_max_bytes (or leave isolate off, so computed weights are handed over)"
        )
    model, cache = _model_and_cache(proto, weights, root, graph, bool(options.prepack))
    sessions = _Sessions(name, graph, model, weights, provider, options, bfloat16_io=bool(kept), cache=cache)
    shapes = contraction_shapes(graph)
    input_symbols = {x for n in graph.inputs for d in graph.types[n].shape for x in dim_symbols(d)}
    # a size only the data gives (an imported NonZero's count: the tokens one expert gets) may be zero on any run
    always_basic = any(0 in s or not {x for d in s for x in dim_symbols(d)} <= input_symbols for s in shapes)
    symbolic = [s for s in shapes if not is_static(s)]  # only these need the run's sizes

    def run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        basic = always_basic or (bool(symbolic) and has_empty_contraction(symbolic, check_inputs(graph, inputs)))
        feeds = {k: (v.astype(np.float32) if k in bf16_in else v) for k, v in inputs.items()}  # exact: bfloat16 is a float32 prefix
        outs = dict(zip(sessions.outputs, sessions.session(basic)(feeds)))
        return {k: (v.astype("bfloat16") if k in bf16_out else v) for k, v in outs.items()}

    native = sessions.native if not bf16_in else None  # widened inputs are converted by `run` only
    decode: dict[str, Any] = {}  # a worker process, or an interface converted by `run`: the cache is NumPy arrays
    if native is not None:
        caches = functools.partial(OrtKVCache, device=device, pool={})
        step = _ort_step(native, list(sessions.outputs), device, sessions.cuda_graph)
        if bf16_out:  # the logits of a bfloat16 model come back float32 (exact): the step gives them as the graph does
            step = functools.partial(_narrowed, step, frozenset(bf16_out))
        decode = {"caches": caches, "stepper": step}
    return Runner(name, sessions.description, graph, run, session=native, weights=weights.describe(), **decode)


class OrtKVCache(ArrayKVCache):
    """onnxruntime's decode cache: ``OrtValue`` s that go from one step's outputs to the next step's inputs, never through
    NumPy; they stay where the step left them (:func:`_ort_step`: on CUDA, on the GPU).  A growing cache's empty first
    pasts hold no bytes, so they are host ``OrtValue`` s.

    A fixed-capacity cache (``lm.static``) is two buffers per layer on ``device``, allocated once: each step reads one as
    the past and writes the other as the present (:attr:`outputs` maps each present to the buffer it is written into),
    then they swap.  The addresses never change, which is what a replayed CUDA graph needs; writing the present over
    the past it reads is left alone, since whether that is safe depends on each runtime's kernels.  Closed, the buffers
    go back to ``pool`` (the runner's), and the next cache of the same batch and capacity takes them: slots it has not
    written yet hold the last loop's values, which its attention mask hides."""

    def __init__(self, lm: LMInterface, batch: int, capacity: int = 0, device: str = "cpu", pool: dict[Any, Any] | None = None) -> None:
        import onnxruntime as ort

        where = device if lm.static else "cpu"

        def fresh(b: int, h: int, n: int, d: int, dtype: str) -> Any:
            if dtype == "bfloat16":  # no NumPy dtype onnxruntime takes: allocated by onnxruntime, zeroed through uint16
                value = ort.OrtValue.ortvalue_from_shape_and_type([b, h, n, d], TensorProto.BFLOAT16, where, 0)
                if b * h * n * d:
                    value.update_inplace(np.zeros((b, h, n, d), np.uint16))
                return value
            return ort.OrtValue.ortvalue_from_numpy(zeros_cache(b, h, n, d, dtype), where, 0)

        self._pool: dict[Any, Any] | None = pool if lm.static else None
        self._key: tuple[int, int] = (batch, capacity)
        reused = self._pool.pop(self._key, None) if self._pool is not None else None
        pooled = iter(reused[0].values()) if reused is not None else None
        super().__init__(lm, batch, fresh if pooled is None else lambda *shape: next(pooled), capacity)
        self._spare: dict[str, Any] = {}
        if lm.static:
            self._spare = reused[1] if reused is not None else {}
            for past, _ in self._names if reused is None else ():
                b, h, d = lm.cache_shape(past, batch)
                self._spare[past] = fresh(b, h, capacity, d, lm.cache_dtype)
            self.outputs = self._targets()

    def _targets(self) -> dict[str, Any]:
        """Each present mapped to the buffer the next step writes it into."""
        return {present: self._spare[past] for past, present in self._names}

    def advance(self, outputs: Mapping[str, Any]) -> None:
        """The presents become the pasts (a fixed-capacity cache: the buffers swap)."""
        if not self._spare:
            super().advance(outputs)
            return
        # the step wrote the presents into the spare buffers: keep this cache's own OrtValues (on the CPU they hold the
        # NumPy arrays behind the memory; the step's output wrappers do not)
        self._values, self._spare = self._spare, self._values
        self.outputs = self._targets()

    def close(self) -> None:
        """Let go of every buffer (a fixed-capacity cache's go back to the runner's pool, for the next loop of its shape:
        the same addresses, so the CUDA graphs captured over them replay)."""
        if self._pool is not None and self._spare:
            self._pool[self._key] = (dict(self._values), self._spare)
        self._spare = {}
        super().close()

    @property
    def length(self) -> int:
        """Positions held (axis 2 of the first ``OrtValue``; a fixed-capacity cache: its capacity)."""
        first = next(iter(self.feeds().values()), None)
        return 0 if first is None else int(first.shape()[2])

    @property
    def capacity(self) -> int:
        """A growing cache gets new tensors each step: no room beyond the length; a fixed one holds its capacity."""
        return self.length


def _ort_step(session: Any, names: list[str], device: str = "cpu", graphs: bool = False) -> StepFn:
    """A decode step on ``session`` through an IO binding: NumPy inputs bound from host memory, the cache's ``OrtValue`` s
    bound where they are, the outputs a cache keeps left on ``device`` (written into the buffers ``keep`` maps them to,
    where it maps them) and the others (the logits) copied to NumPy.

    With ``graphs`` (onnxruntime's CUDA graphs, a fixed-capacity cache) the one-token steps also read their small inputs
    from device buffers that keep their addresses and write the logits to one, so onnxruntime captures the first step
    of each cache buffer pairing and replays it (one graph per pairing); other steps (the prompt) run uncaptured."""
    import onnxruntime as ort

    graphs_seen: dict[int, tuple[Any, dict[str, Any]]] = {}  # the first present's buffer address -> (run options, buffers)
    declared = {i.name: i.type for i in session.get_inputs()}
    uncaptured = ort.RunOptions()
    uncaptured.add_run_config_entry("gpu_graph_id", "-1")

    def graph_of(targets: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """One captured graph per cache buffer pairing, with its own small input and output buffers (name -> OrtValue
        on the device, written in place: a replay reads and writes the addresses it captured)."""
        address = next(iter(targets.values())).data_ptr()
        if address not in graphs_seen:
            options = ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(len(graphs_seen) + 1))
            graphs_seen[address] = (options, {})
        return graphs_seen[address]

    def device_value(fixed: dict[str, Any], name: str, value: np.ndarray) -> Any:
        held = fixed.get(name)
        if held is None:
            held = fixed[name] = ort.OrtValue.ortvalue_from_numpy(np.array(value, copy=True), device, 0)  # a CPU OrtValue wraps its array
        else:
            held.update_inplace(np.ascontiguousarray(value))
        return held

    def step(inputs: Mapping[str, Any], keep: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
        io = session.io_binding()
        targets = keep if isinstance(keep, Mapping) else {}
        replay = graphs and bool(targets) and inputs["input_ids"].shape[1] == 1
        options, fixed = graph_of(targets) if replay else (uncaptured if graphs else None, {})
        for k, v in inputs.items():
            if isinstance(v, ort.OrtValue):
                if k in declared and v.data_type() != declared[k]:  # onnxruntime's own error names neither input nor types
                    raise InputError(f"input {k!r}: an OrtValue of {v.data_type()} where the model takes {declared[k]} (a cache of another dtype?)")
                io.bind_ortvalue_input(k, v)
            elif replay:
                io.bind_ortvalue_input(k, device_value(fixed, k, v))
            else:
                io.bind_cpu_input(k, np.ascontiguousarray(v))
        for n in names:
            if n in targets:
                io.bind_ortvalue_output(n, targets[n])
            elif n in fixed:
                io.bind_ortvalue_output(n, fixed[n])
            else:
                io.bind_output(n, device if n in keep or replay else "cpu")
        session.run_with_iobinding(io, options)
        outs = io.get_outputs()
        if replay:  # the next replay writes the same output buffers: what this step returns is a copy
            fixed.update((n, o) for n, o in zip(names, outs) if n not in keep)
            return {n: (o if n in keep else np.array(o.numpy(), copy=True)) for n, o in zip(names, outs)}
        return {n: (o if n in keep else o.numpy()) for n, o in zip(names, outs)}

    return step
