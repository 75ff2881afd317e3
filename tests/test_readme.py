"""Every Python snippet in the README and the guides in ``docs/`` runs as a script, as written, in an empty folder; every
relative link in them points to a file that exists (and to a heading that exists, where it names one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPETS = [(doc, code) for doc in DOCS for code in re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)]


def test_the_docs_have_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=[f"{doc.name}-{i}" for i, (doc, _) in enumerate(SNIPPETS)])
def test_snippet_runs_as_a_script(index, tmp_path):
    doc, code = SNIPPETS[index]
    if "dask_shards" in code:
        pytest.importorskip("distributed")
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{doc.name} snippet {index} failed:\n{code}\n--- stderr\n{proc.stderr[-3000:]}"
    assert " - ERROR - " not in proc.stderr, proc.stderr[-3000:]  # Dask logging lost data at exit


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub spells them."""
    found, fence = set(), False
    for line in path.read_text(encoding="utf-8").split("\n"):
        fence ^= line.startswith("```")
        if not fence and re.match(r"#{1,6} ", line):
            found.add(re.sub(r"[^a-z0-9 _-]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_relative_link_points_to_what_exists(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name} links {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name} links {target}: {dest.name} has no heading {anchor!r}"


def test_the_first_commands_output_is_graphcs_table_alone():
    """The block of what the README's first command prints holds graphc's table, not pip's output pasted with it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"this table on stdout:\n\n```\n(.*?)```", text, re.S)
    assert block is not None, "README: the first command's output block is missing"
    lines = block.group(1).splitlines()
    assert lines[0].startswith("graph "), lines[0]
    assert lines[1].split()[:2] == ["backend", "status"], lines[1]
    assert not any(line.startswith(("Collecting", "Installing", "Successfully", "Looking in")) for line in lines)
