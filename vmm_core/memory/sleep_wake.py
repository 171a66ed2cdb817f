"""Sleep and wake of one allocator: when its pages may go, what goes to host first, how
they come back, and who is told.

An allocator owns one :class:`SleepWake` (its ``_sleep``) and keeps its public
``sleep``/``wake``/``hold_awake``/``add_sleep_listener`` as calls into it.  Kept apart
because these are rules about time, not about address space: a sleep is refused inside a
block that holds the memory awake, a failed copy leaves everything as it was, listeners
run after the change and outside the lock.  The pages themselves are released and
re-created by the allocator (``_release_pages``, ``_remake_pages``); the host copy is
its :class:`~vmm_core.memory.host_copy.AllocatorHostCopy`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from typing import TYPE_CHECKING

from ..errors import SleepStateError
from . import tag_state
from .host_copy import AllocatorHostCopy
from .offload.pinning import deferred_pinning

if TYPE_CHECKING:
    from .allocator import SharedVMMAllocator

__all__ = ["SleepWake", "check_wake_options", "weak_callable"]

logger = logging.getLogger("vmm_core")


def check_wake_options(keep_host_buffers, eager) -> None:
    """The options of a wake, checked (ValueError): callers that wake several allocators,
    or ranks that must all wake or none, ask before any of them wakes."""
    if not isinstance(eager, bool):
        raise ValueError(f"wake_up: eager must be True or False, got {eager!r}")
    if keep_host_buffers is not None and not isinstance(keep_host_buffers, bool):
        raise ValueError(f"wake_up: keep_host_buffers must be True, False or None (the "
                         f"tag's policy), got {keep_host_buffers!r}")


def weak_callable(fn):
    """A weak reference to a callable: a bound method's dies with its object."""
    return weakref.WeakMethod(fn) if inspect.ismethod(fn) else weakref.ref(fn)


class SleepWake:
    """The sleep/wake half of one allocator (see the module's docstring)."""

    def __init__(self, alloc: SharedVMMAllocator, host: AllocatorHostCopy) -> None:
        self._alloc = alloc
        self._host = host
        #: what holds the allocator awake (hold_awake), on the lock's thread
        self.holds: list[str] = []
        #: weak references to what is told of sleeps and wakes (add_sleep_listener)
        self._listeners: list = []

    def sleep(self, offload: bool) -> None:
        """:meth:`SharedVMMAllocator.sleep`."""
        alloc, host = self._alloc, self._host
        # a kept copy is registered once the handles are released, not beside that
        with deferred_pinning(), alloc._lock:
            self.check_can_sleep()
            if alloc.asleep:
                return
            alloc.backend.synchronize(alloc.device)
            saved, ranges = None, None
            if (offload or alloc.preserve_live) and alloc._page_ranges():
                # asked first: a live_ranges that fails refuses the sleep, nothing changed
                ranges, layout = host.plan()
                saved = host.save(ranges, layout)
            else:
                host.drop()  # discarded bytes need no host copy
            alloc._release_pages()
            host.slept(saved, ranges)
        self.notify("sleep")  # outside the lock: listeners take their own

    def wake(self, keep_host_buffers: bool | None, zero: bool, eager: bool) -> None:
        """:meth:`SharedVMMAllocator.wake`."""
        check_wake_options(keep_host_buffers, eager)
        alloc = self._alloc
        be, dev = alloc.backend, alloc.device
        # a copy kept against the tag's policy is registered once this lock is let go
        with deferred_pinning(), alloc._lock:
            alloc._check_open()
            if not alloc.asleep:
                return
            targets, created = alloc._remake_pages()
            base = alloc.space_base()
            try:
                blank = self._host.restore(base, [(p.offset, p.size) for p in created])
                if zero and blank:
                    for offset, size in blank:
                        be.memset(dev, base + offset, 0, size)
                    be.synchronize(dev)
            except BaseException:
                alloc._unmake_pages(targets, created)  # asleep again, host copy kept
                raise
            alloc._keep_pages(targets, created)
            self._host.woke(keep_host_buffers)
        self.notify("wake", eager=eager)

    # ------------------------------------------------------------------ holds
    @contextlib.contextmanager
    def hold_awake(self, what: str, holder: str):
        """:meth:`SharedVMMAllocator.hold_awake`."""
        alloc = self._alloc
        with tag_state.state_lock(), alloc._lock:
            alloc._check_open()
            if alloc.asleep:
                how = f"vmm_core.wake_up({alloc.tag!r})" if alloc.tag else "wake()"
                raise SleepStateError(f"{what} is asleep; call {how} first")
            self.holds.append(holder)
            try:
                yield alloc
            finally:
                self.holds.pop()

    def check_can_sleep(self) -> None:
        """:meth:`SharedVMMAllocator.check_can_sleep`."""
        alloc = self._alloc
        with alloc._lock:
            alloc._check_open()
            if self.holds and not alloc.asleep:
                raise SleepStateError(f"sleep: the allocator is held awake on this thread by "
                                      f"{self.holds[-1]}; leave that block first")

    def held_by(self) -> str | None:
        holds = self.holds
        return holds[-1] if holds else None

    def held_here(self) -> str | None:
        holds = self.holds
        mine = self._alloc._lock._is_owned()  # type: ignore[attr-defined]  # CPython's RLock
        return holds[-1] if holds and mine else None

    # ------------------------------------------------------------------ listeners
    def add_listener(self, fn) -> None:
        with self._alloc._lock:
            self._listeners.append(weak_callable(fn))

    def remove_listener(self, fn) -> None:
        with self._alloc._lock:
            self._listeners = [r for r in self._listeners if r() is not None and r() != fn]

    def notify(self, event: str, **kw) -> None:
        with self._alloc._lock:
            self._listeners = [r for r in self._listeners if r() is not None]
            listeners = [r() for r in self._listeners]
        for fn in listeners:
            if fn is None:
                continue
            try:
                fn(event, **kw)
            except Exception:
                logger.exception("a listener of %s of %r failed (the %s itself is done)",
                                 event, self._alloc, event)
