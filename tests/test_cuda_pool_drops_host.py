"""No pool of vmm_core's is ever destroyed, and the CUDA backend's own capture keeps
teardowns out.

torch (2.11) empties a ``torch.cuda.MemPool``'s cache in its destructor and asserts there
that no routing or capture is underway on the device, on any thread, aborting the
process: in torch_memory_saver's whole-process mode the routing lasts the life of the
process, and a dropped GraphPool is torn down on a helper thread whenever another thread
may be capturing.  Pools are therefore let go of (torch's use of them handed back once)
and kept.  Checked here without a GPU, on the CUDA backend's Python side, with torch's
routing calls recorded; tests/test_cuda_graph_pool.py shows on a GPU that a pool let go
of during another thread's capture neither aborts nor breaks that capture."""

from __future__ import annotations

import gc
import re
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from vmm_backends.cuda import allocator_adapter, pool_routing
from vmm_backends.cuda.generator_state import GeneratorState
from vmm_core.memory import tagged

ROOT = Path(__file__).resolve().parents[1]


class _Pool:
    """Records when it is destroyed, as torch's MemPool destructor would run."""

    def __init__(self, events: list, name: str, pool_id=(7, 0)) -> None:
        self.id, self._events, self._name = pool_id, events, name

    def __del__(self) -> None:
        self._events.append(("destroyed", self._name))


@pytest.fixture
def torch_calls(monkeypatch):
    """torch's routing calls recorded, nothing let go of yet."""
    events: list = []
    monkeypatch.setattr(pool_routing, "_original", {
        "_cuda_endAllocateToPool": lambda d, p: events.append(("end", d, tuple(p))),
        "_cuda_releasePool": lambda d, p: events.append(("release", d, tuple(p))),
    })
    yield events
    pool_routing._process_pools.clear()


@pytest.fixture
def routed(torch_calls, monkeypatch):
    """The process-wide routing active on device 0."""
    monkeypatch.setitem(pool_routing._process_pools, 0, SimpleNamespace(id=(1, 0)))
    monkeypatch.setattr(pool_routing, "_process_entry", ("lib.so", "a", "f"))
    return torch_calls


@pytest.mark.parametrize("while_routed", [False, True], ids=["unrouted", "routed"])
def test_a_pool_let_go_is_never_destroyed_and_given_back_to_torch_once(
        torch_calls, monkeypatch, while_routed):
    if while_routed:
        monkeypatch.setitem(pool_routing._process_pools, 0, SimpleNamespace(id=(1, 0)))
    adapter = allocator_adapter.CudaAllocatorAdapter(0)
    pool = _Pool(torch_calls, "graph pool")
    adapter.release_pool(pool)
    adapter.release_pool(pool)  # a second release would take a use the pool lacks
    del pool
    gc.collect()
    assert torch_calls == [("release", 0, (7, 0))], torch_calls


def test_the_routing_ending_destroys_no_pool_let_go_of_meanwhile(routed):
    pool = _Pool(routed, "region pool", pool_id=(9, 0))
    allocator_adapter.CudaAllocatorAdapter(0).release_pool(pool)
    del pool
    pool_routing._Route().close()
    gc.collect()
    assert ("destroyed", "region pool") not in routed, routed
    assert routed == [("release", 0, (9, 0)), ("end", 0, (1, 0)), ("release", 0, (1, 0))]


def test_flush_empties_torchs_cache_also_while_routed(routed, monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    allocator_adapter.CudaAllocatorAdapter(0).flush()
    assert calls == ["empty_cache"], "the segments of pools let go of would stay cached"


def test_every_mempool_the_cuda_backend_makes_is_kept_for_the_life_of_the_process():
    """Kept at birth, so that no path (an error that drops a space, shutdown) reaches a
    MemPool destructor; released through ``release_pool`` (region pools through the
    adapter too)."""
    for path in sorted((ROOT / "backends" / "cuda").glob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "torch.cuda.MemPool(" not in line or line.lstrip().startswith("#"):
                continue
            near = "\n".join(lines[i:i + 4])
            assert re.search(r"\bkeep(_for_process_life)?\(", near), \
                f"{path.name}:{i + 1}: a MemPool that may be destroyed"
    tag_state = (ROOT / "vmm_core" / "memory" / "tag_state.py").read_text()
    assert "release_pool(alloc, pool)" in tag_state
    private = (ROOT / "vmm_core" / "integrations" / "torch_memory_saver" /
               "private_api.py").read_text()
    assert "tag_state.release_pool(alloc, pool)" in private


def test_the_generator_state_probe_waits_while_another_thread_holds_the_tagged_lock():
    """A dropped pool's teardown synchronizes the device under the tagged-memory lock;
    the probe is a capture, which that synchronize would break (and a pool let go of
    then would abort torch), so the probe waits for the lock."""
    state = GeneratorState(types.SimpleNamespace(), 0, kernel_params=None)
    probed = []
    state._probe = lambda: probed.append(threading.current_thread().name)
    held, release = threading.Event(), threading.Event()

    def teardown():
        with tagged.state_lock():
            held.set()
            release.wait(10)

    holder = threading.Thread(target=teardown)
    holder.start()
    assert held.wait(10)
    prober = threading.Thread(target=state.ready, name="prober")
    prober.start()
    prober.join(0.3)
    try:
        assert prober.is_alive() and probed == [], "the probe ran under another's lock"
    finally:
        release.set()
        holder.join(10)
        prober.join(10)
    assert probed == ["prober"] and state.ready() and probed == ["prober"]


def test_a_release_torch_refuses_raises_and_the_pool_may_be_let_go_of_again(torch_calls,
                                                                           monkeypatch):
    refusals = [RuntimeError("torch refused")]

    def release(device, pool_id):
        if refusals:
            raise refusals.pop()
        torch_calls.append(("release", device, tuple(pool_id)))

    monkeypatch.setitem(pool_routing._original, "_cuda_releasePool", release)
    pool = _Pool(torch_calls, "graph pool", pool_id=(11, 0))
    adapter = allocator_adapter.CudaAllocatorAdapter(0)
    with pytest.raises(RuntimeError, match="torch refused"):
        adapter.release_pool(pool)
    adapter.release_pool(pool)
    adapter.release_pool(pool)
    assert torch_calls == [("release", 0, (11, 0))], torch_calls
