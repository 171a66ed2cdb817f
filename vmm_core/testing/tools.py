"""Helpers for tests that must see device bytes and hook calls on any backend."""

from __future__ import annotations

import contextlib
import ctypes
from collections import Counter

from ..backend import Backend
from ..errors import BackendError, OutOfMemoryError

__all__ = ["read_bytes", "write_bytes", "HookCounter", "FaultInjector"]


def write_bytes(backend: Backend, device: int, address: int, data: bytes) -> None:
    """Write ``data`` at a device address through the backend's copy hook."""
    buf = ctypes.create_string_buffer(data, len(data))
    backend.copy_from_host(device, ctypes.addressof(buf), address, len(data))


def read_bytes(backend: Backend, device: int, address: int, size: int) -> bytes:
    """Read ``size`` bytes at a device address through the backend's copy hook."""
    buf = ctypes.create_string_buffer(size)
    backend.copy_to_host(device, address, ctypes.addressof(buf), size)
    return buf.raw


class HookCounter(contextlib.AbstractContextManager):
    """Counts calls of each vmm_api hook made through one Backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.calls: Counter = Counter()

    def __enter__(self):
        real = self.backend.call

        def counting(hook, **kwargs):
            self.calls[hook] += 1
            return real(hook, **kwargs)

        self.backend.call = counting
        return self

    def __exit__(self, *exc):
        del self.backend.call  # back to the class method
        return None


class FaultInjector:
    """A Backend stand-in that fails chosen primitives, to test rollback paths.

    Delegates everything to a real backend; ``fail_create_after=n`` lets n handle
    creations succeed and then raises OutOfMemoryError, like a device that runs out;
    ``fail_copy_after=n`` does the same to host<->device copies (BackendError), queued
    ones included, so a copy can fail in the middle of an offload pipeline.
    """

    def __init__(self, backend: Backend) -> None:
        self._real = backend
        self.fail_create_after: int | None = None
        self.fail_map_after: int | None = None
        self.fail_map_calls: set[int] = set()  # 1-based numbers of the map calls that fail
        self.map_calls = 0
        self.live_handles = 0
        #: let n copies succeed (copy hooks and copy-queue copies alike), then fail
        self.fail_copy_after: int | None = None
        self.copy_calls = 0
        self.fail_memset = False

    def __getattr__(self, name):
        return getattr(self._real, name)

    def create_handle(self, device, size):
        if self.fail_create_after is not None:
            if self.fail_create_after <= 0:
                raise OutOfMemoryError(f"injected: out of memory creating {size} bytes")
            self.fail_create_after -= 1
        handle = self._real.create_handle(device, size)
        self.live_handles += 1
        return handle

    def release_handle(self, device, handle):
        self._real.release_handle(device, handle)
        self.live_handles -= 1

    def map(self, device, address, size, handle, offset=0):
        self.map_calls += 1
        if self.map_calls in self.fail_map_calls:
            from ..errors import MappingError

            raise MappingError(f"injected: map call {self.map_calls} failed")
        if self.fail_map_after is not None:
            if self.fail_map_after <= 0:
                from ..errors import MappingError

                raise MappingError("injected: map failed")
            self.fail_map_after -= 1
        self._real.map(device, address, size, handle, offset)

    # -- copies ---------------------------------------------------------------
    def _copy_allowed(self) -> None:
        self.copy_calls += 1
        if self.fail_copy_after is not None:
            if self.fail_copy_after <= 0:
                raise BackendError(f"injected: copy {self.copy_calls} failed")
            self.fail_copy_after -= 1

    def copy_to_host(self, device, address, host_address, size):
        self._copy_allowed()
        self._real.copy_to_host(device, address, host_address, size)

    def copy_from_host(self, device, host_address, address, size):
        self._copy_allowed()
        self._real.copy_from_host(device, host_address, address, size)

    def copy_queue(self, device):
        queue = self._real.copy_queue(device)
        return None if queue is None else _FailingQueue(queue, self)

    def memset(self, device, address, value, size):
        if self.fail_memset:
            raise BackendError("injected: memset failed")
        self._real.memset(device, address, value, size)


class _FailingQueue:
    """A backend's copy queue whose copies count against a FaultInjector."""

    def __init__(self, queue, injector: FaultInjector) -> None:
        self._queue, self._injector = queue, injector
        self.closed = False

    def to_host(self, address, host_address, size):
        self._injector._copy_allowed()
        self._queue.to_host(address, host_address, size)

    def from_host(self, host_address, address, size):
        self._injector._copy_allowed()
        self._queue.from_host(host_address, address, size)

    def record(self):
        return self._queue.record()

    def wait(self, marker):
        self._queue.wait(marker)

    def synchronize(self):
        self._queue.synchronize()

    def close(self):
        self.closed = True
        self._queue.close()
