"""Address ranges given back only once the framework's allocator holds nothing in them.

A framework pool built on vmm_core memory (``torch.cuda.MemPool``) keeps every segment
it got until its own tensors and its cache let go, and it may outlive the allocator that
served it: a tensor or a library workspace still alive when a region's allocator or a
graph pool is closed.  Released at once, such a range could be reserved again by the
next allocator, and the framework would then hold two segments at one address: torch
aborted the process at exit on the H100 ("Trying to free a pointer not allocated here",
``CUDAPluggableAllocator::raw_delete``).  So a closing allocator unmaps its pages as
always (a stale tensor then faults instead of reading someone else's bytes) but keeps
the reservation of such a range, and the range goes back before a later reservation
once the framework no longer holds it.  Backends whose framework never holds vmm_core
memory report no segments (``AllocatorAdapter.held_segments``) and release at once.
"""

from __future__ import annotations

import os
import threading

from ..errors import VMMError

__all__ = ["give_back", "retry", "held_back"]

_held_back: list[tuple] = []  # (backend, device, base, size)
_lock = threading.Lock()


def _segments(backend, device: int) -> list[tuple[int, int]]:
    adapter = backend.allocator_adapter(device)
    return adapter.held_segments() if adapter is not None else []


def _overlaps(segments, base: int, size: int) -> bool:
    return any(addr < base + size and base < addr + length for addr, length in segments)


def give_back(backend, device: int, ranges) -> None:
    """Release each ``(base, size)`` range whose pages are unmapped, or hold it back
    while the framework's allocator still holds a segment inside it."""
    ranges = list(ranges)
    if not ranges:
        return
    segments = _segments(backend, device)
    for base, size in ranges:
        if _overlaps(segments, base, size):
            with _lock:
                _held_back.append((backend, device, base, size))
        else:
            backend.release_range(device, base, size)


def retry(backend, device: int) -> None:
    """Release the held-back ranges of ``backend``'s ``device`` the framework has let go
    (called before every reservation there; free when nothing is held back)."""
    with _lock:
        mine = [r for r in _held_back if r[0] is backend and r[1] == device]
    if not mine:
        return
    segments = _segments(backend, device)
    for entry in mine:
        _, _, base, size = entry
        if _overlaps(segments, base, size):
            continue
        try:
            backend.release_range(device, base, size)
        except VMMError:
            continue  # still reserved: tried again before the next reservation
        with _lock:
            _held_back.remove(entry)


def held_back(device: int | None = None) -> list[tuple[int, int]]:
    """``(base, size)`` of every range held back (of ``device``, or of every device)."""
    with _lock:
        return [(base, size) for _, dev, base, size in _held_back
                if device is None or dev == device]


def _fresh_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)
