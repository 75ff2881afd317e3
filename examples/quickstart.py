"""Quickstart: build a preset's GQA attention layer, print its graph and stats, run it in NumPy.

python examples/quickstart.py [preset] [seq]
"""

import sys

import numpy as np

import graphc
from lowering import random_inputs, run_numpy


def main(name: str = "mistral-7b", seq: int = 16) -> None:
    """Build, print and run the attention layer of preset ``name`` on ``seq`` random tokens."""
    cfg = graphc.preset(name)
    print(f"== {name}: {graphc.PRESETS[name].description}")
    print(cfg.summary(batch=1, seq_len=4096, n_layers=graphc.PRESETS[name].n_layers))

    graph = graphc.attention_layer_graph(cfg, seed=0)
    graph.verify()
    print(f"\n== graph ({len(graph.nodes)} nodes, weights elided)")
    print(str(graph))

    feeds = random_inputs(graph, seed=0, batch=1, seq=seq)
    out = run_numpy(graph, feeds)["out_BSM"]
    ref = run_numpy(graph, feeds, compute_dtype="float64")["out_BSM"]
    print(f"\n== ran on NumPy: out {out.shape} {out.dtype}, max |float32 - float64| = {np.abs(out - ref).max():.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mistral-7b", int(sys.argv[2]) if len(sys.argv) > 2 else 16)
