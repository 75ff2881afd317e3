"""Import an ONNX attention model, remove its K/V copy, re-export it, check it on onnxruntime.

    python examples/onnx_import.py

The model is written here with onnx.helper the way torch.onnx exports
transformers' attention: q/k/v projections, head splits computed from
``Shape``, ``repeat_kv`` as Unsqueeze/Expand/Reshape (a copy of K and V for
every query head), a scaled QK^T, softmax, PV, output projection; batch and
sequence are dynamic.  graphc folds the shape computations into symbolic dims,
turns the Expand into a grouped einsum, and writes ONNX again with the same
input/output names and dynamic axes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import graphc
from graphc.onnx_import import from_onnx
from lowering.exporter.onnx_export import export

D, HEADS, KV, HD = 64, 8, 2, 8


def build_model() -> onnx.ModelProto:
    """A Llama-style GQA attention layer in the form torch.onnx emits."""
    rng = np.random.default_rng(0)
    w = {
        n: numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(D)).astype(np.float32), n)
        for n, s in (("wq", (D, HEADS * HD)), ("wk", (D, KV * HD)), ("wv", (D, KV * HD)), ("wo", (HEADS * HD, D)))
    }
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    consts = [
        ints("i0", 0),
        ints("i1", 1),
        ints("ax0", [0]),
        ints("ax2", [2]),
        ints("hq", [HEADS, HD]),
        ints("hkv", [KV, HD]),
        ints("rep", [1, 1, HEADS // KV, 1, 1]),
        ints("merge", [0, HEADS, -1, HD]),
        ints("out_shape", [0, 0, HEADS * HD]),
        numpy_helper.from_array(np.array(np.sqrt(HD), np.float32), "sqrt_d"),
    ]
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["shape"]),
        n("Gather", ["shape", "i0"], ["b"]),
        n("Gather", ["shape", "i1"], ["s"]),
        n("Unsqueeze", ["b", "ax0"], ["b1"]),
        n("Unsqueeze", ["s", "ax0"], ["s1"]),
        n("Concat", ["b1", "s1", "hq"], ["q_shape"], axis=0),
        n("Concat", ["b1", "s1", "hkv"], ["kv_shape"], axis=0),
        n("MatMul", ["x", "wq"], ["q_proj"]),
        n("Reshape", ["q_proj", "q_shape"], ["q_bshd"]),
        n("Transpose", ["q_bshd"], ["q"], perm=[0, 2, 1, 3]),
    ]
    for t in ("k", "v"):  # projection, head split, then repeat_kv as Unsqueeze -> Expand -> Reshape
        nodes += [
            n("MatMul", ["x", f"w{t}"], [f"{t}_proj"]),
            n("Reshape", [f"{t}_proj", "kv_shape"], [f"{t}_bshd"]),
            n("Transpose", [f"{t}_bshd"], [t], perm=[0, 2, 1, 3]),
            n("Unsqueeze", [t, "ax2"], [f"{t}_u"]),
            n("Shape", [f"{t}_u"], [f"{t}_u_shape"]),
            n("Mul", [f"{t}_u_shape", "rep"], [f"{t}_target"]),
            n("Expand", [f"{t}_u", f"{t}_target"], [f"{t}_e"]),
            n("Reshape", [f"{t}_e", "merge"], [f"{t}_rep"]),
        ]
    nodes += [
        n("Transpose", ["k_rep"], ["k_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "k_t"], ["scores"]),
        n("Div", ["scores", "sqrt_d"], ["scaled"]),
        n("Softmax", ["scaled"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v_rep"], ["ctx"]),
        n("Transpose", ["ctx"], ["ctx_bshd"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx_bshd", "out_shape"], ["ctx_flat"]),
        n("MatMul", ["ctx_flat", "wo"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "llama_style_attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", D])],
        list(w.values()) + consts,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def main() -> None:
    """Import, optimize, re-export and compare with onnxruntime on the original."""
    model = build_model()
    g = from_onnx(model, strict=True)
    print(f"imported: {g.op_counts()}")
    result = graphc.optimize(g)
    print(f"optimized: {result.graph.op_counts()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "attention.opt.onnx"
        rewritten = export(result.graph, path, opset=18)
        x = np.random.default_rng(1).standard_normal((2, 11, D)).astype(np.float32)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    print(
        f"Expand nodes: {sum(n.op_type == 'Expand' for n in model.graph.node)} before, {sum(n.op_type == 'Expand' for n in rewritten.graph.node)} "
        f"after"
    )
    print(
        f"interface kept: {[i.name for i in rewritten.graph.input]} -> {[o.name for o in rewritten.graph.output]}, "
        f"dims {[d.dim_param or d.dim_value for d in rewritten.graph.input[0].type.tensor_type.shape.dim]}"
    )
    print(f"max abs difference on onnxruntime at batch 2, seq 11: {np.abs(got - want).max():.2e}")


if __name__ == "__main__":
    main()
