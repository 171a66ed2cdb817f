"""Where the time of one group sleep or wake went, on this rank.

A group sleep is an agreement, then each step's local work (the offload copy, waiting
for a background registration, unmapping and releasing the pages) and a confirmation
that every rank finished it; a slow rank shows in the others' confirmation, a slow
copy in its own.  Every :func:`vmm_core.sleep` / :func:`vmm_core.wake_up` with
``group=`` records its phases here, and :func:`last_timings` gives the last one of each
kind, so a benchmark (or an engine's log) can print them per rank without timing the
library from outside.

Phase names, in the order they happen:

``resume communicators`` (wake) / ``suspend communicators`` (sleep)
    releasing or restoring the communicators' device memory (``communicators=``);
``agree``
    the first collective: every rank's plan (tags, offload, options).  It waits for
    the last rank to arrive, and on a group whose communicator was never used it also
    sets that up (:func:`vmm_core.distributed.prepare_group` does it ahead of time);
``copy``
    device to host (sleep) or back (wake), summed over the allocators that moved bytes;
``pin wait``
    a copy waiting for its host memory's background registration to finish;
``unmap+release`` (sleep) / ``map`` (wake)
    the rest of the local work: synchronizing, unmapping and releasing handles, or
    creating handles and mapping them;
``confirm``
    the collective after each step: every rank reports how its step went (the time the
    fastest rank waits for the slowest shows here).
"""

from __future__ import annotations

import contextlib
import threading
import time

__all__ = ["Recorder", "last_timings"]

_lock = threading.Lock()
_last: dict[str, dict] = {}


class Recorder:
    """The phases of one group call on this rank, summed by name in first-seen order."""

    def __init__(self, call: str, rank: int) -> None:
        self.call, self.rank = call, rank
        self.phases: dict[str, float] = {}
        self.copied_bytes = 0
        self._start = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + max(0.0, seconds)

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def transfers(self, before: dict, allocators, local_name: str, local_s: float) -> None:
        """Split ``local_s`` of local work into copy, pin wait and the rest
        (``local_name``): the copies are the transfers of ``allocators`` that are not the
        ones ``before`` (allocator -> its last transfer) remembered."""
        copy = wait = 0.0
        for alloc in allocators:
            moved = alloc.last_transfer
            if moved is None or moved is before.get(alloc):
                continue
            copy += moved.seconds
            wait += moved.pin_wait_seconds
            self.copied_bytes += moved.nbytes
        self.add("copy", copy - wait)
        self.add("pin wait", wait)
        self.add(local_name, local_s - copy)

    def finish(self, ok: bool) -> None:
        record = {"call": self.call, "rank": self.rank, "ok": ok,
                  "total_s": time.perf_counter() - self._start,
                  "phases": dict(self.phases), "copied_bytes": self.copied_bytes}
        with _lock:
            _last[self.call] = record


def last_timings(call: str = "sleep") -> dict | None:
    """The phases of this process's last group ``call`` ("sleep" or "wake_up"), or None.

    ``{"call", "rank", "ok", "total_s", "copied_bytes", "phases": {name: seconds}}``:
    the phases in the order they first happened (see this module for what each is); a
    call that failed has ``ok`` False and the phases it reached."""
    if call not in ("sleep", "wake_up"):
        raise ValueError(f"last_timings: call must be 'sleep' or 'wake_up', got {call!r}")
    with _lock:
        record = _last.get(call)
        return None if record is None else {**record, "phases": dict(record["phases"])}
