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
from proc_state import anonymous_mappings, env_with_tests, mapped, run_python

import vmm_core
from vmm_core.errors import BackendError, CaptureError, SleepStateError, VMMError
from vmm_core.memory import offload, tagged
from vmm_core.testing import FaultInjector

MIB = 1 << 20


pytestmark = pytest.mark.usefixtures("clean_tags")


@pytest.fixture
def staged():
    """The staging pipeline with small chunks, so that every offload wraps the ring (and
    nothing kept, so that every sleep makes its host copy)."""
    with offload.configured(strategy="staged", chunk_bytes=192 << 10, slots=3, threads=2,
                            keep_host_buffers=False):
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


# ------------------------------------------------------------------ bytes survive
@pytest.mark.parametrize("strategy", ["staged", "direct", "pinned"])
def test_offload_bytes_survive_20_cycles_over_several_tags(strategy):
    rng = random.Random(7)
    sizes = {"weights": 5 * MIB + 12288, "kv": 3 * MIB, "adapters": 640 << 10}
    allocs = {t: _tagged(t, n, growth=2 * MIB) for t, n in sizes.items()}  # several handles
    # pin_kept=False: every round takes ``strategy``'s path (pinned kept copies are below)
    with offload.configured(strategy=strategy, chunk_bytes=448 << 10, slots=4, threads=2,
                            pin_kept=False):
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
    fds, maps = _open_fds(), anonymous_mappings(size)
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
    assert _open_fds() == fds and anonymous_mappings(size) == maps  # host copy freed
    faulty.fail_copy_after = None
    vmm_core.sleep("w", offload="w")
    vmm_core.wake_up("w")
    assert ctypes.string_at(p, len(data)) == data


def test_staged_failure_mid_copy_on_wake_leaves_tag_asleep_with_its_host_copy(staged):
    alloc, p = _tagged("w", 3 * MIB)
    size = alloc.physical_bytes
    data = _fill_random(p, 3 * MIB, random.Random(2))
    maps = anonymous_mappings(size)
    vmm_core.sleep("w", offload="w")
    fds = _open_fds()
    assert anonymous_mappings(size) == maps + 1  # the host copy
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
    assert alloc.host_bytes == 0 and anonymous_mappings(size) == maps  # freed once awake


def test_direct_failure_on_wake_keeps_host_copy():
    alloc, p = _tagged("d", 2 * MIB)
    data = _fill_random(p, 2 * MIB, random.Random(3))
    with offload.configured(strategy="direct", chunk_bytes=256 << 10, keep_host_buffers=False):
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
    assert offload.wait_for_pinning(10)
    s = vmm_core.memory_summary()["weights"]  # kept, and registered with the backend
    assert s["host_bytes"] == s["pinned_host_bytes"] == held == s["device_bytes"]
    vmm_core.sleep(offload=("weights",))
    vmm_core.wake_up(keep_host_buffers=False)
    s = vmm_core.memory_summary()["weights"]
    assert s["host_bytes"] == s["pinned_host_bytes"] == 0 and s["device_bytes"] == held


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
    assert " GiB/s; host memory held 2.00 MiB (" in lines[0], lines[0]
    assert lines[1].startswith("wake_up: restored 3.00 MiB (tags graph, weights), 3.00 MiB "
                               "of tagged memory in use")
    assert "; copied back 2.00 MiB in " in lines[1]
    assert lines[1].endswith("; host memory held 2.00 MiB (2.00 MiB pinned)"), lines[1]


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
    before = anonymous_mappings(size)
    copy = host_memory.MappedHostCopy(size)
    assert copy.base % (2 * MIB) == 0  # stripes fault whole huge pages
    ctypes.memset(copy.base, 1, size)
    assert anonymous_mappings(size) == before + 1
    with ThreadPoolExecutor(3) as pool:
        copy.release(pool, 3)
        copy.release(pool, 3)  # idempotent
    assert anonymous_mappings(size) == before


# ------------------------------------------------------------------ races and fork
_RACE = r"""
import ctypes, random
import vmm_core
from vmm_core.memory import offload, tagged
from vmm_core.memory.offload import staging

# 3 x 16 MiB slots: larger than malloc's mmap threshold, so a freed ring is unmapped and a
# copy into it crashes instead of corrupting the heap quietly
offload.configure(strategy="staged", chunk_bytes=16 << 20, slots=3, threads=2)
alloc = vmm_core.SharedVMMAllocator("host", tag="w", growth_bytes=8 << 20)
tagged.register("w", alloc)
p = alloc.allocate(24 << 20)
data = random.Random(5).randbytes(24 << 20)
ctypes.memmove(p, data, len(data))
offload.prepare(alloc.backend, 0)  # the ring exists before the sleep looks for it

real_ring, raced = staging.staging_ring, []
def racing_ring(*args):
    ring = real_ring(*args)
    if not raced:  # another thread frees every ring right after the sleep found its own
        raced.append(ring)
        offload.release_staging()
    return ring
staging.staging_ring = racing_ring
vmm_core.sleep("w", offload="w")
vmm_core.wake_up("w")
assert raced, "the race was not staged"
assert ctypes.string_at(p, len(data)) == data, "bytes changed"
staging.staging_ring = real_ring
offload.release_staging()
print("OK")
"""


def test_release_staging_racing_a_staged_sleep_does_not_use_a_freed_ring():
    """release_staging racing a staged sleep never frees the ring the sleep took before its
    pipeline locks it: no copy goes into freed memory."""
    done = run_python(_RACE)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), \
        (done.returncode, done.stdout[-2000:], done.stderr[-2000:])


_FORK = r"""
import ctypes, os, random, signal, sys, time
import vmm_core
from vmm_core.memory import offload, tagged

offload.configure(strategy="staged", chunk_bytes=256 << 10, slots=3, threads=2)
alloc = vmm_core.SharedVMMAllocator("host", tag="w", growth_bytes=1 << 20)
tagged.register("w", alloc)
p = alloc.allocate(3 << 20)
data = random.Random(9).randbytes(3 << 20)
ctypes.memmove(p, data, len(data))
vmm_core.sleep("w", offload="w")  # the parent's copy threads and ring now exist
vmm_core.wake_up("w")

pid = os.fork()
if pid == 0:  # the child: its own offload must work
    code = 1
    try:
        vmm_core.sleep("w", offload="w")
        vmm_core.wake_up("w")
        code = 0 if ctypes.string_at(p, len(data)) == data else 2
    finally:
        os._exit(code)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("HANG")
    sys.exit(3)
print("child exit", os.waitstatus_to_exitcode(status))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_offload_in_a_forked_child_finishes():
    """The child inherited the copy thread pool without its threads, and its
    first staged offload waited forever for work nobody ran."""
    done = run_python(_FORK)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])


# ------------------------------------------------------------------ kept, pinned host copies
class _RegisterSpy(FaultInjector):
    """Counts registrations with the backend; ``fail_register`` makes them fail."""

    def __init__(self, backend):
        super().__init__(backend)
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_register = False

    def host_register(self, device, address, size):
        if self.fail_register:
            raise BackendError("injected: host register failed (locked-memory limit)")
        self.registered.append((address, size))
        return self._real.host_register(device, address, size)

    def host_unregister(self, device, address):
        self.unregistered.append(address)
        return self._real.host_unregister(device, address)


def _spied(alloc) -> _RegisterSpy:
    spy = _RegisterSpy(alloc.backend)
    alloc.backend = spy
    return spy


@pytest.fixture
def small_ring():
    with offload.configured(strategy="staged", chunk_bytes=192 << 10, slots=3, threads=2):
        yield
    offload.release_staging()
    offload.release_prepared()


def test_kept_copies_are_pinned_once_and_later_rounds_copy_straight(small_ring):
    """The default for repeated sleeps: round 1 streams through the ring and leaves a
    copy that is registered once and kept; rounds 2.. copy straight into it."""
    rng = random.Random(11)
    sizes = {"weights": 5 * MIB + 12288, "kv": 3 * MIB - 4096}  # not handle multiples
    allocs = {t: _tagged(t, n, growth=2 * MIB) for t, n in sizes.items()}
    spies = {t: _spied(a) for t, (a, _) in allocs.items()}
    held = {t: a.physical_bytes for t, (a, _) in allocs.items()}
    maps = {t: anonymous_mappings(held[t]) for t in sizes}
    for rnd in range(5):
        data = {t: _fill_random(p, sizes[t], rng) for t, (_, p) in allocs.items()}
        vmm_core.sleep(offload=tuple(sizes))
        for t, (a, _) in allocs.items():
            assert a.last_transfer.strategy == ("staged" if rnd == 0 else "pinned"), (rnd, t)
        vmm_core.wake_up()
        for t, (a, p) in allocs.items():
            assert ctypes.string_at(p, sizes[t]) == data[t], (rnd, t)
            assert a.last_transfer.strategy == "pinned", (rnd, t)
            # held while awake: the offloaded bytes, all pinned, in one mapping
            assert a.host_bytes == a.pinned_host_bytes == held[t]
            assert anonymous_mappings(held[t]) == maps[t] + 1
            assert len(spies[t].registered) == 1 and spies[t].unregistered == []
    summary = vmm_core.memory_summary()
    assert {t: summary[t]["pinned_host_bytes"] for t in sizes} == held
    vmm_core.sleep(offload=("weights",))
    vmm_core.wake_up(keep_host_buffers=False)  # gives the memory back
    for t, (a, _) in allocs.items():
        assert a.host_bytes == a.pinned_host_bytes == 0
        assert anonymous_mappings(held[t]) == maps[t]
        assert spies[t].unregistered == [spies[t].registered[0][0]]


def test_per_tag_policy_and_the_process_default(small_ring):
    w, pw = _tagged("weights", 2 * MIB)
    kv, pk = _tagged("kv", MIB)
    dw, dk = _fill_random(pw, 2 * MIB, random.Random(1)), _fill_random(pk, MIB, random.Random(2))
    offload.set_keep_host_buffers("kv", False)
    try:
        vmm_core.sleep(offload=("weights", "kv"))
        vmm_core.wake_up()
        assert w.host_bytes == w.physical_bytes and kv.host_bytes == 0
        vmm_core.sleep(offload=("weights", "kv"))
        vmm_core.wake_up(keep_host_buffers=True)  # the call wins over the policy
        assert kv.host_bytes == kv.physical_bytes
        offload.set_keep_host_buffers("kv", None)
        with offload.configured(keep_host_buffers=False):
            assert not offload.keeps_host_buffers("kv")
            vmm_core.sleep(offload=("weights", "kv"))
            vmm_core.wake_up()
        assert w.host_bytes == kv.host_bytes == 0
        assert ctypes.string_at(pw, 2 * MIB) == dw and ctypes.string_at(pk, MIB) == dk
    finally:
        offload.set_keep_host_buffers("kv", None)
    with pytest.raises(ValueError, match="True, False or None"):
        offload.set_keep_host_buffers("kv", "no")
    with pytest.raises(ValueError, match="keep_host_buffers must be True or False"):
        offload.configure(keep_host_buffers=1)


def test_a_tag_that_grew_between_rounds_gets_a_new_correct_copy(small_ring):
    rng = random.Random(3)
    alloc, p = _tagged("kv", 3 * MIB)
    spy = _spied(alloc)
    data = _fill_random(p, 3 * MIB, rng)
    vmm_core.sleep(offload="kv")
    vmm_core.wake_up()
    first = spy.registered[0][0]
    extra = alloc.allocate(3 * MIB + 8192)  # tensors re-allocated bigger: more handles
    more = _fill_random(extra, 3 * MIB + 8192, rng)
    data = _fill_random(p, 3 * MIB, rng)
    vmm_core.sleep(offload="kv")
    assert alloc.last_transfer.strategy == "staged"  # the old copy does not fit
    assert spy.unregistered == [first]  # and was given back
    vmm_core.wake_up()
    assert ctypes.string_at(p, 3 * MIB) == data
    assert ctypes.string_at(extra, len(more)) == more
    assert alloc.host_bytes == alloc.pinned_host_bytes == alloc.physical_bytes
    vmm_core.sleep(offload="kv")
    assert alloc.last_transfer.strategy == "pinned"
    vmm_core.wake_up()
    assert ctypes.string_at(extra, len(more)) == more


def test_failed_copy_into_and_out_of_a_kept_copy_leaves_state_consistent(small_ring):
    alloc, p = _tagged("w", 3 * MIB, growth=MIB)
    data = _fill_random(p, 3 * MIB, random.Random(4))
    vmm_core.sleep(offload="w")
    vmm_core.wake_up()  # a kept, pinned copy from here on
    size = alloc.physical_bytes
    faulty = _spied(alloc)
    faulty.fail_copy_after = 1  # the second of three handle copies fails
    with pytest.raises(BackendError, match="injected"):
        vmm_core.sleep("w", offload="w")
    assert not alloc.asleep and alloc.physical_bytes == size
    assert ctypes.string_at(p, len(data)) == data
    assert alloc.host_bytes == size  # the kept copy, still no more than the offloaded bytes
    faulty.fail_copy_after = None
    vmm_core.sleep("w", offload="w")
    faulty.fail_copy_after, faulty.live_handles = 2, 0
    with pytest.raises(BackendError, match="injected"):
        vmm_core.wake_up("w")
    assert alloc.asleep and alloc.host_bytes == alloc.pinned_host_bytes == size
    assert faulty.live_handles == 0
    faulty.fail_copy_after = None
    vmm_core.wake_up("w")
    assert ctypes.string_at(p, len(data)) == data
    assert faulty.registered == []  # registered once, before the spy came


def test_a_failed_registration_leaves_the_copy_pageable_and_working(small_ring, caplog):
    alloc, p = _tagged("w", 2 * MIB)
    spy = _spied(alloc)
    spy.fail_register = True
    data = _fill_random(p, 2 * MIB, random.Random(6))
    with caplog.at_level(logging.WARNING, logger="vmm_core"):
        for _ in range(2):
            vmm_core.sleep(offload="w")
            vmm_core.wake_up()
            assert ctypes.string_at(p, len(data)) == data
            assert alloc.last_transfer.strategy == "staged"
            assert alloc.host_bytes == alloc.physical_bytes and alloc.pinned_host_bytes == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "keep_host_buffers=False" in warnings[0], warnings


def test_prepare_tags_pins_ahead_so_the_first_sleep_copies_straight(small_ring):
    w, pw = _tagged("weights", 4 * MIB + 4096, growth=2 * MIB)
    spy = _spied(w)
    data = _fill_random(pw, 4 * MIB + 4096, random.Random(8))
    with pytest.raises(VMMError, match="no memory is tagged.*after the tagged memory"):
        offload.prepare(["weights", "nope"])
    offload.prepare("weights")
    assert w.host_bytes == w.pinned_host_bytes == w.physical_bytes
    assert len(spy.registered) == 1
    offload.prepare("weights")  # already prepared: nothing new
    assert len(spy.registered) == 1
    vmm_core.sleep(offload="weights")
    assert w.last_transfer.strategy == "pinned"
    vmm_core.wake_up()
    assert ctypes.string_at(pw, len(data)) == data and w.host_bytes == w.physical_bytes


def test_prepare_bytes_is_taken_by_the_first_offload_that_fits(small_ring):
    host = vmm_core.get_backend("host")
    assert offload.prepare(3 * MIB, backend=host) >= 0
    assert offload.prepared_bytes() == 3 * MIB
    with pytest.raises(ValueError, match="positive"):
        offload.prepare(0, backend=host)
    with pytest.raises(ValueError, match="tags or a number of bytes"):
        offload.prepare(True)
    assert offload.prepare(host) >= 0  # a Backend: the ring and threads only, as before
    big, pb = _tagged("big", 4 * MIB)
    small, ps = _tagged("small", 2 * MIB)
    db = _fill_random(pb, 4 * MIB, random.Random(9))
    ds = _fill_random(ps, 2 * MIB, random.Random(10))
    vmm_core.sleep(offload=("big", "small"))
    assert big.last_transfer.strategy == "staged"  # 4 MiB do not fit in 3
    assert small.last_transfer.strategy == "pinned" and offload.prepared_bytes() == 0
    assert small.host_bytes == 3 * MIB  # the whole prepared copy, as documented
    vmm_core.wake_up()
    assert ctypes.string_at(pb, 4 * MIB) == db and ctypes.string_at(ps, 2 * MIB) == ds
    vmm_core.sleep(offload=("small",))
    assert small.last_transfer.strategy == "pinned"  # reused, though larger
    vmm_core.wake_up()
    assert ctypes.string_at(ps, 2 * MIB) == ds


# ------------------------------------------------------------------ fork while registering
_FORK_WHILE_REGISTERING = r"""
import ctypes, os, random, signal, sys, threading, time
import vmm_core
from vmm_core.memory import tagged
from vmm_core.testing import FaultInjector

started = threading.Event()
class SlowRegister(FaultInjector):
    def host_register(self, device, address, size):
        started.set()
        time.sleep(1.0)  # page-locking a large copy takes a while
        return self._real.host_register(device, address, size)

alloc = vmm_core.SharedVMMAllocator("host", tag="w", growth_bytes=1 << 20)
tagged.register("w", alloc)
alloc.backend = SlowRegister(alloc.backend)
p = alloc.allocate(2 << 20)
data = random.Random(1).randbytes(2 << 20)
ctypes.memmove(p, data, len(data))
vmm_core.sleep("w", offload="w")  # the kept copy registers in the background
assert started.wait(10)
pid = os.fork()  # while the registration runs
if pid == 0:
    code = 1
    try:
        vmm_core.wake_up("w", keep_host_buffers=False)  # frees the copy
        code = 0 if ctypes.string_at(p, len(data)) == data else 2
        alloc.close()
    finally:
        os._exit(code)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("HANG")
    sys.exit(3)
vmm_core.wake_up("w")
assert ctypes.string_at(p, len(data)) == data
print("child exit", os.waitstatus_to_exitcode(status))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_fork_while_a_kept_copy_registers_does_not_hang_the_child():
    """The background registration held the copy's lock at the fork; the child's release
    of that copy (wake with keep_host_buffers=False, close, exit) waited forever."""
    done = run_python(_FORK_WHILE_REGISTERING)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])


def test_a_copy_kept_against_the_tag_policy_is_pinned_too(small_ring):
    """wake_up(keep_host_buffers=True) promises a kept (pinned) copy the next sleep copies
    straight into; with the tag's policy False the sleep never started the registration,
    so every round streamed through the ring."""
    alloc, p = _tagged("kv", 2 * MIB)
    spy = _spied(alloc)
    data = _fill_random(p, 2 * MIB, random.Random(12))
    offload.set_keep_host_buffers("kv", False)
    try:
        for rnd in range(3):
            vmm_core.sleep(offload="kv")
            assert alloc.last_transfer.strategy == ("staged" if rnd == 0 else "pinned"), rnd
            vmm_core.wake_up(keep_host_buffers=True)
            assert offload.wait_for_pinning(10)
            assert alloc.host_bytes == alloc.pinned_host_bytes == alloc.physical_bytes
            assert ctypes.string_at(p, len(data)) == data
        assert len(spy.registered) == 1
    finally:
        offload.set_keep_host_buffers("kv", None)


def test_bad_arguments_to_prepare_and_the_keep_policy_are_refused_whole(small_ring):
    """prepare(None), prepare(1.5e6) or prepare(b"w") died in an AttributeError naming no
    remedy; prepare(nbytes, backend="host") refused the backend name every other call
    takes; a bad tag in set_keep_host_buffers left the tags before it changed; and
    wake_up(keep_host_buffers="no") kept the copy."""
    for bad in (None, 1.5e6, b"w", object()):
        with pytest.raises(ValueError, match=r"tags or a number of bytes \(or a Backend\)"):
            offload.prepare(bad)
    offload.prepare(MIB, backend="host")
    assert offload.prepared_bytes() == MIB
    stand_in = FaultInjector(vmm_core.get_backend("host"))  # wrappers work as before
    assert offload.prepare(stand_in) >= 0 and offload.prepare(MIB, backend=stand_in) >= 0
    assert offload.prepared_bytes() == 2 * MIB
    with pytest.raises(ValueError, match="non-empty strings"):
        offload.set_keep_host_buffers(("a", 3), False)
    assert offload.keeps_host_buffers("a")  # unchanged
    with pytest.raises(ValueError, match="a tag name or a list of tag names, got None"):
        offload.set_keep_host_buffers(None, False)
    alloc, p = _tagged("w", MIB)
    vmm_core.sleep(offload="w")
    with pytest.raises(ValueError, match="keep_host_buffers must be True, False or None"):
        vmm_core.wake_up("w", keep_host_buffers="no")
    assert alloc.asleep
    vmm_core.wake_up("w", keep_host_buffers=False)
    assert alloc.host_bytes == 0


def test_a_failed_sleep_gives_the_prepared_copy_back_to_the_reserve(small_ring):
    """A sleep that took the copy prepare(nbytes) made and then failed freed it: the
    memory prepared (and pinned) at load was gone, and the retry paid for a fresh one."""
    alloc, p = _tagged("w", 2 * MIB)
    data = _fill_random(p, 2 * MIB, random.Random(13))
    offload.prepare(3 * MIB, backend=alloc.backend)
    faulty = _spied(alloc)
    faulty.fail_copy_after = 1
    with pytest.raises(BackendError, match="injected"):
        vmm_core.sleep("w", offload="w")
    assert not alloc.asleep and alloc.host_bytes == 0
    assert offload.prepared_bytes() == 3 * MIB
    faulty.fail_copy_after = None
    vmm_core.sleep("w", offload="w")
    assert alloc.last_transfer.strategy == "pinned" and offload.prepared_bytes() == 0
    vmm_core.wake_up("w")
    assert ctypes.string_at(p, len(data)) == data


def test_release_staging_racing_a_direct_sleep_and_wake_fails_neither(monkeypatch):
    """release_staging shut the copy threads down while a direct sleep or wake (or the
    parallel release of a host copy) was handing them work: the call raised RuntimeError
    'cannot schedule new futures after shutdown', a wake that had succeeded included."""
    from vmm_core.memory import host_memory
    from vmm_core.memory.offload import staging

    monkeypatch.setattr(host_memory, "PARALLEL_RELEASE_BYTES", 0)  # "large" = any size
    monkeypatch.setattr(staging, "PARALLEL_RELEASE_BYTES", 0)
    real_pool, raced = staging.copy_threads, []

    def racing_pool(threads):
        pool = real_pool(threads)
        raced.append(pool)
        offload.release_staging()  # another thread frees the threads right after
        return pool

    monkeypatch.setattr(staging, "copy_threads", racing_pool)
    alloc, p = _tagged("w", 3 * MIB)
    data = _fill_random(p, 3 * MIB, random.Random(14))
    with offload.configured(strategy="direct", chunk_bytes=256 << 10, threads=2,
                            direct_threads=2, keep_host_buffers=False):
        for _ in range(2):
            vmm_core.sleep("w", offload="w")
            vmm_core.wake_up("w")
            assert ctypes.string_at(p, len(data)) == data and alloc.host_bytes == 0
    assert raced, "the race was not staged"


#: what Thread.start raises when the process may start no more threads, and when it
#: cannot allocate the new thread's own structures
THREAD_START_FAILURES = [RuntimeError("can't start new thread"), MemoryError()]


def _refusing_thread_starts(monkeypatch, prefix: str, error: BaseException) -> list:
    """Thread.start of the copy threads named ``prefix`` raises ``error`` while the
    returned list holds True."""
    refuse = [True]
    real_start = threading.Thread.start

    def start(thread):
        if refuse[0] and thread.name.startswith(prefix):
            raise error
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return refuse


@pytest.mark.parametrize("error", THREAD_START_FAILURES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("running", [0, 1])
def test_a_copy_thread_that_cannot_start_runs_the_work_once(monkeypatch, running, error):
    """A copy thread that could not start ("can't start new thread") left the work
    queued: the caller ran it itself, then a running thread ran it again, or, with none
    running, the next thread that started ran it late (a chunk's copy written over what
    the next sleep had put there)."""
    from vmm_core.memory.offload import staging

    pool = staging.copy_threads(2 + running)  # the process's pool: a submit falls back
    ran, gate = [], threading.Event()  # to this thread when its own pool cannot take it
    try:
        busy = []
        if running:  # one thread up, held busy, so the next submit starts another
            busy.append(pool.submit(gate.wait, 5))
        refuse = _refusing_thread_starts(monkeypatch, "vmm_core-offload", error)
        future = pool.submit(ran.append, "work")
        if not running:
            assert future.done() and ran == ["work"]  # on this thread, the queue emptied
        refuse[0] = False
        gate.set()
        pool.submit(ran.append, "later").result(timeout=5)  # a thread starts now
        future.result(timeout=5)
        for f in busy:
            f.result(timeout=5)
        time.sleep(0.05)  # a stale queued copy would run by now
        assert sorted(ran) == ["later", "work"], ran
    finally:
        gate.set()
        offload.release_staging()


@pytest.mark.parametrize("error", THREAD_START_FAILURES, ids=lambda e: type(e).__name__)
def test_a_page_locking_thread_that_cannot_start_leaves_no_registration_for_later(
        monkeypatch, error):
    """The registration of a copy whose thread could not start stayed queued, and the
    next one that started registered it late: a copy the caller took to stay pageable,
    and that may be freed by then."""
    from vmm_core.memory.host_memory import MappedHostCopy
    from vmm_core.memory.offload import pinning

    backend = vmm_core.get_backend("host")
    monkeypatch.setattr(pinning, "_pin_executor", None)
    first, second = MappedHostCopy(1 << 20), MappedHostCopy(1 << 20)
    try:
        refuse = _refusing_thread_starts(monkeypatch, "vmm_core-pin", error)
        pinning.pin_later(backend, 0, first)
        assert first.pin_future is None  # stays pageable
        refuse[0] = False
        pinning.pin_later(backend, 0, second)
        assert pinning.wait_for_pinning(timeout=10)
        assert second.pinned_bytes and not first.pinned_bytes
    finally:
        first.release()
        second.release()


def test_a_sleep_whose_copy_threads_run_out_of_memory_to_start_keeps_every_byte():
    """One copy thread started, the next ran out of memory in Thread.start: the sleep
    raised MemoryError, freed its host copy, and the chunk still queued then wrote into
    it (a segfault)."""
    out = run_python("""
    import ctypes, random, threading, time
    import vmm_core
    from vmm_core.memory import offload
    from test_offload_host import MIB, _fill_random, _tagged

    real_start, started = threading.Thread.start, []
    def start(thread):
        if thread.name.startswith("vmm_core-offload"):
            if started:
                raise MemoryError()
            started.append(thread)
        return real_start(thread)
    threading.Thread.start = start

    alloc, p = _tagged("t", 32 * MIB, growth=4 * MIB)
    data = _fill_random(p, 32 * MIB, random.Random(0))
    with offload.configured(strategy="staged", chunk_bytes=4 * MIB, slots=4, threads=4,
                            keep_host_buffers=False):
        for _ in range(5):
            vmm_core.sleep("t", offload="t")
            vmm_core.wake_up("t")
            time.sleep(0.02)  # a stale queued chunk would have run by now
            assert ctypes.string_at(p, 32 * MIB) == data
    print("every byte back")
    """, env=env_with_tests(),
        hung="a sleep waiting for copy threads that never started")
    assert out.returncode == 0 and "every byte back" in out.stdout, (out.returncode,
                                                                     out.stderr[-2000:])


_SLEEP_AT_EXIT = r"""
import atexit, ctypes, random
import vmm_core
from vmm_core.memory import tagged

alloc = vmm_core.SharedVMMAllocator("host", tag="w", growth_bytes=1 << 20)
tagged.register("w", alloc)
p = alloc.allocate(2 << 20)

def offload_at_exit():  # an engine that offloads its weights as the process ends
    try:
        vmm_core.sleep("w", offload="w")
        print("asleep", alloc.asleep, alloc.host_bytes)
    except Exception as exc:
        print("FAILED", type(exc).__name__, exc)

atexit.register(offload_at_exit)
"""


def test_an_offloading_sleep_in_an_atexit_handler_works():
    """The background registration of the kept copy was submitted to a thread pool after
    the interpreter had shut pools down: the sleep raised RuntimeError once its copy was
    done, and the copy leaked."""
    done = run_python(_SLEEP_AT_EXIT)
    assert done.returncode == 0 and done.stdout.strip() == f"asleep True {2 * MIB}", \
        (done.stdout[-2000:], done.stderr[-2000:])


class _PeakSpy(FaultInjector):
    """Records, at every copy to the host, whether ``watched`` host copy is still held."""

    def __init__(self, backend, watched):
        super().__init__(backend)
        self.watched, self.held_during_copy = watched, []

    def copy_to_host(self, device, address, host_address, size):
        self.held_during_copy.append(self.watched.held_bytes)
        return super().copy_to_host(device, address, host_address, size)


def test_a_kept_copy_that_no_longer_fits_is_freed_before_the_new_one_is_filled():
    """A tag that grew between rounds gives its old kept (pinned) copy back before the sleep
    fills the new one: the host never holds twice the offloaded bytes at the peak."""
    alloc, p = _tagged("kv", 3 * MIB)
    with offload.configured(strategy="direct", chunk_bytes=MIB):
        vmm_core.sleep(offload="kv")
        vmm_core.wake_up()
        old = alloc._host.copy
        assert old is not None and old.held_bytes == 3 * MIB
        extra = alloc.allocate(2 * MIB)  # the tag grew: the kept copy does not fit
        data = _fill_random(extra, 2 * MIB, random.Random(15))
        spy = alloc.backend = _PeakSpy(alloc.backend, old)
        vmm_core.sleep(offload="kv")
        assert spy.held_during_copy and set(spy.held_during_copy) == {0}
        vmm_core.wake_up()
    assert ctypes.string_at(extra, len(data)) == data
    assert alloc.host_bytes == alloc.physical_bytes


def test_prepare_bytes_is_taken_under_the_pinned_strategy_too(small_ring):
    """With configure(strategy="pinned") no sleep ever took the copy prepare(nbytes) made:
    it stayed in the reserve, held and unused, while every sleep made its own."""
    alloc, p = _tagged("w", MIB)
    data = _fill_random(p, MIB, random.Random(16))
    with offload.configured(strategy="pinned"):
        offload.prepare(2 * MIB, backend=alloc.backend)
        vmm_core.sleep("w", offload="w")
        assert offload.prepared_bytes() == 0 and alloc.host_bytes == 2 * MIB
        vmm_core.wake_up("w")
    assert ctypes.string_at(p, len(data)) == data


def test_prepare_of_a_sleeping_tag_names_the_call_that_wakes_it(small_ring):
    """The error tells a user of tags to call wake_up(tag), not wake(), a method of an
    allocator they never see."""
    alloc, _ = _tagged("w", MIB)
    vmm_core.sleep("w", offload="w")
    with pytest.raises(SleepStateError, match=r"vmm_core\.wake_up\('w'\)"):
        offload.prepare("w")
    vmm_core.wake_up("w")
    offload.prepare("w")
    assert alloc.host_bytes == alloc.physical_bytes


def test_prepare_of_bytes_off_a_page_boundary_leaves_no_mapping_behind(small_ring):
    """A host copy whose size was not a page multiple (prepare(nbytes) of any size) could
    not trim the huge-page slack past its end (munmap refuses an address inside a page):
    every such copy left a mapping behind after its release."""
    from vmm_core.memory import host_memory

    page = os.sysconf("SC_PAGE_SIZE")
    for size in (3 * MIB + 1, 5 * MIB - 100):
        copy = host_memory.MappedHostCopy(size)
        tail = -(-(copy.base + size) // page) * page  # the first page past the copy
        assert not mapped(tail), "the slack past the copy stays mapped"
        base = copy.base
        copy.release()
        assert not mapped(base) and not mapped(tail - page)  # and the copy is gone
    assert offload.prepare(3 * MIB + 1, backend=vmm_core.get_backend("host")) >= 0
    offload.release_prepared()


class _SlowRegister(_RegisterSpy):
    """Registrations take a while (page-locking gigabytes does), and each records whether
    ``watched`` host copy was still held when it began."""

    watched = None

    def __init__(self, backend):
        super().__init__(backend)
        self.old_held_at_register: list[int] = []

    def host_register(self, device, address, size):
        if self.watched is not None:
            self.old_held_at_register.append(self.watched.held_bytes)
        time.sleep(0.3)
        return super().host_register(device, address, size)


def test_prepare_waits_for_a_pending_registration_instead_of_making_a_second_copy(
        small_ring):
    """prepare(tag) while the kept copy's registration ran in the background made and
    pinned a whole new copy, holding both meanwhile."""
    alloc, p = _tagged("w", 2 * MIB)
    spy = alloc.backend = _SlowRegister(alloc.backend)
    offload.set_keep_host_buffers("w", False)
    try:
        vmm_core.sleep(offload="w")
        vmm_core.wake_up("w", keep_host_buffers=True)  # registers in the background
        kept = alloc._host.copy
        offload.prepare("w")
        assert alloc._host.copy is kept and len(spy.registered) == 1
        assert alloc.host_bytes == alloc.pinned_host_bytes == alloc.physical_bytes
    finally:
        offload.set_keep_host_buffers("w", None)


def test_prepare_frees_a_kept_copy_that_no_longer_fits_before_making_the_new_one(
        small_ring):
    alloc, p = _tagged("w", 2 * MIB)
    vmm_core.sleep(offload="w")
    vmm_core.wake_up("w")
    old = alloc._host.copy
    alloc.allocate(2 * MIB)  # the tag grew
    spy = alloc.backend = _SlowRegister(alloc.backend)
    spy.watched = old
    offload.prepare("w")
    assert spy.old_held_at_register == [0]
    assert alloc.host_bytes == alloc.pinned_host_bytes == alloc.physical_bytes == 4 * MIB


class _RecordingRegistrations(FaultInjector):
    """The host backend, appending "registered" to ``events`` at every registration."""

    def __init__(self, real, events: list) -> None:
        super().__init__(real)
        self._events = events

    def host_register(self, device, address, size):
        self._events.append("registered")
        return self._real.host_register(device, address, size)


def test_prepare_waits_for_an_open_capture_space():
    """prepare() pins off the critical path, maybe on a loader thread while the engine
    captures: a device capture in global mode refuses cudaHostRegister from any thread,
    so pinning waits for the capture block, as sleep and wake do."""
    events: list = []
    backend = _RecordingRegistrations(vmm_core.get_backend("host"), events)
    pool = vmm_core.GraphPool(backend="host", reads=())
    try:
        for what in (2 * MIB, "w-prepared"):  # a copy for later, a tag's own copy
            if what == "w-prepared":
                alloc, _ = _tagged("w-prepared", 2 * MIB)
                alloc.backend = backend
            events.clear()
            with pool.space(what):
                loader = threading.Thread(target=offload.prepare, args=(what, backend))
                loader.start()
                loader.join(0.3)
                events.append("capture ended")
            loader.join(10)
            assert events == ["capture ended", "registered"], what
        assert offload.prepared_bytes() == 2 * MIB
        assert alloc.pinned_host_bytes == alloc.physical_bytes
    finally:
        offload.release_prepared()
        pool.close()


def test_prepare_inside_a_capture_space_of_its_own_thread_is_refused():
    """The lock that keeps prepare() out of other threads' capture blocks is re-entrant, so
    prepare() inside a capture space of its own thread is refused by its own check: it would
    page-lock host memory during that capture (a device capture in global mode refuses
    cudaHostRegister, or breaks). Sleep and wake there (of memory the capture does not hold
    awake) would synchronize and pin during it too. All are refused, naming the remedy;
    afterwards they work."""
    events: list = []
    backend = _RecordingRegistrations(vmm_core.get_backend("host"), events)
    alloc, _ = _tagged("w-in-capture", 2 * MIB)
    pool = vmm_core.GraphPool(backend="host", reads=())
    try:
        with pool.space(1):
            with pytest.raises(CaptureError, match="inside the capture space of 1.*leave"):
                offload.prepare(2 * MIB, backend)
            with offload.configured(strategy="staged"), \
                    pytest.raises(CaptureError, match="inside the capture space of 1"):
                offload.prepare_staging(backend, 0)
            with pytest.raises(SleepStateError, match="inside the capture space of 1"):
                vmm_core.sleep("w-in-capture", offload="w-in-capture")
            assert not alloc.asleep
        assert events == []
        vmm_core.sleep("w-in-capture", offload="w-in-capture")
        with pool.space(1), pytest.raises(SleepStateError, match="wake_up inside"):
            vmm_core.wake_up("w-in-capture")
        vmm_core.wake_up("w-in-capture")
        offload.prepare(2 * MIB, backend)
        assert events == ["registered"]
    finally:
        offload.release_prepared()
        pool.close()


# ------------------------------------------------------------------ round 1 (registration order)
class _DeviceWorkSpy(_RegisterSpy):
    """Records the order of a sleep's or wake's device work and the registrations of
    kept copies, into a list shared by every allocator's spy.  At each device call it
    also notes whether a registration was started (submitted to the background thread,
    whether or not that thread has run it yet) since ``_clear`` was last called."""

    def __init__(self, backend, tag: str, events: list, allocs: list):
        super().__init__(backend)
        self.tag, self.events, self.allocs = tag, events, allocs

    def _note(self, what: str) -> None:
        started = any(a._host.copy is not None and a._host.copy.pin_future is not None
                      and a._host.copy.pin_future not in self.events.known
                      for a in self.allocs)
        self.events.append((what, self.tag, started))

    def host_register(self, device, address, size):
        self.events.append(("register", self.tag, True))
        return super().host_register(device, address, size)

    def unmap(self, device, address, size):
        self._note("unmap")
        return self._real.unmap(device, address, size)

    def release_handle(self, device, handle):
        self._note("release")
        return super().release_handle(device, handle)

    def create_handle(self, device, size):
        self._note("create")
        return super().create_handle(device, size)

    def _copy_allowed(self) -> None:  # every copy: the hooks and the copy queue's
        self._note("copy")
        super()._copy_allowed()


class _Events(list):
    """The spies' shared record; ``known``: registrations started before ``clear``."""

    def __init__(self) -> None:
        super().__init__()
        self.known: set = set()
        self.allocs: list = []

    def clear(self) -> None:
        super().clear()
        self.known = {a._host.copy.pin_future for a in self.allocs
                      if a._host.copy is not None and a._host.copy.pin_future is not None}


def _watched(sizes: dict, events: _Events):
    allocs = events.allocs
    out = {}
    for tag, n in sizes.items():
        alloc, p = _tagged(tag, n, growth=2 * MIB)
        alloc.backend = _DeviceWorkSpy(alloc.backend, tag, events, allocs)
        allocs.append(alloc)
        out[tag] = (alloc, p)
    return out


def test_kept_copies_register_after_the_whole_sleep_not_beside_it(small_ring):
    """A kept copy's registration starts once the whole sleep is done, not as soon as the
    copy is filled: beside the rest of the sleep (unmapping and releasing the handles, the
    next tags' copies and unmapping), which would wait for it, it would make round 1 of the
    default slower than the staging ring alone (on an H100, 4 GiB: 352 ms against 264 ms;
    the copy itself 252 ms). Rounds 2.. still copy straight into the one registered copy,
    bytes intact."""
    rng = random.Random(21)
    sizes = {"weights": 5 * MIB + 12288, "kv": 3 * MIB - 4096, "scratch": 2 * MIB}
    events = _Events()
    allocs = _watched(sizes, events)
    offloaded = ("weights", "kv")
    for rnd in range(3):
        data = {t: _fill_random(allocs[t][1], sizes[t], rng) for t in offloaded}
        events.clear()
        vmm_core.sleep(["weights", "kv", "scratch"], offload=offloaded)
        assert offload.wait_for_pinning(10)
        device_work = [e for e in events if e[0] != "register"]
        assert {e[0] for e in device_work} >= ({"copy", "unmap", "release"} if rnd == 0
                                               else {"unmap", "release"})
        assert not any(started for _, _, started in device_work), device_work
        registered = [e[1] for e in events if e[0] == "register"]
        assert sorted(registered) == (sorted(offloaded) if rnd == 0 else []), rnd
        if registered:  # after the last device call of the sleep, every one of them
            assert all(e[0] == "register" for e in events[-len(registered):]), events
        for t in offloaded:
            a = allocs[t][0]
            assert a.last_transfer.strategy == ("staged" if rnd == 0 else "pinned"), (rnd, t)
        vmm_core.wake_up()
        for t in offloaded:
            a, p = allocs[t]
            assert ctypes.string_at(p, sizes[t]) == data[t], (rnd, t)
            assert a.last_transfer.strategy == "pinned", (rnd, t)
            assert a.host_bytes == a.pinned_host_bytes == a.physical_bytes, (rnd, t)
    assert allocs["scratch"][0].host_bytes == 0


def test_a_sleep_that_fails_midway_registers_the_copies_it_made_only_afterwards(small_ring):
    """The second tag's copy fails: the first tag sleeps with its kept copy, registered
    only after the failed call returned; the second stays awake with its bytes and no
    host copy; the retry sleeps it and every byte comes back."""
    rng = random.Random(22)
    sizes = {"weights": 4 * MIB + 4096, "kv": 3 * MIB}
    events = _Events()
    allocs = _watched(sizes, events)
    data = {t: _fill_random(p, sizes[t], rng) for t, (_, p) in allocs.items()}
    w, kv = allocs["weights"][0], allocs["kv"][0]
    kv.backend.fail_copy_after = 2  # the ring's third chunk of kv fails
    with pytest.raises(BackendError, match="injected"):
        vmm_core.sleep(["weights", "kv"], offload=("weights", "kv"))
    assert offload.wait_for_pinning(10)
    assert w.asleep and w.host_bytes == w.pinned_host_bytes > 0
    assert not kv.asleep and kv.host_bytes == 0
    assert ctypes.string_at(allocs["kv"][1], sizes["kv"]) == data["kv"]
    assert not any(started for what, _, started in events if what != "register"), events
    assert [e[:2] for e in events if e[0] == "register"] == [("register", "weights")]
    assert events[-1][0] == "register"  # after the failed copy, not before it
    kv.backend.fail_copy_after = None
    vmm_core.sleep(["weights", "kv"], offload=("weights", "kv"))
    vmm_core.wake_up()
    for t, (a, p) in allocs.items():
        assert ctypes.string_at(p, sizes[t]) == data[t], t
        assert a.host_bytes == a.physical_bytes, t


def test_copies_kept_against_the_policy_register_after_the_whole_wake(small_ring):
    """wake_up(keep_host_buffers=True) of tags whose policy gives copies back registers
    them; the first tag's registration ran beside the next tag's wake."""
    rng = random.Random(23)
    sizes = {"weights": 2 * MIB, "kv": 3 * MIB + 8192}
    events = _Events()
    allocs = _watched(sizes, events)
    data = {t: _fill_random(p, sizes[t], rng) for t, (_, p) in allocs.items()}
    offload.set_keep_host_buffers(list(sizes), False)
    try:
        vmm_core.sleep(["weights", "kv"], offload=("weights", "kv"))
        assert not any(e[0] == "register" for e in events)  # the policy: nothing kept
        events.clear()
        vmm_core.wake_up(["weights", "kv"], keep_host_buffers=True)
        assert offload.wait_for_pinning(10)
        assert {e[0] for e in events} >= {"create", "register"}
        assert not any(started for what, _, started in events if what != "register"), events
        assert sorted(e[1] for e in events if e[0] == "register") == sorted(sizes)
        for t, (a, p) in allocs.items():
            assert ctypes.string_at(p, sizes[t]) == data[t], t
            assert a.host_bytes == a.pinned_host_bytes == a.physical_bytes, t
        vmm_core.sleep(["weights", "kv"], offload=("weights", "kv"))
        assert {allocs[t][0].last_transfer.strategy for t in sizes} == {"pinned"}
        vmm_core.wake_up(keep_host_buffers=False)
        for t, (a, p) in allocs.items():
            assert ctypes.string_at(p, sizes[t]) == data[t], t
            assert a.host_bytes == 0, t
    finally:
        offload.set_keep_host_buffers(list(sizes), None)
