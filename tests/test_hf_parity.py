"""Parity with transformers' attention modules, real RoPE included: Llama (Llama 3 RoPE scaling), Mistral (a
sliding window shorter than the sequence), Qwen2 (q/k/v-only biases), Gemma 2 (softcap, window, query_pre_attn_scalar).

Each family's module is built by transformers from a small random config; graphc builds
the layer from the same config (``attention_config_from_hf``) and the module's
``state_dict``, and must agree on numpy and ort-cpu, optimized and not, for a causal
prefill and for a decode step over transformers' ``DynamicCache``.  The additive mask
the modules take is written here from the definition (causal, bottom-right aligned,
window: ``i + P - window < j <= i + P``).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import graphc  # noqa: E402
from graphc.attention.config import PROJECTIONS  # noqa: E402
from graphc.attention.hf import attention_config_from_hf  # noqa: E402
from graphc.errors import UnknownNameError  # noqa: E402
from lowering import prepare  # noqa: E402

SMALL = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "max_position_embeddings": 128,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _family(name: str):
    from transformers.models.gemma2 import modeling_gemma2 as gemma2
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    return {
        "llama": (transformers.LlamaConfig, llama.LlamaAttention, llama.LlamaRotaryEmbedding, {"rope_parameters": LLAMA3_ROPE}),
        "mistral": (transformers.MistralConfig, mistral.MistralAttention, mistral.MistralRotaryEmbedding, {"sliding_window": 3}),
        "qwen2": (transformers.Qwen2Config, qwen2.Qwen2Attention, qwen2.Qwen2RotaryEmbedding, {}),
        "qwen3": (transformers.Qwen3Config, qwen3.Qwen3Attention, qwen3.Qwen3RotaryEmbedding, {}),
        "gemma2": (
            transformers.Gemma2Config,
            gemma2.Gemma2Attention,
            gemma2.Gemma2RotaryEmbedding,
            {"sliding_window": 3, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 12},
        ),
    }[name]


def _module(name: str, seed: int = 0):
    config_cls, attention_cls, rope_cls, extra = _family(name)
    config = config_cls(**SMALL, **extra, attn_implementation="eager")
    torch.manual_seed(seed)
    module = attention_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for pname, p in module.named_parameters():
            p.normal_(1.0 if "norm" in pname else 0.0, 0.3)
    return config, module, rope_cls(config)


def _mask(batch: int, sq: int, past: int, window: int | None) -> torch.Tensor:
    i = np.arange(sq)[:, None] + past
    j = np.arange(past + sq)[None, :]
    keep = j <= i
    if window is not None:
        keep &= j > i - window
    return torch.from_numpy(np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32)).expand(batch, 1, sq, past + sq)


def _hf_step(module, rope, x, past: int, cache, window):
    positions = torch.arange(past, past + x.shape[1])[None].expand(x.shape[0], -1)
    with torch.no_grad():
        out, _ = module(x, position_embeddings=rope(x, positions), attention_mask=_mask(x.shape[0], x.shape[1], past, window), past_key_values=cache)
    return out.numpy()


def _weights(module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2"]
TOL = {"atol": 1e-4, "rtol": 1e-3}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_transformers(family):
    config, module, _ = _module(family)
    cfg = attention_config_from_hf(config)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.hd) == (4, 2, 8) and cfg.rope is not None
    assert cfg.sliding_window == {"mistral": 3, "gemma2": 3}.get(family)
    assert cfg.softmax_scale == pytest.approx(module.scaling)
    assert sorted(k for k in module.state_dict() if k.endswith("bias")) == sorted(f"{p}.bias" for p in PROJECTIONS if cfg.has_bias(p))
    assert attention_config_from_hf(config.to_dict()) == cfg


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("optimized", [False, True])
def test_prefill_matches_the_transformers_module(family, optimized):
    config, module, rope = _module(family)
    cfg = attention_config_from_hf(config)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    want = _hf_step(module, rope, x, 0, None, cfg.sliding_window)
    g = graphc.attention_layer_graph(cfg, weights=_weights(module))
    if optimized:
        g = graphc.optimize(g, hints={"batch": 2, "seq": 7}).graph
    for backend in ("numpy", "ort-cpu"):
        got = prepare(g, backend, sizes={"batch": 2, "seq": 7}).run({"x_BSM": x.numpy()})["out_BSM"]
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"{family} {backend}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("new_tokens", [1, 2])
def test_decode_over_a_dynamic_cache_matches_the_transformers_module(family, new_tokens):
    config, module, rope = _module(family)
    cfg = attention_config_from_hf(config)
    prefix = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2))
    step = torch.randn(1, new_tokens, 32, generator=torch.Generator().manual_seed(3))
    cache = DynamicCache()
    _hf_step(module, rope, prefix, 0, cache, cfg.sliding_window)
    past_key, past_value = (t.clone().numpy() for t in (cache.layers[0].keys, cache.layers[0].values))
    want = _hf_step(module, rope, step, 5, cache, cfg.sliding_window)
    present = cache.layers[0].keys.numpy()
    g = graphc.kv_cache_graph(cfg, weights=_weights(module))
    feeds = {"x_BSM": step.numpy(), "past_key": past_key, "past_value": past_value}
    sizes = {"batch": 1, "seq": new_tokens, "past_seq": 5}
    for graph in (g, graphc.optimize(g, hints=sizes).graph):
        for backend in ("numpy", "ort-cpu"):
            got = prepare(graph, backend, sizes=sizes).run(feeds)
            np.testing.assert_allclose(got["out_BSM"], want, **TOL, err_msg=f"{family} {backend}")
            np.testing.assert_allclose(got["present_key"], present, **TOL, err_msg=f"{family} {backend} present_key")


def test_a_window_shorter_than_the_sequence_changes_the_numbers():
    """The Mistral and Gemma 2 parity cases above would pass by accident if the window hid nothing."""
    config, module, rope = _module("mistral")
    x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(1))
    assert np.abs(_hf_step(module, rope, x, 0, None, 3) - _hf_step(module, rope, x, 0, None, None)).max() > 1e-2


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(UnknownNameError, match="model_type 'bert'.*llama, mistral, qwen2, qwen3, gemma2, falcon"):
        attention_config_from_hf({"model_type": "bert", "hidden_size": 32, "num_attention_heads": 4})


# ------------------------------------------------------------------ decoder layers and stacks

DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma2"]


def _decoder_family(name: str):
    import importlib

    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    title = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2"}[name]
    extra = {
        "llama": {"rope_parameters": LLAMA3_ROPE},
        "mistral": {"sliding_window": 3},
        "qwen2": {},
        "qwen3": {},
        "gemma2": {"sliding_window": 3, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 12},
    }[name]
    config = getattr(transformers, f"{title}Config")(**SMALL, **extra, attn_implementation="eager")
    return config, getattr(module, f"{title}DecoderLayer"), getattr(module, f"{title}RotaryEmbedding")(config)


def _hf_layers(name: str, n_layers: int, seed: int = 0):
    config, layer_cls, rope = _decoder_family(name)
    torch.manual_seed(seed)
    layers = [layer_cls(config, layer_idx=i).eval() for i in range(n_layers)]
    with torch.no_grad():
        for layer in layers:
            for pname, p in layer.named_parameters():
                if "norm" in pname:
                    p.copy_((0.0 if name == "gemma2" else 1.0) + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.2)
    return config, layers, rope


def _hf_stack_step(config, layers, rope, x, past, cache):
    from graphc.attention.hf import attention_config_from_hf

    positions = torch.arange(past, past + x.shape[1])[None].expand(x.shape[0], -1)
    emb = rope(x, positions)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            window = attention_config_from_hf(config, i).sliding_window
            x = layer(
                x, attention_mask=_mask(x.shape[0], x.shape[1], past, window), past_key_values=cache, position_embeddings=emb, position_ids=positions
            )
            x = x[0] if isinstance(x, tuple) else x
    return x.float().numpy()


def _stack_weights(layers) -> dict[str, np.ndarray]:
    return {f"model.layers.{i}.{k}": v.detach().numpy().copy() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("n_layers", [1, 2])
def test_decoder_stack_prefill_matches_transformers(family, n_layers):
    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf

    config, layers, rope = _hf_layers(family, n_layers)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4))
    want = _hf_stack_step(config, layers, rope, x, 0, None)
    g = decoder_stack_graph(decoder_configs_from_hf(config, n_layers), weights=_stack_weights(layers))
    sizes = {"batch": 2, "seq": 6}
    for graph in (g, graphc.optimize(g, hints=sizes).graph):
        for backend in ("numpy", "ort-cpu"):
            got = prepare(graph, backend, sizes=sizes).run({"x_BSM": x.numpy()})["out_BSM"]
            np.testing.assert_allclose(got, want, **TOL, err_msg=f"{family} {backend}")


@pytest.mark.parametrize("family", DECODERS)
def test_decoder_stack_decode_over_a_dynamic_cache_matches_transformers(family):
    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf

    config, layers, rope = _hf_layers(family, 2)
    prefix = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(5))
    step = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(6))
    cache = DynamicCache()
    _hf_stack_step(config, layers, rope, prefix, 0, cache)
    feeds = {"x_BSM": step.numpy()}
    for i in range(2):
        feeds[f"past_key.{i}"] = cache.layers[i].keys.clone().numpy()
        feeds[f"past_value.{i}"] = cache.layers[i].values.clone().numpy()
    want = _hf_stack_step(config, layers, rope, step, 5, cache)
    g = decoder_stack_graph(decoder_configs_from_hf(config, 2), weights=_stack_weights(layers), kv_cache=True)
    sizes = {"batch": 1, "seq": 1, "past_seq": 5}
    for graph in (g, graphc.optimize(g, hints=sizes).graph):
        for backend in ("numpy", "ort-cpu"):
            got = prepare(graph, backend, sizes=sizes).run(feeds)
            np.testing.assert_allclose(got["out_BSM"], want, **TOL, err_msg=f"{family} {backend}")
            for i in range(2):
                np.testing.assert_allclose(got[f"present_value.{i}"], cache.layers[i].values.numpy(), **TOL, err_msg=f"{family} {backend} layer {i}")


# ------------------------------------------------------------------ weights from files


def _mistral_model(tmp_path, n_layers=2):
    config = transformers.MistralConfig(**{**SMALL, "num_hidden_layers": n_layers}, sliding_window=3)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    return config, model, path


def test_safetensors_weights_give_the_state_dicts_numbers(tmp_path):
    from safetensors.torch import save_file

    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf
    from graphc.weights import load_weights

    config, model, config_path = _mistral_model(tmp_path)
    state = model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    from_file = load_weights(tmp_path / "model.safetensors")
    assert isinstance(from_file["model.layers.0.self_attn.q_proj.weight"], np.memmap)  # mapped, not read
    cfgs = decoder_configs_from_hf(config_path)
    x = np.random.default_rng(0).standard_normal((1, 6, 32)).astype(np.float32)
    outs = []
    for weights in (load_weights(state), from_file, load_weights(tmp_path)):
        g = decoder_stack_graph(cfgs, weights={k: v for k, v in weights.items() if k.startswith("model.")}, final_norm=True)
        assert isinstance(g.initializers["model.layers.1.self_attn.k_proj.weight"], np.ndarray)
        outs.append(prepare(g, "ort-cpu").run({"x_BSM": x})["out_BSM"])
    with torch.no_grad():
        want = model.model(inputs_embeds=torch.from_numpy(x)).last_hidden_state.numpy()  # transformers builds its own masks here
    for got in outs:
        np.testing.assert_allclose(got, want, **TOL)
    mapped = decoder_stack_graph(cfgs, weights={k: v for k, v in from_file.items() if k.startswith("model.")}, final_norm=True)
    assert np.shares_memory(mapped.initializers["model.layers.0.mlp.up_proj.weight"], from_file["model.layers.0.mlp.up_proj.weight"])
    optimized = graphc.optimize(mapped, hints={"batch": 1, "seq": 64}).graph  # the maps stay mapped through the optimizer,
    big = {n: a for n, a in optimized.initializers.items() if a.size > 256}  # but for the weights it folds the scale into
    unmapped = [n for n, a in big.items() if not any(np.shares_memory(a, m) for m in from_file.values())]
    assert len(big) > 10 and all(n.endswith("_scaled") for n in unmapped) and len(unmapped) <= 2, unmapped


@pytest.mark.parametrize(
    "change, fragment",
    [
        (
            lambda w: w.pop("model.layers.1.mlp.up_proj.weight"),
            "decoder layer 'model.layers.1' weights: missing ['model.layers.1.mlp.up_proj.weight']",
        ),
        (
            lambda w: w.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((31, 32), np.float32)}),
            "'model.layers.0.self_attn.q_proj.weight' is float32[31, 32], expected float32[32, 32]",
        ),
        (
            lambda w: w.update({"model.layers.0.mlp.gate_proj.weight": np.zeros((64, 32), np.float16)}),
            "'model.layers.0.mlp.gate_proj.weight' is float16[64, 32], expected float32",
        ),
        (
            lambda w: w.update({"model.layers.0.mlp.gate_projection.weight": np.zeros(2, np.float32)}),
            "unexpected ['model.layers.0.mlp.gate_projection.weight']",
        ),
    ],
)
def test_a_wrong_weight_is_named(tmp_path, change, fragment):
    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf
    from graphc.errors import WeightError
    from graphc.weights import load_weights

    config, model, config_path = _mistral_model(tmp_path)
    weights = {k: v for k, v in load_weights(model.state_dict()).items() if k.startswith("model.layers.")}
    change(weights)
    with pytest.raises(WeightError) as info:
        decoder_stack_graph(decoder_configs_from_hf(config_path), weights=weights)
    assert fragment in str(info.value)


def test_bad_safetensors_files_are_named(tmp_path):
    from graphc.errors import SerializationError
    from graphc.weights import load_weights

    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(SerializationError, match="junk.safetensors: not a safetensors file"):
        load_weights(tmp_path / "junk.safetensors")
    with pytest.raises(SerializationError, match="cannot read weights file"):
        load_weights(tmp_path / "missing.safetensors")


def test_cli_compares_a_transformers_config_and_weights(tmp_path, capsys):
    from safetensors.torch import save_file

    from graphc.cli import main

    config, model, config_path = _mistral_model(tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    assert (
        main(
            [
                "compare",
                "--hf-config",
                str(config_path),
                "--weights",
                str(tmp_path),
                "--seq",
                "8",
                "--backends",
                "numpy,ort-cpu",
                "--repeats",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    assert "decoder_stack_2" in capsys.readouterr().out
    assert (
        main(["compare", "--hf-config", str(config_path), "--decode", "--past", "5", "--backends", "numpy,ort-cpu", "--repeats", "1", "--quiet"]) == 0
    )
    assert main(["info", "--hf-config", str(config_path)]) == 0
    assert "2 decoder layers" in capsys.readouterr().out
    assert main(["export", "--hf-config", str(config_path), "--weights", str(tmp_path / "model.safetensors"), "-o", str(tmp_path / "m.onnx")]) == 0
    assert main(["compare", "--weights", str(tmp_path), "--preset", "mistral-7b"]) == 2


def test_hf_decoder_example_runs(capsys, monkeypatch):
    import os
    import runpy

    monkeypatch.setattr("sys.argv", ["hf_decoder.py"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runpy.run_path(os.path.join(root, "examples", "hf_decoder.py"), run_name="__main__")
    assert "all backends agree" in capsys.readouterr().out


@pytest.mark.parametrize(
    "preset, config",
    [
        (
            "llama3.1-8b",
            {
                "model_type": "llama",
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
        ),
        (
            "mistral-7b-v0.1",
            {
                "model_type": "mistral",
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "rope_theta": 10000.0,
                "sliding_window": 4096,
            },
        ),
        (
            "mistral-7b",
            {
                "model_type": "mistral",
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "rope_theta": 1000000.0,
                "sliding_window": None,
            },
        ),
        (
            "qwen2-7b",
            {
                "model_type": "qwen2",
                "hidden_size": 3584,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "rope_theta": 1000000.0,
                "use_sliding_window": False,
                "sliding_window": 131072,
            },
        ),
        (
            "gemma2-9b",
            {
                "model_type": "gemma2",
                "hidden_size": 3584,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 256,
                "query_pre_attn_scalar": 256,
                "attn_logit_softcapping": 50.0,
                "sliding_window": 4096,
                "rope_theta": 10000.0,
            },
        ),
    ],
)
def test_presets_match_the_published_config_json(preset, config):
    """The config.json fields as the models publish them (written out here; nothing is downloaded)."""
    assert attention_config_from_hf(config) == graphc.preset(preset)


# ------------------------------------------------------------------ float16 and bfloat16

LOW_PRECISION = {"bfloat16": (torch.bfloat16, 0.02), "float16": (torch.float16, 0.0025)}
"""Stated tolerances: max |graphc - transformers| <= tol * max |transformers| for a 2-layer stack.
transformers rounds after every op in the storage dtype; graphc computes in float32 between
low-precision inputs, weights and outputs, so it sits closer to the float32 model than
transformers' own low-precision run (measured: bfloat16 0.7% vs 1.2% of the scale)."""


@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION))
@pytest.mark.parametrize("family", DECODERS)
def test_low_precision_decoder_stack_matches_transformers(family, dtype):
    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf
    from graphc.weights import load_weights

    torch_dtype, tol = LOW_PRECISION[dtype]
    config, layers, rope = _hf_layers(family, 2)
    x32 = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4))
    want32 = _hf_stack_step(config, layers, rope, x32, 0, None)
    layers = [layer.to(torch_dtype) for layer in layers]
    x = x32.to(torch_dtype)
    want = _hf_stack_step(config, layers, rope, x, 0, None)
    weights = load_weights({f"model.layers.{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.state_dict().items()})
    assert str(weights["model.layers.0.mlp.up_proj.weight"].dtype) == dtype
    g = decoder_stack_graph(decoder_configs_from_hf(config, 2), weights=weights, dtype=dtype)
    feeds = {"x_BSM": load_weights({"x": x})["x"]}
    scale = float(np.abs(want).max())
    for backend in ("numpy", "ort-cpu"):
        got = prepare(g, backend).run(feeds)["out_BSM"]
        assert str(got.dtype) == dtype
        got = got.astype(np.float32)
        assert np.abs(got - want).max() <= tol * scale, (backend, np.abs(got - want).max() / scale)
        assert np.abs(got - want32).max() <= np.abs(want - want32).max() + tol * scale / 4  # no further from float32 than transformers


# ------------------------------------------------------------------ Falcon: fused QKV, parallel attention and MLP

FALCONS = {
    "falcon-7b-style": {"multi_query": True, "new_decoder_architecture": False, "parallel_attn": True, "bias": False},
    "falcon-40b-style": {"new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": True, "bias": False},
    "falcon-mha-sequential": {"multi_query": False, "new_decoder_architecture": False, "parallel_attn": False, "bias": True},
}


def _falcon(kind: str, n_layers: int = 2):
    from transformers.models.falcon import modeling_falcon as falcon

    config = transformers.FalconConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=n_layers,
        vocab_size=64,
        ffn_hidden_size=64,
        **FALCONS[kind],
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    layers = [falcon.FalconDecoderLayer(config, layer_idx=i).eval() for i in range(n_layers)]
    with torch.no_grad():
        for layer in layers:
            for name, p in layer.named_parameters():
                p.copy_((1.0 if "ln" in name or "layernorm" in name else 0.0) * (name.endswith("weight")) + 0.2 * torch.randn_like(p))
    return config, layers, falcon.FalconRotaryEmbedding(config)


def _falcon_step(layers, rope, x, past, cache):
    positions = torch.arange(past, past + x.shape[1])[None].expand(x.shape[0], -1)
    emb = rope(x, positions)
    with torch.no_grad():
        for layer in layers:
            x = layer(
                x,
                alibi=None,
                attention_mask=_mask(x.shape[0], x.shape[1], past, None),
                position_ids=positions,
                layer_past=cache,
                position_embeddings=emb,
            )[0]
    return x.numpy()


@pytest.mark.parametrize("kind", sorted(FALCONS))
def test_falcon_stack_matches_transformers(kind):
    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf, decoder_weights_from_hf

    config, layers, rope = _falcon(kind)
    hf_weights = {f"transformer.h.{i}.{k}": v.detach().numpy() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    weights = decoder_weights_from_hf(hf_weights, config)
    cfgs = decoder_configs_from_hf(config)
    assert cfgs[0].attention.n_kv_heads == {"falcon-7b-style": 1, "falcon-40b-style": 2, "falcon-mha-sequential": 4}[kind]
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(7))
    want = _falcon_step(layers, rope, x, 0, None)
    g = decoder_stack_graph(cfgs, weights=weights)
    for graph in (g, graphc.optimize(g, hints={"batch": 2, "seq": 6}).graph):
        for backend in ("numpy", "ort-cpu"):
            np.testing.assert_allclose(prepare(graph, backend).run({"x_BSM": x.numpy()})["out_BSM"], want, **TOL, err_msg=f"{kind} {backend}")
    # decode one token over transformers' cache (the new architecture caches K/V repeated to every query head)
    prefix, step = (
        torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(8)),
        torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(9)),
    )
    cache = DynamicCache()
    _falcon_step(layers, rope, prefix, 0, cache)
    group = cfgs[0].attention.n_heads // cfgs[0].attention.n_kv_heads if FALCONS[kind]["new_decoder_architecture"] else 1
    feeds = {"x_BSM": step.numpy()}
    for i in range(2):
        feeds[f"past_key.{i}"] = cache.layers[i].keys[:, ::group].clone().numpy()
        feeds[f"past_value.{i}"] = cache.layers[i].values[:, ::group].clone().numpy()
    want = _falcon_step(layers, rope, step, 5, cache)
    dec = decoder_stack_graph(cfgs, weights=weights, kv_cache=True)
    np.testing.assert_allclose(prepare(dec, "ort-cpu").run(feeds)["out_BSM"], want, **TOL, err_msg=f"{kind} decode")


# ------------------------------------------------------------------ padding masks


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("per_query", [False, True])
def test_padded_batch_matches_transformers(kind, per_query):
    """Left-padded batch: keys at padding positions are hidden in every row; pad query rows are not compared."""
    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf

    config, layers, rope = _hf_layers("llama", 2)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(10))
    pad = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)  # sequence 0 is left-padded by two tokens
    positions = torch.arange(6)[None].expand(2, -1)
    causal = np.tril(np.ones((6, 6), bool))
    keep = causal[None] & pad[:, None, :]
    hf_mask = torch.from_numpy(np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32))[:, None]
    with torch.no_grad():
        h, emb = x, rope(x, positions)
        for layer in layers:
            h = layer(h, attention_mask=hf_mask, position_embeddings=emb, position_ids=positions)
            h = h[0] if isinstance(h, tuple) else h
    want = h.numpy()
    mask = np.broadcast_to(pad[:, None, None, :], (2, 1, 6 if per_query else 1, 6)).copy()
    if kind == "additive":
        mask = np.where(mask, 0.0, -np.inf).astype(np.float32)
    g = decoder_stack_graph(decoder_configs_from_hf(config, 2), weights=_stack_weights(layers), mask=kind, mask_per_query=per_query)
    for graph in (g, graphc.optimize(g).graph):
        for backend in ("numpy", "ort-cpu", "onnx-reference"):
            got = prepare(graph, backend).run({"x_BSM": x.numpy(), "attn_mask": mask})["out_BSM"]
            np.testing.assert_allclose(got[pad], want[pad], **TOL, err_msg=backend)


# ------------------------------------------------------------------ ragged caches (past_lengths)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("new_tokens", [1, 2])
def test_ragged_caches_decode_like_each_sequence_alone(family, new_tokens):
    """A batch of caches of lengths 2 and 6, right-padded with garbage: each row equals transformers' run of that sequence alone."""
    config, module, rope = _module(family)
    cfg = attention_config_from_hf(config)
    lengths, padded = [2, 6], 6
    rng = np.random.default_rng(11)
    past_k = rng.standard_normal((2, 2, padded, 8)).astype(np.float32) * 50  # padding slots hold garbage
    past_v = rng.standard_normal((2, 2, padded, 8)).astype(np.float32) * 50
    step = torch.randn(2, new_tokens, 32, generator=torch.Generator().manual_seed(12))
    wants, presents = [], []
    for b, n in enumerate(lengths):
        cache = DynamicCache()
        prefix = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(20 + b))
        _hf_step(module, rope, prefix, 0, cache, cfg.sliding_window)
        past_k[b, :, :n] = cache.layers[0].keys[0].numpy()
        past_v[b, :, :n] = cache.layers[0].values[0].numpy()
        wants.append(_hf_step(module, rope, step[b : b + 1], n, cache, cfg.sliding_window)[0])
        presents.append(cache.layers[0].keys[0, :, n:].numpy())  # the new keys, after RoPE at positions n..
    g = graphc.kv_cache_graph(cfg, weights=_weights(module), past_lengths=True)
    feeds = {"x_BSM": step.numpy(), "past_key": past_k, "past_value": past_v, "past_lengths": np.array(lengths, np.int64)}
    sizes = {"batch": 2, "seq": new_tokens, "past_seq": padded}
    for graph in (g, graphc.optimize(g, hints=sizes).graph):
        for backend in ("numpy", "ort-cpu", "onnx-reference"):
            got = prepare(graph, backend, sizes=sizes).run(feeds)
            np.testing.assert_allclose(got["out_BSM"], np.stack(wants), **TOL, err_msg=f"{family} {backend}")
            for b in range(2):
                np.testing.assert_allclose(got["present_key"][b, :, padded:], presents[b], **TOL, err_msg=f"{family} {backend} new keys")


def test_stack_with_equal_past_lengths_equals_the_plain_stack():
    from graphc.attention.decoder import decoder_stack_graph
    from graphc.attention.hf import decoder_configs_from_hf

    config, layers, rope = _hf_layers("mistral", 2)
    cfgs, weights = decoder_configs_from_hf(config, 2), _stack_weights(layers)
    plain = decoder_stack_graph(cfgs, weights=weights, kv_cache=True)
    ragged = decoder_stack_graph(cfgs, weights=weights, kv_cache=True, past_lengths=True)
    feeds = __import__("lowering").random_inputs(plain, seed=3, batch=2, seq=2, past_seq=5)
    want = prepare(plain, "ort-cpu").run(feeds)
    got = prepare(ragged, "ort-cpu").run({**feeds, "past_lengths": np.array([5, 5], np.int64)})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=name)


def test_position_ids_input_drives_rope():
    """Explicit position ids (here: a sequence continuing at 40) give transformers' numbers for those positions."""
    config, module, rope = _module("llama")
    cfg = attention_config_from_hf(config)
    x = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(13))
    positions = torch.tensor([[40, 41, 42]])
    with torch.no_grad():
        want, _ = module(x, position_embeddings=rope(x, positions), attention_mask=_mask(1, 3, 0, None))
    g = graphc.kv_cache_graph(cfg, weights=_weights(module), position_ids=True)
    feeds = {
        "x_BSM": x.numpy(),
        "past_key": np.zeros((1, 2, 0, 8), np.float32),
        "past_value": np.zeros((1, 2, 0, 8), np.float32),
        "position_ids": positions.numpy(),
    }
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(prepare(g, backend).run(feeds)["out_BSM"], want.numpy(), **TOL, err_msg=backend)


@pytest.mark.parametrize("kind", sorted(FALCONS))
def test_falcon_attention_module_matches_transformers(kind):
    """FalconAttention alone (fused QKV split by decoder_weights_from_hf), prefill and decode."""
    from transformers.models.falcon import modeling_falcon as falcon

    from graphc.attention.hf import decoder_weights_from_hf

    config, layers, rope = _falcon(kind, 1)
    module = layers[0].self_attention
    mapped = decoder_weights_from_hf({f"transformer.h.0.self_attention.{k}": v.detach().numpy() for k, v in module.state_dict().items()}, config)
    weights = {k[len("model.layers.0.self_attn.") :]: v for k, v in mapped.items()}
    cfg = attention_config_from_hf(config)
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(14))
    positions = torch.arange(5)[None]
    with torch.no_grad():
        want = module(x, alibi=None, attention_mask=_mask(1, 5, 0, None), position_ids=positions, position_embeddings=rope(x, positions))[0]
    g = graphc.attention_layer_graph(cfg, weights=weights)
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(prepare(g, backend).run({"x_BSM": x.numpy()})["out_BSM"], want.numpy(), **TOL, err_msg=f"{kind} {backend}")
    assert isinstance(module, falcon.FalconAttention)
