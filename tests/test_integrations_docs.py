"""docs/integrations.md's code runs as written where it can run on a CPU: each fenced
python block right after a ``<!-- cpu-snippet -->`` line, in a fresh process."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
MARK = re.compile(r"^<!-- cpu-snippet\s*-->\n```python\n(.*?)^```", re.M | re.S)
SNIPPETS = MARK.findall(DOC.read_text())


def test_the_page_has_a_cpu_snippet():
    assert SNIPPETS
    assert len(re.findall(r"^<!-- cpu-snippet", DOC.read_text(), re.M)) == len(SNIPPETS)


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet_runs(code):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VMM_CORE_", "TMS_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
