"""The public names: the user API and the errors in ``vmm_core.__all__``, a backend
author's names in ``vmm_core.plugin``, and every name ``vmm_core`` ever exported still
importable from it (ARCHITECTURE.md, section 3)."""

from __future__ import annotations

import subprocess
import sys

import vmm_core
from vmm_core import errors, plugin

#: every name vmm_core.__all__ held before the backend author's names moved out of it
EXPORTED_BEFORE = ["available_backends", "get_backend", "select_backend",
                   "SharedVMMAllocator", "GraphExecutor", "GraphPool", "Backend",
                   "BackendCapabilities", "Probe", "hookimpl", "hookspec",
                   "ENTRY_POINT_GROUP", "ENV_BACKEND", "region", "sleep", "wake_up",
                   "memory_summary", "info", *errors.__all__]


def test_all_is_the_user_api_then_the_errors():
    names = vmm_core.__all__
    user = names[:len(names) - len(errors.__all__)]
    assert names[len(user):] == errors.__all__
    assert not set(user) & set(plugin.__all__), "backend-author names belong to vmm_core.plugin"
    assert not set(user) & set(errors.__all__)
    assert "weak_ref_tensors" in user
    assert len(names) == len(set(names))


def test_every_name_ever_exported_still_resolves():
    code = ("import vmm_core; missing = [n for n in %r if not hasattr(vmm_core, n)]; "
            "print(missing)" % (EXPORTED_BEFORE + vmm_core.__all__,))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    for name in plugin.__all__:
        if hasattr(vmm_core, name) or name == "REQUIRED_HOOKS":
            assert getattr(vmm_core, name, getattr(plugin, name)) is getattr(plugin, name)


def test_weak_ref_tensors_lives_beside_graph_pool():
    from vmm_bench import peers
    from vmm_core.graphs import views

    assert vmm_core.weak_ref_tensors is views.weak_ref_tensors is peers.weak_ref_tensors


def test_a_plain_install_brings_numpy_so_torch_does_not_warn_on_every_run():
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    assert '"numpy"' in dependencies, dependencies
    proc = subprocess.run([sys.executable, "-W", "always", "-c",
                           "import vmm_core, torch; torch.zeros(2).tolist()"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "NumPy" not in proc.stderr, proc.stderr


def test_offload_through_the_public_module_and_its_record_on_the_allocator():
    """What a user tunes (vmm_core.offload) changes how a sleep copies, and the
    allocators of the tag (vmm_core.allocators) say so, with the bytes intact."""
    import ctypes

    from vmm_core import offload

    tag = "public-api-offload"
    with vmm_core.region(tag, backend="host") as alloc:
        ptr = alloc.allocate(1 << 20)
        ctypes.memset(ptr, 0x5C, 1 << 20)
    try:
        assert vmm_core.allocators(tag) == [alloc]
        backend = vmm_core.get_backend("host")
        for strategy in ("direct", "pinned"):
            with offload.configured(strategy=strategy, keep_host_buffers=False):
                assert offload.choose_strategy(backend, 0) == strategy
                vmm_core.sleep(tag, offload=[tag])
                saved = alloc.last_transfer
                vmm_core.wake_up(tag)
            assert isinstance(saved, offload.Transfer) and saved.direction == "to_host"
            assert saved.strategy == strategy and saved.nbytes >= 1 << 20
            assert alloc.last_transfer.direction == "from_host"
            assert ctypes.string_at(ptr, 1 << 20) == b"\x5c" * (1 << 20)
        room = offload.host_room()
        assert room is None or room[0] <= room[1]
    finally:
        alloc.close()
    assert vmm_core.allocators(tag) == []


def test_the_public_modules_name_the_implementations_objects():
    from vmm_core import offload
    from vmm_core.memory import offload as implementation
    from vmm_core.memory import tagged

    for name in offload.__all__:
        if name != "host_room":
            assert getattr(offload, name) is getattr(implementation, name), name
    for name in ("allocators", "hold_awake", "outside_regions", "tags_on"):
        assert getattr(vmm_core, name) is getattr(tagged, name), name
