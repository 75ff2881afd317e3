"""Export a preset's GQA attention layer to ONNX and run it on onnxruntime.

    python examples/export_onnx.py [preset] [out.onnx]

The layer is optimized first (the KV-head repeat becomes a grouped einsum that
lowers to Reshape + MatMul), exported with dynamic batch and sequence axes,
checked by onnx.checker, then run on onnxruntime's CPU provider and compared
with the NumPy interpreter.
"""

import sys
import time

import numpy as np
import onnx

import graphc
from lowering import export, prepare, random_inputs


def main(name: str = "mistral-7b", path: str = "attention.onnx") -> None:
    """Optimize, export, check and run the attention layer of preset ``name``."""
    cfg = graphc.preset(name)
    graph, report = graphc.optimize(graphc.attention_layer_graph(cfg, seed=0), hints={"batch": 1, "seq": 128})
    model = export(graph, path)
    onnx.checker.check_model(model, full_check=True)
    ops = sorted({n.op_type for n in model.graph.node})
    print(f"wrote {path}: opset {model.opset_import[0].version}, IR {model.ir_version}, ops {', '.join(ops)}")
    print(f"repeated K/V bytes before/after optimization: {report.before.repeat_bytes:,} / {report.after.repeat_bytes:,}")

    feeds = random_inputs(graph, seed=0, batch=1, seq=128)
    ort_cpu = prepare(graph, "ort-cpu")
    ort_cpu.run(feeds)
    t0 = time.perf_counter()
    out = ort_cpu.run(feeds)["out_BSM"]
    ms = 1e3 * (time.perf_counter() - t0)
    ref = prepare(graph, "numpy", compute_dtype="float64").run(feeds)["out_BSM"]
    print(f"{ort_cpu.provider}: out {out.shape} in {ms:.1f} ms, max |ort - numpy float64| = {np.abs(out - ref).max():.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
