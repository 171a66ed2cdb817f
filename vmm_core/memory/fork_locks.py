"""The allocators' side of os.fork(): which locks a fork takes first, and what the child
gets in their place.

A child that inherited a lock held by a thread it does not have hangs on its first use
of that memory, so a fork waits (a bounded time) until no other thread is inside tagged
memory or an allocator.  Kept beside the allocator, not in it: this is about every
allocator of the process at once (the ones :func:`track` was told of), and about the
lock of tagged memory, which no allocator owns.
"""

from __future__ import annotations

import threading
import weakref

from .. import forksafe
from . import tag_state

__all__ = ["track"]

#: every allocator of this process (track), for the fork hooks below
_live: weakref.WeakSet = weakref.WeakSet()
#: held while an allocator joins ``_live``, and by a fork from its last look at ``_live``
#: until the child exists: no allocator is made unseen in between
_live_lock = threading.Lock()
_forking: list = []  # the locks taken for the fork in progress (None: forked without)


def _before_fork() -> None:
    """Fork while no other thread is inside tagged memory or an allocator: a child that
    inherited a lock held by a thread it does not have would hang on its first use of
    that memory (the reaper closing a dropped pool, a direct sleep/wake,
    ``memory_summary``), or get a fresh lock over a half-done map.  The tagged-memory
    lock first, as everywhere, so waiting closes no cycle among vmm_core's locks.  The
    wait is bounded (:data:`vmm_core.forksafe.FORK_WAIT_SECONDS`): a thread holding a
    capture, replay or hold_awake block may itself wait for the forking thread; past
    the bound the fork goes on and the child gets fresh locks (those threads only
    wait: no map is half done under them).

    The allocators are listed once the wait for the tagged-memory lock is over, and again
    once no new one can be made (``_live_lock``): an allocator another thread made
    during that wait, and went on using, is then waited for too, and not forked with
    its lock held."""
    taken: list = []

    def take(lock) -> bool:
        if lock.acquire(timeout=forksafe.seconds_left()):
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


forksafe.at_fork("tagged memory", before=_before_fork,
                 after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def track(alloc) -> None:
    """Count ``alloc`` (its ``_lock``, and its sleep piece's holds) among the allocators a
    fork waits for; a fork in progress sees it, and waits for its lock, or not yet."""
    with _live_lock:
        _live.add(alloc)
