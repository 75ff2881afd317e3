"""Encoder stacks built from a transformers checkpoint (``save_pretrained``'s config.json and safetensors) equal
transformers' ``last_hidden_state`` on every backend, padded rows included, and each attention is one non-causal
``Attention`` once optimized."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
from conftest import INSTALLED  # noqa: E402

import graphc  # noqa: E402
from graphc.attention import encoder_config_from_hf, encoder_weights_from_hf  # noqa: E402
from graphc.errors import WeightError  # noqa: E402
from graphc.optimizer import KEEP_EVERY_ATTENTION, lower, optimize  # noqa: E402
from lowering import run  # noqa: E402

pytestmark = pytest.mark.transformers

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, hidden_size=64)


def _model(family: str):  # noqa: ANN202 - a transformers model
    torch.manual_seed(0)
    if family == "bert":
        return tf.BertModel(tf.BertConfig(**SMALL, vocab_size=100), add_pooling_layer=False).eval()
    if family == "distilbert":
        return tf.DistilBertModel(tf.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=100)).eval()
    return tf.ViTModel(tf.ViTConfig(**SMALL, image_size=32, patch_size=8), add_pooling_layer=False).eval()


@pytest.mark.parametrize("family", ["bert", "distilbert", "vit"])
def test_an_encoder_from_its_checkpoint_equals_transformers(family, tmp_path):
    model = _model(family)
    model.save_pretrained(tmp_path)
    graph = graphc.encoder_from_hf(tmp_path / "config.json", graphc.weights.load_weights(tmp_path))
    rng = np.random.default_rng(1)
    if family == "vit":
        feeds = {"pixel_values": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)}
        with torch.no_grad():
            want = model(pixel_values=torch.from_numpy(feeds["pixel_values"])).last_hidden_state.numpy()
    else:
        ids, mask = rng.integers(0, 100, (3, 9)), np.ones((3, 9), np.int64)
        mask[0, :3] = 0  # a padded row
        feeds = {"input_ids": ids, "attention_mask": mask}
        with torch.no_grad():
            want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
    optimized = optimize(graph).graph
    ops = [n.op for n in lower(optimized, KEEP_EVERY_ATTENTION).topological_order() if n.op.kind == "Attention"]
    assert len(ops) == 2 and not any(op.visibility.is_causal for op in ops)
    for backend in INSTALLED:
        got = run(optimized, feeds, backend)["last_hidden_state"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=backend)


def test_an_encoder_checkpoint_with_a_task_head_and_bad_ones_are_named(tmp_path):
    torch.manual_seed(0)
    tf.BertForSequenceClassification(tf.BertConfig(**SMALL, vocab_size=100)).eval().save_pretrained(tmp_path)
    cfg = encoder_config_from_hf(tmp_path / "config.json")
    tensors = graphc.weights.load_weights(tmp_path)
    named = encoder_weights_from_hf(cfg, tensors)  # "bert." prefixed, classifier and pooler left out
    assert named["layers.1.self_attn.q_proj.weight"] is tensors["bert.encoder.layer.1.attention.self.query.weight"]
    with pytest.raises(WeightError, match=r"lacks 2 tensor\(s\) the encoder needs, such as encoder.layer.1.output.LayerNorm.bias"):
        encoder_weights_from_hf(cfg, {k: v for k, v in tensors.items() if "layer.1.output.LayerNorm" not in k})
    with pytest.raises(WeightError, match=r"model_type 'llama' is not an encoder graphc builds; supported: bert, distilbert, vit"):
        encoder_config_from_hf({"model_type": "llama"})
    with pytest.raises(WeightError, match=r"activation 'relu'"):
        encoder_config_from_hf({"model_type": "bert", "hidden_act": "relu", "hidden_size": 64, "num_attention_heads": 4})


def test_the_command_line_takes_an_encoder_checkpoint_folder(tmp_path, capsys):
    from graphc.cli import main

    _model("bert").save_pretrained(tmp_path / "bert")
    _model("vit").save_pretrained(tmp_path / "vit")
    assert main(["compare", str(tmp_path / "bert"), "--batch", "2", "--seq", "9", "--backends", "numpy,ort-cpu", "--quiet"]) == 0
    assert "all backends agree" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "vit")]) == 0
    out = capsys.readouterr().out
    assert "pixel_values [batch, 3, 32, 32]" in out and "2 x not causal" in out and "softmax left unfused: 0" in out
    assert main(["compare", str(tmp_path / "vit"), "--decode"]) == 2
    assert "--decode describe a decoder; a vit encoder is built whole" in capsys.readouterr().err
