"""Graph executables owned by a GraphPool: a budget, sharing by update, sleep, and
preparation ahead of the step.

Once a GraphPool holds graph memory at max(shape), the executables are most of what is
left (about 220 KiB each on an H100; 1683 graphs of a piecewise Llama-3-8B hold about
360 MiB), and the framework keeps each one as long as its graph.  Here the capture keeps
the graph apart from its executable (``GraphOps.new_graph(keep=True)``), and executables
are made from it on demand through the backend's :class:`~vmm_core.graphs.graph_ops.
Executables`:

* **budget**: at most ``max_count`` executables or ``max_bytes`` of their estimated bytes
  per pool, counted before every instantiation, so it is never exceeded, not even for a
  moment.  Keys are given up whole (a step replays every graph of one key): the least
  recently replayed first, or, preparing ahead, the one the forecast
  (:mod:`.exec_forecast`) values least;
* **sharing by update** (opt-in: ``share="when_full"`` or ``"always"``): a graph with no
  executable may take one of a graph of the same topology (the piece of one layer at
  another batch size, the same piece of another layer) and update it, which costs a
  fraction of an instantiation; where the driver refuses, the executable is destroyed
  and a new one made, and the reasons are counted.  Where the backend says an updated
  executable runs slower (CUDA), the thread that prepares ahead makes it again from its
  graph once it has nothing else to do;
* **ahead** (``ExecutablePolicy(ahead=True)``, the default under a budget): a thread of
  the pool's own (:mod:`.exec_ahead`) makes or updates executables before a step needs
  them, so a miss leaves the critical path;
* **sleep**: ``vmm_core.sleep`` of the pool's tag destroys its executables after the
  pages are released; after the wake they are made again by the first replays, in the
  background for the keys that were hot, or all before the wake returns
  (``wake_up(..., eager=True)``).

The launch is the hot path: a graph of a key whose replay block is the innermost one on
this thread launches its handle without a lock (:class:`KeptGraphMixin.replay`), since no
other thread takes or destroys an executable of a key while a replay block of it is open.
Graphs that draw random numbers keep the framework's own replay and executable (see
:mod:`vmm_core.graphs.kept_graphs`), outside the budget.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable

from .. import forksafe, interrupts
from ..errors import CaptureError
from . import exec_policy
from .exec_ahead import (
    IN_FLIGHT_WAIT,
    REMAKE,
    AheadPreparation,
    Job,
    Preparer,
)
from .exec_blocks import open_blocks
from .exec_forecast import KeyForecast
from .exec_graphs import CapturedGraphs
from .exec_policy import REFUSALS_BEFORE_GIVING_UP, SHARE_MODES, ExecutablePolicy, policy_of
from .exec_residency import KeySlot, Owned, Residency, Resident
from .exec_sleep import SleepingExecutables
from .exec_stats import Counts, executables_stats
from .kept_graphs import NOT_CAPTURED

__all__ = ["ExecutablePolicy", "ExecutableCache", "SHARE_MODES", "executables_for",
           "policy_of"]


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
    policy = exec_policy.check_readable(policy or ExecutablePolicy(), ops, calls)
    return ExecutableCache(pool, ops, calls, policy)


def _not_captured() -> CaptureError:
    return CaptureError("replay of a graph that was never captured or was reset; capture "
                        "it (inside pool.space(key)) first")


def _drawing_refused(key, seeded) -> CaptureError:
    return CaptureError(f"a graph of key {key!r} draws random numbers "
                        f"({', '.join(sorted(set(seeded)))}): only the framework's replay "
                        f"advances the generator; call graph.replay()")


_caches: weakref.WeakSet = weakref.WeakSet()


def _fresh_state_after_fork() -> None:
    """In a child: a lock held at the fork by a thread the child does not have is made
    anew, and the preparer's thread is gone with its jobs (their executables, half made,
    are left alone; the graphs get new ones)."""
    for cache in list(_caches):
        if not cache._lock._is_owned():
            cache._lock = threading.RLock()
        cache._cond = threading.Condition(cache._lock)
        cache._worker = None
        cache._stopping = False  # a sleep waiting in the parent is not the child's
        here = threading.get_ident()
        for slot in [s for s in cache._pinned if s.thread != here]:  # blocks gone too
            slot.blocks.clear()
            cache._pinned.remove(slot)
        for job in cache._pending.values():
            cache._res.unreserve(job.nbytes)
            job.done.set()
        cache._pending.clear()
    # the blocks open in the child: this thread's
    open_blocks.after_fork([s for c in _caches for s in c._pinned])


forksafe.at_fork("executables", after_in_child=_fresh_state_after_fork)


class ExecutableCache(CapturedGraphs, AheadPreparation, SleepingExecutables):
    """The executables of one GraphPool's graphs, under an :class:`ExecutablePolicy`.

    Graphs come from :meth:`new_graph` and call back here (their capture, replay and
    reset; see :class:`~vmm_core.graphs.kept_graphs.KeptGraphMixin`); the pool's replay
    blocks pin their key (:class:`~vmm_core.graphs.exec_blocks.replay_block`).  Every
    decision is taken under one lock; driver calls that make or update an executable run
    outside it, the graph marked as being prepared
    (:class:`~vmm_core.graphs.exec_ahead.Job`), so no two threads make one graph's
    executable and none launches a half-made one.  Lock order:
    the pool's locks (tagged memory, then the group's), then this one; nothing here takes
    a pool lock while holding it.
    """

    def __init__(self, pool, ops, calls, policy: ExecutablePolicy) -> None:
        self.policy = policy
        self._pool = weakref.ref(pool)
        self._ops = ops
        self._calls = calls
        #: read by each kept graph's capture_begin: watch its operators (or read kernels)
        self.watches_operators = policy.random_numbers == "operators"
        self._launch = calls.launcher()
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._tokens = itertools.count(1)
        self._owned: dict[int, Owned] = {}
        self._slots: dict = {}  # key -> KeySlot
        self._pinned: list[KeySlot] = []  # keys with a replay block open
        self._res = Residency(policy.max_count, policy.max_bytes)
        self._pending: dict[int, Job] = {}  # token -> its preparation in flight
        self._epoch = 0  # sleeps and closes: a preparation decided before is discarded
        self._clock = 0  # replay blocks opened
        self._ahead = policy.prepares_ahead
        self._forecast = KeyForecast() if self._ahead else None
        self._order: list | None = None  # keys, the one to give up first first
        self._capacity: int | None = None  # keys the budget holds (for the forecast)
        self._hints: list = []  # keys the engine expects next (expect()), next first
        self._hinted = False  # a hint came since the last block ended
        self._bets: list = []  # (key, chance) the forecast expects next
        self._woken: list = []  # keys resident at the sleep, made again after the wake
        self._worker: Preparer | None = None
        self._refusals_in_a_row: Counter = Counter()
        self._unshareable: set = set()
        self._over_budget: list = []  # keys whose graphs alone exceed the budget
        self._gone: list[int] = []  # tokens of graphs the collector took
        self._slept: list[int] = []  # what was resident at the last sleep
        self._asleep = False  # the pool's memory sleeps: nothing is prepared
        self.last_sleep: dict | None = None
        self.counts = Counts()
        self._warned_rng = self._warned_budget = False
        self._unsaid: str | None = None  # a budget warning a drop found, not said yet
        self._closed = False
        self._stopping = False  # a sleep or close waits for the preparation in flight
        _caches.add(self)

    # ------------------------------------------------------------------ replay
    def replay(self, graph) -> None:
        """``graph.replay()`` off the fast path: inside ``pool.replaying(key)`` of its key
        on this thread only the launch; elsewhere the launch inside such a block.  A reset
        on another thread either lets the launch finish first or makes it raise
        :class:`CaptureError`."""
        key = graph._vmm_key
        if key is NOT_CAPTURED:
            raise _not_captured()
        pool = self._live_pool()
        if pool.replaying_here(key):
            self._run(graph)
            return
        with pool._replay_block(key, step=False):
            self._run(graph)

    def _run(self, graph) -> None:
        if graph._vmm_unread:
            self.read_kernels(graph)
        if graph._vmm_random:
            with self._lock:
                self._check_open()
                self.counts.framework_replays += 1
            graph.framework_replay()
            return
        self.launch(graph)

    def launch(self, graph, stream=None) -> None:
        """Launch ``graph``'s executable on ``stream`` (default: the caller's current
        stream), making it first on a miss, or waiting for the preparation in flight.
        Call inside a replay block of the graph's key (its executables are then taken by
        no other thread); a graph drawing random numbers is refused (it replays through
        the framework: ``graph.replay()``)."""
        if graph._vmm_unread:
            self.read_kernels(graph)
        if graph._vmm_random:
            raise _drawing_refused(graph._vmm_key, graph._vmm_random)
        token = graph._vmm_token
        missed, claimed = False, None  # claimed: a miss this thread makes itself
        try:
            while True:
                with self._lock:
                    self._check_open()
                    if graph._vmm_key is NOT_CAPTURED:  # reset since its replay began
                        raise _not_captured()
                    self._reap()
                    handle = graph._vmm_exec
                    if handle is not None:
                        if not missed:
                            self.counts.hits += 1
                        break
                    job = self._pending.get(token)
                    if job is not None and job.kind == REMAKE and not job.started:
                        self._cancel(job)  # its updated executable launches now, remade later
                        if graph._vmm_exec is not None:
                            continue
                    if not missed:
                        missed = True
                        self.counts.misses += 1
                    job = self._pending.get(token)
                    if job is None:
                        job = self._claim_inline(graph, token)
                        if job is None:
                            continue  # the room was held by preparations: one has ended
                        mine = True
                    else:  # a preparation the preparer has not begun: this thread does it
                        mine = not job.started and isinstance(job.owner, Preparer)
                        if mine:
                            job.owner = None
                    job.started = job.started or mine
                    claimed = job if mine else None
                if mine:
                    self._make_inline(job)
                    if job.error is not None:
                        raise job.error
                else:
                    t0 = time.perf_counter()
                    if not job.done.wait(IN_FLIGHT_WAIT):
                        raise CaptureError(f"the executable of a graph of key {graph._vmm_key!r} "
                                           f"was still being prepared after {IN_FLIGHT_WAIT:.0f} "
                                           f"s (a driver call that does not return); replay "
                                           f"again, or use ExecutablePolicy(ahead=False)")
                    with self._lock:
                        self.counts.waits += 1
                        self.counts.wait_seconds += time.perf_counter() - t0
        except BaseException:
            # cut after the claim and before the hold (_make_inline), the job would stay
            # pending: every later launch of the graph would wait for it and give up
            with self._lock:
                job = self._pending.get(token)
                if job is not None and not job.done.is_set() and \
                        (job is claimed or (job.owner is None and not job.started)):
                    self._cancel(job)  # (the second: claimed, cut before it was told)
            raise
        self._calls.launch(handle, stream)

    def _make_inline(self, job: Job) -> None:
        """A miss's driver calls and install on the launching thread, Ctrl-C held: cut
        between the two (or inside the install) the job stayed pending, its executable
        made and never installed, and every later launch of the graph waited for it
        until it gave up.  Cut before the hold, :meth:`launch` drops the job as one
        never begun (what it took or made is destroyed; an executable taken for an
        update is never installed unmade)."""
        with interrupts.held("the executable a launch missed"):
            self._execute(job)
            with self._lock:
                self._install(job)

    # ------------------------------------------------------------------ deciding
    def _job(self, graph, owned: Owned, kind: str, handle, nbytes: int, destroy,
             upload: bool) -> Job:
        job = Job(graph, graph._vmm_token, owned, kind, handle, nbytes, owned.topology,
                  list(destroy), self._epoch, upload)
        self._pending[job.token] = job
        return job

    def _claim_inline(self, graph, token: int) -> Job | None:
        """A miss on the launching thread: decide how the graph gets its executable.
        Other keys go first; the keys the engine expects and the keys of open blocks
        (all of this thread) next; the graph's own key's others last (a key over
        budget).  None: nothing can go now (the room is held by preparations in flight:
        wait for one)."""
        owned = self._owned.get(token)
        if owned is None or owned.ref() is not graph:
            raise CaptureError("this graph was not captured through its GraphPool (capture "
                               "it inside pool.space(key) after pool.new_graph())")
        if owned.slot is None:
            raise _drawing_refused(owned.key, owned.seeded)
        p = self.policy
        if p.max_bytes is not None and owned.nbytes > p.max_bytes:
            raise CaptureError(f"one executable of a graph of key {owned.key!r} is estimated "
                               f"at {owned.nbytes} bytes, more than the whole budget "
                               f"ExecutablePolicy(max_bytes={p.max_bytes}); raise max_bytes "
                               f"to at least one graph's executable")
        hinted = set(self._hints)
        passes: tuple[Callable[[KeySlot], bool], ...] = (
            lambda s: s.depth == 0 and s.key not in hinted,
            lambda s: s is not owned.slot, lambda s: True)
        if p.share == "always":  # one executable per topology, whichever key has it
            passes = passes[2:]
        for allowed in passes:
            job = self._claim(graph, owned, allowed, upload=False)
            if job is not None:
                return job
        if not self._pending:
            raise CaptureError(f"internal: no room for an executable of key {owned.key!r} "
                               f"under {p.as_dict()} with nothing in flight")
        if not self._cancel_not_begun():  # room held only by calls under way
            self._cond.wait(IN_FLIGHT_WAIT)
        return None

    def _claim(self, graph, owned: Owned, allowed, upload: bool) -> Job | None:
        """Under the lock: take an executable of the same topology from a key
        ``allowed`` to give it up (sharing), or make room for a new one by evicting such
        keys' executables; reserve it and mark the graph as being prepared.  None: the
        keys allowed to go do not free enough."""
        p, res = self.policy, self._res
        order = self._eviction_order()
        share = not owned.share_refused and (
            p.share == "always" or (p.share == "when_full" and res.full(owned.nbytes)))
        if share and owned.topology is not None and owned.topology not in self._unshareable:
            # with the budget full (when_full) never one of the graph's own key: the key's
            # other graphs replay in the same step, and each step would take what the
            # step before made
            own = None if p.share == "always" else owned.slot
            victim = res.victim_for_update(owned.topology, order, allowed, own)
            if victim is not None:
                res.detach(victim)
                self._wasted(victim)
                return self._job(graph, owned, "update", victim.handle, victim.nbytes, (),
                                 upload)
        evicted = res.room(owned.nbytes, order, allowed)
        if evicted is None:
            return None
        for entry in evicted:
            res.evict(entry)
            self._wasted(entry)
            self.counts.evictions += 1
        res.reserve(owned.nbytes)
        return self._job(graph, owned, "instantiate", None, owned.nbytes,
                         [e.handle for e in evicted], upload)

    def _wasted(self, entry: Resident) -> None:
        """Count an executable made ahead for a key whose block never came."""
        if entry.wager is not None and entry.wager == entry.slot.uses:
            self.counts.unused_ahead += 1

    def _eviction_order(self) -> list:
        """The keys, the one to give up first first: by the forecast when preparing
        ahead, else the least recently replayed."""
        if self._order is None:
            slots = list(self._slots.values())
            if self._forecast is not None:
                ranks = self._forecast.ranks()
                slots.sort(key=lambda s: (ranks.get(s.key, 0.0), s.last_use))
            else:
                slots.sort(key=lambda s: s.last_use)
            self._order = slots
        return self._order

    # ------------------------------------------------------------------ running
    def _upload_all(self, jobs: list) -> None:
        """Outside the lock: upload the executables a preparer's batch made, together,
        and wait once (one wait behind the device's work, not one per graph); a failure
        is kept in each job."""
        uploading = [j for j in jobs if j.upload and j.handle is not None]
        if not uploading:
            return
        try:
            self._calls.preload_all([j.handle for j in uploading])
        except BaseException as exc:  # noqa: BLE001 - the installing thread raises it
            for job in uploading:
                job.error, handle, job.handle = exc, job.handle, None
                self._destroy_quietly(handle)

    def _execute(self, job: Job, upload: bool | None = None) -> None:
        """The driver calls of ``job``, outside the lock (``upload``: the job's own
        choice unless given); what failed is kept in the job."""
        calls = self._calls
        try:
            for handle in job.destroy:
                calls.destroy(handle)
            job.destroy = []
            t0 = time.perf_counter()
            if job.kind == "update":
                reason = calls.update(job.handle, job.graph)
                if reason is not None:  # not launched again after a refusal
                    job.refused, handle, job.handle = reason, job.handle, None
                    calls.destroy(handle)
            else:
                job.handle = calls.instantiate(job.graph)
            job.seconds = time.perf_counter() - t0
            if job.handle is not None and (job.upload if upload is None else upload):
                calls.preload(job.handle)
        except BaseException as exc:  # noqa: BLE001 - the installing thread raises it
            job.error = exc
            if job.handle is not None:
                handle, job.handle = job.handle, None
                try:
                    calls.destroy(handle)
                except Exception:  # noqa: BLE001 - the first error is the one to see
                    pass

    def _install(self, job: Job, run: bool = False) -> None:
        """Under the lock: give ``job``'s executable to its graph, or count why not.
        ``run``: the driver calls are still to make (at capture, under the lock)."""
        if run:
            self._execute(job)
        if self._pending.get(job.token) is job:
            del self._pending[job.token]
        c, res = self.counts, self._res
        remake = False  # an updated executable, to make again once nothing else is to do
        if job.refused is not None:
            c.update_refused[job.refused] += 1
            job.owned.share_refused = True
            self._refusals_in_a_row[job.topology] += 1
            if self._refusals_in_a_row[job.topology] >= REFUSALS_BEFORE_GIVING_UP:
                self._unshareable.add(job.topology)
        elif job.handle is not None and job.kind == "update":
            c.updates += 1
            c.update_seconds += job.seconds
            self._refusals_in_a_row.pop(job.topology, None)
            remake = self._ahead and not self._closed and self._calls.updated_runs_slower
        elif job.handle is not None and job.kind == REMAKE:
            c.remade += 1
        elif job.handle is not None:
            c.instantiations += 1
            c.instantiate_seconds += job.seconds
        if job.handle is None:
            res.unreserve(job.nbytes)
        elif self._closed or job.epoch != self._epoch or \
                self._owned.get(job.token) is not job.owned or \
                job.graph._vmm_key is NOT_CAPTURED or job.owned.slot is None:
            # slept, closed, reset, dropped or found drawing random numbers meanwhile
            res.unreserve(job.nbytes)
            self._destroy_quietly(job.handle)
        else:
            slot = job.owned.slot
            ahead = job.owner is not None and job.kind != REMAKE
            wager = job.wager if job.kind == REMAKE else \
                slot.uses if ahead and not slot.depth else None
            res.install(Resident(job.handle, job.token, job.nbytes, job.topology, slot,
                                 job.owned.ref, wager, updated=job.kind == "update"))
            job.owned.share_refused = False
            job.graph._vmm_exec = job.handle
            c.prepared_ahead += ahead
        job.graph = None
        job.done.set()
        self._cond.notify_all()
        if remake:  # last: a Ctrl-C raised as the preparer starts finds the install whole
            self._wake_worker()

    def _destroy_quietly(self, handle) -> None:
        try:
            self._calls.destroy(handle)
        except Exception:  # noqa: BLE001 - nothing launches it any more
            pass

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
            self._stop_preparing()
            self._gone.clear()
            deferred = [h for s in self._slots.values() for h in s.deferred]
            for slot in self._slots.values():
                slot.deferred = []
            for handle in deferred:
                self._destroy_quietly(handle)
            error = self._destroy_all(list(self._res.resident.values()))
            self._cond.notify_all()  # the preparer ends
            if error is not None:
                raise error

    @property
    def resident(self) -> int:
        return len(self._res.resident)

    @property
    def resident_bytes(self) -> int:
        return self._res.resident_bytes

    def is_resident(self, graph) -> bool:
        return getattr(graph, "_vmm_token", None) in self._res.resident

    def memory_stats(self) -> dict:
        """This pool's share of its tag's ``memory_summary()``."""
        with self._lock:
            return {"executables": len(self._res.resident),
                    "executable_bytes": self._res.resident_bytes,
                    "executable_bytes_released": self.counts.released_on_sleep_bytes}

    def stats(self) -> dict:
        """``GraphPool.stats()['executables']``: policy, what is resident, and what the
        policy did (see docs/executables.md for each field)."""
        with self._lock:
            return executables_stats(self)
