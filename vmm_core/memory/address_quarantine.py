"""Address ranges given back only once the framework's allocator holds nothing in them.

A framework pool built on vmm_core memory (``torch.cuda.MemPool``) keeps every segment
it got until its own tensors and its cache let go, and it may outlive the allocator that
served it: a tensor or a library workspace still alive when a region's allocator or a
graph pool is closed.  Released at once, such a range could be reserved again by the
next allocator, and the framework would then hold two segments at one address: torch
aborts the process at exit on that ("Trying to free a pointer not allocated here",
``CUDAPluggableAllocator::raw_delete``).  So a closing allocator unmaps its pages as
always (a stale tensor then faults instead of reading someone else's bytes) but keeps
the reservation of such a range, and the range goes back before a later reservation
once the framework no longer holds it.

Whether the framework holds a range is asked of the backend's allocator adapter
(``AllocatorAdapter.holds_memory_in``: by default the C shim's own table of the segments
it handed out), never of the framework itself: torch's snapshot waits for its allocator
lock while holding the GIL, and a thread allocating through the shim holds that lock
while it waits for the GIL.  A range that cannot be asked about, or whose release fails,
is held back too and tried again later: nothing here raises.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from .. import forksafe

__all__ = ["give_back", "retry", "flush_and_retry", "inside_framework_allocator",
           "held_back"]

_held_back: list[tuple] = []  # (backend, device, base, size)
_lock = threading.Lock()
logger = logging.getLogger("vmm_core")


def _held(backend, device: int, base: int, size: int) -> bool:
    """Whether the framework holds anything in the range; True when it cannot be asked."""
    try:
        adapter = backend.allocator_adapter(device)
        return adapter is not None and bool(adapter.holds_memory_in(base, size))
    except Exception:  # noqa: BLE001 - unknown means held: never hand out an address twice
        return True


def _release(backend, device: int, base: int, size: int) -> bool:
    try:
        backend.release_range(device, base, size)
        return True
    except Exception as exc:  # noqa: BLE001 - still reserved: held back, tried again later
        logger.warning("giving back the address range %#x (+%d) on %s:%d failed (%s); it "
                       "stays reserved and is tried again before the next reservation",
                       base, size, getattr(backend, "name", backend), device, exc)
        return False


def _same(entry, backend, device: int) -> bool:
    """Held back by ``backend``'s ``device``: by name, since a test or a tool may wrap a
    backend in another object (FaultInjector) that reaches the same driver."""
    return getattr(entry[0], "name", entry[0]) == getattr(backend, "name", backend) \
        and entry[1] == device


def _kept(entry) -> str | None:
    """Release ``(backend, device, base, size)`` unless the framework holds it; None where
    it went, else why it stays: ``"held"`` (by the framework) or ``"failed"`` (the
    release)."""
    if _held(*entry):
        return "held"
    return None if _release(*entry) else "failed"


def give_back(backend, device: int, ranges) -> bool:
    """Release each ``(base, size)`` range whose pages are unmapped, or hold it back
    while the framework's allocator still holds a segment inside it (or the release
    fails).  Each range on its own: one failure never leaks the others.  Returns
    whether the framework holds any of them (a failed release alone: False)."""
    why = [(entry, _kept(entry)) for entry in ((backend, device, base, size)
                                               for base, size in ranges)]
    kept = [entry for entry, reason in why if reason is not None]
    if kept:
        with _lock:
            _held_back.extend(kept)
    return any(reason == "held" for _, reason in why)


_local = threading.local()  # .inside: the framework's allocator called in on this thread


@contextlib.contextmanager
def inside_framework_allocator():
    """Around a callback the framework's allocator makes while it holds its own lock
    (whole-process memory's segment allocation): a close in there leaves the cache alone
    (:func:`flush_and_retry`), the range goes back before a later reservation."""
    _local.inside = getattr(_local, "inside", 0) + 1
    try:
        yield
    finally:
        _local.inside -= 1


def flush_and_retry(backend, device: int) -> None:
    """Have the framework give back the cached segments of the pools let go of
    (``AllocatorAdapter.flush``: a pool let go of keeps them until its cache is emptied),
    then release the ranges of ``device`` it no longer holds.  Call it holding no
    allocator lock: the framework's allocator calls into vmm_core while it holds its own.
    Inside such a call (:func:`inside_framework_allocator`) nothing is emptied.  Never
    raises.  The framework's cache is emptied whole (torch has no call for one pool's):
    its default pool's cached blocks go too."""
    if getattr(_local, "inside", 0):
        return
    try:
        adapter = backend.allocator_adapter(device)
        if adapter is not None:
            adapter.flush()
    except Exception as exc:  # noqa: BLE001 - the ranges stay held, retried later
        logger.warning("emptying the framework's cache on %s:%d failed (%s); the ranges "
                       "it holds are given back before a later reservation instead",
                       getattr(backend, "name", backend), device, exc)
    retry(backend, device)


def retry(backend, device: int) -> None:
    """Release the held-back ranges of ``backend``'s ``device`` the framework has let go
    (called before every reservation there; free when nothing is held back).

    The entries are taken out of the list before anything is tried, so two threads
    never release one range twice (the second release could hit a range reserved again
    in between); those still held go back in."""
    with _lock:
        mine = [r for r in _held_back if _same(r, backend, device)]
        if not mine:
            return
        _held_back[:] = [r for r in _held_back if not _same(r, backend, device)]
    kept = [entry for entry in mine if _kept(entry) is not None]
    if kept:
        with _lock:
            _held_back.extend(kept)


def held_back(device: int | None = None) -> list[tuple[int, int]]:
    """``(base, size)`` of every range held back (of ``device``, or of every device)."""
    with _lock:
        return [(base, size) for _, dev, base, size in _held_back
                if device is None or dev == device]


def _fresh_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()


forksafe.at_fork("address ranges", after_in_child=_fresh_lock_in_child)
