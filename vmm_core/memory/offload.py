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
    host memory held while awake is the ring, unless the caller keeps buffers.
``direct``
    The synchronous copy hooks straight into pageable memory, chunk by chunk (backends
    without a copy queue; the host backend, where staging is one memcpy too many).
``pinned``
    One backend pinned buffer per handle, allocated at each sleep unless kept: the path
    of backends that have pinned buffers but no copy queue.

:func:`configure` switches strategy and sizes (the benchmark measures each); every
failure leaves the caller's bytes where they were and every staging slot quiet.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..errors import BackendError, VMMError
from .host_memory import PARALLEL_RELEASE_BYTES, HostCopy, MappedHostCopy, PinnedHostCopy, stripes

__all__ = ["OffloadConfig", "Transfer", "config", "configure", "configured",
           "choose_strategy", "prepare", "save", "restore", "release", "staging_bytes",
           "release_staging", "STRATEGIES"]

STRATEGIES = ("auto", "staged", "direct", "pinned")


@dataclass(frozen=True)
class OffloadConfig:
    """How offload moves bytes.  Defaults are the benchmark's choice (TODO-LEAD: confirm
    chunk, slots and threads on the H100/H200 with ``vmm-core bench --sleep``).

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
    """

    strategy: str = "auto"
    chunk_bytes: int = 32 << 20
    slots: int = 4
    threads: int = 0
    direct_threads: int = 1
    hugepages: bool = True
    populate: bool = False
    parallel_release: bool = True

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
    if not isinstance(new.threads, int) or new.threads < 0:
        raise ValueError(f"offload threads must be an int >= 0, got {new.threads!r}")
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


def _pool(threads: int) -> ThreadPoolExecutor:
    global _executor, _executor_threads
    with _state:
        if _executor is None or _executor_threads != threads:
            if _executor is not None:
                _executor.shutdown(wait=False)  # running work finishes on the old threads
            _executor = ThreadPoolExecutor(threads, thread_name_prefix="vmm_core-offload")
            _executor_threads = threads
        return _executor


def prepare(backend, device: int = 0) -> float:
    """Allocate the staging ring and start the copy threads now, so that the first
    sleep does not pay for them; returns the seconds it took (0 if nothing to do)."""
    cfg = _config
    if choose_strategy(backend, device, cfg) != "staged":
        return 0.0
    t0 = time.perf_counter()
    _ring(backend, device, cfg)
    pool = _pool(cfg.host_threads())
    for f in [pool.submit(time.sleep, 0) for _ in range(cfg.host_threads())]:
        f.result()  # the pool starts its threads on demand
    return time.perf_counter() - t0


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
            ring._buffer = None
    if executor is not None:
        executor.shutdown(wait=True)


# ---------------------------------------------------------------- save / restore
def save(backend, device: int, regions: list[tuple[int, int]],
         reuse: HostCopy | None = None) -> tuple[HostCopy, Transfer]:
    """Copy device ``regions`` [(address, size), ...] into host memory, in order.

    Reuses ``reuse`` when it fits.  On failure nothing on the device changed and a host
    copy made here is freed; the caller's ``reuse`` stays as it was (its bytes are not
    meaningful any more).
    """
    cfg = _config
    t0 = time.perf_counter()
    strategy = choose_strategy(backend, device, cfg)
    sizes = [size for _, size in regions]
    host, fresh = reuse, False
    if host is None or not host.fits(sizes):
        host = PinnedHostCopy(backend, device, sizes) if strategy == "pinned" \
            else MappedHostCopy(sum(sizes), hugepages=cfg.hugepages)
        fresh = True
    transfer = Transfer("to_host", strategy, sum(sizes))
    try:
        if fresh and cfg.populate and isinstance(host, MappedHostCopy):
            host.populate(_pool(cfg.host_threads()), cfg.host_threads())
        transfer.host_alloc_seconds = time.perf_counter() - t0
        _move(backend, device, regions, host, strategy, cfg, transfer)
    except BaseException:
        if fresh:
            host.release()
        raise
    transfer.seconds = time.perf_counter() - t0
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
          transfer: Transfer) -> None:
    """Copy between ``regions`` and ``host`` in ``transfer.direction``: straight into
    per-handle buffers, through the staging ring, or chunk by chunk through the hooks."""
    direction = transfer.direction
    if isinstance(host, PinnedHostCopy):
        transfer.strategy = "pinned"
        _direct(backend, device, list(_chunks(regions, None)), host, direction, cfg)
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
    """Run the staging pipeline; returns the seconds spent creating the ring (if now)."""
    ring, setup = _ring(backend, device, cfg)
    threads = cfg.host_threads()
    pool = _pool(threads)
    chunks = list(_chunks(regions, ring.chunk))
    with ring.lock:
        queue = _Queue(backend, device)
        try:
            if direction == "to_host":
                _stream_to_host(queue, pool, threads, ring.addresses, chunks, host)
            else:
                _stream_from_host(queue, pool, threads, ring.addresses, chunks, host)
        finally:
            queue.close()
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
