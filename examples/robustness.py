"""Robustness: graphc's own errors, the size guard, and onnxruntime in a worker process.

python examples/robustness.py
"""

import numpy as np

import graphc
from graphc.errors import GraphcError, ResourceLimitError
from graphc.memory import format_bytes, memory_cap, set_memory_cap
from lowering import compare, prepare, random_inputs


def main() -> None:
    """Show one caught mistake of each kind, the size guard at work, and an isolated onnxruntime run."""
    g = graphc.Graph("demo")
    x = g.input("x", [2, 3])
    for mistake in (
        lambda: g.einsum("ij,jk->ik", x, g.input("w", [4, 5])),  # label j: 3 vs 4
        lambda: g.softmax(x, axis=0.5),  # an attribute of the wrong type
        lambda: graphc.AttentionConfig(4096, 32, 7),  # 7 KV heads do not divide 32 query heads
    ):
        try:
            mistake()
        except GraphcError as e:
            print(f"{type(e).__name__}: {e}")

    cfg = graphc.preset("mistral-7b")
    layer = graphc.attention_layer_graph(cfg)
    print(f"\nmemory cap now: {format_bytes(memory_cap() or 0)}")
    try:
        compare(layer, sizes={"batch": 1, "seq": 1_000_000})
    except ResourceLimitError as e:
        print(f"ResourceLimitError: {e}")

    set_memory_cap("2GiB")  # or GRAPHC_MEMORY_CAP=2GiB, or graphc --memory-cap 2GiB
    try:
        core = graphc.sdpa_graph(cfg)
        feeds = random_inputs(core, batch=1, seq=64)
        out = prepare(core, "ort-cpu", isolate=True).run(feeds)["attn_BHSD"]  # a crash in onnxruntime would be a BackendError
        print(f"\nort-cpu in a worker process: attn {out.shape}, mean {float(np.mean(out)):+.4f}")
        print(compare(core, feeds, backends=["numpy", "ort-cpu"], repeats=1))
    finally:
        set_memory_cap(None)


if __name__ == "__main__":
    main()
