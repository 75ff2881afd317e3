"""Architecture: the modules of graphc/ and lowering/ import each other without cycles.

Every import counts: at module level, inside a function (a lazy import is still a dependency) and under
``if TYPE_CHECKING:`` (an annotation that needs the other module is a dependency too).  ``from pkg import name``
depends on ``pkg.name`` when that is a module, else on ``pkg`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("graphc", "lowering"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _all_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> nx.DiGraph:
    """Module -> the graphc/lowering modules it imports."""
    modules = _modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        g.add_node(name)
        for node in _all_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            g.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return g


def test_the_import_graph_has_no_cycles():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert cycles == [], "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_the_analysis_sees_lazy_imports():
    g = import_graph()
    assert g.has_edge("lowering.backends.registry", "lowering.backends.torch_backend")  # imported inside prepare's torch branch
    assert not g.has_edge("lowering.backends.torch_backend", "lowering.backends.registry")


def test_every_function_is_under_80_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 >= 80
    ]
    assert long == []


def test_every_op_has_an_onnx_emitter_or_is_lowered_before_export():
    """The emitter is looked up by op type; an op without one is named at export time (Rotary is decomposed first)."""
    from graphc.ops import OP_TYPES
    from lowering.exporter.onnx_export import ONNX_EMITTERS

    lowered_first = {"Rotary"}  # legalisation decomposes it for every target
    assert sorted(n for n, t in OP_TYPES.items() if t not in ONNX_EMITTERS) == sorted(lowered_first)


def test_ruff_check_passes():
    """The lint configuration in pyproject.toml holds for the whole tree."""
    import shutil
    import subprocess
    import sys

    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode:
        import pytest

        pytest.skip("ruff is not installed (pip install '.[test]')")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "graphc", "lowering", "tests", "benchmarks", "examples"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:]


def test_every_op_has_reference_semantics():
    """The NumPy interpreter, constant folding and the torch backend's fallback run an op by its ``evaluate``."""
    from graphc.ops import OP_TYPES, Op

    missing = [n for n, t in OP_TYPES.items() if t.evaluate is Op.evaluate and t.evaluate_all is Op.evaluate_all]
    assert missing == []


# The places a type checker cannot follow, each for a reason: an op that computes its output count overrides the
# base's class-level ``num_outputs`` with a property, and unpickling re-runs ``__init__`` on a made object.
_TYPE_IGNORES_ALLOWED = {
    ("graphc/opaque.py", "def num_outputs(self) -> int:  # type: ignore[override]"),
    ("graphc/attention_op.py", "def num_outputs(self) -> int:  # type: ignore[override]"),
    ("graphc/graph.py", 'self.__init__(state["name"])  # type: ignore[misc]'),
}


def test_type_ignores_are_only_where_the_checker_cannot_follow():
    found = {
        (str(path.relative_to(ROOT)), line.strip())
        for path in _modules().values()
        for line in path.read_text().splitlines()
        if "# type: ignore" in line
    }
    assert found <= _TYPE_IGNORES_ALLOWED, sorted(found - _TYPE_IGNORES_ALLOWED)


def test_no_two_folders_import_each_other():
    """Within ``graphc/`` and ``lowering/``, the first-level folders (``lowering/backends``, ``lowering/decode``, ...,
    nested folders counted as theirs) import one another without a cycle; a package's own top-level modules (the
    CLI, ``lowering/compare.py``, ``lowering/generate.py``) stand above its folders and are left out."""
    graph = import_graph()
    folders = {m.split(".")[1] for m in graph.nodes if m.count(".") >= 2}

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return f"{parts[0]}.{parts[1]}" if len(parts) > 1 and parts[1] in folders else None

    between = nx.DiGraph()
    for a, b in graph.edges:
        fa, fb = folder(a), folder(b)
        if fa and fb and fa != fb and fa.split(".")[0] == fb.split(".")[0]:
            between.add_edge(fa, fb)
    cycles = sorted(nx.simple_cycles(between), key=len)
    assert cycles == [], "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_every_module_the_needs_table_names_exists():
    """``conftest.NEEDS`` marks modules by name: a renamed module would silently fall back to ``core``."""
    from conftest import NEEDS

    named = set().union(*NEEDS.values())
    assert sorted(m for m in named if not (ROOT / "tests" / f"{m}.py").exists()) == []


def test_what_a_query_may_see_is_read_through_visibility():
    """The causal offset, window and empty-row rule live in ``graphc/visibility.py``: elsewhere they are read a handful of
    times (``CausalMask``'s own fields), the matcher's record stays small, its functions simple, and the exporters'
    mask idioms are patterns rather than hand walks up the producers."""
    import dataclasses
    import re
    import subprocess
    import sys

    from graphc.optimizer.attention import AttentionMatch

    reads = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in _modules().values()
        if path.name != "visibility.py"
        for line in path.read_text().splitlines()
        if re.search(r"\.(causal_offset|window|empty_rows)\b(?!\()", line)
    ]
    assert len(reads) <= 10, "\n".join(reads)
    assert len(dataclasses.fields(AttentionMatch)) <= 15
    masks = (ROOT / "graphc" / "optimizer" / "masks.py").read_text()
    assert masks.count("producer(") <= 5
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "C901", "--config", "lint.mccabe.max-complexity=15",
         "graphc/optimizer/attention.py", "graphc/optimizer/masks.py"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 or "No module named ruff" in done.stderr, done.stdout[-2000:]
