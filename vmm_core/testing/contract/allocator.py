"""SharedVMMAllocator on the backend: spaces that alias, growth, merges, and every failure
leaving the allocator as it was."""

from __future__ import annotations

import pytest

from ...errors import (
    AllocationError,
    MappingError,
    OutOfMemoryError,
    ReservationExceededError,
    VMMError,
)
from ...memory.allocator import SharedVMMAllocator
from ..tools import FaultInjector, HookCounter, read_bytes, write_bytes
from .fixtures import pattern


def test_contract_allocations_alias_across_spaces(alloc, vmm_backend, vmm_device, granularity):
    g = granularity
    p0 = alloc.allocate(3 * g)
    data = pattern(3 * g, 1)
    write_bytes(vmm_backend, vmm_device, p0, data)
    s1 = alloc.switch_to_new_virtual_space()
    p1 = alloc.allocate(3 * g)
    assert p1 != p0, "a new space must hand out new addresses"
    assert p1 == alloc.translate(p0, s1)
    assert read_bytes(vmm_backend, vmm_device, p1, 3 * g) == data
    assert alloc.physical_bytes >= 3 * g
    assert alloc.physical_bytes < 2 * 3 * g, "two spaces must not double physical memory"
    assert alloc.num_virtual_spaces == 2


def test_contract_allocate_is_granularity_aligned_bump(alloc, granularity):
    g = granularity
    p = alloc.allocate(1)
    q = alloc.allocate(g + 1)
    r = alloc.allocate(5)
    assert p % g == 0 and q % g == 0 and r % g == 0
    assert q == p + g and r == q + 2 * g


def test_contract_growth_is_mapped_into_every_space(alloc, vmm_backend, vmm_device, granularity):
    g = granularity
    s0 = alloc.current_space
    alloc.allocate(g)
    s1 = alloc.switch_to_new_virtual_space()
    before = alloc.num_handles
    p = alloc.allocate(8 * g)  # grows physical memory while space 1 is current
    assert alloc.num_handles > before
    tail = p + 7 * g
    write_bytes(vmm_backend, vmm_device, tail, b"grown!")
    alloc.extend_mapping(20 * g)  # maps everything into every space, old ones too
    assert alloc.physical_bytes >= 20 * g
    assert read_bytes(vmm_backend, vmm_device, alloc.translate(tail, s0), 6) == b"grown!"
    for s in (s0, s1):
        addr = alloc.space_base(s) + 19 * g
        write_bytes(vmm_backend, vmm_device, addr, bytes([s + 1]) * 4)
        assert read_bytes(vmm_backend, vmm_device, alloc.translate(addr, s1 - s + s0), 4) == \
            bytes([s + 1]) * 4
    s2 = alloc.switch_to_new_virtual_space()  # compaction maps the merged pages everywhere
    assert read_bytes(vmm_backend, vmm_device, alloc.translate(tail, s2), 6) == b"grown!"


def test_contract_allocation_growth_costs_one_map(alloc, vmm_backend, granularity):
    g = granularity
    alloc.allocate(g)
    for _ in range(5):
        alloc.switch_to_new_virtual_space()
    alloc.allocate(g)
    with HookCounter(vmm_backend) as counter:
        alloc.allocate(10 * g)  # grows; older spaces never reach this far
    assert counter.calls["vmm_create_handle"] == 1
    assert counter.calls["vmm_map"] == 1, "growth must not remap every older space"


def test_contract_switch_costs_one_map_per_handle(alloc, vmm_backend, granularity):
    g = granularity
    alloc.merge_on_switch = False
    for n in (1, 3, 9):
        alloc.allocate(n * g)
    handles = alloc.num_handles
    assert 1 <= handles <= 3, f"growth made {handles} handles; it must grow in few steps"
    caps = vmm_backend.capabilities(alloc.device)
    with HookCounter(vmm_backend) as counter:
        alloc.switch_to_new_virtual_space()
    assert counter.calls["vmm_reserve"] == 1
    assert counter.calls["vmm_map"] == handles
    assert counter.calls["vmm_create_handle"] == 0
    if caps.needs_set_access:
        expected = 1 if caps.set_access_spans_mappings else handles
        assert counter.calls["vmm_set_access"] == expected


def test_contract_compaction_merges_handles_and_keeps_bytes(alloc, vmm_backend, vmm_device,
                                                            granularity):
    g = granularity
    s0 = alloc.current_space
    first = alloc.allocate(2 * g)
    alloc.extend_mapping(3 * g)
    second = alloc.allocate(4 * g)  # a second handle
    assert alloc.num_handles >= 2
    data = pattern(6 * g, 11)
    write_bytes(vmm_backend, vmm_device, first, data)
    s1 = alloc.switch_to_new_virtual_space()  # merges before mapping the new space
    assert alloc.num_handles == 1
    assert alloc.physical_bytes == 6 * g, "compaction trims to the bytes any space uses"
    assert read_bytes(vmm_backend, vmm_device, alloc.translate(first, s1), 6 * g) == data
    assert read_bytes(vmm_backend, vmm_device, second, 4 * g) == data[2 * g:]
    assert alloc.space_base(s0) == first
    with HookCounter(vmm_backend) as counter:
        alloc.switch_to_new_virtual_space()
    assert counter.calls["vmm_map"] == 1 and counter.calls["vmm_create_handle"] == 0


def test_contract_release_space_gives_addresses_back(alloc, vmm_backend, vmm_device, granularity):
    g = granularity
    s0 = alloc.current_space
    alloc.allocate(2 * g)
    s1 = alloc.switch_to_new_virtual_space()
    p = alloc.allocate(2 * g)
    write_bytes(vmm_backend, vmm_device, p, b"keep")
    with pytest.raises(VMMError, match="current space"):
        alloc.release_virtual_space(s1)
    with HookCounter(vmm_backend) as counter:
        alloc.release_virtual_space(s0)
    assert counter.calls["vmm_release_range"] == 1
    assert counter.calls["vmm_unmap"] == alloc.num_handles
    assert alloc.num_virtual_spaces == 1 and alloc.space_indices() == [s1]
    assert read_bytes(vmm_backend, vmm_device, p, 4) == b"keep"
    with pytest.raises(VMMError):
        alloc.release_virtual_space(s0)


def test_contract_close_is_idempotent_and_final(vmm_backend, vmm_device, granularity):
    a = SharedVMMAllocator(vmm_backend, device=vmm_device, reserve_bytes=16 * granularity)
    a.allocate(granularity)
    a.switch_to_new_virtual_space()
    a.close()
    a.close()
    assert a.physical_bytes == 0 and a.num_virtual_spaces == 0
    with pytest.raises(VMMError, match="closed"):
        a.allocate(1)
    a.deallocate(12345)  # must not raise, even after close


@pytest.mark.parametrize("nbytes", [0, -5, 1.5, "4096"])
def test_contract_allocate_bad_sizes(alloc, nbytes):
    with pytest.raises(AllocationError):
        alloc.allocate(nbytes)


def test_contract_allocate_past_reserve_leaves_allocator_usable(alloc, granularity):
    g = granularity
    alloc.allocate(10 * g)
    held = alloc.physical_bytes
    with pytest.raises(ReservationExceededError, match="reserve_bytes"):
        alloc.allocate(60 * g)
    assert alloc.physical_bytes == held
    alloc.allocate(g)
    with pytest.raises(ReservationExceededError):
        alloc.extend_mapping(65 * g)


def test_contract_deallocate_never_raises(alloc):
    p = alloc.allocate(100)
    alloc.deallocate(p)
    alloc.deallocate(p)
    alloc.deallocate(0)
    alloc.deallocate(None)
    assert p not in alloc.live_allocations()


def test_contract_out_of_memory_while_growing_leaks_nothing(alloc, vmm_backend, granularity):
    g = granularity
    alloc.allocate(g)
    alloc.switch_to_new_virtual_space()
    faulty = FaultInjector(vmm_backend)
    alloc.backend = faulty
    held, spaces = alloc.physical_bytes, alloc.num_virtual_spaces
    faulty.fail_create_after = 0
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(8 * g)
    assert (alloc.physical_bytes, alloc.num_virtual_spaces) == (held, spaces)
    faulty.fail_create_after = None
    faulty.fail_map_after = 1  # the new handle maps into one space, then fails
    with pytest.raises(MappingError):
        alloc.extend_mapping(12 * g)
    assert faulty.live_handles == 0, "the half-mapped handle must be released"
    assert alloc.physical_bytes == held
    faulty.fail_map_after = None
    p = alloc.allocate(8 * g)  # and the allocator still works
    assert alloc.physical_bytes >= 8 * g and p


def test_contract_failed_extend_mapping_promises_nothing(alloc, vmm_backend, vmm_device,
                                                         granularity):
    g = granularity
    p = alloc.allocate(g)
    write_bytes(vmm_backend, vmm_device, p, b"first")
    faulty = FaultInjector(vmm_backend)
    alloc.backend = faulty
    faulty.fail_create_after = 0
    with pytest.raises(OutOfMemoryError):
        alloc.extend_mapping(32 * g)
    faulty.fail_create_after = None
    alloc.allocate(g)  # a second handle
    s1 = alloc.switch_to_new_virtual_space()  # merges: must not size by the failed request
    assert alloc.physical_bytes == 2 * g
    assert read_bytes(vmm_backend, vmm_device, alloc.translate(p, s1), 5) == b"first"


def test_contract_failed_merge_rolls_back_or_refuses_work(alloc, vmm_backend, vmm_device,
                                                          granularity):
    g = granularity
    p = alloc.allocate(g)
    alloc.extend_mapping(4 * g)
    alloc.allocate(6 * g)  # at least two handles now
    write_bytes(vmm_backend, vmm_device, p, b"rollback")
    faulty = FaultInjector(vmm_backend)
    alloc.backend = faulty
    held = alloc.physical_bytes
    copies = 0 if alloc.scratch else 1  # a merge maps into a scratch range to copy first
    faulty.fail_map_calls = {copies + 1}  # the merged handle fails to map; the old map back
    with pytest.raises(MappingError):
        alloc.compact()
    assert alloc.physical_bytes == held and faulty.live_handles == 0
    assert read_bytes(vmm_backend, vmm_device, p, 8) == b"rollback"
    faulty.map_calls, faulty.fail_map_calls = 0, set(range(copies + 1, 100))  # rollback too
    with pytest.raises(MappingError):
        alloc.compact()
    with pytest.raises(VMMError, match="inconsistent"):
        alloc.allocate(g)
    faulty.fail_map_calls = set()
    alloc.close()  # still releases everything



__all__ = [n for n in list(globals()) if n.startswith("test_contract_")]
