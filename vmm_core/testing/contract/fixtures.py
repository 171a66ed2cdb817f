"""The fixtures every part of the contract suite takes, and the byte pattern it writes.

A vendor's test module provides ``vmm_backend`` (and may override ``vmm_device``).
"""

from __future__ import annotations

import pytest

from ...memory.allocator import SharedVMMAllocator

__all__ = ["vmm_device", "granularity", "alloc", "pattern"]


@pytest.fixture
def vmm_device():
    return 0


@pytest.fixture
def granularity(vmm_backend, vmm_device):
    return vmm_backend.capabilities(vmm_device).granularity


@pytest.fixture
def alloc(vmm_backend, vmm_device, granularity):
    a = SharedVMMAllocator(vmm_backend, device=vmm_device, reserve_bytes=64 * granularity)
    yield a
    a.close()


def pattern(n: int, seed: int) -> bytes:
    """Bytes that differ from page to page, so a wrong mapping offset is caught."""
    block = bytes(((i * 131) ^ seed) & 0xFF for i in range(4096))
    return b"".join(i.to_bytes(8, "little") + block[8:] for i in range(n // 4096 + 1))[:n]
