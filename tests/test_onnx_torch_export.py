"""torch.onnx exports of HF-style attention, imported, optimized and re-exported by graphc.

The modules are written here the way Llama and Mistral write them (q/k/v/o
projections, RoPE with rotate_half, ``repeat_kv`` as expand + reshape, an
additive causal mask from ``full(-inf).triu``, Mistral's sliding window from
``tril``, softmax in float32), plus transformers' own ``LlamaAttention``.
Each is exported by torch.onnx (dynamo and the legacy TorchScript exporter)
with dynamic batch and sequence, with and without a KV cache.  graphc must
import it without opaque nodes, remove the K/V repeat (no Expand in the
re-exported model), agree with torch at sizes other than the traced ones, and
keep the model's input/output names and dynamic axes.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from graphc import optimize  # noqa: E402
from graphc.cli import main  # noqa: E402
from graphc.onnx_import import from_onnx  # noqa: E402
from lowering import run  # noqa: E402
from lowering.exporter.onnx_export import export  # noqa: E402

HIDDEN, HEADS, KV_HEADS = 64, 8, 2
HEAD_DIM = HIDDEN // HEADS


def _rotate_half(x: "torch.Tensor") -> "torch.Tensor":
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _repeat_kv(x: "torch.Tensor", n_rep: int) -> "torch.Tensor":  # transformers' repeat_kv
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class HFStyleAttention(torch.nn.Module):
    """Llama attention (``window=None``) or Mistral's sliding-window attention, with an optional KV cache."""

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.q_proj = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), persistent=False)

    def forward(self, x, past_key=None, past_value=None):  # type: ignore[no-untyped-def]
        b, s, _ = x.shape
        past = past_key.shape[2] if past_key is not None else 0
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        positions = torch.arange(past, past + s, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past_key is not None:
            k = torch.cat([past_key, k], dim=2)
            v = torch.cat([past_value, v], dim=2)
        present_k, present_v = k, v
        k, v = _repeat_kv(k, HEADS // KV_HEADS), _repeat_kv(v, HEADS // KV_HEADS)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HEAD_DIM)
        t = k.shape[2]
        mask = torch.full((s, t), float("-inf")).triu(t - s + 1)
        if self.window is not None:
            mask = mask + torch.full((s, t), float("-inf")).tril(t - s - self.window)
        p = torch.softmax((scores + mask).float(), dim=-1).to(q.dtype)
        out = self.o_proj(torch.matmul(p, v).transpose(1, 2).reshape(b, s, HIDDEN))
        return (out, present_k, present_v) if past_key is not None else out


def _export(module: "torch.nn.Module", path: Path, dynamo: bool, cache: bool) -> None:
    x = torch.randn(2, 5, HIDDEN)
    args = (x, torch.randn(2, KV_HEADS, 3, HEAD_DIM), torch.randn(2, KV_HEADS, 3, HEAD_DIM)) if cache else (x,)
    names = ["x", "past_key", "past_value"] if cache else ["x"]
    outputs = ["out", "present_key", "present_value"] if cache else ["out"]
    if dynamo:
        pytest.importorskip("onnxscript")
        batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
        shapes = {"x": {0: batch, 1: seq}}
        if cache:
            shapes.update(past_key={0: batch, 2: past}, past_value={0: batch, 2: past})
        torch.onnx.export(module, args, str(path), dynamo=True, input_names=names, output_names=outputs, dynamic_shapes=shapes, verbose=False)
    else:
        axes = {"x": {0: "batch", 1: "seq"}}
        if cache:
            axes.update(past_key={0: "batch", 2: "past"}, past_value={0: "batch", 2: "past"})
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=18, input_names=names, output_names=outputs, dynamic_axes=axes)


def _interface(model: "onnx.ModelProto") -> list[tuple[str, list[object]]]:
    def dims(vi: "onnx.ValueInfoProto") -> list[object]:
        return [d.dim_param.replace(" ", "") if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]

    return [(vi.name, dims(vi)) for vi in (*model.graph.input, *model.graph.output)]


def _same_dims(a: list[object], b: list[object]) -> bool:
    from graphc.dims import normalize_dim

    return [normalize_dim(x) for x in a] == [normalize_dim(x) for x in b]


@pytest.mark.parametrize("cache", [False, True], ids=["prefill", "kv-cache"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_torch_export_imports_groups_and_round_trips(tmp_path: Path, exporter: str, arch: str, cache: bool) -> None:
    torch.manual_seed(0)
    module = HFStyleAttention(window=3 if arch == "mistral" else None).eval()
    path = tmp_path / "attn.onnx"
    _export(module, path, exporter == "dynamo", cache)
    original = onnx.load(str(path))
    assert any(n.op_type == "Expand" for n in original.graph.node), "the export should carry repeat_kv as Expand"

    g = from_onnx(path, strict=True)  # every op modelled: nothing opaque
    optimized = optimize(g).graph
    assert "Repeat" not in optimized.op_counts(), "the K/V repeat must become a grouped einsum"
    from lowering.exporter.targets import target_named

    _, report = optimize(g, target=target_named("numpy"))  # recognised as one attention: causal, window, cache
    (fused,) = [f.detail for f in report.trace.fired if f.rule == "fuse_attention"]
    assert "group=4" in fused and ("causal (offset past" if cache else "causal (offset 0)") in fused
    assert ("window 3" in fused) == (arch == "mistral") and ("KV cache past_key, past_value" in fused) == cache
    if arch == "llama":
        exported = export(optimized, tmp_path / "fused.onnx", attention="onnx-attention")
        assert [n.op_type for n in exported.graph.node].count("Attention") == 1

    x = torch.randn(3, 7, HIDDEN)  # sizes other than the traced ones
    pk, pv = torch.randn(3, KV_HEADS, 6, HEAD_DIM), torch.randn(3, KV_HEADS, 6, HEAD_DIM)
    with torch.no_grad():
        want = module(x, pk, pv) if cache else (module(x),)
    feeds = {"x": x.numpy()} | ({"past_key": pk.numpy(), "past_value": pv.numpy()} if cache else {})
    for backend in ("numpy", "ort-cpu"):
        got = run(optimized, feeds, backend=backend)
        for name, ref in zip(optimized.outputs, want):
            np.testing.assert_allclose(got[name], ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"{backend} {name}")

    out = tmp_path / "attn.opt.onnx"
    assert main(["optimize", str(path), "-o", str(out), "--quiet"]) == 0
    rewritten = onnx.load(str(out))
    assert not any(n.op_type == "Expand" for n in rewritten.graph.node)
    assert [n for n, _ in _interface(rewritten)] == [n for n, _ in _interface(original)]
    n_inputs = len(original.graph.input)
    for i, ((_, a), (_, b)) in enumerate(zip(_interface(rewritten), _interface(original))):
        if i < n_inputs:
            assert _same_dims(a, b)  # inputs: the same dynamic axes, by name
        else:  # outputs: the legacy exporter names output axes arbitrarily ('Concatpresent_key_dim_2'); graphc writes the expression
            assert len(a) == len(b) and [isinstance(x, int) for x in a] == [isinstance(x, int) for x in b]
            assert [x for x in a if isinstance(x, int)] == [x for x in b if isinstance(x, int)]

    import onnxruntime as ort

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    results = session.run(None, feeds)
    for got_arr, ref in zip(results, want):
        np.testing.assert_allclose(got_arr, ref.numpy(), rtol=1e-4, atol=1e-5)


def test_transformers_llama_attention_export(tmp_path: Path) -> None:
    """transformers' own LlamaAttention (eager), exported by dynamo with an additive mask input of its own name."""
    pytest.importorskip("onnxscript")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaAttention

    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = LlamaAttention(cfg, layer_idx=0).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = attention

        def forward(self, hidden, cos, sin, causal_bias):  # type: ignore[no-untyped-def]
            return self.attention(hidden, (cos, sin), causal_bias)[0]

    wrapper = Wrapper()
    b, s = torch.export.Dim("batch"), torch.export.Dim("seq")
    args = (torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HEAD_DIM), torch.randn(2, 5, HEAD_DIM), torch.zeros(2, 1, 5, 5))
    path = tmp_path / "llama_attention.onnx"
    torch.onnx.export(
        wrapper,
        args,
        str(path),
        dynamo=True,
        input_names=["hidden", "cos", "sin", "causal_bias"],
        output_names=["out"],
        dynamic_shapes={"hidden": {0: b, 1: s}, "cos": {0: b, 1: s}, "sin": {0: b, 1: s}, "causal_bias": {0: b, 2: s, 3: s}},
    )
    imported = from_onnx(path, strict=True)
    optimized = optimize(imported).graph
    assert "Repeat" not in optimized.op_counts()
    from lowering.exporter.targets import target_named

    _, report = optimize(imported, target=target_named("numpy"))  # the mask input has its own name; attention is still recognised
    assert [f.detail for f in report.trace.fired if f.rule == "fuse_attention"] == [
        "attention recognised: scale=0.353553, group=4, not causal, additive mask 'causal_bias'"
    ]
    hidden, cos, sin = torch.randn(3, 7, HIDDEN), torch.randn(3, 7, HEAD_DIM), torch.randn(3, 7, HEAD_DIM)
    bias = torch.triu(torch.full((7, 7), float("-inf")), 1).expand(3, 1, 7, 7).contiguous()
    with torch.no_grad():
        want = wrapper(hidden, cos, sin, bias).numpy()
    feeds = {"hidden": hidden.numpy(), "cos": cos.numpy(), "sin": sin.numpy(), "causal_bias": bias.numpy()}
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_allclose(run(optimized, feeds, backend=backend)["out"], want, rtol=1e-4, atol=1e-5)


class _InPlaceMask(torch.nn.Module):
    """transformers' masks before 4.58: padding written into a slice of the causal mask in place (a ScatterND)."""

    def forward(self, causal: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        mask = causal.clone()
        n = attention_mask.shape[-1]
        padding = (mask[:, :, :, :n] + attention_mask[:, None, None, :]) == 0
        mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(padding, -1e9)
        return mask * 2


@pytest.mark.parametrize("whole", [True, False])
def test_an_in_place_slice_write_over_every_position_is_its_updates(tmp_path, whole):
    """A ScatterND whose indices are the grid of every position and whose updates have the data's shape is read as the
    updates (graphc then sees the mask as written); one that writes part of its data stays a ScatterND.  Both give
    onnxruntime's numbers on the file at sizes other than the traced ones."""
    import onnxruntime as ort

    path = tmp_path / "mask.onnx"
    keys = "t" if whole else "t_all"  # the slice [:n] covers the causal mask's keys when they are the attention mask's
    axes = {"causal": {0: "b", 2: "s", 3: keys}, "attention_mask": {0: "b", 1: "t"}}
    args = (torch.randn(2, 1, 3, 5 if whole else 7), torch.ones(2, 5, dtype=torch.int64))
    torch.onnx.export(_InPlaceMask(), args, str(path), dynamo=False, input_names=list(axes), output_names=["y"], dynamic_axes=axes, opset_version=18)
    g = from_onnx(path)
    optimized = optimize(g).graph
    assert ("Opaque" in {n.op.kind for n in optimized.nodes.values()}) == (not whole)
    rng = np.random.default_rng(0)
    t = 6
    feeds = {"causal": rng.choice([0.0, -3e38], (3, 1, 4, t if whole else t + 2)).astype(np.float32), "attention_mask": rng.integers(0, 2, (3, t))}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    for backend in ("numpy", "ort-cpu"):
        np.testing.assert_array_equal(run(optimized, feeds, backend=backend)["y"], want)


class _OldMaskAttention(torch.nn.Module):
    """Attention over a KV cache with transformers' causal mask before 4.58 (``_prepare_4d_causal_attention_mask_with_cache_position``,
    as optimum still exports OPT, GPT-J and StableLM): a Trilu of the fill times the keys after each query's position,
    then the padded keys filled in place."""

    def forward(self, q, k, v, past_k, past_v, attention_mask):  # noqa: ANN001, ANN201
        k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        seq, total = q.shape[2], k.shape[2]
        position = torch.arange(total - seq, total)
        fill = torch.finfo(torch.float32).min
        causal = torch.triu(torch.full((seq, total), fill), diagonal=1)
        causal = causal * (torch.arange(total) > position.reshape(-1, 1))
        causal = causal[None, None, :, :].expand(q.shape[0], 1, -1, -1).clone()
        n = attention_mask.shape[-1]
        padding = (causal[:, :, :, :n] + attention_mask[:, None, None, :]) == 0
        causal[:, :, :, :n] = causal[:, :, :, :n].masked_fill(padding, fill)
        scores = q @ k.transpose(2, 3) * q.shape[-1] ** -0.5 + causal
        return torch.softmax(scores, -1) @ v, k, v


def test_transformers_old_causal_mask_is_one_causal_attention_with_its_cache_and_padding(tmp_path):
    """The pre-4.58 mask reads as the op's causal offset (the past length), the cache as its KV cache and the padded keys
    as a bool mask: one ``Attention``, with onnxruntime's numbers on the file at other sizes, a fully padded row included."""
    import onnxruntime as ort

    from graphc.optimizer import Target, lower

    path = tmp_path / "old_mask.onnx"
    names = ["q", "k", "v", "past_k", "past_v", "attention_mask"]
    axes = {n: {0: "b", 2: "s"} for n in ("q", "k", "v")} | {n: {0: "b", 2: "p"} for n in ("past_k", "past_v")}
    axes["attention_mask"] = {0: "b", 1: "p + s"}  # as optimum names it: graphc reads the sum
    args = (*(torch.randn(2, 4, 3, 8) for _ in range(3)), *(torch.randn(2, 4, 5, 8) for _ in range(2)), torch.ones(2, 8, dtype=torch.int64))
    torch.onnx.export(_OldMaskAttention(), args, str(path), dynamo=False, input_names=names, output_names=["y", "present_k", "present_v"],
                      dynamic_axes=axes, opset_version=18)  # fmt: skip
    g = from_onnx(path)
    optimized = optimize(g).graph
    ops = [n.op for n in lower(optimized, Target("keep", lambda graph, node, ctx: None)).topological_order() if n.op.kind == "Attention"]
    assert [(op.visibility.causal_offset, op.kv_cache, op.mask) for op in ops] == [("p", True, "bool")], ops
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, seq, past in ((3, 1, 9), (2, 4, 6), (1, 6, 0)):
        feeds = {n: rng.standard_normal((batch, 4, seq, 8)).astype(np.float32) for n in ("q", "k", "v")}
        feeds |= {n: rng.standard_normal((batch, 4, past, 8)).astype(np.float32) for n in ("past_k", "past_v")}
        mask = np.ones((batch, past + seq), np.int64)
        mask[0, : past + seq - 1 if batch > 1 else 0] = 0  # row 0 left-padded (its queries but the last see no key)
        feeds["attention_mask"] = mask
        want = session.run(None, feeds)
        for backend in ("numpy", "ort-cpu"):
            got = run(optimized, feeds, backend=backend)
            for name, w in zip(("y", "present_k", "present_v"), want):
                np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5, err_msg=f"{backend} {name} {batch, seq, past}")
