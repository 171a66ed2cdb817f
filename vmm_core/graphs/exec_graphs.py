"""The graphs an executable cache keeps: their capture, the first read of their kernels,
their reset, and their collection.

A captured graph joins its key's slot (:class:`~.exec_residency.KeySlot`) and, without a
budget, gets its executable at once, as the framework makes its own at the end of a
capture.  Where the pool tells drawing graphs by their kernels, the reading waits for the
graph's first replay (:meth:`CapturedGraphs.read_kernels`): it costs driver calls per node
that an engine's start-up would otherwise wait for, and until it is done the graph has no
fast-path slot, so it cannot launch through the pool's executable unread.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

from ..errors import VMMFallbackWarning
from .exec_residency import KeySlot, Owned, Residency
from .kept_graphs import NOT_CAPTURED, read_random_kernels

__all__ = ["CapturedGraphs"]


class CapturedGraphs:
    """The graph side of :class:`~.executables.ExecutableCache` (a base of it): what a
    kept graph's capture, reset and collection do to the cache's books.  Decisions run
    under the cache's lock; see the cache for the lock order."""

    # the cache's state these methods share (ExecutableCache.__init__ sets it)
    policy: Any
    watches_operators: bool
    _lock: threading.RLock
    _calls: Any
    _ops: Any
    _tokens: Any
    _owned: dict[int, Owned]
    _slots: dict
    _res: Residency
    _order: list | None
    _capacity: int | None
    _over_budget: list
    _gone: list
    _closed: bool
    _warned_rng: bool
    _warned_budget: bool
    _unsaid: str | None
    _launch: Any

    def new_graph(self):
        graph = self._ops.new_graph(keep=True)
        graph._vmm_token = next(self._tokens)
        graph._vmm_owner = self
        return graph

    def capture_begins(self, graph) -> object:
        """The key of the capture space open on this thread (the graph replays under it)."""
        key = self._live_pool().open_key()
        self.forget(graph)  # captured again: what it had is gone
        return key

    def capture_failed(self, graph) -> None:
        graph._vmm_key = NOT_CAPTURED

    def capture_ended(self, graph, key) -> None:
        # kernels are read at the graph's first replay (read_kernels), not here: about
        # 0.1 ms of driver calls a graph that an engine's start-up would wait for.  Until
        # then the graph counts as drawing nothing (its executable may be made) and
        # replays through this cache, which reads first
        unread = not self.watches_operators
        token, seeded = graph._vmm_token, () if unread else tuple(graph._vmm_random)
        nbytes = 0 if seeded else int(self._calls.nbytes(graph))
        topology = None if seeded else self._topology(graph)
        gone = self._gone

        def collected(_ref, token: int = token) -> None:  # any thread, inside any lock
            gone.append(token)

        owned = Owned(weakref.ref(graph, collected), key, nbytes, seeded, topology=topology,
                      unread=unread)
        warn = None
        with self._lock:
            self._owned[token] = owned
            graph._vmm_key = key
            graph._vmm_unread = unread
            if seeded:
                warn = self._drawing_warning(key, seeded)
            else:
                slot = self._slots.get(key)
                if slot is None:
                    slot = self._slots[key] = KeySlot(key, self._launch)
                    self._order = None
                slot.tokens.append(token)
                slot.nbytes += nbytes
                slot.unread += unread
                self._capacity = None
                owned.slot = slot
                if not unread:
                    graph._vmm_slot = slot
                warn = self._check_key_fits(slot)
                if not self.policy.bounded and self.policy.share != "always" \
                        and not self._closed:
                    # no budget: made now, as the framework makes its own at the end of a
                    # capture (the capture's memory and the first replay's cost as before)
                    self._res.reserve(nbytes)
                    job = self._job(graph, owned, "instantiate", None, nbytes, (), False)
                    self._install(job, run=True)
                    if job.error is not None:
                        raise job.error
            said = [warn, self._take_unsaid()]
        _say(said, stacklevel=5)

    def read_kernels(self, graph) -> None:
        """Read which kernels of ``graph``, captured and not yet read, draw random numbers.
        A graph that draws leaves its key (its executable is destroyed, or deferred to the
        end of the key's replay blocks) and replays through the framework from now on;
        one that draws nothing gets its slot, and with it the fast path.  Under the lock:
        a reset on another thread waits, so the framework's graph is alive while read."""
        self._calls.sees_generator_state()  # its one probe (done when the pool was made)
        said: list = []
        error = None
        with self._lock:
            if not graph._vmm_unread:
                return
            read = False
            try:
                read_random_kernels(graph, self._calls)
                read = True  # interrupted before this (KeyboardInterrupt): read again later
                token = graph._vmm_token
                owned = self._owned.get(token)
                if owned is None or owned.ref() is not graph:
                    return
                slot = owned.slot
                if owned.unread:
                    owned.unread = False
                    slot.unread -= 1
                seeded = tuple(graph._vmm_random)
                if seeded:
                    try:
                        self._drop(token)  # the books change first; only a destroy raises
                    except Exception as exc:  # noqa: BLE001 - raised once the books hold
                        error = exc
                    graph._vmm_exec = None
                    self._owned[token] = Owned(owned.ref, owned.key, 0, seeded)
                    if token in self._slept:  # an eager wake would make it again
                        self._slept.remove(token)
                    said.append(self._drawing_warning(owned.key, seeded))
                else:  # (a drop checks its key's fit itself)
                    graph._vmm_slot = slot
                    said.append(self._check_key_fits(slot))
                said.append(self._take_unsaid())
            finally:
                # last, and only with a verdict: a thread that sees the flag down (it
                # reads it without the lock) sees the verdict too
                if read:
                    graph._vmm_unread = False
        _say(said, stacklevel=6)
        if error is not None:
            raise error

    def _take_unsaid(self) -> str | None:
        """Under the lock: the budget warning a drop found, to be said once the lock is
        released."""
        said, self._unsaid = self._unsaid, None
        return said

    def _drawing_warning(self, key, seeded: tuple) -> str | None:
        """Said once per pool: a graph that draws random numbers keeps the framework's
        replay."""
        if self._warned_rng:
            return None
        self._warned_rng = True
        return (f"a graph captured for key {key!r} draws random numbers "
                f"({', '.join(sorted(set(seeded)))}); only the framework's own "
                f"replay advances the generator before a launch, so graphs "
                f"like it replay through the framework and keep its "
                f"executable (outside the budget, not released on sleep; "
                f"stats()['executables']['framework_replayed'] counts them)")

    def _topology(self, graph):
        """The graph's topology key, read at capture and only where sharing can happen
        (a ``when_full`` pool without a budget is never full); None: never shared."""
        p = self.policy
        if p.share == "off" or (p.share == "when_full" and not p.bounded):
            return None
        try:
            return self._calls.topology(graph)
        except Exception:  # noqa: BLE001 - a graph the driver cannot list: not shared
            return None

    def _check_key_fits(self, slot: KeySlot) -> str | None:
        """A key whose graphs alone exceed the budget misses on every replay: list it
        (stats, and the preparer leaves it alone), and say so once, when the key's graphs
        are all known not to draw (a graph found drawing at its first read leaves the key,
        which may then fit)."""
        p = self.policy
        graphs = len(slot.tokens)
        over = (p.max_count is not None and graphs > p.max_count) or \
            (p.max_bytes is not None and slot.nbytes > p.max_bytes)
        listed = slot.key in self._over_budget
        if over and not listed:
            self._over_budget.append(slot.key)
        elif listed and not over:
            self._over_budget.remove(slot.key)
        if not over or slot.unread or self._warned_budget:
            return None
        self._warned_budget = True
        return (f"the {graphs} graphs of key {slot.key!r} ({slot.nbytes} estimated bytes) do "
                f"not fit the budget {p.as_dict()}: every replay of that key re-instantiates "
                f"some of them. Raise the budget above one key's graphs "
                f"(stats()['executables']['keys_over_budget'] lists every such key)")

    def forget(self, graph) -> None:
        """The graph is reset (or captured again): destroy its executable."""
        token = getattr(graph, "_vmm_token", None)
        with self._lock:
            graph._vmm_key = NOT_CAPTURED
            graph._vmm_exec = graph._vmm_slot = None
            graph._vmm_unread = False
            if token is not None:
                self._drop(token)
            said = self._take_unsaid()
        _say([said], stacklevel=4)

    def _drop(self, token: int, collected: bool = False) -> None:
        owned = self._owned.pop(token, None)
        if owned is not None and owned.slot is not None:
            owned.slot.tokens.remove(token)
            owned.slot.nbytes -= owned.nbytes
            owned.slot.unread -= owned.unread
            self._capacity = None
            # the key may fit now, or have no unread graph left: said by the next caller
            # outside the lock (this may run inside any of the cache's calls)
            self._unsaid = self._check_key_fits(owned.slot) or self._unsaid
        entry = self._res.resident.get(token)
        if entry is not None:
            self._res.evict(entry)
            if entry.slot.depth and not collected:  # a launch may be under way on the
                # thread of the block (a collected graph has no launch left)
                entry.slot.deferred.append(entry.handle)
            else:
                self._calls.destroy(entry.handle)

    def _reap(self) -> None:
        """Destroy the executables of graphs the collector took (their callback only
        queued the token: it may run on any thread, inside any lock)."""
        while self._gone:
            self._drop(self._gone.pop(), collected=True)


def _say(messages: list, stacklevel: int) -> None:
    """Issue the cache's warnings, outside its lock (a filter may turn one into an
    error)."""
    for message in messages:
        if message:
            warnings.warn(f"GraphPool executables: {message}", VMMFallbackWarning,
                          stacklevel=stacklevel)
