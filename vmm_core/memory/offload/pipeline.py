"""The copies themselves: device memory to a host copy and back, by the strategy
:func:`~vmm_core.memory.offload.settings.choose_strategy` picks.

A host copy that is registered with the backend is copied straight, every chunk queued
on the copy queue at once; otherwise the staged pipeline streams chunks through the
pinned staging ring while the copy threads move them to or from pageable memory; a
backend without a copy queue gets the synchronous copy hooks, chunk by chunk.  Every
failure leaves the caller's bytes where they were and every staging slot quiet: nothing
still copies into or out of a slot once an error propagates.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

from ... import interrupts
from ...errors import BackendError, VMMError
from ..host_memory import HostCopy, MappedHostCopy, PinnedHostCopy, stripes
from . import staging
from .pinning import pin_later
from .prepared import return_to_reserve, take_reserve
from .settings import OffloadConfig, choose_strategy, config

__all__ = ["Transfer", "save", "restore"]


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


def save(backend, device: int, regions: list[tuple[int, int]],
         reuse: HostCopy | None = None, pin: bool = False, layout: list[int] | None = None,
         wait_pinned: bool = True) -> tuple[HostCopy, Transfer]:
    """Copy device ``regions`` [(address, size), ...] into host memory, in order.

    ``layout`` gives the sizes of the host copy's buffers (default: one per region;
    their sum is always the regions' total).  Reuses ``reuse`` when it fits, else a
    copy made by ``prepare(nbytes)``, else a new one.  With ``pin`` (the copy will be
    kept) a copy that is not pinned yet gets registered in the background once filled,
    or, inside :func:`.pinning.deferred_pinning` (every sleep), once that block ends.  A copy
    whose registration is in flight is waited for (every round then takes the same
    path), unless ``wait_pinned`` is False: then it is filled through the staging ring
    meanwhile.  On failure nothing on the device changed, a host copy made here is freed
    and a prepared one goes back to the reserve; the caller's ``reuse`` stays as it was
    (its bytes are not meaningful any more).
    """
    cfg = config()
    t0 = time.perf_counter()
    strategy = choose_strategy(backend, device, cfg)
    sizes = list(layout) if layout is not None else [size for _, size in regions]
    host, fresh, reserved = reuse, False, False
    if host is None or not host.fits(sizes):
        host = take_reserve(sum(sizes))
        reserved = host is not None
        if host is None:
            host = PinnedHostCopy(backend, device, sizes) if strategy == "pinned" \
                else MappedHostCopy(sum(sizes), hugepages=cfg.hugepages)
        fresh = True
    transfer = Transfer("to_host", strategy, sum(size for _, size in regions))
    try:
        if fresh and cfg.populate and isinstance(host, MappedHostCopy):
            host.populate(staging.copy_threads(cfg.host_threads()), cfg.host_threads())
        transfer.host_alloc_seconds = time.perf_counter() - t0
        _move(backend, device, regions, host, strategy, cfg, transfer, wait_pinned)
    except BaseException:
        if reserved:  # prepared ahead of time (and pinned): the retry takes it again
            return_to_reserve(host)
        elif fresh:
            host.release()
        raise
    transfer.seconds = time.perf_counter() - t0
    if pin:
        pin_later(backend, device, host)
    return host, transfer


def restore(backend, device: int, regions: list[tuple[int, int]], host: HostCopy) -> Transfer:
    """Copy ``host`` back into device ``regions``; complete when it returns.

    On failure the host copy is intact (wake can be retried) and no copy is in flight.
    """
    cfg = config()
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
        # run_all: after a failure nothing writes the copy, which is freed next
        interrupts.run_all(staging.copy_threads(cfg.host_threads()), one,
                           [(chunk,) for chunk in chunks], _IN_FLIGHT)
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
        ring, seconds = staging.staging_ring(backend, device, cfg)
        setup += seconds
        ring.lock.acquire()
        if not ring.closed:
            break
        ring.lock.release()
    try:
        threads = cfg.host_threads()
        # after the ring: release_staging shuts a pool down only once it holds every
        # ring's lock
        pool = staging.copy_threads(threads)
        chunks = list(_chunks(regions, ring.chunk))
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


#: what a Ctrl-C waits for while work is handed to the copy threads, and after a failure
_HANDING = "the hand-over of a chunk to the host copy threads"
_IN_FLIGHT = "the host copy threads' work in flight"


def _spread(pool, threads: int, dst: int, src: int, size: int, into: list) -> None:
    """Hand one chunk's copy to the threads, its futures into ``into``, Ctrl-C held
    until all are there: a future the caller never saw would go on copying into or out
    of a slot after the failure's wait (:func:`_quiesce`) let it be reused."""
    with interrupts.held(_HANDING):
        for o, n in stripes(size, threads):
            into.append(pool.submit(ctypes.memmove, dst + o, src + o, n))


def _stream_to_host(queue, pool, threads, slots, chunks, host) -> None:
    """Device -> slot (copy queue) -> pageable host (threads), chunks in flight at once.

    Chunk ``j`` uses slot ``j % K``.  After chunk ``i`` lands, its host copy starts and
    the slot of chunk ``i - lag`` (whose host copy is then waited for) gets chunk
    ``i - lag + K``: the queue always holds the next ``K - lag - 1`` chunks while up to
    ``lag + 1`` host copies run.
    """
    k, n = len(slots), len(chunks)
    lag = max(0, k // 2 - 1)
    markers: list = [None] * n
    copies: list[list] = [[] for _ in range(n)]
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
            _spread(pool, threads, host.address(offset, size), slots[i % k], size, copies[i])
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
    markers: list = [None] * n
    fills: list[list] = [[] for _ in range(n)]
    filled = 0
    try:
        for i in range(n):
            while filled < n and filled <= i + ahead:
                j = filled
                if j >= k:
                    queue.wait(markers[j - k])
                    markers[j - k] = None
                _, offset, size = chunks[j]
                _spread(pool, threads, slots[j % k], host.address(offset, size), size, fills[j])
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
    """After a failure: nothing may still copy into or out of the slots (a Ctrl-C while
    this waits is held: its wait cut short would let the slots be reused under a copy)."""
    with interrupts.held(_IN_FLIGHT):
        try:
            queue.synchronize()
        except BaseException:  # noqa: BLE001 - the original error is what the caller sees
            pass
        interrupts.settle([f for futures in pending for f in futures], _IN_FLIGHT)


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
