"""Random valid graphs for differential fuzzing, and the differential check itself.

:func:`einsum_dags` draws DAGs of every op kind graphc has (einsums of one to
three operands with batch, contracted, free and one-sided summed labels;
broadcasting binaries; unary functions; softmax on any axis; reshapes that
split and merge; transposes; scales; causal masks with any offset; additive and
boolean masks; Concat and Repeat; constants, including constant-only subgraphs
that the optimizer folds; rank-0 values; size-1 and size-0 dims).
:func:`attention_graphs` draws attention graphs from the builders with every
feature they have.  :func:`check_differential` runs a graph on the float64
NumPy oracle and on every backend under test and raises ``AssertionError``
describing the first disagreement or crash.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from graphc import Graph
from graphc.attention import AttentionConfig, attention_layer_graph, kv_cache_graph, sdpa_graph
from graphc.errors import BackendError
from graphc.optimizer import optimize
from lowering import prepare

__all__ = ["einsum_dags", "einsum_chains", "int_graphs", "attention_graphs", "Case", "check_differential", "BACKENDS_UNDER_TEST"]

BACKENDS_UNDER_TEST = ("numpy", "numpy-optimized", "onnx-reference", "ort-cpu")
_LABELS = string.ascii_letters


@dataclass
class Case:
    """A graph, its feeds, and the symbol sizes of the run."""

    graph: Graph
    feeds: dict[str, np.ndarray]
    sizes: dict[str, int]

    def __repr__(self) -> str:  # hypothesis prints this for a failing example
        shapes = {k: list(v.shape) for k, v in self.feeds.items()}
        return f"Case(sizes={self.sizes}, feeds={shapes})\n{self.graph}"


class _Dag:
    """The graph under construction and its values with concrete shapes."""

    def __init__(self, draw: st.DrawFn, rng: np.random.Generator) -> None:
        self.draw = draw
        self.rng = rng
        self.g = Graph("fuzz")
        self.values: list[tuple[str, tuple[int, ...]]] = []
        self.const_values: list[tuple[str, tuple[int, ...]]] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.n = 0
        self.produced: list[str] = []

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def size(self) -> int:
        return self.draw(st.sampled_from([1, 2, 3, 4, 5, 2, 3, 0]))

    def shape(self, rank: int | None = None) -> tuple[int, ...]:
        rank = self.draw(st.integers(0, 3)) if rank is None else rank
        return tuple(self.size() for _ in range(rank))

    def add(self, value: object, shape: tuple[int, ...], constant: bool = False) -> str:
        name = value if isinstance(value, str) else value.name  # type: ignore[attr-defined]
        if self.g.producer(name) is not None:
            self.produced.append(name)
        (self.const_values if constant else self.values).append((name, shape))
        return name

    def new_input(self, shape: tuple[int, ...]) -> str:
        name = self.name("x")
        self.g.input(name, list(shape))
        self.feeds[name] = self.rng.standard_normal(shape).astype(np.float32)
        return self.add(name, shape)

    def new_constant(self, shape: tuple[int, ...]) -> str:
        name = self.name("w")
        self.g.constant(name, self.rng.standard_normal(shape).astype(np.float32))
        return self.add(name, shape, constant=True)

    def pick(self, min_rank: int = 0) -> tuple[str, tuple[int, ...]]:
        """A value (input, constant or node output) of rank >= ``min_rank``; a new input if there is none."""
        pool = [(n, s) for n, s in self.values + self.const_values if len(s) >= min_rank]
        if not pool:
            name = self.new_input(self.shape(min_rank))
            return name, self.values[-1][1]
        return self.draw(st.sampled_from(pool))


def _einsum_step(d: _Dag) -> None:
    arity = d.draw(st.integers(1, 3))
    operands = [d.pick() for _ in range(arity)]
    sizes: dict[str, int] = {}
    terms = []
    fresh = iter(_LABELS)
    for _, shape in operands:
        term = ""
        for n in shape:
            shared = [ch for ch, s in sizes.items() if s == n and ch not in term]
            if shared and d.draw(st.booleans()):
                ch = d.draw(st.sampled_from(shared))
            else:
                ch = next(fresh)
                sizes[ch] = n
            term += ch
        terms.append(term)
    labels = sorted(set("".join(terms)))
    out = d.draw(st.permutations(labels)) if labels else []
    keep = d.draw(st.integers(0, len(labels)))
    out_term = "".join(out[:keep])
    spec = ",".join(terms) + "->" + out_term
    v = d.g.einsum(spec, *[n for n, _ in operands], name=d.name("e"))
    d.add(v, tuple(sizes[ch] for ch in out_term))


def _broadcast_partner(d: _Dag, shape: tuple[int, ...]) -> tuple[int, ...]:
    keep = d.draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - keep :]
    return tuple(1 if d.draw(st.booleans()) and n != 0 else n for n in tail) if tail else ()


def _binary_step(d: _Dag) -> None:
    name, shape = d.pick()
    fn = d.draw(st.sampled_from(["add", "sub", "mul", "max", "div"]))
    other_shape = _broadcast_partner(d, shape)
    match = [n for n, s in d.values + d.const_values if s == other_shape and n != name]
    if match and d.draw(st.booleans()):
        other = d.draw(st.sampled_from(match))
    elif d.draw(st.booleans()):
        other = d.new_constant(other_shape)
    else:
        other = d.new_input(other_shape)
    if fn == "div":  # a divisor bounded away from zero
        other = d.g.add(d.g.sigmoid(other, name=d.name("s")), d.g.constant(d.name("one"), np.ones((), np.float32)), name=d.name("den")).name
    a, b = (name, other) if fn == "div" or d.draw(st.booleans()) else (other, name)  # a divisor stays bounded away from 0
    v = d.g.binary(fn, a, b, name=d.name(fn))
    d.add(v, tuple(np.broadcast_shapes(shape, other_shape)))


def _unary_step(d: _Dag) -> None:
    name, shape = d.pick()
    fn = d.draw(st.sampled_from(["neg", "tanh", "relu", "sigmoid", "exp", "sqrt", "reciprocal"]))
    if fn == "exp":  # bounded arguments keep float32 and float64 comparable
        name = d.g.tanh(name, name=d.name("t")).name
    elif fn in ("sqrt", "reciprocal"):
        name = d.g.add(d.g.sigmoid(name, name=d.name("s")), d.g.constant(d.name("half"), np.full((), 0.5, np.float32)), name=d.name("pos")).name
    d.add(d.g.unary(fn, name, name=d.name(fn)), shape)


def _softmax_step(d: _Dag) -> None:
    name, shape = d.pick(1)
    axis = d.draw(st.integers(-len(shape), len(shape) - 1))
    d.add(d.g.softmax(name, axis=axis, name=d.name("sm")), shape)


def _masked_softmax_step(d: _Dag) -> None:
    """A mask (causal with any offset, additive constant with -inf, or boolean) and a last-axis softmax."""
    name, shape = d.pick(2)
    kind = d.draw(st.sampled_from(["causal", "additive", "bool"]))
    if kind == "causal":
        masked = d.g.causal_mask(name, offset=d.draw(st.integers(-3, 2)), name=d.name("cm"))
    elif kind == "additive":
        bias = np.where(d.rng.random(shape[-2:]) < 0.3, -np.inf, 0.0).astype(np.float32)
        if bias.size and d.draw(st.booleans()):
            bias[0] = -np.inf  # a fully masked row
        masked = d.g.add(name, d.g.constant(d.name("bias"), bias), name=d.name("am"))
    else:
        keep = d.rng.random(shape[-2:]) < 0.7
        if keep.size and d.draw(st.booleans()):
            keep[-1] = False
        ninf = d.g.constant(d.name("ninf"), np.full((), -np.inf, np.float32))
        masked = d.g.where(d.g.constant(d.name("keep"), keep), name, ninf, name=d.name("wm"))
    d.add(d.g.softmax(masked, axis=-1, name=d.name("sm")), shape)


def _reshape_step(d: _Dag) -> None:
    name, shape = d.pick()
    total = int(np.prod(shape)) if shape else 1
    if len(shape) >= 2 and d.draw(st.booleans()):  # merge two adjacent axes
        i = d.draw(st.integers(0, len(shape) - 2))
        new = shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2 :]
    elif total > 0 and d.draw(st.booleans()):  # split an axis
        divisors = [(i, f) for i, n in enumerate(shape) for f in range(1, n + 1) if n % f == 0]
        if not divisors:
            new = (1, total)
        else:
            i, f = d.draw(st.sampled_from(divisors))
            new = shape[:i] + (f, shape[i] // f) + shape[i + 1 :]
    else:
        new = (total,) if d.draw(st.booleans()) or total == 0 else ()
        if new == () and total != 1:
            new = (total,)
    d.add(d.g.reshape(name, list(new), name=d.name("r")), new)


def _transpose_step(d: _Dag) -> None:
    name, shape = d.pick()
    perm = tuple(d.draw(st.permutations(range(len(shape)))))
    d.add(d.g.transpose(name, perm, name=d.name("tr")), tuple(shape[p] for p in perm))


def _scale_step(d: _Dag) -> None:
    name, shape = d.pick()
    factor = d.draw(st.sampled_from([0.125, 0.5, 2.0, -1.0, 0.0883883476]))
    d.add(d.g.scale(name, factor, name=d.name("sc")), shape)


def _concat_repeat_step(d: _Dag) -> None:
    name, shape = d.pick(1)
    axis = d.draw(st.integers(0, len(shape) - 1))
    if d.draw(st.booleans()):
        others = [
            n for n, s in d.values + d.const_values if len(s) == len(shape) and all(a == b for i, (a, b) in enumerate(zip(s, shape)) if i != axis)
        ]
        other, other_shape = d.draw(st.sampled_from(others)), None
        other_shape = dict(d.values + d.const_values)[other]
        v = d.g.concat([name, other], axis=axis, name=d.name("cat"))
        d.add(v, shape[:axis] + (shape[axis] + other_shape[axis],) + shape[axis + 1 :])
    else:
        reps = d.draw(st.integers(1, 3))
        d.add(d.g.repeat(name, reps, axis=axis, name=d.name("rep")), shape[:axis] + (shape[axis] * reps,) + shape[axis + 1 :])


_STEPS = (
    _einsum_step,
    _einsum_step,
    _binary_step,
    _unary_step,
    _softmax_step,
    _masked_softmax_step,
    _reshape_step,
    _transpose_step,
    _scale_step,
    _concat_repeat_step,
)


@st.composite
def einsum_dags(draw: st.DrawFn, max_steps: int = 6, steps: tuple = _STEPS) -> Case:
    """A random valid float32 graph of static shapes, with random feeds (see the module doc)."""
    d = _Dag(draw, np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    for _ in range(draw(st.integers(1, 3))):
        d.new_input(d.shape())
    for _ in range(draw(st.integers(0, 2))):
        d.new_constant(d.shape())
    for _ in range(draw(st.integers(1, max_steps))):
        draw(st.sampled_from(steps))(d)
    outs = draw(st.lists(st.sampled_from(d.produced), min_size=1, max_size=3, unique=True))
    for o in outs:
        d.g.output(o)
    d.g.verify()
    return Case(d.g, d.feeds, {})


def einsum_chains() -> st.SearchStrategy[Case]:
    """DAGs of einsums only (what ``plan_contractions`` merges and splits)."""
    return einsum_dags(max_steps=5, steps=(_einsum_step,))


@st.composite
def int_graphs(draw: st.DrawFn) -> Case:
    """Integer elementwise graphs (add, sub, mul, div, max, neg) on int32 or int64, divisors of both signs and zero."""
    dtype = draw(st.sampled_from(["int32", "int64"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    g = Graph("fuzz_int")
    a, b = g.input("a", list(shape), dtype), g.input("b", list(shape[1:]), dtype)
    feeds = {"a": rng.integers(-50, 50, shape).astype(dtype), "b": rng.integers(-9, 9, shape[1:]).astype(dtype)}
    x = a
    for i in range(draw(st.integers(1, 4))):
        fn = draw(st.sampled_from(["add", "sub", "mul", "div", "max", "neg"]))
        if fn == "neg":
            x = g.neg(x, name=f"n{i}")
        elif fn == "div":
            x = g.div(x, b, name=f"d{i}")
        else:
            x = g.binary(fn, x, b, name=f"{fn}{i}")
    g.output(x)
    return Case(g, feeds, {})


@st.composite
def attention_graphs(draw: st.DrawFn) -> Case:
    """Attention graphs from the builders: MHA/GQA/MQA, bias, causal or not, sliding window, softcap, core or layer, decode over a cache of any
    length."""
    n_kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 2, 4, 8]))
    heads = n_kv * group
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 5))) if causal else None
    softcap = draw(st.one_of(st.none(), st.sampled_from([0.5, 3.0])))
    cfg = AttentionConfig(
        heads * head_dim,
        heads,
        n_kv,
        head_dim=head_dim,
        bias=draw(st.booleans()),
        causal=causal,
        sliding_window=window,
        softcap=softcap,
        alibi=draw(st.booleans()),
    )
    seed = draw(st.integers(0, 1000))
    kind = draw(st.sampled_from(["core", "layer", "decode", "core_cache"]))
    batch, seq, past = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(0, 6))
    if kind == "core":
        g, sizes = sdpa_graph(cfg), {"batch": batch, "seq": seq}
    elif kind == "layer":
        g, sizes = attention_layer_graph(cfg, seed=seed), {"batch": batch, "seq": seq}
    elif kind == "decode":
        g, sizes = kv_cache_graph(cfg, seed=seed), {"batch": batch, "seq": seq, "past_seq": past}
    else:
        g, sizes = sdpa_graph(cfg, q_len="seq", kv_len="past_seq+seq"), {"batch": batch, "seq": seq, "past_seq": past}
    from lowering import random_inputs

    return Case(g, random_inputs(g, seed=seed, **sizes), sizes)


def _close(name: str, got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> str | None:
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"output {name!r}: shape {list(got.shape)}, oracle {list(want.shape)}"
    if want.dtype.kind in "iub":
        bad = got != want
        return f"output {name!r}: {int(bad.sum())} of {want.size} integers differ" if bad.any() else None
    got = got.astype(np.float64)
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    if (nan_got != nan_want).any():
        return f"output {name!r}: NaN at {int(nan_got.sum())} entries, the oracle at {int(nan_want.sum())}"
    finite = np.isfinite(want)
    if (np.isinf(got) != np.isinf(want)).any() or (got[~finite & ~nan_want] != want[~finite & ~nan_want]).any():
        return f"output {name!r}: infinities differ from the oracle's"
    scale = float(np.abs(want[finite]).max()) if finite.any() else 0.0
    err = np.abs(got[finite] - want[finite])
    if err.size and float(err.max()) > atol + rtol * scale:
        return f"output {name!r}: max abs error {float(err.max()):.3g} > {atol:g} + {rtol:g} * {scale:.3g}"
    return None


def check_differential(case: Case, backends: tuple[str, ...] = BACKENDS_UNDER_TEST, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """Run ``case`` on the float64 oracle and on ``backends``; raise AssertionError on a mismatch or a crash.

    ``numpy`` runs the unoptimized graph, ``numpy-optimized`` the optimized one;
    ONNX backends run the optimized graph, onnxruntime in its worker process.
    """
    g, feeds, sizes = case.graph, case.feeds, case.sizes
    oracle = prepare(g, "numpy", compute_dtype="float64", reference=True, sizes=sizes).run(feeds)
    optimized = optimize(g, hints=sizes or None).graph
    optimized.verify()
    for backend in backends:
        graph, name, opts = optimized, backend, {"sizes": sizes}
        if backend == "numpy":
            graph = g
        elif backend == "numpy-optimized":
            name = "numpy"
        elif backend.startswith("ort"):
            opts["isolate"] = True
        try:
            got = prepare(graph, name, **opts).run(feeds)
        except BackendError as e:
            raise AssertionError(f"{backend} crashed: {e}") from e
        problems = [p for o in g.outputs if (p := _close(o, got[o], oracle[o], atol, rtol))]
        assert not problems, f"{backend} disagrees with the float64 oracle: {'; '.join(problems)}"
