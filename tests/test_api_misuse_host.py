"""The single-process API used in ways it does not expect, on the host backend: tags of
one allocator slept apart, kept extents, sizes past the platform's limit, sleeps and
closes inside capture spaces, bad region tags, many keys, and forks under held locks.

A test where the failure would be a segfault or a deadlock runs its body in a child
interpreter with a timeout, so a crash or a hang fails the test instead of killing (or
stalling) the whole run.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re

import pytest
import torch
from host_space import framework_alloc, read, write
from proc_state import fork_while_held, run_python

import vmm_core
from vmm_core.errors import (
    AllocationError,
    BackendNotFoundError,
    CaptureError,
    SleepStateError,
    VMMError,
)
from vmm_core.memory import offload, tagged
from vmm_core.testing.tools import HookCounter

MiB = 1 << 20
PAGE = 4096
pytestmark = pytest.mark.usefixtures("clean_tags")


def run_child(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter; a segfault or a hang fails the test."""
    proc = run_python(code, timeout=timeout, env=dict(os.environ, VMM_CORE_BACKEND="host"))
    assert proc.returncode == 0, (f"the child died with {proc.returncode} "
                                  f"(negative: a signal); stderr:\n{proc.stderr[-3000:]}")
    return proc.stdout


# ------------------------------------------------------------------ tags of one allocator
def _two_families(host, warns_unrouted):
    """Pools "full" and "pieces" on one allocator; "pieces" keeps an output that holds
    b"piece output", "full" holds nothing.  Returns the allocator, both pools (a dropped
    pool gives its tag back) and the output."""
    alloc = vmm_core.SharedVMMAllocator(host)
    full = vmm_core.GraphPool(backend=host, allocator=alloc, tag="full")
    pieces = vmm_core.GraphPool(backend=host, allocator=alloc, tag="pieces")
    with warns_unrouted(host), full.space(1):
        pass
    with pieces.space(1):
        out = framework_alloc(MiB)
        pieces.keep(out)
    write(out, b"piece output")
    return alloc, (full, pieces), out


def test_offloading_one_tag_of_a_shared_allocator_keeps_its_bytes(host, warns_unrouted):
    """Two families on one allocator, one discarded and one offloaded in one sleep: the
    output the offloaded one kept reads back after wake, whatever order the tags sleep
    in."""
    alloc, (_, pieces), out = _two_families(host, warns_unrouted)
    vmm_core.sleep(offload=["pieces"])
    assert alloc.asleep
    vmm_core.wake_up()
    pieces.before_replay(1)
    assert read(out, 12) == b"piece output"


def test_sleeping_one_tag_of_a_shared_allocator_alone_is_refused(host, warns_unrouted):
    """Sleeping "full" alone would discard what "pieces" kept on their shared pages: the
    sleep is refused, naming the tag left out, and nothing sleeps."""
    alloc, (_, pieces), out = _two_families(host, warns_unrouted)
    for call in (lambda: vmm_core.sleep(["full"]),
                 lambda: vmm_core.sleep(["full"], offload=["full"])):
        with pytest.raises(SleepStateError, match=r"'full'.*\['pieces'\].*sleep\(\['full', "
                                                  r"'pieces'\]"):
            call()
        assert not alloc.asleep
    vmm_core.sleep(["full", "pieces"], offload=["pieces"])
    vmm_core.sleep(["full"])  # asleep already: a no-op, nothing more to lose
    vmm_core.wake_up(["full"])
    pieces.before_replay(1)
    assert read(out, 12) == b"piece output"


def test_an_allocator_under_two_tags_is_counted_once_in_the_sleep_log(host, caplog):
    alloc = vmm_core.SharedVMMAllocator(host)
    alloc.extend_mapping(1 << 30)  # memfd pages are not touched: no real memory
    tagged.register("a", alloc)
    tagged.register("b", alloc)
    with caplog.at_level(logging.INFO, logger="vmm_core"):
        vmm_core.sleep(["a", "b"])
    assert "freed 1.00 GiB" in caplog.text, caplog.text


# ------------------------------------------------------------------ keep extents
def test_a_kept_extent_excuses_every_block_it_overlaps(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        first = framework_alloc(MiB)
        second = framework_alloc(MiB)
        assert second == first + MiB
        pool.keep((first, 2 * MiB))
    assert pool.poisoned is None
    with pool.space(2):
        first = framework_alloc(MiB)
        framework_alloc(MiB)
        both = torch.frombuffer((ctypes.c_char * (2 * MiB)).from_address(first),
                                dtype=torch.uint8)
        pool.keep(both[MiB - 8:MiB + 8])  # a view spanning the two blocks
    assert pool.poisoned is None
    del both


# ------------------------------------------------------------------ sizes
def test_sizes_past_the_platform_limit_are_refused_before_any_system_call():
    out = run_child("""
        import vmm_core
        from vmm_core.errors import VMMError
        be = vmm_core.get_backend("host")
        for n in (2**64, 2**70, 2**64 - 4096):
            try:
                a = vmm_core.SharedVMMAllocator(be, reserve_bytes=n)
            except VMMError as exc:
                print("allocator refused", n, type(exc).__name__, exc)
            else:
                a.allocate(4096)
                print("allocator accepted", n)
            try:
                be.reserve(0, n, 4096)
            except VMMError as exc:
                print("reserve refused", n, type(exc).__name__)
            else:
                print("reserve accepted", n)
        try:
            vmm_core.SharedVMMAllocator(be, growth_bytes=2**64)
        except VMMError as exc:
            print("growth refused")
    """)
    assert "accepted" not in out, out
    assert out.count("allocator refused") == 3 and out.count("reserve refused") == 3, out
    assert "AllocationError" in out and "reserve_bytes" in out and "growth refused" in out


# ------------------------------------------------------------------ sleep in a capture
def test_sleep_inside_an_open_capture_space_is_refused(host):
    pool = vmm_core.GraphPool(backend=host)
    with vmm_core.region("weights", backend="host") as w:
        weights = w.allocate(PAGE)
    with pool.space(1):
        out = framework_alloc(MiB)
        pool.keep(out)
        with pytest.raises(SleepStateError, match=r"capture space of 1.*leave"):
            vmm_core.sleep()
        with pytest.raises(SleepStateError, match="capture space of 1"):
            pool.allocator.sleep()
        assert not tagged.allocators("weights")[0].asleep, "refused, but half done"
        write(out, b"still mapped")
        framework_alloc(PAGE)  # the next allocation works
        pool.keep(out + MiB)
    write(weights, b"w")
    vmm_core.sleep()  # outside the block: fine
    vmm_core.wake_up()


def test_space_while_graph_memory_sleeps_is_refused_every_time(host):
    pool = vmm_core.GraphPool(backend=host)
    vmm_core.sleep("graph")
    for _ in range(2):
        with pytest.raises(SleepStateError, match=r"wake_up\('graph'\)"):
            with pool.space(1):
                pass
    vmm_core.wake_up("graph")
    with pool.space(1):
        pass


# ------------------------------------------------------------------ lock order
def test_allocator_hold_awake_then_before_replay_does_not_deadlock_a_replay():
    run_child("""
        import threading, time
        import vmm_core
        pool = vmm_core.GraphPool(backend="host")
        for key in (1, 2):
            with pool.space(key):
                pass
        alloc, done = pool.allocator, []
        barrier = threading.Barrier(2, timeout=10)

        def engine():
            with alloc.hold_awake():
                barrier.wait()
                time.sleep(0.3)  # let the other thread start its replay first
                pool.before_replay(1)
                done.append("engine")

        def other():
            barrier.wait()
            with pool.replaying(2):
                done.append("other")

        threads = [threading.Thread(target=f, daemon=True) for f in (engine, other)]
        [t.start() for t in threads]
        [t.join(20) for t in threads]
        assert sorted(done) == ["engine", "other"], done
    """, timeout=60)


# ------------------------------------------------------------------ region tags
@pytest.mark.parametrize("bad", [123, ""])
def test_a_bad_region_tag_creates_nothing(host, bad):
    for _ in range(2):  # the second attempt is refused alike
        with pytest.raises((TypeError, ValueError), match="tag"):
            with vmm_core.region(bad, backend="host"):
                pass
    assert not tagged._region_allocators and not tagged._registry
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        pass
    pool.before_replay(1)  # tags of other types left no trace to compare against


# ------------------------------------------------------------------ many keys
def test_ten_thousand_keys_with_a_graph_pool_level_reservation(host):
    pool = vmm_core.GraphPool(backend=host, reserve_bytes=MiB)
    for key in range(10_000):
        with pool.space(key):
            pool.keep(framework_alloc(PAGE))
    stats = pool.stats()
    assert stats["virtual_spaces"] == 10_000 and stats["physical_bytes"] == PAGE
    with pytest.raises(CaptureError) as err:
        pool.before_replay(-1)
    msg = str(err.value)
    assert "10000 keys" in msg and len(msg) < 300, msg  # a few keys and the count
    pool.close()


def test_running_out_of_address_space_names_the_graph_pool_remedy():
    out = run_child("""
        import resource
        import vmm_core
        from vmm_core.errors import VMMError
        with open("/proc/self/status") as f:
            vm = [l for l in f if l.startswith("VmSize")][0]
        used = int(vm.split()[1]) * 1024
        limit = used + 40 * 2**30  # room for two 16 GiB spaces, not three
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        pool = vmm_core.GraphPool(backend="host")
        try:
            for key in range(10):
                with pool.space(key):
                    pool.keep(pool.allocator.allocate(4096))
        except VMMError as exc:
            print(type(exc).__name__, exc)
    """)
    assert "GraphPool(reserve_bytes=" in out, out


def test_a_new_pools_first_reservation_names_the_graph_pool_remedy():
    out = run_child("""
        import resource
        import vmm_core
        from vmm_core.errors import VMMError
        with open("/proc/self/status") as f:
            vm = [l for l in f if l.startswith("VmSize")][0]
        used = int(vm.split()[1]) * 1024
        limit = used + 8 * 2**30  # less than one 16 GiB space
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            vmm_core.GraphPool(backend="host")
        except VMMError as exc:
            print(type(exc).__name__, exc)
        pool = vmm_core.GraphPool(backend="host", reserve_bytes=64 * 2**20)
        with pool.space(1):
            pass
        print("a smaller reservation fits")
    """)
    # the same type (a caller catching MemoryError still does), the GraphPool-level remedy
    assert "OutOfMemoryError GraphPool: no address space left for the first key" in out, out
    assert "GraphPool(reserve_bytes=" in out and "a smaller reservation fits" in out, out


# ------------------------------------------------------------------ close in a space
def test_closing_a_pool_inside_its_own_space_is_refused(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        with pytest.raises(CaptureError, match=r"close\(\).*space of 1.*leave"):
            pool.close()
    pool.before_replay(1)
    pool.close()


def test_closing_the_allocator_under_a_block_that_holds_it_awake_is_refused(host):
    """Closing the allocator inside a capture space unmapped the pages the space goes on
    writing (its kept outputs); a GraphPool closing the allocator it created inside a
    ``hold_awake`` block of its tag did the same to the holder."""
    alloc = vmm_core.SharedVMMAllocator(host)
    pool = vmm_core.GraphPool(backend=host, allocator=alloc, tag="closing")
    with pool.space(1):
        out = framework_alloc(MiB)
        pool.keep(out)
        with pytest.raises(VMMError, match=r"close\(\) inside the capture space of 1.*leave"):
            alloc.close()
        write(out, b"still mapped")
    assert not alloc.closed and read(out, 12) == b"still mapped"
    with alloc.hold_awake():
        with pytest.raises(VMMError, match=r"close\(\) inside a hold_awake block"):
            alloc.close()
    pool.close()
    alloc.close()
    assert alloc.closed

    owned = vmm_core.GraphPool(backend=host, tag="owned")
    with owned.space(1):
        pass
    with tagged.hold_awake("owned"):
        with pytest.raises(VMMError, match=r"GraphPool.close\(\) inside .*leave"):
            owned.close()
        owned.before_replay(1)  # refused before anything was given back
    owned.close()
    assert owned.allocator.closed


def test_closing_a_pool_on_a_shared_allocator_under_a_hold_is_refused(host):
    """Not only the last pool: one of two pools on an allocator gave its spaces (and its
    kept output) back inside a hold_awake of its own tag."""
    a = vmm_core.GraphPool(backend=host, tag="fam-a")
    b = vmm_core.GraphPool(backend=host, allocator=a.allocator, tag="fam-b")
    with a.space(1):
        out = framework_alloc(MiB)
        a.keep(out)
    with b.space(2):
        pass
    write(out, b"kept by a")
    with tagged.hold_awake("fam-a"):
        with pytest.raises(VMMError, match=r"GraphPool.close\(\) inside"):
            a.close()
        assert read(out, 9) == b"kept by a"
    with a.replaying(1):
        with pytest.raises(VMMError, match=r"inside the replay block of 1 "):
            a.close()
    a.close()
    b.close()
    assert a.allocator.closed


def test_closing_an_executor_under_a_hold_changes_nothing(host):
    ex = vmm_core.GraphExecutor(lambda x: x * 2, torch.zeros(4, 4), backend=host, tag="ex")
    x = torch.rand(2, 4)
    assert torch.equal(ex(x), x * 2)
    with tagged.hold_awake("ex"):
        with pytest.raises(VMMError, match=r"inside a hold_awake block"):
            ex.close()
    y = torch.rand(3, 4)
    assert torch.equal(ex(y), y * 2)  # still open, its graphs still there
    ex.close()
    with pytest.raises(CaptureError, match="closed"):
        ex(y)


# ------------------------------------------------------------------ per-key cost
def _map_calls_per_key(host, keys: int) -> float:
    """Every key a page larger than the last, one page per growth: every key adds a
    handle, the worst case for merging."""
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=4 * MiB, growth_bytes=PAGE)
    pool = vmm_core.GraphPool(backend=host, allocator=alloc)
    starts = []
    with HookCounter(host) as counter:
        for key in range(keys):
            with pool.space(key):
                starts.append(framework_alloc((key + 1) * PAGE))
                pool.keep(starts[-1])
            # the page only this key reaches, written through this key's space: merges
            # must carry it along, and every other space must see it
            write(starts[-1] + key * PAGE, b"key %d" % key)
            if key % 7 == 0:
                pool.before_replay(key // 2)  # replays of other keys merge too
    assert alloc.num_handles < 20, "handles piled up instead of merging"
    for key in range(0, keys, max(1, keys // 25)):
        marker = b"key %d" % key
        assert read(starts[-1] + key * PAGE, len(marker)) == marker  # the newest space
        assert read(starts[key] + key * PAGE, len(marker)) == marker  # its own space
        later = min(keys - 1, 2 * key + 1)  # a later space maps every older key's block
        pool.before_replay(later)
        assert read(starts[later] + key * PAGE, len(marker)) == marker
    pool.close()
    alloc.close()
    return (counter.calls["vmm_map"] + counter.calls["vmm_unmap"]) / keys


def test_map_calls_per_new_key_do_not_grow_with_the_key_count(host):
    few, many = _map_calls_per_key(host, 150), _map_calls_per_key(host, 600)
    assert many < 2 * few, (few, many)


class _NoScan(dict):
    """A dict that fails a test that walks it: lookups only, no scan of every entry."""

    def _scan(self, *args):
        raise AssertionError("scanned every entry")

    __iter__ = keys = values = items = _scan


def test_the_host_backend_checks_mappings_without_scanning_them_all(host):
    """A scan of every range and mapping made a new key cost 1 ms at 8000 keys (0.09 ms
    at first): every check is a lookup in the sorted starts."""
    be = host.plugin
    bases = [host.reserve(0, 4 * PAGE, PAGE) for _ in range(200)]
    handle = host.create_handle(0, PAGE)
    ranges, maps = be._ranges, be._maps
    be._ranges, be._maps = _NoScan(ranges), _NoScan(maps)
    try:
        for base in bases:
            host.map(0, base, PAGE, handle, 0)
        with pytest.raises(VMMError, match="overlaps"):
            host.map(0, bases[100], PAGE, handle, 0)
        with pytest.raises(VMMError, match="not inside"):
            host.map(0, bases[100] + 4 * PAGE, PAGE, handle, 0)
        with pytest.raises(VMMError, match="still live"):
            host.release_range(0, bases[50], 4 * PAGE)
        with pytest.raises(VMMError, match="not fully mapped"):
            host.set_access(0, bases[7], 2 * PAGE)
        host.set_access(0, bases[7], PAGE)
        host.unmap(0, bases[9], PAGE)
        host.release_range(0, bases[9], 4 * PAGE)
        bases.remove(bases[9])
    finally:
        be._ranges, be._maps = dict(dict.items(be._ranges)), dict(dict.items(be._maps))
        for base in bases:
            if base in be._maps:
                host.unmap(0, base, PAGE)
            host.release_range(0, base, 4 * PAGE)
        host.release_handle(0, handle)


def test_the_allocator_finds_an_address_space_without_scanning_them_all(host):
    """The framework's free path looks up the space of every block it frees."""
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE)
    try:
        addresses = []
        for _ in range(100):
            alloc.switch_to_new_virtual_space()
            addresses.append(alloc.allocate(PAGE))
        spaces = alloc._spaces
        alloc._spaces = _NoScan(spaces)
        try:
            assert alloc.translate(addresses[40], alloc.current_space) == \
                alloc.space_base() + (addresses[40] - alloc.space_base(41))
            alloc.deallocate(addresses[40])  # never raises: check that it worked
            assert addresses[40] not in spaces[41].live
        finally:
            alloc._spaces = spaces
    finally:
        alloc.close()


def test_a_zero_byte_fill_through_the_fallback_does_nothing(host, monkeypatch):
    """Backends without vmm_memset fill through host copies; 0 bytes made range(0, 0, 0)
    raise a raw ValueError."""
    monkeypatch.setattr(host, "implements", lambda hook: False)
    host.memset(0, 0, 0, 0)


# ------------------------------------------------------------------ smaller
@pytest.mark.parametrize("device", ["0", 0.7, True, -1])
def test_loose_devices_are_refused(host, device):
    with pytest.raises((TypeError, ValueError, VMMError), match="device"):
        vmm_core.SharedVMMAllocator(host, device=device)
    with pytest.raises((TypeError, ValueError, VMMError), match="device"):
        vmm_core.GraphPool(device, backend=host)


def test_loose_buckets_and_offload_settings_are_refused(host):
    with pytest.raises(ValueError, match="buckets"):
        vmm_core.GraphExecutor(lambda x: x * 2, torch.zeros(4, 2), buckets=[1.5, 4])
    with pytest.raises(ValueError, match="buckets"):
        vmm_core.GraphExecutor(lambda x: x * 2, torch.zeros(4, 2), buckets=[True, 4])
    with pytest.raises(ValueError, match="hugepages"):
        offload.configure(hugepages="no")
    with pytest.raises(ValueError, match="chunk_bytes"):
        offload.configure(chunk_bytes=True)
    assert offload.config().hugepages is True and offload.config().chunk_bytes > 1


def test_bad_sleep_tags_and_pool_allocators_are_explained(host):
    with pytest.raises(VMMError, match="tags must be"):
        vmm_core.sleep(tags=123)
    with pytest.raises(VMMError, match="tags must be"):
        vmm_core.wake_up(tags=[1])
    with pytest.raises(TypeError, match="allocator must be a SharedVMMAllocator"):
        vmm_core.GraphPool(allocator="x")
    with pytest.raises(AllocationError, match="reserve_bytes"):
        vmm_core.GraphPool(backend=host, allocator=vmm_core.SharedVMMAllocator(host),
                           reserve_bytes=MiB)


@pytest.mark.parametrize("bad", [5, True, [""], ["weights", 3], b"weights"])
def test_every_tags_argument_refuses_alike_naming_itself(host, bad):
    """"A tag or a list of tags" is read by one function (tag_state.tag_list): a call
    given anything else raises its own error type naming its argument and what it was
    given, and changes nothing."""
    with vmm_core.region("weights", backend=host, reserve_bytes=MiB) as alloc:
        alloc.allocate(PAGE)
    shown = repr(bad) if isinstance(bad, int) else r".* in \["
    calls = [
        (VMMError, "tags", lambda: vmm_core.sleep(tags=bad)),
        (VMMError, "tags", lambda: vmm_core.wake_up(tags=bad)),
        (VMMError, "vmm_core.sleep: offload", lambda: vmm_core.sleep(offload=bad)),
        (ValueError, "reads", lambda: vmm_core.GraphPool(backend=host, reads=bad)),
        (ValueError, "offload.prepare: tags",
         lambda: offload.prepare(bad if isinstance(bad, list) else [bad])),
        (ValueError, "set_keep_host_buffers: tags",
         lambda: offload.set_keep_host_buffers(bad, False)),
        (ValueError, "hold_awake: tags", lambda: tagged.hold_awake(bad).__enter__()),
    ]
    for error, what, call in calls:
        with pytest.raises(error, match=rf"^{re.escape(what)} must be a tag name or a "
                                        rf"list of tag names \(non-empty strings\), got "
                                        rf"{shown}"):
            call()
    assert not alloc.asleep and alloc.host_bytes == 0
    assert offload.keeps_host_buffers("weights")


def test_every_tags_argument_takes_a_tag_or_any_iterable_of_tags(host):
    with vmm_core.region("weights", backend=host, reserve_bytes=MiB) as w, \
            vmm_core.region("kv", backend=host, reserve_bytes=MiB) as kv:
        w.allocate(PAGE)
        kv.allocate(PAGE)
    vmm_core.sleep(tags=(t for t in ["weights", "kv", "weights"]), offload={"weights"})
    assert w.asleep and kv.asleep and w.host_bytes > 0 and kv.host_bytes == 0
    vmm_core.wake_up(tags=vmm_core.memory_summary().keys())
    assert not w.asleep and not kv.asleep
    with tagged.hold_awake("kv"):
        assert kv._lock._is_owned()


def _enter_region(tag, backend):
    with vmm_core.region(tag, backend=backend):
        pass


@pytest.mark.parametrize("bad", [5, 2.5, ["host"], b"host"])
def test_a_backend_of_a_wrong_type_is_refused_alike_everywhere(host, bad):
    """Every ``backend=`` is read by one function (vmm_core.registry.resolve): a Backend,
    a name or None; anything else is a TypeError naming what was given, before anything
    is made."""
    calls = {
        "SharedVMMAllocator": lambda: vmm_core.SharedVMMAllocator(backend=bad),
        "GraphPool": lambda: vmm_core.GraphPool(backend=bad),
        "GraphExecutor": lambda: vmm_core.GraphExecutor(lambda x: x, torch.zeros(2),
                                                        backend=bad),
        "region": lambda: _enter_region("bad-backend", bad),
        "offload.prepare": lambda: offload.prepare(MiB, backend=bad),
    }
    expected = (rf"backend must be a vmm_core Backend \(vmm_core.get_backend\(\)\), a "
                rf"backend name or None \(auto-detect\), got {re.escape(repr(bad))} "
                rf"\({type(bad).__name__}\)")
    for what, call in calls.items():
        with pytest.raises(TypeError, match=expected):
            call()
    assert "bad-backend" not in vmm_core.memory_summary()
    assert offload.prepared_bytes() == 0


def test_a_backend_name_and_the_backend_itself_resolve_alike(host):
    by_name = vmm_core.SharedVMMAllocator(backend="host", reserve_bytes=MiB)
    by_object = vmm_core.SharedVMMAllocator(backend=host, reserve_bytes=MiB)
    pool = vmm_core.GraphPool(backend="host", reserve_bytes=MiB)
    try:
        assert by_name.backend is by_object.backend is pool.backend is host
    finally:
        for closing in (by_name, by_object, pool):
            closing.close()
    with pytest.raises(BackendNotFoundError, match="no vmm_core backend named 'hots'"):
        vmm_core.GraphPool(backend="hots")


def test_a_key_whose_capture_failed_is_not_captured(host):
    pool = vmm_core.GraphPool(backend=host)
    with pytest.raises(ZeroDivisionError):
        with pool.space(7):
            1 / 0
    with pytest.raises(CaptureError, match="no graph was captured in the space of 7"):
        with pool.replaying(7):
            pass
    with pool.space(7):  # a second attempt succeeds and counts
        pass
    pool.before_replay(7)


# ------------------------------------------------------------------ fork
def _lock_named(host, lock: str):
    from vmm_core import registry
    from vmm_core.graphs import torch_graph_ops
    from vmm_core.memory import shim

    return {"tagged": lambda: tagged.state_lock(), "host backend": lambda: host.plugin._lock,
            "Backend": lambda: host._lock,
            "registry": lambda: registry.default_registry()._lock,
            "default registry": lambda: registry._default_lock,
            "shim": lambda: shim._lock,
            "replay streams": lambda: torch_graph_ops._replay_lock}[lock]()


@pytest.mark.parametrize("lock", ["tagged", "host backend", "Backend", "registry",
                                  "default registry", "shim", "replay streams"])
def test_a_fork_while_another_thread_holds_a_lock_leaves_the_child_usable(host, lock):
    """The reaper thread closing a dropped pool holds the tagged-memory lock (and the host
    backend's) for a moment; a child forked then gets every lock of vmm_core fresh and makes
    its first GraphPool: the child takes each lock (the replay-stream lock has no host
    caller: taken as is)."""
    from vmm_core import get_backend
    from vmm_core.memory import shim

    held = _lock_named(host, lock)

    def child():
        get_backend("host").capabilities(0)  # the registries' and the Backend's locks
        shim.load_shim().ensure_routing()
        with _lock_named(host, "replay streams"):
            pass
        pool = vmm_core.GraphPool(backend=host, tag="forked-child")
        with pool.space(1):
            pool.keep(framework_alloc(PAGE))
        pool.close()

    fork_while_held(held, child, f"on the {lock} lock held at the fork")
