"""A merge of a graph pool's handles keeps every byte that matters between captures: blocks
not yet declared with keep() inside an open space, an owner's own allocations and live
ranges, kept blocks across trims, sleeps, lazy wakes and a failed capture."""
from __future__ import annotations

import pytest
from host_space import framework_alloc, read, write

import vmm_core

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


@pytest.mark.parametrize("how", ["trim", "compact"])
def test_a_merge_inside_an_open_space_keeps_a_block_not_yet_declared(host, how):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space("a"):
        pool.keep(framework_alloc(MiB))
    with pool.space("b"):
        x = framework_alloc(5 * MiB)  # grows: a second handle with an unused tail
        x += 4 * MiB  # past what key "a" keeps at the same offsets
        write(x, b"static input")
        assert pool.allocator.num_handles >= 2
        getattr(pool, how)()
        got = read(x, 12)
        pool.keep(x)
    assert got == b"static input"
    pool.close()


def test_caller_allocations_survive_a_pool_merge(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    mine = alloc.allocate(4 * MiB) + 3 * MiB  # the caller's own, outside every pool
    write(mine, b"caller bytes")
    pool = vmm_core.GraphPool(backend=host, allocator=alloc)
    with pool.space("a"):
        pool.keep(framework_alloc(MiB))
    with pool.space("b"):
        from vmm_core.memory import routing
        routing.current_target(0).deallocate(framework_alloc(7 * MiB))
        pool.keep(framework_alloc(MiB))  # at 7 MiB: offsets 1..7 MiB are kept by nobody
    pool.compact()
    got = read(mine, 12)
    pool.close()
    alloc.close()
    assert got == b"caller bytes"


def test_kept_survive_trim_after_sleep_wake_and_a_failed_capture(host):
    pool = vmm_core.GraphPool(backend=host, tag="g")
    with pool.space(1):
        a = framework_alloc(MiB)
        pool.keep((a, MiB))
    vmm_core.sleep("g")
    vmm_core.wake_up("g")
    with pytest.raises(RuntimeError):
        with pool.space(2):
            from vmm_core.memory import routing
            routing.current_target(0).deallocate(framework_alloc(3 * MiB))
            raise RuntimeError("capture failed")
    with pool.space(3):
        b = framework_alloc(6 * MiB)
        write(b, b"kept")
        pool.keep((b, 6 * MiB))
    pool.trim()
    alloc = pool.allocator
    used = max(alloc.space_used_bytes(i) for i in alloc.space_indices())
    assert read(b, 4) == b"kept"
    assert alloc.physical_bytes == used, (alloc.physical_bytes, used)
    pool.close()


def test_first_replay_after_a_lazy_wake_merges_with_kept_bytes(host):
    pool = vmm_core.GraphPool(backend=host, tag="g")
    with pool.space("a"):
        a = framework_alloc(MiB)
        write(a, b"a-bytes")
        pool.keep((a, MiB))
    with pool.space("b"):
        b = framework_alloc(6 * MiB)
        pool.keep((b, 6 * MiB))
    vmm_core.sleep("g", offload="g")
    vmm_core.wake_up("g")
    with pool.replaying("b"):
        pass
    with pool.replaying("a"):
        pass
    with pool.space("c"):
        c = framework_alloc(9 * MiB)
        write(c + 8 * MiB, b"c-bytes")
        pool.keep((c, 9 * MiB))
    vmm_core.sleep("g", offload="g")
    vmm_core.wake_up("g")
    with pool.replaying("a"):
        assert read(a, 7) == b"a-bytes"
    with pool.replaying("c"):
        assert read(c + 8 * MiB, 7) == b"c-bytes"
    pool.trim()
    alloc = pool.allocator
    used = max(alloc.space_used_bytes(i) for i in alloc.space_indices())
    assert alloc.physical_bytes == used
    pool.close()


def test_trim_after_the_largest_pool_closed_holds_what_the_rest_use(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    small = vmm_core.GraphPool(backend=host, allocator=alloc, tag="s")
    big = vmm_core.GraphPool(backend=host, allocator=alloc, tag="b")
    with small.space(1):
        small.keep((framework_alloc(MiB), MiB))
    with big.space(2):
        big.keep((framework_alloc(8 * MiB), 8 * MiB))
    with big.space(3):
        big.keep((framework_alloc(40 * MiB), 40 * MiB))
    with small.space(4):
        small.keep((framework_alloc(2 * MiB), 2 * MiB))
    small.trim()
    big.close()
    with small.space(5):
        small.keep((framework_alloc(MiB), MiB))
    small.trim()
    used = max(alloc.space_used_bytes(i) for i in alloc.space_indices())
    handles, phys = alloc.num_handles, alloc.physical_bytes
    small.compact()
    after = alloc.physical_bytes
    small.close()
    alloc.close()
    assert phys == used, (phys, used, handles, after)


def test_kept_blocks_survive_a_merge_on_an_allocator_whose_owner_set_live_ranges(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    alloc.live_ranges = lambda: []  # the owner's: nothing of its own to keep
    pool = vmm_core.GraphPool(backend=host, allocator=alloc)
    with pool.space("a"):
        a = framework_alloc(MiB)
        pool.keep((a, MiB))
    with pool.space("b"):
        b = framework_alloc(6 * MiB)
        write(b + 5 * MiB, b"kept by b")
        pool.keep((b, 6 * MiB))
    pool.compact()
    got = read(b + 5 * MiB, 9)
    pool.close()
    alloc.close()
    assert got == b"kept by b"


def test_kept_blocks_survive_a_merge_on_a_region_allocator(host):
    with vmm_core.region("shared", backend=host, reserve_bytes=64 * MiB) as alloc:
        alloc.deallocate(alloc.allocate(1))
    pool = vmm_core.GraphPool(backend=host, allocator=alloc, tag="shared")
    with pool.space("a"):
        pool.keep((framework_alloc(MiB), MiB))
    with pool.space("b"):
        b = framework_alloc(6 * MiB)
        write(b + 5 * MiB, b"kept by b")
        pool.keep((b, 6 * MiB))
    with pool.space("c"):
        pool.keep((framework_alloc(MiB), MiB))
    with pool.replaying("b"):  # the switch merges
        got = read(b + 5 * MiB, 9)
    pool.close()
    assert got == b"kept by b"
