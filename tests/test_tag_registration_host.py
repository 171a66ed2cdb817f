"""Whole-process memory registers each new segment's allocator from inside the
framework's allocator, which holds its own lock meanwhile: that registration must not
wait for the lock of tagged memory, or a thread holding that lock and needing the
framework's allocator (a dropped GraphPool's teardown emptying the framework's cache, a
capture allocating) deadlocks against it.  Registrations asked for while another thread
holds the lock are applied by its next holder, before any reader sees the registry."""

from __future__ import annotations

import os
import threading

import pytest
from proc_state import run_python

import vmm_core
from vmm_core.memory import tag_state, tagged

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


def _held_elsewhere():
    """A thread holding the lock of tagged memory until the returned event is set."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with tag_state.state_lock():
            held.set()
            release.wait(10)

    worker = threading.Thread(target=hold, daemon=True)
    worker.start()
    assert held.wait(10)
    return worker, release


def test_a_registration_asked_for_while_another_thread_holds_the_lock_does_not_wait(host):
    alloc = vmm_core.SharedVMMAllocator(backend=host)
    alloc.allocate(MiB)
    worker, release = _held_elsewhere()
    done = threading.Event()
    asker = threading.Thread(target=lambda: (tag_state.register_soon("late", alloc),
                                             done.set()), daemon=True)
    asker.start()
    assert done.wait(5), "register_soon waited for the lock another thread holds"
    release.set()
    worker.join(10)
    assert tagged.allocators("late") == [alloc] and "late" in tagged.tags()
    assert tagged.memory_summary()["late"]["device_bytes"] == MiB
    alloc.close()


def test_queued_changes_apply_in_order_before_any_reader_sees_the_registry(host):
    first = vmm_core.SharedVMMAllocator(backend=host)
    second = vmm_core.SharedVMMAllocator(backend=host)
    for a in (first, second):
        a.allocate(MiB)
    worker, release = _held_elsewhere()
    tag_state.register_soon("q", first)
    tag_state.register_soon("q", second)
    tag_state.unregister_soon("q", first)
    release.set()
    worker.join(10)
    assert tagged.tags_on(host, 0) == {"q": False}  # the lock-free reader settles too
    assert tagged.allocators("q") == [second]
    vmm_core.sleep("q")  # the sleep finds the queued registration
    assert second.asleep and not first.asleep
    vmm_core.wake_up("q")
    for a in (first, second):
        a.close()


def test_a_dropped_pools_teardown_and_a_whole_process_allocation_do_not_deadlock():
    """torch's caching allocator holds its device lock while it asks whole-process memory
    for a segment, and ``torch.cuda.empty_cache`` takes that lock: modelled here by a lock
    the host adapter's flush takes and the allocating thread holds.  A dropped GraphPool's
    teardown empties the cache under the lock of tagged memory."""
    out = run_python(f"""
        import gc, sys, threading, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import vmm_core
        from vmm_core.memory import reaper, whole_process, tagged
        from vmm_backends.host.allocator_adapter import HostAllocatorAdapter
        from host_space import framework_alloc

        framework_lock = threading.Lock()  # torch's allocator lock, as the model has it
        in_flush, allocating = threading.Event(), threading.Event()
        result = {{}}

        def flush(self):  # torch.cuda.empty_cache
            in_flush.set()
            allocating.wait(5); time.sleep(0.3)
            got = framework_lock.acquire(timeout=5)
            result["flush"] = "ok" if got else "deadlock"
            if got:
                framework_lock.release()

        HostAllocatorAdapter.flush = flush
        routing = whole_process.route_process("wp", backend="host", device=0)

        def framework():  # a new segment, asked for from inside torch's allocator
            in_flush.wait(10)
            with framework_lock:
                allocating.set()
                t0 = time.monotonic()
                address = routing.entry.alloc(1 << 20, 0)
                result["alloc"] = (address != 0, time.monotonic() - t0 < 2)

        thread = threading.Thread(target=framework, daemon=True)
        thread.start()
        pool = vmm_core.GraphPool(backend="host", tag="dropped")
        with pool.space(1):
            pool.keep(framework_alloc(1 << 20))
        del pool
        gc.collect()
        thread.join(20)
        reaper.drain(20)
        print(sorted(result.items()), len(tagged.allocators("wp")))
        routing.stop()
    """, timeout=60, hung="the teardown and the allocation deadlocked")
    assert out.returncode == 0, out.stderr
    assert "[('alloc', (True, True)), ('flush', 'ok')] 1" in out.stdout, (out.stdout,
                                                                        out.stderr)
