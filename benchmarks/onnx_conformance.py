"""Run onnx's Attention backend test cases through graphc.from_onnx on every backend; print a Markdown table.

    python benchmarks/onnx_conformance.py [--backends numpy,onnx-reference,ort-cpu]

One row per non-expanded case (93 with onnx 1.23): its opset, what it
exercises (input rank, GQA, mask rank/dtype, cache, attributes) and the result
on each backend against the outputs onnx ships with the case (float32:
rtol 1e-3, atol 1e-7 as onnx's backend runner; float16/bfloat16: 2e-2), as
imported and after graphc's optimizer.  ``tests/test_onnx_conformance.py``
asserts the same.  Also runs onnxruntime's own ``Attention`` kernel on each
case's original model, for comparison.
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import onnx

from graphc import optimize
from graphc.onnx_import import from_onnx
from lowering import run

TOL = {"float": dict(rtol=1e-3, atol=1e-7), "low": dict(rtol=2e-2, atol=2e-2)}
DTYPES = {1: "fp32", 10: "fp16", 16: "bf16"}


def _features(model: onnx.ModelProto) -> str:
    node = model.graph.node[0]
    types = {vi.name: vi.type.tensor_type for vi in model.graph.input}
    q = types[node.input[0]]
    k = types[node.input[1]]
    feats = [f"{len(q.shape.dim)}D", DTYPES.get(q.elem_type, str(q.elem_type))]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    heads = attrs.get("q_num_heads", q.shape.dim[1].dim_value if len(q.shape.dim) == 4 else None)
    kv = attrs.get("kv_num_heads", k.shape.dim[1].dim_value if len(k.shape.dim) == 4 else None)
    if heads and kv and heads != kv:
        feats.append(f"GQA {heads}/{kv}")
    names = list(node.input) + [""] * 7
    if names[3]:
        m = types[names[3]]
        feats.append(f"mask {len(m.shape.dim)}D {'bool' if m.elem_type == 9 else DTYPES.get(m.elem_type, '?')}")
    if names[4]:
        feats.append("past/present")
    if names[6]:
        feats.append("nonpad_kv_seqlen")
    for key, label in (
        ("is_causal", "causal"),
        ("softcap", "softcap"),
        ("scale", "scale"),
        ("qk_matmul_output_mode", "qk mode"),
        ("softmax_precision", "softmax_precision"),
        ("left_window_size", "left window"),
        ("right_window_size", "right window"),
    ):
        if key in attrs and attrs[key] not in (0, -1):
            feats.append(label if key == "is_causal" else f"{label} {attrs[key]:g}" if isinstance(attrs[key], float) else f"{label} {attrs[key]}")
    if len(model.graph.output) > 1 and not names[4]:
        feats.append(f"{len(model.graph.output)} outputs")
    return ", ".join(feats)


def _check(model: onnx.ModelProto, data: tuple, backend: str, optimized: bool) -> str:
    try:
        g = from_onnx(model, strict=True)
        if optimized:
            g = optimize(g).graph
        inputs, expected = data
        feeds = {vi.name: x for vi, x in zip(model.graph.input, inputs)}
        got = run(g, feeds, backend=backend)
        for vi, want in zip(model.graph.output, expected):
            tol = TOL["float"] if want.dtype in (np.float32, np.float64) else TOL["low"]
            np.testing.assert_allclose(np.asarray(got[vi.name], np.float64), np.asarray(want, np.float64), **tol)
        return "pass"
    except AssertionError:
        return "MISMATCH"
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"error: {type(e).__name__}"


def _ort_kernel(model: onnx.ModelProto, data: tuple) -> str:
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        inputs, expected = data
        got = session.run(None, {vi.name: x for vi, x in zip(model.graph.input, inputs)})
        for g, want in zip(got, expected):
            tol = TOL["float"] if want.dtype in (np.float32, np.float64) else TOL["low"]
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(want, np.float64), **tol)
        return "pass"
    except AssertionError:
        return "mismatch"
    except Exception:  # noqa: BLE001 - the kernel refuses the case
        return "fails"


def main() -> None:
    """Print the conformance table and the totals."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="numpy,onnx-reference,ort-cpu")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases

        cases = sorted(
            (
                c
                for c in collect_testcases()
                if "expanded" not in c.name and len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type == "Attention"
            ),
            key=lambda c: c.name,
        )
    import onnxruntime as ort

    header = (
        ["case", "opset", "exercises"]
        + [f"graphc {b}" for b in backends]
        + ["graphc optimized, ort-cpu", f"onnxruntime {ort.__version__} Attention kernel"]
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    totals = [0] * (len(backends) + 2)
    for c in cases:
        opset = next(o.version for o in c.model.opset_import if o.domain in ("", "ai.onnx"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = [_check(c.model, c.data_sets[0], b, False) for b in backends] + [
                _check(c.model, c.data_sets[0], "ort-cpu", True),
                _ort_kernel(c.model, c.data_sets[0]),
            ]
        totals = [t + (r == "pass") for t, r in zip(totals, results)]
        print(f"| `{c.name.removeprefix('test_')}` | {opset} | {_features(c.model)} | " + " | ".join(results) + " |")
    print("| **passed** | | | " + " | ".join(f"**{t}/{len(cases)}**" for t in totals) + " |")


if __name__ == "__main__":
    main()
