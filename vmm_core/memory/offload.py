"""Offload: copy an allocator's physical memory to the host and back, at copy bandwidth.

The allocator decides *what* to copy (the handles of its current space, in order);
this module decides *how*, in one place (:func:`choose_strategy`):

``staged`` (default where the backend declares ``async_copies``)
    Pinning fresh host memory at every sleep runs at a few GiB/s, against ~50 GiB/s for
    the copy itself, and keeping pinned buffers holds host memory while awake.  So the
    device streams fixed-size chunks through a small ring of pinned staging slots,
    allocated once per process and device and shared by every tag and sleep, on the
    backend's copy queue (a CUDA stream), while a pool of host threads moves each
    finished chunk into pageable memory from ``mmap`` (huge-page advised, faulted in
    by the copying threads in parallel).  Wake runs the pipeline backwards.  The only
    host memory held while awake is then the ring, unless host copies are kept (the
    default, below).
``direct``
    The synchronous copy hooks straight into pageable memory, chunk by chunk (backends
    without a copy queue; the host backend, where staging is one memcpy too many).
``pinned``
    One backend pinned buffer per handle, allocated at each sleep unless kept: the path
    of backends that have pinned buffers but no copy queue.

Repeated sleeps (an RL loop sleeps the engine every step): by default wake keeps the
host copy of every tag (:func:`keeps_host_buffers`), and the copy is registered with the
backend once, in the background after the sleep that made it (``vmm_host_register``:
cudaHostRegister on CUDA).  Every later round copies straight between the device and
that pinned copy on the copy queue, at full copy bandwidth, without the ring or the
host threads.  Host memory held while awake is then the offloaded bytes (plus the ring,
and copies ``prepare(nbytes)`` made that no tag took, or that a smaller tag took whole);
``wake_up(keep_host_buffers=False)`` gives it back, and :func:`set_keep_host_buffers` or
``configure(keep_host_buffers=False)`` make later wakes do so.  :func:`prepare` makes
the pinned copies ahead of time (at model load), so that even the first sleep copies
straight.

:func:`configure` switches strategy and sizes (the benchmark measures each); every
failure leaves the caller's bytes where they were and every staging slot quiet.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import numbers
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..errors import BackendError, CaptureError, OutOfMemoryError, VMMError
from ..sizes import byte_count
from . import tag_state
from .host_memory import (
    PARALLEL_RELEASE_BYTES,
    HostCopy,
    MappedHostCopy,
    PinnedHostCopy,
    check_host_fits,
    stripes,
)

logger = logging.getLogger("vmm_core")

__all__ = ["OffloadConfig", "Transfer", "config", "configure", "configured",
           "choose_strategy", "prepare", "prepare_staging", "save", "restore", "release",
           "staging_bytes", "prepared_bytes", "release_prepared", "release_staging",
           "set_keep_host_buffers", "keeps_host_buffers", "wait_for_pinning",
           "deferred_pinning", "prepare_later", "PendingCopy", "wait_for_prepared",
           "STRATEGIES"]

STRATEGIES = ("auto", "staged", "direct", "pinned")


@dataclass(frozen=True)
class OffloadConfig:
    """How offload moves bytes.  Defaults are the benchmark's choice (``vmm-core bench
    --sleep`` on a device measures chunk, slots and threads against them).

    strategy:         "auto" (by capability), "staged", "direct" or "pinned".
    chunk_bytes:      bytes per staging slot (one device copy each).
    slots:            staging slots in the ring (device copies in flight + host copies).
    threads:          host copy threads; 0 means min(8, CPUs).
    direct_threads:   > 1: the direct strategy's synchronous copies run on the copy
                      threads, several at once; 1: one after the other.
    hugepages:        advise transparent huge pages for pageable host copies.
    populate:         fault host copies in before copying (MADV_POPULATE_WRITE), instead
                      of letting the copy threads fault them.
    parallel_release: free large host copies from the copy threads (MADV_DONTNEED).
    keep_host_buffers: what ``wake_up`` does with a host copy when not told (and no
                      per-tag policy says otherwise): keep it for the next sleep.
    pin_kept:         register kept host copies with the backend (page-lock them), so
                      later rounds copy straight between device and host.
    """

    strategy: str = "auto"
    chunk_bytes: int = 32 << 20
    slots: int = 4
    threads: int = 0
    direct_threads: int = 1
    hugepages: bool = True
    populate: bool = False
    parallel_release: bool = True
    keep_host_buffers: bool = True
    pin_kept: bool = True

    def host_threads(self) -> int:
        return self.threads or max(1, min(8, os.cpu_count() or 1))


@dataclass
class Transfer:
    """What one save or restore moved, how, and how long it took."""

    direction: str  # "to_host" | "from_host"
    strategy: str
    nbytes: int
    seconds: float = 0.0
    host_alloc_seconds: float = 0.0  # mmap/pin of a fresh host copy (inside seconds)
    staging_setup_seconds: float = 0.0  # the ring's first allocation (inside seconds)
    #: waiting for the copy's background registration to finish (inside seconds): a
    #: wake right after the sleep that made a kept copy, before it was pinned
    pin_wait_seconds: float = 0.0

    @property
    def gib_s(self) -> float:
        return self.nbytes / 2**30 / self.seconds if self.seconds > 0 else float("inf")


_state = threading.Lock()
_config = OffloadConfig()
_rings: dict = {}  # (backend name, device) -> _StagingRing
_executor: ThreadPoolExecutor | None = None
_executor_threads = 0


def config() -> OffloadConfig:
    return _config


def configure(**changes) -> OffloadConfig:
    """Change how offload works, process-wide; returns the previous configuration."""
    global _config
    new = replace(_config, **changes)
    if new.strategy not in STRATEGIES:
        raise ValueError(f"offload strategy {new.strategy!r} is not one of {STRATEGIES}")
    for name in ("hugepages", "populate", "parallel_release"):
        if not isinstance(getattr(new, name), bool):  # "no" would be true
            raise ValueError(f"offload {name} must be True or False, got "
                             f"{getattr(new, name)!r}")
    for name in ("chunk_bytes", "slots", "direct_threads", "threads"):
        if isinstance(getattr(new, name), bool):  # True would be 1
            raise ValueError(f"offload {name} must be an int, got {getattr(new, name)!r}")
    for name in ("chunk_bytes", "slots", "direct_threads"):
        if not isinstance(getattr(new, name), int) or getattr(new, name) < 1:
            raise ValueError(f"offload {name} must be a positive int, got "
                             f"{getattr(new, name)!r}")
    if new.slots < 2:
        raise ValueError("offload needs at least 2 staging slots (one copying in, one out)")
    byte_count("offload chunk_bytes * slots (the staging ring)", new.chunk_bytes * new.slots,
               error=ValueError, remedy="use smaller chunks or fewer slots")
    if not isinstance(new.threads, int) or new.threads < 0:
        raise ValueError(f"offload threads must be an int >= 0, got {new.threads!r}")
    for name in ("keep_host_buffers", "pin_kept"):
        if not isinstance(getattr(new, name), bool):
            raise ValueError(f"offload {name} must be True or False, got "
                             f"{getattr(new, name)!r}")
    with _state:
        previous, _config = _config, new
    return previous


@contextlib.contextmanager
def configured(**changes):
    """``configure(**changes)`` for the duration of a block."""
    previous = configure(**changes)
    try:
        yield _config
    finally:
        configure(**{f: getattr(previous, f) for f in previous.__dataclass_fields__})


_keep_by_tag: dict[str, bool] = {}


def set_keep_host_buffers(tags, keep: bool | None) -> None:
    """Per-tag policy for ``wake_up`` without ``keep_host_buffers``: True keeps the
    tag's host copy (pinned) for the next sleep, False gives it back at wake, None
    follows ``configure(keep_host_buffers=...)``.  For hosts that can spare pinned
    memory for the weights but not for, say, a large KV cache."""
    if isinstance(tags, str):
        tags = [tags]
    if keep is not None and not isinstance(keep, bool):
        raise ValueError(f"set_keep_host_buffers: keep must be True, False or None, got "
                         f"{keep!r}")
    if not isinstance(tags, (list, tuple, set, frozenset)):
        raise ValueError(f"set_keep_host_buffers: tags must be a tag or a list of tags, got "
                         f"{tags!r}")
    for tag in tags:  # all checked before any is set: a bad call changes nothing
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"set_keep_host_buffers: tags must be non-empty strings, "
                             f"got {tag!r}")
    with _state:
        for tag in tags:
            if keep is None:
                _keep_by_tag.pop(tag, None)
            else:
                _keep_by_tag[tag] = keep


def keeps_host_buffers(tag: str | None) -> bool:
    """Whether a wake of ``tag`` keeps its host copy when the caller does not say."""
    keep = _keep_by_tag.get(tag) if tag is not None else None
    return _config.keep_host_buffers if keep is None else keep


def choose_strategy(backend, device: int, cfg: OffloadConfig | None = None) -> str:
    """The one place that decides how a backend's memory is offloaded."""
    cfg = cfg or _config
    has_queue = backend.implements("vmm_copy_queue")
    if cfg.strategy == "staged" and not has_queue:
        raise VMMError(f"offload strategy 'staged' needs the vmm_copy_queue hook, which "
                       f"backend {backend.name!r} does not implement; use 'direct'")
    if cfg.strategy != "auto":
        return cfg.strategy
    if has_queue and backend.capabilities(device).async_copies:
        return "staged"
    if backend.implements("vmm_host_buffer"):
        return "pinned"
    return "direct"


# ---------------------------------------------------------------- process-wide resources
class _StagingRing:
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


def _ring(backend, device: int, cfg: OffloadConfig) -> tuple[_StagingRing, float]:
    key = (backend.name, device)
    with _state:
        ring = _rings.get(key)
        if ring is not None and (ring.chunk, ring.slots) == (cfg.chunk_bytes, cfg.slots):
            return ring, 0.0
        t0 = time.perf_counter()
        ring = _rings[key] = _StagingRing(backend, device, cfg.chunk_bytes, cfg.slots)
        return ring, time.perf_counter() - t0


class _Threads(ThreadPoolExecutor):
    """The copy threads.  release_staging (or a new thread count) shuts a pool down that
    another thread may still hand work to, and the interpreter's exit shuts every pool:
    such work runs on the calling thread instead of failing a sleep or wake midway."""

    def submit(self, fn, /, *args, **kwargs):
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            future: Future = Future()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - raised by result(), as a pool does
                future.set_exception(exc)
            return future


def _pool(threads: int) -> ThreadPoolExecutor:
    global _executor, _executor_threads
    with _state:
        if _executor is None or _executor_threads != threads:
            if _executor is not None:
                _executor.shutdown(wait=False)  # running work finishes on the old threads
            _executor = _Threads(threads, thread_name_prefix="vmm_core-offload")
            _executor_threads = threads
        return _executor


def prepare_staging(backend, device: int = 0) -> float:
    """Allocate the staging ring and start the copy threads now, so that the first
    sleep does not pay for them; returns the seconds it took (0 if nothing to do)."""
    cfg = _config
    if choose_strategy(backend, device, cfg) != "staged":
        return 0.0
    with _no_capture():
        return _prepare_staging(backend, device, cfg)


def _prepare_staging(backend, device: int, cfg: OffloadConfig) -> float:
    t0 = time.perf_counter()
    _ring(backend, device, cfg)
    pool = _pool(cfg.host_threads())
    for f in [pool.submit(time.sleep, 0) for _ in range(cfg.host_threads())]:
        f.result()  # the pool starts its threads on demand
    return time.perf_counter() - t0


def prepare(what, backend=None, device: int | None = None) -> float:
    """Pin host memory for offload now, off the critical path (at model load), so that
    even the first sleep copies straight between device and pinned host memory.

    ``what`` is a tag or a list of tags: every allocator of those tags gets a host copy
    of exactly its current size, first-touched by the copy threads in parallel and
    registered with its backend, which its next offloading sleep fills (and which is
    kept, like any kept copy).  Or an int of bytes: one such copy, not yet any tag's,
    that the first offload of a tag needing at most that many bytes takes whole (its
    host bytes then count the whole copy: prepare the size you will offload).  Or a
    Backend: only the staging ring and copy threads (:func:`prepare_staging`).
    Returns the seconds it took.
    """
    with _no_capture():
        return _prepare(what, backend, device)


@contextlib.contextmanager
def _no_capture():
    """Hold the lock of tagged memory, which every graph capture block holds: pinning
    (cudaHostRegister, cudaHostAlloc) on one thread while another captures a device graph
    in global mode is refused, or breaks that capture.  Re-entrant: a sleep holding it
    makes the staging ring without waiting for itself; so a capture block of this thread
    would not keep it out either, and is refused instead."""
    tag_state.refuse_in_capture("offload.prepare", CaptureError)
    with tag_state.state_lock():
        yield


def _prepare(what, backend, device: int | None) -> float:
    import vmm_core

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
        be = vmm_core.get_backend(backend) if backend is None or isinstance(backend, str) \
            else backend
        dev = tag_state.current_device(be) if device is None else device
        prepare_staging(be, dev)
        copy = _pinned_copy_now(be, dev, what, prepared=True)
        with _state:
            _reserve.append(copy)
        return time.perf_counter() - t0
    if isinstance(what, str) or isinstance(what, (list, tuple, set, frozenset)):
        names = [what] if isinstance(what, str) else list(what)
        bad = [t for t in names if not isinstance(t, str)]
        if bad:
            raise ValueError(f"offload.prepare: tags must be tag names, got {bad[0]!r}")
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
                prepare_staging(alloc.backend, alloc.device)
                alloc.prepare_host_copy()
        return time.perf_counter() - t0
    return prepare_staging(what, 0 if device is None else device)


_reserve: list = []  # prepared copies no tag has taken yet (prepare(nbytes))


def release_prepared() -> None:
    """Free the copies made by ``prepare(nbytes)`` that no tag has taken."""
    with _state:
        copies = list(_reserve)
        _reserve.clear()
    for copy in copies:
        copy.release()


def prepared_bytes() -> int:
    """Host bytes made by ``prepare(nbytes)`` that no tag has taken yet."""
    with _state:
        return sum(c.size for c in _reserve)


def _take_reserve(total: int):
    """The smallest prepared copy that holds ``total`` bytes, taken out of the reserve."""
    with _state:
        fitting = [c for c in _reserve if c.base is not None and c.size >= total]
        if not fitting:
            return None
        best = min(fitting, key=lambda c: c.size)
        _reserve.remove(best)
        return best


def prepared_copy(backend, device: int, sizes: list[int]) -> HostCopy:
    """A pinned host copy for handles of ``sizes``, made now (``prepare``)."""
    if choose_strategy(backend, device) == "pinned":
        return PinnedHostCopy(backend, device, sizes)
    return _pinned_copy_now(backend, device, sum(sizes))


def _pinned_copy_now(backend, device: int, size: int, prepared: bool = False):
    cfg = _config
    copy = MappedHostCopy(size, hugepages=cfg.hugepages, prepared=prepared)
    try:
        copy.populate(_pool(cfg.host_threads()), cfg.host_threads(), touch=True)
        if cfg.pin_kept and backend.implements("vmm_host_register"):
            copy.register(backend, device)
    except BaseException:
        copy.release()
        raise
    return copy


# ---------------------------------------------------------------- copies made ahead
_prepare_executor: ThreadPoolExecutor | None = None
_preparing: set = set()  # background copies being made (a forked child fails them)


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
        release(future.result())


def prepare_later(backend, device: int, size: int) -> PendingCopy:
    """Start making a pinned host copy of ``size`` bytes off the calling thread.

    The pages are faulted in by the copy threads (no device call, so nothing here
    disturbs a graph capture); the registration then starts as a kept copy's does,
    under the lock of tagged memory (see :func:`deferred_pinning`)."""
    global _prepare_executor
    cfg = _config

    def make() -> MappedHostCopy:
        copy = MappedHostCopy(size, hugepages=cfg.hugepages)
        try:
            copy.populate(_pool(cfg.host_threads()), cfg.host_threads(), touch=True)
        except BaseException:
            copy.release()
            raise
        return copy

    settled: Future = Future()  # done once the copy is made and its registration started
    with _state:
        if _prepare_executor is None:
            _prepare_executor = ThreadPoolExecutor(1, thread_name_prefix="vmm_core-prepare")
        future = _prepare_executor.submit(make)
        _preparing.update((future, settled))
    pending = PendingCopy(size, future)

    def made(done: Future) -> None:
        try:
            if not done.cancelled() and done.exception() is None:
                _pin_later(backend, device, done.result())  # a copy freed meanwhile is skipped
        finally:
            with _state:
                _preparing.discard(done)
                _preparing.discard(settled)
            if not settled.done():  # a forked child failed it already
                settled.set_result(None)

    future.add_done_callback(made)
    return pending


def wait_for_prepared(timeout: float | None = None) -> bool:
    """Wait for host copies being made in the background (and then for their
    registrations); False on timeout."""
    from concurrent.futures import wait

    deadline = None if timeout is None else time.monotonic() + timeout
    with _state:
        pending = list(_preparing)
    if wait(pending, timeout=timeout).not_done:
        return False
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return wait_for_pinning(left)


# ---------------------------------------------------------------- pinning kept copies
_pin_executor: ThreadPoolExecutor | None = None
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
    _deferred.pending = pending = []
    try:
        yield
    finally:
        _deferred.pending = None
        if pending:
            with tag_state.state_lock():
                for args in pending:
                    _pin_later(*args)


def _pin_later(backend, device: int, host: HostCopy) -> None:
    """Register a freshly filled copy in the background (inside :func:`deferred_pinning`:
    once the block ends); the next copy into or out of it waits for the registration.

    Outside such a block the registration starts under the lock of tagged memory (see
    :func:`deferred_pinning`): call it holding no allocator's lock."""
    global _pin_executor
    if not (_config.pin_kept and isinstance(host, MappedHostCopy)) or host.pinned_bytes \
            or not host.held_bytes or host.pin_future is not None \
            or not backend.implements("vmm_host_register"):
        return
    pending = getattr(_deferred, "pending", None)
    if pending is not None:
        if not any(h is host for _, _, h in pending):
            pending.append((backend, device, host))
        return
    with tag_state.state_lock(), _state:
        if host.pin_future is not None or host.pinned_bytes or not host.held_bytes:
            return  # another thread started it (a background copy and its first sleep)
        if _pin_executor is None:
            _pin_executor = ThreadPoolExecutor(1, thread_name_prefix="vmm_core-pin")
        try:
            future = _pin_executor.submit(_register, backend, device, host)
        except RuntimeError:  # the interpreter is exiting: the copy stays pageable
            return
        _pinning.add(future)
        host.pin_future = future
    future.add_done_callback(_pinned)


def _pinned(future) -> None:
    with _state:  # wait_for_pinning copies the set under the same lock
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

    with _state:
        pending = list(_pinning)
    return not wait(pending, timeout=timeout).not_done


def staging_bytes() -> int:
    """Pinned host bytes held by staging rings in this process."""
    with _state:
        return sum(r.nbytes for r in _rings.values())


def release_staging() -> None:
    """Free the staging rings and host threads; the next staged offload makes new ones."""
    global _executor
    with _state:
        rings = list(_rings.values())
        _rings.clear()
        executor, _executor = _executor, None
    for ring in rings:
        with ring.lock:  # wait for a pipeline that still uses it
            ring.closed = True  # one that found it but has not locked it yet looks again
            ring._buffer = None
    if executor is not None:
        executor.shutdown(wait=True)


def _after_fork_in_child() -> None:
    """A forked child inherits the pool without its threads (work submitted there would
    wait forever) and locks that a parent thread may have held at the fork: start afresh.
    The parent's rings are kept, unused, so that the child never frees the parent's
    pinned memory through a driver it cannot use."""
    global _state, _executor, _executor_threads, _rings, _pin_executor, _pinning
    global _prepare_executor, _preparing
    _orphans.extend(_rings.values())
    _state, _executor, _executor_threads, _rings = threading.Lock(), None, 0, {}
    for future in list(_pinning) + list(_preparing):  # their thread is gone: a copy
        # must not wait for it
        if not future.done():
            try:
                future.set_exception(VMMError("forked while registering a host copy"))
            except Exception:  # noqa: BLE001 - finished meanwhile
                pass
    _pin_executor, _pinning = None, set()
    _prepare_executor, _preparing = None, set()


_orphans: list = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- save / restore
def save(backend, device: int, regions: list[tuple[int, int]],
         reuse: HostCopy | None = None, pin: bool = False, layout: list[int] | None = None,
         wait_pinned: bool = True) -> tuple[HostCopy, Transfer]:
    """Copy device ``regions`` [(address, size), ...] into host memory, in order.

    ``layout`` gives the sizes of the host copy's buffers (default: one per region;
    their sum is always the regions' total).  Reuses ``reuse`` when it fits, else a
    copy made by ``prepare(nbytes)``, else a new one.  With ``pin`` (the copy will be
    kept) a copy that is not pinned yet gets registered in the background once filled,
    or, inside :func:`deferred_pinning` (every sleep), once that block ends.  A copy
    whose registration is in flight is waited for (every round then takes the same
    path), unless ``wait_pinned`` is False: then it is filled through the staging ring
    meanwhile.  On failure nothing on the device changed, a host copy made here is freed
    and a prepared one goes back to the reserve; the caller's ``reuse`` stays as it was
    (its bytes are not meaningful any more).
    """
    cfg = _config
    t0 = time.perf_counter()
    strategy = choose_strategy(backend, device, cfg)
    sizes = list(layout) if layout is not None else [size for _, size in regions]
    host, fresh, reserved = reuse, False, False
    if host is None or not host.fits(sizes):
        host = _take_reserve(sum(sizes))
        reserved = host is not None
        if host is None:
            host = PinnedHostCopy(backend, device, sizes) if strategy == "pinned" \
                else MappedHostCopy(sum(sizes), hugepages=cfg.hugepages)
        fresh = True
    transfer = Transfer("to_host", strategy, sum(size for _, size in regions))
    try:
        if fresh and cfg.populate and isinstance(host, MappedHostCopy):
            host.populate(_pool(cfg.host_threads()), cfg.host_threads())
        transfer.host_alloc_seconds = time.perf_counter() - t0
        _move(backend, device, regions, host, strategy, cfg, transfer, wait_pinned)
    except BaseException:
        if reserved:  # prepared ahead of time (and pinned): the retry takes it again
            with _state:
                _reserve.append(host)
        elif fresh:
            host.release()
        raise
    transfer.seconds = time.perf_counter() - t0
    if pin:
        _pin_later(backend, device, host)
    return host, transfer


def restore(backend, device: int, regions: list[tuple[int, int]], host: HostCopy) -> Transfer:
    """Copy ``host`` back into device ``regions``; complete when it returns.

    On failure the host copy is intact (wake can be retried) and no copy is in flight.
    """
    cfg = _config
    t0 = time.perf_counter()
    strategy = choose_strategy(backend, device, cfg)
    transfer = Transfer("from_host", strategy, sum(size for _, size in regions))
    _move(backend, device, regions, host, strategy, cfg, transfer)
    transfer.seconds = time.perf_counter() - t0
    return transfer


def _move(backend, device, regions, host: HostCopy, strategy: str, cfg: OffloadConfig,
          transfer: Transfer, wait_pinned: bool = True) -> None:
    """Copy between ``regions`` and ``host`` in ``transfer.direction``: straight into
    per-handle buffers, through the staging ring, or chunk by chunk through the hooks."""
    direction = transfer.direction
    if isinstance(host, MappedHostCopy) and wait_pinned:
        t0 = time.perf_counter()
        host.wait_pinned()  # deterministic: a registered copy always takes the same path
        transfer.pin_wait_seconds = time.perf_counter() - t0
    if isinstance(host, PinnedHostCopy):
        transfer.strategy = "pinned"
        _direct(backend, device, list(_chunks(regions, None)), host, direction, cfg)
    elif host.pinned_bytes:
        transfer.strategy = "pinned"
        _pinned_copies(backend, device, regions, host, direction, cfg)
    elif strategy == "staged":
        transfer.strategy = "staged"
        transfer.staging_setup_seconds = _staged(backend, device, regions, host, direction,
                                                 cfg)
    else:
        transfer.strategy = "direct"
        _direct(backend, device, list(_chunks(regions, cfg.chunk_bytes)), host, direction,
                cfg)


def release(host: HostCopy | None) -> float:
    """Free a host copy (from the copy threads when large); returns the seconds it took."""
    if host is None:
        return 0.0
    t0 = time.perf_counter()
    cfg = _config
    if cfg.parallel_release and isinstance(host, MappedHostCopy) \
            and host.size >= PARALLEL_RELEASE_BYTES:
        host.release(_pool(cfg.host_threads()), cfg.host_threads())
    else:
        host.release()
    return time.perf_counter() - t0


def _pinned_copies(backend, device, regions, host: HostCopy, direction: str,
                   cfg: OffloadConfig) -> None:
    """Straight between device and a registered host copy: every copy queued on the
    copy queue at once (the copy engine runs them back to back), one wait at the end;
    the synchronous copy hooks where the backend has no queue."""
    chunks = list(_chunks(regions, _PINNED_CHUNK))
    if not backend.implements("vmm_copy_queue"):
        _direct(backend, device, chunks, host, direction, cfg)
        return
    queue = _Queue(backend, device)
    try:
        for address, offset, size in chunks:
            if direction == "to_host":
                queue.to_host(address, host.address(offset, size), size)
            else:
                queue.from_host(host.address(offset, size), address, size)
        queue.synchronize()
    except BaseException:
        _quiesce(queue, [])
        raise
    finally:
        queue.close()


#: one queued copy per this many bytes at most (a handle may be larger)
_PINNED_CHUNK = 256 << 20


def _chunks(regions, chunk: int | None):
    """(device address, host offset, size) pieces, never crossing a region."""
    offset = 0
    for address, size in regions:
        step = size if chunk is None else chunk
        for o in range(0, size, step):
            yield address + o, offset + o, min(step, size - o)
        offset += size


# ---------------------------------------------------------------- direct copies
def _direct(backend, device, chunks, host: HostCopy, direction: str,
            cfg: OffloadConfig) -> None:
    def one(chunk):
        address, offset, size = chunk
        if direction == "to_host":
            backend.copy_to_host(device, address, host.address(offset, size), size)
        else:
            backend.copy_from_host(device, host.address(offset, size), address, size)

    if cfg.direct_threads <= 1 or len(chunks) <= 1:
        for chunk in chunks:
            one(chunk)
    else:
        _join(_pool(cfg.host_threads()).submit(one, c) for c in chunks)
    if direction == "from_host":
        backend.synchronize(device)  # pageable copies may return before the device wrote


def _join(futures) -> None:
    """Wait for every future; raise the first error once all have finished."""
    first = None
    for f in list(futures):
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            first = first or exc
    if first is not None:
        raise first


# ---------------------------------------------------------------- staged pipeline
def _staged(backend, device, regions, host: HostCopy, direction: str,
            cfg: OffloadConfig) -> float:
    """Run the staging pipeline; returns the seconds spent creating the ring (if now).

    The ring is locked before anything touches it, and one that release_staging closed
    in between is given up for a new one: its slots are freed memory."""
    setup = 0.0
    while True:
        ring, seconds = _ring(backend, device, cfg)
        setup += seconds
        ring.lock.acquire()
        if not ring.closed:
            break
        ring.lock.release()
    try:
        threads = cfg.host_threads()
        pool = _pool(threads)  # after the ring: release_staging shuts a pool down only
        chunks = list(_chunks(regions, ring.chunk))  # once it holds every ring's lock
        queue = _Queue(backend, device)
        try:
            if direction == "to_host":
                _stream_to_host(queue, pool, threads, ring.addresses, chunks, host)
            else:
                _stream_from_host(queue, pool, threads, ring.addresses, chunks, host)
        finally:
            queue.close()
    finally:
        ring.lock.release()
    return setup


def _spread(pool, threads: int, dst: int, src: int, size: int) -> list:
    return [pool.submit(ctypes.memmove, dst + o, src + o, n)
            for o, n in stripes(size, threads)]


def _stream_to_host(queue, pool, threads, slots, chunks, host) -> None:
    """Device -> slot (copy queue) -> pageable host (threads), chunks in flight at once.

    Chunk ``j`` uses slot ``j % K``.  After chunk ``i`` lands, its host copy starts and
    the slot of chunk ``i - lag`` (whose host copy is then waited for) gets chunk
    ``i - lag + K``: the queue always holds the next ``K - lag - 1`` chunks while up to
    ``lag + 1`` host copies run.
    """
    k, n = len(slots), len(chunks)
    lag = max(0, k // 2 - 1)
    markers, copies = [None] * n, [[] for _ in range(n)]
    issued = 0

    def issue():
        nonlocal issued
        address, _, size = chunks[issued]
        queue.to_host(address, slots[issued % k], size)
        markers[issued] = queue.record()
        issued += 1

    try:
        while issued < min(k, n):
            issue()
        for i in range(n):
            queue.wait(markers[i])
            markers[i] = None
            _, offset, size = chunks[i]
            copies[i] = _spread(pool, threads, host.address(offset, size), slots[i % k], size)
            r = i - lag
            if r >= 0:
                _join(copies[r])
                copies[r] = []
                if issued < n:
                    issue()
        for i in range(max(0, n - lag), n):
            _join(copies[i])
            copies[i] = []
    except BaseException:
        _quiesce(queue, copies)
        raise


def _stream_from_host(queue, pool, threads, slots, chunks, host) -> None:
    """Pageable host (threads) -> slot -> device (copy queue), the reverse pipeline.

    The host copy of chunk ``j`` into slot ``j % K`` starts once the device copy of
    chunk ``j - K`` (the slot's last reader) finished; up to ``K - 2`` chunks are filled
    ahead, so the queue never waits for the thread that feeds it.
    """
    k, n = len(slots), len(chunks)
    ahead = max(0, k - 2)
    markers, fills = [None] * n, [[] for _ in range(n)]
    filled = 0
    try:
        for i in range(n):
            while filled < n and filled <= i + ahead:
                j = filled
                if j >= k:
                    queue.wait(markers[j - k])
                    markers[j - k] = None
                _, offset, size = chunks[j]
                fills[j] = _spread(pool, threads, slots[j % k], host.address(offset, size), size)
                filled += 1
            _join(fills[i])
            fills[i] = []
            address, _, size = chunks[i]
            queue.from_host(slots[i % k], address, size)
            markers[i] = queue.record()
        queue.synchronize()
    except BaseException:
        _quiesce(queue, fills)
        raise


def _quiesce(queue, pending) -> None:
    """After a failure: nothing may still copy into or out of the slots."""
    try:
        queue.synchronize()
    except BaseException:  # noqa: BLE001 - the original error is what the caller sees
        pass
    for futures in pending:
        try:
            _join(futures)
        except BaseException:  # noqa: BLE001
            pass


class _Queue:
    """A backend's CopyQueue with every foreign exception turned into BackendError."""

    def __init__(self, backend, device: int) -> None:
        self._name = backend.name
        queue = self._call("vmm_copy_queue", backend.copy_queue, device)
        if queue is None:
            raise BackendError(f"backend {backend.name!r}: vmm_copy_queue({device}) returned "
                               f"None; offload with strategy 'direct' instead")
        self._queue = queue

    def _call(self, what, fn, *args):
        try:
            return fn(*args)
        except VMMError:
            raise
        except Exception as exc:
            raise BackendError(f"backend {self._name!r}: copy queue {what} raised "
                               f"{type(exc).__name__}: {exc}") from exc

    def to_host(self, address, host_address, size):
        self._call("to_host", self._queue.to_host, address, host_address, size)

    def from_host(self, host_address, address, size):
        self._call("from_host", self._queue.from_host, host_address, address, size)

    def record(self):
        return self._call("record", self._queue.record)

    def wait(self, marker):
        self._call("wait", self._queue.wait, marker)

    def synchronize(self):
        self._call("synchronize", self._queue.synchronize)

    def close(self):
        try:
            self._queue.close()
        except Exception:  # noqa: BLE001 - close after a failure must not mask it
            pass
