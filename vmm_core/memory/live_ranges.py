"""Which bytes of an allocator must survive an offloading sleep.

A region's framework pool holds free cached blocks between its live tensors (the caching
allocator keeps what was freed for reuse), and a graph pool's space holds intermediates
that every replay rewrites.  Copying those to the host and back costs bandwidth and host
memory for bytes nobody reads: an RL step's wake copied 7.19 GiB for 6.50 GiB of
weights.  The owner of an allocator (a region, a GraphPool) knows which blocks are live
and tells the allocator through ``SharedVMMAllocator.live_ranges``; the allocator copies
exactly those (see :meth:`SharedVMMAllocator.sleep`).

Ranges are ``(start, size)`` pairs.  Two live ranges closer than :data:`LIVE_GAP_BYTES`
are copied as one: a queued copy costs a few microseconds to issue, more than copying
that many bytes at device bandwidth, and a staged copy of many tiny ranges would take a
ring slot each.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable, Iterable

from ..errors import VMMError

__all__ = ["LIVE_GAP_BYTES", "merge", "subtract", "pool_live_ranges", "checked"]

#: live ranges this close together are copied as one (see the module docstring)
LIVE_GAP_BYTES = 64 << 10


def merge(ranges: Iterable[tuple[int, int]], gap: int = LIVE_GAP_BYTES) -> list[tuple[int, int]]:
    """Sorted ranges, overlapping ones and those at most ``gap`` bytes apart joined;
    empty ranges dropped."""
    out: list[list[int]] = []
    for start, size in sorted((s, n) for s, n in ranges if n > 0):
        end = start + size
        if out and start <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end - start) for start, end in out]


def subtract(ranges: Iterable[tuple[int, int]],
             holes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` with every byte of ``holes`` taken out (both as ``(start, size)``).

    One sweep over both sorted lists: a pool has as many free blocks as live ones, and a
    sleep asks this of thousands."""
    cuts = merge(holes, gap=0)
    out = []
    i = 0
    for start, size in merge(ranges, gap=0):
        end, at = start + size, start
        while i < len(cuts) and cuts[i][0] + cuts[i][1] <= at:
            i += 1  # holes wholly before this range: no later range reaches back to them
        j = i
        while j < len(cuts) and cuts[j][0] < end:
            hole_start, hole_end = cuts[j][0], cuts[j][0] + cuts[j][1]
            if hole_start > at:
                out.append((at, hole_start - at))
            at = max(at, hole_end)
            j += 1
        if at < end:
            out.append((at, end - at))
    return out


def checked(ranges, who: str) -> list[tuple[int, int]]:
    """``ranges`` as a list of ``(int, int)`` pairs, or VMMError naming ``who`` returned
    something else (a sleep then refuses before anything changed)."""
    try:
        pairs = list(ranges)
    except TypeError:
        raise VMMError(f"{who} returned {ranges!r}, not a list of (address, nbytes) "
                       f"pairs") from None
    out = []
    for pair in pairs:
        ok = isinstance(pair, tuple) and len(pair) == 2 and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pair)
        if not ok or pair[1] < 0:
            raise VMMError(f"{who} returned {pair!r} among its ranges; each must be an "
                           f"(address, nbytes) pair of ints with nbytes >= 0")
        out.append((int(pair[0]), int(pair[1])))
    return out


def pool_live_ranges(allocator, adapter, get_pool) -> Callable[[], list[tuple[int, int]]]:
    """The ``live_ranges`` of an allocator that serves one framework pool (a region, a
    single-space graph pool): its allocations, minus the blocks the framework reports
    free in the pool ``get_pool()`` returns (None: no pool, nothing known free).

    Starting from the allocations, not from the framework's live blocks, keeps anything
    the framework does not account for (memory allocated from the allocator directly, a
    segment its snapshot does not list) where an offload copies it: only bytes known to
    be free are left out.  On CUDA this asks the pool's snapshot once per sleep (the
    same call the escape guard makes after a capture).  The allocator is held weakly and
    the pool looked up at each call: the allocator keeps this function, and a framework
    pool held here could never be freed when its owner drops it."""
    ref = weakref.ref(allocator)

    def live() -> list[tuple[int, int]]:
        alloc = ref()
        if alloc is None:
            return []
        allocations = alloc.live_allocations()
        if not allocations:
            return []
        pool = get_pool() if adapter is not None else None
        free = adapter.free_blocks(pool) if pool is not None else []
        return subtract(allocations.items(), free)

    return live
