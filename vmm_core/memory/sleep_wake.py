"""Sleep and wake of one allocator: when its pages may go, what goes to host first, how
they come back, and who is told.

An allocator owns one :class:`SleepWake` (its ``_sleep``) and keeps its public
``sleep``/``wake``/``hold_awake``/``add_sleep_listener`` as calls into it.  Kept apart
because these are rules about time, not about address space: a sleep is refused inside a
block that holds the memory awake, a failed copy leaves everything as it was, listeners
run after the change and outside the lock.  The pages themselves are released and
re-created by the allocator (``_release_pages``, ``_remake_pages``); the host copy is
its :class:`~vmm_core.memory.host_copy.AllocatorHostCopy`.  The allocator passes itself
to every call (as a :class:`~vmm_core.memory.pages.PageOwner`) instead of being held
here: a reference back would make a cycle, and a dropped allocator would then be closed
only by a later garbage collection instead of at once.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref

from .. import interrupts
from ..errors import SleepStateError
from . import tag_state
from .host_copy import AllocatorHostCopy
from .offload.pinning import deferred_pinning
from .pages import PageOwner

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

    def __init__(self, host: AllocatorHostCopy) -> None:
        self._host = host
        #: what holds the allocator awake (hold_awake), on the lock's thread
        self.holds: list[str] = []
        #: weak references to what is told of sleeps and wakes (add_sleep_listener)
        self._listeners: list = []

    def sleep(self, alloc: PageOwner, offload: bool) -> None:
        """Release every physical page; virtual addresses stay reserved.

        With ``offload=True`` the bytes are copied to host memory first (see
        :mod:`vmm_core.memory.offload` for how) and come back on :meth:`wake`: every
        mapped byte, or only the ranges the allocator's ``live_ranges`` names when its
        owner set it (the rest comes back undefined, as discarded memory does).  With
        ``preserve_live`` those ranges are kept even when ``offload`` is False.  If the
        copy fails the allocator stays awake with its memory untouched.  Sleeping while
        asleep is a no-op; sleeping inside :meth:`hold_awake` raises SleepStateError.
        """
        host = self._host
        # from the release of the pages until the listeners have heard it, Ctrl-C waits
        # (the copy before it stays interruptible: nothing has changed yet)
        with interrupts.Held(f"the sleep of memory tagged {alloc.tag!r}") as commit:
            # a kept copy is registered once the handles are released, not beside that
            with deferred_pinning(), alloc._lock:
                self.check_can_sleep(alloc)
                if alloc.asleep:
                    return
                alloc.backend.synchronize(alloc.device)
                saved, ranges = None, None
                if (offload or alloc.preserve_live) and alloc._page_ranges():
                    # asked first: a live_ranges that fails refuses the sleep, nothing
                    # changed
                    ranges, layout = host.plan(alloc)
                    saved = host.save(alloc, ranges, layout)
                else:
                    host.drop()  # discarded bytes need no host copy
                commit.arm()
                alloc._release_pages()
                host.slept(saved, ranges)
            # outside the lock: listeners take their own
            self.notify(alloc, "sleep", allocator=alloc)

    def wake(self, alloc: PageOwner, keep_host_buffers: bool | None, zero: bool,
             eager: bool) -> None:
        """Re-create the physical pages at the same addresses (and restore offloaded bytes).

        Memory that was discarded (slept without offload) holds undefined bytes after
        wake: fresh physical pages may hold anything (on CUDA, whatever the device last
        stored there).  ``zero=True`` fills it with zeros before wake returns; offloaded
        memory gets its bytes back either way.

        With ``keep_host_buffers`` the host copy is kept (pinned) for the next offloading
        sleep, which then copies straight into it; with False it is freed before wake
        returns; None follows the tag's policy
        (:func:`vmm_core.offload.keeps_host_buffers`: keep, unless configured).
        If the memory cannot be had (OutOfMemoryError), or the copy back or the zeroing
        fails, the allocator stays asleep with its host copy intact: call again.  Waking
        while awake is a no-op.  ``eager`` is passed to the sleep listeners
        (:meth:`add_listener`): graph pools then make their executables again now
        instead of on each graph's first replay.
        """
        check_wake_options(keep_host_buffers, eager)
        # from the first map until the listeners have heard it, Ctrl-C waits: a map the
        # driver made and the books did not yet hold could not be undone
        with interrupts.Held(f"the wake of memory tagged {alloc.tag!r}") as commit:
            # a copy kept against the tag's policy is registered once this lock is let go
            with deferred_pinning(), alloc._lock:
                alloc._check_open()
                if not alloc.asleep:
                    return
                commit.arm()
                be, dev = alloc.backend, alloc.device
                targets, created = alloc._remake_pages()
                base = alloc.space_base()
                try:
                    blank = self._host.restore(alloc, base,
                                               [(p.offset, p.size) for p in created])
                    if zero and blank:
                        for offset, size in blank:
                            be.memset(dev, base + offset, 0, size)
                        be.synchronize(dev)
                except BaseException:
                    alloc._unmake_pages(targets, created)  # asleep again, host copy kept
                    raise
                alloc._keep_pages(targets, created)
                self._host.woke(alloc, keep_host_buffers)
            self.notify(alloc, "wake", eager=eager, allocator=alloc)

    # ------------------------------------------------------------------ holds
    @contextlib.contextmanager
    def hold_awake(self, alloc: PageOwner, what: str, holder: str):
        """Hold the lock and refuse to run unless awake: no sleep slips in until the block
        ends (other threads' sleeps wait; this thread's raise SleepStateError naming
        ``holder``).

        Takes the process-wide lock of tagged memory first, as every sleep, wake and
        graph capture or replay does: one lock order for every entry point, so a replay
        (or ``before_replay``) inside the block cannot deadlock against another thread's
        replay, which holds that lock while it waits for this allocator."""
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

    def check_can_sleep(self, alloc: PageOwner) -> None:
        """Raise what :meth:`sleep` would refuse with now, without sleeping: memory closed
        or inconsistent after a failed rollback (VMMError), or held awake on this thread
        (SleepStateError).  Callers that sleep several allocators, or ranks that must all
        sleep or none, ask each one first, so none sleeps when one would refuse."""
        with alloc._lock:
            alloc._check_open()
            if self.holds and not alloc.asleep:
                raise SleepStateError(f"sleep: the allocator is held awake on this thread by "
                                      f"{self.holds[-1]}; leave that block first")

    def held_by(self) -> str | None:
        """What holds the allocator awake (:meth:`hold_awake`), or None.  Only the thread
        holding the lock of tagged memory can see a hold: every hold takes that lock."""
        holds = self.holds
        return holds[-1] if holds else None

    def held_here(self, alloc: PageOwner) -> str | None:
        """What holds the allocator awake on the calling thread, or None.  A hold owns
        the allocator's lock for its whole block, so another thread's is never seen: a
        close from there waits for the block instead of being refused."""
        holds = self.holds
        mine = alloc._lock._is_owned()  # type: ignore[attr-defined]  # CPython's RLock
        return holds[-1] if holds and mine else None

    # ------------------------------------------------------------------ listeners
    def add_listener(self, alloc: PageOwner, fn) -> None:
        """Call ``fn(event, **kw)`` after every sleep (``event="sleep"``, once the pages
        are released) and wake (``event="wake", eager=<bool>``, once it is complete),
        with ``allocator=`` the allocator: another thread may have put it to sleep again
        by the time a wake is heard (read ``allocator.asleep``).

        Held weakly (a bound method of a dropped object disappears; a lambda nobody else
        holds disappears at once), called outside the allocator's lock, and an exception
        it raises is logged and swallowed: the sleep or wake already happened."""
        with alloc._lock:
            self._listeners.append(weak_callable(fn))

    def remove_listener(self, alloc: PageOwner, fn) -> None:
        with alloc._lock:
            self._listeners = [r for r in self._listeners if r() is not None and r() != fn]

    def notify(self, alloc: PageOwner, event: str, **kw) -> None:
        with alloc._lock:
            self._listeners = [r for r in self._listeners if r() is not None]
            listeners = [r() for r in self._listeners]
        interrupted: BaseException | None = None
        for fn in listeners:
            if fn is None:
                continue
            try:
                fn(event, **kw)
            except Exception:
                logger.exception("a listener of %s of %r failed (the %s itself is done)",
                                 event, alloc, event)
            except BaseException as exc:  # an interrupt: every listener hears it first
                interrupted = interrupted or exc
        if interrupted is not None:
            try:
                raise interrupted
            finally:  # this frame, in its traceback, must not hold it: no cycle
                interrupted = None
