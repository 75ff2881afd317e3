"""Encoders and encoder-decoder parts as torch.onnx writes them: imported, understood and equal to onnxruntime.

Each tiny model (:mod:`encoder_exports`) by its exporters (``EXPORTERS``): the file imports, every attention block is one
``Attention`` with the visibility the model means, no softmax is left unexplained, and graphc (NumPy, and onnxruntime
on its re-export) equals onnxruntime on the file at sizes never traced, a padded row included.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
import onnxruntime as ort  # noqa: E402
from encoder_exports import ENCODER_FAMILIES, EXPORTERS, export_encoder, feeds  # noqa: E402

from graphc import Visibility  # noqa: E402
from graphc.onnx_import import from_onnx  # noqa: E402
from graphc.optimizer import KEEP_EVERY_ATTENTION, lower, optimize, unfused_softmaxes  # noqa: E402
from lowering import run  # noqa: E402

pytestmark = [  # T5's position buckets take log(0) and cast its -inf (a branch its Where does not pick), as the model does
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
]

EXPECTED = {
    "vit": [False] * 2,
    "clip_text": [True] * 2,
    "whisper_encoder": [False] * 2,
    "bart_decoder": [True, False, True, False],  # per layer: causal self-attention, then cross-attention
    "t5_encoder": [False] * 2,
    "t5_decoder": [True, False, True, False],  # Where(causal, relative bias, fill): causal, the bias the additive term
    "siglip_vision": [False] * 3,  # two layers and the pooling head's one learned query
    "clip": [False] * 2 + [True] * 2,  # the vision tower, then the text tower
    "torch_decoder": [True, False, True, False],
    "torch_mha": [False],
    "bert": [False] * 2,
    "modernbert": [False, True],  # global, then a local layer: |i - j| <= 2 read as the band i-2..i+2 (a shifted causal window)
}
"""Per family, whether each attention (in graph order) is causal."""


@pytest.mark.parametrize("family, exporter", [(f, e) for f in ENCODER_FAMILIES for e in EXPORTERS[f]])
def test_encoders_import_understood_and_equal_to_onnxruntime(family, exporter, tmp_path):
    path = export_encoder(family, exporter, tmp_path / f"{family}.onnx")
    graph = from_onnx(path)
    optimized = optimize(graph).graph
    kept = lower(optimized, KEEP_EVERY_ATTENTION)
    ops = [n.op for n in kept.topological_order() if n.op.kind == "Attention"]
    assert [op.visibility.is_causal for op in ops] == EXPECTED[family], [op.visibility for op in ops]
    assert all(op.visibility.aligned_to(0) for op in ops if op.visibility.is_causal and family != "modernbert")  # the offset: no past
    if family == "t5_encoder":  # the relative-position bias with the padding in it: the additive term
        assert {op.visibility for op in ops} == {Visibility(mask="additive")}
    if family == "modernbert":
        assert (ops[1].visibility.causal_offset, ops[1].visibility.window) == (2, 5)
    if family == "t5_decoder":  # the self-attention's bias (the cross-attention's: the encoder's padding)
        assert [op.visibility for op in ops][::2] == [Visibility(causal_offset=0, mask="additive")] * 2
    assert unfused_softmaxes(kept, lowered=True) == []
    f = feeds(family)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, f)[0]
    for backend in ("numpy", "ort-cpu"):
        got = run(optimized, f, backend)[optimized.outputs[0]]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"{backend}")
