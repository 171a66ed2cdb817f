"""Regressions from the adversarial review of the issue-16 fixes (locks, fork, sizes),
host backend.  A hang runs in a forked child with a timeout so it cannot stall pytest."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import vmm_core
from vmm_core.errors import AllocationError

PAGE = 4096
pytestmark = pytest.mark.usefixtures("clean_tags")


@pytest.fixture
def host():
    return vmm_core.get_backend("host")


# ------------------------------------------------------------------ sizes
def test_numpy_integer_sizes_are_taken_as_sizes(host):
    """Sizes computed with numpy (np.prod(shape) * itemsize) are np.int64: they were
    refused with "must be a positive int, got np.int64(...)", while device=np.int64(0)
    was accepted."""
    n = np.prod([4, 1024]).astype(np.int64)
    alloc = vmm_core.SharedVMMAllocator(host, device=np.int64(0), reserve_bytes=n * 16)
    assert alloc.reserve_bytes == 16 * 4096 and type(alloc.reserve_bytes) is int
    address = alloc.allocate(n)
    ctypes.memset(address, 7, int(n))
    alloc.extend_mapping(np.int32(2 * PAGE))
    assert alloc.physical_bytes >= 2 * PAGE
    pool = vmm_core.GraphPool(backend=host, reserve_bytes=np.uint64(1 << 20))
    assert pool.allocator.reserve_bytes == 1 << 20
    pool.close()
    alloc.close()


@pytest.mark.parametrize("call", ["allocate", "extend_mapping", "reserve_bytes"])
def test_bool_sizes_are_refused(host, call):
    """extend_mapping(True) was accepted as one byte."""
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=1 << 20)
    with pytest.raises(AllocationError, match="True"):
        if call == "reserve_bytes":
            vmm_core.SharedVMMAllocator(host, reserve_bytes=True)
        else:
            getattr(alloc, call)(True)
    alloc.close()
