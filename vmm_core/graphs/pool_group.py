"""The pools sharing one SharedVMMAllocator, and what a pool gives back to it.

Several GraphPools over one allocator (graph families: vLLM's FULL and PIECEWISE graphs)
are one group: their spaces share physical pages, so they share the escape guard, the
claim on each space, the stream of the last launch and the capture stream.  What a sleep
of the allocator keeps is the group's business too (the blocks declared with ``keep()``
in any of its pools), and so is what a pool gives back when it is closed or dropped: its
executables, its framework pools, its spaces, and its use of the allocator (the last
pool closes an allocator a pool created).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter

from .. import forksafe
from ..errors import OutOfMemoryError, VMMError
from ..memory import reaper
from ..memory.allocator import SharedVMMAllocator
from .capture_space import EscapeGuard
from .pool_arguments import CLOSED_ALLOCATOR, PoolArguments

__all__ = ["PoolGroup", "group_of", "join_allocator", "give_back", "release_given_back",
           "keep_live_blocks", "no_address_space"]


class PoolGroup:
    """What every GraphPool over one SharedVMMAllocator shares.

    An escape poisons the whole group (the escaped block lives on pages every other space
    reuses); spaces are claimed group-wide so two pools never capture into one space; the
    stream of the last launch orders the next one, whichever pool it belongs to; and every
    pool captures on one stream, so a warm-up through any of them prepares all (a second
    family on a cold stream put cuBLAS's 32 MiB workspace into its first space, on an H100).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.guard = EscapeGuard()
        self.claimed: set[int] = set()
        self.last_stream = None
        self.ops = None  # the graph ops (and so the capture stream) of the group
        #: handles added by captures wait to be merged: by the next switch, or the first
        #: replay of another key (a merge remaps every space; batching them keeps
        #: capture cheap)
        self.compact_pending = False
        self.last_key: tuple | None = None  # (pool id, key) last captured or replayed
        #: open pools on the allocator; one that a pool created closes with the last
        self.users = 0
        self.tags: Counter = Counter()  # tag -> open pools registered under it
        self.owned = None  # the allocator, when a pool created it
        #: spaces of closed or dropped pools that were the allocator's current space then
        #: (it cannot be released): released once another space is current, instead of
        #: one space (address range and mappings) leaking per pool closed
        self.given_back: set[int] = set()
        #: the open pools on the allocator: their kept blocks survive a sleep
        self.pools: weakref.WeakSet = weakref.WeakSet()
        #: the allocator's (preserve_live, live_ranges) before the first pool set them:
        #: given back with the last pool (a caller's allocator is the caller's again)
        self.live_before: tuple | None = None

    @property
    def poisoned(self) -> str | None:
        return self.guard.poisoned

    def space_for_new_key(self, allocator, key, clock) -> int:
        """The allocator's space a new key gets: the current one if no pool claimed it and
        nothing lives in it, else a new one (the switch merges pending handles first).
        The caller claims it once its framework pool exists."""
        current = allocator.current_space
        if current in self.claimed or allocator.space_used_bytes(current) > 0:
            with clock("switch"):
                try:
                    current = allocator.switch_to_new_virtual_space()
                except OutOfMemoryError as exc:
                    raise OutOfMemoryError(no_address_space(
                        f"the capture space of {key!r}", exc,
                        f"each key reserves {allocator.reserve_bytes} bytes and "
                        f"{allocator.num_virtual_spaces} spaces exist")) from exc
            self.compact_pending = False
        self.given_back.discard(current)  # reused, if it was one
        release_given_back(allocator, self)
        return current

    def join(self, pool, allocator, created: bool) -> None:
        """Count ``pool`` as a user of ``allocator`` (the caller holds the tagged-memory
        lock and this group's, and has registered the pool's tag)."""
        if self.ops is None:
            self.ops = pool.ops
        if created:
            self.owned = allocator
        self.users += 1
        self.tags[pool.tag] += 1
        self.pools.add(pool)


_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


def _fresh_group_locks_after_fork() -> None:
    """A GraphPool being made holds these without the tagged-memory lock the fork hooks
    wait for (any thread may make one, also one inside a capture): a child forked then
    would inherit them held by a thread it does not have, and hang in its first
    GraphPool.
    They guard a few dict and counter updates, so fresh ones are safe; a group lock the
    forking thread holds (it is the child's thread) stays."""
    global _groups_lock
    _groups_lock = threading.Lock()
    for group in list(_groups.values()):
        if not group.lock._is_owned():
            group.lock = threading.RLock()


forksafe.at_fork("pool groups", after_in_child=_fresh_group_locks_after_fork)


def group_of(allocator) -> PoolGroup:
    """The one group of ``allocator``'s pools, made on first use."""
    with _groups_lock:
        group = _groups.get(allocator)
        if group is None:
            group = _groups[allocator] = PoolGroup()
        return group


def join_allocator(pool, args: PoolArguments) -> tuple[SharedVMMAllocator, PoolGroup]:
    """The allocator of GraphPool ``pool`` (the given one, or a new one it owns), prepared for
    capture, and its group, which ``pool`` joins under the locks the reaper's give-back
    takes: its tag registered, what a sleep keeps set, its executables told of sleeps."""
    from ..memory import tagged

    allocator, created = args.allocator, args.allocator is None
    if allocator is None:
        # merges copy (scratch=False): space-local tensors survive them
        try:
            allocator = SharedVMMAllocator(pool.backend, device=pool.device, tag=pool.tag,
                                           reserve_bytes=args.reserve_bytes)
        except OutOfMemoryError as exc:
            raise OutOfMemoryError(no_address_space("the first key", exc)) from exc
        # each space is mapped by its first replay ("single" has only one)
        allocator.lazy_wake = pool.reuse == "vmm"
    try:
        pool.adapter.prepare()
    except BaseException:
        if created:
            allocator.close()
        raise
    group = group_of(allocator)
    # checked again under these locks: a pool dropped just before may close the
    # allocator it created meanwhile, and this pool would be built on a closed one
    with tagged.state_lock(), group.lock:
        if allocator.closed:
            raise VMMError(CLOSED_ALLOCATOR)
        tagged.register(pool.tag, allocator)
        group.join(pool, allocator, created)
        keep_live_blocks(allocator, group, pool.reuse, pool.adapter, pool._single)
    if pool._executables is not None:  # held weakly by the allocator
        allocator.add_sleep_listener(pool._executables.on_memory_event)
        allocator.add_stats_provider(pool._executables.memory_stats)
    return allocator, group


def no_address_space(what: str, exc, state: str = "") -> str:
    return (f"GraphPool: no address space left for {what}"
            f"{': ' + state if state else ''} ({exc}). Create the GraphPool with a smaller "
            f"reserve_bytes (GraphPool(reserve_bytes=...), enough for the largest key's "
            f"graph memory), or close pools you no longer use")


# ----------------------------------------------------------------------------------
# What a sleep keeps
# ----------------------------------------------------------------------------------

def keep_live_blocks(allocator, group: PoolGroup, reuse: str, adapter, single: list) -> None:
    """Tell the allocator which of its bytes a sleep must keep (and keep them even when
    it discards: ``preserve_live``): what replays read and no replay rewrites first.

    "vmm": the blocks declared with ``keep()`` in any pool of the group (valid until
    another key replays, they come back as they were); a raw address declared with
    keep() keeps the block it lies in.  "single": every block alive in the space (blocks
    alive after a capture are legal there), not the free ones."""
    if group.live_before is None:
        group.live_before = (allocator.preserve_live, allocator.live_ranges)
    allocator.preserve_live = True
    if allocator.live_ranges is not None:
        return  # set by the allocator's owner, or by the first pool of the group
    if reuse == "single":
        from ..memory.live_ranges import pool_live_ranges

        allocator.live_ranges = pool_live_ranges(allocator, adapter,
                                                 lambda: single[0] if single else None)
        return
    ref = weakref.ref(group)

    def kept() -> list[tuple[int, int]]:
        g = ref()
        if g is None:
            return []
        out: list[tuple[int, int]] = []
        for pool in list(g.pools):
            for space in list(pool._spaces.values()):
                extents = [(a, n, r is None and n == 1) for r, a, n in list(space.kept)
                           if r is None or r() is not None]
                out += [(a, n) for a, n, raw in extents if not raw]
                raws = [a for a, _, raw in extents if raw]
                if raws and space.pool is not None and pool.adapter is not None:
                    out += [(a, n) for a, n in pool.adapter.live_blocks(space.pool)
                            if any(a <= r < a + n for r in raws)]
        return out

    allocator.live_ranges = kept


# ----------------------------------------------------------------------------------
# What a closed or dropped pool gives back
# ----------------------------------------------------------------------------------

def give_back(spaces: dict, ops, adapter, allocator, group: PoolGroup, tag: str,
              executables=None, single: list | None = None) -> None:
    """What close() gives back, and a pool collected without close() on the reaper: the
    executables, the framework pools, then the spaces, then this pool's use of the
    allocator, under the pool's locks in their order (re-entered from close()).  The use
    is given back even if the rest fails (a device error in the synchronize, a failed
    unmap): otherwise the tag would stay registered and an allocator a pool created would
    never be closed, silently when the reaper runs it.  Takes no pool: the reaper runs
    it after the pool is gone."""
    from ..memory import tagged

    # reaper.acquire: at exit the reaper does not wait for a lock that may never come free
    with reaper.acquire(tagged.state_lock()), group.lock:
        try:
            try:
                if executables is not None:
                    executables.close()
            finally:  # spaces go back even if a driver call failed
                _give_back_spaces(spaces, ops, adapter, allocator, group, single or [])
        finally:
            if allocator is not None:
                _release_use(group, tag, allocator)


def _give_back_spaces(spaces: dict, ops, adapter, allocator, group: PoolGroup,
                      single: list) -> None:
    ops.synchronize()
    taken = list(spaces.values())
    spaces.clear()
    if adapter is not None:
        pools = list({id(p): p for p in [s.pool for s in taken if s.pool is not None]
                      + single}.values())  # "single": every key has the one pool
        single.clear()
        for pool in pools:
            adapter.release_pool(pool)
        for s in taken:
            s.pool = None
        del pools
        # the framework may still cache the dropped pools' segments; let it return them
        # before their addresses go back (a new space could get them again)
        adapter.flush()
    if allocator is None or allocator.closed:
        return
    for s in taken:
        group.claimed.discard(s.index)
        group.given_back.add(s.index)  # the current one: released once another is current
    release_given_back(allocator, group)


def release_given_back(allocator, group: PoolGroup) -> None:
    """Release the given-back spaces that are no longer current (all are tried; the
    first error is raised after)."""
    if not group.given_back:
        return
    current = allocator.current_space
    stale = sorted(i for i in group.given_back if i != current)
    group.given_back.difference_update(stale)
    error = None
    for index in stale:
        try:
            allocator.release_virtual_space(index)
        except Exception as exc:  # noqa: BLE001 - the others still go back
            error = error or exc
    if error is not None:
        raise error


def _release_use(group: PoolGroup, tag: str, allocator) -> None:
    """A pool on ``allocator`` is gone; the last one closes an allocator a pool created."""
    from ..memory import tagged

    with tagged.state_lock(), group.lock:
        group.users -= 1
        group.tags[tag] -= 1
        if group.tags[tag] <= 0:
            tagged.unregister(tag, allocator)
        if group.users <= 0 and group.owned is not None:
            group.owned.close()
        elif group.users <= 0 and group.live_before is not None:
            # the last pool on a caller's allocator: what its sleeps keep is the
            # caller's choice again (the pools' kept blocks are gone with them)
            allocator.preserve_live, allocator.live_ranges = group.live_before
            group.live_before = None
