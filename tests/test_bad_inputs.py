"""The bad-input catalogue: every mistake gets graphc's own exception, naming the culprit.

Each case is a call that must raise a specific :class:`~graphc.errors.GraphcError`
subclass whose message contains every listed fragment (the operand, label,
field, flag or size at fault, and what was expected).  CLI cases must print one
line on stderr and exit 2.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import graphc
from graphc import AttentionConfig, Graph, load_graph, optimize, save_graph
from graphc.cli import main
from graphc.errors import (
    AttentionConfigError,
    BackendError,
    DimError,
    DTypeMismatchError,
    DuplicateNameError,
    EinsumSpecError,
    ExportError,
    GraphError,
    GraphcError,
    InputError,
    OpError,
    ResourceLimitError,
    SerializationError,
    ShapeMismatchError,
    UndefinedValueError,
    UnknownNameError,
    WeightError,
)
from graphc.memory import set_memory_cap
from graphc.ops import Binary, Cast, Concat, Einsum, Repeat, Reshape, Scale, Softmax, Transpose, Unary
from lowering import compare, prepare, random_inputs, run
from lowering.exporter.onnx_export import export

CFG = AttentionConfig(32, 4, 2, head_dim=8)


def _g() -> Graph:
    g = Graph("t")
    g.input("x", [2, 3])
    return g


def _graph_file(tmp: Path, mutate: Callable[[dict], None]) -> Path:
    g = _g()
    g.output(g.softmax("x", name="y"))
    doc = graphc.serialize.graph_to_dict(g)
    mutate(doc)
    path = tmp / "g.json"
    path.write_text(json.dumps(doc))
    return path


def _set(path: str, value: object) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        node = doc
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if k.isdigit() else node[k]
        node[keys[-1]] = value

    return mutate


def _sdpa_inputs(**change: np.ndarray) -> tuple[Graph, dict[str, np.ndarray]]:
    g = graphc.sdpa_graph(CFG)
    feeds = random_inputs(g, batch=1, seq=4)
    feeds.update(change)
    return g, feeds


CASES: list = [
    # ---- configs
    pytest.param(lambda t: AttentionConfig(32, 0, 1), AttentionConfigError, ["n_heads", "> 0"], id="config-zero-heads"),
    pytest.param(lambda t: AttentionConfig(32, 4, 3, head_dim=8), AttentionConfigError, ["n_kv_heads", "3"], id="config-kv-heads-not-dividing"),
    pytest.param(
        lambda t: AttentionConfig(32, 2, 4, head_dim=8), AttentionConfigError, ["n_kv_heads (4)", "n_heads (2)"], id="config-more-kv-than-query-heads"
    ),
    pytest.param(lambda t: AttentionConfig(32, 4.0, 2), AttentionConfigError, ["n_heads", "float"], id="config-float-heads"),
    pytest.param(lambda t: AttentionConfig(32, 4, 2, head_dim=-8), AttentionConfigError, ["head_dim"], id="config-negative-head-dim"),
    pytest.param(lambda t: AttentionConfig(32, 4, 2, head_dim=8, scale=float("nan")), AttentionConfigError, ["scale"], id="config-nan-scale"),
    pytest.param(lambda t: graphc.preset("falcon-41b"), UnknownNameError, ["falcon-41b", "falcon-40b"], id="config-unknown-preset"),
    pytest.param(lambda t: CFG.kv_head_of(4), AttentionConfigError, ["query head 4", "0..3"], id="config-head-out-of-range"),
    pytest.param(lambda t: CFG.kv_cache_bytes(1, -5), AttentionConfigError, ["seq_len", "-5"], id="config-negative-cache-length"),
    # ---- einsum specs
    pytest.param(lambda t: Einsum("ij,jk"), EinsumSpecError, ["'->'", "ij,jk"], id="einsum-no-arrow"),
    pytest.param(lambda t: Einsum("ij->jk->k"), EinsumSpecError, ["exactly one '->'"], id="einsum-two-arrows"),
    pytest.param(lambda t: Einsum("i1,j->ij"), EinsumSpecError, ["operand 0", "'1'"], id="einsum-digit-label"),
    pytest.param(lambda t: Einsum("...i,i->..."), EinsumSpecError, ["no ellipsis"], id="einsum-ellipsis"),
    pytest.param(lambda t: Einsum("ii->i"), EinsumSpecError, ["label 'i' repeats in operand 0"], id="einsum-diagonal"),
    pytest.param(lambda t: Einsum("ij->ii"), EinsumSpecError, ["output label 'i' appears more than once"], id="einsum-output-repeat"),
    pytest.param(lambda t: Einsum("ij->k"), EinsumSpecError, ["output label 'k' does not appear"], id="einsum-output-unknown-label"),
    pytest.param(lambda t: Einsum(3), OpError, ["spec", "int"], id="einsum-spec-not-string"),
    pytest.param(
        lambda t: (g := _g(), g.input("w", [4, 5]), g.einsum("ij,jk->ik", "x", "w")),
        EinsumSpecError,
        ["label 'j'", "size 3 in operand 0", "4 in operand 1"],
        id="einsum-inconsistent-sizes",
    ),
    pytest.param(lambda t: (g := _g(), g.einsum("ijk->k", "x")), EinsumSpecError, ["operand 0", "3 labels but rank 2"], id="einsum-rank-mismatch"),
    pytest.param(lambda t: (g := _g(), g.einsum("ij,jk->ik", "x")), OpError, ["2 operand(s) but 1 input(s)"], id="einsum-operand-count"),
    # ---- builder misuse and op attributes
    pytest.param(lambda t: (g := _g(), g.relu("nope")), UndefinedValueError, ["'nope'", "not defined"], id="builder-undefined-value"),
    pytest.param(lambda t: (g := _g(), g.input("x", [1])), DuplicateNameError, ["'x'"], id="builder-duplicate-name"),
    pytest.param(
        lambda t: (g := _g(), g.reshape("x", [4, 2])), ShapeMismatchError, ["[2,3]", "6 elements", "[4,2]", "8 elements"], id="builder-reshape-count"
    ),
    pytest.param(lambda t: Transpose((0, 0)), OpError, ["perm [0, 0]", "not a permutation"], id="op-transpose-not-permutation"),
    pytest.param(lambda t: Transpose((0.5, 1)), OpError, ["'perm'", "int", "0.5"], id="op-transpose-float-perm"),
    pytest.param(lambda t: Softmax(0.5), OpError, ["Softmax", "'axis'", "int", "0.5"], id="op-softmax-float-axis"),
    pytest.param(lambda t: Softmax("1"), OpError, ["Softmax", "'axis'", "str"], id="op-softmax-string-axis"),
    pytest.param(lambda t: (g := _g(), g.softmax("x", axis=2)), OpError, ["axis 2", "rank 2"], id="builder-softmax-axis-range"),
    pytest.param(lambda t: Concat(True), OpError, ["Concat", "'axis'", "bool"], id="op-concat-bool-axis"),
    pytest.param(lambda t: Repeat(1, 0), OpError, ["'repeats'", ">= 1", "0"], id="op-repeat-zero"),
    pytest.param(lambda t: Repeat(1.0, 2), OpError, ["'axis'", "float"], id="op-repeat-float-axis"),
    pytest.param(lambda t: Scale(float("inf")), OpError, ["factor", "finite"], id="op-scale-inf"),
    pytest.param(lambda t: Scale("0.5"), OpError, ["'factor'", "number", "str"], id="op-scale-string"),
    pytest.param(lambda t: Cast("int3"), UnknownNameError, ["dtype 'int3'", "float32"], id="op-cast-unknown-dtype"),
    pytest.param(lambda t: Unary("gelu"), UnknownNameError, ["'gelu'", "tanh"], id="op-unknown-unary"),
    pytest.param(lambda t: Binary(["add"]), OpError, ["'fn'", "list"], id="op-binary-fn-not-string"),
    pytest.param(lambda t: Reshape("abc"), DimError, ["shape", "str"], id="op-reshape-shape-string"),
    pytest.param(
        lambda t: (g := _g(), g.input("m", [2, 3], "bool"), g.add("m", "m")),
        DTypeMismatchError,
        ["Binary add", "operand 0 is bool"],
        id="builder-bool-add",
    ),
    pytest.param(
        lambda t: (g := _g(), g.input("i", [2, 3], "int32"), g.add("x", "i")), DTypeMismatchError, ["float32", "int32"], id="builder-mixed-dtypes"
    ),
    pytest.param(
        lambda t: (g := _g(), g.where("x", "x", "x")), DTypeMismatchError, ["condition", "bool", "float32"], id="builder-where-float-condition"
    ),
    pytest.param(
        lambda t: (g := _g(), g.input("y", [4]), g.add("x", "y")), ShapeMismatchError, ["[2,3]", "[4]", "do not broadcast"], id="builder-broadcast"
    ),
    pytest.param(lambda t: (g := _g(), g.input("v", [3]), g.causal_mask("v")), ShapeMismatchError, ["rank >= 2"], id="builder-causal-mask-rank"),
    pytest.param(lambda t: Graph("t").input("x", [2, -1]), DimError, ["-1", "negative"], id="builder-negative-dim"),
    pytest.param(lambda t: Graph("t").input("x", [2, "seq+"]), DimError, ["seq+"], id="builder-bad-dim-expression"),
    pytest.param(lambda t: Graph("t").input("x", [2], "float8"), UnknownNameError, ["dtype 'float8'"], id="builder-unknown-dtype"),
    pytest.param(lambda t: _g().output("nope"), UndefinedValueError, ["'nope'"], id="builder-unknown-output"),
    pytest.param(lambda t: graphc.attention_stack_graph(CFG, 0), WeightError, ["n_layers", "0"], id="builder-zero-layers"),
    pytest.param(
        lambda t: graphc.attention_layer_graph(CFG, weights={"q_proj.weight": np.zeros((32, 32), np.float32)}),
        WeightError,
        ["missing", "k_proj.weight"],
        id="builder-missing-weights",
    ),
    # ---- JSON graph files
    pytest.param(lambda t: load_graph(t / "missing.json"), SerializationError, ["cannot read", "missing.json"], id="json-missing-file"),
    pytest.param(lambda t: load_graph(t), SerializationError, ["cannot read"], id="json-directory"),
    pytest.param(
        lambda t: (p := t / "b.onnx", p.write_bytes(b"\x08\x07\xff\xfe"), load_graph(p))[-1], SerializationError, ["not UTF-8"], id="json-binary-file"
    ),
    pytest.param(
        lambda t: (p := t / "d.json", p.write_text("[" * 100000), load_graph(p))[-1],
        SerializationError,
        ["nested too deeply"],
        id="json-deep-nesting",
    ),
    pytest.param(
        lambda t: (p := t / "j.json", p.write_text("{"), load_graph(p))[-1], SerializationError, ["not valid JSON", "line 1"], id="json-truncated"
    ),
    pytest.param(
        lambda t: (p := t / "o.json", p.write_text("{}"), load_graph(p))[-1], SerializationError, ["not a graphc graph"], id="json-not-graphc"
    ),
    pytest.param(lambda t: load_graph(_graph_file(t, _set("version", 99))), SerializationError, ["version 99"], id="json-wrong-version"),
    pytest.param(
        lambda t: load_graph(_graph_file(t, _set("nodes.0.op.kind", "Gelu"))), SerializationError, ["'Gelu'", "Softmax"], id="json-unknown-op"
    ),
    pytest.param(
        lambda t: load_graph(_graph_file(t, _set("nodes.0.op.attrs.axis", "1"))),
        SerializationError,
        ["nodes[0]", "'axis'", "str"],
        id="json-string-axis",
    ),
    pytest.param(
        lambda t: load_graph(_graph_file(t, _set("nodes.0.op.attrs.axis", 0.5))),
        SerializationError,
        ["nodes[0]", "'axis'", "0.5"],
        id="json-float-axis",
    ),
    pytest.param(
        lambda t: load_graph(_graph_file(t, _set("nodes.0.op.attrs", {"axis": -1, "temperature": 2}))),
        SerializationError,
        ["takes attributes ['axis']", "temperature"],
        id="json-unknown-attribute",
    ),
    pytest.param(
        lambda t: load_graph(_graph_file(t, _set("inputs.0.shape", "ab"))),
        SerializationError,
        ["inputs[0]", "'shape'", "array"],
        id="json-shape-not-list",
    ),
    pytest.param(lambda t: load_graph(_graph_file(t, _set("nodes.0.inputs", ["zz"]))), UndefinedValueError, ["'zz'"], id="json-undefined-input"),
    pytest.param(
        lambda t: load_graph(
            _graph_file(t, _set("initializers", [{"name": "w", "shape": [2], "dtype": "float32", "data": base64.b64encode(b"abc").decode()}]))
        ),
        SerializationError,
        ["initializers[0]", "float32[2]"],
        id="json-bad-weight-bytes",
    ),
    pytest.param(
        lambda t: save_graph(graphc.sdpa_graph(CFG), t / "no" / "dir" / "g.json"),
        SerializationError,
        ["cannot write", "g.json"],
        id="json-save-missing-dir",
    ),
    # ---- ONNX export
    pytest.param(lambda t: export(graphc.sdpa_graph(CFG), t / "no" / "m.onnx"), ExportError, ["cannot write", "m.onnx"], id="onnx-unwritable-path"),
    pytest.param(lambda t: export(graphc.sdpa_graph(CFG), opset=7), ExportError, ["opset", "7"], id="onnx-opset-too-old"),
    pytest.param(
        lambda t: export(graphc.sdpa_graph(CFG), attention="flash"), UnknownNameError, ["'flash'", "decomposed"], id="onnx-unknown-attention-mode"
    ),
    pytest.param(
        lambda t: export(graphc.sdpa_graph(CFG), external_data=True), ExportError, ["external_data", "path"], id="onnx-external-data-no-path"
    ),
    pytest.param(lambda t: export((g := _g(), g.output("x"), g)[-1]), ExportError, ["output 'x'", "graph input"], id="onnx-output-is-input"),
    # ---- runtime inputs
    pytest.param(lambda t: run(*_sdpa_inputs()[:1], {}), InputError, ["missing input", "q_BHSD"], id="run-missing-input"),
    pytest.param(lambda t: run(*(_sdpa_inputs(extra=np.zeros(1, np.float32)))), InputError, ["unexpected input", "extra"], id="run-extra-input"),
    pytest.param(
        lambda t: run(*(_sdpa_inputs(q_BHSD=np.zeros((1, 4, 4, 8), np.float64)))), InputError, ["q_BHSD", "float64", "float32"], id="run-wrong-dtype"
    ),
    pytest.param(lambda t: run(*(_sdpa_inputs(q_BHSD=np.zeros((1, 4, 4, 7), np.float32)))), InputError, ["q_BHSD", "7"], id="run-wrong-shape"),
    pytest.param(lambda t: run(*(_sdpa_inputs(q_BHSD=np.zeros((1, 4, 5, 8), np.float32)))), InputError, ["seq"], id="run-inconsistent-symbol"),
    pytest.param(lambda t: run(*(_sdpa_inputs(q_BHSD=[[1.0]]))), InputError, ["q_BHSD", "numpy.ndarray", "list"], id="run-list-input"),
    pytest.param(lambda t: run(graphc.sdpa_graph(CFG), [1, 2]), InputError, ["mapping", "list"], id="run-inputs-not-mapping"),
    pytest.param(lambda t: random_inputs(graphc.sdpa_graph(CFG), batch=1, seq=-1), DimError, ["'seq'", ">= 0", "-1"], id="inputs-negative-seq"),
    pytest.param(lambda t: random_inputs(graphc.sdpa_graph(CFG), batch=1, seq="abc"), DimError, ["'seq'", "int", "abc"], id="inputs-string-seq"),
    pytest.param(lambda t: random_inputs(graphc.sdpa_graph(CFG), batch=1), InputError, ["seq"], id="inputs-missing-size"),
    pytest.param(lambda t: random_inputs(graphc.sdpa_graph(CFG), seed=-1, batch=1, seq=2), InputError, ["seed", "-1"], id="inputs-negative-seed"),
    # ---- optimizer and backend options
    pytest.param(lambda t: optimize(graphc.sdpa_graph(CFG), hints={"seq": "abc"}), DimError, ["hints", "'seq'", "abc"], id="optimize-string-hint"),
    pytest.param(lambda t: optimize(graphc.sdpa_graph(CFG), hints={"seq": -3}), DimError, ["hints", "'seq'", "-3"], id="optimize-negative-hint"),
    pytest.param(lambda t: optimize(graphc.sdpa_graph(CFG), hints={"2x": 3}), DimError, ["'2x'", "symbol name"], id="optimize-bad-hint-name"),
    pytest.param(lambda t: optimize(graphc.sdpa_graph(CFG), level=7), UnknownNameError, ["optimization level '7'", "2"], id="optimize-unknown-level"),
    pytest.param(
        lambda t: optimize(graphc.sdpa_graph(CFG), optimizer="fastest"), UnknownNameError, ["'fastest'", "greedy"], id="optimize-unknown-optimizer"
    ),
    pytest.param(lambda t: prepare(graphc.sdpa_graph(CFG), "tpu"), UnknownNameError, ["backend 'tpu'", "ort-cpu"], id="backend-unknown"),
    pytest.param(lambda t: prepare(graphc.sdpa_graph(CFG), "numpy", opset=18), BackendError, ["'numpy'", "opset"], id="backend-unknown-option"),
    pytest.param(
        lambda t: prepare(graphc.sdpa_graph(CFG), "numpy", compute_dtype="int32"),
        GraphcError,
        ["compute_dtype", "int32"],
        id="backend-int-compute-dtype",
    ),
    pytest.param(
        lambda t: compare(graphc.sdpa_graph(CFG), sizes={"batch": 1, "seq": 2}, repeats=0), GraphcError, ["repeats", "0"], id="compare-zero-repeats"
    ),
    pytest.param(
        lambda t: compare(graphc.sdpa_graph(CFG), sizes={"batch": 1, "seq": 2}, atol=-1), GraphcError, ["atol", "-1"], id="compare-negative-atol"
    ),
    pytest.param(
        lambda t: compare(graphc.sdpa_graph(CFG), sizes={"batch": 1, "seq": 2}, backends=[]),
        GraphcError,
        ["backends", "non-empty"],
        id="compare-no-backends",
    ),
    pytest.param(
        lambda t: compare(graphc.sdpa_graph(CFG), sizes={"batch": 1, "seq": 2}, backends="numpy"),
        GraphcError,
        ["backends", "'numpy'"],
        id="compare-backends-string",
    ),
    # ---- size guard
    pytest.param(
        lambda t: compare(graphc.attention_layer_graph(graphc.preset("mistral-7b")), sizes={"batch": 1, "seq": 10**9}),
        ResourceLimitError,
        ["seq=1000000000", "memory cap", "GRAPHC_MEMORY_CAP"],
        id="guard-huge-seq",
    ),
    pytest.param(
        lambda t: (set_memory_cap("1MiB"), random_inputs(graphc.sdpa_graph(CFG), batch=64, seq=512)),
        ResourceLimitError,
        ["random inputs", "1.0 MiB", "set_memory_cap"],
        id="guard-random-inputs",
    ),
    pytest.param(
        lambda t: (set_memory_cap("1MiB"), graphc.attention_layer_graph(graphc.preset("mistral-7b"))),
        ResourceLimitError,
        ["weights", "d_model=4096", "160.0 MiB"],
        id="guard-weights",
    ),
    pytest.param(lambda t: set_memory_cap("lots"), GraphcError, ["'lots'", "GiB"], id="guard-bad-cap"),
    # ---- earlier raw tracebacks and silent bindings
    pytest.param(
        lambda t: CFG.kv_cache_bytes(1, 16, dtype="floaty"), UnknownNameError, ["dtype 'floaty'", "float32"], id="config-cache-bytes-unknown-dtype"
    ),
    pytest.param(lambda t: Graph("t").input("x", [10**30, 3]), DimError, ["exceeds", "2**48"], id="builder-huge-dim"),
    pytest.param(
        lambda t: load_graph(_graph_file(t, _set("inputs.0.shape", [10**30, 3]))), SerializationError, ["inputs[0]", "exceeds"], id="load-huge-dim"
    ),
    pytest.param(lambda t: load_graph(None), SerializationError, ["file path", "NoneType"], id="load-graph-none"),
    pytest.param(lambda t: Graph(name=None), GraphError, ["name", "NoneType"], id="graph-name-none"),
    pytest.param(
        lambda t: (a := _g(), b := _g(), b.output(b.softmax(a.value("x")))),
        UndefinedValueError,
        ["'x'", "another graph"],
        id="builder-value-of-another-graph",
    ),
    pytest.param(
        lambda t: (a := _g(), b := _g(), b.output(a.value("x"))), UndefinedValueError, ["another graph"], id="builder-output-of-another-graph"
    ),
    pytest.param(
        lambda t: graphc.serialize.graph_from_dict(_two_nodes_one_name()),
        DuplicateNameError,
        ["'y'", "nodes[0]", "one producer"],
        id="load-two-nodes-one-name",
    ),
    pytest.param(
        lambda t: run(_softmax_graph(), {"x": np.ones((2, 3), np.float32)}, threads=0), BackendError, ["threads", "0"], id="run-zero-threads"
    ),
    pytest.param(
        lambda t: run(_softmax_graph(), {"x": np.ones((2, 3), np.float32)}, backend="ort-cpu", threads=-1),
        BackendError,
        ["threads", "-1"],
        id="run-negative-threads",
    ),
]


def _softmax_graph() -> Graph:
    g = _g()
    g.output(g.softmax("x", name="y"))
    return g


def _two_nodes_one_name() -> dict:
    g = _g()
    g.output(g.exp(g.softmax("x", name="y"), name="z"))
    doc = graphc.serialize.graph_to_dict(g)
    doc["nodes"][1]["name"] = "y"
    doc["outputs"] = ["y"]
    return doc


@pytest.fixture(autouse=True)
def _default_cap():
    yield
    set_memory_cap(None)


@pytest.mark.parametrize("call, error, fragments", CASES)
def test_bad_input_raises_graphc_error_naming_the_culprit(call, error, fragments, tmp_path):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert isinstance(info.value, GraphcError)
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message lacks {missing}: {message}"


CLI_CASES = [
    pytest.param(["compare", "--heads", "0"], "--heads must be >= 1, got 0", id="cli-zero-heads"),
    pytest.param(["compare", "--heads", "4", "--head-dim", "0"], "--head-dim must be >= 1, got 0", id="cli-zero-head-dim"),
    pytest.param(["compare", "--heads", "4", "--kv-heads", "0", "--head-dim", "8"], "--kv-heads must be >= 1, got 0", id="cli-zero-kv-heads"),
    pytest.param(["compare", "--heads", "4", "--kv-heads", "3", "--head-dim", "8"], "n_kv_heads", id="cli-kv-heads-not-dividing"),
    pytest.param(["compare", "--heads", "4"], "needs --head-dim or --d-model", id="cli-custom-without-width"),
    pytest.param(["compare", "--kv-heads", "2"], "needs --heads", id="cli-kv-heads-alone"),
    pytest.param(["compare", "--preset", "mistral-7b", "--heads", "4"], "not both", id="cli-preset-and-heads"),
    pytest.param(["compare", "--preset", "nope"], "unknown preset 'nope'", id="cli-unknown-preset"),
    pytest.param(["info", "--preset", "mistral-7b", "--seq", "0"], "--seq must be >= 1, got 0", id="cli-info-zero-seq"),
    pytest.param(["info", "--preset", "mistral-7b", "--dtype", "int3"], "invalid choice: 'int3'", id="cli-info-bad-dtype"),
    pytest.param(["compare", "--preset", "mistral-7b", "--atol", "-1"], "--atol must be >= 0", id="cli-negative-atol"),
    pytest.param(["compare", "--preset", "mistral-7b", "--rtol", "nan"], "--rtol must be >= 0", id="cli-nan-rtol"),
    pytest.param(["compare", "--preset", "mistral-7b", "--backends", ""], "--backends needs at least one", id="cli-empty-backends"),
    pytest.param(["compare", "--preset", "mistral-7b", "--backends", "numpy,tpu"], "unknown backend 'tpu'", id="cli-unknown-backend"),
    pytest.param(["compare", "--preset", "mistral-7b", "--threads", "-1"], "--threads must be in 1..4096, got -1", id="cli-negative-threads"),
    pytest.param(["compare", "--preset", "mistral-7b", "--repeats", "0"], "--repeats must be in 1..10000", id="cli-zero-repeats"),
    pytest.param(["compare", "--preset", "mistral-7b", "--repeats", "1000000"], "--repeats must be in 1..10000", id="cli-huge-repeats"),
    pytest.param(["compare", "--preset", "mistral-7b", "--seed", "-1"], "--seed must be >= 0, got -1", id="cli-negative-seed"),
    pytest.param(["compare", "--preset", "mistral-7b", "--seq", "abc"], "invalid int value: 'abc'", id="cli-seq-not-int"),
    pytest.param(["compare", "--preset", "mistral-7b", "--batch", "0"], "--batch must be >= 1, got 0", id="cli-zero-batch"),
    pytest.param(["compare", "--preset", "mistral-7b", "--seq", "1000000000"], "memory cap", id="cli-huge-seq"),
    pytest.param(["compare", "--preset", "mistral-7b", "--memory-cap", "lots"], "cannot read memory size 'lots'", id="cli-bad-memory-cap"),
    pytest.param(["export", "--preset", "mistral-7b", "-o", "/nonexistent/dir/m.onnx"], "cannot write", id="cli-export-unwritable"),
    pytest.param(["export", "--preset", "mistral-7b", "-o", "m.onnx", "--hint", "seq"], "--hint takes NAME=INT", id="cli-bad-hint"),
    pytest.param(["show", "--graph", "/nonexistent/g.json"], "cannot read graph file", id="cli-missing-graph-file"),
    pytest.param(["optimize", "--preset", "mistral-7b", "--target", "tpu"], "unknown target 'tpu'", id="cli-unknown-target"),
    pytest.param(["compare"], "no graph given", id="cli-no-graph"),
    pytest.param([], "a command is needed", id="cli-no-command"),
    pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="cli-unknown-command"),
]


@pytest.mark.parametrize("argv, fragment", CLI_CASES)
def test_cli_user_error_is_one_line_and_exit_2(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("graphc: [")]  # progress lines
    assert len(lines) == 1 and lines[0].startswith("graphc: error: "), err
    assert fragment in lines[0], lines[0]


def test_cli_debug_after_the_subcommand_shows_the_traceback(capsys):
    assert main(["compare", "--heads", "0", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("graphc: error: --heads must be >= 1, got 0")


def test_the_catalogue_is_large_enough():
    assert len(CASES) + len(CLI_CASES) >= 60
