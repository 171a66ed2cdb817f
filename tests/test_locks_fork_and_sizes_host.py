"""Locks, fork and sizes, host backend: numpy and bool sizes, forks while other threads
hold vmm_core's locks, a merge whose unmap fails, and region arguments on an existing
tag.  A hang runs in a forked child with a timeout so it cannot stall pytest."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from proc_state import fork_while_held, join_child, run_python

import vmm_core
from vmm_core.errors import AllocationError

PAGE = 4096
pytestmark = pytest.mark.usefixtures("clean_tags")



# ------------------------------------------------------------------ sizes
def test_numpy_integer_sizes_are_taken_as_sizes(host):
    """Sizes computed with numpy (np.prod(shape) * itemsize) are np.int64: they were
    refused with "must be a positive int, got np.int64(...)", while device=np.int64(0)
    was accepted."""
    n = np.prod([4, 1024]).astype(np.int64)
    alloc = vmm_core.SharedVMMAllocator(host, device=np.int64(0), reserve_bytes=n * 16)
    assert alloc.reserve_bytes == 16 * 4096 and type(alloc.reserve_bytes) is int
    address = alloc.allocate(n)
    ctypes.memset(address, 7, int(n))
    alloc.extend_mapping(np.int32(2 * PAGE))
    assert alloc.physical_bytes >= 2 * PAGE
    pool = vmm_core.GraphPool(backend=host, reserve_bytes=np.uint64(1 << 20))
    assert pool.allocator.reserve_bytes == 1 << 20
    pool.close()
    alloc.close()


@pytest.mark.parametrize("call", ["allocate", "extend_mapping", "reserve_bytes"])
def test_bool_sizes_are_refused(host, call):
    """extend_mapping(True) is refused, not taken as one byte."""
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=1 << 20)
    with pytest.raises(AllocationError, match="True"):
        if call == "reserve_bytes":
            vmm_core.SharedVMMAllocator(host, reserve_bytes=True)
        else:
            getattr(alloc, call)(True)
    alloc.close()


# ------------------------------------------------------------------ fork
def test_a_fork_while_another_thread_holds_an_allocator_lock_leaves_the_child_usable(host):
    """SharedVMMAllocator.sleep/wake/allocate called directly, offload.prepare and
    memory_summary hold an allocator's own lock without the tagged-memory lock; the fork
    hooks wait for it too, so a child forked meanwhile does not inherit the lock held by a
    thread it does not have, and its first memory_summary(), sleep() or region() of that tag
    returns."""
    with vmm_core.region("weights", backend=host, reserve_bytes=1 << 20) as w:
        w.allocate(PAGE)

    def child():
        assert "weights" in vmm_core.memory_summary()
        with vmm_core.region("weights", backend=host) as mine:
            mine.allocate(PAGE)
        vmm_core.sleep("weights")
        vmm_core.wake_up("weights")

    # what a direct w.sleep(offload=True) holds for its whole copy
    fork_while_held(w._lock, child, "on an allocator lock held at the fork")


def test_a_child_forked_inside_a_capture_space_leaves_it_normally(host):
    """The forking thread's own locks stay held in the child: a child forked inside a
    space (a hold_awake block) leaves it and uses the pool as the parent would."""
    import os
    import signal
    import time

    from vmm_core.memory import routing

    pool = vmm_core.GraphPool(backend=host, reserve_bytes=1 << 20)
    with pool.space(1):
        pool.keep(routing.current_target(0).allocate(PAGE))
        pid = os.fork()
    if pid == 0:  # the child reports by its exit status, never returns into pytest
        code = 1
        try:
            pool.before_replay(1)
            with pool.space(2):
                pass
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child forked inside a capture space hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    pool.close()


# ------------------------------------------------------------------ hold_awake
def test_tagged_hold_awake_ignores_memory_closed_while_it_waited(host):
    """vmm_core.memory.tagged.hold_awake chose its allocators before taking the lock; one
    closed meanwhile by another thread (the last pool of a tag closed) raised "the
    SharedVMMAllocator is closed; create a new one" instead of being ignored, as memory
    gone is documented to be."""
    import threading
    import time

    from vmm_core.memory import tagged

    pool = vmm_core.GraphPool(backend=host, tag="closing", reserve_bytes=1 << 20)
    with pool.space(1):
        pass
    inside, result = threading.Event(), []

    def closer():
        # the tagged-memory lock, as hold_awake takes it (closing inside a hold_awake of
        # the tag is refused: the block would go on using the memory)
        with tagged.state_lock():
            inside.set()
            time.sleep(0.5)  # the main thread has chosen its allocators and waits
            pool.close()  # the last pool: its allocator closes

    thread = threading.Thread(target=closer, daemon=True)
    thread.start()
    assert inside.wait(5)
    try:
        with tagged.hold_awake("closing"):
            result.append("held")
    finally:
        thread.join(10)
    assert result == ["held"] and pool.allocator.closed


# ------------------------------------------------------------------ merge failures
def test_an_unmap_failing_mid_merge_leaves_every_space_mapped():
    """A merge swaps each space's handles for the merged one. An unmap that fails half way
    through a space's handles is undone (or the allocator marked inconsistent), so no space
    is left with some handles unmapped, and reading a kept tensor of that space reads its
    bytes. Run in a child: a segfault would kill the interpreter."""
    import textwrap

    code = textwrap.dedent("""
        import ctypes, vmm_core
        from vmm_core.errors import MappingError
        be = vmm_core.get_backend("host")
        a = vmm_core.SharedVMMAllocator(be, reserve_bytes=1 << 24, growth_bytes=4096)
        a.merge_on_switch = False  # five spaces, five handles: the merge has work to do
        g = a.granularity
        kept = []
        for k in range(5):
            if k:
                a.switch_to_new_virtual_space()
                a.allocate(g * k)
            q = a.allocate(g)
            ctypes.memset(q, k + 1, g)
            kept.append(q)
        unmap, calls = be.unmap, [0]
        def failing(*args):
            calls[0] += 1
            if calls[0] == 3:  # the first of space 1's two handles
                raise MappingError("injected: the device refused an unmap")
            return unmap(*args)
        be.unmap = failing
        try:
            a.merge_tail()
        except MappingError as exc:
            print("merge raised:", exc)
        finally:
            be.unmap = unmap
        print("values", [ctypes.c_ubyte.from_address(q).value for q in kept])
        print("merged", a.merge_tail(), a.num_handles)
        print("values", [ctypes.c_ubyte.from_address(q).value for q in kept])
        a.sleep(offload=True)
        a.wake()
        print("values", [ctypes.c_ubyte.from_address(q).value for q in kept[-1:]])
        a.close()
    """)
    proc = run_python(code)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "merge raised: injected" in proc.stdout, proc.stdout
    assert proc.stdout.count("values [1, 2, 3, 4, 5]") == 2, proc.stdout
    assert "merged True 1" in proc.stdout and "values [5]" in proc.stdout, proc.stdout


# ------------------------------------------------------------------ region
@pytest.mark.parametrize("reserve", [1 << 40, -5, "x"])
def test_region_reserve_bytes_on_an_existing_tag_is_not_ignored(host, reserve, warns_unrouted):
    """A second region(tag, reserve_bytes=...) other than the tag's reservation is refused
    (a larger one, -5, "x"), never silently ignored; the tag's own reservation is accepted,
    and the remedy an allocation error names is one region() takes."""
    with vmm_core.region("kv", backend=host) as first:
        first.allocate(PAGE)
    with pytest.raises(AllocationError, match="reserve_bytes"):
        with vmm_core.region("kv", backend=host, reserve_bytes=reserve):
            pass
    # the same reservation, or none, is what the tag has: accepted
    with warns_unrouted(host, "kv"), \
            vmm_core.region("kv", backend=host, reserve_bytes=first.reserve_bytes) as again:
        assert again is first
    with pytest.raises(AllocationError, match=r"region\(tag, reserve_bytes"):
        first.allocate(first.reserve_bytes + PAGE)


def test_a_child_forked_during_another_threads_wake_sees_a_whole_wake(host):
    """A fork in the middle of another thread's direct wake() (its allocator lock held, the
    tagged-memory lock not) waits for the wake: the child gets whole mappings, and its own
    wake_up does not find half-mapped memory it refuses to map over ("overlaps the
    mapping")."""
    import multiprocessing
    import threading

    with vmm_core.region("weights", backend=host, reserve_bytes=1 << 20) as w:
        w.allocate(PAGE)
        w.extend_mapping(w.physical_bytes + PAGE)  # two handles: the wake maps twice
    w.sleep()
    mapping, release = threading.Event(), threading.Event()
    real_map = host.map

    def slow_map(*args, **kwargs):
        result = real_map(*args, **kwargs)
        if threading.current_thread() is waker:
            mapping.set()
            release.wait(5)  # the first handle is mapped, the second not yet
        return result

    waker = threading.Thread(target=w.wake, daemon=True)
    host.map = slow_map
    try:
        waker.start()
        assert mapping.wait(5)
        threading.Timer(0.5, release.set).start()  # the fork may wait for the wake
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()

        def child():
            vmm_core.wake_up("weights")
            vmm_core.sleep("weights")
            vmm_core.wake_up("weights")
            queue.put("ok")

        proc = ctx.Process(target=child)
        proc.start()
    finally:
        release.set()
        host.map = real_map
    join_child(proc, "during another thread's wake")
    waker.join(5)
    assert proc.exitcode == 0 and queue.get(timeout=5) == "ok"


@pytest.mark.parametrize("what", ["np", 1.5, None])
def test_offload_prepare_takes_numpy_sizes_and_explains_bad_arguments(host, what):
    """offload.prepare(np.int64(n)) takes the size; prepare(1.5) and other arguments that
    are neither a size nor a Backend are explained, not taken as a Backend."""
    from vmm_core.memory import offload

    if what == "np":
        try:
            assert offload.prepare(np.int64(1 << 20), backend=host) >= 0
            assert offload.prepared_bytes() == 1 << 20
        finally:
            offload.release_prepared()  # later tests' offloads must not take it
    else:
        with pytest.raises(ValueError, match="a number of bytes"):
            offload.prepare(what)


def test_a_fork_while_another_thread_looks_up_a_pool_group_leaves_the_child_usable(host):
    """Every GraphPool looks its allocator's group up under a module lock that the fork
    hooks cover: a child forked while another thread holds it (a GraphPool being made) makes
    its own first GraphPool."""
    from vmm_core.graphs import pool_group

    def child():
        pool = vmm_core.GraphPool(backend=host, tag="forked-child", reserve_bytes=1 << 20)
        with pool.space(1):
            pass
        pool.close()

    # what group_of() holds while a pool is made
    fork_while_held(pool_group._groups_lock, child, "on the pool-group lock held at the fork")


def test_keep_takes_numpy_addresses_and_extents(host):
    """keep((address, np.int64(n))) raised "keep() takes ... (address, nbytes) tuples,
    got tuple" inside the capture, which then counted as failed."""
    from vmm_core.memory import routing

    pool = vmm_core.GraphPool(backend=host, reserve_bytes=1 << 20)
    with pool.space(1):
        first = routing.current_target(0).allocate(PAGE)
        second = routing.current_target(0).allocate(PAGE)
        pool.keep(np.int64(first), (np.uint64(second), np.int64(PAGE)))
    assert pool.poisoned is None
    pool.before_replay(1)
    pool.close()


def test_a_fork_while_a_capture_waits_for_the_forking_thread_does_not_hang():
    """The fork hooks wait a bounded time for the tagged-memory lock, then fork anyway and
    give the child fresh locks: a thread inside a capture space (or replaying / hold_awake
    block) that waits for the forking thread cannot make os.fork() hang. Run in a child
    interpreter: a hang would stall it, not the run."""
    import textwrap

    code = textwrap.dedent("""
        import os, threading, vmm_core
        from vmm_core import forksafe
        from vmm_core.memory import routing
        forksafe.FORK_WAIT_SECONDS = 0.5
        be = vmm_core.get_backend("host")
        pool = vmm_core.GraphPool(backend=be, reserve_bytes=1 << 20)
        go, inside = threading.Event(), threading.Event()
        def capture():
            with pool.space(1):
                pool.keep(routing.current_target(0).allocate(4096))
                inside.set()
                go.wait()  # for the main thread, which forks first
        thread = threading.Thread(target=capture, daemon=True)
        thread.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:  # the child: its own pool, and sleep/wake of everything
            code = 1
            try:
                mine = vmm_core.GraphPool(backend=be, tag="child", reserve_bytes=1 << 20)
                with mine.space(1):
                    pass
                mine.before_replay(1)
                vmm_core.sleep()
                vmm_core.wake_up()
                code = 0
            finally:
                os._exit(code)
        go.set()
        _, status = os.waitpid(pid, 0)
        thread.join(5)
        pool.before_replay(1)  # the parent's locks were given back
        print("child exit", os.waitstatus_to_exitcode(status))
    """)
    proc = run_python(code, hung="os.fork() hung: a capture space on another thread "
                                 "waited for it")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "child exit 0" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


def test_a_local_sleep_refuses_before_any_tag_sleeps_when_one_is_inconsistent(host):
    """The local plan checked holds but not a failed rollback: sleep(["a", "b"]) with b
    inconsistent slept a, then raised on b, leaving the call half done."""
    from vmm_core.errors import VMMError
    from vmm_core.memory import tagged

    a = vmm_core.SharedVMMAllocator(host, tag="a")
    b = vmm_core.SharedVMMAllocator(host, tag="b")
    tagged.register("a", a)
    tagged.register("b", b)
    try:
        a.allocate(PAGE)
        b.allocate(PAGE)
        b._broken = VMMError("injected: a rollback that failed")
        with pytest.raises(VMMError, match="memory tagged 'b'.*failed rollback"):
            vmm_core.sleep(["a", "b"])
        assert not a.asleep
    finally:
        b._broken = None
        a.close()
        b.close()
