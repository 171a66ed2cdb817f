"""The README's code runs as written where it can run on a CPU.

A fenced python block right after a ``<!-- cpu-snippet -->`` line is run as a script in
a fresh process; after ``<!-- cpu-snippet: pytest -->`` it is written to a ``test_*.py``
file and run with pytest (the contract suite a vendor copies), with ``"host"`` in place of
the placeholder backend name ``"myvendor"``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARK = re.compile(r"^<!-- cpu-snippet(?::\s*(\w+))?\s*-->\n```python\n(.*?)^```", re.M | re.S)


def _snippets() -> list[tuple[str, str, str]]:
    text = README.read_text()
    found = []
    for match in MARK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append((f"README.md:{line}", match.group(1) or "script", match.group(2)))
    return found


SNIPPETS = _snippets()


def _env() -> dict:
    # a user's shell: no test-session backend overrides
    return {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}


def test_the_readme_marks_its_cpu_snippets():
    kinds = [kind for _, kind, _ in SNIPPETS]
    assert kinds.count("script") >= 2 and kinds.count("pytest") == 1, SNIPPETS
    # a marker not followed by a python block would silently test nothing
    markers = re.findall(r"^<!-- cpu-snippet", README.read_text(), re.M)
    assert len(markers) == len(SNIPPETS)


@pytest.mark.parametrize("where, kind, code", SNIPPETS, ids=[w for w, _, _ in SNIPPETS])
def test_readme_snippet_runs(tmp_path, where, kind, code):
    if kind == "pytest":
        path = tmp_path / "test_snippet_contract.py"
        path.write_text(code.replace('"myvendor"', '"host"'))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(path)], capture_output=True, text=True, cwd=tmp_path,
                              env=_env(), timeout=600)
        assert proc.returncode == 0, f"{where}:\n{proc.stdout}\n{proc.stderr}"
        passed = re.search(r"(\d+) passed", proc.stdout)
        assert passed and int(passed.group(1)) >= 10, proc.stdout  # the suite, not nothing
        assert "failed" not in proc.stdout.splitlines()[-1]
        return
    assert kind == "script", f"{where}: unknown snippet kind {kind!r}"
    path = tmp_path / "snippet.py"
    path.write_text(code)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=300)
    assert proc.returncode == 0, f"{where}:\n{proc.stdout}\n{proc.stderr}"
