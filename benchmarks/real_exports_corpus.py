"""The exports of optimum and onnxruntime-genai, made in their own virtual environments and checked with graphc here.

Both tools pin transformers versions other than graphc's test environment (optimum-onnx 0.1.0 needs transformers
< 4.58; onnxruntime-genai 0.18's model builder imports names of a recent transformers), so this script creates one
venv per tool under ``--work`` (once; later runs reuse them), builds in each the same tiny random-weight models as
``tests/real_exports.py`` (``config_kwargs``; hidden 256, so that onnxruntime's ``GroupQueryAttention`` gets a head
size that is a multiple of 16), saves them with a small word-level tokenizer and exports them:

- optimum: ``optimum.exporters.onnx.main_export(..., task="text-generation-with-past")``;
- onnxruntime-genai: ``python -m onnxruntime_genai.models.builder -i MODEL -o OUT -p fp32 -e cpu``.

Then, in this environment, each file is imported, optimized and run by graphc (numpy and ort-cpu) against
onnxruntime on the file at sizes never traced (prefill 5 and 30 tokens, a left-padded prompt batch, decode over a past of 100 and 260, a
7-token chunk over a past, a left-padded batch), and graphc's re-export against the file.  One table row per file::

    python benchmarks/real_exports_corpus.py [--work DIR] [--tools optimum,genai] [--families llama,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

TOOLS = {
    "optimum": ["torch==2.13.0", "optimum-onnx[onnxruntime]==0.1.0"],
    "genai": ["torch==2.13.0", "onnxruntime-genai==0.18.0", "onnx", "onnx_ir", "transformers==5.23.0"],
}
"""What each tool's venv installs (torch 2.13.0 is the CPU build)."""

FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "gpt_neox", "falcon",  # the causal LMs of tests/real_exports.py
    "mpt", "bloom",  # its ALiBi families
    "gptj", "opt", "gpt_bigcode", "phi", "stablelm", "olmo", "gemma", "starcoder2", "deepseek_v3",  # and its MORE_FAMILIES
    "mixtral", "qwen3_moe", "deepseek_v3_moe",  # and its MOE_FAMILIES
)  # fmt: skip
SIZES = [(1, 5, 0, 0), (2, 9, 0, 3), (1, 1, 100, 0), (2, 1, 260, 0), (3, 7, 13, 0), (2, 30, 5, 0), (3, 7, 13, 2), (3, 1, 20, 4)]
"""(batch, new tokens, past, left padding of row 0)."""

GENERATOR = r"""
import json, os, subprocess, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers
tool, out, name, kwargs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
torch.manual_seed(0)
cfg = getattr(transformers, name)(**kwargs)
model = AutoModelForCausalLM.from_config(cfg).eval()
hf = os.path.join(out, "hf")
model.save_pretrained(hf)
vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0").save_pretrained(hf)
if tool.startswith("optimum"):
    from optimum.exporters.onnx import main_export
    main_export(hf, output=os.path.join(out, "fp32" if tool == "optimum-int8" else "onnx"), task="text-generation-with-past")
    if tool == "optimum-int8":  # what optimum-cli onnxruntime quantize --avx2 writes
        from optimum.onnxruntime import ORTQuantizer
        from optimum.onnxruntime.configuration import AutoQuantizationConfig
        config = AutoQuantizationConfig.avx2(is_static=False, per_channel=False)
        ORTQuantizer.from_pretrained(os.path.join(out, "fp32")).quantize(save_dir=os.path.join(out, "onnx"), quantization_config=config)
        os.replace(os.path.join(out, "onnx", "model_quantized.onnx"), os.path.join(out, "onnx", "model.onnx"))
else:
    precision = "int4" if tool == "genai-int4" else "fp32"
    r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", os.path.join(out, "onnx"),
                        "-p", precision, "-e", "cpu", "-c", os.path.join(out, "cache")], capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "the model builder failed")
"""


def tool_python(work: Path, tool: str) -> Path:
    """The venv of ``tool`` under ``work`` (created and filled on first use); returns its python.  A tool's variants
    (``genai-int4``, ``optimum-int8``) use its venv."""
    tool = tool.split("-")[0]
    env = work / f"venv-{tool}"
    python = env / "bin" / "python"
    if not (env / ".ready").exists():
        print(f"creating {env} ({' '.join(TOOLS[tool])}) ...", file=sys.stderr, flush=True)
        venv.create(env, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TOOLS[tool]], check=True)
        (env / ".ready").write_text("ok\n")
    return python


def _config(family: str) -> tuple[str, dict]:
    """The transformers config class and arguments of ``family`` at hidden 256 (``NAME+tied``: its embedding tied to the
    LM head)."""
    from real_exports import config_kwargs

    name, kwargs = config_kwargs(family.split("+")[0], hidden=256)
    if family.endswith("+tied"):
        kwargs["tie_word_embeddings"] = True
    return name, kwargs


def head_dim(family: str) -> int:
    """The attention head size of ``family``'s model (see :func:`_config`)."""
    kw = _config(family)[1]
    return kw.get("head_dim") or 256 // (kw.get("num_attention_heads") or kw.get("n_head") or kw.get("n_heads"))


def export(work: Path, tool: str, family: str) -> tuple[Path | None, str]:
    """Export ``family`` (see :func:`_config`) with ``tool``; ``(model.onnx or None, why not)``."""
    out = work / "models" / f"{family}-{tool}"
    model = out / "onnx" / "model.onnx"
    if model.exists():
        return model, ""
    name, kwargs = _config(family)
    script = work / "generate.py"
    script.write_text(GENERATOR)
    r = subprocess.run([str(tool_python(work, tool)), str(script), tool, str(out), name, json.dumps(kwargs)], capture_output=True, text=True)
    if r.returncode or not model.exists():
        lines = (r.stderr or r.stdout).strip().splitlines()
        return None, (lines[-1] if lines else "no model written").replace(str(work), "WORK")[:160]
    return model, ""


def rolling_window(path: Path) -> int | None:
    """The window of a genai export's rolling caches (``past_sliding_length`` inputs), from its ``genai_config.json``."""
    config = path.parent / "genai_config.json"
    if not config.exists():
        return None
    window = json.loads(config.read_text())["model"]["decoder"].get("sliding_window") or {}
    return window.get("window_size")


def feeds(model, batch: int, seq: int, past: int, pad: int, head_dim: int, window: int | None = None) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Inputs for an optimum or genai export (``kv_cache_dim``, which genai leaves unnamed-size, is ``head_dim``).  A
    rolling cache (genai's ``past_sliding_length``) has ``window`` slots, its first ``min(past, window)`` the row's last
    tokens."""
    rng = np.random.default_rng(seq + past)
    out: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name == "input_ids":
            out[vi.name] = rng.integers(0, 128, (batch, seq)).astype(np.int64)
        elif vi.name == "attention_mask":
            mask = np.ones((batch, seq + past), np.int64)
            mask[0, :pad] = 0
            out[vi.name] = mask
        elif vi.name == "position_ids":
            out[vi.name] = np.tile(np.arange(past, past + seq), (batch, 1)).astype(np.int64)
        else:
            slots = window if dims[2].dim_param == "past_sliding_length" and window else past
            out[vi.name] = rng.standard_normal((batch, dims[1].dim_value, slots, dims[3].dim_value or head_dim)).astype(np.float32)
    return out


def defined_slots(model, f: dict[str, np.ndarray], window: int | None) -> dict[str, list[int]]:  # noqa: ANN001
    """For each rolling cache's present: how many leading slots of each row onnxruntime defines (``min(past + new,
    window)``; the slots after those are left unspecified)."""
    if not window:
        return {}
    seq = f["input_ids"].shape[1]
    keep = [min(min(int(m.sum()) - seq, window) + seq, window) for m in f["attention_mask"]]
    rolling = [
        vi.name
        for vi in model.graph.input
        if vi.name.startswith("past_key_values") and vi.type.tensor_type.shape.dim[2].dim_param == "past_sliding_length"
    ]
    return {name.replace("past_key_values", "present"): keep for name in rolling}


def _undefined_zeroed(present: np.ndarray, defined: list[int]) -> np.ndarray:
    out = present.copy()
    for b, n in enumerate(defined):
        out[b, :, n:] = 0
    return out


def check(path: Path, head_dim: int, budget: float = 0.0, opset: int | None = None) -> tuple[str, str, str]:
    """``(attention recognised, worst error / tolerance, status)`` of one exported file.  The tolerance is
    ``1e-4 + 1e-3 |want|``, plus ``budget`` times the output's largest value for a file whose products round their
    activations (its own quantization error).  ``opset``: the re-export's (default graphc's)."""
    import onnx
    import onnxruntime as ort

    from graphc import optimize
    from graphc.errors import GraphcError
    from graphc.onnx_import import from_onnx
    from graphc.optimizer import Target, lower
    from lowering import export as export_onnx
    from lowering import run

    model = onnx.load(str(path), load_external_data=False)
    try:
        graph = from_onnx(path)
        optimized = optimize(graph).graph
    except GraphcError as e:
        return "-", "-", f"import refused: {str(e).splitlines()[0][:200]}"
    ops = [n.op for n in lower(optimized, Target("keep", lambda g, n, c: None)).topological_order() if n.op.kind == "Attention"]
    seen = sorted(
        {
            ("causal" if o.causal_offset is not None else "no causal mask")
            + (", cache" if o.kv_cache else "")
            + (f", window {o.window}" if o.window else "")
            + (f", {o.mask} mask" if o.has_mask else "")
            for o in ops
        }
    )
    recognised = f"{len(ops)} ({'; '.join(seen)})" if ops else "0"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:
        reexport = Path(tmp) / "graphc.onnx"
        export_onnx(optimized, reexport, **({"opset": opset} if opset else {}))
        mine = ort.InferenceSession(str(reexport), providers=["CPUExecutionProvider"])
        worst, problems, refused = 0.0, [], []
        window = rolling_window(path)
        for batch, seq, past, pad in SIZES:
            f = feeds(model, batch, seq, past, pad, head_dim, window)
            defined = defined_slots(model, f, window)
            try:
                want = session.run(None, f)
            except Exception:  # noqa: BLE001 - the file itself refuses this size
                refused.append(str((batch, seq, past, pad)))
                continue
            by_name = {name: f[vi.name] for name, vi in zip(graph.inputs, model.graph.input)}
            results = {
                "numpy": lambda: run(optimized, by_name, backend="numpy"),
                "ort-cpu": lambda: run(optimized, by_name, backend="ort-cpu"),
                "re-export": lambda: dict(zip(optimized.outputs, mine.run(None, f))),
            }
            for backend, get in results.items():
                try:
                    got = get()
                except Exception as e:  # noqa: BLE001 - reported in the row
                    problems.append(f"{backend} at {batch, seq, past, pad}: {str(e).splitlines()[0][:100]}")
                    continue
                for name, w, onnx_name in zip(optimized.outputs, want, (o.name for o in model.graph.output)):
                    if onnx_name in defined and got[name].shape == w.shape:  # compare the slots onnxruntime defines
                        w, got = _undefined_zeroed(w, defined[onnx_name]), {**got, name: _undefined_zeroed(got[name], defined[onnx_name])}
                    if got[name].shape != w.shape:
                        problems.append(f"{backend}: {name} is {list(got[name].shape)}, onnxruntime gives {list(w.shape)} at {batch, seq, past, pad}")
                        continue
                    err = float(np.max(np.abs(got[name] - w) / (1e-4 + 1e-3 * np.abs(w) + budget * float(np.abs(w).max(initial=0)))))
                    worst = max(worst, err)
                    if err > 1:
                        problems.append(f"{backend} differs at {batch, seq, past, pad} ({err:.1f}x the tolerance)")
    result = "; ".join(dict.fromkeys(problems)) or "equal"
    if refused:
        result += f" (onnxruntime itself fails on the file at {', '.join(refused)})"
    return recognised, f"{worst:.2g}", result


def main() -> None:
    """Export every family with every tool, check each file, print one Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "graphc-real-exports")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    print("| family | exporter | Attention ops (per file) | worst err / tol | result |\n|---|---|---|---|---|")
    for tool in args.tools.split(","):
        for family in args.families.split(","):
            path, why = export(args.work, tool, family)
            if path is None:
                print(f"| {family} | {tool} | - | - | the exporter fails: {why} |", flush=True)
                continue
            try:
                row = check(path, head_dim(family))
            except Exception as e:  # noqa: BLE001 - graphc's failure on one file is that file's row
                row = ("-", "-", f"FAILED: {type(e).__name__}: {str(e)[:160]}")
            print(f"| {family} | {tool} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
