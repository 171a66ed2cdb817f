"""The code of the README and of the pages under docs/ runs as written where it can run
on a CPU.

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

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- cpu-snippet(?::\s*(\w+))?\s*-->\n```python\n(.*?)^```", re.M | re.S)
#: the README's first screen: a newcomer reaches its first runnable snippet within it
FIRST_SCREEN_LINES = 60
#: the README is a first screen plus links; topics live under docs/
README_MAX_LINES = 250


def _snippets(page: pathlib.Path) -> list[tuple[str, str, str]]:
    text = page.read_text()
    found = []
    for match in MARK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1) or "script",
                      match.group(2)))
    return found


SNIPPETS = [s for page in PAGES for s in _snippets(page)]


def _env() -> dict:
    # a user's shell: no test-session backend overrides
    return {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_marker_is_followed_by_a_python_block(page):
    # a marker not followed by a python block would silently test nothing
    markers = re.findall(r"^<!-- cpu-snippet", page.read_text(), re.M)
    assert len(markers) == len(_snippets(page)), page


def test_the_readme_marks_its_cpu_snippets():
    kinds = [kind for _, kind, _ in _snippets(README)]
    assert kinds.count("script") >= 1 and kinds.count("pytest") == 1, kinds
    # the pages under docs/ carry the other runnable examples (allocator, sleep, pools)
    assert [k for _, k, _ in SNIPPETS].count("script") >= 4, SNIPPETS


def test_the_readme_opens_with_a_snippet_that_runs_on_a_cpu():
    """The first python block of the README is a tested one, within the first screen:
    a newcomer on a CPU-only machine runs it before anything that needs a GPU."""
    text = README.read_text()
    first = re.search(r"^```python\n", text, re.M)
    assert first, "the README has no python block"
    before = text[:first.start()].rstrip("\n").splitlines()
    assert before[-1].startswith("<!-- cpu-snippet"), before[-3:]
    assert len(before) < FIRST_SCREEN_LINES, len(before)
    assert text.index(install_commands()[1]) < first.start()


CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def install_commands() -> list[str]:
    """The README's first block: the command that installs and runs the benchmark, then
    the one that installs and runs the tests."""
    block = re.search(r"^```bash\n(.*?)^```", README.read_text(), re.M | re.S)
    assert block, "the README has no bash block"
    return block.group(1).strip().splitlines()


def test_the_readme_opens_with_the_two_commands_and_they_give_a_cpu_the_cpu_torch():
    text = README.read_text()
    block = text.index("```bash")
    assert block == text.index("```"), "the install commands are the README's first block"
    assert text[:block].count("\n") < 12, "they open the README"
    bench, tests = install_commands()
    # a plain torch==2.13.0 on a stock CPU-only machine is the CUDA build
    assert bench == f"{CPU_TORCH} && pip install -e . && vmm-core bench"
    assert tests == f"{CPU_TORCH} && pip install -e '.[test,bench]' && python -m pytest tests"


def test_ci_runs_exactly_the_readmes_test_command():
    """.ci/run runs each part of the README's test command as written, in order, with
    only the released engines installed between the install and the test run."""
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln and not ln.startswith("#")]
    parts = install_commands()[1].split(" && ")
    at = [lines.index(part) for part in parts[:-1]]
    run = [i for i, ln in enumerate(lines) if ln.endswith(" " + parts[-1])]
    assert len(run) == 1 and lines[run[0]] == \
        f"VMM_CORE_REQUIRE=vllm,torch_memory_saver {parts[-1]}", lines
    assert at == sorted(at) and at[-1] < run[0], lines
    between = lines[at[-1] + 1:run[0]]
    assert between == ["pip install --no-deps --no-warn-conflicts vllm==0.33.0 "
                       "torch_memory_saver==0.0.10 regex"], between


def test_the_readme_stays_a_first_screen_and_links():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move topics to docs/"


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"README.md does not link docs/{page.name}"


#: how the project was built, which the product never tells
HISTORY = re.compile(r"\bissues?[ -]?#?\d+|\b(first|second|third|fourth|fifth|earlier|"
                     r"previous|device) sessions?\b|\b(this|earlier|previous) release\b|"
                     r"\bTODO", re.I)


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md"],
                         ids=[str(p.relative_to(ROOT)) for p in [*PAGES, ROOT / "CHANGELOG.md"]])
def test_the_docs_speak_only_of_the_product(page):
    hits = [f"{page.name}:{n}: {line.strip()}"
            for n, line in enumerate(page.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("where, kind, code", SNIPPETS, ids=[w for w, _, _ in SNIPPETS])
def test_snippet_runs(tmp_path, where, kind, code):
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
    assert "Traceback" not in proc.stderr, f"{where}:\n{proc.stderr}"
