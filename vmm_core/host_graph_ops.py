"""Graph ops and allocator adapter of the host backend.

There is no graph API on the CPU, so a "graph" remembers its function and replay calls
it eagerly.  What the host does have is real VMM: a "pool" is the current virtual space
of the capture's SharedVMMAllocator, and its live blocks are the allocations made there
and not freed.  That lets CI run the executor's whole policy (buckets, padding,
persistent buffers, space switching, escape guard) for real.
"""

from __future__ import annotations

import contextlib
import threading

from . import routing
from .adapter import AllocatorAdapter
from .errors import CaptureError
from .graph_ops import GraphOps

__all__ = ["HostGraphOps", "HostAllocatorAdapter", "HostGraph", "HostPool", "current_stream"]

_tls = threading.local()


def current_stream():
    """The host "stream" work runs on: None by default, the ops' own during warm-up and
    capture.  Libraries that cache per stream (as cuBLAS does) can key on it."""
    return getattr(_tls, "stream", None)


@contextlib.contextmanager
def _on_stream(stream):
    previous = current_stream()
    _tls.stream = stream
    try:
        yield
    finally:
        _tls.stream = previous


class HostGraph:
    def __init__(self) -> None:
        self.fn = None

    def reset(self) -> None:
        self.fn = None


class HostPool:
    """The virtual space a capture allocates from, and the allocations made in it."""

    def __init__(self, allocator, space: int, baseline: set[int]) -> None:
        self.allocator = allocator
        self.space = space
        self.baseline = baseline


class HostGraphOps(GraphOps):
    device_type = "cpu"

    def synchronize(self) -> None:
        return None

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self.stream = object()

    def warmup(self, fn) -> None:
        with _on_stream(self.stream):
            fn()

    def new_graph(self):
        return HostGraph()

    def capture(self, graph, fn, pool_handle):
        graph.fn = fn
        with _on_stream(self.stream):
            return fn()

    def replay(self, graph) -> None:
        if graph.fn is None:
            raise CaptureError("replay of a graph that was reset or never captured")
        graph.fn()

    def shared_pool_handle(self):
        return object()


class HostAllocatorAdapter(AllocatorAdapter):
    def new_pool(self):
        allocator = routing.current_target(0)
        if allocator is None:
            raise CaptureError("host pools are created inside routing.target(...)")
        space = allocator.current_space
        return HostPool(allocator, space, set(allocator.live_allocations(space)))

    def use_pool(self, pool):
        return contextlib.nullcontext()

    def pool_handle(self, pool):
        return pool

    def live_blocks(self, pool) -> list[int]:
        live = pool.allocator.live_allocations(pool.space)
        return [size for addr, size in live.items() if addr not in pool.baseline]

    def shim_counters(self) -> dict[str, int]:
        return {}
