"""Host copies made ahead of the sleep that fills them.

The first offloading sleep of a tag would otherwise fault in and pin a fresh host copy
on the critical path, at a few GiB/s against ~50 GiB/s for the copy.  :func:`prepare`
makes pinned copies at model load (of tags, or a number of bytes any tag may take), and
:func:`prepare_later` makes one off the calling thread when a ``region(tag,
prepare_offload=True)`` ends; a sleep that comes first waits only for the pages, never
for the registration.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import threading
import time
from concurrent.futures import Future

from ... import forksafe, interrupts, registry
from ...errors import OutOfMemoryError, VMMError
from ...sizes import byte_count
from .. import tag_state
from ..host_memory import HostCopy, MappedHostCopy, PinnedHostCopy, check_host_fits
from . import staging
from .pinning import fail_in_child, pin_later, wait_for_pinning
from .settings import choose_strategy, config
from .workers import Workers

__all__ = ["prepare", "release_prepared", "prepared_bytes", "prepared_copy",
           "prepare_later", "PendingCopy", "wait_for_prepared"]

logger = logging.getLogger("vmm_core")

_lock = threading.Lock()  # the reserve, and the copies being made in the background
_reserve: list = []  # prepared copies no tag has taken yet (prepare(nbytes))
_prepare_executor: Workers | None = None
_preparing: set = set()  # background copies being made (a forked child fails them)


def prepare(what, backend=None, device: int | None = None) -> float:
    """Pin host memory for offload now, off the critical path (at model load), so that
    even the first sleep copies straight between device and pinned host memory.

    ``what`` is a tag or a list of tags: every allocator of those tags gets a host copy
    of exactly its current size, first-touched by the copy threads in parallel and
    registered with its backend, which its next offloading sleep fills (and which is
    kept, like any kept copy).  Or an int of bytes: one such copy, not yet any tag's,
    that the first offload of a tag needing at most that many bytes takes whole (its
    host bytes then count the whole copy: prepare the size you will offload).  Or a
    Backend: only the staging ring and copy threads (:func:`.staging.prepare_staging`).
    Returns the seconds it took.
    """
    with staging.no_capture():
        return _prepare(what, backend, device)


def _prepare(what, backend, device: int | None) -> float:
    t0 = time.perf_counter()
    if isinstance(what, bool) or not (
            isinstance(what, (numbers.Integral, str, list, tuple, set, frozenset))
            or hasattr(what, "implements")):  # a Backend, or a stand-in of one
        raise ValueError(f"offload.prepare: expected tags or a number of bytes (or a Backend), "
                         f"got {what!r}: a tag, a list of tags, an int of bytes, or a "
                         f"vmm_core Backend")
    if isinstance(what, numbers.Integral):  # numpy's too (np.prod(shape) * itemsize)
        what = int(what)
        if what <= 0:
            raise ValueError(f"offload.prepare: bytes must be positive, got {what}")
        # refused before the staging ring or anything else is made
        remedy = "prepare fewer bytes, or free host memory first"
        what = byte_count("offload.prepare: bytes", what, error=OutOfMemoryError,
                          remedy=remedy)
        check_host_fits(what, "offload.prepare", remedy)
        be = registry.resolve(backend)
        dev = tag_state.current_device(be) if device is None else device
        staging.prepare_staging(be, dev)
        copy = _pinned_copy_now(be, dev, what, prepared=True)
        return_to_reserve(copy)
        return time.perf_counter() - t0
    if isinstance(what, str) or isinstance(what, (list, tuple, set, frozenset)):
        names = tag_state.tag_list(what, "offload.prepare: tags")
        known = tag_state.tags()
        unknown = [t for t in names if t not in known]
        if unknown:
            raise VMMError(f"offload.prepare: no memory is tagged {unknown}; known tags: "
                           f"{known}. Call it after the tagged memory is allocated")
        # every tag is checked before any copy is made, and held awake until the last is
        # made (no direct sleep slips in between): a refused call pins nothing
        chosen = {id(a): a for tag in names for a in tag_state.allocators(tag)}
        with contextlib.ExitStack() as held:
            ready = []
            for alloc in sorted(chosen.values(), key=id):  # one order: no lock cycle
                try:
                    held.enter_context(alloc.hold_awake(
                        f"offload.prepare: memory tagged {alloc.tag!r}",
                        holder="offload.prepare"))
                except VMMError as exc:
                    if alloc.closed:  # closed meanwhile: no longer one of the tags
                        continue
                    raise type(exc)(f"{exc}; nothing was prepared") from None
                ready.append(alloc)
            # what the new copies take, less the copies they replace (freed first)
            wanted = [(a.host_copy_wanted(), a.host_bytes) for a in ready]
            check_host_fits(sum(new - old for new, old in wanted if new),
                            "offload.prepare", "prepare fewer tags, or free host memory "
                                               "first")
            for alloc in ready:
                staging.prepare_staging(alloc.backend, alloc.device)
                alloc.prepare_host_copy()
        return time.perf_counter() - t0
    return staging.prepare_staging(what, 0 if device is None else device)


def release_prepared() -> None:
    """Free the copies made by ``prepare(nbytes)`` that no tag has taken."""
    with _lock:
        copies = list(_reserve)
        _reserve.clear()
    for copy in copies:
        copy.release()


def prepared_bytes() -> int:
    """Host bytes made by ``prepare(nbytes)`` that no tag has taken yet."""
    with _lock:
        return sum(c.size for c in _reserve)


def take_reserve(total: int):
    """The smallest prepared copy that holds ``total`` bytes, taken out of the reserve."""
    with _lock:
        fitting = [c for c in _reserve if c.base is not None and c.size >= total]
        if not fitting:
            return None
        best = min(fitting, key=lambda c: c.size)
        _reserve.remove(best)
        return best


def return_to_reserve(copy) -> None:
    """A prepared copy no tag holds (made now, or taken by a copy that failed: the
    retry takes it again)."""
    with _lock:
        _reserve.append(copy)


def prepared_copy(backend, device: int, sizes: list[int]) -> HostCopy:
    """A pinned host copy for handles of ``sizes``, made now (``prepare``)."""
    if choose_strategy(backend, device) == "pinned":
        return PinnedHostCopy(backend, device, sizes)
    return _pinned_copy_now(backend, device, sum(sizes))


def _pinned_copy_now(backend, device: int, size: int, prepared: bool = False):
    cfg = config()
    copy = MappedHostCopy(size, hugepages=cfg.hugepages, prepared=prepared)
    try:
        copy.populate(staging.copy_threads(cfg.host_threads()), cfg.host_threads(),
                      touch=True)
        if cfg.pin_kept and backend.implements("vmm_host_register"):
            copy.register(backend, device)
    except BaseException:
        copy.release()
        raise
    return copy


class PendingCopy:
    """A host copy being made off the caller's thread (:func:`prepare_later`).

    Its pages are faulted in by the copy threads; once they are, the copy is handed to
    whoever :meth:`take` s it and its registration starts in the background (as a kept
    copy's does).  Never both held: an abandoned copy is freed as soon as it exists."""

    def __init__(self, size: int, future: Future) -> None:
        self.size = size
        self.future = future

    def fits(self, layout: list[int]) -> bool:
        return sum(layout) == self.size

    def _made(self) -> MappedHostCopy | None:
        if not self.future.done() or self.future.cancelled() or self.future.exception():
            return None
        return self.future.result()

    @property
    def held_bytes(self) -> int:
        copy = self._made()
        return copy.held_bytes if copy is not None else 0

    @property
    def pinned_bytes(self) -> int:
        copy = self._made()
        return copy.pinned_bytes if copy is not None else 0

    def take(self) -> MappedHostCopy | None:
        """The copy, once its pages are there; None if it was not started yet
        (cancelled: the caller makes its own copy without waiting) or failed."""
        if self.future.cancel():
            return None
        try:
            return self.future.result()
        except Exception as exc:  # noqa: BLE001 - the caller makes its own copy instead
            logger.warning("offload: a host copy of %d bytes prepared in the background "
                           "could not be made (%s); this sleep makes its own", self.size, exc)
            return None

    def abandon(self) -> None:
        """Not wanted any more: cancelled if not started, else freed once made."""
        if not self.future.cancel():
            self.future.add_done_callback(_release_result)


def _release_result(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        staging.release(future.result())


def prepare_later(backend, device: int, size: int) -> PendingCopy:
    """Start making a pinned host copy of ``size`` bytes off the calling thread.

    The pages are faulted in by the copy threads (no device call, so nothing here
    disturbs a graph capture); the registration then starts as a kept copy's does,
    under the lock of tagged memory (see :func:`.pinning.deferred_pinning`)."""
    global _prepare_executor
    cfg = config()

    def make() -> MappedHostCopy:
        copy = MappedHostCopy(size, hugepages=cfg.hugepages)
        try:
            copy.populate(staging.copy_threads(cfg.host_threads()), cfg.host_threads(),
                          touch=True)
        except BaseException:
            copy.release()
            raise
        return copy

    settled: Future = Future()  # done once the copy is made and its registration started

    def made(done: Future) -> None:
        try:
            if not done.cancelled() and done.exception() is None:
                pin_later(backend, device, done.result())  # a copy freed meanwhile is skipped
        finally:
            with _lock:
                _preparing.discard(done)
                _preparing.discard(settled)
            if not settled.done():  # a forked child failed it already
                settled.set_result(None)

    # Ctrl-C held, once the lock is had, while the executor may start its thread (cut
    # inside Thread.start, a worker it never recorded keeps the interpreter's exit
    # waiting) and until the copy is on the books and will call back: a Ctrl-C raised
    # before that would leave `settled` never done, and wait_for_prepared() waiting
    with interrupts.Held("the start of the thread that makes host copies ahead") as hold:
        with _lock:
            hold.arm()
            if _prepare_executor is None:
                _prepare_executor = Workers(1, thread_name_prefix="vmm_core-prepare")
            future = _prepare_executor.submit(make)
            _preparing.update((future, settled))
        future.add_done_callback(made)  # outside the lock: a finished one calls back now
    return PendingCopy(size, future)


def wait_for_prepared(timeout: float | None = None) -> bool:
    """Wait for host copies being made in the background (and then for their
    registrations); False on timeout."""
    from concurrent.futures import wait

    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        pending = list(_preparing)
    if wait(pending, timeout=timeout).not_done:
        return False
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return wait_for_pinning(left)


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a copy being made there never
    finishes, so nothing may wait for it, and the lock a parent thread may have held is
    replaced."""
    global _lock, _prepare_executor, _preparing
    _lock = threading.Lock()
    fail_in_child(_preparing)
    _prepare_executor, _preparing = None, set()


forksafe.at_fork("offload", after_in_child=_after_fork_in_child)
