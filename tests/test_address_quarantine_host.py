"""A closed allocator's addresses do not go back while the framework still holds a
segment there (host backend, through the real C shim: the "framework" is this test,
calling the shim's alloc and free entry points as torch's pluggable allocator does).

Found on the H100: closing every tagged allocator while torch still held one of their
segments, then making new ones, gave the new allocator the old addresses; torch then
held two segments at one address and aborted the process at exit.  The later tests
cover the cases around it: concurrent retries, failures mid-way, a region's pool that
outlived its allocator.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

import vmm_core
from vmm_backends.host.allocator_adapter import HostAllocatorAdapter
from vmm_core.memory import address_quarantine, routing, tagged
from vmm_core.memory.shim import ALLOC_CALLBACK, c_alloc_callback, load_shim

PAGE = 4096
pytestmark = pytest.mark.usefixtures("clean_tags")


@pytest.fixture
def shim():
    s = load_shim()
    s.ensure_routing()
    return s


@pytest.fixture
def quarantine():
    """The ranges held back by this test: each test starts from what was there."""
    before = set(address_quarantine.held_back(0))
    yield lambda: set(address_quarantine.held_back(0)) - before


def _reserved(host, base) -> bool:
    return base in host.plugin._ranges


@contextlib.contextmanager
def _segment(shim, alloc, nbytes=PAGE):
    """A segment the framework holds until the block ends (alloc, then free)."""
    with routing.target(alloc.device, alloc):
        ptr = shim.lib.vmm_shim_alloc(nbytes, alloc.device, None)
    assert ptr
    try:
        yield ptr
    finally:
        shim.lib.vmm_shim_free(ptr, nbytes, alloc.device, None)


def test_the_shim_records_what_the_framework_holds(host, shim):
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    base = alloc.space_base()
    assert not shim.holds(base, alloc.reserve_bytes)
    with _segment(shim, alloc, 3 * PAGE) as ptr:
        assert shim.holds(base, alloc.reserve_bytes)
        assert shim.holds(ptr + 3 * PAGE - 1, 1) and not shim.holds(ptr + 3 * PAGE, PAGE)
    assert not shim.holds(base, alloc.reserve_bytes)
    alloc.close()


def test_a_range_the_framework_holds_stays_reserved_until_it_lets_go(host, shim, quarantine):
    old = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    base = old.space_base()
    with _segment(shim, old):
        old.close()
        assert quarantine() == {(base, old.reserve_bytes)}
        assert _reserved(host, base)  # unmapped, but no later reservation can get it
        new = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
        assert not base <= new.space_base() < base + old.reserve_bytes
        assert quarantine() == {(base, old.reserve_bytes)}  # tried, still held
    other = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)  # freed: it goes
    assert quarantine() == set()
    assert not _reserved(host, base) or other.space_base() == base
    new.close()
    other.close()


def test_ranges_nobody_holds_go_back_at_once(host, shim, quarantine):
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    alloc.allocate(PAGE)  # vmm_core's own allocation: not the framework's
    bases = [alloc.space_base()]
    alloc.switch_to_new_virtual_space()
    bases.append(alloc.space_base())
    alloc.close()
    assert quarantine() == set()
    assert not any(_reserved(host, b) for b in bases)


def test_a_released_space_the_framework_holds_is_held_back_too(host, shim, quarantine):
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    first, base = alloc.current_space, alloc.space_base()
    with _segment(shim, alloc):
        alloc.switch_to_new_virtual_space()
        alloc.release_virtual_space(first)
        assert quarantine() == {(base, alloc.reserve_bytes)}
        assert first not in alloc.space_indices()
    alloc.switch_to_new_virtual_space()  # the next reservation gives it back
    assert quarantine() == set()
    alloc.close()


def test_two_threads_retrying_release_each_range_once(host, shim, quarantine, monkeypatch):
    """Two threads retrying at once release each range once: neither releases a range twice,
    so no release can hit a range reserved again in between."""
    allocs = [vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE) for _ in range(4)]
    held = []
    segments = contextlib.ExitStack()
    for a in allocs:
        held.append((a.space_base(), a.reserve_bytes))
        segments.enter_context(_segment(shim, a))
        a.close()
    assert quarantine() == set(held)
    segments.close()  # the framework lets go of all four
    released, real = [], host.release_range

    def slow_release(device, base, size):
        released.append(base)
        time.sleep(0.02)  # widen the window between taking an entry and removing it
        return real(device, base, size)

    monkeypatch.setattr(host, "release_range", slow_release)
    threads = [threading.Thread(target=address_quarantine.retry, args=(host, 0))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(released) == sorted(base for base, _ in held)
    assert quarantine() == set()


def test_close_completes_when_the_framework_cannot_be_asked(host, quarantine, monkeypatch):
    """An error from the question does not leave close() half done (closed, yet its physical
    memory never released), and every new allocator in retry still works."""
    def broken(self, base, size):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(HostAllocatorAdapter, "holds_memory_in", broken)
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE)
    alloc.allocate(PAGE)
    base = alloc.space_base()
    alloc.close()
    assert alloc.closed and alloc.physical_bytes == 0
    assert quarantine() == {(base, alloc.reserve_bytes)}  # unknown: kept, never reused
    fresh = vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE)  # retry: no raise
    assert fresh.space_base() != base
    monkeypatch.undo()
    fresh.close()
    vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE).close()
    assert quarantine() == set()


@pytest.mark.parametrize("raised", [RuntimeError("a listener's bug"), KeyboardInterrupt()])
def test_a_step_of_close_that_raises_leaves_nothing_behind(host, quarantine, monkeypatch,
                                                           raised):
    """close() cannot be done twice (it is closed from its first step), so a step that
    raises something other than VMMError (a close listener's bug, an interrupt) must not
    stop the rest: every page and range is given back, then the error is raised."""
    from vmm_core.memory import tag_state

    def closing(alloc):
        raise raised

    monkeypatch.setattr(tag_state, "closing", closing)
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE)
    alloc.allocate(PAGE)
    alloc.switch_to_new_virtual_space()
    bases = [alloc.space_base(i) for i in alloc.space_indices()]
    with pytest.raises(type(raised)):
        alloc.close()
    assert alloc.closed and alloc.physical_bytes == 0
    assert not any(_reserved(host, base) for base in bases)
    assert quarantine() == set()
    alloc.close()  # done once: a no-op now


@pytest.mark.parametrize("raised", [RuntimeError("a listener's bug"),
                                    vmm_core.VMMError("a listener's error")])
def test_every_close_listener_is_told_whatever_one_raises(host, monkeypatch, raised):
    """A close listener that raises (a VMMError too: not a driver call whose failure a
    close may leave behind) does not keep the next one from its work, and is raised."""
    from vmm_core.memory import tag_state

    told = []

    def bad(alloc):
        raise raised

    monkeypatch.setattr(tag_state, "on_close", [bad, told.append])
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE)
    alloc.allocate(PAGE)
    with pytest.raises(type(raised)):
        alloc.close()
    assert told == [alloc] and alloc.closed and alloc.physical_bytes == 0


def test_one_failed_release_holds_back_that_range_and_releases_the_others(
        host, quarantine, monkeypatch):
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE)
    first = alloc.space_base()
    alloc.switch_to_new_virtual_space()
    second = alloc.space_base()
    real = host.release_range

    def failing_once(device, base, size):
        if base == first:
            raise vmm_core.errors.MappingError("vmm_release_range: injected")
        return real(device, base, size)

    monkeypatch.setattr(host, "release_range", failing_once)
    alloc.close()
    assert quarantine() == {(first, alloc.reserve_bytes)}
    assert not _reserved(host, second)
    monkeypatch.undo()
    vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE).close()
    assert quarantine() == set()


def test_a_closed_regions_framework_pool_goes_with_it(host):
    """The framework pool goes with its allocator: closing and re-entering a tag adds no
    pool, its segments are freed and its range given back, and a later allocator with the
    same id() is never handed the old pool."""
    before = len(tagged._pools)
    with pytest.warns(vmm_core.errors.VMMFallbackWarning):
        with vmm_core.region("cycle", backend=host, reserve_bytes=16 * PAGE):
            pass
    for _ in range(20):
        with vmm_core.region("cycle", backend=host, reserve_bytes=16 * PAGE) as alloc:
            alloc.allocate(PAGE)
        assert id(alloc) in tagged._pools
        alloc.close()
        assert id(alloc) not in tagged._pools
    assert len(tagged._pools) <= before + 1


# ---------------------------------------------------------------------- the shim's table
def test_the_table_answers_exactly_at_the_edges_and_near_the_top(shim):
    saved = shim._callback
    handed = []
    callback = c_alloc_callback(lambda size, device, stream: handed.pop(0))
    shim.lib.vmm_shim_set_alloc_callback(callback)
    try:
        for ptr, size in ((0x7000_0000_0000, 3 * PAGE), (2**64 - 2 * PAGE, PAGE)):
            handed.append(ptr)
            assert shim.lib.vmm_shim_alloc(size, 0, None) == ptr
            assert shim.holds(ptr, 1) and shim.holds(ptr + size - 1, 1)
            assert not shim.holds(ptr - PAGE, PAGE) and not shim.holds(ptr + size, PAGE)
            # a query whose end wraps past the top of the address space
            assert shim.holds(ptr - PAGE, 2**64 - (ptr - PAGE))
            shim.lib.vmm_shim_free(ptr, size, 0, None)
            assert not shim.holds(ptr, size)
    finally:
        shim.lib.vmm_shim_set_alloc_callback(saved if saved is not None else ALLOC_CALLBACK())


def test_an_allocation_not_yet_recorded_counts_as_held(shim):
    """The address is recorded after the callback returns: a close on another thread in
    between saw an empty table and gave back a range torch was about to hold."""
    saved = shim._callback
    inside, go = threading.Event(), threading.Event()

    def slow(size, device, stream):
        inside.set()
        go.wait(10)
        return 0x6000_0000_0000

    callback = c_alloc_callback(slow)
    shim.lib.vmm_shim_set_alloc_callback(callback)
    try:
        t = threading.Thread(target=shim.lib.vmm_shim_alloc, args=(PAGE, 0, None))
        t.start()
        assert inside.wait(10)
        assert shim.holds(0x1000, PAGE)  # any range: the address is not known yet
        go.set()
        t.join(10)
        assert not shim.holds(0x1000, PAGE) and shim.holds(0x6000_0000_0000, PAGE)
        shim.lib.vmm_shim_free(0x6000_0000_0000, PAGE, 0, None)
    finally:
        go.set()
        shim.lib.vmm_shim_set_alloc_callback(saved if saved is not None else ALLOC_CALLBACK())


def test_closing_empties_the_frameworks_cache_when_its_range_is_held(host, shim, quarantine,
                                                                     monkeypatch):
    """A framework pool let go of keeps its cached segments until the framework's cache
    is emptied (torch frees a released pool's segments then): a closing allocator whose
    range is held asks for that, and the range goes back at once, with no later
    reservation needed."""
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    base = alloc.space_base()
    with routing.target(alloc.device, alloc):
        cached = shim.lib.vmm_shim_alloc(PAGE, alloc.device, None)
    flushes = []

    def flush():  # the framework's empty cache: the released pool's segment goes
        flushes.append(True)
        shim.lib.vmm_shim_free(cached, PAGE, alloc.device, None)

    monkeypatch.setattr(host.allocator_adapter(0), "flush", flush)
    alloc.close()
    assert flushes == [True]
    assert quarantine() == set() and not _reserved(host, base)


def test_closing_a_range_nobody_holds_does_not_empty_the_frameworks_cache(host, quarantine,
                                                                          monkeypatch):
    flushes = []
    monkeypatch.setattr(host.allocator_adapter(0), "flush", lambda: flushes.append(True))
    vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE).close()
    assert flushes == [] and quarantine() == set()


def test_a_failed_release_alone_does_not_empty_the_frameworks_cache(host, quarantine,
                                                                    monkeypatch):
    flushes = []
    monkeypatch.setattr(host.allocator_adapter(0), "flush", lambda: flushes.append(True))
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE)
    base = alloc.space_base()

    def refuse(device, address, size):
        raise vmm_core.errors.VMMError("the driver refused the release")

    monkeypatch.setattr(host, "release_range", refuse)
    alloc.close()
    assert flushes == [], "emptying the cache cannot help a release the driver refused"
    assert quarantine() == {(base, 16 * PAGE)}
    monkeypatch.undo()
    vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE).close()  # retried: it goes
    assert quarantine() == set()


def test_a_close_inside_the_frameworks_allocator_leaves_its_cache_alone(host, shim, quarantine,
                                                                        monkeypatch):
    """Whole-process memory closes freed segments from inside torch's malloc, which holds
    torch's allocator lock: emptying the cache there would run torch's release mid-malloc."""
    flushes = []
    monkeypatch.setattr(host.allocator_adapter(0), "flush", lambda: flushes.append(True))
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    base = alloc.space_base()
    with _segment(shim, alloc):
        with address_quarantine.inside_framework_allocator():
            alloc.close()
        assert flushes == [] and quarantine() == {(base, alloc.reserve_bytes)}
    vmm_core.SharedVMMAllocator(host, reserve_bytes=16 * PAGE).close()
    assert quarantine() == set()
