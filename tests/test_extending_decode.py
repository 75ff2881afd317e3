"""A backend brings its own decode cache in one file: generate knows only the KVCache protocol and Runner.step.

The toy backend here keeps every layer's keys and values in a store of its own and hands
the decode loop opaque handles (as a device-resident cache hands out device tensors);
``generate`` runs it with no change and gets the NumPy backend's tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

import graphc
from graphc.attention.hf_lm import causal_lm_config_from_hf
from lowering import BackendSpec, KVCache, LMInterface, Runner, generate, prepare, register_backend, unregister_backend

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 97, "rope_theta": 10000.0}  # fmt: skip
PROMPTS = [[5, 17, 33], [7, 1, 90, 44, 12, 60]]


class Handle(str):
    """A name for a tensor the toy backend keeps; NumPy never sees what it names."""


class ToyCache:
    """The toy backend's KVCache: handles into the backend's store, replaced by each step's present handles."""

    def __init__(self, store: dict[str, np.ndarray], lm: LMInterface, batch: int) -> None:
        self.store, self.names = store, lm.cache_names
        self.outputs = tuple(present for _, present in self.names)
        self.handles = {}
        for past, _ in self.names:
            self.handles[past] = Handle(f"empty-{past}")
            store[self.handles[past]] = np.zeros((*lm.cache_shape(past, batch)[:2], 0, lm.cache_shape(past, batch)[2]), lm.cache_dtype)
        self.closed = False

    @property
    def length(self) -> int:
        return 0 if self.closed else int(self.store[next(iter(self.handles.values()))].shape[2])

    @property
    def capacity(self) -> int:
        return self.length

    def feeds(self) -> dict[str, Any]:
        return dict(self.handles)

    def advance(self, outputs: Mapping[str, Any]) -> None:
        for past, present in self.names:
            assert isinstance(outputs[present], Handle), "the step keeps the cache's outputs on the backend"
            self.handles[past] = outputs[present]

    def close(self) -> None:
        self.closed = True
        self.store.clear()


CACHES: list[ToyCache] = []


def prepare_toy(graph: graphc.Graph) -> Runner:
    inner = prepare(graph, "numpy")
    store: dict[str, np.ndarray] = {}
    counter = itertools.count()

    def step(inputs: Mapping[str, Any], keep: Sequence[str]) -> dict[str, Any]:
        arrays = {k: store[v] if isinstance(v, Handle) else v for k, v in inputs.items()}
        outs = inner.run(arrays)
        for name in keep:
            handle = Handle(f"{name}#{next(counter)}")
            store[handle] = np.array(outs[name])
            outs[name] = handle
        return outs

    def new_cache(lm: LMInterface, batch: int, capacity: int) -> KVCache:
        CACHES.append(ToyCache(store, lm, batch))
        return CACHES[-1]

    return Runner("toy", "a toy backend with its own KV store", graph, inner.run, caches=new_cache, stepper=step)


@pytest.fixture()
def toy_backend():
    register_backend(BackendSpec("toy", "toy backend (test)", lambda: None, prepare_toy))
    yield
    unregister_backend("toy")
    CACHES.clear()


def test_a_backend_with_its_own_cache_generates_the_numpy_backends_tokens(toy_backend):
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0)
    want = generate(g, PROMPTS, 7, backend="numpy", keep_logits=True)
    got = generate(g, PROMPTS, 7, backend="toy", keep_logits=True)
    np.testing.assert_array_equal(got.new_tokens, want.new_tokens)
    np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), rtol=1e-5, atol=1e-5)
    assert got.backend == "toy" and got.provider == "a toy backend with its own KV store"
    (cache,) = CACHES
    assert isinstance(cache, KVCache) and cache.closed  # the loop closes the cache it asked for


def test_the_cache_is_closed_when_a_step_fails(toy_backend):
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0)
    runner = prepare(g, "toy")
    calls = itertools.count()
    real = runner.stepper

    def failing(inputs: Mapping[str, Any], keep: Sequence[str]) -> dict[str, Any]:
        if next(calls) == 2:
            raise RuntimeError("device lost")
        return real(inputs, keep)  # type: ignore[misc]

    runner.stepper = failing
    with pytest.raises(graphc.errors.ExecutionError, match="backend 'toy' failed .* RuntimeError: device lost"):
        generate(g, PROMPTS, 5, runner=runner)
    assert CACHES[-1].closed


def test_every_builtin_backend_makes_a_cache_that_meets_the_protocol():
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0)
    from lowering.generate import lm_interface
    from conftest import installed

    lm = lm_interface(g)
    for backend in installed("numpy", "ort-cpu", "torch", "onnx-reference"):
        cache = prepare(g, backend).new_cache(lm, 2, 16)
        assert isinstance(cache, KVCache) and cache.length == 0, backend
        assert cache.capacity >= (16 if backend == "numpy" else 0), backend
        assert sorted(cache.feeds()) == sorted(past for past, _ in lm.cache_names)
        if backend == "ort-cpu":  # onnxruntime's own tensors, never NumPy arrays between steps
            import onnxruntime as ort

            assert all(isinstance(v, ort.OrtValue) for v in cache.feeds().values())
        cache.close()


def test_decode_options_come_from_each_backends_spec():
    """A decode loop asks the registry how to prepare each backend; no caller names backends."""
    from lowering.backends.registry import decode_options

    sizes = {"batch": 1, "seq": 1, "past_seq": 64}
    assert decode_options("numpy", sizes, threads=2) == {"threads": 2}
    assert decode_options("ort-cpu", sizes) == {"attention": "auto", "sizes": sizes}
    register_backend(BackendSpec("toy-sized", "toy", lambda: None, lambda graph, sizes=None: None, decode=(("flag", 1),), decode_sizes=True))
    try:
        assert decode_options("toy-sized", sizes, threads=3) == {"flag": 1, "sizes": sizes}  # it takes no threads
    finally:
        unregister_backend("toy-sized")
