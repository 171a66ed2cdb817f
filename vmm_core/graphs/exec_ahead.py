"""Executables prepared ahead of the step that launches them, on a thread of their own.

A miss costs an update (12-49 us on an H100) or an instantiation (80-130 us) plus the
first launch's upload (about 31 us), against a launch of 2.7 us: taken inline, dozens of
them make a step 7-28% slower (docs/executables.md).  Under ``ExecutablePolicy(ahead=
True)`` the executable cache hands that work to a :class:`Preparer`: the graphs of a key
whose replay block has just opened (in the step's order, so the step waits at most for
its first pieces while the device runs the earlier ones), the keys the engine expects next
(``GraphPool.expect``), the keys the forecast bets on, after a wake the keys that were
resident at the sleep, and last, where the pool shares by update and the backend says
an updated executable runs slower, those executables made again from their own graphs
(:data:`REMAKE`).  The driver calls run outside the cache's lock; each decision is taken
under it (:class:`Job`).

Device graph capture in global mode refuses some driver calls from *any* thread while a
capture runs, and a refused call invalidates the capture.  So a capture space of a
GraphPool pauses every preparer (:func:`preparation_paused`): it waits for the calls in
flight, and no new one starts until the capture ends.  Captures outside every GraphPool
space should first wait with ``GraphPool.settle()``.

While a replay block is open on any thread of the process, a preparer makes only the
executables of its own open blocks' keys (what the step launches next): the rest of its
work (hints, bets, keys woken) waits until no block is open (:mod:`.exec_blocks`).  A
step's launches then share neither the interpreter nor the driver with preparations it
does not need: its Python launch loop gives up the interpreter at every driver call, and
a preparer's bookkeeping would take it each time, and a driver call that makes or updates
an executable would hold the driver beside the step's launches.  An engine that names
the next key while its step is in its block (``GraphPool.expect``) has it prepared as the
block ends, while the device still runs the step.

What comes next is known from the pool's replay blocks (:mod:`.exec_blocks`: each pins
its key, and marks it the innermost on its thread for the launch fast path), the
engine's hints and the forecast (:mod:`.exec_forecast`): :class:`AheadPreparation`, the
part of the executable cache that chooses the preparer's next job.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import forksafe, interrupts
from .exec_blocks import open_blocks
from .exec_forecast import KeyForecast
from .exec_residency import KeySlot, Owned, Residency, Resident

__all__ = ["Job", "Preparer", "AheadPreparation", "preparation_paused", "IDLE_SECONDS",
           "BET_AT_LEAST", "IN_FLIGHT_WAIT", "BATCH", "REMAKE"]

log = logging.getLogger("vmm_core")

#: a preparer with nothing to do for this long ends its thread (a later need starts one)
IDLE_SECONDS = 30.0
#: without the engine's hint, a key is prepared ahead when the forecast gives it at least
#: this chance of being the next block's (and only in place of keys it gives less)
BET_AT_LEAST = 0.2
#: how long a sleep or a close waits for a preparation in flight (seconds)
IN_FLIGHT_WAIT = 60.0
#: at most this many graphs of one key a preparer makes or updates before it uploads
#: them together and waits once (work for a key no block has open; a block that opens
#: meanwhile ends the batch at the graph in flight)
BATCH = 8
#: a :class:`Job`'s kind where an updated executable is made again from the graph it runs
#: (its old handle destroyed first, so the budget holds)
REMAKE = "remake"


@dataclass(eq=False)
class Job:
    """One graph's executable being made (``"instantiate"``) or taken from another graph
    (``"update"``): decided and counted under the cache's lock, run outside it, then
    installed under it again."""

    graph: Any  # held strongly until installed
    token: int
    owned: Owned
    kind: str  # "instantiate", "update" or REMAKE
    handle: object  # the executable taken (update), or the one made
    nbytes: int  # what the budget counts for it
    topology: object
    destroy: list  # executables evicted to make room, destroyed before the instantiation
    epoch: int  # the cache's sleeps and closes when decided: another one discards it
    upload: bool  # upload it before it is installed (ahead of its first launch)
    owner: object = None  # the Preparer running it; None: the thread that decided it
    allowed: Callable | None = None  # which keys a preparer's job of its key may displace
    started: bool = False
    wager: int | None = None  # a remake's: the executable it replaces was made ahead then
    done: threading.Event = field(default_factory=threading.Event)
    refused: str | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class _Gate:
    """Captures against preparations: a capture waits for the driver calls in flight,
    and none starts while a capture is open."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.captures = 0
        self.calls = 0

    @contextlib.contextmanager
    def capture(self):
        with self.cond:
            self.captures += 1
            self.cond.wait_for(lambda: self.calls == 0)
        try:
            yield
        finally:
            with self.cond:
                self.captures -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def driver_calls(self):
        with self.cond:
            self.cond.wait_for(lambda: self.captures == 0)
            self.calls += 1
        try:
            yield
        finally:
            with self.cond:
                self.calls -= 1
                self.cond.notify_all()


_gate = _Gate()


def preparation_paused():
    """Enter around a capture: background preparations wait until it ends."""
    return _gate.capture()


def _fresh_gate_in_child() -> None:
    """A preparer the child does not have may have been inside a driver call."""
    global _gate
    _gate = _Gate()


forksafe.at_fork("executables", after_in_child=_fresh_gate_in_child)


class Preparer:
    """The thread that prepares one executable cache's executables ahead.

    It holds the cache weakly (a dropped pool ends it), takes its next :class:`Job` from
    ``cache._next_job()`` under the cache's lock, runs it outside (``cache._execute``)
    and installs it under the lock again (``cache._install``).  A job another thread
    took over before it started (``owner`` changed) is skipped."""

    def __init__(self, cache) -> None:
        self._cache = weakref.ref(cache)
        self._cond = cache._cond
        self.thread: threading.Thread | None = None
        self.idle = True
        self._said = False  # that no thread could start

    def wake(self) -> None:
        """Call with the cache's lock held, as the caller's last step: there may be work.
        Where no thread can start (the process's limit, out of memory), nothing is
        prepared ahead until a later wake starts one: each step makes what it misses, as
        without ``ahead`` (said once), and the engine's call that woke it goes on.  A
        Ctrl-C waits while the thread starts (cut there, a thread would run unrecorded,
        or be recorded and never run) and is raised once it is on the books."""
        self.idle = False
        if self.thread is not None:
            self._cond.notify_all()
            return
        try:
            with interrupts.held("the start of the thread that prepares graph executables"):
                self.thread = threading.Thread(target=self._loop, daemon=True,
                                               name="vmm-core-executables")
                self.thread.start()
        except BaseException as exc:  # noqa: BLE001 - preparing ahead is an optimisation
            if self.thread is None or not self.thread.is_alive():  # it never began
                self.thread, self.idle = None, True
                if isinstance(exc, Exception) and not self._said:
                    self._said = True
                    log.warning("vmm_core: no thread could start to prepare graph "
                                "executables ahead (%r): each step makes the ones it "
                                "misses until one can", exc)
            if not isinstance(exc, Exception):
                raise  # a Ctrl-C, raised once the books are whole

    def _loop(self) -> None:
        """The thread: jobs until the cache is closed or dropped, or nothing came for
        :data:`IDLE_SECONDS` (a later :meth:`wake` starts another thread)."""
        try:
            self._jobs()
        except BaseException:  # noqa: BLE001 - said, and the next wake starts anew
            log.exception("vmm_core: the thread preparing graph executables ahead stopped")
            with self._cond:
                self._retire()

    def _retire(self) -> None:
        """Under the lock, as the thread ends: a :meth:`wake` after this starts another.
        Taken in the same hold of the lock as the decision to end, or a wake in between
        would find a thread that no longer listens."""
        if self.thread is threading.current_thread():
            self.thread = None
            self.idle = True
            self._cond.notify_all()  # settle() waits for this

    def _jobs(self) -> None:
        while True:
            with self._cond:
                cache = self._cache()
                if cache is None or cache._closed or cache._worker is not self:
                    self._retire()
                    return
                job = cache._next_job(self)
                if job is None:
                    self.idle = True
                    self._cond.notify_all()  # settle() waits for this
                    del cache
                    if not self._cond.wait(IDLE_SECONDS) and self.idle:
                        self._retire()
                        return
                    continue
                batch = [job]
                while len(batch) < BATCH and (more := cache._more_of(self, job)) is not None:
                    batch.append(more)
            try:
                with _gate.driver_calls():
                    made: list[Job] = []
                    for j in batch:
                        with self._cond:
                            if j.owner is not self:  # taken over, or cancelled by a sleep
                                continue
                            if made and open_blocks.count:  # a step began: the rest is
                                break  # given back (the step takes what it needs)
                            j.started = True
                        cache._execute(j, upload=False)
                        made.append(j)
                    cache._upload_all(made)
            except BaseException:  # noqa: BLE001 - a thread must not die of one graph
                log.exception("vmm_core: preparing a graph executable ahead failed")
            finally:
                with self._cond:
                    for j in batch:
                        if j.owner is self:
                            if j.started:
                                cache._install(j)
                            else:  # interrupted before its driver call: give its room back
                                cache._cancel(j)
                del cache, job, batch


class AheadPreparation:
    """The part of :class:`~vmm_core.graphs.executables.ExecutableCache` that knows what
    comes next: replay blocks opening and ending (:meth:`pin`, :meth:`unpin`), the
    engine's hints (:meth:`expect`), the forecast's bets, the keys to make again after a
    wake, and the choice of the preparer's next job.  Every method runs under the cache's
    lock (taken here, or by the caller where it says so)."""

    # the cache's state these methods share (ExecutableCache.__init__ sets it)
    policy: Any
    counts: Any
    _lock: threading.RLock
    _cond: threading.Condition
    _closed: bool
    _stopping: bool
    _asleep: bool
    _ahead: bool
    _forecast: KeyForecast | None
    _slots: dict
    _pinned: list[KeySlot]
    _owned: dict[int, Owned]
    _res: Residency
    _pending: dict[int, Job]
    _over_budget: list
    _order: list | None
    _capacity: int | None
    _clock: int
    _epoch: int
    _hints: list
    _hinted: bool
    _bets: list
    _woken: list
    _slept: list[int]
    _worker: Preparer | None
    _claim: Callable[..., Job | None]
    _job: Callable[..., Job]
    _calls: Any
    _execute: Callable[[Job], None]
    _upload_all: Callable[[list], None]
    _install: Callable[..., None]
    _destroy_quietly: Callable[[Any], None]
    _reap: Callable[[], None]

    def pin(self, key, block, step: bool = True) -> KeySlot | None:
        """The replay block ``block`` of ``key`` opens on this thread
        (:class:`~.exec_blocks.replay_block`); ``step=False``: one graph's launch outside
        a block of its key (a use of the key, but not a step: the forecast and the hints
        do not count it).  Whatever cuts it, an interrupt included, leaves the block closed."""
        with self._lock:
            self._reap()
            slot = self._slots.get(key)
            if slot is None:
                return None
            first = not slot.blocks
            slot.blocks.append(block)  # from here on the block is open: undone below
            try:
                if first:
                    slot.thread = threading.get_ident()
                    self._pinned.append(slot)
                    open_blocks.opened(slot)
                    self._clock += 1
                    slot.last_use = self._clock
                    slot.uses += 1
                    if self._forecast is None:
                        self._order = None
                wake = False
                if first and step:
                    if self._hints:  # the hint came true, or was wrong: it is used
                        self._hints = self._hints[1:] if self._hints[0] == key else []
                    self.counts.blocks += 1
                    if not slot.complete:
                        self.counts.cold_blocks += 1
                        wake = self._ahead and not self._closed
                if wake:
                    self._wake_worker()
                return slot
            except BaseException as exc:  # a Ctrl-C: the block never opened for its caller
                failed, (resume, _) = exc, self._end_block(slot, block, learn=False)
        try:
            self._resume_all(resume)
            raise failed
        finally:
            del failed

    def abandon(self, block) -> None:
        """End ``block`` wherever it is open: its opening was cut after :meth:`pin` put
        it on its slot and before the block recorded the slot."""
        with self._lock:
            slots = [s for s in self._slots.values() if block in s.blocks]
        for slot in slots:
            self.unpin(slot, block, step=False)

    def unpin(self, slot: KeySlot, block, step: bool = True) -> None:
        """The replay block ``block`` of ``slot``'s key ends: destroy what waited for it,
        and (ahead, a step) learn from it and bet on the next block.  Called again after
        an interrupt cut it, it completes what the first call left."""
        with self._lock:
            resume, bet = self._end_block(slot, block, learn=step)
        self._resume_all(resume)  # the last block ended: work put off goes on
        if bet:  # the keys the forecast bets on next, woken last (see Preparer.wake)
            self._resume()

    def _end_block(self, slot: KeySlot, block, learn: bool) -> tuple[list, bool]:
        """Under the lock: ``block`` of ``slot``'s key ends.  The caches to resume
        (outside the lock) when it was the last open block of the process, and whether
        the forecast made bets to prepare.  Each step is idempotent, so a call after one
        an interrupt cut completes it (the forecast learns only on the first)."""
        ended = block in slot.blocks
        if ended:
            slot.blocks.remove(block)
        if slot.blocks:
            return [], False
        if slot in self._pinned:
            self._pinned.remove(slot)
        resume = open_blocks.closed(slot)
        if slot.deferred:
            # each handle destroyed exactly once: cut between taking it off the list
            # and destroying it, it would be lost, destroyed twice the other way round
            with interrupts.held("the destruction of executables a replay block kept"):
                deferred, slot.deferred = slot.deferred, []
                for handle in deferred:
                    self._destroy_quietly(handle)
        if ended and self._forecast is not None and not self._closed and learn:
            return resume, self._learn(slot)
        return resume, not ended and bool(self._bets)  # bets a cut end left unwoken

    @staticmethod
    def _resume_all(caches) -> None:
        """Wake each cache's preparer; an interrupt in one still wakes the others (a
        wake is idempotent: the one it cut is woken again), then is raised."""
        failed = None
        for cache in caches:
            try:
                open_blocks.resumed(cache)
                cache._resume()
            except BaseException as exc:
                if failed is None:
                    failed = exc
                with contextlib.suppress(Exception):
                    cache._resume()
        if failed is not None:
            try:
                raise failed
            finally:
                del failed

    def _resume(self) -> None:
        with self._lock:
            if self._ahead and not self._closed:
                self._wake_worker()

    def _learn(self, slot: KeySlot) -> bool:
        """Under the lock, as a step's block ends: the forecast observes it and bets on
        the next block (True: there are bets to prepare)."""
        forecast = self._forecast
        assert forecast is not None
        forecast.capacity = self._keys_the_budget_holds()
        forecast.observe(slot.key)
        self._order = None
        # an engine that named the key of this block will name the next one too: its
        # hint beats a bet, which would only make what the hint then gives up
        hinted, self._hinted = self._hinted, False
        self._bets = [] if hinted else [(k, p) for k, p in forecast.bets(BET_AT_LEAST)
                                        if not self._slots[k].complete]
        return bool(self._bets)

    def _keys_the_budget_holds(self) -> int:
        """How many keys' executables the budget holds, for the forecast's shadows (the
        average key's graphs; kept until a capture or a reset changes them)."""
        if self._capacity is None:
            self._capacity = self._count_keys_the_budget_holds()
        return self._capacity

    def _count_keys_the_budget_holds(self) -> int:
        p = self.policy
        per_key = [len(s.tokens) for s in self._slots.values() if s.tokens]
        if not per_key or p.max_count is None:
            per_key_bytes = [s.nbytes for s in self._slots.values() if s.tokens]
            if p.max_bytes is None or not per_key_bytes:
                return max(1, len(self._slots))
            return max(1, p.max_bytes * len(per_key_bytes) // sum(per_key_bytes))
        return max(1, p.max_count * len(per_key) // sum(per_key))

    def expect(self, keys) -> None:
        """The engine's hint: the next replay blocks are of ``keys``, next first (the
        previous hint is replaced).  Ahead, their executables are prepared now in place
        of the keys valued least; a key never replayed only costs that work."""
        with self._lock:
            self.counts.hints += 1
            if not self._ahead or self._closed:
                return
            self._hinted = True
            self._hints = [k for k in dict.fromkeys(keys) if k in self._slots]
            if any(not self._slots[k].complete for k in self._hints):
                self._wake_worker()

    def _wake_worker(self) -> None:
        if self._worker is None:
            self._worker = Preparer(self)
        self._worker.wake()

    def _next_job(self, worker: Preparer) -> Job | None:
        """Under the lock, for the preparer: the next graph to prepare.  First the open
        blocks' keys (in the step's order), then the engine's hints, the forecast's bets
        and the keys woken; each takes room only from keys it may displace (a bet: keys
        less likely next; keys woken: free room only).  A target that cannot get room is
        dropped."""
        if self._stopping or self._asleep:  # a sleep or a close waits for the call in
            return None  # flight; asleep, the hints wait for the wake
        pinned = {id(s) for s in self._pinned}
        hinted = set(self._hints)

        def unprotected(s: KeySlot) -> bool:
            return id(s) not in pinned and s.key not in hinted

        forecast = self._forecast

        def displacing(key, below: float | None = None) -> Callable[[KeySlot], bool]:
            def allowed(s: KeySlot) -> bool:
                return unprotected(s) and s.key != key and \
                    (below is None or forecast is None or forecast.chance(s.key) < below)
            return allowed

        def free_room_only(s: KeySlot) -> bool:
            return False

        targets: list[tuple[KeySlot, Callable[[KeySlot], bool]]]
        targets = [(s, unprotected) for s in self._pinned]
        job = self._first_job(worker, targets)
        remakes = self._remakes_slower
        if job is not None or not (self._hints or self._bets or self._woken or remakes):
            return job
        if open_blocks.defer(self):  # a step is launching: the rest waits for its end
            return None
        targets = [(self._slots[k], displacing(k)) for k in self._hints]
        targets += [(self._slots[k], displacing(k, p)) for k, p in self._bets]
        targets += [(self._slots[k], free_room_only) for k in self._woken
                    if k in self._slots]
        job = self._first_job(worker, targets)
        if job is None and remakes:
            job = self._remake_job(worker)
        return job

    @property
    def _remakes_slower(self) -> bool:
        """Whether updated executables are made again (the backend says they run
        slower) and one is resident."""
        return bool(self._res.updated) and self._calls.updated_runs_slower

    def _remake_job(self, worker: Preparer) -> Job | None:
        """Under the lock, with nothing else to prepare and no block open: an updated
        executable to make again from the graph it runs, the keys valued most first
        (the engine's next key, then the forecast's), each key's last pieces first (a
        block that opens meanwhile waits for one graph at most, and late in its step).
        Its old handle is destroyed before the new one is made: the budget holds."""
        ranks = self._forecast.ranks() if self._forecast is not None else {}
        hinted = {k: i for i, k in enumerate(self._hints)}
        slots = sorted((s for s in self._slots.values() if s.updated and not s.depth),
                       key=lambda s: (hinted.get(s.key, len(hinted)),
                                      -ranks.get(s.key, 0.0), -s.last_use))
        for slot in slots:
            for token in reversed(slot.tokens):
                entry = slot.resident.get(token)
                if entry is None or not entry.updated or token in self._pending:
                    continue
                graph, owned = entry.ref(), self._owned.get(token)
                if graph is not None and owned is not None and owned.ref() is graph:
                    return self._remake(worker, entry, graph, owned)
        return None

    def _remake(self, worker: Preparer, entry, graph, owned: Owned) -> Job:
        self._res.detach(entry)  # still counted: its handle is destroyed by the job
        job = self._job(graph, owned, REMAKE, None, entry.nbytes, [entry.handle], True)
        job.owner, job.allowed, job.wager = worker, None, entry.wager
        return job

    def _first_job(self, worker: Preparer, targets) -> Job | None:
        """The first graph of ``targets`` (slot, which keys it may displace) with no
        executable and none being made, claimed for ``worker``; a target that cannot get
        room is dropped."""
        for slot, allowed in targets:
            if slot.key in self._over_budget:
                continue
            for token in slot.tokens:
                if token in self._res.resident or token in self._pending:
                    continue
                owned = self._owned[token]
                graph = owned.ref()
                if graph is None:
                    continue
                job = self._claim(graph, owned, allowed, upload=True)
                if job is not None:
                    job.owner, job.allowed = worker, allowed
                    return job
                self._drop_target(slot)
                break
        return None

    def _more_of(self, worker: Preparer, job: Job) -> Job | None:
        """Under the lock: another graph of ``job``'s key for the preparer's batch (for
        a remake, the next remake), if the key is one no block has open and no block is
        open anywhere (a step's own pieces go one by one: it launches each as soon as it
        is made)."""
        slot = job.owned.slot
        if slot is None or slot.depth or open_blocks.count:
            return None
        if job.kind == REMAKE:
            return self._remake_job(worker)
        if job.allowed is None:
            return None
        return self._first_job(worker, [(slot, job.allowed)])

    def _drop_target(self, slot: KeySlot) -> None:
        self._hints = [k for k in self._hints if k != slot.key]
        self._bets = [(k, p) for k, p in self._bets if k != slot.key]
        self._woken = [k for k in self._woken if k != slot.key]

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is being prepared ahead; False if ``timeout`` passed first."""
        def quiet() -> bool:
            worker = self._worker
            return not self._pending and (worker is None or worker.idle)

        with self._lock:
            return self._cond.wait_for(quiet, timeout)

    def _stop_preparing(self) -> None:
        """Under the lock: drop every target, cancel what the preparer has not begun and
        wait for what it has (its driver call ends; the executable is then destroyed)."""
        self._epoch += 1
        self._hints, self._bets, self._woken = [], [], []
        self._cancel_not_begun()
        # while it waits (the lock released) the thread begins nothing new: a remake of an
        # updated executable left out of its batch would be made only to be destroyed
        self._stopping = True
        try:
            self._cond.wait_for(lambda: not self._pending, IN_FLIGHT_WAIT)
        finally:
            self._stopping = False

    def _cancel_not_begun(self) -> int:
        """Under the lock: cancel what the thread has claimed and not begun (a remake
        puts its updated executable back unless a sleep or close is under way, any other
        job gives its room back).  For a sleep or close, and for a launch that finds no
        room: the thread may be held at a capture's gate by the very thread that
        launches, so waiting for it could be waiting for good."""
        jobs = [j for j in self._pending.values()
                if not j.started and isinstance(j.owner, Preparer)]
        for job in jobs:
            self._cancel(job)
        return len(jobs)

    def _cancel(self, job: Job) -> None:
        """Under the lock: a job the preparer has not begun is dropped (it skips it).  The
        executables it took are destroyed: the one an update would have taken (detached
        from its graph, still counted) and those evicted to make room (no longer counted)."""
        job.owner = False
        self._pending.pop(job.token, None)
        if job.kind == REMAKE and job.epoch == self._epoch and not self._closed and \
                job.owned.slot is not None and self._owned.get(job.token) is job.owned:
            # a remake cut before it began (a block opened): the updated executable
            # stays the graph's (it never stopped being counted)
            handle, = job.destroy
            self._res.install(Resident(handle, job.token, job.nbytes, job.topology,
                                       job.owned.slot, job.owned.ref, job.wager,
                                       updated=True))
            job.graph._vmm_exec = handle
            job.destroy, job.graph = [], None
            job.done.set()
            return
        self._res.unreserve(job.nbytes)
        for handle in [*job.destroy, *([job.handle] if job.handle is not None else [])]:
            self._destroy_quietly(handle)
        job.destroy, job.handle, job.graph = [], None, None
        job.done.set()
