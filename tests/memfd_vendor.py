"""A third party's vmm_core backend, written as a vendor writes one: of vmm_core it imports
``vmm_core.plugin`` and ``vmm_core.errors`` alone (tests/test_plugins.py checks it with
the check the built-in backends pass).

Its device is this machine's memory, driven through the C library: a physical handle is
a memfd, known to core only as an int (an index into the backend's own table), a
reservation an ``mmap(PROT_NONE)``, a mapping ``mmap(MAP_FIXED | MAP_SHARED)`` of the
memfd, readable at once (so it declares ``needs_set_access=False``, unlike the host
backend).  It fills every role through the plugin's bases: an allocator adapter whose
pools are spaces of the allocator core routes to (its framework, the CPU allocator,
cannot be redirected), graph ops whose replay runs the captured function again, and a
copy queue whose copies complete inside the call.  tests/test_third_party_backend.py
installs it as a distribution and runs the contract suite and the benchmark on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

from vmm_core.errors import CaptureError, MappingError, OutOfMemoryError
from vmm_core.plugin import (
    AllocatorAdapter,
    BackendCapabilities,
    CopyQueue,
    GraphOps,
    Probe,
    hookimpl,
    routed_allocator,
)

PAGE = mmap.PAGESIZE
_RW, _NONE = 0x1 | 0x2, 0x0
_SHARED, _PRIVATE, _FIXED, _ANON, _NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000

_c = ctypes.CDLL(None, use_errno=True)
_c.mmap.restype = ctypes.c_void_p
_c.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_long]
_c.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(call: str, address, size: int, prot: int, flags: int, fd: int = -1,
          offset: int = 0) -> int:
    got = _c.mmap(address, size, prot, flags, fd, offset)
    if got in (None, ctypes.c_void_p(-1).value) or (address and got != address):
        raise MappingError(f"{call}: mmap failed: {os.strerror(ctypes.get_errno())}")
    return got


class MemfdBackend:
    """The hooks.  One device (0)."""

    def __init__(self) -> None:
        self._handles: dict[int, tuple[int, int]] = {}  # handle -> (memfd, size)
        self._next = 0
        self._lock = threading.Lock()

    def _size(self, call: str, size) -> int:
        if size <= 0 or size % PAGE:
            raise MappingError(f"{call}: size {size} must be a positive multiple of {PAGE}")
        return size

    @hookimpl
    def vmm_probe(self):
        return Probe(True, "memfd pages of this machine: 1 device", device_count=1,
                     priority=1, versions={"memfd_vendor": "1.0"})

    @hookimpl
    def vmm_capabilities(self, device):
        return BackendCapabilities(granularity=PAGE, needs_set_access=False,
                                   default_reserve_bytes=1 << 32, notes="handles are ints")

    @hookimpl
    def vmm_reserve(self, device, size, alignment):
        size, alignment = self._size("vmm_reserve", size), max(alignment, PAGE)
        base = _mmap("vmm_reserve", None, size + alignment, _NONE, _PRIVATE | _ANON | _NORESERVE)
        start = -(-base // alignment) * alignment
        for head, length in ((base, start - base), (start + size, base + alignment - start)):
            if length:
                _c.munmap(head, length)  # the slack around the aligned range
        return start

    @hookimpl
    def vmm_release_range(self, device, address, size):
        _c.munmap(address, size)

    @hookimpl
    def vmm_create_handle(self, device, size):
        fd = os.memfd_create("memfd_vendor", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self._size("vmm_create_handle", size))
        except OSError as exc:
            os.close(fd)
            raise OutOfMemoryError(f"ftruncate({size}) of a memfd failed: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._next += 1
            self._handles[self._next] = (fd, size)
            return self._next

    @hookimpl
    def vmm_release_handle(self, device, handle):
        os.close(self._handles.pop(handle)[0])

    @hookimpl
    def vmm_map(self, device, address, size, handle, offset):
        fd, whole = self._handles[handle]
        if address % PAGE or offset % PAGE or offset + size > whole:
            raise MappingError(f"vmm_map: {address:#x} +{size} at offset {offset} is not "
                               f"page-aligned inside the handle's {whole} bytes")
        _mmap("vmm_map", address, size, _RW, _SHARED | _FIXED, fd, offset)

    @hookimpl
    def vmm_set_access(self, device, address, size):
        return None  # mapped readable and writable

    @hookimpl
    def vmm_unmap(self, device, address, size):
        _mmap("vmm_unmap", address, size, _NONE, _PRIVATE | _ANON | _FIXED | _NORESERVE)

    @hookimpl
    def vmm_synchronize(self, device):
        return None

    @hookimpl
    def vmm_copy_to_host(self, device, address, host_address, size):
        ctypes.memmove(host_address, address, size)

    @hookimpl
    def vmm_copy_from_host(self, device, host_address, address, size):
        ctypes.memmove(address, host_address, size)

    @hookimpl
    def vmm_copy_queue(self, device):
        return MemmoveQueue()

    @hookimpl
    def vmm_allocator_adapter(self, device):
        return SpaceAdapter()

    @hookimpl
    def vmm_graph_ops(self, device):
        return RerunGraphOps(device)


class MemmoveQueue(CopyQueue):
    def __init__(self) -> None:
        self.closed = False

    def to_host(self, address, host_address, size):
        ctypes.memmove(host_address, address, size)

    def from_host(self, host_address, address, size):
        ctypes.memmove(address, host_address, size)

    def record(self):
        return None

    def wait(self, marker):
        return None

    def synchronize(self):
        return None

    def close(self):
        self.closed = True


class SpaceAdapter(AllocatorAdapter):
    """A pool is the routed allocator's current space; its blocks, what was allocated
    there after the pool was made and not freed."""

    def new_pool(self):
        allocator = routed_allocator(0)
        if allocator is None:
            raise CaptureError("memfd_vendor pools are made while vmm_core routes this thread")
        space = allocator.current_space
        return allocator, space, frozenset(allocator.live_allocations(space))

    def use_pool(self, pool):
        return contextlib.nullcontext()

    def pool_handle(self, pool):
        return pool

    def live_blocks(self, pool):
        allocator, space, before = pool
        return [(a, n) for a, n in allocator.live_allocations(space).items() if a not in before]

    def shim_counters(self):
        return {}


class RerunGraph:
    def __init__(self) -> None:
        self.fn = self.outputs = None

    def replay(self) -> None:
        fresh = self.fn()
        for static, new in zip(_flat(self.outputs), _flat(fresh)):
            static.copy_(new)

    def reset(self) -> None:
        self.fn = self.outputs = None


def _flat(outputs) -> list:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


class RerunGraphOps(GraphOps):
    """No graph API on a CPU: a graph remembers its function and outputs."""

    device_type = "cpu"

    def synchronize(self) -> None:
        return None

    def warmup(self, fn) -> None:
        fn()

    def new_graph(self, keep: bool = False):
        if keep:
            raise self.refuse_kept_graphs()
        return RerunGraph()

    def capture(self, graph, fn, pool_handle):
        graph.fn, graph.outputs = fn, fn()
        return graph.outputs

    def replay(self, graph) -> None:
        graph.replay()

    def shared_pool_handle(self):
        return object()


#: the plugin object an entry point names
backend = MemfdBackend()
