"""Which executables of a GraphPool are alive, per key, and which go when room is needed.

The executable cache (:mod:`vmm_core.graphs.executables`) keeps its graphs and their
executables here, per key (:class:`KeySlot`): a step replays every graph of one key, so
a key is kept or given up as a whole.  The accounting counts every executable alive, the
ones being made or updated included, so a budget holds even while a preparation runs
on another thread.  Nothing here calls the driver or takes a lock: the cache calls it
under its own lock and destroys what it is handed back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

__all__ = ["Owned", "Resident", "KeySlot", "Residency"]


@dataclass(eq=False)
class Owned:
    """A captured graph of the pool (held weakly: the engine owns it)."""

    ref: weakref.ref
    key: object
    nbytes: int
    seeded: tuple
    slot: KeySlot | None = None
    topology: object = None
    #: an update of an executable to this graph was refused: make the next one anew
    share_refused: bool = False
    #: its kernels are read at its first replay, not yet (counted in its slot's ``unread``)
    unread: bool = False


@dataclass(eq=False)
class Resident:
    """A live executable, the graph it runs now and that graph's key."""

    handle: object
    token: int
    nbytes: int
    topology: object
    slot: KeySlot
    ref: weakref.ref
    #: the key's ``uses`` when it was made ahead of its block (None: made for a block of
    #: its key): still equal when it goes, it was made for nothing
    wager: int | None = None
    #: runs a graph it was updated to (where the backend says such an executable runs
    #: slower, the preparer makes it again from that graph when it has nothing to do)
    updated: bool = False


class KeySlot:
    """One key's graphs and executables.

    A graph of the key holds its slot (``graph._vmm_slot``) and its launchable handle
    (``graph._vmm_exec``); the launch path reads both without the cache's lock.  ``blocks``
    are the replay blocks of the key open now (a list, not a count: a block is on it or
    not, so an interrupted opening or end can be told and completed): while there is
    one, no other thread takes or destroys an executable of the key."""

    __slots__ = ("key", "launch", "hits", "blocks", "thread", "uses", "last_use", "tokens",
                 "resident", "by_topology", "deferred", "nbytes", "updated", "unread")

    def __init__(self, key, launch) -> None:
        self.key = key
        self.launch = launch  # the backend's launch on the current stream
        self.hits = 0  # launches of the fast path (by the thread holding the block)
        self.blocks: list = []
        self.thread = 0  # the thread whose blocks these are
        self.uses = 0  # replay blocks of the key so far
        self.last_use = 0  # the cache's block clock at the last one
        self.tokens: list[int] = []  # its graphs, in capture order (a step's order)
        self.resident: dict[int, Resident] = {}  # in the order they were made
        self.by_topology: dict = {}  # topology -> {token: None}
        self.deferred: list = []  # handles to destroy once the key's blocks end
        self.nbytes = 0  # estimated bytes of all its graphs' executables
        self.updated = 0  # of its resident executables, those updated to their graph
        self.unread = 0  # of its graphs, those whose kernels are not read yet

    @property
    def depth(self) -> int:
        return len(self.blocks)

    @property
    def complete(self) -> bool:
        return len(self.resident) == len(self.tokens)


class Residency:
    """The executables alive, and the room a budget leaves."""

    def __init__(self, max_count: int | None, max_bytes: int | None) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self.resident: dict[int, Resident] = {}
        self.count = 0  # alive: resident, or being made or updated
        self.bytes = 0
        self.resident_bytes = 0
        self.updated = 0  # resident executables updated to the graph they run
        self.peak_count = self.peak_bytes = 0

    # ------------------------------------------------------------------ accounting
    def full(self, nbytes: int) -> bool:
        """Whether one more executable of ``nbytes`` would break the budget."""
        return (self.max_count is not None and self.count + 1 > self.max_count) or \
            (self.max_bytes is not None and self.bytes + nbytes > self.max_bytes)

    def reserve(self, nbytes: int) -> None:
        """Count an executable about to be made (before it exists: the budget holds at
        the instantiation itself)."""
        self.count += 1
        self.bytes += nbytes
        self.peak_count = max(self.peak_count, self.count)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def unreserve(self, nbytes: int) -> None:
        """An executable counted is gone (destroyed, or never made)."""
        self.count -= 1
        self.bytes -= nbytes

    def install(self, entry: Resident) -> None:
        """``entry`` (counted already) runs its graph from now on."""
        self.resident[entry.token] = entry
        self.resident_bytes += entry.nbytes
        entry.slot.resident[entry.token] = entry
        if entry.topology is not None:
            entry.slot.by_topology.setdefault(entry.topology, {})[entry.token] = None
        if entry.updated:
            self.updated += 1
            entry.slot.updated += 1

    def detach(self, entry: Resident) -> None:
        """Take ``entry`` away from its graph (it stays counted: it is being updated to
        another graph, or destroyed next)."""
        del self.resident[entry.token]
        self.resident_bytes -= entry.nbytes
        slot = entry.slot
        del slot.resident[entry.token]
        if entry.updated:
            self.updated -= 1
            slot.updated -= 1
        if entry.topology is not None:
            same = slot.by_topology[entry.topology]
            del same[entry.token]
            if not same:
                del slot.by_topology[entry.topology]
        graph = entry.ref()
        if graph is not None and getattr(graph, "_vmm_exec", None) is entry.handle:
            graph._vmm_exec = None

    def evict(self, entry: Resident) -> None:
        """Detach ``entry`` and stop counting it (the caller destroys its handle)."""
        self.detach(entry)
        self.unreserve(entry.nbytes)

    # ------------------------------------------------------------------ what goes
    def victim_for_update(self, topology, order, allowed, own: KeySlot | None):
        """An executable of ``topology`` to update to another graph: of the first key in
        ``order`` (the key to give up first) that ``allowed`` lets go, never of ``own``;
        within a key the one made last (a step needs the first pieces first)."""
        for slot in order:  # most keys hold none of it: that is looked up first
            same = slot.by_topology.get(topology)
            if same and slot is not own and allowed(slot):
                return slot.resident[next(reversed(same))]
        return None

    def room(self, nbytes: int, order, allowed) -> list[Resident] | None:
        """The executables to destroy so that one more of ``nbytes`` fits: whole keys
        first, in ``order``, each key's last-made first; None when the keys ``allowed``
        to go do not free enough (nothing is changed then)."""
        need_count = 0 if self.max_count is None else self.count + 1 - self.max_count
        need_bytes = 0 if self.max_bytes is None else self.bytes + nbytes - self.max_bytes
        if need_count <= 0 and need_bytes <= 0:
            return []
        victims: list[Resident] = []
        for slot in order:
            if not slot.resident or not allowed(slot):
                continue
            for entry in reversed(slot.resident.values()):
                victims.append(entry)
                need_count -= 1
                need_bytes -= entry.nbytes
                if need_count <= 0 and need_bytes <= 0:
                    return victims
        return None
