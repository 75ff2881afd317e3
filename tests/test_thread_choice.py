"""A decode step's thread count follows the machine's load: the count asked for while it is faster, one while another
process makes it slower, and never more than asked (lowering.kernels.thread_choice); the NumPy backend's few-row runs
use it and give the same numbers on either count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphc
from lowering import prepare
from lowering.kernels import thread_choice
from lowering.kernels.thread_choice import EXPLORE_EVERY, EXPLORE_MOST, ThreadChoice

pytestmark = pytest.mark.core


class _Machine:
    """A clock whose runs take ``cost[threads]`` seconds: the cost table stands for the load of the moment."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.picks = dict(cost), 0.0, []

    def clock(self) -> float:
        return self.now

    def run(self, threads: int) -> int:
        self.picks.append(threads)
        self.now += self.cost[threads]
        return threads


def _steps(choice: ThreadChoice, machine: _Machine, n: int) -> list[int]:
    start = len(machine.picks)
    for _ in range(n):
        choice.timed("decode", machine.run)
    return machine.picks[start:]


def test_a_quiet_machine_keeps_the_count_asked_for_and_rarely_tries_one():
    machine = _Machine({2: 1.0, 1: 2.0})
    choice = ThreadChoice(2, clock=machine.clock)
    picks = _steps(choice, machine, 600)
    assert picks[:3] == [2, 2, 1]  # the kind's warm-up, then each count timed once, the asked one first
    assert choice.chosen("decode") == 2
    assert picks[3:].count(1) <= 1 + 600 // EXPLORE_MOST + 3  # the gap between tries doubles up to EXPLORE_MOST


def test_a_load_that_starts_moves_to_one_thread_within_a_few_runs_and_back_when_it_stops():
    machine = _Machine({2: 1.0, 1: 2.0})
    choice = ThreadChoice(2, clock=machine.clock)
    _steps(choice, machine, 200)
    machine.cost = {2: 3.2, 1: 2.1}  # a second process busy on one core: the even split waits on the shared core
    loaded = _steps(choice, machine, 200)
    first_one = loaded.index(1)
    assert first_one <= 3 and choice.chosen("decode") == 1
    assert loaded[first_one:].count(2) <= 1 + 200 // EXPLORE_EVERY  # the other count only as a try
    machine.cost = {2: 1.0, 1: 2.0}  # the load stops
    quiet = _steps(choice, machine, 2 * EXPLORE_MOST)
    back = next(i for i in range(len(quiet) - 3) if quiet[i : i + 3] == [2, 2, 2])
    assert back <= EXPLORE_MOST + 2 and choice.chosen("decode") == 2


def test_one_thread_asked_for_is_always_one():
    machine = _Machine({1: 1.0})
    assert set(_steps(ThreadChoice(1, clock=machine.clock), machine, 50)) == {1}


@settings(max_examples=30, deadline=None)
@given(threads=st.integers(1, 8), costs=st.lists(st.tuples(st.floats(0.01, 10), st.floats(0.01, 10)), min_size=1, max_size=60))
def test_the_pick_is_always_a_candidate_and_never_above_the_count_asked_for(threads, costs):
    machine = _Machine({})
    choice = ThreadChoice(threads, clock=machine.clock)
    for many, one in costs:
        machine.cost = {threads: many, 1: one}
        for kind in ("decode", "batch of 4"):
            picked = choice.timed(kind, machine.run)
            assert picked in (threads, 1)


def _decode_graph() -> tuple[graphc.Graph, dict[str, np.ndarray]]:
    g = graphc.attention_layer_graph(graphc.gqa(256, 8, 2), seed=0)
    x = np.random.default_rng(3).standard_normal((1, 1, 256)).astype(np.float32)
    return g, {"x_BSM": x}


def test_few_row_runs_on_either_count_equal_the_reference(monkeypatch):
    """Both counts run (the choice's warm-up tries each), and every run equals the float64 reference."""
    g, feeds = _decode_graph()
    want = prepare(g, "numpy", compute_dtype="float64", reference=True).run(feeds)["out_BSM"]
    runner = prepare(g, "numpy", threads=2)
    seen: list[int] = []
    original = ThreadChoice.pick

    def spy(self: ThreadChoice, key: object) -> int:
        seen.append(original(self, key))
        return seen[-1]

    monkeypatch.setattr(ThreadChoice, "pick", spy)
    for _ in range(6):
        np.testing.assert_allclose(runner.run(feeds)["out_BSM"], want, rtol=1e-4, atol=1e-4)
    assert set(seen) == {1, 2}


def test_the_choice_is_off_with_the_variable(monkeypatch):
    monkeypatch.setenv("GRAPHC_ADAPTIVE_THREADS", "0")
    assert not thread_choice.adaptive_threads_enabled()
    g, feeds = _decode_graph()
    runner = prepare(g, "numpy", threads=2)
    monkeypatch.setattr(ThreadChoice, "pick", lambda self, key: pytest.fail("the choice was consulted"))
    for _ in range(4):
        runner.run(feeds)


def test_keyed_blocks_on_either_count_do_every_block_once():
    """``run_blocks`` with a key runs on the count the shared choice picks; every block runs once on either."""
    from lowering.kernels.softmax import run_blocks

    key = ("test blocks", 37)
    for _ in range(EXPLORE_EVERY + 4):
        done: list[int] = []
        run_blocks(done.append, list(range(37)), 2, key=key)
        assert sorted(done) == list(range(37))
    assert thread_choice.shared_choice(2).chosen(key) in (1, 2)


def test_a_product_cut_into_blocks_or_run_whole_equals_numpys():
    """The blocked products' choice (blocks on 2 threads, or the product whole on one) never changes the numbers."""
    from lowering.kernels import contraction
    from lowering.kernels.contraction import contract

    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.standard_normal((1100, 300)).astype(np.float32)
    want = np.einsum("mk,nk->mn", a.astype(np.float64), b.astype(np.float64))
    saved = contraction.BLOCKED_MIN_FLOPS
    contraction.BLOCKED_MIN_FLOPS = 1
    try:
        for _ in range(EXPLORE_EVERY + 4):  # the warm-up, each count's try, then the faster one
            np.testing.assert_allclose(contract("mk,nk->mn", a, b, threads=2), want, rtol=1e-4, atol=1e-4)
    finally:
        contraction.BLOCKED_MIN_FLOPS = saved
    assert thread_choice.shared_choice(2).chosen(("matmul", (64, 300), (300, 1100), "<f4", "<f4")) in (1, 2)


def test_a_choice_remembers_a_bounded_number_of_kinds():
    machine = _Machine({2: 1.0, 1: 2.0})
    choice = ThreadChoice(2, clock=machine.clock)
    for past in range(thread_choice.MAX_KINDS + 50):  # a decode step's attention: a new shape each token
        choice.timed(("attention", past), machine.run)
    assert len(choice._kinds) == thread_choice.MAX_KINDS
    assert ("attention", 0) not in choice._kinds and ("attention", thread_choice.MAX_KINDS + 49) in choice._kinds


def test_products_of_one_shape_in_two_dtypes_are_two_kinds():
    """A float64 reference run's products (twice the time) must not set the choice for the float32 ones of its shape."""
    from lowering.kernels import contraction
    from lowering.kernels.contraction import contract

    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((40, 256)), rng.standard_normal((1030, 256))
    saved = contraction.BLOCKED_MIN_FLOPS
    contraction.BLOCKED_MIN_FLOPS = 1
    try:
        for dtype in (np.float64, np.float32):
            contract("mk,nk->mn", a.astype(dtype), b.astype(dtype), threads=2)
    finally:
        contraction.BLOCKED_MIN_FLOPS = saved
    kinds = [key for key in thread_choice.shared_choice(2)._kinds if key[:3] == ("matmul", (40, 256), (256, 1030))]
    assert sorted(key[3] for key in kinds) == ["<f4", "<f8"]
