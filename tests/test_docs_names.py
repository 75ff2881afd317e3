"""Every graphc or lowering name the README and docs/ show exists: dotted names (``lowering.exporter.export``) resolve, and
every ``from graphc... import a, b`` / ``from lowering... import a, b`` line imports."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"\b((?:graphc|lowering)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
FROM = re.compile(r"^\s*from ((?:graphc|lowering)[\w.]*) import ([\w, ]+)$", re.M)
SKIP = {"graphc.py"}  # a file name, not a module path


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _names():
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for name in sorted(set(DOTTED.findall(text)) - SKIP):
            yield path.name, name.rstrip(".")
        for module, names in FROM.findall(text):
            for n in names.split(","):
                if n.strip():
                    yield path.name, f"{module}.{n.strip().split(' as ')[0]}"


@pytest.mark.parametrize("doc,name", sorted(set(_names())))
def test_a_name_the_docs_show_exists(doc, name):
    if name.endswith((".py", ".md", ".json", ".onnx")) or "/" in name:
        pytest.skip("a file name")
    assert _resolve(name), f"{doc} shows {name}, which does not exist"
