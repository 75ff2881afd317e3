"""Every Python snippet in the README runs as a script, as written, in an empty folder."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_a_script(index, tmp_path):
    if "dask_shards" in SNIPPETS[index]:
        pytest.importorskip("distributed")
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(SNIPPETS[index], encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"snippet {index} failed:\n{SNIPPETS[index]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert " - ERROR - " not in proc.stderr, proc.stderr[-3000:]  # Dask logging lost data at exit
