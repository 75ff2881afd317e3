"""Tiny random-weight transformers causal LMs exported by torch.onnx as users export them (shared by tests and benchmarks).

``export_model(family, exporter, attention, cache, path)`` writes one ONNX file: ``input_ids``, ``attention_mask`` and,
with a cache, ``past_key_values.{i}.key/value`` in, ``logits`` (and ``present.{i}.key/value``) out, with dynamic batch,
sequence and past lengths, by the legacy TorchScript exporter (``dynamo=False``, opset 18) or by ``torch.export``
(``dynamo=True``).  ``feeds(model, batch, seq, past, pad)`` makes inputs for any size, left-padding the first row.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: each test process keeps its own exports
    fcntl = None

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "gpt_neox", "falcon", "bert")
"""The causal LMs, and BERT (an encoder: ``last_hidden_state`` out, no cache)."""
ALIBI_FAMILIES = ("mpt", "bloom")
"""Causal LMs whose attention adds an ALiBi bias (positions by a per-head slope) instead of rotating Q and K."""
MORE_FAMILIES = ("gptj", "opt", "gpt_bigcode", "phi", "stablelm", "olmo", "gemma", "starcoder2", "deepseek_v3")
"""Further decoders transformers exports: interleaved partial rotary (GPT-J), learned positions and a scale before the
mask (OPT), multi-query attention (GPTBigCode), partial rotary with LayerNorm (Phi, StableLM), non-parametric norms
(OLMo), one KV head (Gemma), biases everywhere (Starcoder2) and multi-head latent attention (DeepSeek-V3, its layers
dense here: ``MOE_FAMILIES`` has its MoE), whose cache holds the compressed latents, not keys and values."""
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3_moe")
"""Mixture-of-experts decoders (4 experts, 2 per token): Mixtral and Qwen3-MoE (softmax top-k routing), DeepSeek-V3 with
its MoE layer (sigmoid scores, group-limited top-k, a shared expert).  Exported with transformers' ``batched_mm``
experts: each token gathers its experts' weights and runs batched MatMuls, a graph without data-dependent shapes (the
default experts loop over the experts a batch hits, which the tracer would unroll for the traced routing)."""
VOCAB = 128
REAL_SHAPES = {
    "deepseek_v2_lite_attention": (
        "DeepseekV3Config",
        dict(
            hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, intermediate_size=2048, kv_lora_rank=512,
            q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=2, n_routed_experts=4,
            n_group=1, topk_group=1,
        ),
    ),
}  # fmt: skip
"""Models at a real shape (``hidden`` is ignored): DeepSeek-V2-Lite's attention (16 heads, a 512-wide latent, rotary 64,
nope 128, value 128) in 2 layers whose MLPs are dense and of the hidden width."""


def config_kwargs(family: str, attention: str | None = None, hidden: int = 64, window: int = 16) -> tuple[str, dict]:
    """``(transformers config class name, keyword arguments)`` of a 2-layer ``family`` model of width ``hidden``: 8 query /
    2 KV heads where the family has GQA, else 4 heads; Mistral and Gemma 2 with a sliding ``window``.  Plain data, so
    that other environments (other transformers versions) build the same models."""
    common: dict = dict(vocab_size=VOCAB, **({"attn_implementation": attention} if attention else {}))
    if family in REAL_SHAPES:
        name, kw = REAL_SHAPES[family]
        return name, dict(kw, **common)
    if family == "bert":
        return "BertConfig", dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden, **common)
    if family == "gpt2":
        return "GPT2Config", dict(n_embd=hidden, n_layer=2, n_head=4, n_positions=4096, **common)
    if family == "gpt_neox":
        return "GPTNeoXConfig", dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden, **common)
    if family == "mpt":
        return "MptConfig", dict(d_model=hidden, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=4096, **common)
    if family == "bloom":
        return "BloomConfig", dict(hidden_size=hidden, n_head=4, n_layer=2, **common)
    if family in MORE_FAMILIES:
        return _more_config(family, hidden, common)
    if family in MOE_FAMILIES:
        return _moe_config(family, hidden, common)
    if family == "falcon":
        return "FalconConfig", dict(
            hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2, **common
        )
    classes = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "gemma2": "Gemma2Config",
        "phi3": "Phi3Config",
    }
    kw = dict(
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        head_dim=hidden // 8,
        **common,
    )
    if family in ("mistral", "gemma2"):
        kw.update(sliding_window=window)
    if family == "gemma2":
        kw.update(query_pre_attn_scalar=8)
    if family == "phi3":  # its default pad token (32000) lies outside the tiny vocabulary
        kw.update(pad_token_id=0)
    return classes[family], kw


def _more_config(family: str, hidden: int, common: dict) -> tuple[str, dict]:
    heads = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden, **common)
    if family == "gptj":
        return "GPTJConfig", dict(n_embd=hidden, n_layer=2, n_head=4, rotary_dim=hidden // 8, n_positions=4096, **common)
    if family == "opt":
        return "OPTConfig", dict(hidden_size=hidden, ffn_dim=2 * hidden, word_embed_proj_dim=hidden, max_position_embeddings=4096, **heads)
    if family == "gpt_bigcode":
        return "GPTBigCodeConfig", dict(n_embd=hidden, n_layer=2, n_head=4, multi_query=True, n_positions=4096, **common)
    if family == "deepseek_v3":
        d = hidden // 8
        mla = dict(kv_lora_rank=2 * d, q_lora_rank=3 * d, qk_rope_head_dim=d, qk_nope_head_dim=d, v_head_dim=d, num_key_value_heads=4)
        return "DeepseekV3Config", dict(hidden_size=hidden, first_k_dense_replace=2, n_routed_experts=4, n_group=1, topk_group=1, **mla, **heads)
    classes = {"phi": "PhiConfig", "stablelm": "StableLmConfig", "olmo": "OlmoConfig", "gemma": "GemmaConfig", "starcoder2": "Starcoder2Config"}
    kw = dict(hidden_size=hidden, **heads)
    kw.update(
        {
            "phi": dict(partial_rotary_factor=0.5),
            "stablelm": dict(num_key_value_heads=2, partial_rotary_factor=0.25),
            "olmo": dict(pad_token_id=0),
            "gemma": dict(num_key_value_heads=1, head_dim=hidden // 4),
            "starcoder2": dict(num_key_value_heads=2, sliding_window=None),
        }[family]
    )
    return classes[family], kw


def _moe_config(family: str, hidden: int, common: dict) -> tuple[str, dict]:
    experts = dict(intermediate_size=2 * hidden, num_experts_per_tok=2, experts_implementation="batched_mm", **common)
    if family == "mixtral":
        gqa = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8)
        return "MixtralConfig", dict(num_local_experts=4, **gqa, **experts)
    if family == "qwen3_moe":
        gqa = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8)
        return "Qwen3MoeConfig", dict(moe_intermediate_size=hidden, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[], **gqa, **experts)
    d = hidden // 8  # deepseek_v3_moe: layer 0 dense, layer 1 the MoE
    mla = dict(kv_lora_rank=2 * d, q_lora_rank=3 * d, qk_rope_head_dim=d, qk_nope_head_dim=d, v_head_dim=d, num_key_value_heads=4)
    routing = dict(first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=hidden)
    return "DeepseekV3Config", dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, **mla, **routing, **experts)


def config(family: str, attention: str, hidden: int = 64, window: int = 16):  # noqa: ANN201 - a transformers PretrainedConfig
    """The transformers config of :func:`config_kwargs`."""
    import transformers

    name, kw = config_kwargs(family, attention, hidden, window)
    return getattr(transformers, name)(**kw)


def _cache_shape(cfg) -> tuple[int, int, int, int]:  # noqa: ANN001
    """Layers, KV heads, key width, value width."""
    if cfg.model_type == "deepseek_v3":  # MLA caches its compressed latents as one head: "keys" the latent, "values" the rotary keys
        return cfg.num_hidden_layers, 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    layers, heads, width = _kv_shape(cfg)
    return layers, heads, width, width


def _kv_shape(cfg) -> tuple[int, int, int]:  # noqa: ANN001
    if cfg.model_type in ("gpt2", "gptj"):
        return cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
    if cfg.model_type == "gpt_bigcode":  # multi-query: one KV head
        return cfg.n_layer, 1, cfg.n_embd // cfg.n_head
    if cfg.model_type == "mpt":
        return cfg.n_layers, cfg.n_heads, cfg.d_model // cfg.n_heads
    if cfg.model_type == "bloom":
        return cfg.n_layer, cfg.n_head, cfg.hidden_size // cfg.n_head
    if cfg.model_type == "falcon":  # Falcon caches K/V already expanded to every query head
        return cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, kv, hd


def export_model(
    family: str, exporter: str, attention: str, cache: bool, path: str | Path, seed: int = 0, hidden: int = 64, window: int = 16
) -> Path:
    """Export one tiny model (see the module doc; ``window``: Mistral's and Gemma 2's sliding window); returns ``path``.

    Each model is exported once per test run: a second request copies the first file (torch's exporters take seconds a
    model, and several tests read the same one).  The test processes of one run share the files through the folder
    ``$GRAPHC_TEST_EXPORTS`` (``tests/conftest.py`` makes it), one lock a model, so two workers never export the same
    model twice; without it (a benchmark) the files are kept per process."""
    key = (family, exporter, attention, cache, seed, hidden, window)
    shared = os.environ.get("GRAPHC_TEST_EXPORTS")
    if shared and fcntl is not None:
        stored = Path(shared) / f"{hashlib.sha1(repr(key).encode()).hexdigest()}.onnx"
        with open(f"{stored}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return _export_or_copy(key, path, stored)
    return _export_or_copy(key, path, _EXPORTED.setdefault(key, Path(_CACHE_DIR.name) / f"{len(_EXPORTED)}.onnx"))


def _export_or_copy(key: tuple, path: str | Path, stored: Path) -> Path:
    """Copy ``stored`` to ``path`` if a model was exported there, else export it to ``path`` and keep a copy."""
    if stored.exists():
        shutil.copyfile(stored, path)
        return Path(path)
    _export_model(*key[:4], path, *key[4:])
    if not Path(f"{path}.data").exists():  # one self-contained file (tiny models always are): safe to copy
        shutil.copyfile(path, stored)
    return Path(path)


_EXPORTED: dict[tuple, Path] = {}
_CACHE_DIR = tempfile.TemporaryDirectory(prefix="graphc-real-exports-")


def _export_model(family: str, exporter: str, attention: str, cache: bool, path: str | Path, seed: int, hidden: int, window: int) -> None:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

    torch.manual_seed(seed)
    cfg = config(family, attention, hidden, window)
    encoder = family == "bert"
    if encoder and cache:
        raise ValueError("BERT is an encoder: it has no KV cache")
    model = (AutoModel if encoder else AutoModelForCausalLM).from_config(cfg).eval()
    layers, kv_heads, key_dim, value_dim = _cache_shape(cfg)

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, *past):  # noqa: ANN001, ANN201
            if encoder:
                return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if not cache:
                return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            c = DynamicCache(config=self.m.config)
            for i in range(layers):
                c.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=c, use_cache=True)
            return (out.logits, *(t for layer in out.past_key_values.layers[:layers] for t in (layer.keys, layer.values)))

    b, s, p = 2, 5, 7
    ids = torch.randint(0, VOCAB, (b, s))
    past = [torch.randn(b, kv_heads, p, key_dim if i % 2 == 0 else value_dim) for i in range(2 * layers)] if cache else []
    mask = torch.ones(b, s + (p if cache else 0), dtype=torch.int64)
    cache_names = [f"{kind}.{i}.{kv}" for kind in ("past_key_values",) for i in range(layers) for kv in ("key", "value")] if cache else []
    inputs = ["input_ids", "attention_mask", *cache_names]
    outputs = ["last_hidden_state" if encoder else "logits", *(n.replace("past_key_values", "present") for n in cache_names)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            d = torch.export.Dim.DYNAMIC
            shapes = ({0: d, 1: d}, {0: d, 1: d}) + ((tuple({0: d, 2: d} for _ in past),) if cache else ())
            torch.onnx.export(
                Wrapped(),
                (ids, mask, *past),
                str(path),
                dynamo=True,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=shapes,
                optimize=True,
                verbose=False,
            )
        else:
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total_seq"}}
            axes.update({n: {0: "batch", 2: "past_seq"} for n in cache_names})
            torch.onnx.export(
                Wrapped(), (ids, mask, *past), str(path), dynamo=False, input_names=inputs, output_names=outputs, dynamic_axes=axes, opset_version=18
            )


def feeds(model, batch: int, seq: int, past: int, pad: int = 0, seed: int = 0) -> dict[str, np.ndarray]:  # noqa: ANN001 - onnx.ModelProto
    """Inputs for an exported model: token ids, a mask (the first row left-padded by ``pad``), a random cache of ``past``."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name == "input_ids":
            out[vi.name] = rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)
        elif vi.name == "attention_mask":
            mask = np.ones((batch, seq + past), np.int64)
            mask[0, :pad] = 0
            out[vi.name] = mask
        else:
            dims = vi.type.tensor_type.shape.dim
            out[vi.name] = rng.standard_normal((batch, dims[1].dim_value, past, dims[3].dim_value)).astype(np.float32)
    return out
