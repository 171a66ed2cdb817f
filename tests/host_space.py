"""What a device framework does inside a capture space, done by hand on the host backend
(where the CPU allocator cannot be redirected): allocate through the shim's route, and
read and write the bytes at an address."""

from __future__ import annotations

import ctypes

from vmm_core.memory import routing


def framework_alloc(nbytes: int) -> int:
    """What a device framework's allocation inside a capture does: ask the shim route."""
    target = routing.current_target(0)
    assert target is not None, "allocation outside a capture space"
    return target.allocate(nbytes)


def write(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


def read(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


class LazyCounter:
    """A library's persistent counter, made lazily and zero-initialised on its first call,
    then read and incremented by every call (and so by every replay of a capture that
    made it): it lives in the capture's pool, as such libraries' state does."""

    def __init__(self) -> None:
        self.address: int | None = None

    def step(self) -> int:
        if self.address is None:
            self.address = framework_alloc(8)
            ctypes.memset(self.address, 0, 8)
        value = ctypes.c_int64.from_address(self.address)
        value.value += 1
        return value.value
