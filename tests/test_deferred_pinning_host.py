"""Deferred pinning (kept host copies registered once a sleep or wake is done,
offload.deferred_pinning) where a registration must not start: inside a capture space,
and the thread mode of the CUDA hooks that register, host backend.

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
    """GraphPool.space waits for registrations in flight and then holds the lock of tagged
    memory, on the claim that a registration starts only under that lock. A
    SharedVMMAllocator.sleep (or a wake keeping a copy against its tag's policy) called
    directly holds to that claim too: its deferred registration does not start on another
    thread while the space is open."""
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


# ------------------------------------------------------------------ the CUDA hooks' thread mode
class _Driver:
    """Just enough of ``cuda.bindings.driver`` for the host register/unregister hooks,
    with a per-thread stream capture mode as the driver keeps it.  No GPU: what this
    checks is the hooks' own bookkeeping (the mode each call runs in, and the one left
    behind on every path), not what the driver does in that mode."""

    import enum as _enum

    class CUresult(_enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_INVALID_HANDLE = 400
        CUDA_ERROR_NOT_MAPPED = 211
        CUDA_ERROR_NOT_SUPPORTED = 801
        CUDA_ERROR_INVALID_ADDRESS_SPACE = 717
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900

    class CUstreamCaptureMode(_enum.IntEnum):
        CU_STREAM_CAPTURE_MODE_GLOBAL = 0
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
        CU_STREAM_CAPTURE_MODE_RELAXED = 2

    CU_MEMHOSTREGISTER_PORTABLE = 1
    CU_MEMHOSTREGISTER_DEVICEMAP = 2

    def __init__(self) -> None:
        self.local = threading.local()
        self.calls: list = []  # (driver call, the calling thread's mode then)
        self.fail: dict = {}  # driver call -> CUresult it returns instead

    def mode(self):
        return getattr(self.local, "mode", self.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)

    def _call(self, name: str):
        self.calls.append((name, self.mode()))
        return self.fail.get(name, self.CUresult.CUDA_SUCCESS)

    def cuGetErrorName(self, err):
        return self.CUresult.CUDA_SUCCESS, self.CUresult(err).name.encode()

    def cuThreadExchangeStreamCaptureMode(self, mode):
        assert isinstance(mode, self.CUstreamCaptureMode), mode
        err = self._call("cuThreadExchangeStreamCaptureMode")
        if err:
            return err, self.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
        previous, self.local.mode = self.mode(), mode
        return err, previous

    def cuCtxGetCurrent(self):
        return self.CUresult.CUDA_SUCCESS, 7

    def cuMemHostRegister(self, address, size, flags):
        return (self._call("cuMemHostRegister"),)

    def cuMemHostGetDevicePointer(self, address, flags):
        return self._call("cuMemHostGetDevicePointer"), address

    def cuMemHostUnregister(self, address):
        return (self._call("cuMemHostUnregister"),)


def _cuda_with(driver):
    from vmm_backends.cuda.vmm_api import CudaBackend

    backend = CudaBackend()
    backend._driver, backend._contexts[0] = driver, 7  # the primary context: current
    return backend


@pytest.mark.parametrize("failing", [None, "cuMemHostRegister", "cuMemHostGetDevicePointer"])
@pytest.mark.parametrize("start", ["CU_STREAM_CAPTURE_MODE_GLOBAL",
                                   "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL"])
def test_cuda_host_register_runs_relaxed_and_gives_the_thread_its_own_mode_back(start,
                                                                               failing):
    from vmm_core.errors import VMMError

    drv = _Driver()
    drv.local.mode = drv.CUstreamCaptureMode[start]
    backend = _cuda_with(drv)
    if failing:
        drv.fail[failing] = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        with pytest.raises(VMMError, match=failing):
            backend.vmm_host_register(0, 1 << 21, 1 << 21)
    else:
        assert backend.vmm_host_register(0, 1 << 21, 1 << 21) == 1 << 21
    relaxed = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    made = [(n, m) for n, m in drv.calls if n != "cuThreadExchangeStreamCaptureMode"]
    assert made and all(m == relaxed for _, m in made), drv.calls
    if failing == "cuMemHostGetDevicePointer":  # registered, then undone, still relaxed
        assert made[-1][0] == "cuMemHostUnregister"
    assert drv.mode() == drv.CUstreamCaptureMode[start]  # the one it had, not GLOBAL


@pytest.mark.parametrize("failing", [None, "cuMemHostUnregister",
                                     "cuThreadExchangeStreamCaptureMode"])
def test_cuda_host_unregister_runs_relaxed_and_gives_the_thread_its_own_mode_back(failing):
    from vmm_core.errors import VMMError

    drv = _Driver()
    drv.local.mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    backend = _cuda_with(drv)
    if failing:
        drv.fail[failing] = drv.CUresult.CUDA_ERROR_INVALID_VALUE
        with pytest.raises(VMMError, match=failing):
            backend.vmm_host_unregister(0, 1 << 21)
    else:
        backend.vmm_host_unregister(0, 1 << 21)
    made = [(n, m) for n, m in drv.calls if n != "cuThreadExchangeStreamCaptureMode"]
    if failing != "cuThreadExchangeStreamCaptureMode":
        assert made == [("cuMemHostUnregister",
                         drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)]
    assert drv.mode() == drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
