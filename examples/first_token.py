"""Time to first token: a checkpoint folder ready in seconds, and the same tokens however it was loaded.

    pip install .
    python examples/first_token.py            # writes a small Llama-shaped checkpoint first
    python examples/first_token.py DIR        # a transformers checkpoint folder (config.json + safetensors)

With ``prepack=False`` graphc's onnxruntime session reads each weight from the checkpoint's files as it is stored,
so it is ready at once; ``prepack=True`` has onnxruntime pack every weight for its kernels while the session is made
(seconds more for a 1B model, faster steps after; by default graphc packs weights under 256 MB only), and with
``GRAPHC_WEIGHT_CACHE`` set graphc saves that optimized session the first time (cold) and loads it the next (warm).
A bfloat16 folder's onnxruntime rows read a float32 conversion graphc makes in memory (onnxruntime's CPU kernels
have no bfloat16 product; the session reads the arrays in place, and nothing is written unless the cache is set).
The NumPy backend maps the folder and is ready at once too.  For each: seconds to load, seconds to the first token of
a prompt, ms per decode step, and the greedy tokens, which must be the same on every row.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import graphc
from graphc.weights import load_weights
from lowering import generate, prepare

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_memory import on_the_folder_given  # noqa: E402

PROMPT = list(range(3, 67))


def load_and_generate(folder: Path, backend: str, **options: bool) -> tuple[float, float, float, list[int]]:
    """(load s, first token s, ms per decode step, tokens) for ``backend`` (with ``options``) on the folder, from
    nothing built."""
    start = time.perf_counter()
    model = graphc.optimize(graphc.causal_lm_from_hf(folder / "config.json", load_weights(folder), logits="last")).graph
    runner = prepare(model, backend, threads=2, **options)
    loaded = time.perf_counter() - start
    result = generate(model, [PROMPT], 8, runner=runner)
    return loaded, loaded + result.prefill_seconds, result.ms_per_token, result.new_tokens[0].tolist()


def main(folder: Path) -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        os.environ.pop("GRAPHC_WEIGHT_CACHE", None)
        rows["ort-cpu, as stored"] = load_and_generate(folder, "ort-cpu", prepack=False)
        rows["ort-cpu, packed"] = load_and_generate(folder, "ort-cpu", prepack=True)
        os.environ["GRAPHC_WEIGHT_CACHE"] = cache  # graphc writes only under this folder
        rows["packed, cache cold"] = load_and_generate(folder, "ort-cpu", prepack=True)
        rows["packed, cache warm"] = load_and_generate(folder, "ort-cpu", prepack=True)
        del os.environ["GRAPHC_WEIGHT_CACHE"]
    rows["numpy"] = load_and_generate(folder, "numpy")
    print(f"{folder}: a {len(PROMPT)}-token prompt, 8 new tokens, 2 threads")
    for name, (loaded, first, step, tokens) in rows.items():
        print(f"  {name:20} load {loaded:6.2f} s  first token {first:6.2f} s  {step:6.1f} ms/token  tokens {tokens}")
    same = len({tuple(r[3]) for r in rows.values()}) == 1
    print("every row gives the same tokens" if same else "the rows' tokens differ")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    on_the_folder_given(main)
