"""Replay blocks, as the executables of a pool see them: which keys are in use on which
thread (a key's executables are neither taken nor destroyed while a block of it is open),
which block is the innermost on a thread (its graphs launch on the fast path), and
whether any block is open in the process (a preparer then puts off what the step does
not need).

A block opens and ends once per step, so nothing here holds Ctrl-C: each step is made
so that a KeyboardInterrupt anywhere leaves no block open (docs/failures.md).
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

from .exec_residency import KeySlot
from .kept_graphs import innermost

__all__ = ["OpenBlocks", "open_blocks", "replay_block", "Pins"]


class Pins(Protocol):
    """What a block asks of its pool's executables
    (:class:`~vmm_core.graphs.exec_ahead.AheadPreparation`)."""

    def pin(self, key, block, step: bool = True) -> KeySlot | None: ...

    def unpin(self, slot: KeySlot, block, step: bool = True) -> None: ...

    def abandon(self, block) -> None: ...


class OpenBlocks:
    """The keys with a replay block open in the process (any pool, any thread), and the
    executable caches whose preparer put work off until none has.  A cache adds a key's
    slot as its first block opens and drops it as its last ends (under the cache's lock;
    this lock is taken inside it and never around a cache's).  A set, not a count: both
    are idempotent, so a block's end cut by an interrupt is completed by ending it again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set = set()
        self._waiting: weakref.WeakSet = weakref.WeakSet()
        #: how many times a preparer put its background work off for an open block
        self.deferrals = 0

    def after_fork(self, slots) -> None:
        """In a child: the blocks open are those of ``slots`` (the forking thread's);
        the lock, maybe held at the fork by a thread the child lacks, is made anew."""
        self._lock = threading.Lock()
        self._open = set(slots)
        self._waiting = weakref.WeakSet()

    @property
    def count(self) -> int:
        return len(self._open)

    def opened(self, slot) -> None:
        with self._lock:
            self._open.add(slot)

    def closed(self, slot) -> list:
        """``slot``'s last block ended (nothing where it was not open); the caches to wake
        when no block is open now.  They stay listed until :meth:`resumed`: an end an
        interrupt cut before it woke them finds them again when completed."""
        with self._lock:
            self._open.discard(slot)
            return [] if self._open else list(self._waiting)

    def resumed(self, cache) -> None:
        """``cache``'s preparer is being woken: no longer waiting (called before the wake,
        so a deferral that comes after it stays listed)."""
        with self._lock:
            self._waiting.discard(cache)

    def defer(self, cache) -> bool:
        """For a preparer about to take background work: True (and ``cache`` is woken
        when the last block ends) if a block is open now."""
        with self._lock:
            if not self._open:
                return False
            self._waiting.add(cache)
            self.deferrals += 1
            return True


open_blocks = OpenBlocks()


class replay_block:
    """What a replay block of a pool's key (``GraphPool.replaying``) tells the pool's
    executables and the thread: the key is in use on this thread (no other thread takes
    its executables until the block ends), it is the innermost block here (its graphs
    launch on the fast path), and it is on the thread's list of open blocks (``stack``,
    as ``(owner, key, block)``).  A pool without executables of its own passes None:
    graphs of outer blocks then take the slow path, which opens their own block.
    ``step=False``: one graph's launch outside a block of its key, not a step (the
    forecast does not count it).

    A Ctrl-C can cut the opening or the end anywhere (KeyboardInterrupt comes at any
    call).  A block left open would pin its key and put every pool's background
    preparation off for good, so the opening undoes itself when cut, :meth:`close`
    completes a cut end when called again (``GraphPool._replay_block`` does, on the way
    out of a failed block), and a block's end also ends the blocks opened inside it whose
    own end a Ctrl-C cut off (blocks on a thread nest)."""

    __slots__ = ("_cache", "_key", "_slot", "_step", "_stack", "_entry", "_thread")

    def __init__(self, cache: Pins | None, key, stack: list, owner,
                 step: bool = True) -> None:
        self._cache, self._key, self._step = cache, key, step
        self._stack, self._entry = stack, (owner, key, self)
        self._slot: KeySlot | None = None
        self._thread = threading.get_ident()

    def __enter__(self) -> None:
        cache = self._cache
        try:
            self._stack.append(self._entry)
            if cache is not None:
                self._slot = cache.pin(self._key, self, self._step)
            innermost.slot = self._slot
        except BaseException:
            # pin undid itself if cut inside; cut after it returned, the block is on
            # its slot's list unrecorded here
            if cache is not None:
                cache.abandon(self)
            self.close()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abandoned=exc_type is GeneratorExit)

    def close(self, abandoned: bool = False) -> None:
        """End the block and those still listed inside it; nothing where it has ended (a
        second call completes an end an interrupt cut).  ``abandoned``: the block's
        generator is being closed (collected after a Ctrl-C cut its end, maybe on
        another thread, maybe under blocks opened since): only its own entry goes."""
        stack, ended = self._stack, [self]
        if stack and stack[-1] is self._entry:
            stack.pop()
        elif (at := _index(stack, self._entry)) >= 0:
            if abandoned:
                del stack[at]
            else:  # blocks inside it whose end was cut off: ended too
                ended = [entry[2] for entry in reversed(stack[at:])]
                del stack[at:]
        if self._thread == threading.get_ident():
            # the graphs' fast path also checks the slot is still open: another
            # thread's innermost block is never set from here
            innermost.slot = stack[-1][2]._slot if stack else None
        for block in ended:  # innermost first
            block._unpin()

    def _unpin(self) -> None:
        if self._slot is not None:
            assert self._cache is not None
            self._cache.unpin(self._slot, self, self._step)


def _index(stack: list, entry) -> int:
    """Where ``entry`` is on ``stack`` (the last place), by identity: keys need not
    compare (``hash(key)`` is all a pool asks of them); -1 where it is not."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is entry:
            return i
    return -1
