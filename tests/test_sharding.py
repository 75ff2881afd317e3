"""Sharding by KV-head group: exact partitions, the gathers, the errors, and the Dask runner with the cache kept on the workers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from reference import ref_sdpa

import graphc
from graphc import AttentionConfig
from graphc.errors import BackendUnavailableError, InputError, ShardingError
from graphc.sharding import shard
from graphc.tensor_ops import Slice
from lowering.distributed.sharded import LocalExecutor, Resident, ShardedRunner
from lowering import NumpyInterpreter, prepare, random_inputs, run
from lowering.exporter.onnx_export import export

TOL = dict(rtol=1e-5, atol=1e-5)
GQA = AttentionConfig(64, 8, 4)
MHA = AttentionConfig(48, 6, 6)
MQA = AttentionConfig(64, 8, 1)
ROPE = graphc.preset("mistral-7b").with_(d_model=64, n_heads=8, n_kv_heads=4, head_dim=8, sliding_window=3)  # RoPE, sliding window


def _decoder(cfg: AttentionConfig, layers: int, kv_cache: bool, past_lengths: bool = False) -> graphc.Graph:
    from graphc.attention.decoder import DecoderConfig, decoder_stack_graph

    return decoder_stack_graph([DecoderConfig(cfg, intermediate_size=96)] * layers, seed=3, kv_cache=kv_cache, past_lengths=past_lengths)


GRAPHS = {
    "gqa core": (lambda: graphc.sdpa_graph(GQA), dict(batch=2, seq=5)),
    "mha core": (lambda: graphc.sdpa_graph(MHA), dict(batch=1, seq=4)),
    "gqa layer": (lambda: graphc.attention_layer_graph(GQA, seed=0), dict(batch=2, seq=5)),
    "mha layer": (lambda: graphc.attention_layer_graph(MHA, seed=0), dict(batch=1, seq=3)),
    "gqa decode": (lambda: graphc.kv_cache_graph(GQA, seed=0), dict(batch=2, seq=1, past_seq=6)),
    "mqa decode": (lambda: graphc.kv_cache_graph(MQA, seed=0), dict(batch=1, seq=2, past_seq=5)),
    "gqa stack": (lambda: graphc.attention_stack_graph(GQA, 2, seed=0), dict(batch=1, seq=4)),
    "decoder stack decode": (lambda: _decoder(GQA, 2, True), dict(batch=1, seq=1, past_seq=5)),
    "rope window decoder stack": (lambda: _decoder(ROPE, 2, True), dict(batch=2, seq=3, past_seq=5)),
    "alibi layer": (lambda: graphc.attention_layer_graph(GQA.with_(alibi=True), seed=0), dict(batch=2, seq=5)),
    "alibi decode": (lambda: graphc.kv_cache_graph(GQA.with_(alibi=True), seed=0), dict(batch=2, seq=2, past_seq=6)),
    "ragged decode": (lambda: graphc.kv_cache_graph(ROPE, seed=0, past_lengths=True), dict(batch=3, seq=1, past_seq=9)),
    "ragged decoder stack": (lambda: _decoder(ROPE, 2, True, past_lengths=True), dict(batch=2, seq=2, past_seq=9)),
}


def _reference(g: graphc.Graph, feeds: dict) -> dict:
    return NumpyInterpreter(g, reference=True).run(feeds)  # float64 where it matters, attention decomposed, no sharding


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("kind", GRAPHS)
def test_sharded_result_equals_the_single_process_result(kind, n):
    build, sizes = GRAPHS[kind]
    g = build()
    if kind.startswith("mha") and n == 4:
        n = 3  # 6 heads
    plan = shard(g, n)
    feeds = random_inputs(g, seed=1, **sizes)
    want = _reference(g, feeds)
    got = ShardedRunner(plan, LocalExecutor(n)).run(feeds)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=f"{kind} x{n}: {name}")


def test_alibi_shards_take_their_heads_slopes():
    """Each shard's ALiBi bias uses the slopes of its own query heads (a replicated slope table would give every shard head 0's)."""
    g = graphc.attention_layer_graph(GQA.with_(alibi=True), seed=0)
    plan = shard(g, 2)
    slopes = [next(a for n, a in sg.initializers.items() if "alibi_slopes" in n) for sg in plan.stages[0].graphs]
    full = graphc.attention.alibi_slopes(8)
    np.testing.assert_array_equal(np.concatenate(slopes), full)


def test_core_shards_hold_consecutive_kv_groups():
    """Shard s computes query heads s*Hq/n.. from KV heads s*Hkv/n..: checked against SDPA written out here, head by head."""
    g = graphc.sdpa_graph(GQA)
    feeds = random_inputs(g, seed=2, batch=1, seq=3)
    plan = shard(g, 2)
    q, k, v = feeds["q_BHSD"], feeds["k_BHkvTD"], feeds["v_BHkvTD"]
    for s, sg in enumerate(plan.stages[0].graphs):
        part = prepare(sg, "numpy").run({n: plan.split(n, feeds[n], s) for n in sg.inputs})["attn_BHSD"]
        want = ref_sdpa(q[:, 4 * s : 4 * s + 4], k[:, 2 * s : 2 * s + 2], v[:, 2 * s : 2 * s + 2], causal=True)
        np.testing.assert_allclose(part, want, **TOL)
        tile = ref_sdpa(q[:, 4 * s : 4 * s + 4], k[:, [s, s + 2]], v[:, [s, s + 2]], causal=True)  # h % n_kv grouping: a different answer
        assert not np.allclose(part, tile, **TOL)


def test_layer_plan_splits_projections_and_sums_the_output_projection():
    g = graphc.kv_cache_graph(GQA, seed=0)
    plan = shard(g, 2)
    assert len(plan.stages) == 1 and plan.stages[0].sharded
    s0 = plan.stages[0].graphs[0]
    assert s0.initializers["q_proj.weight"].shape == (32, 64)  # 4 of 8 query heads x head_dim 8
    assert s0.initializers["k_proj.weight"].shape == (16, 64)  # 2 of 4 KV heads
    assert s0.initializers["o_proj.weight"].shape == (64, 32)  # its columns: a partial sum
    np.testing.assert_array_equal(plan.stages[0].graphs[1].initializers["k_proj.weight"], g.initializers["k_proj.weight"][16:])
    assert plan.partial == {"out_BSM"} and plan.split_axis["past_key"] == 1 and plan.split_axis["present_value"] == 1
    text = str(plan)
    assert "stage 0 (sharded x2)" in text and "out_BSM: summed over shards" in text and "past_key: split on axis 1" in text


def test_decoder_stack_alternates_sharded_and_replicated_stages_with_the_residual_in_the_driver():
    """replicated="driver", mlp=False: attention (with its norm and RoPE positions) per shard, then residual + MLP whole."""
    plan = shard(_decoder(ROPE, 2, True), 2, mlp=False, replicated="driver")
    assert [st.sharded for st in plan.stages] == [True, False, True, False]
    mlp = plan.stages[1].graphs[0]
    assert any("mlp" in name for name in mlp.initializers) and not any("q_proj" in name for name in mlp.initializers)
    assert plan.stages[2].inputs == ("model.layers.0.out_BSM", "past_key.1", "past_value.1")
    assert plan.stages[2].outputs == ("present_key.1", "present_value.1", "model.layers.1.self_attn.out_BSM")


def test_decoder_layers_run_on_the_shards_with_the_mlp_split():
    """The default plan: every stage sharded (norms and residual adds on every shard), each layer two stages (attention, then MLP
    split Megatron-style: gate/up rows, down columns), one sum of addends between them; no MLP weight whole anywhere."""
    g = _decoder(ROPE, 2, True)
    plan = shard(g, 2)
    assert all(st.sharded for st in plan.stages) and len(plan.stages) == 5  # 2 per layer, then the last residual add
    for name in ("mlp.up_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight"):
        full = g.initializers[f"model.layers.0.{name}"]
        axis = 1 if "down" in name else 0
        parts = [next(a for n, a in st_g.initializers.items() if n.endswith(f"layers.0.{name}")) for st_g in plan.stages[1].graphs]
        np.testing.assert_array_equal(np.concatenate(parts, axis=axis), full)
        assert all(p.shape[axis] == full.shape[axis] // 2 for p in parts)
    assert "model.layers.0.out_BSM" not in plan.partial and any(v.endswith("mlp_out") or "down" in v for v in plan.partial)
    feeds = random_inputs(g, seed=2, batch=2, seq=2, past_seq=4)
    runner = ShardedRunner(plan, LocalExecutor(2))
    got = runner.run(feeds)
    want = _reference(g, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=name)
    assert runner.last.all_reduces == 4  # two per layer, summed among the shards
    caches = sum(a.nbytes for n, a in feeds.items() if n.startswith("past_"))
    assert runner.last.bytes_sent == 2 * feeds["x_BSM"].nbytes + caches  # x to each shard once, each cache split; nothing else


def test_every_shard_is_an_ordinary_graph_that_optimizes_exports_and_runs_on_onnxruntime(tmp_path):
    g = graphc.kv_cache_graph(GQA, seed=0)
    plan = shard(g, 2)
    sizes = dict(batch=1, seq=1, past_seq=4)
    feeds = random_inputs(g, seed=5, **sizes)
    for s, sg in enumerate(plan.stages[0].graphs):
        part = {n: plan.split(n, feeds[n], s) for n in sg.inputs}
        want = prepare(sg, "numpy").run(part)
        opt = graphc.optimize(sg).graph
        export(opt, tmp_path / f"shard{s}.onnx", attention="auto", sizes=sizes)
        got = prepare(opt, "ort-cpu", attention="auto", sizes=sizes).run(part)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], **TOL)


@pytest.mark.parametrize(
    "build, n, fragment",
    [
        (
            lambda: graphc.sdpa_graph(GQA),
            3,
            r"8 query / 4 KV heads\) cannot be split into 3 shards; shard counts that divide the 4 KV heads: \[2, 4\]",
        ),
        (lambda: graphc.sdpa_graph(AttentionConfig(71 * 8, 71, 1)), 2, r"splits its 71 query heads instead: shard counts \[71\]"),
        (lambda: graphc.sdpa_graph(GQA), 0, "shard count must be an int >= 1"),
    ],
)
def test_shard_counts_that_do_not_divide_are_refused(build, n, fragment):
    with pytest.raises(ShardingError, match=fragment):
        shard(build(), n)


def test_graphs_pickle_to_the_same_graph_with_aligned_read_only_weights():
    import pickle

    g = graphc.kv_cache_graph(GQA, seed=0)
    back = pickle.loads(pickle.dumps(g, protocol=5))
    back.verify()
    assert str(back) == str(g)
    for name, arr in back.initializers.items():
        assert arr.flags.aligned and arr.flags.c_contiguous and not arr.flags.writeable
        np.testing.assert_array_equal(arr, g.initializers[name])


def test_a_graph_without_attention_is_refused():
    g = graphc.Graph("mlp")
    x = g.input("x", [2, 4])
    g.output(g.einsum("ab,cb->ac", x, g.add_initializer("w", np.ones((3, 4), np.float32))))
    with pytest.raises(ShardingError, match="no attention"):
        shard(g, 2)


def test_runner_names_bad_inputs():
    g = graphc.sdpa_graph(GQA)
    runner = ShardedRunner(shard(g, 2), LocalExecutor(2))
    with pytest.raises(InputError, match="missing input"):
        runner.run({"q_BHSD": np.zeros((1, 8, 2, 16), np.float32)})
    with pytest.raises(InputError, match="resident output"):
        runner.run(random_inputs(g, batch=1, seq=2), resident=["nope"])


def test_a_sharded_plan_checks_the_graphs_assumptions():
    """An imported model's domain (``Graph.assumptions``) holds for its shards too: the driver checks it on every run."""
    g = graphc.sdpa_graph(GQA)
    g.assume("max(0,seq-4)", 0)  # as a sliding-window cache export records it
    runner = ShardedRunner(shard(g, 2), LocalExecutor(2))
    feeds = random_inputs(g, batch=1, seq=3)
    np.testing.assert_allclose(runner.run(feeds)[g.outputs[0]], NumpyInterpreter(g).run(feeds)[g.outputs[0]], rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"defined only where max\(0,seq-4\) == 0"):
        runner.run(random_inputs(g, batch=1, seq=6))


def test_run_sharded_without_dask_says_how_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_distributed(name, *a, **kw):  # type: ignore[no-untyped-def]
        if name == "distributed" or name.startswith("distributed."):
            raise ImportError("no distributed")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_distributed)
    from lowering.distributed.dask_shards import run_sharded

    with pytest.raises(BackendUnavailableError, match=r"graphc\[distributed\]"):
        run_sharded(graphc.sdpa_graph(GQA), {}, 2)


# ------------------------------------------------------------------ on Dask


@pytest.fixture(scope="module")
def client():
    pytest.importorskip("distributed")
    from lowering.distributed.dask_shards import close_cluster, local_cluster

    c = local_cluster(2)
    yield c
    close_cluster(c)


@pytest.mark.parametrize("kind", ["gqa layer", "mha layer", "mha core", "gqa stack", "mqa decode", "alibi decode", "ragged decoder stack"])
def test_dask_result_equals_the_single_process_result(client, kind):
    from lowering.distributed.dask_shards import run_sharded

    build, sizes = GRAPHS[kind]
    g = build()
    feeds = random_inputs(g, seed=4, **sizes)
    got, stats = run_sharded(g, feeds, 2, client=client)
    want = _reference(g, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=f"{kind}: {name}")
    assert len(stats.shard_s) == sum(st.sharded for st in shard(g, 2).stages) and all(len(s) == 2 for s in stats.shard_s)


@pytest.mark.parametrize("cfg", [GQA, MQA], ids=["gqa", "mqa"])
def test_decode_steps_keep_the_cache_on_the_workers(client, cfg):
    """Several decode steps: the cache is sent once, then only the new token goes out and the output comes back."""
    from lowering.distributed.dask_shards import sharded_runner

    g = graphc.kv_cache_graph(cfg, seed=0)
    runner = sharded_runner(g, 2, client=client)
    feeds = random_inputs(g, seed=6, batch=1, seq=1, past_seq=7)
    cache = {"past_key": feeds["past_key"], "past_value": feeds["past_value"]}
    local = dict(cache)
    cache_bytes = feeds["past_key"].nbytes + feeds["past_value"].nbytes
    for step in range(3):
        x = np.random.default_rng(step).standard_normal((1, 1, cfg.d_model), dtype=np.float32)
        got = runner.run({"x_BSM": x, **cache}, resident=["present_key", "present_value"])
        want = _reference(g, {"x_BSM": x, **local})
        np.testing.assert_allclose(got["out_BSM"], want["out_BSM"], **TOL, err_msg=f"step {step}")
        sent, received = runner.last.bytes_sent, runner.last.bytes_received
        if step == 0:
            assert sent >= cache_bytes  # the cache goes out once (each MQA shard gets the whole single-head cache)
        else:
            assert sent == 2 * x.nbytes, sent  # the token, to each shard; never the cache
        assert received == 2 * want["out_BSM"].nbytes  # one addend of the output per shard
        assert isinstance(got["present_key"], Resident)  # multi-query: each shard keeps its own copy of the one KV head
        np.testing.assert_allclose(got["present_key"].gather(runner), want["present_key"], **TOL)
        cache = {"past_key": got["present_key"], "past_value": got["present_value"]}
        local = {"past_key": want["present_key"].astype(np.float32), "past_value": want["present_value"].astype(np.float32)}


def test_decoder_stack_decode_over_steps_on_dask(client):
    from lowering.distributed.dask_shards import sharded_runner

    g = _decoder(GQA, 2, True)
    runner = sharded_runner(g, 2, client=client)
    feeds = random_inputs(g, seed=8, batch=1, seq=1, past_seq=4)
    caches = [n for n in g.inputs if n.startswith("past_")]
    presents = [n.replace("past_", "present_") for n in caches]
    state, local = {n: feeds[n] for n in caches}, {n: feeds[n] for n in caches}
    for step in range(2):
        x = np.random.default_rng(10 + step).standard_normal(feeds["x_BSM"].shape, dtype=np.float32)
        got = runner.run({"x_BSM": x, **state}, resident=presents)
        want = _reference(g, {"x_BSM": x, **local})
        np.testing.assert_allclose(got["out_BSM"], want["out_BSM"], **TOL)
        state = {c: got[p] for c, p in zip(caches, presents)}
        local = {c: want[p].astype(np.float32) for c, p in zip(caches, presents)}
        if step:
            assert runner.last.bytes_sent < sum(feeds[c].nbytes for c in caches)


# ------------------------------------------------------------------ command line


def test_cli_compare_adds_a_sharded_row(capsys):
    pytest.importorskip("distributed")
    from graphc.cli import main

    code = main(["compare", "--heads", "8", "--kv-heads", "4", "--head-dim", "8", "--seq", "6", "--backends", "numpy", "--shards", "2", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    row = next(line for line in out.splitlines() if line.startswith("sharded x2 (numpy)"))
    assert "PASS" in row and "dask, 2 worker processes; per call sent" in row and "shard ms" in row
    assert "all backends agree" in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--preset", "mistral-7b", "--shards", "3"], "cannot be split into 3 shards; shard counts that divide the 8 KV heads: [2, 4, 8]"),
        (["--preset", "falcon-7b", "--core", "--shards", "2"], "multi-query attention splits its 71 query heads instead"),
        (["--preset", "mistral-7b", "--shards", "0"], "--shards"),
    ],
)
def test_cli_refuses_shard_counts_in_one_line(capsys, argv, fragment):
    from graphc.cli import main

    code = main(["compare", *argv, "--seq", "4", "--backends", "numpy", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_sharded_run_checks_input_ranks_before_splitting():
    """A rank-1 past_key reached the splitter as a raw IndexError."""
    from lowering.distributed.sharded import LocalExecutor, ShardedRunner

    g = graphc.kv_cache_graph(graphc.AttentionConfig(64, 4, 2, head_dim=16), seed=0)
    runner = ShardedRunner(shard(g, 2), LocalExecutor(2))
    feeds = random_inputs(g, batch=1, seq=1, past_seq=4)
    feeds["past_key"] = np.ones(8, np.float32)
    with pytest.raises(InputError, match=r"'past_key': expected rank 4 .*got rank 1"):
        runner.run(feeds)


def _lm() -> graphc.Graph:
    from graphc.attention import causal_lm_config_from_hf

    config = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 96,
              "num_hidden_layers": 2, "vocab_size": 50, "sliding_window": 3}  # fmt: skip
    return graphc.causal_lm_graph(causal_lm_config_from_hf(config), seed=1)


@pytest.mark.parametrize("n", [2, 4])
def test_generate_sharded_gives_the_single_process_tokens(n):
    from lowering import generate

    g = _lm()
    prompts = [[1, 2, 3, 4], [5, 6]]  # left padding, a window shorter than the prompts
    want = generate(g, prompts, 8, keep_logits=True)
    runner = ShardedRunner(shard(g, n), LocalExecutor(n))
    got = generate(g, prompts, 8, runner=runner, keep_logits=True)
    np.testing.assert_array_equal(got.new_tokens, want.new_tokens)
    np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), **TOL)
    assert got.provider == f"sharded x{n}, numpy per shard"
    assert runner.last.bytes_sent < 64 * 1024  # the caches stayed on the shards: only the step's activations crossed


def test_generate_on_dask_gives_the_single_process_tokens(client):
    from lowering import generate

    g = graphc.optimize(_lm(), hints={"batch": 2, "seq": 1, "past_seq": 12}).graph
    prompts = [[1, 2, 3, 4], [5, 6]]
    want = generate(g, prompts, 6)
    for n in (2, 4):  # 4 shards on the 2 workers: shard i on worker i % 2
        got = generate(g, prompts, 6, shards=n, client=client)
        np.testing.assert_array_equal(got.new_tokens, want.new_tokens, err_msg=f"{n} shards")
    from lowering.distributed.dask_shards import sharded_runner

    with sharded_runner(g, 2, client=client) as runner:  # once placed, the driver keeps no shard weights
        assert all(st.graphs == () for st in runner.plan.stages) and all(st.sharded for st in runner.plan.stages)
        np.testing.assert_array_equal(generate(g, prompts, 6, runner=runner).new_tokens, want.new_tokens)


def test_a_tied_table_goes_to_each_worker_once_and_the_mask_stays_there(client, monkeypatch):
    """The embedding lookup (first stage) and the LM head (last stage) read one table: each worker receives it once."""
    from graphc.attention import causal_lm_config_from_hf
    from lowering import generate
    from lowering.distributed import dask_shards

    monkeypatch.setattr(dask_shards, "EMBED_BYTES", 1024)  # the tiny model's weights count as large ones
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 96,
              "num_hidden_layers": 2, "vocab_size": 50, "tie_word_embeddings": True}  # fmt: skip
    g = graphc.causal_lm_graph(causal_lm_config_from_hf(config), seed=1)
    plan = shard(g, 2)
    holders = [st for st in plan.stages if any("model.embed_tokens.weight" in sg.initializers for sg in st.graphs)]
    assert len(holders) == 2  # the table is read in two stages
    once = sum(sum(a.nbytes for a in {id(a): a for st in plan.stages for a in st.graphs[i].initializers.values()}.values()) for i in range(2))
    with dask_shards.sharded_runner(plan, client=client) as runner:
        assert runner.executor.setup_bytes == once  # type: ignore[attr-defined]
        sent: list[int] = []
        got = generate(g, [[1, 2, 3], [4, 5]], 8, runner=runner, progress=lambda step, total: sent.append(runner.last.bytes_sent))
    np.testing.assert_array_equal(got.new_tokens, generate(g, [[1, 2, 3], [4, 5]], 8).new_tokens)
    assert len(set(sent[2:])) == 1, sent


def test_cli_generate_adds_a_sharded_row(tmp_path, capsys):
    import json

    pytest.importorskip("distributed")
    from graphc.cli import main

    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 96,
              "num_hidden_layers": 2, "vocab_size": 50}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["generate", "--hf-config", str(tmp_path / "config.json"), "--prompt-ids", "1,2,3", "--prompt-ids", "4", "--max-new-tokens", "4"]
    assert main([*argv, "--backends", "numpy", "--shards", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "sharded x2" in out and "sharded x2, numpy per shard" in out and "tokens (every backend the same):" in out
    assert main([*argv, "--shards", "0", "--quiet"]) == 2
    assert "--shards must be in 1..1024" in capsys.readouterr().err


@pytest.mark.parametrize("n", [2, 4])
def test_a_decode_step_moves_what_the_design_note_predicts(n):
    """docs/sharding.md: per token 2 L all-reduces moving 2 L n (n - 1) B M b between the shards, one driver wait, and from the driver
    only the step's token ids, mask and positions."""
    from lowering import generate

    g = _lm()
    runner = ShardedRunner(shard(g, n), LocalExecutor(n))
    out = generate(g, [[1, 2, 3]], 3, runner=runner)
    layers, width = 2, 64
    last = runner.last  # the last decode step: one token over a past of 4
    assert last.all_reduces == 2 * layers and last.driver_waits == 1
    assert last.bytes_between_shards == 2 * layers * n * (n - 1) * 1 * width * 4
    step_inputs = 8 + 8 + 8  # input_ids, the attention_mask's new column (the rest is held on the shards), position_ids
    assert last.bytes_sent == n * step_inputs and last.bytes_received == 50 * 4  # logits from one shard
    assert out.sequences.shape[1] == 6


def test_the_bytes_a_decode_step_sends_do_not_grow_with_the_context():
    """The attention_mask grows by a column a token: the shards keep it and receive the new column only."""
    from lowering import generate

    g = _lm()
    runner = ShardedRunner(shard(g, 2), LocalExecutor(2))
    sent: list[int] = []
    generate(g, [[1, 2, 3], [4, 5]], 12, runner=runner, progress=lambda step, total: sent.append(runner.last.bytes_sent))
    assert len(set(sent[2:])) == 1, sent  # from the third step on, every step sends the same bytes
    assert sent[-1] == 2 * 3 * (2 * 8)  # per shard: input_ids, the mask's new column, position_ids, for 2 sequences
    feeds = {"input_ids": np.array([[7], [8]]), "attention_mask": np.array([[0, 1, 1], [1, 1, 1]]), "position_ids": np.array([[1], [2]]),
             **{n: np.zeros((2, 4, 2, 8), np.float32) + 0.5 for n in g.inputs if n.startswith("past_key_values.")}}  # fmt: skip
    again = runner.run(feeds)  # a mask that does not extend the last one: sent whole, and the numbers are the unsharded graph's
    assert runner.last.bytes_sent > sent[-1]
    np.testing.assert_allclose(again["logits"], run(g, feeds, "numpy")["logits"], **TOL)


SHARDED_EXPORTS = [("llama", "legacy", False), ("mistral", "legacy", False), ("gemma2", "dynamo", False), ("gemma2", "legacy", True)]


@pytest.mark.parametrize("family,exporter,cache", SHARDED_EXPORTS)
def test_an_imported_torch_onnx_export_shards_with_its_rotary_slices(family, exporter, cache, tmp_path):
    """torch.onnx writes RoPE's rotate-half as Slices of the head-split Q/K: the plan splits them by head like the rest,
    and the shards' result equals onnxruntime on the original file.  Gemma 2's legacy cache export flattens its mask to
    ``[batch*total_seq, 1]``: the stage that reads it gets the mask too, so ``total_seq`` has a dim of its own there."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import onnxruntime as ort
    from real_exports import export_model, feeds

    from graphc.onnx_import import from_onnx

    path = tmp_path / "m.onnx"
    export_model(family, exporter, "eager", cache, path)
    model = onnx.load(str(path))
    inputs = feeds(model, batch=2, seq=1 if cache else 7, past=5 if cache else 0, pad=0 if cache else 2)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)
    g = graphc.optimize(from_onnx(path)).graph
    got = ShardedRunner(shard(g, 2), LocalExecutor(2)).run({k: inputs[k] for k in g.inputs})
    np.testing.assert_allclose(got[g.outputs[0]], want[0], rtol=1e-4, atol=1e-4)


def test_a_fused_qkv_slice_is_refused_by_name():
    """GPT-2's and Phi-3's fused QKV projection is sliced along the head axis: no KV-head split exists, and the error says so."""
    g = graphc.Graph("fused")
    x = g.input("x", ["b", "s", 3 * 64])
    q = g.add_node(Slice(2, 0, 64), [x], "q").name
    qh = g.reshape(q, ["b", "s", 4, 16], name="q_heads")
    kh = g.reshape(g.add_node(Slice(2, 64, 128), [x], "k").name, ["b", "s", 4, 16], name="k_heads")
    vh = g.reshape(g.add_node(Slice(2, 128, 192), [x], "v").name, ["b", "s", 4, 16], name="v_heads")
    out = g.attention(g.transpose(qh, (0, 2, 1, 3)), g.transpose(kh, (0, 2, 1, 3)), g.transpose(vh, (0, 2, 1, 3)), scale=0.25)
    g.output(out)
    with pytest.raises(ShardingError, match="slices along the head axis"):
        shard(g, 2)


@pytest.mark.parametrize("replicated", ["workers", "driver"])
def test_an_opaque_node_on_a_head_split_value_runs_whole_between_the_shards(replicated):
    """An op graphc carries unmodelled (here ONNX ``Round``) has no sharding rule: it runs whole in a replicated stage, on
    its input gathered from the shards, and the attention after it takes its result split again (it used to be refused)."""
    import base64

    from onnx import helper

    from graphc.opaque import Opaque

    g = graphc.Graph("opaque_on_heads")
    q, k, v = g.input("q", [1, 8, 3, 8]), g.input("k", [1, 4, 5, 8]), g.input("v", [1, 4, 5, 8])
    scaled = g.add_node(graphc.ops.Scale(3.0), [q], "q_scaled").name  # on the shards: the opaque node reads a split value
    proto = base64.b64encode(helper.make_node("Round", ["x"], ["y"]).SerializeToString()).decode()
    rounded = g.add_node(Opaque("Round", "", 18, proto, ((1, 8, 3, 8),), ("float32",)), [scaled], "q_round").name
    g.output(g.attention(rounded, k, v, scale=0.25, names=["attn"]))
    plan = shard(g, 2, replicated=replicated)
    assert [st.sharded for st in plan.stages] == [True, False, True]
    feeds = random_inputs(g, seed=5)
    want = run(g, feeds, "numpy")["attn"]
    np.testing.assert_allclose(want, ref_sdpa(np.round(3 * feeds["q"]), feeds["k"], feeds["v"], scale=0.25), **TOL)
    np.testing.assert_allclose(ShardedRunner(plan, LocalExecutor(2)).run(feeds)["attn"], want, **TOL)
