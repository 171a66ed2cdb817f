"""Allocator adapter of the host backend.

The framework's CPU allocator cannot be redirected, so a "pool" is the current virtual
space of the SharedVMMAllocator core routes this thread to (``routed_allocator``), and
its live blocks are the allocations made there and not freed.  Code that wants host VMM
memory allocates from the allocator directly (``region()`` yields it).
"""

from __future__ import annotations

import contextlib

from vmm_core.errors import CaptureError
from vmm_core.plugin import AllocatorAdapter, routed_allocator

__all__ = ["HostAllocatorAdapter", "HostPool"]


class HostPool:
    """The virtual space a capture allocates from, and the allocations made in it."""

    def __init__(self, allocator, space: int, baseline: set[int]) -> None:
        self.allocator = allocator
        self.space = space
        self.baseline = baseline


class HostAllocatorAdapter(AllocatorAdapter):
    def new_pool(self):
        allocator = routed_allocator(0)
        if allocator is None:
            raise CaptureError("a host pool is a space of the allocator this thread's "
                               "allocations are routed to, and none is: make host pools "
                               "through a GraphPool space or a vmm_core.region()")
        space = allocator.current_space
        return HostPool(allocator, space, set(allocator.live_allocations(space)))

    def use_pool(self, pool):
        return contextlib.nullcontext()

    def pool_handle(self, pool):
        return pool

    def live_blocks(self, pool) -> list[tuple[int, int]]:
        live = pool.allocator.live_allocations(pool.space)
        return [(addr, size) for addr, size in live.items() if addr not in pool.baseline]

    def shim_counters(self) -> dict[str, int]:
        return {}

    def route_process(self, path: str, alloc_symbol: str, free_symbol: str):
        """Nothing to redirect (the CPU allocator cannot be), as for regions: the
        process's tagged memory is what code asks the entry points for itself."""
        return _NoRouting()


class _NoRouting:
    def close(self) -> None:
        return None
