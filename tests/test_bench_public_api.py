"""The benchmark (bench/, imported as vmm_bench) uses vmm_core's public API only.

It is the library's first user: what it cannot do through the public API, a user cannot
do either, so it reaches no module and no name outside the list below.  The check reads
the source (imports, and attribute chains on an imported vmm_core module), so a benchmark
module that is never run here is checked all the same.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: the modules a user imports, each with its own ``__all__`` (docs/api.md lists them)
PUBLIC = {
    # backends, the allocator, graph pools and the executor, tagged memory, sleep/wake
    "vmm_core": "the package's face",
    # the one exception hierarchy every error of the library is part of
    "vmm_core.errors": "the exceptions a caller catches",
    # the offload settings and copies made ahead of a sleep, which an engine tunes
    "vmm_core.offload": "how a sleep copies to the host, and its settings",
    # mapped and distributed tensors, group sleep's communicator setup and timings
    "vmm_core.distributed": "memory over the ranks of a torch.distributed group",
    # the drop-ins for other projects' APIs
    "vmm_core.integrations.torch_memory_saver": "torch_memory_saver's API on vmm_core",
    "vmm_core.integrations.vllm": "vLLM's sleep-mode backend",
    # what a package adding a `vmm-core` subcommand builds on (the benchmark is one)
    "vmm_core.cli": "the frame of vmm-core's subcommands",
    # the vendor contract a backend package implements, and its test tools
    "vmm_core.plugin": "the backend author's names",
    "vmm_core.testing": "the contract suite's tools",
}


def _public_names(module: str) -> set[str]:
    names = set(importlib.import_module(module).__all__)
    prefix = module + "."
    # a public submodule is a public name of its parent package ("from vmm_core import
    # offload"), and so is a package on the way to one ("vmm_core.integrations.vllm")
    names |= {m[len(prefix):].split(".")[0] for m in PUBLIC if m.startswith(prefix)}
    return names


def violations(source: str, where: str = "<source>") -> list[str]:
    """Every use in ``source`` of a vmm_core module or name outside :data:`PUBLIC`."""
    tree = ast.parse(source)
    found = []
    bound: dict[str, str] = {}  # local name -> the vmm_core module it stands for

    def check_module(module: str, line: int) -> None:
        if module not in PUBLIC:
            found.append(f"{where}:{line}: imports {module}, not a public module")

    def check_name(module: str, name: str, line: int) -> bool:
        if name.startswith("_") or name not in _public_names(module):
            found.append(f"{where}:{line}: {module}.{name} is not public "
                         f"(not in {module}.__all__)")
            return False
        return True

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vmm_core":
                    check_module(alias.name, node.lineno)
                    if alias.asname:  # import vmm_core.offload as off
                        bound[alias.asname] = alias.name
                    else:  # import vmm_core.x binds vmm_core
                        bound["vmm_core"] = "vmm_core"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "vmm_core":
            check_module(node.module, node.lineno)
            if node.module not in PUBLIC:
                continue
            for alias in node.names:
                if check_name(node.module, alias.name, node.lineno) \
                        and f"{node.module}.{alias.name}" in PUBLIC:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        inner: ast.expr = node
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in bound:
            continue
        # only the outermost Attribute of a chain is judged; inner ones are its prefixes
        module = bound[inner.id]
        for attr in reversed(chain):
            if not check_name(module, attr, node.lineno) or f"{module}.{attr}" not in PUBLIC:
                break
            module = f"{module}.{attr}"
    return sorted(set(found))


def test_the_benchmark_imports_only_the_public_api():
    files = sorted((ROOT / "bench").glob("*.py"))
    assert files, "bench/ has no modules"
    found = [v for f in files for v in violations(f.read_text(), f"bench/{f.name}")]
    assert not found, "the benchmark reaches past vmm_core's public API; make the name " \
        "public (docs/api.md) if a user needs it too, else measure with public pieces:\n" \
        + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from vmm_core.memory import tagged", "imports vmm_core.memory"),
    ("import vmm_core.memory.offload", "imports vmm_core.memory.offload"),
    ("from vmm_core.offload import _config", "vmm_core.offload._config is not public"),
    ("from vmm_core.offload import save", "vmm_core.offload.save is not public"),
    ("import vmm_core\nvmm_core.memory.tagged.allocators('w')", "vmm_core.memory is not"),
    ("import vmm_core\nvmm_core.offload.release()", "vmm_core.offload.release is not"),
    ("from vmm_core import offload\noffload.save(1)", "vmm_core.offload.save is not"),
    ("import vmm_core as v\nv.registry.resolve(None)", "vmm_core.registry is not"),
])
def test_the_check_names_what_is_not_public(source, expected):
    found = violations(source)
    assert len(found) == 1 and expected in found[0], found


def test_public_uses_pass_the_check():
    source = ("import vmm_core\nfrom vmm_core import offload, SharedVMMAllocator\n"
              "from vmm_core.integrations.vllm import VmmSleepMode\n"
              "vmm_core.allocators('w'); vmm_core.offload.configure(); offload.staging_bytes()\n"
              "vmm_core.integrations.vllm.deferrable_tags\n")
    assert violations(source) == []


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_resolves_and_is_documented(module):
    mod = importlib.import_module(module)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not have: {missing}"
    assert f"`{module}`" in (ROOT / "docs" / "api.md").read_text(), \
        f"docs/api.md does not list the public module {module}"
