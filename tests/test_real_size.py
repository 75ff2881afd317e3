"""A checkpoint at a real model's size: TinyLlama-1.1B's shape in float32 (22 layers, 4.4 GB of weights).

transformers writes it (``save_pretrained``, random weights: unit-scale embeddings and
layers that each add a little to the residual stream, so greedy tokens vary); graphc maps the folder and generates for a left-padded batch of
two prompts on NumPy and on onnxruntime (whose session reads the weights from the
safetensors file: the model is past protobuf's 2 GiB), and every backend's 16 greedy
tokens must be transformers' ``generate(do_sample=False)`` tokens.  Two-layer models
cannot show what this does: the 2 GiB limit, and the memory and time of a real load.
"""

from __future__ import annotations

import gc
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import graphc  # noqa: E402
from graphc.weights import load_weights  # noqa: E402
from lowering import generate, left_pad, prepare  # noqa: E402

from conftest import installed  # noqa: E402

TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rope_theta": 10000.0,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
PROMPTS = [[5, 17, 33, 2001, 901], [7, 1, 90, 44, 12, 60, 311, 4, 18]]
NEW = 16


@pytest.fixture(scope="module")
def tinyllama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tinyllama")
    if shutil.disk_usage(folder).free < 12 * 2**30:
        pytest.skip("under 12 GiB of free disk for a 4.4 GB checkpoint")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINYLLAMA)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():  # unit-scale embeddings, each layer adding a little: the greedy tokens vary (the default init repeats one)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else (0.3 if "o_proj" in name or "down_proj" in name else 1.0) * p.shape[-1] ** -0.5)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # to_empty left its buffers uninitialised
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        out = model.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = out[:, ids.shape[1] :].numpy()
    del model, out
    gc.collect()
    yield folder, want
    shutil.rmtree(folder, ignore_errors=True)


def test_a_tinyllama_sized_checkpoint_generates_transformers_tokens_on_every_backend(tinyllama):
    folder, want = tinyllama
    weights = load_weights(folder)
    assert sum(a.nbytes for a in weights.values()) > 4 * 2**30
    g = graphc.causal_lm_from_hf(folder / "config.json", weights, logits="last")
    g = graphc.optimize(g, hints={"batch": 2, "seq": 1, "past_seq": 24}).graph
    assert min(len(set(row)) for row in want.tolist()) > 8  # the tokens vary, so equal tokens mean something
    for backend in installed("numpy", "ort-cpu"):
        runner = prepare(g, backend, **({"attention": "auto", "sizes": {"batch": 2, "seq": 1, "past_seq": 24}} if backend == "ort-cpu" else {}))
        if backend == "ort-cpu":
            assert "GiB read from the checkpoint files" in runner.weights, runner.weights
        np.testing.assert_array_equal(generate(g, PROMPTS, NEW, runner=runner).new_tokens, want, err_msg=backend)
        del runner
        gc.collect()
