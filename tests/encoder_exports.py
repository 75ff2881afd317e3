"""Tiny random-weight encoders and encoder-decoder parts exported by torch.onnx as users export them (shared by tests
and benchmarks).

``export_encoder(family, exporter, path)`` writes one ONNX file by the legacy TorchScript exporter (``dynamo=False``,
opset 18) or by ``torch.export`` (``dynamo=True``), with dynamic batch and lengths; ``feeds(family, batch, seed)`` makes
inputs at sizes never traced, the first row padded where the model takes a mask.  The families:

- ``vit``: a ViT image encoder (``pixel_values`` in, ``last_hidden_state`` out; no mask);
- ``clip_text``: CLIP's text tower (causal self-attention with a padding mask);
- ``whisper_encoder``: Whisper's audio encoder (two Conv1d over mel frames, learned positions; no mask);
- ``bart_decoder``: BART's decoder (causal self-attention built without an attention mask, cross-attention over
  ``encoder_hidden_states`` with the encoder's padding mask);
- ``t5_encoder``: T5's encoder (a relative-position bias added to the unscaled scores, the padding in it);
- ``t5_decoder``: T5's decoder (the relative bias where the causal mask keeps a key, ``finfo.min`` elsewhere;
  cross-attention over the encoder's padding);
- ``siglip_vision``: SigLIP's vision tower (its pooling head attends with one learned query);
- ``clip``: CLIP's two towers in one file (text causal with padding, vision; the image-text logits out);
- ``torch_decoder``: torch's own ``nn.TransformerDecoder`` (a causal ``tgt_mask``, the memory's padding), dynamo only;
- ``bert``: BERT (its padding mask);
- ``modernbert``: ModernBERT (global attention, then a local layer that keeps ``|i - j| <= 2``, written into its mask);
- ``torch_mha``: torch's ``nn.MultiheadAttention`` as cross-attention with a key padding mask, dynamo only (the
  legacy exporter writes both modules' batch size into a ``Reshape``: the file fails in onnxruntime at another batch).
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

ENCODER_FAMILIES = ("vit", "clip_text", "whisper_encoder", "bart_decoder", "t5_encoder")
ENCODER_FAMILIES += ("t5_decoder", "siglip_vision", "clip", "torch_decoder", "torch_mha", "modernbert", "bert")
EXPORTERS = {family: ("legacy", "dynamo") for family in ENCODER_FAMILIES} | {"torch_decoder": ("dynamo",), "torch_mha": ("dynamo",)}
"""The exporters each family is written by."""
VOCAB = 100
SHAPES = {"tiny": (64, 2, 128, 32), "base": (256, 4, 1024, 64)}
"""(hidden, layers, MLP width, ViT image side) of the tests' models and of the benchmark's (4 heads; ViT patches of 8)."""
WHISPER_FRAMES = {"tiny": 32, "base": 256}
"""Mel frames of Whisper's input (its encoder's positions are half as many, after the strided Conv1d; fixed, as Whisper's)."""
SIZES = {"vit": (3, None, None), "clip_text": (3, 9, None), "whisper_encoder": (3, None, None), "bart_decoder": (3, 6, 9), "t5_encoder": (3, 9, None),
         "t5_decoder": (3, 6, 9), "siglip_vision": (3, None, None), "clip": (3, 9, None), "torch_decoder": (3, 6, 9),
         "torch_mha": (3, 6, 9), "modernbert": (3, 9, None), "bert": (3, 9, None)}  # fmt: skip
"""(batch, sequence, encoder length) of the untraced run (traced: batch 2, sequence 5 or 7)."""


def _model(family: str, shape: str):  # noqa: ANN202 - (torch module, example args, input names, dynamic axes by input)
    import torch
    import transformers as tf

    hidden, layers, ff, image = SHAPES[shape]
    small = dict(num_hidden_layers=layers, num_attention_heads=4, intermediate_size=ff, hidden_size=hidden)
    if family == "vit":
        m = tf.ViTModel(tf.ViTConfig(**small, image_size=image, patch_size=8)).eval()
        return m, (torch.randn(2, 3, image, image),), ["pixel_values"], {"pixel_values": {0: "batch"}}
    if family == "clip_text":
        m = tf.CLIPTextModel(tf.CLIPTextConfig(**small, vocab_size=VOCAB, max_position_embeddings=256)).eval()
        ids, mask = torch.randint(0, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.long)
        return m, (ids, mask), ["input_ids", "attention_mask"], {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    if family == "whisper_encoder":
        cfg = tf.WhisperConfig(d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4, decoder_attention_heads=4,
                               encoder_ffn_dim=ff, decoder_ffn_dim=ff, num_mel_bins=16, max_source_positions=WHISPER_FRAMES[shape] // 2,
                               vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)  # fmt: skip
        encoder = tf.WhisperModel(cfg).eval().get_encoder()

        class Encoder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.encoder = encoder

            def forward(self, input_features):  # noqa: ANN001, ANN201
                return self.encoder(input_features).last_hidden_state

        return Encoder().eval(), (torch.randn(2, 16, WHISPER_FRAMES[shape]),), ["input_features"], {"input_features": {0: "batch"}}
    if family == "t5_encoder":
        m = tf.T5EncoderModel(tf.T5Config(d_model=hidden, d_kv=hidden // 4, d_ff=ff, num_layers=layers, num_heads=4, vocab_size=VOCAB)).eval()
        ids, mask = torch.randint(0, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.long)
        return m, (ids, mask), ["input_ids", "attention_mask"], {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    if family == "bart_decoder":
        cfg = tf.BartConfig(d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=ff, decoder_ffn_dim=ff, vocab_size=VOCAB, max_position_embeddings=256)  # fmt: skip
        decoder = tf.BartModel(cfg).eval().get_decoder()

        class Decoder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.decoder = decoder

            def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask):  # noqa: ANN001, ANN201
                return self.decoder(
                    input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask, use_cache=False
                ).last_hidden_state

        args = (torch.randint(0, VOCAB, (2, 5)), torch.randn(2, 7, hidden), torch.ones(2, 7, dtype=torch.long))
        names = ["input_ids", "encoder_hidden_states", "encoder_attention_mask"]
        return Decoder().eval(), args, names, {"input_ids": {0: "batch", 1: "seq"}, "encoder_hidden_states": {0: "batch", 1: "enc"},
                                              "encoder_attention_mask": {0: "batch", 1: "enc"}}  # fmt: skip
    return _more_models(family, shape)


def _more_models(family: str, shape: str):  # noqa: ANN202 - as _model
    import torch
    import transformers as tf

    hidden, layers, ff, image = SHAPES[shape]
    small = dict(num_hidden_layers=layers, num_attention_heads=4, intermediate_size=ff, hidden_size=hidden)
    text = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    if family == "bert":
        m = _wrap("text", tf.BertModel(tf.BertConfig(**small, vocab_size=VOCAB), add_pooling_layer=False).eval())
        return m, (torch.randint(0, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.long)), ["input_ids", "attention_mask"], text
    if family == "modernbert":
        cfg = tf.ModernBertConfig(**small, vocab_size=VOCAB, global_attn_every_n_layers=2, local_attention=4, max_position_embeddings=256,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)  # fmt: skip
        args = (torch.randint(0, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.long))
        return tf.ModernBertModel(cfg).eval(), args, ["input_ids", "attention_mask"], text
    if family == "siglip_vision":
        m = tf.SiglipVisionModel(tf.SiglipVisionConfig(**small, image_size=image, patch_size=8)).eval()
        return _wrap("pooled", m), (torch.randn(2, 3, image, image),), ["pixel_values"], {"pixel_values": {0: "batch"}}
    if family == "clip":
        towers = dict(text_config=dict(**small, vocab_size=VOCAB, max_position_embeddings=256), vision_config=dict(**small, image_size=image,
                                                                                                             patch_size=8))  # fmt: skip
        cfg = tf.CLIPConfig(**towers, projection_dim=32)
        args = (torch.randint(0, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.long), torch.randn(2, 3, image, image))
        names = ["input_ids", "attention_mask", "pixel_values"]
        return _wrap("logits", tf.CLIPModel(cfg).eval()), args, names, {**text, "pixel_values": {0: "images"}}
    if family == "t5_decoder":
        cfg = tf.T5Config(d_model=hidden, d_kv=hidden // 4, d_ff=ff, num_layers=layers, num_heads=4, vocab_size=VOCAB)
        decoder = tf.T5Model(cfg).eval().get_decoder()
        args = (torch.randint(0, VOCAB, (2, 5)), torch.randn(2, 7, hidden), torch.ones(2, 7, dtype=torch.long))
        return _wrap("decoder", decoder), args, list(_CROSS), _CROSS
    layer = torch.nn.TransformerDecoderLayer(hidden, 4, ff, dropout=0.0, batch_first=True)
    module = _wrap("torch_decoder", torch.nn.TransformerDecoder(layer, layers)) if family == "torch_decoder" else _wrap("torch_cross", hidden)
    args = (torch.randn(2, 5, hidden), torch.randn(2, 7, hidden), torch.ones(2, 7, dtype=torch.long))
    if family in ("torch_decoder", "torch_mha"):
        return module.eval(), args, list(_CROSS), _CROSS
    raise ValueError(f"unknown encoder family {family!r}; known: {', '.join(ENCODER_FAMILIES)}")


_CROSS = {"input_ids": {0: "batch", 1: "seq"}, "encoder_hidden_states": {0: "batch", 1: "enc"}, "encoder_attention_mask": {0: "batch", 1: "enc"}}
"""The inputs of the decoders and cross-attention (torch's modules take float states for ``input_ids``)."""


def _modules():  # noqa: ANN202 - the wrappers, defined once torch is imported
    import torch

    class Hidden(torch.nn.Module):
        def __init__(self, model) -> None:  # noqa: ANN001
            super().__init__()
            self.model = model

        def forward(self, *args):  # noqa: ANN002, ANN201
            return self.model(*args).last_hidden_state

    class Pooled(Hidden):
        def forward(self, pixel_values):  # noqa: ANN001, ANN201
            return self.model(pixel_values=pixel_values).pooler_output

    class Text(Hidden):
        def forward(self, input_ids, attention_mask):  # noqa: ANN001, ANN201
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    class Logits(Hidden):
        def forward(self, input_ids, attention_mask, pixel_values):  # noqa: ANN001, ANN201
            return self.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits_per_image

    class Decoder(Hidden):
        def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask):  # noqa: ANN001, ANN201
            states, mask = encoder_hidden_states, encoder_attention_mask
            return self.model(input_ids=input_ids, encoder_hidden_states=states, encoder_attention_mask=mask, use_cache=False).last_hidden_state

    class TorchDecoder(Hidden):
        def forward(self, x, memory, memory_mask):  # noqa: ANN001, ANN201
            causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.model(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=memory_mask == 0)

    class TorchCross(torch.nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(hidden, 4, batch_first=True)

        def forward(self, x, memory, memory_mask):  # noqa: ANN001, ANN201
            return self.attention(x, memory, memory, key_padding_mask=memory_mask == 0, need_weights=False)[0]

    return Hidden, Pooled, Text, Logits, Decoder, TorchDecoder, TorchCross


def _wrap(kind: str, arg):  # noqa: ANN001, ANN202 - a wrapper module (hidden, logits, decoder, torch_decoder, torch_cross) around arg
    names = ("hidden", "pooled", "text", "logits", "decoder", "torch_decoder", "torch_cross")
    return _modules()[names.index(kind)](arg).eval()


def _export(family: str, exporter: str, path: Path, shape: str) -> None:
    import torch

    torch.manual_seed(0)
    model, args, names, axes = _model(family, shape)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(model, args, str(path), dynamo=True, input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes)
        else:
            axes = {**axes, "last_hidden_state": {0: "images", 1: "batch"} if family == "clip" else {0: "batch"}}
            out = ["last_hidden_state"]
            torch.onnx.export(model, args, str(path), dynamo=False, input_names=names, output_names=out, dynamic_axes=axes, opset_version=18)


_EXPORTED: dict[tuple, Path] = {}
_CACHE_DIR = tempfile.TemporaryDirectory(prefix="graphc-encoder-exports-")


def export_encoder(family: str, exporter: str, path: str | Path, shape: str = "tiny") -> Path:
    """Export one model of :data:`SHAPES` ``shape`` to ``path`` (once per test run: later requests copy the first file;
    the test processes of a run share them through ``$GRAPHC_TEST_EXPORTS``, one lock a model, as
    ``tests/real_exports.py`` does)."""
    key = ("encoder", family, exporter, shape)
    shared = os.environ.get("GRAPHC_TEST_EXPORTS")
    if shared and fcntl is not None:
        stored = Path(shared) / f"{hashlib.sha1(repr(key).encode()).hexdigest()}.onnx"
        with open(f"{stored}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _export_or_copy(family, exporter, Path(path), stored, shape)
    return _export_or_copy(family, exporter, Path(path), _EXPORTED.setdefault(key, Path(_CACHE_DIR.name) / f"{len(_EXPORTED)}.onnx"), shape)


def _export_or_copy(family: str, exporter: str, path: Path, stored: Path, shape: str) -> Path:
    if stored.exists():
        shutil.copyfile(stored, path)
        return path
    _export(family, exporter, path, shape)
    if not Path(f"{path}.data").exists():
        shutil.copyfile(path, stored)
    return path


def feeds(family: str, seed: int = 0, shape: str = "tiny", sizes: tuple[int, int, int] | None = None) -> dict[str, np.ndarray]:
    """Inputs at ``sizes`` (batch, sequence, encoder length; default :data:`SIZES`, never traced) for a model of
    ``shape``; the first row padded (its first two positions) where a mask is taken."""
    rng = np.random.default_rng(seed)
    batch, seq, enc = sizes or SIZES[family]
    hidden, image = SHAPES[shape][0], SHAPES[shape][3]
    if family in ("vit", "siglip_vision"):
        return {"pixel_values": rng.standard_normal((batch, 3, image, image)).astype(np.float32)}
    if family == "whisper_encoder":
        return {"input_features": rng.standard_normal((batch, 16, WHISPER_FRAMES[shape])).astype(np.float32)}
    ids = rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)
    if family in ("torch_decoder", "torch_mha"):
        ids = rng.standard_normal((batch, seq, hidden)).astype(np.float32)
    if family in ("bart_decoder", "t5_decoder", "torch_decoder", "torch_mha"):
        mask = np.ones((batch, enc), np.int64)
        mask[0, :2] = 0
        states = rng.standard_normal((batch, enc, hidden)).astype(np.float32)
        return {"input_ids": ids, "encoder_hidden_states": states, "encoder_attention_mask": mask}
    mask = np.ones((batch, seq), np.int64)
    mask[0, :2] = 0
    if family == "clip":
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": rng.standard_normal((2, 3, image, image)).astype(np.float32)}
    return {"input_ids": ids, "attention_mask": mask}
