"""Every relative link of the README and of the pages beside it resolves: the file it
names exists, and a ``#fragment`` names a heading of that page (GitHub's anchors: the
heading in lower case, punctuation dropped, spaces as hyphens, ``-1``, ``-2`` for
repeats).  Links inside code blocks and to other sites are not checked."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "ARCHITECTURE.md",
         ROOT / "scripts" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(page: pathlib.Path) -> str:
    return FENCE.sub("", page.read_text())


def anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", _prose(page), re.M):
        name = anchor(match.group(1))
        n = seen.get(name, 0)
        seen[name] = n + 1
        found.add(name if n == 0 else f"{name}-{n}")
    return found


def test_anchors_are_github_s():
    assert anchor("A CUDA-only hazard: one thread in torch's allocator at a time") == \
        "a-cuda-only-hazard-one-thread-in-torchs-allocator-at-a-time"
    assert anchor("`vmm-core bench --json` keys (schema 3)") == \
        "vmm-core-bench---json-keys-schema-3"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for match in LINK.finditer(_prose(page)):
        link = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT)}")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: no heading #{fragment} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


#: a test file or test the pages cite: ``tests/test_x.py``, ``test_x.py::test_y``
CITED = re.compile(r"\b(?:tests/)?(test_\w+\.py)(?:::(test_\w+))?")
#: the file a vendor writes in their own package (the README's example)
NOT_OURS = {"test_myvendor_contract.py"}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_cited_test_exists(page):
    """A renamed test file or test leaves no page citing the old name."""
    missing = []
    for match in CITED.finditer(page.read_text()):
        name, test = match.groups()
        path = ROOT / "tests" / name
        if name in NOT_OURS:
            continue
        if not path.exists():
            missing.append(f"{match.group(0)}: no tests/{name}")
        elif test and not re.search(rf"^\s*def {test}\(", path.read_text(), re.M):
            missing.append(f"{match.group(0)}: no {test} in tests/{name}")
    assert not missing, f"{page.relative_to(ROOT)}:\n" + "\n".join(missing)
