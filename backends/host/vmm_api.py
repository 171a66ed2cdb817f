"""The embedded ``host`` backend: real virtual memory management on Linux.

A physical handle is a ``memfd_create`` file, a reservation is an ``mmap(PROT_NONE)``,
mapping is ``mmap(MAP_FIXED | MAP_SHARED)`` of the file and unmapping puts the range back
to ``PROT_NONE`` while keeping it reserved.  Two virtual ranges mapping one memfd really
alias, so CI exercises the same semantics the device backends have.  It enforces the
strictest vendor contract we support (aligned addresses, mappings inside a reservation,
no double mapping, no release of a mapped handle) so allocator bugs surface here first.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
import threading
from dataclasses import dataclass

from vmm_core.errors import MappingError, OutOfMemoryError
from vmm_core.plugin import (
    MAX_BYTES,
    BackendCapabilities,
    CopyQueue,
    Probe,
    at_fork,
    hookimpl,
    raw_tensor,
)

from .libc_bindings import (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_RW,
)
from .libc_bindings import libc as _libc

__all__ = ["HostBackend", "HostHandle", "HostCopyQueue", "backend"]


@dataclass(eq=False)
class HostHandle:
    """A memfd holding ``size`` bytes of physical (page-cache) memory."""

    fd: int
    size: int
    mapped: int = 0  # number of live mappings


class HostBackend:
    """vmm_api on memfd + mmap.  One "device" (index 0): the host."""

    name = "host"

    def __init__(self) -> None:
        self._lib = None
        self._lock = threading.Lock()
        self._ranges: dict[int, int] = {}  # reservation start -> size
        self._maps: dict[int, tuple[int, HostHandle]] = {}  # mapping start -> (size, handle)
        # sorted starts of both: checks bisect instead of scanning every range and mapping
        # (a scan made a new capture space cost 1 ms at 8000 spaces, 0.09 ms at first)
        self._range_starts: list[int] = []
        self._map_starts: list[int] = []
        self.granularity = mmap.PAGESIZE

    def _libc(self):  # a method: pluggy reads every attribute when registering
        if self._lib is None:
            self._lib = _libc()
        return self._lib

    # -- detection -----------------------------------------------------------
    @hookimpl
    def vmm_probe(self):
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            return Probe(False, "needs Linux memfd_create (os.memfd_create)", priority=0)
        return Probe(True, "memfd_create + mmap on Linux (always usable; no accelerator)",
                     device_count=1, priority=0,
                     versions={"kernel": os.uname().release})

    @hookimpl
    def vmm_capabilities(self, device):
        self._check_device(device)
        return BackendCapabilities(
            granularity=self.granularity,
            partial_map=True,
            needs_set_access=True,
            set_access_spans_mappings=True,
            graph_pool=True,
            default_reserve_bytes=1 << 34,
            notes="graphs are not captured on the host: replay re-runs the function eagerly",
            shareable_handles="fd",  # a handle is a memfd: another process maps the same pages
        )

    # -- ranges ----------------------------------------------------------------
    @hookimpl
    def vmm_reserve(self, device, size, alignment):
        self._check_device(device)
        self._check_size("vmm_reserve", size)
        alignment = max(int(alignment or 0), self.granularity)
        if alignment > MAX_BYTES:
            raise MappingError(f"vmm_reserve: alignment {alignment} exceeds {MAX_BYTES}")
        if alignment % self.granularity:
            raise MappingError(f"vmm_reserve: alignment {alignment} is not a multiple of the "
                               f"page size {self.granularity}")
        total = size + alignment
        base = self._libc().mmap(None, total, PROT_NONE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, MAP_FAILED):
            raise OutOfMemoryError(f"mmap(PROT_NONE, {total}) failed: "
                                   f"{os.strerror(ctypes.get_errno())}; reserve less")
        start = (base + alignment - 1) // alignment * alignment
        if start > base:
            self._libc().munmap(base, start - base)
        tail = base + total - (start + size)
        if tail:
            self._libc().munmap(start + size, tail)
        with self._lock:
            self._ranges[start] = size
            bisect.insort(self._range_starts, start)
        return start

    @hookimpl
    def vmm_release_range(self, device, address, size):
        with self._lock:
            if self._ranges.get(address) != size:
                raise MappingError(f"vmm_release_range: {address:#x} (+{size}) was not "
                                   f"returned by vmm_reserve")
            inside = self._starts_in(self._map_starts, address, address + size)
            if inside:
                raise MappingError(f"vmm_release_range: {len(inside)} mapping(s) still live in "
                                   f"{address:#x}; unmap them first")
            del self._ranges[address]
            self._remove(self._range_starts, address)
        if self._libc().munmap(address, size) != 0:
            raise MappingError(f"munmap({address:#x}, {size}) failed: "
                               f"{os.strerror(ctypes.get_errno())}")

    # -- handles ----------------------------------------------------------------
    @hookimpl
    def vmm_create_handle(self, device, size):
        self._check_device(device)
        self._check_size("vmm_create_handle", size)
        fd = os.memfd_create("vmm_core", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            raise OutOfMemoryError(f"memfd ftruncate({size}) failed: {exc}") from exc
        return HostHandle(fd, size)

    @hookimpl
    def vmm_release_handle(self, device, handle):
        if not isinstance(handle, HostHandle) or handle.fd < 0:
            raise MappingError(f"vmm_release_handle: {handle!r} is not a live host handle")
        if handle.mapped:
            raise MappingError(f"vmm_release_handle: handle still has {handle.mapped} "
                               f"mapping(s); unmap it everywhere first")
        os.close(handle.fd)
        handle.fd = -1

    # -- mapping ------------------------------------------------------------------
    @hookimpl
    def vmm_map(self, device, address, size, handle, offset):
        self._check_size("vmm_map", size)
        if address % self.granularity or offset % self.granularity:
            raise MappingError(f"vmm_map: address {address:#x} / offset {offset} is not "
                               f"aligned to the granularity {self.granularity}")
        if not isinstance(handle, HostHandle) or handle.fd < 0:
            raise MappingError(f"vmm_map: {handle!r} is not a live host handle")
        if offset < 0 or offset + size > handle.size:
            raise MappingError(f"vmm_map: offset {offset} + size {size} exceeds the handle "
                               f"size {handle.size}")
        with self._lock:
            if not self._inside_reservation(address, size):
                raise MappingError(f"vmm_map: [{address:#x}, +{size}) is not inside a range "
                                   f"returned by vmm_reserve")
            # mappings never overlap, so the last one starting before the end is the only
            # one that can reach into the range
            i = bisect.bisect_left(self._map_starts, address + size) - 1
            if i >= 0:
                start = self._map_starts[i]
                if address < start + self._maps[start][0]:
                    raise MappingError(f"vmm_map: [{address:#x}, +{size}) overlaps the mapping "
                                       f"at {start:#x}; unmap it first")
            got = self._libc().mmap(address, size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                                handle.fd, offset)
            if got != address:
                raise MappingError(f"mmap(MAP_FIXED) at {address:#x} failed: "
                                   f"{os.strerror(ctypes.get_errno())}")
            self._maps[address] = (size, handle)
            bisect.insort(self._map_starts, address)
            handle.mapped += 1

    @hookimpl
    def vmm_set_access(self, device, address, size):
        with self._lock:
            covered = sum(self._maps[a][0]
                          for a in self._starts_in(self._map_starts, address, address + size)
                          if a + self._maps[a][0] <= address + size)
        if covered != size:
            raise MappingError(f"vmm_set_access: [{address:#x}, +{size}) is not fully mapped")
        if self._libc().mprotect(address, size, PROT_RW) != 0:
            raise MappingError(f"mprotect({address:#x}, {size}) failed: "
                               f"{os.strerror(ctypes.get_errno())}")

    @hookimpl
    def vmm_unmap(self, device, address, size):
        with self._lock:
            entry = self._maps.get(address)
            if entry is None or entry[0] != size:
                raise MappingError(f"vmm_unmap: no mapping of {size} bytes starts at "
                                   f"{address:#x}")
            got = self._libc().mmap(address, size, PROT_NONE,
                                MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                                -1, 0)
            if got != address:
                raise MappingError(f"mmap(PROT_NONE) over {address:#x} failed: "
                                   f"{os.strerror(ctypes.get_errno())}")
            del self._maps[address]
            self._remove(self._map_starts, address)
            entry[1].mapped -= 1

    # -- data movement ----------------------------------------------------------------
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
    def vmm_copy_device(self, device, src_address, dst_address, size):
        ctypes.memmove(dst_address, src_address, size)

    # -- queued copies and fills ----------------------------------------------------
    @hookimpl
    def vmm_copy_queue(self, device):
        self._check_device(device)
        return HostCopyQueue()

    @hookimpl
    def vmm_memset(self, device, address, value, size):
        ctypes.memset(address, value, size)

    @hookimpl
    def vmm_graph_ops(self, device):
        from .graph_ops import HostGraphOps

        return HostGraphOps(device)

    @hookimpl
    def vmm_allocator_adapter(self, device):
        from .allocator_adapter import HostAllocatorAdapter

        return HostAllocatorAdapter()

    # -- sharing between processes -------------------------------------------------------
    @hookimpl
    def vmm_create_shareable_handle(self, device, size):
        return self.vmm_create_handle(device, size)  # every memfd can be passed on

    @hookimpl
    def vmm_export_handle(self, device, handle, importers):
        if not isinstance(handle, HostHandle) or handle.fd < 0:
            raise MappingError(f"vmm_export_handle: {handle!r} is not a live host handle")
        return os.dup(handle.fd)

    @hookimpl
    def vmm_import_handle(self, device, shareable, size):
        self._check_device(device)
        self._check_size("vmm_import_handle", size)
        try:
            held = os.fstat(shareable).st_size
        except (OSError, TypeError) as exc:
            raise MappingError(f"vmm_import_handle: {shareable!r} is not an open file "
                               f"descriptor of this process: {exc}") from exc
        if held < size:
            raise MappingError(f"vmm_import_handle: the memfd holds {held} bytes, fewer than "
                               f"the {size} announced by its exporter")
        return HostHandle(os.dup(shareable), size)

    @hookimpl
    def vmm_set_access_for(self, device, address, size, devices):
        for d in devices:
            self._check_device(d)
        self.vmm_set_access(device, address, size)

    @hookimpl
    def vmm_host_register(self, device, address, size):
        self._check_device(device)
        # a no-op by design: the device is the host, so its memory needs no pinning and
        # its address is the device address (offload still "registers" kept copies here,
        # which is how CI runs the pinned path)
        return address

    @hookimpl
    def vmm_host_unregister(self, device, address):
        return None

    @hookimpl
    def vmm_torch_tensor(self, device, address, nbytes):
        return raw_tensor(address, nbytes, "cpu")

    @hookimpl
    def vmm_mem_get_info(self, device):
        """The host's memory is this backend's device memory: MemAvailable, MemTotal."""
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    fields[name] = int(rest.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]

    # -- helpers --------------------------------------------------------------------
    def _inside_reservation(self, address: int, size: int) -> bool:
        i = bisect.bisect_right(self._range_starts, address) - 1
        if i < 0:
            return False
        start = self._range_starts[i]  # reservations never overlap: only this one can
        return address + size <= start + self._ranges[start]

    @staticmethod
    def _starts_in(starts: list[int], lo: int, hi: int) -> list[int]:
        return starts[bisect.bisect_left(starts, lo):bisect.bisect_left(starts, hi)]

    @staticmethod
    def _remove(starts: list[int], value: int) -> None:
        del starts[bisect.bisect_left(starts, value)]

    def _check_device(self, device) -> None:
        if device not in (0, None):
            raise MappingError(f"host backend has one device (0), got device={device!r}")

    def _check_size(self, call: str, size) -> None:
        """Checked before any system call: ctypes passes sizes as ``size_t`` and would
        wrap one past it silently."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0 \
                or size % self.granularity:
            raise MappingError(f"{call}: size {size!r} must be a positive multiple of the "
                               f"granularity {self.granularity}")
        if size > MAX_BYTES:
            raise MappingError(f"{call}: size {size} exceeds the largest size this platform "
                               f"can map ({MAX_BYTES}); ask for less")

    def physical_bytes(self, handles) -> int:
        """Bytes held by ``handles`` as the kernel reports them (fstat of each memfd)."""
        return sum(os.fstat(h.fd).st_size for h in handles if h.fd >= 0)


class HostCopyQueue(CopyQueue):
    """Copies that complete inside the call (no copy engine on the host): correct for
    the staging pipeline, which CI runs through it, though not faster than memmove."""

    def __init__(self) -> None:
        self.closed = False

    def to_host(self, address, host_address, size):
        self._check_open()
        ctypes.memmove(host_address, address, size)

    def from_host(self, host_address, address, size):
        self._check_open()
        ctypes.memmove(address, host_address, size)

    def record(self):
        self._check_open()
        return None

    def wait(self, marker):
        return None

    def synchronize(self):
        return None

    def close(self):
        self.closed = True

    def _check_open(self):
        if self.closed:
            raise MappingError("host copy queue used after close()")


#: the plugin object registered under the entry point ``host``
backend = HostBackend()


def _fresh_lock_after_fork() -> None:
    """Another thread (the reaper closing a dropped allocator) may have held the lock at
    the fork; the child does not have that thread, so it would never be released there.
    Each call takes the lock only around its own bookkeeping, so a fresh one is safe."""
    backend._lock = threading.Lock()


at_fork("backends", after_in_child=_fresh_lock_after_fork)
