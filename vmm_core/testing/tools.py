"""Helpers for tests that must see device bytes and hook calls on any backend."""

from __future__ import annotations

import contextlib
import ctypes
from collections import Counter

from ..backend import Backend
from ..errors import OutOfMemoryError

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
    creations succeed and then raises OutOfMemoryError, like a device that runs out.
    """

    def __init__(self, backend: Backend) -> None:
        self._real = backend
        self.fail_create_after: int | None = None
        self.fail_map_after: int | None = None
        self.fail_map_calls: set[int] = set()  # 1-based numbers of the map calls that fail
        self.map_calls = 0
        self.live_handles = 0

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
