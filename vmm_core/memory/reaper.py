"""Teardown of dropped objects on a helper thread, never inside the garbage collector.

The collector runs finalizers at whatever allocation triggers it, also while this thread
holds a backend's lock in the middle of a map.  Closing an allocator there re-enters the
backend and deadlocks (seen with the host backend's lock during a test run).  Finalizers
therefore only queue the work (``SimpleQueue.put`` is safe inside ``__del__`` and weakref
callbacks); a daemon thread runs it, taking the locks in their normal order.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

__all__ = ["start", "close_later", "drain"]

logger = logging.getLogger("vmm_core")

_queue: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def start() -> None:
    """Start the thread (from ordinary code: starting it from a finalizer is unsafe)."""
    global _thread
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="vmm_core-reaper", daemon=True)
            _thread.start()


def close_later(fn, *args) -> None:
    """Run ``fn(*args)`` on the reaper thread; safe to call from a finalizer."""
    _queue.put((fn, args))


def drain(timeout: float = 10.0) -> bool:
    """Wait until everything queued so far has run; False on timeout."""
    start()
    done = threading.Event()
    _queue.put(done)
    return done.wait(timeout)


def _after_fork_in_child() -> None:
    """A forked child inherits the thread object, not the thread: start afresh there."""
    global _thread, _queue, _start_lock
    _thread, _queue, _start_lock = None, queue.SimpleQueue(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _run() -> None:
    while True:
        item = _queue.get()
        if isinstance(item, threading.Event):
            item.set()
            continue
        fn, args = item
        try:
            fn(*args)
        except Exception:  # a failed teardown must not kill the thread: say so, go on
            try:
                logger.warning("vmm_core: tearing down a dropped object (%s) failed; what "
                               "it held may stay allocated until the process exits. Close "
                               "it explicitly to see the error where it happens",
                               getattr(fn, "__qualname__", fn), exc_info=True)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
