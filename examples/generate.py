"""A whole causal LM from a transformers config.json: greedy generation on each backend, exported as an optimum-style ONNX model.

    pip install .
    python examples/generate.py                        # a small Mistral-shaped config, seeded random weights
    python examples/generate.py CONFIG.json WEIGHTS    # a local checkpoint (WEIGHTS: .safetensors file or folder)

The model takes ``input_ids``, ``attention_mask``, ``position_ids`` and
``past_key_values.{i}.key/value`` and returns ``logits`` and ``present.{i}.key/value``,
as optimum's ``text-generation-with-past`` exports do, so the ONNX file written
here runs in a decode loop written for those.
"""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

import graphc
from graphc.attention.hf_lm import causal_lm_config_from_hf
from graphc.weights import load_weights
from lowering import export, generate

CONFIG = {
    "model_type": "mistral",
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "sliding_window": 16,
    "rope_theta": 10000.0,
}


def build(argv: list[str]) -> graphc.Graph:
    """The model of ``argv`` (config and weights), or the small random one above."""
    if len(argv) == 2:
        return graphc.causal_lm_from_hf(argv[0], load_weights(argv[1]))
    return graphc.causal_lm_graph(causal_lm_config_from_hf(CONFIG), seed=0)


def onnx_decode_loop(path: Path, prompt: list[int], n: int, n_layers: int, kv_heads: int, head_dim: int) -> list[int]:
    """A plain onnxruntime decode loop, as one writes it for an optimum export: nothing graphc-specific."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.array([prompt], np.int64)
    mask = np.ones_like(ids)
    cache = {f"past_key_values.{i}.{k}": np.zeros((1, kv_heads, 0, head_dim), np.float32) for i in range(n_layers) for k in ("key", "value")}
    positions = np.arange(ids.shape[1])[None]
    out = []
    for _ in range(n):
        logits, *presents = sess.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **cache})
        token = int(logits[0, -1].argmax())
        out.append(token)
        cache = dict(zip(cache, presents))
        ids, positions = np.array([[token]]), positions[:, -1:] + 1
        mask = np.concatenate([mask, [[1]]], axis=1)
    return out


def main(argv: list[str]) -> None:
    model = build(argv)
    prompts = [[11, 42, 7], [3, 14, 15, 92, 65, 35]]  # different lengths: left-padded into one batch
    opt = graphc.optimize(model, hints={"batch": 2, "seq": 1, "past_seq": 32}).graph
    results = {backend: generate(opt, prompts, 16, backend=backend) for backend in ("numpy", "ort-cpu")}
    for backend, r in results.items():
        print(f"{backend:8} prefill {r.prefill_seconds * 1e3:7.2f} ms, {r.ms_per_token:6.2f} ms/token, {r.tokens_per_second:8.1f} tokens/s")
    tokens = results["numpy"].new_tokens
    assert all((r.new_tokens == tokens).all() for r in results.values()), "backends disagree"
    for prompt, new in zip(prompts, tokens.tolist()):
        print(f"{prompt} -> {new}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export(opt, path)
        key = opt.types["past_key_values.0.key"].shape
        n_layers = sum(1 for n in opt.inputs if n.endswith(".key"))
        plain = onnx_decode_loop(path, prompts[1], 16, n_layers, key[1], key[3])
    assert plain == tokens[1].tolist(), (plain, tokens[1].tolist())
    print(f"the exported ONNX model in a plain onnxruntime loop: the same {len(plain)} tokens")
    print(json.dumps({"inputs": opt.inputs[:4], "outputs": opt.outputs[:3]}))


if __name__ == "__main__":
    main(sys.argv[1:])
