"""The allocators' side of os.fork(): which locks a fork takes first, and what the child
gets in their place.

A child that inherited a lock held by a thread it does not have hangs on its first use
of that memory, so a fork waits (a bounded time) until no other thread is inside tagged
memory or an allocator.  Kept beside the allocator, not in it: this is about every
allocator of the process at once (the ones :func:`track` was told of), and about the
lock of tagged memory, which no allocator owns.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

# imported before this module registers its fork hooks, so that the registry's are
# registered first: Python runs before-fork hooks in reverse order, and a fork must take
# the tagged-memory and allocator locks before the registry's (a capture block holding
# the tagged-memory lock may look a backend up; the other order stalled such a fork for
# the whole FORK_WAIT_SECONDS)
from .. import registry as _registry  # noqa: F401
from . import tag_state

__all__ = ["track", "FORK_WAIT_SECONDS"]

#: every allocator of this process (track), for the fork hooks below
_live: weakref.WeakSet = weakref.WeakSet()
#: held while an allocator joins ``_live``, and by a fork from its last look at ``_live``
#: until the child exists: no allocator is made unseen in between
_live_lock = threading.Lock()
_forking: list = []  # the locks taken for the fork in progress (None: forked without)
#: how long a fork waits for other threads to leave vmm_core's locks
FORK_WAIT_SECONDS = 10.0


def _before_fork() -> None:
    """Fork while no other thread is inside tagged memory or an allocator: a child that
    inherited a lock held by a thread it does not have hung on its first use of that
    memory (the reaper closing a dropped pool, a direct sleep/wake, ``memory_summary``),
    or got a fresh lock over a half-done map.  The tagged-memory lock first, as
    everywhere, so waiting closes no cycle among vmm_core's locks.  The wait is bounded:
    a thread holding a capture, replay or hold_awake block may itself wait for the
    forking thread, and os.fork() then hung forever; past ``FORK_WAIT_SECONDS`` the fork
    goes on and the child gets fresh locks (those threads only wait: no map is half
    done under them).

    The allocators are listed once the wait for the tagged-memory lock is over, and again
    once no new one can be made (``_live_lock``): listed before that wait, an allocator
    another thread made during it (and went on using) was forked with its lock held, and
    the child's first call on it never returned."""
    deadline = time.monotonic() + FORK_WAIT_SECONDS
    taken: list = []

    def take(lock) -> bool:
        if lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            taken.append(lock)
            return True
        for held in reversed(taken):
            held.release()
        taken.clear()
        return False

    def take_new() -> bool:
        mine = {id(lock) for lock in taken}
        return all(take(a._lock) for a in sorted(list(_live), key=id)
                   if id(a._lock) not in mine)

    # the allocators made so far, then the lock that keeps new ones out, then those made
    # meanwhile (their makers took no lock of ours: waiting for them closes no cycle)
    ok = take(tag_state.state_lock()) and take_new() and take(_live_lock) and take_new()
    _forking.append(taken if ok else None)


def _after_fork_in_parent() -> None:
    for lock in reversed(_forking.pop() or []):
        lock.release()


def _after_fork_in_child() -> None:
    global _live_lock
    taken = _forking.pop()
    if taken is not None:
        for lock in reversed(taken):
            lock.release()
        return
    tag_state._fresh_lock_in_child()
    _live_lock = threading.Lock()
    for alloc in list(_live):
        if not alloc._lock._is_owned():  # the forking thread's own holds stay
            alloc._lock = threading.RLock()
            alloc._sleep.holds = []  # holds of threads the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def track(alloc) -> None:
    """Count ``alloc`` (its ``_lock``, and its sleep piece's holds) among the allocators a
    fork waits for; a fork in progress sees it, and waits for its lock, or not yet."""
    with _live_lock:
        _live.add(alloc)
