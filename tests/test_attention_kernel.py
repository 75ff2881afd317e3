"""The interpreter's row-blocked attention kernel: where it engages, and that it changes no number."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_sdpa

import graphc
from graphc import AttentionConfig, optimize
from graphc.optimizer import REFERENCE_TARGET, lower
from lowering import NUMPY_TARGET, NumpyInterpreter, random_inputs, run
from lowering.kernels.attention_kernel import blocked_attention
from graphc import Visibility
from graphc.attention_op import Attention

CFG = AttentionConfig(48, 6, 2, bias=True)
F64 = dict(rtol=1e-11, atol=1e-13)

GRAPHS = {
    "core": (lambda: graphc.sdpa_graph(CFG, dtype="float64"), dict(batch=2, seq=7)),
    "core-mha": (lambda: graphc.sdpa_graph(CFG.with_(n_kv_heads=6), dtype="float64"), dict(batch=1, seq=5)),
    "layer": (lambda: graphc.attention_layer_graph(CFG, seed=0, dtype="float64"), dict(batch=2, seq=6)),
    "cross": (lambda: graphc.cross_attention_graph(CFG, seed=0, dtype="float64"), dict(batch=1, q_len=3, kv_len=8)),
    "decode": (lambda: graphc.kv_cache_graph(CFG, seed=0, dtype="float64"), dict(batch=2, seq=1, past_seq=9)),
    "chunk": (lambda: graphc.kv_cache_graph(CFG.with_(n_kv_heads=1), seed=0, dtype="float64"), dict(batch=1, seq=4, past_seq=3)),
}


@pytest.mark.parametrize("optimized", [False, True])
@pytest.mark.parametrize("kind", GRAPHS)
def test_kernel_engages_and_matches_the_reference_interpreter(kind, optimized):
    build, sizes = GRAPHS[kind]
    g = build()
    if optimized:
        g = optimize(g).graph
    lowered = lower(g, NUMPY_TARGET, sizes)
    assert lowered.op_counts().get("Attention") == 1 and "Softmax" not in lowered.op_counts()
    reference = lower(g, REFERENCE_TARGET)
    assert "Attention" not in reference.op_counts()
    feeds = random_inputs(g, seed=3, **sizes)
    want = NumpyInterpreter(reference, reference=True).run(feeds)
    for name, arr in NumpyInterpreter(lowered).run(feeds).items():
        np.testing.assert_allclose(arr, want[name], **F64, err_msg=name)


def test_kernel_declines_user_masks_and_shared_values():
    masked = lower(graphc.sdpa_graph(CFG, mask=True), NUMPY_TARGET)
    assert "Attention" not in masked.op_counts()  # decomposed: the blocked kernel takes no user mask
    g = graphc.sdpa_graph(CFG)
    g.output("probs_BHST")  # the probabilities are wanted too: they must be materialised
    assert "Attention" not in lower(g, NUMPY_TARGET).op_counts()
    out = run(g, random_inputs(g, batch=1, seq=3))
    np.testing.assert_allclose(out["probs_BHST"].sum(-1), 1.0, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    groups=st.integers(1, 5),
    sq=st.integers(1, 70),
    extra=st.integers(-3, 40),
    causal=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 999),
)
def test_blocked_kernel_equals_reference(batch, kv_heads, groups, sq, extra, causal, threads, seed):
    """Row blocks (prefill) and batch x KV-head slices (decode, few row blocks) give the reference's numbers, heads in consecutive groups."""
    t_len = max(1, sq + extra)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, kv_heads, groups, sq, 4))
    k = rng.standard_normal((batch, kv_heads, t_len, 4))
    v = rng.standard_normal((batch, kv_heads, t_len, 3))
    offset = t_len - sq if causal else None  # bottom-right; negative when there are fewer keys than queries
    vis = Visibility() if offset is None else Visibility.causal(offset)
    got = blocked_attention(q.reshape(batch, kv_heads, groups * sq, 4), k, v, sq, vis, 0.5, threads)
    want = ref_sdpa(q.reshape(batch, kv_heads * groups, sq, 4), k, v, causal=causal, offset=offset, scale=0.5)
    np.testing.assert_allclose(got.reshape(batch, kv_heads * groups, sq, 3), want, rtol=1e-12, atol=1e-13)


KEY_MASKS = {
    "all kept": lambda t: np.ones((3, t), bool),
    "left padding": lambda t: np.arange(t)[None, :] >= np.array([[0], [2], [5]]),
    "right padding": lambda t: np.arange(t)[None, :] < np.array([[t], [t - 1], [3]]),
    "a row with no key": lambda t: np.arange(t)[None, :] >= np.array([[0], [t], [1]]),
    "holes": lambda t: (np.arange(t)[None, :] % 3 != 1) | (np.arange(3)[:, None] == 0),
}


@pytest.mark.parametrize("kind", KEY_MASKS)
@pytest.mark.parametrize("sq, past, window, softcap", [(1, 9, None, None), (6, 0, None, None), (4, 5, 3, None), (2, 7, None, 2.0)])
def test_padding_masks_run_in_the_kernel_and_match_the_reference(kind, sq, past, window, softcap):
    """A bool key mask [B, 1, 1, T] stays one Attention for NumPy: each row's run of kept keys, the causal offset shifted; holes
    take the reference semantics.  Left-padded prompts put whole query rows out of sight (zeros)."""
    from lowering.kernels.attention_kernel import attention_kernel, key_runs

    rng = np.random.default_rng(7)
    b, hq, hkv, d, t = 3, 4, 2, 8, past + sq
    q = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((b, hkv, sq, d)).astype(np.float32) for _ in range(2))
    past_k, past_v = (rng.standard_normal((b, hkv, past, d)).astype(np.float32) for _ in range(2))
    mask = KEY_MASKS[kind](t)[:, None, None, :]
    op = Attention(d**-0.5, Visibility.causal("past", window, mask="bool"), kv_cache=True, softcap=softcap)
    out, k, v = attention_kernel(op, [q, k_new, v_new, mask, past_k, past_v], {"past": past}, threads=2)
    np.testing.assert_array_equal(k, np.concatenate([past_k, k_new], axis=2))
    want = ref_sdpa(q, k, v, causal=True, offset=past, mask=mask, window=window, softcap=softcap)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    assert (key_runs(mask, b, t) is None) == (kind == "holes")


def test_the_numpy_target_keeps_padding_masks_and_decomposes_the_others():
    cfg = AttentionConfig(32, 4, 2)
    keyed = graphc.kv_cache_graph(cfg, seed=0, mask="bool", mask_per_query=False)
    per_query = graphc.kv_cache_graph(cfg, seed=0, mask="bool")
    additive = graphc.kv_cache_graph(cfg, seed=0, mask="additive", mask_per_query=False)
    assert lower(optimize(keyed).graph, NUMPY_TARGET).op_counts().get("Attention") == 1
    assert "Attention" not in lower(optimize(per_query).graph, NUMPY_TARGET).op_counts()
    assert "Attention" not in lower(optimize(additive).graph, NUMPY_TARGET).op_counts()


@pytest.mark.parametrize("threads", [2, 3])
def test_run_blocks_runs_every_block_once_and_raises_a_blocks_error(threads):
    """The caller works beside the pool: every start exactly once; an error in any block (caller's or pool's) is raised after all stop."""
    import threading

    from lowering.kernels.softmax import run_blocks

    seen: list[tuple[int, str]] = []
    run_blocks(lambda i: seen.append((i, threading.current_thread().name)), list(range(50)), threads)
    assert sorted(i for i, _ in seen) == list(range(50))
    for bad in (0, 49):

        def block(i: int, bad: int = bad) -> None:
            if i == bad:
                raise ValueError(f"block {i}")

        with pytest.raises(ValueError, match=f"block {bad}"):
            run_blocks(block, list(range(50)), threads)


def test_run_blocks_called_from_a_block_runs_the_inner_blocks_on_that_thread():
    """A block that itself asks for helpers (the crew is busy with the outer call) gets its blocks run inline, not a deadlock."""
    from lowering.kernels.softmax import run_blocks

    inner: list[int] = []

    def outer(i: int) -> None:
        run_blocks(lambda j: inner.append(i * 10 + j), [0, 1, 2], 2)

    run_blocks(outer, [0, 1, 2, 3], 2)
    assert sorted(inner) == sorted(i * 10 + j for i in range(4) for j in range(3))


def test_run_blocks_from_several_threads_at_once():
    """Callers on several threads share one crew: one is served by it, the others run their blocks themselves; every block runs once."""
    import threading

    from lowering.kernels.softmax import run_blocks

    done: list[tuple[int, int]] = []
    lock = threading.Lock()

    def caller(c: int) -> None:
        for _ in range(20):
            seen: list[int] = []
            run_blocks(lambda i: seen.append(i), list(range(8)), 2)
            with lock:
                done.append((c, sorted(seen) == list(range(8))))

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(done) == 80 and all(each_block_once for _, each_block_once in done)


@pytest.mark.parametrize("compiled_spin", [False, True])
def test_crew_runs_work_on_every_thread_and_raises_a_helpers_error(compiled_spin):
    """Without the compiled busy wait helpers sleep between calls; with it they spin first: the same results either way."""
    import threading

    from lowering.kernels import compiled
    from lowering.kernels.crew import Crew

    if compiled_spin and not compiled.use_compiled():
        pytest.skip(f"compiled kernels off: {compiled.compiled_reason()}")
    team = Crew(2, compiled.spin_until() if compiled_spin else None)
    for _ in range(30):
        names: list[str] = []
        assert team.run(lambda: names.append(threading.current_thread().name))
        assert len(names) == 3 and len(set(names)) == 3

    def fail_on_helpers() -> None:
        if threading.current_thread().name.startswith("graphc-crew"):
            raise RuntimeError("helper failed")

    with pytest.raises(RuntimeError, match="helper failed"):
        team.run(fail_on_helpers)
    assert team.run(lambda: None)  # still serves after an error
