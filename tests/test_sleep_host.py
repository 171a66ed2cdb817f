"""Tagged sleep/wake, for real, on the host backend's memfd pages."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

import vmm_core
from vmm_core.errors import OutOfMemoryError, SleepStateError, VMMError
from vmm_core.testing import FaultInjector

pytestmark = pytest.mark.usefixtures("clean_tags")


def _fill(address, data):
    ctypes.memmove(address, data, len(data))


def test_offload_keeps_bytes_discard_frees(tmp_path):
    with vmm_core.region("weights", backend="host") as w:
        pw = w.allocate(3 << 20)
    with vmm_core.region("scratch", backend="host") as s:
        ps = s.allocate(1 << 20)
    payload = bytes(range(256)) * (3 << 12)
    _fill(pw, payload)
    _fill(ps, b"scratch")
    vmm_core.sleep(offload=("weights",))
    assert w.physical_bytes == 0 and s.physical_bytes == 0
    assert w.asleep and s.asleep
    vmm_core.wake_up()
    assert ctypes.string_at(pw, len(payload)) == payload  # same address, same bytes
    assert ctypes.string_at(ps, 7) == b"\0" * 7  # discarded: fresh zero pages
    assert w.physical_bytes >= 3 << 20


def test_sleep_and_wake_are_idempotent_per_tag():
    with vmm_core.region("kv", backend="host") as kv:
        p = kv.allocate(1 << 20)
    _fill(p, b"kv!")
    vmm_core.sleep("kv", offload="kv")
    vmm_core.sleep("kv", offload="kv")  # no-op, not a crash
    vmm_core.wake_up("kv")
    vmm_core.wake_up("kv")
    assert ctypes.string_at(p, 3) == b"kv!"


def test_bad_tags_are_explained(warns_unrouted):
    with warns_unrouted("host", "a"), vmm_core.region("a", backend="host"):
        pass
    with pytest.raises(VMMError, match="no memory is tagged"):
        vmm_core.sleep("nope")
    with pytest.raises(VMMError, match="not being put to sleep"):
        vmm_core.sleep("a", offload=("b",))
    vmm_core.sleep("a")
    with pytest.raises(SleepStateError, match="wake_up"):
        with vmm_core.region("a", backend="host"):
            pass


def test_graphs_sleep_under_their_tag_and_replay_after_wake():
    host = vmm_core.get_backend("host")
    w = torch.randn(4, 4)
    ex = vmm_core.GraphExecutor(lambda x: x @ w, torch.zeros(16, 4), backend=host)
    for n in (1, 7, 16):
        ex(torch.randn(n, 4))
    captured = ex.captured_buckets
    vmm_core.sleep("graph")
    # (host graphs keep no pool memory: replay is eager; the GPU suite checks the bytes)
    assert ex.stats()["asleep"]
    with pytest.raises(SleepStateError, match="asleep"):
        ex(torch.randn(3, 4))
    vmm_core.wake_up("graph")
    x = torch.randn(7, 4)
    torch.testing.assert_close(ex(x), x @ w)
    assert ex.captured_buckets == captured


def test_failed_wake_leaves_each_tag_awake_or_asleep_and_retry_works():
    with vmm_core.region("first", backend="host") as a:
        pa = a.allocate(1 << 20)
    with vmm_core.region("second", backend="host") as b:
        pb = b.allocate(2 << 20)
    _fill(pa, b"AAAA")
    _fill(pb, b"BBBB")
    vmm_core.sleep(offload=("first", "second"))
    faulty = FaultInjector(b.backend)
    b.backend = faulty
    faulty.fail_create_after = 0
    with pytest.raises(OutOfMemoryError):
        vmm_core.wake_up()
    assert not a.asleep and b.asleep and b.physical_bytes == 0
    assert faulty.live_handles == 0
    faulty.fail_create_after = None
    vmm_core.wake_up()
    assert ctypes.string_at(pa, 4) == b"AAAA" and ctypes.string_at(pb, 4) == b"BBBB"


def test_host_buffers_dropped_after_wake_unless_kept():
    with vmm_core.region("w", backend="host") as w:
        p = w.allocate(1 << 20)
    _fill(p, b"keep")
    vmm_core.sleep(offload="w")
    vmm_core.wake_up("w", keep_host_buffers=True)
    kept = w._host.copy
    assert kept is not None and w.host_bytes == w.physical_bytes  # held while awake
    vmm_core.sleep(offload="w")
    assert w._host.copy is kept  # reused, not re-allocated
    vmm_core.wake_up("w", keep_host_buffers=False)
    assert w._host.copy is None and w.host_bytes == 0
    assert ctypes.string_at(p, 4) == b"keep"


def test_concurrent_sleep_and_wake_from_threads_are_serialized():
    with vmm_core.region("t", backend="host") as t:
        p = t.allocate(4 << 20)
    _fill(p, b"threads")
    errors = []

    def flip():
        try:
            for _ in range(5):
                vmm_core.sleep("t", offload="t")
                vmm_core.wake_up("t")
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=flip) for _ in range(3)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    vmm_core.wake_up("t")
    assert not errors and ctypes.string_at(p, 7) == b"threads"


def test_emulated_platforms_do_not_leak_into_auto_detection():
    """After an emulated driver is released, nothing of it is left for auto-detection."""
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import emulated

    for platform in ("ascend", "mlu"):
        assert emulated.backend_for(platform).available
        emulated.release(platform)
    assert "VMM_CORE_ASCEND_LIB" not in os.environ and "VMM_CORE_MLU_LIB" not in os.environ
    usable = vmm_core.available_backends()
    assert "ascend" not in usable and "mlu" not in usable
    if usable == ["host"]:
        assert vmm_core.get_backend().name == "host"


def test_a_dropped_allocator_is_closed_without_waiting_for_a_garbage_collection(host):
    """The allocator's sleep/wake and host-copy pieces keep no reference back to it: with
    one, every allocator sat in a reference cycle, and a dropped one kept its pages and
    its host copy until the next garbage collection instead of going to the reaper at
    once."""
    import gc
    import weakref

    from vmm_core.memory import reaper

    gc.collect()
    gc.disable()  # only reference counting may free it here
    try:
        events: list[str] = []

        def told(event, **kw):
            events.append(event)

        alloc = vmm_core.SharedVMMAllocator(host, growth_bytes=1 << 20)
        alloc.allocate(1 << 20)
        alloc.add_sleep_listener(told)
        alloc.sleep(offload=True)
        alloc.wake(keep_host_buffers=True)
        assert events == ["sleep", "wake"]
        with alloc.hold_awake():
            pass
        handles, kept = [p.handle for p in alloc._physical], alloc._host
        assert host.plugin.physical_bytes(handles) == 1 << 20 and alloc.host_bytes == 1 << 20
        dropped = weakref.ref(alloc)
        del alloc
        assert reaper.drain(10)
        assert dropped() is None or dropped().closed, "the dropped allocator was not closed"
        assert host.plugin.physical_bytes(handles) == 0, "its pages were not given back"
        assert kept.copy is None and kept.held_bytes == 0, "its host copy was not given back"
    finally:
        gc.enable()
