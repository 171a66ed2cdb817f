"""GraphPool(reuse="single") and what sleep keeps of graph memory, on the host backend.

"single" is a drop-in for one shared capture pool: every key captures into one VMM space
in capture order, blocks alive after a capture are legal and survive sleep, free blocks
are not copied.  The default reuse="vmm" keeps refusing blocks that outlive a capture
(they would alias every other key), so a library's lazily made persistent state inside a
capture is refused there, and kept where nothing aliases it."""

from __future__ import annotations

import pytest
from host_space import LazyCounter, framework_alloc, read, write

import vmm_core
from vmm_core.errors import CaptureEscapeError, VMMError

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


def test_every_key_captures_into_one_space_in_capture_order(host):
    pool = vmm_core.GraphPool(backend=host, reuse="single")
    outs = {}
    for key in (8, 1, 4):
        with pool.space(key) as handle:
            assert handle is not None
            outs[key] = framework_alloc(MIB)  # a static output the engine keeps
            write(outs[key], bytes([key]) * 16)
    assert outs[1] == outs[8] + MIB and outs[4] == outs[1] + MIB, "one bump, no aliasing"
    assert {k: read(a, 16) for k, a in outs.items()} == {k: bytes([k]) * 16 for k in outs}
    stats = pool.stats()
    assert stats["reuse"] == "single" and stats["virtual_spaces"] == 1
    assert stats["physical_bytes"] == 3 * MIB
    pool.before_replay(8)
    pool.close()


def test_sleep_keeps_live_blocks_and_drops_free_ones_even_when_it_discards(host):
    pool = vmm_core.GraphPool(backend=host, reuse="single", tag="g")
    with pool.space(1):
        kept = framework_alloc(MIB)
        scratch = framework_alloc(2 * MIB)
        write(kept, b"replays read this")
        pool.allocator.deallocate(scratch)  # an intermediate the capture freed
    vmm_core.sleep("g")  # no offload asked
    assert pool.allocator.host_bytes == MIB, "only the live block is kept"
    vmm_core.wake_up("g")
    assert read(kept, 17) == b"replays read this"
    pool.close()


def test_a_lazily_made_persistent_counter_is_refused_by_vmm_and_kept_by_single(host):
    counter = LazyCounter()
    vmm = vmm_core.GraphPool(backend=host)
    with pytest.raises(CaptureEscapeError, match="still alive after the capture"):
        with vmm.space(1):
            counter.step()
    vmm.close()

    counter = LazyCounter()
    single = vmm_core.GraphPool(backend=host, reuse="single", tag="g")
    with single.space(1):
        counter.step()  # the capture's run
    for _ in range(4):
        counter.step()  # replays
    vmm_core.sleep("g")
    vmm_core.wake_up("g")
    assert counter.step() == 6, "the counter must come back, not as garbage"
    single.close()


def test_single_refuses_a_shared_allocator(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    with pytest.raises(VMMError, match="own allocator"):
        vmm_core.GraphPool(backend=host, reuse="single", allocator=alloc)
    alloc.close()
    with pytest.raises(ValueError, match="single"):
        vmm_core.GraphPool(backend=host, reuse="bogus")


def test_vmm_keeps_what_keep_declared_through_a_discarding_sleep(host):
    pool = vmm_core.GraphPool(backend=host, tag="g")
    with pool.space(2):
        out = framework_alloc(MIB)
        pool.allocator.deallocate(framework_alloc(3 * MIB))  # an intermediate, freed
        pool.keep((out, MIB))
        write(out, b"static output")
    with pool.space(1):
        raw = framework_alloc(MIB)
        pool.keep(raw)  # a raw address keeps the block it lies in
    vmm_core.sleep("g")
    # out and raw share their physical offset (spaces alias): one MiB is kept
    assert pool.allocator.host_bytes == MIB
    vmm_core.wake_up("g")
    pool.before_replay(2)
    assert read(out, 13) == b"static output"
    pool.close()


def test_closing_a_single_pool_gives_everything_back(host):
    pool = vmm_core.GraphPool(backend=host, reuse="single", tag="g")
    for key in range(3):
        with pool.space(key):
            framework_alloc(MIB)
    alloc = pool.allocator
    pool.close()
    assert alloc.closed and "g" not in vmm_core.memory_summary()
