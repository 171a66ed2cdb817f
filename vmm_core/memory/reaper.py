"""Teardown of dropped objects on a helper thread, never inside the garbage collector.

The collector runs finalizers at whatever allocation triggers it, also while this thread
holds a backend's lock in the middle of a map.  Closing an allocator there re-enters the
backend and deadlocks on the backend's own lock.  Finalizers
therefore only queue the work (``SimpleQueue.put`` is safe inside ``__del__`` and weakref
callbacks); a daemon thread runs it, taking the locks in their normal order.

At interpreter exit the thread is stopped and joined before finalization (an ``atexit``
handler).  A daemon thread still running then is the crash to avoid: a teardown waits in
the device runtime (``torch.cuda.synchronize`` with the GIL released), the interpreter
finalizes meanwhile, and when the call returns Python ends the thread with
``pthread_exit``, whose forced unwind through the C++ binding calls ``std::terminate``:
a process whose last GraphPool is dropped just before exit aborts with "terminate called
without an active exception" (on an H100).

Exit does not wait for a teardown that waits for a lock: the exiting thread itself may
hold it (a capture, replay, ``hold_awake`` or region block entered and never left, say in
a suspended generator) or a daemon thread that never lets it go, and exit would then wait
the whole timeout.  Teardowns take their first lock through :func:`acquire`, which gives up
once exit began: a thread waiting for a lock is in no C++ call, so it is safe to leave,
and the memory the skipped teardown held goes back to the system with the process.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time

from .. import forksafe

__all__ = ["start", "close_later", "drain", "acquire"]

logger = logging.getLogger("vmm_core")

_queue: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()
_exiting = False
#: how long interpreter exit waits for the teardowns still queued
EXIT_TIMEOUT_S = 60.0
_said_abandoned = False


class _Stop:
    """The last item exit queues; ``done`` is set when the thread has run the rest."""

    def __init__(self) -> None:
        self.done = threading.Event()


class _Abandoned(Exception):
    """A teardown gave up waiting for a lock because the interpreter is exiting."""


@contextlib.contextmanager
def acquire(lock):
    """``with lock`` for teardown code; on the reaper thread, waiting for ``lock`` gives up
    (skipping the teardown) once interpreter exit began."""
    if threading.current_thread() is not _thread:
        with lock:
            yield
        return
    while not lock.acquire(timeout=0.05):
        if _exiting:
            raise _Abandoned
    try:
        yield
    finally:
        lock.release()


def start() -> None:
    """Start the thread (from ordinary code: starting it from a finalizer is unsafe)."""
    global _thread
    with _start_lock:
        if _exiting:  # no new thread once exit has joined the last one
            return
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="vmm_core-reaper", daemon=True)
            _thread.start()


def close_later(fn, *args) -> None:
    """Run ``fn(*args)`` on the reaper thread; safe to call from a finalizer."""
    _queue.put((fn, args))


def drain(timeout: float = 10.0) -> bool:
    """Wait until everything queued so far has run; False on timeout or after exit began."""
    if _exiting:
        return False
    start()
    done = threading.Event()
    _queue.put(done)
    return done.wait(timeout)


def _after_fork_in_child() -> None:
    """A forked child inherits the thread object, not the thread: start afresh there."""
    global _thread, _queue, _start_lock, _exiting
    _thread, _queue, _start_lock = None, queue.SimpleQueue(), threading.Lock()
    _exiting = False


def _stop_at_exit(timeout: float | None = None) -> None:
    """Run what is queued, then end the thread, before the interpreter finalizes."""
    global _exiting
    with _start_lock:
        _exiting = True
        thread = _thread
    if thread is None or not thread.is_alive():
        return
    stop = _Stop()
    _queue.put(stop)
    limit = EXIT_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + limit
    interrupted = False
    # an Event, not Thread.join: a join interrupted by Ctrl-C marks the thread stopped
    # while it still runs (Python 3.11), and a second join then returns at once
    while not stop.done.is_set() and time.monotonic() < deadline:
        try:
            stop.done.wait(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            # leaving now ends the thread inside the teardown: the very abort this
            # wait avoids; one Ctrl-C keeps waiting and says why, a second one leaves
            if interrupted:
                raise
            interrupted = True
            logger.warning("vmm_core: interpreter exit waits (at most %.0f s more) for "
                           "the teardown of a dropped object: ending the process inside "
                           "it aborts it. Press Ctrl-C again to stop waiting",
                           max(0.0, deadline - time.monotonic()))
    if stop.done.is_set():
        thread.join(max(0.0, deadline - time.monotonic()))  # only returns from _run now
    else:
        logger.warning("vmm_core: a teardown of a dropped object was still running %.0f s "
                       "into interpreter exit; the process may abort when it returns. "
                       "Close GraphPools and mapped tensors explicitly before exiting",
                       limit)


atexit.register(_stop_at_exit)

forksafe.at_fork("teardown", after_in_child=_after_fork_in_child)


def _run() -> None:
    global _said_abandoned
    while True:
        item = _queue.get()
        if isinstance(item, _Stop):
            item.done.set()
            return
        if isinstance(item, threading.Event):
            item.set()
            continue
        fn, args = item
        try:
            fn(*args)
        except _Abandoned:
            if not _said_abandoned:
                _said_abandoned = True
                logger.warning("vmm_core: at interpreter exit, a dropped GraphPool "
                               "waited for the tagged-memory lock, which another thread "
                               "or a capture, replay, hold_awake or region block left open "
                               "(e.g. in a suspended generator) holds; it is not given "
                               "back, the process frees its memory as it exits. Close "
                               "GraphPools and leave such blocks before exiting")
        except Exception:  # a failed teardown must not kill the thread: say so, go on
            try:
                logger.warning("vmm_core: tearing down a dropped object (%s) failed; what "
                               "it held may stay allocated until the process exits. Close "
                               "it explicitly to see the error where it happens",
                               getattr(fn, "__qualname__", fn), exc_info=True)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
