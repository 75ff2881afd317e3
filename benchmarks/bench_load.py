"""Time to first token on ort-cpu, its weights read as stored or packed (with and without the session cache), beside
transformers: load, then a prompt's prefill.

    python benchmarks/bench_load.py CHECKPOINT_DIR [--prompt 512] [--out docs/bench/load.md]

Each row is one process, run one after the other (nothing else running): ``graphc ort-cpu`` as ``prepare`` makes it
(the weights read from the checkpoint's files as they are), then with ``prepack=True`` (onnxruntime packs every
weight while the session is built) without ``GRAPHC_WEIGHT_CACHE``, with an empty cache folder (cold: the session
built and saved), with that folder again (warm: the saved session loaded), and transformers (``from_pretrained`` in
the checkpoint's dtype, sdpa).  Load is from the process's first graphc (or transformers) call to a runnable model:
graphc's import, build, optimize and ``prepare``; the prefill runs the prompt (random ids) once, through the first
token's logits.  The cache folder is a temporary one, removed at the end.  Writes the table to ``--out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkpoint_args, machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, "benchmarks")
from _common import lm_feeds
runtime, folder, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
if runtime == "transformers":
    import torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype="auto").eval()
    t1 = time.perf_counter()
    ids = np.random.default_rng(0).integers(3, 1000, (1, prompt))  # lm_feeds' ids
    with torch.no_grad():
        model(torch.from_numpy(ids)).logits[:, -1]
else:
    import graphc
    from graphc.weights import load_weights
    from lowering import prepare
    g = graphc.optimize(graphc.causal_lm_from_hf(f"{folder}/config.json", load_weights(folder), logits="last")).graph
    runner = prepare(g, "ort-cpu", prepack=runtime == "graphc-packed")
    t1 = time.perf_counter()
    runner.run(lm_feeds(g, prompt))
t2 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "prefill": t2 - t1}))
"""


def _run(runtime: str, folder: str, prompt: int, cache: str | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GRAPHC_WEIGHT_CACHE"}
    if cache is not None:
        env["GRAPHC_WEIGHT_CACHE"] = cache
    r = subprocess.run([sys.executable, "-c", CHILD, runtime, folder, str(prompt)], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{runtime}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'failed'}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run the five rows; print the table and write it to ``--out``."""
    args = checkpoint_args(__doc__, "load.md")
    config = json.loads(Path(args.checkpoint, "config.json").read_text())
    lines = [
        "# `python benchmarks/bench_load.py`: one run\n",
        f"machine: {machine()}; checkpoint {config.get('model_type')} "
        f"({config.get('num_hidden_layers')} layers, hidden {config.get('hidden_size')}, {config.get('torch_dtype') or config.get('dtype')}); "
        f"prompt {args.prompt} tokens\n",
        "| runtime | load s | prefill s | first token s |",
        "|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(prefix="graphc-bench-cache-") as cache:
        rows = [
            ("graphc ort-cpu (weights read as stored)", "graphc", None),
            ("graphc ort-cpu, packed, no cache", "graphc-packed", None),
            ("graphc ort-cpu, packed, cache cold (built and saved)", "graphc-packed", cache),
            ("graphc ort-cpu, packed, cache warm (loaded)", "graphc-packed", cache),
            ("transformers sdpa", "transformers", None),
        ]
        for label, runtime, folder in rows:
            t = _run(runtime, args.checkpoint, args.prompt, folder)
            line = f"| {label} | {t['load']:.1f} | {t['prefill']:.1f} | {t['load'] + t['prefill']:.1f} |"
            print(line, flush=True)
            lines.append(line)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
