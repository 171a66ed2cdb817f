"""No pool of vmm_core's is destroyed while the process-wide routing is active.

torch (2.11) empties a ``torch.cuda.MemPool``'s cache in its destructor and asserts there
that no allocate-to-pool routing is underway, aborting the process; in
torch_memory_saver's whole-process mode the routing is active for the life of the
process.  The rule is checked here without a GPU, on the CUDA backend's Python side: the
routing state is set as ``route_process`` sets it and torch's routing calls are recorded.
Only a GPU shows that torch itself no longer aborts (tests/test_cuda_tms_process.py)."""

from __future__ import annotations

import gc
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vmm_backends.cuda import allocator_adapter, pool_routing

ROOT = Path(__file__).resolve().parents[1]


class _Pool:
    """Records when it is destroyed, as torch's MemPool destructor would run."""

    def __init__(self, events: list, name: str) -> None:
        self.id, self._events, self._name = (7, 0), events, name

    def __del__(self) -> None:
        self._events.append(("destroyed", self._name))


@pytest.fixture
def routed(monkeypatch):
    """The process-wide routing active on device 0, torch's calls recorded."""
    events: list = []
    monkeypatch.setattr(pool_routing, "_original", {
        "_cuda_endAllocateToPool": lambda d, p: events.append(("end", d)),
        "_cuda_releasePool": lambda d, p: events.append(("release", d)),
    })
    monkeypatch.setitem(pool_routing._process_pools, 0, SimpleNamespace(id=(1, 0)))
    monkeypatch.setattr(pool_routing, "_process_entry", ("lib.so", "a", "f"))
    yield events
    pool_routing._process_pools.clear()
    pool_routing._held.clear()


def test_a_pool_let_go_while_routed_is_destroyed_only_after_the_routing_ends(routed):
    adapter = allocator_adapter.CudaAllocatorAdapter(0)
    pool = _Pool(routed, "region pool")
    adapter.release_pool(pool)
    del pool
    gc.collect()
    assert ("destroyed", "region pool") not in routed, "destroyed with the routing active"
    pool_routing._Route().close()
    gc.collect()
    assert routed == [("end", 0), ("release", 0), ("destroyed", "region pool")], routed
    assert pool_routing._held == []


def test_with_nothing_routed_a_pool_let_go_is_not_held():
    events: list = []
    pool = _Pool(events, "graph pool")
    allocator_adapter.CudaAllocatorAdapter(0).release_pool(pool)
    del pool
    gc.collect()
    assert events == [("destroyed", "graph pool")]


def test_flush_asks_torch_to_release_nothing_while_routed(routed, monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    allocator_adapter.CudaAllocatorAdapter(0).flush()
    assert calls == []


def test_every_mempool_the_cuda_backend_makes_is_kept_or_given_to_a_releasing_owner():
    """A MemPool made in the CUDA backend is kept for the life of the process, held
    until the routing ends, or returned by ``new_pool`` (whose owners let go of it
    through ``release_pool``); region pools are let go of through the adapter."""
    for path in sorted((ROOT / "backends" / "cuda").glob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "torch.cuda.MemPool(" not in line or line.lstrip().startswith("#"):
                continue
            near = "\n".join(lines[i:i + 3])
            assert re.search(r"keep_for_process_life\(|_held\.append\(|^\s*return ", near,
                             re.M), f"{path.name}:{i + 1}: a MemPool that may be dropped"
    tag_state = (ROOT / "vmm_core" / "memory" / "tag_state.py").read_text()
    assert "release_pool(alloc, pool)" in tag_state
    private = (ROOT / "vmm_core" / "integrations" / "torch_memory_saver" /
               "private_api.py").read_text()
    assert "tag_state.release_pool(alloc, pool)" in private
