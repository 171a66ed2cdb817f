"""How the physical pool of an allocator grows and merges: the size of its next handle,
and which of its handles a switch of spaces merges.

Switching spaces costs one map per handle, while a merge remaps every space that maps a
merged handle: these two rules keep both costs logarithmic.  Pure functions of a few
numbers, apart from the allocator that applies them, so that the measured trade-offs
they encode are read (and changed) in one place.
"""

from __future__ import annotations

__all__ = ["GROWTH_FRACTION", "MAX_GROWTH_BYTES", "FULL_MERGE_SPACES", "round_up",
           "growth_step", "merge_start"]

#: Growth never adds less than this fraction of what is already held ...
GROWTH_FRACTION = 32
#: ... nor more than this in one handle (bounds unused memory to one step).
MAX_GROWTH_BYTES = 1 << 30
#: Up to this many spaces a merge takes every handle (switches then map one handle, as
#: the H100/H200 numbers were measured); beyond, only the newest ones (see merge_start).
FULL_MERGE_SPACES = 64


def round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


def growth_step(shortfall: int, physical: int, granularity: int, limit: int) -> int:
    """Size of the next physical handle.

    At least the shortfall (so one allocation never needs two handles), and at least
    ``physical / GROWTH_FRACTION`` so that a slowly growing pool makes O(log) handles,
    not one per request: switching a space costs one map call per handle (measured on an
    H200: 2 MiB handles made 51 switches 11x slower than 64 MiB ones).  Unused memory is
    bounded by one step (about 3% of what is held, and never more than
    ``MAX_GROWTH_BYTES``).  ``limit`` is what the reservation still has room for.
    """
    want = max(shortfall, min(MAX_GROWTH_BYTES, physical // GROWTH_FRACTION))
    return min(round_up(want, granularity), limit)


def merge_start(handle_spaces: list[set[int]], num_spaces: int) -> int | None:
    """The first of the newest handles a switch merges into one (None: none), given the
    spaces each handle is mapped into, oldest first.

    Merging handles remaps every space that maps one of them.  Merging everything at
    every switch made each new key remap all older spaces when every key grew (26 ms
    per key at 500 keys, 640 ms at 2500, on the host).  Here the newest handles are
    merged only while the next older one is mapped into at most twice as many spaces
    as they are (a binary counter): a space is remapped O(log spaces) times over its
    life and a switch maps O(log spaces) handles.  Up to ``FULL_MERGE_SPACES`` spaces
    everything is merged."""
    last = len(handle_spaces) - 1
    if last < 1:
        return None
    if num_spaces <= FULL_MERGE_SPACES:
        return 0
    i = last
    spaces = set(handle_spaces[i])
    while i >= 1 and len(handle_spaces[i - 1]) <= 2 * len(spaces):
        i -= 1
        spaces |= handle_spaces[i]
    return i if i < last else None
