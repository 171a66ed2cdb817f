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
