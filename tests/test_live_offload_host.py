"""An offloading sleep copies live bytes only, for real on the host backend.

A region's allocator knows its framework pool's free blocks; a graph pool knows what
replays read.  The sleep copies exactly what they name (``SharedVMMAllocator.live_ranges``),
the host copy is that size, and ``preserve_live`` keeps it through a discarding sleep."""

from __future__ import annotations

import ctypes
import random

import pytest

import vmm_core
from vmm_core.errors import VMMError
from vmm_core.memory import host_memory, live_ranges, offload, tagged

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


def _fill(address: int, n: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(n)
    ctypes.memmove(address, data, n)
    return data


def _read(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


def _region_with_a_hole(tag: str = "w"):
    """A region holding A, a freed B and C (1 MiB each): what a framework pool caches."""
    with vmm_core.region(tag, backend="host") as alloc:
        a, b, c = (alloc.allocate(MIB) for _ in range(3))
    alloc.deallocate(b)
    return alloc, a, b, c


def test_range_arithmetic():
    assert live_ranges.merge([(10, 5), (0, 4), (4, 2), (30, 0)], gap=0) == [(0, 6), (10, 5)]
    assert live_ranges.merge([(0, 4), (10, 5)], gap=6) == [(0, 15)]
    assert live_ranges.subtract([(0, 100)], [(10, 10), (50, 60)]) == [(0, 10), (20, 30)]
    assert live_ranges.subtract([(0, 10), (20, 10)], [(5, 20)]) == [(0, 5), (25, 5)]
    with pytest.raises(VMMError, match="pairs"):
        live_ranges.checked(5, "x")
    with pytest.raises(VMMError, match=r"\(address, nbytes\)"):
        live_ranges.checked([(1, -2)], "x")
    with pytest.raises(VMMError, match=r"\(address, nbytes\)"):
        live_ranges.checked([(1.5, 2)], "x")


def test_subtract_takes_out_exactly_the_bytes_of_the_holes():
    rng = random.Random(3)
    for _ in range(2000):
        ranges = [(rng.randrange(200), rng.randrange(40)) for _ in range(rng.randrange(6))]
        holes = [(rng.randrange(200), rng.randrange(40)) for _ in range(rng.randrange(6))]
        got = live_ranges.subtract(ranges, holes)
        want = {b for s, n in ranges for b in range(s, s + n)} - \
            {b for s, n in holes for b in range(s, s + n)}
        assert {b for s, n in got for b in range(s, s + n)} == want, (ranges, holes)
        assert got == live_ranges.merge(got, gap=0), "sorted, disjoint, not touching"


def test_offload_copies_the_live_blocks_not_the_freed_one():
    alloc, a, b, c = _region_with_a_hole()
    data_a, data_c = _fill(a, MIB, 1), _fill(c, MIB, 2)
    _fill(b, MIB, 3)  # freed: its bytes need not come back
    vmm_core.sleep("w", offload="w")
    assert alloc.host_bytes == 2 * MIB, "the freed block must not be copied"
    assert alloc.last_transfer.nbytes == 2 * MIB
    vmm_core.wake_up("w", zero=True)
    assert _read(a, MIB) == data_a and _read(c, MIB) == data_c
    assert _read(b, MIB) == bytes(MIB), "zero=True fills what was not copied"
    assert alloc.host_bytes == 2 * MIB  # kept for the next round, at the live size


def test_live_blocks_close_together_are_copied_as_one_range():
    with vmm_core.region("w", backend="host") as alloc:
        a = alloc.allocate(MIB)
        gap = alloc.allocate(32 << 10)
        c = alloc.allocate(MIB)
    alloc.deallocate(gap)
    data = _fill(a, MIB, 1), _fill(c, MIB, 2)
    vmm_core.sleep("w", offload="w")
    assert alloc.host_bytes == 2 * MIB + (32 << 10)  # one copy beats two
    vmm_core.wake_up("w")
    assert (_read(a, MIB), _read(c, MIB)) == data


def test_the_kept_copy_is_reused_while_the_live_set_is_unchanged_and_replaced_once():
    alloc, a, _, c = _region_with_a_hole()
    events: list[tuple[str, int]] = []
    real_init, real_release = host_memory.MappedHostCopy.__init__, \
        host_memory.MappedHostCopy.release

    def init(self, size, *args, **kwargs):
        events.append(("made", size))
        real_init(self, size, *args, **kwargs)

    def release(self, *args, **kwargs):
        if self.base is not None:
            events.append(("freed", self.size))
        real_release(self, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(host_memory.MappedHostCopy, "__init__", init)
    mp.setattr(host_memory.MappedHostCopy, "release", release)
    try:
        for rnd in range(3):
            data = _fill(a, MIB, rnd), _fill(c, MIB, rnd + 10)
            vmm_core.sleep("w", offload="w")
            vmm_core.wake_up("w")
            assert (_read(a, MIB), _read(c, MIB)) == data
            assert offload.wait_for_pinning(10)
        assert events == [("made", 2 * MIB)], "one copy for three rounds of one live set"
        assert alloc.last_transfer.strategy == "pinned"  # rounds 2.. copy straight
        with vmm_core.region("w", backend="host"):
            d = alloc.allocate(MIB)  # the live set grows
        data = _fill(a, MIB, 7), _fill(d, MIB, 8)
        vmm_core.sleep("w", offload="w")
        vmm_core.wake_up("w")
        assert (_read(a, MIB), _read(d, MIB)) == data
        # the old copy went before the new one was made: never both held
        assert events == [("made", 2 * MIB), ("freed", 2 * MIB), ("made", 3 * MIB)]
    finally:
        mp.undo()


def test_nothing_live_copies_nothing_and_keeps_nothing():
    with vmm_core.region("w", backend="host") as alloc:
        a = alloc.allocate(MIB)
    vmm_core.sleep("w", offload="w")
    vmm_core.wake_up("w")
    assert alloc.host_bytes == MIB
    alloc.deallocate(a)
    vmm_core.sleep("w", offload="w")
    assert alloc.asleep and alloc.host_bytes == 0 and alloc.physical_bytes == 0
    vmm_core.wake_up("w")
    assert alloc.host_bytes == 0 and alloc.physical_bytes > 0


def test_preserve_live_keeps_the_live_ranges_through_a_discarding_sleep(host):
    alloc = vmm_core.SharedVMMAllocator(host, tag="g")
    tagged.register("g", alloc)
    alloc.allocate(MIB)  # scratch: not kept
    kept = alloc.allocate(MIB)
    alloc.live_ranges = lambda: [(kept, MIB)]
    data = _fill(kept, MIB, 4)
    alloc.preserve_live = True
    vmm_core.sleep("g")  # discard
    assert alloc.host_bytes == MIB
    vmm_core.wake_up("g")
    assert _read(kept, MIB) == data
    assert alloc.host_copy_address(kept, MIB) is not None  # kept for the next round
    alloc.preserve_live = False
    vmm_core.sleep("g")
    vmm_core.wake_up("g", keep_host_buffers=False)
    assert alloc.host_bytes == 0


def test_ranges_in_another_space_are_kept_through_their_physical_offset(host):
    alloc = vmm_core.SharedVMMAllocator(host, tag="g")
    tagged.register("g", alloc)
    first = alloc.allocate(MIB)
    alloc.switch_to_new_virtual_space()  # the current space is another one
    alloc.live_ranges = lambda: [(first, MIB), (0x10, 5)]  # 0x10: nobody's memory
    data = _fill(first, MIB, 9)
    vmm_core.sleep("g", offload="g")
    assert alloc.host_bytes == MIB
    vmm_core.wake_up("g")
    alloc.ensure_mapped(0)
    assert _read(first, MIB) == data


@pytest.mark.parametrize("bad", [lambda: 7, lambda: [(1, 2, 3)], lambda: 1 / 0])
def test_a_broken_live_ranges_refuses_the_sleep_and_changes_nothing(host, bad):
    alloc = vmm_core.SharedVMMAllocator(host, tag="g")
    tagged.register("g", alloc)
    address = alloc.allocate(MIB)
    data = _fill(address, MIB, 5)
    alloc.live_ranges = bad
    with pytest.raises((VMMError, ZeroDivisionError)):
        vmm_core.sleep("g", offload="g")
    assert not alloc.asleep and alloc.host_bytes == 0 and _read(address, MIB) == data
    vmm_core.sleep("g")  # a discarding sleep does not ask
    assert alloc.asleep


def test_host_copy_address_finds_offloaded_bytes_and_nothing_else():
    alloc, _, b, c = _region_with_a_hole()
    data_c = _fill(c, MIB, 6)
    assert alloc.host_copy_address(c, MIB) is None  # nothing copied yet
    vmm_core.sleep("w", offload="w")
    host = alloc.host_copy_address(c + 4096, 4096)
    assert host is not None and _read(host, 4096) == data_c[4096:8192]
    assert alloc.host_copy_address(b, 16) is None, "the freed block was not copied"
    assert alloc.host_copy_address(c + MIB - 8, 16) is None, "past the live block"
    vmm_core.wake_up("w", keep_host_buffers=False)
    assert alloc.host_copy_address(c, MIB) is None
