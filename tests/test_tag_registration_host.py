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


def test_a_segment_queued_during_a_sleep_stays_out_of_it(host, monkeypatch):
    """A sleep checks the tags' allocators (no tag left out of an allocator it sleeps),
    then sleeps them, under one hold of the lock: a registration another thread queues
    between the two is applied after the sleep, as it was when the registration waited
    for the lock, so the sleep never reaches memory it did not check."""
    kept = vmm_core.SharedVMMAllocator(backend=host)
    kept.allocate(MiB)
    tagged.register("s", kept)
    late = vmm_core.SharedVMMAllocator(backend=host)
    late.allocate(MiB)
    real_check = tagged.check_whole

    def check_whole(chosen):
        real_check(chosen)
        asker = threading.Thread(target=tag_state.register_soon, args=("s", late))
        asker.start()
        asker.join(5)

    monkeypatch.setattr(tagged, "check_whole", check_whole)
    vmm_core.sleep("s")
    assert kept.asleep and not late.asleep, "the segment queued during the sleep slept"
    assert set(tagged.allocators("s")) == {kept, late}
    vmm_core.wake_up("s")
    for a in (kept, late):
        a.close()


def test_a_group_sleep_undone_leaves_a_segment_made_meanwhile_awake():
    """A group sleep snapshots what it will put to sleep and, when another rank fails,
    wakes what it changed: a whole-process segment made on another thread meanwhile stays
    out of both (one rank of two here, the other reporting a failure)."""
    out = run_python("""
        import threading
        from vmm_core.memory import whole_process, tagged
        from vmm_core.distributed import collective
        from vmm_core.distributed.group import Group, RankFailure
        from vmm_core.errors import VMMError

        routing = whole_process.route_process("wp3", backend="host", device=0)
        routing.entry.alloc(1 << 20, 0)

        class OtherRankFails(Group):
            def __init__(self):
                self.rank, self.size = 0, 2

            def gather(self, value, what):
                if what.startswith("undoing"):
                    return [value, (None, [])]
                return [value, RankFailure(VMMError("rank 1 ran out"))]

        made = {}

        def act():
            t = threading.Thread(target=lambda: made.update(
                address=routing.entry.alloc(1 << 20, 0)), daemon=True)
            t.start()
            t.join(5)
            made["during"] = not t.is_alive()
            tagged.sleep_step(["wp3"], [])

        try:
            collective._all_or_none(OtherRankFails(), "sleep", act,
                                    undo=lambda a: a.wake(zero=True),
                                    changed=lambda was, a: not was and a.asleep,
                                    tags=["wp3"], discards=["wp3"])
        except Exception as exc:
            print("refused", type(exc).__name__)
        print("made during", made.get("during"),
              "asleep", [a.asleep for a in tagged.allocators("wp3")])
        routing.stop()
    """, timeout=60, hung="the group sleep and the allocation deadlocked")
    assert out.returncode == 0, out.stderr
    assert "made during True asleep [False, False]" in out.stdout, (out.stdout, out.stderr)


def test_a_freed_segment_another_thread_holds_is_not_waited_for_inside_the_allocator():
    """Closing the segments the framework freed runs inside its allocator (its lock held):
    one another thread holds awake is left to the closing thread, which closes it once the
    hold ends, instead of being waited for."""
    out = run_python(f"""
        import sys, threading, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import vmm_core
        from vmm_core.memory import whole_process, tagged

        routing = whole_process.route_process("wp2", backend="host", device=0)
        first = routing.entry.alloc(1 << 20, 0)
        alloc = routing._segments[first]
        held, leave = threading.Event(), threading.Event()

        def hold():
            with alloc.hold_awake("the segment", holder="a block on another thread"):
                held.set()
                leave.wait(10)

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert held.wait(10)
        routing.entry.free(first)
        t0 = time.monotonic()
        second = routing.entry.alloc(1 << 20, 0)  # closes the freed ones first
        waited = time.monotonic() - t0
        print("second", second != 0, "waited", waited < 2, "closed", alloc.closed)
        leave.set()
        holder.join(10)
        for _ in range(200):
            if alloc.closed:
                break
            time.sleep(0.05)
        print("closed later", alloc.closed, alloc not in tagged.allocators("wp2"))
        print("frees", routing.entry.counters()["frees"])  # kept aside: not a second free
        routing.stop()
    """, timeout=60, hung="the allocation waited for the held segment")
    assert out.returncode == 0, out.stderr
    assert "second True waited True closed False" in out.stdout, (out.stdout, out.stderr)
    assert "closed later True True" in out.stdout, (out.stdout, out.stderr)
    assert "frees 1" in out.stdout, out.stdout


def test_a_segment_queued_while_a_disk_sleep_writes_its_files_stays_awake(host, tmp_path,
                                                                           monkeypatch):
    """A sleep to disk writes a file per awake allocator, then discards their memory: a
    registration queued while the files are written is applied after the sleep, so the
    discard never reaches memory no file holds."""
    import ctypes
    import random

    from vmm_core.memory import disk_offload

    kept = vmm_core.SharedVMMAllocator(backend=host)
    ctypes.memmove(kept.allocate(MiB), b"K" * MiB, MiB)
    tagged.register("d", kept)
    late = vmm_core.SharedVMMAllocator(backend=host)
    address = late.allocate(MiB)
    payload = random.Random(7).randbytes(MiB)
    ctypes.memmove(address, payload, MiB)
    real_write = disk_offload._write_file

    def write_file(*args, **kwargs):  # another thread makes a segment meanwhile
        asker = threading.Thread(target=tag_state.register_soon, args=("d", late))
        asker.start()
        asker.join(5)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(disk_offload, "_write_file", write_file)
    disk_offload.sleep(["d"], str(tmp_path))
    assert kept.asleep and not late.asleep, "the segment made during the sleep slept"
    disk_offload.wake_up(["d"])
    assert ctypes.string_at(address, MiB) == payload
    for a in (kept, late):
        a.close()
