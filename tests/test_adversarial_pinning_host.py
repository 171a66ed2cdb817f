"""Regressions from the adversarial review of deferred pinning (kept host copies
registered once a sleep or wake is done, offload.deferred_pinning), host backend.

The host backend's registration is a no-op, so a spy records when it runs; a capture
space (GraphPool.space) stands for a device capture in global mode, which a backend
without a relaxed thread mode would see broken by a registration on another thread."""

from __future__ import annotations

import ctypes
import threading

import pytest

import vmm_core
from vmm_core.memory import offload, tagged
from vmm_core.testing import FaultInjector

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


class _RegisterWatch(FaultInjector):
    """Notes, at each registration, whether a capture space was open then."""

    def __init__(self, backend, space_open: threading.Event) -> None:
        super().__init__(backend)
        self.space_open = space_open
        self.during_space: list[bool] = []

    def host_register(self, device, address, size):
        self.during_space.append(self.space_open.is_set())
        return self._real.host_register(device, address, size)


def _kept(host, tag: str, space_open: threading.Event):
    alloc = vmm_core.SharedVMMAllocator(host, tag=tag, growth_bytes=MIB)
    tagged.register(tag, alloc)
    watch = _RegisterWatch(alloc.backend, space_open)
    alloc.backend = watch
    p = alloc.allocate(2 * MIB)
    ctypes.memset(p, 0x5A, 2 * MIB)
    return alloc, watch, p


@pytest.mark.parametrize("how", ["sleep", "wake"])
def test_a_direct_allocator_sleep_or_wake_starts_no_registration_inside_a_capture_space(
        host, how):
    """GraphPool.space waits for registrations in flight and then holds the lock of
    tagged memory, on the claim that a registration starts only under that lock.  A
    SharedVMMAllocator.sleep (or wake keeping a copy against its tag's policy) called
    directly took no such lock: its deferred registration started on another thread
    while the space was open."""
    space_open = threading.Event()
    alloc, watch, p = _kept(host, "w", space_open)
    pool = vmm_core.GraphPool(backend=host, reads=())
    errors: list = []
    if how == "wake":
        offload.set_keep_host_buffers("w", False)
        alloc.sleep(offload=True)  # the policy: not registered at sleep
        assert watch.during_space == []

    def direct():
        try:
            if how == "sleep":
                alloc.sleep(offload=True)
            else:
                alloc.wake(keep_host_buffers=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    worker = threading.Thread(target=direct, daemon=True)
    try:
        with pool.space(1):
            space_open.set()
            worker.start()
            worker.join(1.0)  # the sleep itself may finish; its registration must wait
            offload.wait_for_pinning(5)
            space_open.clear()
        worker.join(30)
        assert not worker.is_alive() and not errors, errors
        assert offload.wait_for_pinning(30)
        assert watch.during_space == [False], watch.during_space
        if how == "sleep":
            vmm_core.wake_up("w")
        assert alloc.pinned_host_bytes == alloc.host_bytes == 2 * MIB
        assert ctypes.string_at(p, 2 * MIB) == b"\x5a" * (2 * MIB)
    finally:
        offload.set_keep_host_buffers("w", None)
        pool.close()
        alloc.close()
