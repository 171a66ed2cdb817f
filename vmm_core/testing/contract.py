"""The vmm_api contract suite: every backend must pass it.

It needs one fixture, ``vmm_backend`` (a :class:`vmm_core.Backend`), and optionally
``vmm_device`` (default 0).  Device bytes are read and written only through the
backend's copy hooks, so the same tests run on host memory, an emulated driver or a GPU.
Import everything from this module into a test module (``test_*.py``: pytest collects
nothing from a ``conftest.py``) to run it; :mod:`vmm_core.testing` shows the file.
"""

from __future__ import annotations

import threading

import pytest

from ..errors import (
    AllocationError,
    BackendError,
    MappingError,
    OutOfMemoryError,
    ReservationExceededError,
    VMMError,
)
from ..memory.allocator import SharedVMMAllocator
from .tools import FaultInjector, HookCounter, read_bytes, write_bytes


@pytest.fixture
def vmm_device():
    return 0


@pytest.fixture
def granularity(vmm_backend, vmm_device):
    return vmm_backend.capabilities(vmm_device).granularity


@pytest.fixture
def alloc(vmm_backend, vmm_device, granularity):
    a = SharedVMMAllocator(vmm_backend, device=vmm_device, reserve_bytes=64 * granularity)
    yield a
    a.close()


def _pattern(n: int, seed: int) -> bytes:
    """Bytes that differ from page to page, so a wrong mapping offset is caught."""
    block = bytes(((i * 131) ^ seed) & 0xFF for i in range(4096))
    return b"".join(i.to_bytes(8, "little") + block[8:] for i in range(n // 4096 + 1))[:n]


# --------------------------------------------------------------- raw primitives
def test_contract_probe_and_capabilities(vmm_backend, vmm_device):
    probe = vmm_backend.probe()
    assert probe.available, probe.reason
    assert probe.device_count >= 1
    caps = vmm_backend.capabilities(vmm_device)
    g = caps.granularity
    assert g > 0 and g & (g - 1) == 0, f"granularity {g} is not a power of two"
    assert caps.default_reserve_bytes % g == 0


def test_contract_two_ranges_alias_one_handle(vmm_backend, vmm_device, granularity):
    be, dev, g = vmm_backend, vmm_device, granularity
    caps = be.capabilities(dev)
    a = be.reserve(dev, 4 * g, g)
    b = be.reserve(dev, 4 * g, g)
    h = be.create_handle(dev, 2 * g)
    try:
        assert a % g == 0 and b % g == 0 and abs(a - b) >= 4 * g
        be.map(dev, a, 2 * g, h, 0)
        be.map(dev, b + g, 2 * g, h, 0)
        if caps.needs_set_access:
            be.set_access(dev, a, 2 * g)
            be.set_access(dev, b + g, 2 * g)
        data = _pattern(2 * g, 7)
        write_bytes(be, dev, a, data)
        assert read_bytes(be, dev, b + g, 2 * g) == data
        write_bytes(be, dev, b + g + g - 3, b"xyz")
        assert read_bytes(be, dev, a + g - 3, 3) == b"xyz"
    finally:
        be.unmap(dev, a, 2 * g)
        be.unmap(dev, b + g, 2 * g)
        be.release_handle(dev, h)
        be.release_range(dev, a, 4 * g)
        be.release_range(dev, b, 4 * g)


def test_contract_partial_map_follows_capability(vmm_backend, vmm_device, granularity):
    be, dev, g = vmm_backend, vmm_device, granularity
    caps = be.capabilities(dev)
    a = be.reserve(dev, 4 * g, g)
    h = be.create_handle(dev, 2 * g)
    try:
        if caps.partial_map:
            be.map(dev, a, g, h, g)
            if caps.needs_set_access:
                be.set_access(dev, a, g)
            be.unmap(dev, a, g)
        else:
            with pytest.raises(MappingError):
                be.map(dev, a, g, h, 0)  # part of the handle
            with pytest.raises(MappingError):
                be.map(dev, a, g, h, g)  # non-zero offset
    finally:
        be.release_handle(dev, h)
        be.release_range(dev, a, 4 * g)


def test_contract_map_at_unaligned_address_is_refused(vmm_backend, vmm_device, granularity):
    be, dev, g = vmm_backend, vmm_device, granularity
    a = be.reserve(dev, 4 * g, g)
    h = be.create_handle(dev, g)
    try:
        with pytest.raises((MappingError, BackendError)) as err:
            be.map(dev, a + g // 2, g, h, 0)
        assert "map" in str(err.value).lower()
        be.map(dev, a, g, h, 0)  # the failure left everything usable
        be.unmap(dev, a, g)
    finally:
        be.release_handle(dev, h)
        be.release_range(dev, a, 4 * g)


@pytest.mark.parametrize("size", [0, -1])
def test_contract_bad_sizes_are_refused(vmm_backend, vmm_device, size):
    with pytest.raises(VMMError):
        vmm_backend.create_handle(vmm_device, size)
    with pytest.raises(VMMError):
        vmm_backend.reserve(vmm_device, size, 0)


@pytest.mark.parametrize("size", [2**64, 2**70, -1, True, 1.5])
def test_contract_byte_counts_past_size_t_never_reach_the_backend(vmm_backend, vmm_device,
                                                                   size):
    """Sizes reach a driver as ``size_t`` and wrap silently past it (2**64 became 0, and
    MAP_FIXED then mapped over the process's own memory): the Backend refuses them with
    its own message before the hook runs, whatever the backend's own checks."""
    be, dev = vmm_backend, vmm_device
    calls = [lambda: be.reserve(dev, size, 0), lambda: be.reserve(dev, 1 << 21, size),
             lambda: be.create_handle(dev, size), lambda: be.map(dev, 0, size, None, 0),
             lambda: be.map(dev, 0, 1 << 21, None, size), lambda: be.unmap(dev, 0, size),
             lambda: be.set_access(dev, 0, size), lambda: be.release_range(dev, 0, size),
             lambda: be.copy_to_host(dev, 0, 0, size), lambda: be.memset(dev, 0, 0, size),
             lambda: be.copy_device(dev, 0, 0, size)]
    for call in calls:
        with pytest.raises(MappingError, match=r"must be an int, got|outside 0\.\."):
            call()


# --------------------------------------------------------------- SharedVMMAllocator
def test_contract_allocations_alias_across_spaces(alloc, vmm_backend, vmm_device, granularity):
    g = granularity
    p0 = alloc.allocate(3 * g)
    data = _pattern(3 * g, 1)
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
    data = _pattern(6 * g, 11)
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


# --------------------------------------------------------------- sleep / wake
def test_contract_offload_sleep_keeps_bytes_at_same_addresses(alloc, vmm_backend, vmm_device,
                                                               granularity):
    g = granularity
    p = alloc.allocate(5 * g)
    alloc.switch_to_new_virtual_space()
    q = alloc.allocate(g)
    data = _pattern(5 * g, 3)
    write_bytes(vmm_backend, vmm_device, p, data)
    held = alloc.physical_bytes
    alloc.sleep(offload=True)
    assert alloc.asleep and alloc.physical_bytes == 0
    alloc.sleep(offload=True)  # no-op
    alloc.wake()
    alloc.wake()  # no-op
    assert alloc.physical_bytes == held
    assert read_bytes(vmm_backend, vmm_device, p, 5 * g) == data
    assert read_bytes(vmm_backend, vmm_device, q, g) == data[:g]  # still aliased


def test_contract_discard_sleep_frees_and_keeps_addresses(alloc, vmm_backend, vmm_device,
                                                          granularity):
    g = granularity
    p = alloc.allocate(2 * g)
    alloc.sleep()
    assert alloc.physical_bytes == 0
    with pytest.raises(VMMError, match="asleep"):
        alloc.allocate(g)
    alloc.wake()
    write_bytes(vmm_backend, vmm_device, p, b"back")
    assert read_bytes(vmm_backend, vmm_device, p, 4) == b"back"
    assert alloc.allocate(g) == p + 2 * g


def test_contract_lazy_wake_maps_the_current_space_then_on_demand(alloc, vmm_backend,
                                                                  vmm_device, granularity):
    g = granularity
    s0 = alloc.current_space
    p0 = alloc.allocate(2 * g)
    write_bytes(vmm_backend, vmm_device, p0, b"lazy wake")
    for _ in range(3):
        alloc.switch_to_new_virtual_space()
    alloc.lazy_wake = True
    alloc.sleep(offload=True)
    with HookCounter(vmm_backend) as counter:
        alloc.wake()
    assert counter.calls["vmm_map"] == alloc.num_handles  # the current space only
    current = alloc.current_space
    assert read_bytes(vmm_backend, vmm_device, alloc.translate(p0, current), 9) == b"lazy wake"
    with HookCounter(vmm_backend) as counter:
        alloc.ensure_mapped(s0)
        alloc.ensure_mapped(s0)  # once only
    assert counter.calls["vmm_map"] == alloc.num_handles
    assert read_bytes(vmm_backend, vmm_device, p0, 9) == b"lazy wake"
    alloc.sleep()  # unmaps what is mapped, dormant spaces included
    alloc.wake()
    alloc.close()


def test_contract_wake_after_failed_wake(alloc, vmm_backend, vmm_device, granularity):
    g = granularity
    p = alloc.allocate(g)
    alloc.extend_mapping(12 * g)  # at least two handles
    write_bytes(vmm_backend, vmm_device, p, b"survive")
    alloc.sleep(offload=True)
    faulty = FaultInjector(vmm_backend)
    alloc.backend = faulty
    faulty.fail_create_after = alloc.num_handles - 1
    with pytest.raises(OutOfMemoryError):
        alloc.wake()
    assert alloc.asleep and alloc.physical_bytes == 0 and faulty.live_handles == 0
    faulty.fail_create_after = None
    alloc.wake()
    assert read_bytes(vmm_backend, vmm_device, p, 7) == b"survive"


def test_contract_concurrent_sleep_is_serialized(alloc, vmm_backend, vmm_device, granularity):
    p = alloc.allocate(4 * granularity)
    write_bytes(vmm_backend, vmm_device, p, b"threads")
    errors = []

    def worker():
        try:
            alloc.sleep(offload=True)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and alloc.asleep
    alloc.wake()
    assert read_bytes(vmm_backend, vmm_device, p, 7) == b"threads"


# --------------------------------------------------------------- offload, queues, zeroing
def _needs_queue(backend, strategy):
    if strategy == "staged" and not backend.implements("vmm_copy_queue"):
        pytest.skip("the backend has no vmm_copy_queue (optional): offload copies directly")


@pytest.mark.parametrize("strategy", ["staged", "direct", "pinned"])
def test_contract_offload_in_every_strategy_keeps_bytes(alloc, vmm_backend, vmm_device,
                                                       granularity, strategy):
    from ..memory import offload

    _needs_queue(vmm_backend, strategy)
    g = granularity
    alloc.growth_bytes = 3 * g  # several handles; chunks straddle none of them
    p = alloc.allocate(3 * g)
    alloc.allocate(3 * g)
    alloc.allocate(g)
    data = _pattern(7 * g, 5)
    write_bytes(vmm_backend, vmm_device, p, data)
    with offload.configured(strategy=strategy, chunk_bytes=g + g // 3, slots=3, threads=2,
                            pin_kept=False):  # kept copies stay on the strategy's path
        for keep in (False, True, False):
            alloc.sleep(offload=True)
            assert alloc.physical_bytes == 0 and alloc.host_bytes == 9 * g
            alloc.wake(keep_host_buffers=keep)
            assert read_bytes(vmm_backend, vmm_device, p, 7 * g) == data, (strategy, keep)
            assert alloc.host_bytes == (9 * g if keep else 0)
            assert alloc.last_transfer.strategy == strategy
    offload.release_staging()


@pytest.mark.parametrize("strategy", ["staged", "direct"])
def test_contract_failed_offload_copy_leaves_memory_awake_or_asleep(alloc, vmm_backend,
                                                                    vmm_device, granularity,
                                                                    strategy):
    from ..memory import offload

    _needs_queue(vmm_backend, strategy)
    g = granularity
    p = alloc.allocate(4 * g)
    data = _pattern(4 * g, 9)
    write_bytes(vmm_backend, vmm_device, p, data)
    faulty = FaultInjector(vmm_backend)
    with offload.configured(strategy=strategy, chunk_bytes=g // 2, slots=3, threads=2,
                            keep_host_buffers=False):  # every sleep makes its host copy
        alloc.backend = faulty
        faulty.fail_copy_after = 3  # mid-way: 8 chunks
        with pytest.raises(BackendError, match="injected"):
            alloc.sleep(offload=True)
        assert not alloc.asleep and alloc.host_bytes == 0
        assert read_bytes(vmm_backend, vmm_device, p, 4 * g) == data
        faulty.fail_copy_after = None
        alloc.sleep(offload=True)
        faulty.fail_copy_after, faulty.live_handles = 5, 0
        with pytest.raises(BackendError, match="injected"):
            alloc.wake()
        assert alloc.asleep and alloc.physical_bytes == 0 and alloc.host_bytes == 4 * g
        assert faulty.live_handles == 0
        faulty.fail_copy_after = None
        alloc.wake()
    assert read_bytes(vmm_backend, vmm_device, p, 4 * g) == data
    offload.release_staging()


def test_contract_copy_queue_copies_in_order(vmm_backend, vmm_device, granularity):
    import ctypes

    if not vmm_backend.implements("vmm_copy_queue"):
        pytest.skip("the backend has no vmm_copy_queue (optional)")
    g = granularity
    a = SharedVMMAllocator(vmm_backend, device=vmm_device, reserve_bytes=4 * g)
    try:
        p = a.allocate(2 * g)
        data = _pattern(2 * g, 11)
        pinned = vmm_backend.host_buffer(vmm_device, 2 * g, pinned=True)
        buf = pinned if pinned is not None else ctypes.create_string_buffer(2 * g)
        host = int(pinned.address) if pinned is not None else ctypes.addressof(buf)
        ctypes.memmove(host, data, 2 * g)
        queue = vmm_backend.copy_queue(vmm_device)
        queue.from_host(host, p, g)
        queue.from_host(host + g, p + g, g)
        queue.wait(queue.record())
        ctypes.memset(host, 0, 2 * g)
        queue.to_host(p + g, host, g)  # in order: the second half lands first ...
        queue.to_host(p, host + g, g)  # ... then the first
        queue.record()  # never waited on: synchronize retires it
        queue.synchronize()
        assert ctypes.string_at(host, 2 * g) == data[g:] + data[:g]
        queue.close()
        queue.close()  # idempotent
    finally:
        a.close()


def test_contract_memset_fills_device_bytes(alloc, vmm_backend, vmm_device, granularity):
    g = granularity
    p = alloc.allocate(3 * g)
    write_bytes(vmm_backend, vmm_device, p, _pattern(3 * g, 13))
    vmm_backend.memset(vmm_device, p + 7, 0x5A, 2 * g)
    got = read_bytes(vmm_backend, vmm_device, p, 3 * g)
    assert got[7:7 + 2 * g] == b"\x5a" * (2 * g)
    assert got[:7] == _pattern(3 * g, 13)[:7] and got[7 + 2 * g:] == _pattern(3 * g, 13)[7 + 2 * g:]


def test_contract_discard_wake_with_zero_returns_zeros(alloc, vmm_backend, vmm_device,
                                                       granularity):
    g = granularity
    p = alloc.allocate(2 * g)
    write_bytes(vmm_backend, vmm_device, p, b"\xab" * (2 * g))
    alloc.sleep()
    with HookCounter(vmm_backend) as counter:
        alloc.wake(zero=True)
    assert counter.calls["vmm_memset"] + counter.calls["vmm_copy_from_host"] >= 1
    assert read_bytes(vmm_backend, vmm_device, p, 2 * g) == bytes(2 * g)


# --------------------------------------------------------------- sharing handles (optional)
_PAYLOAD = bytes(range(256)) * 16
_CHILD_TIMEOUT = 60.0


def _shared_pair(vmm_backend, vmm_device, size):
    """A shareable handle and its import in this same process (as another process would)."""
    import os

    caps = vmm_backend.capabilities(vmm_device)
    own = vmm_backend.create_shareable_handle(vmm_device, size)
    shareable = vmm_backend.export_handle(vmm_device, own,
                                          [vmm_backend.process_id(vmm_device)])
    try:
        imported = vmm_backend.import_handle(vmm_device, shareable, size)
    except BaseException:
        vmm_backend.release_handle(vmm_device, own)
        raise
    finally:
        if caps.shareable_handles == "fd":
            os.close(shareable)  # the caller owns exported and received descriptors
    return own, imported


def test_contract_exported_handle_aliases_after_import(vmm_backend, vmm_device, granularity):
    """Export, import, map both: one set of bytes seen twice; releasing the imported
    handle leaves the exporter's memory intact.  The import runs in this process, or in a
    child process where the backend declares ``same_process_import=False`` (the backend
    must then be loadable by name, ``vmm_core.get_backend(name)``, in a fresh process)."""
    caps = vmm_backend.capabilities(vmm_device)
    if caps.shareable_handles is None:
        pytest.skip(f"backend {vmm_backend.name!r} declares no shareable handles")
    if not caps.same_process_import:
        _alias_through_child(vmm_backend, vmm_device, granularity)
        return
    size = 2 * granularity
    own, imported = _shared_pair(vmm_backend, vmm_device, size)
    a = vmm_backend.reserve(vmm_device, size, granularity)
    b = vmm_backend.reserve(vmm_device, size, granularity)
    undo = []  # cleanups, run last-in first-out whatever happens
    try:
        vmm_backend.map(vmm_device, a, size, own, 0)
        undo.append(lambda: vmm_backend.unmap(vmm_device, a, size))
        if caps.needs_set_access:
            vmm_backend.set_access(vmm_device, a, size)
        vmm_backend.map(vmm_device, b, size, imported, 0)
        undo.append(lambda: vmm_backend.unmap(vmm_device, b, size))
        vmm_backend.set_access_for(vmm_device, b, size, [vmm_device])
        write_bytes(vmm_backend, vmm_device, a + granularity, _PAYLOAD)
        assert read_bytes(vmm_backend, vmm_device, b + granularity, len(_PAYLOAD)) == _PAYLOAD
        write_bytes(vmm_backend, vmm_device, b, b"from the importer")
        assert read_bytes(vmm_backend, vmm_device, a, 17) == b"from the importer"
        vmm_backend.synchronize(vmm_device)
        undo.pop()()  # unmap b
        vmm_backend.release_handle(vmm_device, imported)
        imported = None
        assert read_bytes(vmm_backend, vmm_device, a + granularity, len(_PAYLOAD)) == _PAYLOAD
    finally:
        vmm_backend.synchronize(vmm_device)
        while undo:
            undo.pop()()
        for handle in (imported, own):
            if handle is not None:
                vmm_backend.release_handle(vmm_device, handle)
        vmm_backend.release_range(vmm_device, a, size)
        vmm_backend.release_range(vmm_device, b, size)


def _alias_through_child(be, dev, g):
    """The aliasing check with the import in a child process, over a socket pair: the
    child sends its process id, gets the shareable handle (a descriptor travels with
    SCM_RIGHTS), maps it, checks and writes bytes, releases its import, reports."""
    import json
    import os
    import socket
    import subprocess
    import sys

    size = 2 * g
    caps = be.capabilities(dev)
    own = be.create_shareable_handle(dev, size)
    a = be.reserve(dev, size, g)
    ours, theirs = socket.socketpair()
    proc = reader = None
    mapped = False
    try:
        be.map(dev, a, size, own, 0)
        mapped = True
        if caps.needs_set_access:
            be.set_access(dev, a, size)
        write_bytes(be, dev, a + g, _PAYLOAD)
        be.synchronize(dev)
        code = "from vmm_core.testing.contract import _import_child; _import_child()"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, be.name, str(dev), str(size), str(theirs.fileno())],
            pass_fds=[theirs.fileno()])
        theirs.close()
        ours.settimeout(_CHILD_TIMEOUT)
        reader = ours.makefile("r")
        line = reader.readline()
        # a child that fails before it knows its process id sends its report instead
        assert line.strip().isdigit(), "the import child failed before sending its " \
            "process id: " + (json.loads(line).get("error") if line.startswith("{")
                              else "it died")
        pid = int(line)
        shareable = be.export_handle(dev, own, [pid])
        if caps.shareable_handles == "fd":
            try:
                socket.send_fds(ours, [b"fd\n"], [shareable])
            finally:
                os.close(shareable)
        else:
            ours.sendall(f"{shareable}\n".encode())
        report = json.loads(reader.readline() or '{"error": "the import child died"}')
        assert report.get("error") is None, f"the import child failed: {report['error']}"
        assert report["read"] == "ok"
        assert read_bytes(be, dev, a, 17) == b"from the importer"
        # the child released its import (and exited): the exporter's memory is intact
        assert read_bytes(be, dev, a + g, len(_PAYLOAD)) == _PAYLOAD
        assert proc.wait(_CHILD_TIMEOUT) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(_CHILD_TIMEOUT)
        if reader is not None:
            reader.close()  # else the socket stays open while the failure is kept
        ours.close()
        theirs.close()
        be.synchronize(dev)
        if mapped:
            be.unmap(dev, a, size)
        be.release_handle(dev, own)
        be.release_range(dev, a, size)


def _import_child() -> None:
    """Entry point of the import child (see :func:`_alias_through_child`)."""
    import json
    import os
    import socket
    import sys
    import traceback

    import vmm_core

    name, dev, size, fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sock = socket.socket(fileno=fd)
    sock.settimeout(_CHILD_TIMEOUT)
    report: dict = {"error": None}
    try:
        be = vmm_core.get_backend(name)
        g = be.capabilities(dev).granularity
        sock.sendall(f"{be.process_id(dev)}\n".encode())
        if be.capabilities(dev).shareable_handles == "fd":
            _, fds, _, _ = socket.recv_fds(sock, 16, 1)
            shareable = fds[0]
        else:
            shareable = int(sock.makefile("r").readline())
        try:
            imported = be.import_handle(dev, shareable, size)
        finally:
            if be.capabilities(dev).shareable_handles == "fd":
                os.close(shareable)
        b = be.reserve(dev, size, g)
        mapped = False
        try:
            be.map(dev, b, size, imported, 0)
            mapped = True
            be.set_access_for(dev, b, size, [dev])
            ok = read_bytes(be, dev, b + g, len(_PAYLOAD)) == _PAYLOAD
            report["read"] = "ok" if ok else "the child read other bytes than were written"
            write_bytes(be, dev, b, b"from the importer")
        finally:
            be.synchronize(dev)
            if mapped:
                be.unmap(dev, b, size)
            be.release_handle(dev, imported)
            be.release_range(dev, b, size)
    except BaseException:
        report["error"] = traceback.format_exc()
    sock.sendall((json.dumps(report) + "\n").encode())
    sock.close()


__all__ = [n for n in list(globals()) if n.startswith("test_contract_")] + [  # noqa
    "vmm_device", "granularity", "alloc"]
