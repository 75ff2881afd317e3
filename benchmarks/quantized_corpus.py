"""Quantized and float16 files, as the tools users quantize with write them, checked with graphc: every route, family.

Each file comes from the tiny random-weight models of ``benchmarks/real_exports_corpus.py`` (hidden 256; ``qwen2+tied``
ties its embedding to the LM head):

- ``genai-int4``: onnxruntime-genai 0.18's builder, ``-p int4 -e cpu`` (``MatMulNBits``, block 32, accuracy level 4; a
  tied table as ``GatherBlockQuantized``), in its venv;
- ``optimum-int8``: optimum's ``text-generation-with-past`` export quantized by ``ORTQuantizer`` with
  ``AutoQuantizationConfig.avx2(is_static=False)`` (``optimum-cli onnxruntime quantize --avx2``), in its venv;
- from optimum's float export, by onnxruntime's own tools here: ``nbits-int4`` (``matmul_nbits_quantizer``: block 32,
  symmetric), ``qdq-int4`` (the same in its QDQ format: ``DequantizeLinear`` of ``INT4`` weights), ``dynamic-int8``
  (``quantize_dynamic``), ``fused-int8`` (that file as onnxruntime's optimizer saves it: ``DynamicQuantizeMatMul``,
  ``MatMulIntegerToFloat``), ``static-qdq`` (``quantize_static``, QDQ, its products, calibrated on three prompts), ``fp16``
  (onnxruntime's float16 converter, float32 inputs and outputs kept).

Per file: imported, optimized and run by graphc (numpy, ort-cpu, and graphc's re-export at the file's opset, 18 at
least, on onnxruntime) against
onnxruntime on the file at the sizes of ``real_exports_corpus``; the attention ops recognised; and whether the re-export
keeps the weights quantized (its float initializers hold no more bytes than the file's).  The tolerance is
``1e-4 + 1e-3 |want|``, plus, where onnxruntime rounds activations the file's way and graphc's NumPy backend computes
the products exactly (int8 activations: ``DynamicQuantizeLinear``, accuracy level 4) or in float16, a budget of 2%
(1% for float16) of the output's largest value: the file's own quantization error.  One row a file::

    python benchmarks/quantized_corpus.py [--work DIR] [--routes genai-int4,...] [--families llama,...]

writes ``docs/bench/quantized_corpus.md``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from real_exports_corpus import check, export, feeds, head_dim  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen2+tied", "mistral", "phi3", "gpt2")
ROUTES = ("genai-int4", "optimum-int8", "nbits-int4", "qdq-int4", "dynamic-int8", "fused-int8", "static-qdq", "fp16")
BUDGET = {"genai-int4": 0.02, "optimum-int8": 0.02, "qdq-int4": 0.02, "dynamic-int8": 0.02, "fused-int8": 0.02, "static-qdq": 0.02, "fp16": 0.01}
"""Each route's own error budget, a fraction of the output's largest value (see the module doc); 0 elsewhere."""


def _tool_export(work: Path, tool: str, family: str) -> Path:
    """``family`` exported by ``tool`` in its venv (:func:`real_exports_corpus.export`); the model file, or the tool's
    error raised."""
    model, why = export(work, tool, family)
    if model is None:
        raise RuntimeError(why)
    return model


def _derived(work: Path, route: str, family: str, size: int) -> Path:
    """optimum's float export of ``family`` through onnxruntime's tool for ``route`` (``size``: its head size, for the
    calibration prompts); the model file."""
    import onnx
    import onnxruntime as ort

    source = _tool_export(work, "optimum", family)
    out = work / "models" / f"{family}-{route}" / "model.onnx"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if route in ("nbits-int4", "qdq-int4"):
        from onnxruntime.quantization import QuantFormat
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

        fmt = QuantFormat.QDQ if route == "qdq-int4" else QuantFormat.QOperator
        quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), algo_config=DefaultWeightOnlyQuantConfig(block_size=32, quant_format=fmt))
        quantizer.process()
        onnx.save(quantizer.model.model, str(out))
    elif route in ("dynamic-int8", "fused-int8"):
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(source), str(out), weight_type=QuantType.QInt8)
        if route == "fused-int8":
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            options.optimized_model_filepath = str(out)
            ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    elif route == "static-qdq":
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

        model = onnx.load(str(source))
        prompts = iter([feeds(model, 1, n, 0, 0, size) for n in (5, 9, 3)])

        class Prompts(CalibrationDataReader):
            def get_next(self) -> dict | None:
                return next(prompts, None)

        # the products only: quantizing every op type writes a QuantizeLinear onnxruntime itself rejects (an Expand's output)
        quantize_static(str(source), str(out), Prompts(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul", "Gemm"])
    elif route == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        onnx.save(convert_float_to_float16(onnx.load(str(source)), keep_io_types=True), str(out))
    else:
        raise ValueError(f"unknown route {route!r}")
    return out


def _bytes(model, floats_only: bool) -> int:  # noqa: ANN001 - onnx.ModelProto
    import onnx

    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    return sum(
        int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in model.graph.initializer
        if t.data_type in floats or (not floats_only and t.data_type not in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4))
    )


def kept_quantized(path: Path) -> str:
    """Whether graphc's re-export keeps the weights as the file holds them: its float initializers hold at most 5% of
    the file's weight bytes more than the file's (small tables graphc computes once, such as rotary angles, fit in
    that; one weight matrix widened to float32 does not)."""
    import onnx

    from graphc import optimize
    from graphc.onnx_import import from_onnx
    from lowering import export

    original = onnx.load(str(path))
    again = export(optimize(from_onnx(path)).graph)
    before, after = _bytes(original, True), _bytes(again, True)
    if after <= before + 0.05 * _bytes(original, False):
        return "yes"
    return f"NO: {after / 1e6:.2f} MB of float weights against the file's {before / 1e6:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=HERE.parent / ".bench-quantized")
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    import onnx
    import onnxruntime as ort

    lines = ["| family | route | Attention ops (per file) | worst err / tol | kept quantized | result |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for route in args.routes.split(","):
        for family in args.families.split(","):
            size = head_dim(family)
            try:
                tool_made = route in ("genai-int4", "optimum-int8")
                path = _tool_export(args.work, route, family) if tool_made else _derived(args.work, route, family, size)
            except Exception as e:  # noqa: BLE001 - the tool's failure is that file's row
                lines.append(f"| {family} | {route} | - | - | - | the tool fails: {str(e)[:160]} |")
                print(lines[-1], flush=True)
                continue
            try:
                ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001 - the tool wrote a file onnxruntime itself rejects
                lines.append(f"| {family} | {route} | - | - | - | onnxruntime cannot load the file: {str(e).splitlines()[0][:140]} |")
                print(lines[-1], flush=True)
                continue
            try:
                opset = next(o.version for o in onnx.load(str(path), load_external_data=False).opset_import if o.domain in ("", "ai.onnx"))
                recognised, worst, result = check(path, size, BUDGET.get(route, 0.0), opset=max(opset, 18))
                kept = kept_quantized(path) if not result.startswith("import refused") else "-"
            except Exception as e:  # noqa: BLE001 - graphc's failure on one file is that file's row
                recognised, worst, kept, result = "-", "-", "-", f"FAILED: {type(e).__name__}: {str(e)[:160]}"
            lines.append(f"| {family} | {route} | {recognised} | {worst} | {kept} | {result} |")
            print(lines[-1], flush=True)
    (HERE.parent / "docs" / "bench" / "quantized_corpus.md").write_text(
        "# `python benchmarks/quantized_corpus.py`\n\n" + (__doc__ or "").split("\n\n")[0] + "\n\n" + "\n".join(lines) + "\n"
    )
    return 0 if all("FAILED" not in line and "differs" not in line and "NO:" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
