"""Registering kept host copies with the backend (page-locking them), in the background
and at a moment that slows nothing down.

A registration page-locks gigabytes: done inside a sleep it ran beside the rest of that
sleep and slowed it; done at the first copy into the kept copy it slowed that copy.  So
the registrations asked for during a sleep or wake start when it ends
(:func:`deferred_pinning`), on a thread of their own, and only the next copy into or
out of that host copy waits for its registration.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from ... import forksafe, interrupts
from ...errors import VMMError
from .. import tag_state
from ..host_memory import HostCopy, MappedHostCopy
from .settings import config
from .workers import Workers

__all__ = ["deferred_pinning", "pin_later", "wait_for_pinning"]

logger = logging.getLogger("vmm_core")

_lock = threading.Lock()  # the registrations in flight and their thread
_pin_executor: Workers | None = None
_pinning: set = set()  # registrations in flight

_deferred = threading.local()  # .pending: registrations asked for inside deferred_pinning


@contextlib.contextmanager
def deferred_pinning():
    """Start the registrations of kept copies asked for inside the block when the
    outermost such block on this thread ends (also when it raises: the copies that were
    made are kept either way).

    Sleep and wake run in one: a registration page-locks gigabytes, and one started
    right after its copy ran beside the rest of the sleep (unmapping and releasing the
    handles, other tags' copies and unmaps), which waited for it.  Measured on an H100
    (4 GiB): round 1 took 352 ms, its copy 252 ms, against 264 ms and 261 ms with
    nothing registered; only the sleep that registered spent 100 ms outside its copy
    (the others 2-4 ms), and the wake right after it found the copy already pinned.
    Started once the device work is done, the registration runs while the caller goes
    on (a training step), and only the next copy into or out of the kept copy waits
    for it.

    They start under the lock of tagged memory (taken here if the block's caller does
    not hold it, as a SharedVMMAllocator.sleep called directly does not): a capture
    space waits for the registrations in flight and then holds that lock, so none may
    start on another thread while it is open."""
    if getattr(_deferred, "pending", None) is not None:  # nested: the outermost starts them
        yield
        return
    pending: list[tuple] = []
    _deferred.pending = pending
    try:
        yield
    finally:
        _deferred.pending = None
        if pending:
            with tag_state.state_lock():
                for args in pending:
                    pin_later(*args)


def pin_later(backend, device: int, host: HostCopy) -> None:
    """Register a freshly filled copy in the background (inside :func:`deferred_pinning`:
    once the block ends); the next copy into or out of it waits for the registration.

    Outside such a block the registration starts under the lock of tagged memory (see
    :func:`deferred_pinning`): call it holding no allocator's lock."""
    global _pin_executor
    if not (config().pin_kept and isinstance(host, MappedHostCopy)) or host.pinned_bytes \
            or not host.held_bytes or host.pin_future is not None \
            or not backend.implements("vmm_host_register"):
        return
    pending = getattr(_deferred, "pending", None)
    if pending is not None:
        if not any(h is host for _, _, h in pending):
            pending.append((backend, device, host))
        return
    # Ctrl-C held, once the locks are had (their wait stays interruptible), while the
    # executor may start its thread (one raised inside Thread.start leaves a running
    # worker the executor never recorded, which nothing tells to stop, and the
    # interpreter's exit waits for it forever) and until the registration is on the
    # books and will call back
    with interrupts.Held("the start of the thread that page-locks host copies") as hold:
        with tag_state.state_lock(), _lock:
            hold.arm()
            if host.pin_future is not None or host.pinned_bytes or not host.held_bytes:
                return  # another thread started it (a background copy and its first sleep)
            if _pin_executor is None:
                _pin_executor = Workers(1, thread_name_prefix="vmm_core-pin")
            try:
                future = _pin_executor.submit(_register, backend, device, host)
            except RuntimeError:  # the interpreter is exiting, or no thread could start
                # (nothing stays queued: Workers): the copy stays pageable
                return
            _pinning.add(future)
            host.pin_future = future
        future.add_done_callback(_pinned)  # outside the lock: a finished one calls back now


def _pinned(future) -> None:
    with _lock:  # wait_for_pinning copies the set under the same lock
        _pinning.discard(future)


def _register(backend, device: int, host: MappedHostCopy) -> None:
    try:
        host.register(backend, device)
    except Exception as exc:
        logger.warning("offload: registering a kept host copy of %d bytes with backend %r "
                       "failed (%s); it stays pageable, so its copies run at pageable "
                       "speed. Raise the locked-memory limit or pass "
                       "keep_host_buffers=False to wake_up", host.size, backend.name, exc)
        raise


def wait_for_pinning(timeout: float | None = None) -> bool:
    """Wait for background registrations of kept host copies; False on timeout."""
    from concurrent.futures import wait

    with _lock:
        pending = list(_pinning)
    return not wait(pending, timeout=timeout).not_done


def fail_in_child(futures) -> None:
    """In a forked child, which has none of the parent's threads: fail the work that
    was in flight on them, so that nothing waits for it forever."""
    for future in list(futures):
        if not future.done():
            try:
                future.set_exception(VMMError("forked while registering a host copy"))
            except Exception:  # noqa: BLE001 - finished meanwhile
                pass


def _after_fork_in_child() -> None:
    """A registration in flight in the parent never finishes in the child, and the lock
    a parent thread may have held is replaced."""
    global _lock, _pin_executor, _pinning
    _lock = threading.Lock()
    fail_in_child(_pinning)
    _pin_executor, _pinning = None, set()


forksafe.at_fork("offload", after_in_child=_after_fork_in_child)
