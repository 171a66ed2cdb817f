"""Offload, zeroed wake, memory reports and replay holds, for real on the host backend.

The staging pipeline runs here through the host backend's copy queue (copies complete
inside the call, but the ring, the slots, the threads and the failure paths are the
ones the GPU uses)."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import threading
import time

import pytest

import vmm_core
from vmm_core.errors import BackendError, SleepStateError, VMMError
from vmm_core.memory import offload, tagged
from vmm_core.testing import FaultInjector

MIB = 1 << 20


pytestmark = pytest.mark.usefixtures("clean_tags")


@pytest.fixture
def staged():
    """The staging pipeline with small chunks, so that every offload wraps the ring."""
    with offload.configured(strategy="staged", chunk_bytes=192 << 10, slots=3, threads=2):
        yield
    offload.release_staging()


def _tagged(tag: str, nbytes: int, growth: int = MIB, spaces: int = 1):
    """An allocator under ``tag`` holding ``nbytes`` at one address, over handles of
    ``growth`` bytes (so copies cross handle boundaries)."""
    alloc = vmm_core.SharedVMMAllocator("host", tag=tag, growth_bytes=growth)
    tagged.register(tag, alloc)
    for _ in range(spaces - 1):
        alloc.switch_to_new_virtual_space()
    start, left = None, nbytes
    while left > 0:
        address = alloc.allocate(min(growth, left))
        start = address if start is None else start
        left -= growth
    return alloc, start


def _fill_random(address: int, n: int, rng: random.Random) -> bytes:
    data = rng.randbytes(n)
    ctypes.memmove(address, data, n)
    return data


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _anonymous_mappings(size: int) -> int:
    """Private anonymous read-write mappings of exactly ``size`` bytes (host copies)."""
    count = 0
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if end - start == size and fields[1].startswith("rw") and fields[4] == "0":
                count += 1
    return count


# ------------------------------------------------------------------ bytes survive
@pytest.mark.parametrize("strategy", ["staged", "direct", "pinned"])
def test_offload_bytes_survive_20_cycles_over_several_tags(strategy):
    rng = random.Random(7)
    sizes = {"weights": 5 * MIB + 12288, "kv": 3 * MIB, "adapters": 640 << 10}
    allocs = {t: _tagged(t, n, growth=2 * MIB) for t, n in sizes.items()}  # several handles
    with offload.configured(strategy=strategy, chunk_bytes=448 << 10, slots=4, threads=2):
        for cycle in range(20):
            data = {t: _fill_random(p, sizes[t], rng) for t, (_, p) in allocs.items()}
            keep = cycle % 3 == 1  # kept buffers are reused by the next sleep
            vmm_core.sleep(offload=tuple(sizes))
            for t, (a, _) in allocs.items():
                assert a.asleep and a.physical_bytes == 0
                assert a.host_bytes >= sizes[t]
            vmm_core.wake_up(keep_host_buffers=keep)
            for t, (a, p) in allocs.items():
                assert ctypes.string_at(p, sizes[t]) == data[t], (strategy, cycle, t)
                assert a.host_bytes == (a.physical_bytes if keep else 0)
            assert a.last_transfer.strategy == strategy
    offload.release_staging()


def test_default_strategy_is_declared_by_capabilities():
    host = vmm_core.get_backend("host")
    assert not host.capabilities(0).async_copies
    assert offload.choose_strategy(host, 0) == "direct"  # a queue, but no copy engine
    with offload.configured(strategy="staged"):
        assert offload.choose_strategy(host, 0) == "staged"
    with pytest.raises(ValueError, match="one of"):
        offload.configure(strategy="fast")
    with pytest.raises(ValueError, match="2 staging slots"):
        offload.configure(slots=1)


def test_staged_offload_needs_a_copy_queue():
    import emulated

    ascend = emulated.backend_for("ascend")
    try:
        alloc = vmm_core.SharedVMMAllocator(ascend, reserve_bytes=1 << 26)
        alloc.allocate(1 << 21)
        with offload.configured(strategy="staged"):
            with pytest.raises(VMMError, match="vmm_copy_queue.*'direct'"):
                alloc.sleep(offload=True)
        assert not alloc.asleep and alloc.host_bytes == 0  # nothing happened
        alloc.close()
    finally:
        emulated.release("ascend")


# ------------------------------------------------------------------ failures
def test_staged_failure_mid_copy_on_sleep_leaves_tag_awake_and_intact(staged):
    alloc, p = _tagged("w", 3 * MIB + 8192)
    size = alloc.physical_bytes
    data = _fill_random(p, 3 * MIB + 8192, random.Random(1))
    alloc.sleep(offload=True)  # ring and threads exist before counting
    alloc.wake()
    fds, maps = _open_fds(), _anonymous_mappings(size)
    faulty = FaultInjector(alloc.backend)
    alloc.backend = faulty
    faulty.fail_copy_after = 5  # the sixth of 24 chunks fails, with copies in flight
    with pytest.raises(BackendError, match="injected") as err:
        vmm_core.sleep("w", offload="w")
    # ``err`` keeps the failed call's frames alive: the host copy must have been freed
    # explicitly, not by the garbage collector
    assert err.tb is not None
    assert not alloc.asleep and alloc.physical_bytes == size and alloc.host_bytes == 0
    assert ctypes.string_at(p, len(data)) == data
    assert _open_fds() == fds and _anonymous_mappings(size) == maps  # host copy freed
    faulty.fail_copy_after = None
    vmm_core.sleep("w", offload="w")
    vmm_core.wake_up("w")
    assert ctypes.string_at(p, len(data)) == data


def test_staged_failure_mid_copy_on_wake_leaves_tag_asleep_with_its_host_copy(staged):
    alloc, p = _tagged("w", 3 * MIB)
    size = alloc.physical_bytes
    data = _fill_random(p, 3 * MIB, random.Random(2))
    maps = _anonymous_mappings(size)
    vmm_core.sleep("w", offload="w")
    fds = _open_fds()
    assert _anonymous_mappings(size) == maps + 1  # the host copy
    faulty = FaultInjector(alloc.backend)
    alloc.backend = faulty
    faulty.fail_copy_after = 7
    with pytest.raises(BackendError, match="injected"):
        vmm_core.wake_up("w")
    assert alloc.asleep and alloc.physical_bytes == 0 and alloc.host_bytes == size
    assert faulty.live_handles == 0 and _open_fds() == fds  # the new memfds were closed
    faulty.fail_copy_after = 0
    with pytest.raises(BackendError):  # fails on the very first copy as well
        vmm_core.wake_up("w")
    faulty.fail_copy_after = None
    vmm_core.wake_up("w")
    assert ctypes.string_at(p, len(data)) == data
    assert alloc.host_bytes == 0 and _anonymous_mappings(size) == maps  # freed once awake


def test_direct_failure_on_wake_keeps_host_copy():
    alloc, p = _tagged("d", 2 * MIB)
    data = _fill_random(p, 2 * MIB, random.Random(3))
    with offload.configured(strategy="direct", chunk_bytes=256 << 10):
        vmm_core.sleep("d", offload="d")
        faulty = FaultInjector(alloc.backend)
        alloc.backend = faulty
        faulty.fail_copy_after = 3
        with pytest.raises(BackendError):
            vmm_core.wake_up("d")
        assert alloc.asleep and alloc.host_bytes == sum(alloc._sleep_sizes)
        faulty.fail_copy_after = None
        vmm_core.wake_up("d")
    assert ctypes.string_at(p, len(data)) == data


# ------------------------------------------------------------------ zeroed wake
class _StaleHandles(FaultInjector):
    """New physical memory that still holds someone's bytes, as fresh device pages may."""

    def create_handle(self, device, size):
        handle = super().create_handle(device, size)
        os.pwrite(handle.fd, b"\xee" * size, 0)
        return handle


def test_discard_wake_returns_stale_bytes_unless_zero():
    alloc, p = _tagged("scratch", MIB)
    ctypes.memset(p, 0xAB, MIB)
    alloc.backend = _StaleHandles(alloc.backend)
    vmm_core.sleep("scratch")
    vmm_core.wake_up("scratch")
    assert ctypes.string_at(p, 4) == b"\xee" * 4  # undefined, as documented
    vmm_core.sleep("scratch")
    vmm_core.wake_up("scratch", zero=True)
    assert ctypes.string_at(p, MIB) == bytes(MIB)


def test_zero_applies_to_discarded_memory_only():
    a, pa = _tagged("kept", MIB)
    b, pb = _tagged("dropped", MIB)
    ctypes.memset(pa, 0x11, MIB)
    ctypes.memset(pb, 0x22, MIB)
    vmm_core.sleep(offload=("kept",))
    b.backend = _StaleHandles(b.backend)
    vmm_core.wake_up(zero=True)
    assert ctypes.string_at(pa, MIB) == b"\x11" * MIB  # offloaded bytes come back
    assert ctypes.string_at(pb, MIB) == bytes(MIB)


def test_failed_zeroing_leaves_the_tag_asleep():
    alloc, p = _tagged("z", MIB)
    vmm_core.sleep("z")
    faulty = FaultInjector(alloc.backend)
    alloc.backend = faulty
    faulty.fail_memset = True
    with pytest.raises(BackendError, match="memset"):
        vmm_core.wake_up("z", zero=True)
    assert alloc.asleep and faulty.live_handles == 0
    faulty.fail_memset = False
    vmm_core.wake_up("z", zero=True)
    assert ctypes.string_at(p, MIB) == bytes(MIB)


# ------------------------------------------------------------------ reports
def test_memory_summary_matches_memfd_sizes():
    host = vmm_core.get_backend("host")
    w, pw = _tagged("weights", 3 * MIB, growth=MIB, spaces=2)  # three handles
    kv, pk = _tagged("kv", 2 * MIB, growth=2 * MIB)
    ctypes.memset(pw, 1, 3 * MIB)

    def memfd_bytes(alloc):
        return host.plugin.physical_bytes([p.handle for p in alloc._physical])

    summary = vmm_core.memory_summary()
    assert set(summary) == {"weights", "kv"}
    s = summary["weights"]
    assert s["device_bytes"] == memfd_bytes(w) == w.physical_bytes > 0
    assert (s["spaces"], s["handles"], s["asleep"], s["host_bytes"]) == (2, 3, False, 0)
    assert (s["backend"], s["device"]) == ("host", 0)
    assert summary["kv"]["device_bytes"] == memfd_bytes(kv)
    held = w.physical_bytes
    vmm_core.sleep(offload=("weights",))
    s = vmm_core.memory_summary()
    assert s["weights"]["device_bytes"] == 0 == memfd_bytes(w)
    assert s["weights"]["host_bytes"] == held and s["weights"]["asleep"]
    assert s["weights"]["handles"] == 3 and s["weights"]["allocators"][0]["offloaded"]
    assert s["kv"]["host_bytes"] == 0 and s["kv"]["asleep"]
    vmm_core.wake_up()
    assert vmm_core.memory_summary()["weights"]["host_bytes"] == 0


def test_info_prints_backends_and_tagged_memory(capsys):
    _tagged("weights", 2 * MIB)
    vmm_core.info()
    out = capsys.readouterr().out
    assert "active: host" in out and "offload: direct" in out
    line = [ln for ln in out.splitlines() if ln.strip().startswith("weights")]
    assert line and "awake" in line[0] and "2.0 MiB" in line[0]


def test_sleep_and_wake_log_one_line_each(caplog):
    _tagged("weights", 2 * MIB)
    _tagged("graph", MIB)
    with caplog.at_level(logging.INFO, logger="vmm_core"):
        vmm_core.sleep(offload=("weights",))
        vmm_core.wake_up()
    lines = [r.getMessage() for r in caplog.records if r.name == "vmm_core"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("sleep: freed 3.00 MiB (tags graph, weights), 0 B of "
                               "tagged memory in use; offloaded 2.00 MiB in "), lines[0]
    assert lines[0].endswith("GiB/s")
    assert lines[1].startswith("wake_up: restored 3.00 MiB (tags graph, weights), 3.00 MiB "
                               "of tagged memory in use")
    assert "; copied back 2.00 MiB in " in lines[1]


# ------------------------------------------------------------------ replay holds
def test_tags_on_reports_each_tag_and_whether_it_sleeps():
    _tagged("weights", MIB)
    _tagged("kv", MIB)
    assert tagged.tags_on("host", 0) == {"weights": False, "kv": False}
    vmm_core.sleep("kv")
    assert tagged.tags_on(vmm_core.get_backend("host"), 0) == {"weights": False, "kv": True}
    assert tagged.tags_on("host", 1) == {} and tagged.tags_on("cuda", 0) == {}


def test_hold_awake_refuses_sleeping_tags_by_name():
    _tagged("weights", MIB)
    _tagged("kv", MIB)
    vmm_core.sleep("kv")
    with pytest.raises(SleepStateError, match=r"'kv'.*wake_up\('kv'\)"):
        with tagged.hold_awake(["weights", "kv"], backend="host", device=0):
            pass
    with tagged.hold_awake(["weights", "kv"], backend="host", device=1):
        pass  # nothing of either tag there
    with tagged.hold_awake(["weights", "never-registered"]):
        pass


def test_hold_awake_makes_sleep_wait_for_the_block():
    w, p = _tagged("weights", MIB)
    ctypes.memset(p, 7, MIB)
    order = []
    started = threading.Event()

    def sleeper():
        started.set()
        vmm_core.sleep("weights", offload="weights")
        order.append("slept")

    with tagged.hold_awake("weights", backend="host", device=0):
        t = threading.Thread(target=sleeper)
        t.start()
        started.wait()
        time.sleep(0.05)  # the sleeper is now blocked on the allocator lock
        assert not w.asleep
        assert ctypes.string_at(p, 1) == b"\x07"  # a "launch" reading the memory
        order.append("launched")
    t.join(5)
    assert order == ["launched", "slept"] and w.asleep


def test_sleep_inside_hold_awake_on_the_same_thread_raises():
    w, _ = _tagged("weights", MIB)
    with tagged.hold_awake("weights"):
        with pytest.raises(SleepStateError, match="held awake"):
            vmm_core.sleep("weights")
    vmm_core.sleep("weights")
    assert w.asleep


def test_large_host_copies_are_freed_by_several_threads(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from vmm_core.memory import host_memory

    monkeypatch.setattr(host_memory, "PARALLEL_RELEASE_BYTES", 0)  # "large" = any size
    size = 6 * MIB + 4096
    before = _anonymous_mappings(size)
    copy = host_memory.MappedHostCopy(size)
    assert copy.base % (2 * MIB) == 0  # stripes fault whole huge pages
    ctypes.memset(copy.base, 1, size)
    assert _anonymous_mappings(size) == before + 1
    with ThreadPoolExecutor(3) as pool:
        copy.release(pool, 3)
        copy.release(pool, 3)  # idempotent
    assert _anonymous_mappings(size) == before
