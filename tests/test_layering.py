"""Layering: graphc (all but its CLI) never imports lowering; lowering uses only graphc's public API."""

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_graphc_does_not_import_lowering_except_the_cli():
    bad = [
        f"{p.relative_to(ROOT)} imports {mod}"
        for p in sorted((ROOT / "graphc").rglob("*.py"))
        if (ROOT / "graphc" / "cli") not in p.parents  # the command line stands above both
        for mod, _ in _imports(p)
        if mod == "lowering" or mod.startswith("lowering.")
    ]
    assert bad == []


def test_lowering_uses_only_names_graphc_exports():
    bad = []
    for p in sorted((ROOT / "lowering").rglob("*.py")):
        for mod, names in _imports(p):
            if not (mod == "graphc" or mod.startswith("graphc.")):
                continue
            if any(part.startswith("_") for part in mod.split(".")):
                bad.append(f"{p.name}: private module {mod}")
                continue
            public = set(getattr(importlib.import_module(mod), "__all__", ()))
            bad += [f"{p.name}: {mod}.{n} is not in {mod}.__all__" for n in names if n not in public]
    assert bad == []
