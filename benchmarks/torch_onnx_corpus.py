"""The torch.onnx corpus beyond the test suite's: every route of the further decoder families, checked against onnxruntime.

    python benchmarks/torch_onnx_corpus.py [--families gptj,opt,...] [--work DIR]

For each family of ``tests/real_exports.py``'s ``MORE_FAMILIES`` and ``MOE_FAMILIES`` (default; any family there may be
named) a 2-layer random-weight transformers model (hidden 64, eager attention) is exported by both torch.onnx exporters,
with and without a KV cache, and each file is imported, optimized and run by graphc (numpy and ort-cpu) against onnxruntime on the file
at sizes never traced: prefill 5 and 130 tokens (batch 3, a left-padded row), decode over pasts of 100 and 260, a
7-token chunk over a past.  The test suite runs the legacy cache export of each family; this runs all four routes.
Prints a Markdown table: the ``Attention`` ops graphc finds per file (causal offset, cache, mask) and the worst error
in units of the tolerance (1e-4 + 1e-3*|ref|).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SIZES = {False: [(1, 5, 0, 0), (3, 130, 0, 9)], True: [(1, 1, 100, 0), (2, 1, 260, 5), (3, 7, 13, 2)]}
"""(batch, new tokens, past, left padding of row 0), as ``tests/test_real_exports.py``."""


def _describe(op) -> str:  # noqa: ANN001 - graphc.attention_op.Attention
    parts = ["causal" if op.visibility.is_causal else "not causal"]
    parts += ["cache"] if op.kv_cache else []
    parts += [f"{op.mask} mask"] if op.has_mask else []
    return ", ".join(parts)


def check(family: str, exporter: str, cache: bool, work: Path) -> tuple[str, str, str]:
    """``(attention ops, worst error / tolerance, result)`` of one file."""
    import onnx
    import onnxruntime as ort
    from real_exports import export_model, feeds

    from graphc import optimize
    from graphc.onnx_import import from_onnx
    from graphc.optimizer import Target, lower
    from lowering import prepare

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = export_model(family, exporter, "eager", cache, work / f"{family}-{exporter}-{cache}.onnx")
    except Exception as e:  # noqa: BLE001 - the exporter's own failure is a row
        return "-", "-", f"the exporter fails: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    try:
        model = onnx.load(str(path), load_external_data=False)
        graph = from_onnx(path)
        optimized = optimize(graph).graph
        keep = Target("keep", lambda g, node, ctx: None)
        ops = [n.op for n in lower(optimized, keep).topological_order() if n.op.kind == "Attention"]
        described = sorted({_describe(op) for op in ops})
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        runners = [prepare(optimized, backend) for backend in ("numpy", "ort-cpu")]
        worst = 0.0
        for batch, seq, past, pad in SIZES[cache]:
            f = feeds(model, batch, seq, past, pad)
            want = session.run(None, f)
            mine = {name: f[vi.name] for name, vi in zip(graph.inputs, model.graph.input)}
            for runner in runners:
                got = runner.run(mine)
                for name, w in zip(optimized.outputs, want):
                    worst = max(worst, float(np.max(np.abs(got[name] - w) / (1e-4 + 1e-3 * np.abs(w)))))
    except Exception as e:  # noqa: BLE001 - graphc's failure is a row too
        return "-", "-", f"FAILED: {type(e).__name__}: {str(e)[:160]}"
    return f"{len(ops)} ({'; '.join(described)})", f"{worst:.2g}", "equal" if worst <= 1 else "DIFFERENT"


def main() -> None:
    from real_exports import MOE_FAMILIES, MORE_FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join((*MORE_FAMILIES, *MOE_FAMILIES)))
    parser.add_argument("--work", type=Path, default=None, help="where the files go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("| family | exporter | cache | Attention ops (per file) | worst err / tol | result |")
        print("|---|---|---|---|---|---|")
        for family in args.families.split(","):
            for exporter in ("legacy", "dynamo"):
                for cache in (False, True):
                    ops, worst, result = check(family, exporter, cache, work)
                    print(f"| {family} | {exporter} | {'yes' if cache else 'no'} | {ops} | {worst} | {result} |", flush=True)


if __name__ == "__main__":
    main()
