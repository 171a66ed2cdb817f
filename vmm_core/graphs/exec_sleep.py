"""What a sleep and a wake of a GraphPool's memory do to the executables it owns.

A sleep destroys every executable (the driver keeps their memory for later executables
rather than showing it free, docs/executables.md) and remembers which were resident.  A
wake makes them again: eagerly, before the wake returns, where the caller asks
(``wake_up(..., eager=True)``) or the policy does (``ExecutablePolicy(eager_wake=True)``);
else each at its graph's first replay, or, preparing ahead, the keys resident at the sleep
in the background, the most valued first.  While the memory sleeps nothing is made: the
preparer waits for the wake with the hints it was given.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import VMMFallbackWarning
from .exec_ahead import REMAKE, Job
from .exec_forecast import KeyForecast
from .exec_residency import Owned, Residency, Resident

__all__ = ["SleepingExecutables"]


class SleepingExecutables:
    """The part of :class:`~vmm_core.graphs.executables.ExecutableCache` that a sleep
    listener of the pool's allocator calls (:meth:`on_memory_event`)."""

    # the cache's state these methods share (ExecutableCache.__init__ sets it)
    policy: Any
    counts: Any
    last_sleep: dict | None
    _lock: threading.RLock
    _closed: bool
    _asleep: bool
    _ahead: bool
    _forecast: KeyForecast | None
    _owned: dict[int, Owned]
    _res: Residency
    _pending: dict[int, Job]
    _epoch: int
    _hints: list
    _bets: list
    _woken: list
    _slept: list[int]
    _calls: Any
    _claim: Callable[..., Job | None]
    _execute: Callable[[Job], None]
    _make_inline: Callable[[Job], None]
    _cancel: Callable[[Job], None]
    _install: Callable[..., None]
    _stop_preparing: Callable[[], None]
    _wake_worker: Callable[[], None]
    _wasted: Callable[[Resident], None]
    _reap: Callable[[], None]

    def on_memory_event(self, event: str, **kw) -> None:
        """The pool's allocator slept (destroy every executable) or woke (with
        ``eager=True``, or a policy of ``eager_wake``, make again those resident at the
        sleep; ahead, the keys resident then are made again in the background, the most
        valued first)."""
        if event == "sleep":
            self.release()
        elif event == "wake":
            alloc = kw.get("allocator")
            with self._lock:
                if alloc is not None and alloc.asleep:
                    return  # slept again before this wake was heard: the next wake's
                self._asleep = False
                epoch = self._epoch  # a sleep from here on moves it
            cut = True
            try:
                if kw.get("eager") or self.policy.eager_wake:
                    self.reinstantiate(epoch)
                cut = False
            finally:  # its warning may be an error, an interrupt may come: this still runs
                self._after_wake(epoch, keep=cut)

    def _after_wake(self, epoch: int, keep: bool) -> None:
        """Ahead: the keys resident at the sleep and not made yet, and the hints given
        while asleep, go to the preparer, unless a sleep or close came since the wake.
        ``keep``: an eager wake was cut, what it did not make stays for the next one."""
        with self._lock:
            if self._asleep or self._epoch != epoch:  # slept again (or closed) meanwhile:
                return  # what is left waits for the next wake
            ahead = self._ahead and not self._closed
            if ahead:
                keys = dict.fromkeys(self._owned[t].key for t in self._slept
                                     if t in self._owned)
                ranks = self._forecast.ranks() if self._forecast is not None else {}
                self._woken = sorted(keys, key=lambda k: -ranks.get(k, 0.0))
            if not keep:
                self._slept = []
            if ahead and (self._woken or self._hints or self._bets):
                self._wake_worker()  # last; hints given while asleep waited for the wake

    def release(self) -> dict:
        """Destroy every executable (sleep); returns what was released: the count, their
        estimated bytes and the change of the device's free memory the driver reports
        (None where the backend cannot tell)."""
        with self._lock:
            # a graph whose updated executable was being made again had one at the sleep;
            # stopping destroys it (the epoch moves first: none goes back to residency)
            remaking = {t: j.nbytes for t, j in self._pending.items() if j.kind == REMAKE}
            self._asleep = True  # the preparer makes nothing until the wake
            self._stop_preparing()
            self._reap()
            before = self._calls.device_free_bytes()
            entries = list(self._res.resident.values())
            # what an eager wake left to make (a sleep or an interrupt cut it) first, so
            # that under a budget the executables resident now are made last, and stay
            resident = [e.token for e in entries] + list(remaking)
            self._keep_for_wake(resident, first=False)
            released = sum(e.nbytes for e in entries) + sum(remaking.values())
            error = self._destroy_all(entries)
            after = self._calls.device_free_bytes()
            self.last_sleep = {
                "executables": len(entries) + len(remaking), "bytes": released,
                "driver_free_change": None if before is None or after is None
                else after - before}
            self.counts.released_on_sleep += len(entries) + len(remaking)
            self.counts.released_on_sleep_bytes += released
            if error is not None:
                raise error
            return dict(self.last_sleep)

    def _destroy_all(self, entries) -> BaseException | None:
        error = None
        for entry in entries:
            self._res.evict(entry)
            self._wasted(entry)
            try:
                self._calls.destroy(entry.handle)
            except Exception as exc:  # noqa: BLE001 - the others still go
                error = error or exc
        return error

    def _keep_for_wake(self, tokens: list[int], first: bool = True) -> None:
        """Under the lock: add ``tokens`` to what the next eager wake makes, before what
        is there (``first``: left over from a wake that was cut) or after it (resident
        at a sleep: made last, so a budget keeps them)."""
        if first:
            self._slept = [t for t in tokens if t not in self._slept] + self._slept
        else:
            self._slept = [t for t in self._slept if t not in tokens] + list(tokens)

    def reinstantiate(self, epoch: int | None = None) -> int:
        """Make again, before returning, the executables resident at the last sleep
        (eager wake), each uploaded; returns how many.  ``epoch``: the cache's when the
        wake was heard (nothing is made if a sleep or close came since).

        One that cannot be made (out of memory) is said in a warning and made at its
        graph's first replay instead; an interrupt stops the wake's making and is raised,
        what is left kept for the next eager wake; a sleep or a close meanwhile ends it
        (what the sleep found resident, and what was still to make, waits for the next
        wake)."""
        made, failed = 0, []
        with self._lock:
            if epoch is not None and epoch != self._epoch:
                return 0  # slept or closed since the wake: the next wake makes them
            tokens, self._slept = self._slept, []
            epoch = self._epoch
        job, at = None, 0
        try:
            for at, token in enumerate(tokens):
                with self._lock:
                    if self._epoch != epoch:  # slept or closed meanwhile
                        self._keep_for_wake(tokens[at:])
                        break
                    owned = self._owned.get(token)
                    graph = owned.ref() if owned is not None else None
                    if self._closed or owned is None or graph is None or \
                            owned.slot is None or token in self._res.resident or \
                            token in self._pending:
                        continue  # (no slot: found drawing random numbers since the sleep)
                    job = self._claim(graph, owned, lambda s: s.depth == 0, upload=True)
                    if job is None:
                        continue
                    job.started = True
                self._make_inline(job)  # Ctrl-C held from its driver calls to its install
                with self._lock:
                    if job.epoch != self._epoch:  # made as a sleep came: destroyed, kept
                        self._keep_for_wake([token])
                    made += job.error is None and job.refused is None
                    if job.error is not None and not isinstance(job.error, Exception):
                        raise job.error  # an interrupt a program's own handler raised
                    if job.error is not None:
                        failed.append(job.error)
        except BaseException:
            # an interrupt: the rest waits for the next wake, a job cut before its hold
            # is dropped (left pending, its graph's launches would wait for it)
            with self._lock:
                if job is not None and not job.done.is_set():
                    self._cancel(job)
                self.counts.eager_instantiations += made
                self._keep_for_wake(tokens[at:])
            raise
        with self._lock:
            self.counts.eager_instantiations += made
        if failed:
            warnings.warn(f"GraphPool executables: the eager wake made {made} of the "
                          f"executables resident at the sleep; {len(failed)} could not be "
                          f"made ({type(failed[0]).__name__}: {failed[0]}): each is made at "
                          f"its graph's first replay instead", VMMFallbackWarning,
                          stacklevel=2)
        return made
