"""Sleep and wake on the backend: bytes that survive at the same addresses, offload in
every strategy, failed copies, fills."""

from __future__ import annotations

import threading

import pytest

from ...errors import BackendError, OutOfMemoryError, VMMError
from ..tools import FaultInjector, HookCounter, read_bytes, write_bytes
from .fixtures import pattern


def test_contract_offload_sleep_keeps_bytes_at_same_addresses(alloc, vmm_backend, vmm_device,
                                                               granularity):
    g = granularity
    p = alloc.allocate(5 * g)
    alloc.switch_to_new_virtual_space()
    q = alloc.allocate(g)
    data = pattern(5 * g, 3)
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


# --------------------------------------------------------------- offload and zeroing
def _needs_queue(backend, strategy):
    if strategy == "staged" and not backend.implements("vmm_copy_queue"):
        pytest.skip("the backend has no vmm_copy_queue (optional): offload copies directly")


@pytest.mark.parametrize("strategy", ["staged", "direct", "pinned"])
def test_contract_offload_in_every_strategy_keeps_bytes(alloc, vmm_backend, vmm_device,
                                                       granularity, strategy):
    from ...memory import offload

    _needs_queue(vmm_backend, strategy)
    g = granularity
    alloc.growth_bytes = 3 * g  # several handles; chunks straddle none of them
    p = alloc.allocate(3 * g)
    alloc.allocate(3 * g)
    alloc.allocate(g)
    data = pattern(7 * g, 5)
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
    from ...memory import offload

    _needs_queue(vmm_backend, strategy)
    g = granularity
    p = alloc.allocate(4 * g)
    data = pattern(4 * g, 9)
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


def test_contract_memset_fills_device_bytes(alloc, vmm_backend, vmm_device, granularity):
    g = granularity
    p = alloc.allocate(3 * g)
    write_bytes(vmm_backend, vmm_device, p, pattern(3 * g, 13))
    vmm_backend.memset(vmm_device, p + 7, 0x5A, 2 * g)
    got = read_bytes(vmm_backend, vmm_device, p, 3 * g)
    assert got[7:7 + 2 * g] == b"\x5a" * (2 * g)
    assert got[:7] == pattern(3 * g, 13)[:7] and got[7 + 2 * g:] == pattern(3 * g, 13)[7 + 2 * g:]


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




__all__ = [n for n in list(globals()) if n.startswith("test_contract_")]
