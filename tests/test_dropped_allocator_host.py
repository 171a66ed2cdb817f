"""A dropped allocator is closed on the reaper thread under the lock of tagged memory, so
its device synchronize waits for another thread's capture block instead of breaking the
capture; the waits for such closes never stall a thread that holds that lock."""

from __future__ import annotations

import gc
import threading

import pytest
from host_space import framework_alloc

import vmm_core
from vmm_core.memory import reaper, tag_state

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


def test_a_dropped_allocators_close_waits_for_another_threads_capture_block(host,
                                                                           monkeypatch):
    pool = vmm_core.GraphPool(backend=host)
    entered, leave = threading.Event(), threading.Event()
    inside = [False]
    closes: list = []
    real_close = vmm_core.SharedVMMAllocator.close

    def close(self):
        closes.append(inside[0])
        real_close(self)

    monkeypatch.setattr(vmm_core.SharedVMMAllocator, "close", close)

    def capture():
        with pool.space("k"):
            pool.keep(framework_alloc(MiB))
            inside[0] = True
            entered.set()
            leave.wait(10)
            inside[0] = False

    worker = threading.Thread(target=capture, daemon=True)
    worker.start()
    assert entered.wait(10)
    dropped = vmm_core.SharedVMMAllocator(backend=host)
    dropped.allocate(MiB)
    del dropped
    gc.collect()
    assert not reaper.drain(0.3), "the close waits while the capture block is open"
    assert closes == []
    leave.set()
    worker.join(10)
    assert reaper.drain()
    assert closes == [False], "closed once the capture block ended, never inside it"
    pool.close()


def test_leaving_a_private_region_config_under_the_lock_does_not_wait_for_closes(
        host, monkeypatch):
    """torch_memory_saver's ``_impl._with_region_config`` waits, as it ends, for the closes
    of the pools dropped inside it; those take the lock of tagged memory first, so a thread
    holding that lock leaves without waiting, and the closes run once it is let go."""
    from vmm_core.integrations import torch_memory_saver as compat

    tms = compat.TorchMemorySaver(backend=host)
    with tms.region(tag="dropped") as w:
        w.allocate(MiB)
    tms._ensure_initialized()
    from vmm_core.integrations.torch_memory_saver import state

    key = next(k for k in state.region_keys if k[0] == "dropped")
    pool = tms._impl._mem_pools.pop(key)
    waits: list = []
    real_drain = reaper.drain
    monkeypatch.setattr(reaper, "drain", lambda timeout=10.0: waits.append(timeout)
                        or real_drain(0.1))
    with tag_state.state_lock():
        with tms._impl._with_region_config(tag="dropped", enable_cpu_backup=False):
            del pool
            gc.collect()
        assert waits == [] and not w.closed
    assert real_drain() and w.closed
    with tms._impl._with_region_config(tag="other", enable_cpu_backup=False):
        pass
    assert waits == [10.0], "outside the lock the wait is kept"
