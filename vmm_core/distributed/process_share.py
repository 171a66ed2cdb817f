"""What one rank created for one mapped object, and how it lets all of it go alone.

A setup step that fails, a ``close()`` and the finalizer of an object dropped without
``close()`` all free this process's share the same way, without talking to the other
ranks: mappings, reservations, own and imported handles, descriptors, host mappings and
registrations, and the distributed kind's own allocator.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from ..backend import Backend

__all__ = ["ProcessShare"]


@dataclass(eq=False)
class ProcessShare:
    """Everything one rank created for one mapped object.  ``release`` frees it all
    without talking to other ranks (the finalizer calls it), and is idempotent."""

    backend: Backend
    device: int
    maps: list = field(default_factory=list)      # (address, size) device mappings
    ranges: list = field(default_factory=list)    # (address, size) reservations
    handles: list = field(default_factory=list)   # own and imported handles
    fds: list = field(default_factory=list)       # descriptors not yet closed
    host_maps: list = field(default_factory=list)  # mmap.mmap objects
    registered: list = field(default_factory=list)  # host addresses given to host_register
    allocators: list = field(default_factory=list)  # the distributed kind's own part
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> list[str]:
        """Free everything; returns what could not be freed (never raises)."""
        problems: list[str] = []
        with self.lock:
            be, dev = self.backend, self.device

            def attempt(what, fn, *args):
                try:
                    fn(*args)
                except Exception as exc:  # keep freeing the rest
                    problems.append(f"{what}: {exc}")

            if self.maps or self.registered:
                attempt("synchronize", be.synchronize, dev)
            for address in self.registered:
                attempt("host_unregister", be.host_unregister, dev, address)
            for address, size in self.maps:
                attempt("unmap", be.unmap, dev, address, size)
            for address, size in self.ranges:
                attempt("release_range", be.release_range, dev, address, size)
            for handle in self.handles:
                attempt("release_handle", be.release_handle, dev, handle)
            for mm in self.host_maps:
                attempt("munmap", mm.close)
            for fd in self.fds:
                attempt("close", os.close, fd)
            for alloc in self.allocators:
                if alloc.tag:
                    attempt("untag", _tagged().unregister, alloc.tag, alloc)
                attempt("close allocator", alloc.close)
            self.allocators = []
            self.maps, self.ranges, self.handles = [], [], []
            self.host_maps, self.registered, self.fds = [], [], []
        return problems

    def untag(self) -> None:
        """Take the distributed kind's part out of its tag now, even if views delay its
        release: a later ``vmm_core.sleep`` must not unmap memory under a stale view."""
        for alloc in self.allocators:
            if alloc.tag:
                _tagged().unregister(alloc.tag, alloc)

    def close_fd(self, fd: int) -> None:
        os.close(fd)
        self.fds.remove(fd)



def _tagged():
    from ..memory import tagged

    return tagged
