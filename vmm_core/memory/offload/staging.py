"""The process-wide resources every offload copy shares: the pinned staging ring of each
backend and device, and the host copy threads.

Pinning host memory costs far more than a copy through it, so the ring is made once per
process and device (or ahead of time, :func:`prepare_staging`) and reused by every tag
and sleep; the copy threads fault in, fill, drain and free host copies.  Both can be
given back (:func:`release_staging`) while other threads copy: a copy that finds its
ring closed takes a new one, and work handed to threads that were shut down runs on the
calling thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ... import forksafe, interrupts
from ...errors import CaptureError
from .. import tag_state
from ..host_memory import PARALLEL_RELEASE_BYTES, HostCopy, MappedHostCopy
from .settings import OffloadConfig, choose_strategy, config
from .workers import Workers

__all__ = ["prepare_staging", "staging_bytes", "release_staging", "release"]

_lock = threading.Lock()  # the rings and the copy threads
_rings: dict = {}  # (backend name, device) -> StagingRing
_executor: ThreadPoolExecutor | None = None
_executor_threads = 0


class StagingRing:
    """Pinned staging slots for one (backend, device), reused by every tag and sleep."""

    def __init__(self, backend, device: int, chunk: int, slots: int) -> None:
        self.chunk, self.slots = chunk, slots
        self.lock = threading.Lock()  # one pipeline at a time per ring
        self.closed = False  # set under ``lock`` by release_staging: take a new ring
        total = chunk * slots
        buf = backend.host_buffer(device, total, pinned=True)
        if buf is None:  # no pinned allocator (host backend): plain memory
            buf = (ctypes.c_char * total)()
            base = ctypes.addressof(buf)
        else:
            base = int(buf.address)
        self._buffer = buf
        self.nbytes = total
        self.addresses = [base + i * chunk for i in range(slots)]


def staging_ring(backend, device: int, cfg: OffloadConfig) -> tuple[StagingRing, float]:
    """The ring of ``(backend, device)`` sized as ``cfg`` says, made now if it is not
    (and the seconds that took)."""
    key = (backend.name, device)
    with _lock:
        ring = _rings.get(key)
        if ring is not None and (ring.chunk, ring.slots) == (cfg.chunk_bytes, cfg.slots):
            return ring, 0.0
        t0 = time.perf_counter()
        ring = _rings[key] = StagingRing(backend, device, cfg.chunk_bytes, cfg.slots)
        return ring, time.perf_counter() - t0


class _Threads(Workers):
    """The copy threads.  release_staging (or a new thread count) shuts a pool down that
    another thread may still hand work to, and the interpreter's exit shuts every pool:
    such work runs on the calling thread instead of failing a sleep or wake midway.

    A submit that may start a thread holds Ctrl-C while it does: one raised inside
    ``Thread.start`` leaves a running worker the pool never recorded, which nothing tells
    to stop, and the interpreter's exit waits for it forever.  Once every thread runs,
    a submit holds nothing (a sleep's copy submits one task per chunk)."""

    def submit(self, fn, /, *args, **kwargs):
        try:
            return self._queue(fn, *args, **kwargs)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown",
            pass  # or no worker could start (then nothing stays queued: Workers)
        # shut down by release_staging or a new thread count: the pool that replaced it,
        # not this thread, which may hold Ctrl-C for the hand-over (once: it may be shut
        # down as well)
        with _lock:
            current = _executor
        threads = getattr(self, "_max_workers", 0)
        if current is None and threads:
            current = copy_threads(threads)
        if isinstance(current, _Threads) and current is not self:
            try:
                return current._queue(fn, *args, **kwargs)
            except RuntimeError:
                pass
        # the interpreter's exit (or pools shut down as fast as they are made): here
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - raised by result(), as a pool does
            future.set_exception(exc)
        return future

    def _queue(self, fn, /, *args, **kwargs) -> Future:
        # ThreadPoolExecutor's own books (3.8-3.13); without them every submit holds
        started, most = getattr(self, "_threads", None), getattr(self, "_max_workers", None)
        if started is not None and most is not None and len(started) >= most:
            return super().submit(fn, *args, **kwargs)
        return self._submit_starting(fn, *args, **kwargs)

    def _submit_starting(self, fn, /, *args, **kwargs) -> Future:
        future: Future | None = None
        try:
            with interrupts.held("the start of a host copy thread"):
                future = super().submit(fn, *args, **kwargs)
        except KeyboardInterrupt:
            # raised as the hold ended, the work queued: its caller never sees the
            # future, so the work must not run on after this raises
            if future is not None and not future.cancel():
                interrupts.settle([future], "a host copy thread's work")
            raise
        assert future is not None  # set in the block, or it raised
        return future


def copy_threads(threads: int) -> ThreadPoolExecutor:
    """The pool of ``threads`` host copy threads (a new one when the count changed)."""
    global _executor, _executor_threads
    with _lock:
        if _executor is None or _executor_threads != threads:
            if _executor is not None:
                _executor.shutdown(wait=False)  # running work finishes on the old threads
            _executor = _Threads(threads, thread_name_prefix="vmm_core-offload")
            _executor_threads = threads
        return _executor


@contextlib.contextmanager
def no_capture():
    """Hold the lock of tagged memory, which every graph capture block holds: pinning
    (cudaHostRegister, cudaHostAlloc) on one thread while another captures a device graph
    in global mode is refused, or breaks that capture.  Re-entrant: a sleep holding it
    makes the staging ring without waiting for itself; so a capture block of this thread
    would not keep it out either, and is refused instead."""
    tag_state.refuse_in_capture("offload.prepare", CaptureError)
    with tag_state.state_lock():
        yield


def prepare_staging(backend, device: int = 0) -> float:
    """Allocate the staging ring and start the copy threads now, so that the first
    sleep does not pay for them; returns the seconds it took (0 if nothing to do)."""
    cfg = config()
    if choose_strategy(backend, device, cfg) != "staged":
        return 0.0
    with no_capture():
        return _prepare_staging(backend, device, cfg)


def _prepare_staging(backend, device: int, cfg: OffloadConfig) -> float:
    t0 = time.perf_counter()
    staging_ring(backend, device, cfg)
    pool = copy_threads(cfg.host_threads())
    for f in [pool.submit(time.sleep, 0) for _ in range(cfg.host_threads())]:
        f.result()  # the pool starts its threads on demand
    return time.perf_counter() - t0


def staging_bytes() -> int:
    """Pinned host bytes held by staging rings in this process."""
    with _lock:
        return sum(r.nbytes for r in _rings.values())


def release_staging() -> None:
    """Free the staging rings and host threads; the next staged offload makes new ones."""
    global _executor
    with _lock:
        rings = list(_rings.values())
        _rings.clear()
        executor, _executor = _executor, None
    for ring in rings:
        with ring.lock:  # wait for a pipeline that still uses it
            ring.closed = True  # one that found it but has not locked it yet looks again
            ring._buffer = None
    if executor is not None:
        executor.shutdown(wait=True)


def release(host: HostCopy | None) -> float:
    """Free a host copy (from the copy threads when large); returns the seconds it took."""
    if host is None:
        return 0.0
    t0 = time.perf_counter()
    cfg = config()
    if cfg.parallel_release and isinstance(host, MappedHostCopy) \
            and host.size >= PARALLEL_RELEASE_BYTES:
        host.release(copy_threads(cfg.host_threads()), cfg.host_threads())
    else:
        host.release()
    return time.perf_counter() - t0


def _after_fork_in_child() -> None:
    """A forked child inherits the pool without its threads (work submitted there would
    wait forever) and a lock that a parent thread may have held at the fork: start afresh.
    The parent's rings are kept, unused, so that the child never frees the parent's
    pinned memory through a driver it cannot use."""
    global _lock, _executor, _executor_threads, _rings
    _orphans.extend(_rings.values())
    _lock, _executor, _executor_threads, _rings = threading.Lock(), None, 0, {}


_orphans: list = []
forksafe.at_fork("offload", after_in_child=_after_fork_in_child)
