"""Graph executables owned by a GraphPool: a budget, eviction, sharing by update, sleep.

Once a GraphPool holds graph memory at max(shape), the executables are most of what is
left (about 220 KiB each on an H100; 1683 graphs of a piecewise Llama-3-8B hold about
360 MiB), and the framework keeps each one as long as its graph.  Here the capture keeps
the graph apart from its executable (``GraphOps.new_graph(keep=True)``), and executables
are made from it on demand through the backend's :class:`~vmm_core.graphs.graph_ops.
Executables`:

* **budget**: at most ``max_count`` executables or ``max_bytes`` of their estimated bytes
  per pool, enforced before every instantiation (the least recently launched go first,
  and are made again on their graph's next replay), so it is never exceeded, not even for
  a moment;
* **sharing by update**: a graph with no executable may take one of a graph of the same
  topology (the piece of one layer at another batch size, the same piece of another
  layer) and update it, which costs a fraction of an instantiation; where the driver
  refuses, the executable is destroyed and a new one made, and the reasons are counted;
* **sleep**: ``vmm_core.sleep`` of the pool's tag destroys its executables after the
  pages are released; the first replay after the wake makes each again, or
  ``wake_up(..., eager=True)`` makes again all that were resident.

Graphs that draw random numbers keep the framework's own replay and executable (see
:mod:`vmm_core.graphs.kept_graphs`), outside the budget.  :class:`GraphPool` only calls
this module.
"""

from __future__ import annotations

import itertools
import numbers
import os
import threading
import time
import warnings
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ..errors import CaptureError, VMMFallbackWarning
from .kept_graphs import NOT_CAPTURED

__all__ = ["ExecutablePolicy", "ExecutableCache", "SHARE_MODES", "executables_for", "policy_of"]

#: ``ExecutablePolicy.share``: never; only when the budget is full (recommended: an
#: update instead of an eviction plus an instantiation); on every miss (fewest executables,
#: an update per launch where graphs of one topology alternate)
SHARE_MODES = ("off", "when_full", "always")
#: refused updates in a row after which a topology is no longer shared
REFUSALS_BEFORE_GIVING_UP = 3


@dataclass(frozen=True)
class ExecutablePolicy:
    """How a GraphPool keeps its graphs' executables (``GraphPool(executables=...)``).

    :param max_count: at most this many executables alive (None: no limit).
    :param max_bytes: at most this many estimated bytes of executables alive (None: no
        limit).  The estimate is the backend's (CUDA: 100 KiB + 2.5 KiB per node, the fit
        measured on an H100): the driver does not report executables' bytes.
    :param share: ``"when_full"`` (default): when an instantiation would need an eviction,
        update the least recently launched executable of the same topology instead, if
        there is one; ``"always"``: on every miss; ``"off"``: never.

    ``ExecutablePolicy()`` keeps every executable, made at the end of its graph's capture
    as the framework does, but owned by the pool (so that sleep releases them).  Under a
    budget an executable is made by its graph's first replay.
    """

    max_count: int | None = None
    max_bytes: int | None = None
    share: str = "when_full"

    def __post_init__(self) -> None:
        for name in ("max_count", "max_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) \
                    or value < 1:
                raise ValueError(f"ExecutablePolicy({name}=...) must be None (no limit) or "
                                 f"an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.share not in SHARE_MODES:
            raise ValueError(f"ExecutablePolicy(share=...) must be one of {SHARE_MODES}, "
                             f"got {self.share!r}")

    @property
    def bounded(self) -> bool:
        return self.max_count is not None or self.max_bytes is not None

    def as_dict(self) -> dict:
        return {"max_count": self.max_count, "max_bytes": self.max_bytes,
                "share": self.share}


def policy_of(value) -> ExecutablePolicy | None:
    """What ``GraphPool(executables=value)`` asks for; None: the framework keeps them."""
    if value is None or isinstance(value, ExecutablePolicy):
        return value
    if value is False:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return ExecutablePolicy(max_count=int(value))
    raise TypeError(f"GraphPool(executables=...) takes None (owned by the pool where the "
                    f"backend can, else the framework's), False (always the framework's), "
                    f"an int (at most that many alive) or a vmm_core.ExecutablePolicy; got "
                    f"{value!r}")


def executables_for(pool, ops, value) -> ExecutableCache | None:
    """The executable cache of a new GraphPool, or None where the framework keeps them.

    The default (None) owns them wherever the backend offers :meth:`GraphOps.executables`
    and keeps today's behaviour elsewhere; an explicit policy on a backend without the
    capability raises :class:`CaptureError` naming it."""
    explicit = value is not None
    policy = policy_of(value)
    if value is False:
        return None
    calls = ops.executables()
    if calls is None:
        if explicit:
            raise CaptureError(
                f"GraphPool(executables={value!r}): the {ops.device_type} graph ops "
                f"({type(ops).__name__}) offer no graph executables apart from the framework "
                f"(GraphOps.executables() is None), so a budget or a release on sleep cannot "
                f"be enforced. Drop executables= (the framework then keeps every graph's "
                f"executable, as before)")
        return None
    return ExecutableCache(pool, ops, calls, policy or ExecutablePolicy())


def _not_captured() -> CaptureError:
    return CaptureError("replay of a graph that was never captured or was reset; capture "
                        "it (inside pool.space(key)) first")


@dataclass(eq=False)
class _Owned:
    """A captured graph of this pool (held weakly: the engine owns it)."""

    ref: weakref.ref
    key: object
    nbytes: int
    seeded: tuple
    topology: object = None
    topology_known: bool = False


@dataclass(eq=False)
class _Resident:
    """A live executable and the graph it runs now."""

    handle: object
    token: int
    nbytes: int
    topology: object = None


@dataclass
class _Counts:
    hits: int = 0
    misses: int = 0
    instantiations: int = 0
    instantiate_seconds: float = 0.0
    updates: int = 0
    update_seconds: float = 0.0
    update_refused: Counter = field(default_factory=Counter)
    evictions: int = 0
    framework_replays: int = 0
    eager_instantiations: int = 0
    released_on_sleep: int = 0
    released_on_sleep_bytes: int = 0
    peak_resident: int = 0
    peak_resident_bytes: int = 0


_caches: weakref.WeakSet = weakref.WeakSet()


def _fresh_locks_after_fork() -> None:
    """A thread the child does not have may have held a cache's lock (a launch in flight
    at the fork): the child would hang on its first replay."""
    for cache in list(_caches):
        if not cache._lock._is_owned():
            cache._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_after_fork)


class ExecutableCache:
    """The executables of one GraphPool's graphs, under an :class:`ExecutablePolicy`.

    Graphs come from :meth:`new_graph` and call back here (their capture, replay and
    reset; see :class:`~vmm_core.graphs.kept_graphs.KeptGraphMixin`).  Every decision is
    taken under one lock, the launch included, so a sleep, an eviction or a reset on
    another thread never destroys an executable between its choice and its launch.  Lock
    order: the pool's locks (tagged memory, then the group's), then this one; nothing
    here takes a pool lock while holding it.
    """

    def __init__(self, pool, ops, calls, policy: ExecutablePolicy) -> None:
        self.policy = policy
        self._pool = weakref.ref(pool)
        self._ops = ops
        self._calls = calls
        self._lock = threading.RLock()
        self._tokens = itertools.count(1)
        self._owned: dict[int, _Owned] = {}
        self._resident: OrderedDict[int, _Resident] = OrderedDict()  # least recent first
        self._by_topology: dict[object, OrderedDict] = {}  # topology -> tokens, LRU first
        self._bytes = 0
        self._key_totals: dict = {}  # key -> [graphs, estimated bytes]
        self._over_budget: list = []  # keys whose graphs alone exceed the budget
        self._refusals_in_a_row: Counter = Counter()
        self._unshareable: set = set()
        self._gone: list[int] = []  # tokens of graphs the collector took
        self._slept: list[int] = []  # what was resident at the last sleep, LRU first
        self.last_sleep: dict | None = None
        self.counts = _Counts()
        self._warned_rng = self._warned_budget = False
        self._closed = False
        _caches.add(self)

    # ------------------------------------------------------------------ graphs
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
        token, seeded = graph._vmm_token, tuple(graph.vmm_seeded)
        nbytes = 0 if seeded else int(self._calls.nbytes(graph))
        gone = self._gone

        def collected(_ref, token: int = token) -> None:  # any thread, inside any lock
            gone.append(token)

        ref = weakref.ref(graph, collected)
        warn = None
        with self._lock:
            self._owned[token] = _Owned(ref, key, nbytes, seeded)
            graph._vmm_key = key
            if seeded:
                if not self._warned_rng:
                    self._warned_rng = True
                    warn = (f"a graph captured for key {key!r} draws random numbers "
                            f"({', '.join(sorted(set(seeded)))}); only the framework's own "
                            f"replay advances the generator before a launch, so graphs "
                            f"like it replay through the framework and keep its "
                            f"executable (outside the budget, not released on sleep; "
                            f"stats()['executables']['framework_replayed'] counts them)")
            else:
                totals = self._key_totals.setdefault(key, [0, 0])
                totals[0] += 1
                totals[1] += nbytes
                warn = self._check_key_fits(key, totals)
                if not self.policy.bounded and self.policy.share != "always" \
                        and not self._closed:
                    # no budget: made now, as the framework makes its own at the end of a
                    # capture (the capture's memory and the first replay's cost as before)
                    self._add(_Resident(self._instantiate(graph), token, nbytes,
                                        self._topology(graph, self._owned[token])))
        if warn:
            warnings.warn(f"GraphPool executables: {warn}", VMMFallbackWarning, stacklevel=4)

    def _check_key_fits(self, key, totals) -> str | None:
        """A key whose graphs alone exceed the budget misses on every replay: say so once
        (stats list every such key)."""
        p = self.policy
        over = (p.max_count is not None and totals[0] > p.max_count) or \
            (p.max_bytes is not None and totals[1] > p.max_bytes)
        if not over or key in self._over_budget:
            return None
        self._over_budget.append(key)
        if self._warned_budget:
            return None
        self._warned_budget = True
        return (f"the {totals[0]} graphs of key {key!r} ({totals[1]} estimated bytes) do not "
                f"fit the budget {p.as_dict()}: every replay of that key re-instantiates "
                f"some of them. Raise the budget above one key's graphs "
                f"(stats()['executables']['keys_over_budget'] lists every such key)")

    def forget(self, graph) -> None:
        """The graph is reset (or captured again): destroy its executable."""
        token = getattr(graph, "_vmm_token", None)
        with self._lock:
            graph._vmm_key = NOT_CAPTURED
            if token is not None:
                self._drop(token)

    def _drop(self, token: int) -> None:
        owned = self._owned.pop(token, None)
        if owned is not None and not owned.seeded:
            totals = self._key_totals.get(owned.key)
            if totals is not None:
                totals[0] -= 1
                totals[1] -= owned.nbytes
        entry = self._resident.get(token)
        if entry is not None:
            self._remove(entry)
            self._calls.destroy(entry.handle)

    def _reap(self) -> None:
        """Destroy the executables of graphs the collector took (their callback only
        queued the token: it may run on any thread, inside any lock)."""
        while self._gone:
            self._drop(self._gone.pop())

    # ------------------------------------------------------------------ replay
    def replay(self, graph) -> None:
        """``graph.replay()``: inside ``pool.replaying(key)`` of its key on this thread,
        only the launch; elsewhere the launch inside such a block.  A reset on another
        thread either waits for the launch or makes it raise :class:`CaptureError`."""
        key = graph._vmm_key
        if key is NOT_CAPTURED:
            raise _not_captured()
        pool = self._live_pool()
        if pool.replaying_here(key):
            self._run(graph)
        else:
            with pool.replaying(key):
                self._run(graph)

    def _run(self, graph) -> None:
        if graph.vmm_seeded:
            with self._lock:
                self._check_open()
                self.counts.framework_replays += 1
            graph.framework_replay()
            return
        self.launch(graph)

    def launch(self, graph, stream=None) -> None:
        """Launch ``graph``'s executable on ``stream`` (default: the caller's current
        stream), making it first on a miss."""
        token = graph._vmm_token
        with self._lock:
            self._check_open()
            if graph._vmm_key is NOT_CAPTURED:  # reset since its replay began
                raise _not_captured()
            self._reap()
            entry = self._resident.get(token)
            if entry is not None:
                self.counts.hits += 1
                self._touch(entry)
                handle = entry.handle
            else:
                self.counts.misses += 1
                handle = self._make(graph, token)
            self._calls.launch(handle, stream)

    def _make(self, graph, token: int):
        owned = self._owned.get(token)
        if owned is None or owned.ref() is not graph:
            raise CaptureError("this graph was not captured through its GraphPool (capture "
                               "it inside pool.space(key) after pool.new_graph())")
        p = self.policy
        if p.max_bytes is not None and owned.nbytes > p.max_bytes:
            raise CaptureError(f"one executable of a graph of key {owned.key!r} is estimated "
                               f"at {owned.nbytes} bytes, more than the whole budget "
                               f"ExecutablePolicy(max_bytes={p.max_bytes}); raise max_bytes "
                               f"to at least one graph's executable")
        if p.share == "always" or (p.share == "when_full" and self._full(owned.nbytes)):
            handle = self._take_by_update(graph, token, owned)
            if handle is not None:
                return handle
        self._make_room(owned.nbytes)
        handle = self._instantiate(graph)
        self._add(_Resident(handle, token, owned.nbytes, self._topology(graph, owned)))
        return handle

    def _instantiate(self, graph):
        t0 = time.perf_counter()
        handle = self._calls.instantiate(graph)
        self.counts.instantiate_seconds += time.perf_counter() - t0
        self.counts.instantiations += 1
        return handle

    def _take_by_update(self, graph, token: int, owned: _Owned):
        """Update the least recently launched executable of ``graph``'s topology to it;
        None where there is none or the driver refused (then that one is destroyed).

        With the budget full (``when_full``) an executable of the graph's own key is not
        taken: the key's other graphs replay in the same step, and taking one of them
        would make each step of that key miss what the step before made (the least
        recently launched executable of all is evicted instead)."""
        topology = self._topology(graph, owned)
        if topology is None or topology in self._unshareable:
            return None
        same = self._by_topology.get(topology)
        if not same:
            return None
        victim = None
        for candidate in same:  # least recently launched first
            if self.policy.share == "always" or self._owned[candidate].key != owned.key:
                victim = self._resident[candidate]
                break
        if victim is None:
            return None
        self._remove(victim)
        t0 = time.perf_counter()
        try:
            reason = self._calls.update(victim.handle, graph)
        except BaseException:
            self._calls.destroy(victim.handle)
            raise
        if reason is None:
            self.counts.update_seconds += time.perf_counter() - t0
            self.counts.updates += 1
            self._refusals_in_a_row.pop(topology, None)
            victim.token = token  # it runs this graph now; its previous graph misses
            self._add(victim)
            return victim.handle
        self.counts.update_refused[reason] += 1
        self._calls.destroy(victim.handle)  # not launched again after a refusal
        self._refusals_in_a_row[topology] += 1
        if self._refusals_in_a_row[topology] >= REFUSALS_BEFORE_GIVING_UP:
            self._unshareable.add(topology)
        return None

    def _topology(self, graph, owned: _Owned):
        """The graph's topology key (asked once per graph, and only where sharing can
        happen: a ``when_full`` pool without a budget is never full); None: never shared."""
        p = self.policy
        if p.share == "off" or (p.share == "when_full" and not p.bounded):
            return None
        if not owned.topology_known:
            try:
                owned.topology = self._calls.topology(graph)
            except Exception:  # noqa: BLE001 - a graph the driver cannot list: not shared
                owned.topology = None
            owned.topology_known = True
        return owned.topology

    # ------------------------------------------------------------------ the budget
    def _full(self, nbytes: int) -> bool:
        p = self.policy
        return (p.max_count is not None and len(self._resident) + 1 > p.max_count) or \
            (p.max_bytes is not None and self._bytes + nbytes > p.max_bytes)

    def _make_room(self, nbytes: int) -> None:
        while self._full(nbytes) and self._resident:
            entry = next(iter(self._resident.values()))
            self._remove(entry)
            self.counts.evictions += 1
            self._calls.destroy(entry.handle)

    def _add(self, entry: _Resident) -> None:
        self._resident[entry.token] = entry
        self._bytes += entry.nbytes
        if entry.topology is not None:
            self._by_topology.setdefault(entry.topology, OrderedDict())[entry.token] = None
        c = self.counts
        c.peak_resident = max(c.peak_resident, len(self._resident))
        c.peak_resident_bytes = max(c.peak_resident_bytes, self._bytes)

    def _remove(self, entry: _Resident) -> None:
        del self._resident[entry.token]
        self._bytes -= entry.nbytes
        if entry.topology is not None:
            same = self._by_topology[entry.topology]
            del same[entry.token]
            if not same:
                del self._by_topology[entry.topology]

    def _touch(self, entry: _Resident) -> None:
        self._resident.move_to_end(entry.token)
        if entry.topology is not None:
            self._by_topology[entry.topology].move_to_end(entry.token)

    # ------------------------------------------------------------------ sleep / wake
    def on_memory_event(self, event: str, **kw) -> None:
        """The pool's allocator slept (destroy every executable) or woke (with
        ``eager=True``, make again those resident at the sleep)."""
        if event == "sleep":
            self.release()
        elif event == "wake":
            if kw.get("eager"):
                self.reinstantiate()
            else:
                with self._lock:
                    self._slept = []

    def release(self) -> dict:
        """Destroy every executable (sleep); returns what was released: the count, their
        estimated bytes and the change of the device's free memory the driver reports
        (None where the backend cannot tell)."""
        with self._lock:
            self._reap()
            before = self._calls.device_free_bytes()
            entries = list(self._resident.values())
            self._slept = [e.token for e in entries]
            released = sum(e.nbytes for e in entries)
            error = None
            for entry in entries:
                self._remove(entry)
                try:
                    self._calls.destroy(entry.handle)
                except Exception as exc:  # noqa: BLE001 - the others still go
                    error = error or exc
            after = self._calls.device_free_bytes()
            self.last_sleep = {
                "executables": len(entries), "bytes": released,
                "driver_free_change": None if before is None or after is None
                else after - before}
            self.counts.released_on_sleep += len(entries)
            self.counts.released_on_sleep_bytes += released
            if error is not None:
                raise error
            return dict(self.last_sleep)

    def reinstantiate(self) -> int:
        """Make again the executables resident at the last sleep (eager wake), oldest
        first so the order of eviction is kept; returns how many."""
        made = 0
        with self._lock:
            if self._closed:
                return 0
            tokens, self._slept = self._slept, []
            for token in tokens:
                owned = self._owned.get(token)
                graph = owned.ref() if owned is not None else None
                if graph is None or token in self._resident:
                    continue
                self._make_room(owned.nbytes)  # type: ignore[union-attr]
                handle = self._instantiate(graph)
                self._add(_Resident(handle, token, owned.nbytes,  # type: ignore[union-attr]
                                    self._topology(graph, owned)))  # type: ignore[arg-type]
                self._calls.upload(handle)
                made += 1
            self.counts.eager_instantiations += made
        return made

    # ------------------------------------------------------------------ state
    def _live_pool(self):
        pool = self._pool()
        if pool is None:
            raise CaptureError("the GraphPool this graph was made by was closed or dropped; "
                               "capture it again in a live pool")
        return pool

    def _check_open(self) -> None:
        if self._closed:
            raise CaptureError("the GraphPool this graph was made by was closed; create a "
                               "new pool and capture again")

    def close(self) -> None:
        """Destroy every executable; later replays are refused.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._gone.clear()
            error = None
            for entry in list(self._resident.values()):
                self._remove(entry)
                try:
                    self._calls.destroy(entry.handle)
                except Exception as exc:  # noqa: BLE001 - the others still go
                    error = error or exc
            if error is not None:
                raise error

    @property
    def resident(self) -> int:
        return len(self._resident)

    @property
    def resident_bytes(self) -> int:
        return self._bytes

    def is_resident(self, graph) -> bool:
        return getattr(graph, "_vmm_token", None) in self._resident

    def memory_stats(self) -> dict:
        """This pool's share of its tag's ``memory_summary()``."""
        with self._lock:
            return {"executables": len(self._resident), "executable_bytes": self._bytes,
                    "executable_bytes_released": self.counts.released_on_sleep_bytes}

    def stats(self) -> dict:
        """``GraphPool.stats()['executables']``: policy, what is resident, and what the
        policy did (see docs/executables.md for each field)."""
        with self._lock:
            c = self.counts
            graphs = [o for o in self._owned.values() if o.ref() is not None]
            return {
                "policy": self.policy.as_dict(),
                "graphs": sum(1 for o in graphs if not o.seeded),
                "resident": len(self._resident),
                "resident_bytes": self._bytes,
                "peak_resident": c.peak_resident,
                "peak_resident_bytes": c.peak_resident_bytes,
                "hits": c.hits,
                "misses": c.misses,
                "instantiations": c.instantiations,
                "instantiate_seconds": c.instantiate_seconds,
                "updates": c.updates,
                "update_seconds": c.update_seconds,
                "update_refused": dict(c.update_refused),
                "unshareable_topologies": len(self._unshareable),
                "evictions": c.evictions,
                "keys_over_budget": list(self._over_budget),
                "framework_replayed": sum(1 for o in graphs if o.seeded),
                "framework_replays": c.framework_replays,
                "eager_instantiations": c.eager_instantiations,
                "released_on_sleep": c.released_on_sleep,
                "released_on_sleep_bytes": c.released_on_sleep_bytes,
                "last_sleep": dict(self.last_sleep) if self.last_sleep else None,
            }
