"""Every framework allocation of a process in tagged memory, from its start.

A region routes one thread's allocations for the length of a block; training engines
that put their whole process to sleep between steps (torch_memory_saver's
``TMS_INIT_ENABLE``) need every allocation of every thread and stream routed instead,
with regions, captures and ``outside_regions()`` blocks still taking precedence on their
own threads and streams.  :func:`route_process` asks the backend's allocator adapter for
that (``AllocatorAdapter.route_process``, a declared capability; the framework's caching
allocator stays in front, so a step costs what it costs without routing), and this
module serves the segments the framework's pool asks for.

Each segment is memory of its own: a SharedVMMAllocator of exactly its size, registered
under the tag, closed as soon as the framework frees the segment.  One bump allocator
under every segment (what a region uses) would never give back what the caching
allocator releases on ``empty_cache`` or before it reports out of memory, so a training
loop would grow without bound.  The framework frees from under its own lock, where
Python must not run: the C entry point (``csrc/vmm_segments.c``) lists the address and a
thread of this module closes its memory; every allocation first closes what is listed,
so a retry after an out-of-memory error finds the freed memory given back.

Sleep and wake are the tag's, as for any region (``vmm_core.sleep(tag, offload=[tag])``
copies every byte of every segment, free cached blocks included: the framework pool's
free blocks are not known per segment).  What never reaches the framework's allocator
stays outside: memory a library allocates with the driver or runtime directly
(communication libraries' own buffers, graph executables), and, where the adapter says
so, devices the process never makes current.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import logging
import threading

from .. import forksafe, interrupts, registry
from ..errors import BackendUnavailableError, VMMError
from . import address_quarantine, free_margin, tag_state
from .allocator import SharedVMMAllocator
from .shim import ALLOC_CALLBACK, REBUILD, c_alloc_callback

__all__ = ["route_process", "process_routing", "entry", "SegmentEntry", "ProcessRouting"]

logger = logging.getLogger("vmm_core")

ABI_VERSION = 4
#: how long the closing thread waits for a freed segment before it looks for exit
_WAIT_MS = 200


class SegmentEntry:
    """The loaded C entry points (``vmm_core._vmm_segments``): what a framework's
    pluggable allocator loads by ``path``, ``alloc_symbol`` and ``free_symbol``."""

    alloc_symbol = "vmm_segments_alloc"
    free_symbol = "vmm_segments_free"

    def __init__(self) -> None:
        spec = importlib.util.find_spec("vmm_core._vmm_segments")
        if spec is None or not spec.origin:
            raise BackendUnavailableError(
                "the C library vmm_core._vmm_segments is not built; install vmm_core with "
                "pip (pip install -e .) so that the system C compiler builds "
                "csrc/vmm_segments.c")
        self.path = spec.origin
        lib = ctypes.CDLL(self.path)
        try:
            lib.vmm_segments_abi_version.restype = ctypes.c_int
        except AttributeError as exc:
            raise BackendUnavailableError(f"{self.path} is not vmm_core's segments library; "
                                          f"{REBUILD}") from exc
        found = lib.vmm_segments_abi_version()
        if found != ABI_VERSION:
            raise BackendUnavailableError(
                f"{self.path} has ABI {found}, this vmm_core expects {ABI_VERSION}: {REBUILD}")
        lib.vmm_segments_set_alloc_callback.argtypes = [ALLOC_CALLBACK]
        lib.vmm_segments_set_alloc_callback.restype = None
        lib.vmm_segments_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.vmm_segments_alloc.restype = ctypes.c_void_p
        lib.vmm_segments_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                          ctypes.c_void_p]
        lib.vmm_segments_free.restype = None
        lib.vmm_segments_take.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
        lib.vmm_segments_take.restype = ctypes.c_size_t
        lib.vmm_segments_wait.argtypes = [ctypes.c_int]
        lib.vmm_segments_wait.restype = ctypes.c_int
        lib.vmm_segments_counter.argtypes = [ctypes.c_int]
        lib.vmm_segments_counter.restype = ctypes.c_ulonglong
        self.lib = lib
        #: kept for the life of the process: the framework may call it late
        self._callback: object = None
        self._retired: list = []  # replaced callbacks: a call may still be inside one

    def install(self, fn) -> None:
        if self._callback is not None:
            self._retired.append(self._callback)
        self._callback = c_alloc_callback(fn)
        self.lib.vmm_segments_set_alloc_callback(self._callback)

    def disable(self) -> None:
        """alloc returns NULL from now on without entering Python (interpreter exit)."""
        self.lib.vmm_segments_set_alloc_callback(ALLOC_CALLBACK())

    def alloc(self, size: int, device: int = 0) -> int:
        """What the framework's pool calls: an address, or 0 (out of memory)."""
        return int(self.lib.vmm_segments_alloc(size, device, None) or 0)

    def free(self, address: int, size: int = 0, device: int = 0) -> None:
        self.lib.vmm_segments_free(address, size, device, None)

    def take(self, into: list[int], limit: int = 1024) -> list[int]:
        """Move up to ``limit`` freed addresses from the C list into ``into`` (the
        caller's list, filled before this returns: an interrupt as it returns leaves
        them with the caller); returns ``into``."""
        out = (ctypes.c_size_t * limit)()
        n = self.lib.vmm_segments_take(out, limit)
        into.extend(out[:n])  # one call: no interrupt lands halfway
        return into

    def wait(self, timeout_ms: int) -> bool:
        return bool(self.lib.vmm_segments_wait(timeout_ms))

    def counters(self) -> dict[str, int]:
        c = self.lib.vmm_segments_counter
        return {"allocs": c(0), "frees": c(1), "lost": c(2)}


class ProcessRouting:
    """The process's framework allocations under ``tag`` (see the module docstring)."""

    def __init__(self, tag: str, backend, entry: SegmentEntry) -> None:
        self.tag = tag
        self.backend = backend
        self.entry = entry
        self._lock = threading.Lock()
        self._segments: dict[int, SharedVMMAllocator] = {}
        #: freed by the framework, not closed yet (held elsewhere, or a close that failed)
        self._later: dict[int, SharedVMMAllocator] = {}
        self._said: set[int] = set()  # addresses whose failed close was logged
        self._routes: dict[int, object] = {}  # device -> the adapter's handle
        self._closing: threading.Thread | None = None
        self._said_no_thread = False  # that the closing thread could not start
        self._stop = threading.Event()
        self.last_error: BaseException | None = None
        self.lost_reported = 0

    # ---------------------------------------------------------------- the entry point
    def _alloc(self, size: int, device: int, stream) -> int:
        """The C entry's callback (under the GIL, inside the framework's allocator, which
        holds its own lock): never raises into C, never empties the framework's cache.
        An interrupt after the segment is on the books hands it out all the same: the
        framework frees what it got, never what it did not."""
        address = 0
        try:
            with address_quarantine.inside_framework_allocator():
                address = self.allocate(int(size), int(device))
        except BaseException as exc:  # noqa: BLE001 - reported as out of memory
            self.last_error = exc
        return address

    def allocate(self, nbytes: int, device: int) -> int:
        """A segment of ``nbytes`` under the tag on ``device``: memory of its own."""
        self.close_freed(wait=False)
        free_margin.check(self.backend, device, nbytes, f"a segment of {nbytes} bytes")
        alloc = SharedVMMAllocator(self.backend, device=device, reserve_bytes=nbytes,
                                   tag=self.tag)
        address, registered = None, False
        try:
            address = alloc.allocate(nbytes)
            tag_state.register_soon(self.tag, alloc)  # inside the framework's allocator
            registered = True
            with self._lock:
                self._segments[address] = alloc
        except BaseException:  # an interrupt too: a segment no one will free is undone
            try:
                with self._lock:
                    if address is not None and self._segments.get(address) is alloc:
                        del self._segments[address]
                if registered:
                    tag_state.unregister_soon(self.tag, alloc)
            finally:
                alloc.close()  # its memory, whatever interrupts the books
            raise
        return address

    def close_freed(self, wait: bool = True) -> int:
        """Close the memory of every segment the framework freed since the last call, and
        of those kept for a later round; returns how many were closed.

        ``wait=False`` is for inside the framework's allocator, which holds its own lock: a
        segment another thread holds (a hold or replay block of the tag) is left to the
        closing thread instead of waited for, since that thread may need the framework's
        allocator before it lets go.  A segment that cannot be closed now (held awake by
        a block on this thread, or its close failed) stays registered under its tag, kept
        here, and is tried again on the next round: never dropped from the books, never
        failing the allocation that closes it first."""
        # each freed segment is kept first, then taken out to be closed: whatever
        # interrupts a round (KeyboardInterrupt), every segment it took stays on the books
        freed: list[int] = []
        try:
            self.entry.take(freed)
        finally:
            with self._lock:
                for address in freed:
                    alloc = self._segments.get(address)
                    if alloc is not None:
                        self._later[address] = alloc
                        del self._segments[address]
                todo = list(self._later.items())
        closed = 0
        for address, alloc in todo:
            with self._lock:
                if self._later.get(address) is not alloc:
                    continue  # another round's (the closing thread's, an allocation's)
                del self._later[address]
            try:
                closed += self._close_one(address, alloc, wait)
            except BaseException:
                self._keep_for_later([(address, alloc)])
                raise
        lost = self.entry.counters()["lost"]
        if lost > self.lost_reported:
            self.lost_reported = lost
            logger.warning("whole-process memory: %d freed segment(s) could not be listed "
                           "(host out of memory); their memory stays until the process ends",
                           lost)
        return closed

    def _close_one(self, address: int, alloc, wait: bool) -> bool:
        """Close one freed segment and take it off its tag; False where it is kept for a
        later round instead."""
        if not wait and not alloc._lock.acquire(blocking=False):
            self._keep_for_later([(address, alloc)])
            return False
        try:
            try:
                alloc.close()
            finally:
                if not wait:
                    alloc._lock.release()
        except Exception as exc:  # noqa: BLE001 - VMMError: held awake by a block here
            if not alloc.closed:  # refused before it began: tried again
                if address not in self._said:  # once per segment, not once per round
                    self._said.add(address)
                    logger.warning("whole-process memory: the freed segment at %#x could not "
                                   "be closed yet (%s: %s); it stays under tag %r and is "
                                   "tried again", address, type(exc).__name__, exc, self.tag)
                self._keep_for_later([(address, alloc)])
                return False
            # a close that raised part-way gave back all it could (it cannot be done again)
            logger.warning("whole-process memory: closing the freed segment at %#x raised "
                           "%s: %s; what could be given back was", address,
                           type(exc).__name__, exc)
        self._said.discard(address)
        tag_state.unregister_soon(self.tag, alloc)
        return True

    def _keep_for_later(self, segments) -> None:
        """Keep freed segments for the next round of :meth:`close_freed` (the closing
        thread's, within its wait, or the next allocation's): not listed in the entry
        again, which would count a second free and could lose the address.  A forked
        child has no closing thread until something is kept: it gets one then."""
        with self._lock:
            self._later.update(segments)
        self._start_closing(while_routed=True)

    def segments(self) -> dict[int, int]:
        """address -> size of the segments the framework holds now."""
        with self._lock:
            return {a: alloc.reserve_bytes for a, alloc in self._segments.items()}

    # ---------------------------------------------------------------- lifetime
    def _start_closing_thread(self) -> None:
        self._stop.clear()
        self._start_closing(while_routed=False)

    def _start_closing(self, while_routed: bool) -> None:
        """Start the closing thread unless one runs (``while_routed``: only while the
        routing is on; stop() clears the routes under the lock before it stops the
        thread).  Ctrl-C waits from the thread's record to its start: cut there, it
        would be recorded and never run, or run unrecorded.  One that cannot start (the
        process's thread limit, out of memory) is forgotten, said once: freed segments
        are then closed by the next allocation's round and by stop(), and neither the
        routing nor the allocation that kept a segment fails for it."""
        thread = None
        try:
            with interrupts.held("the start of the thread that closes freed segments"):
                with self._lock:
                    if (while_routed and (not self._routes or self._stop.is_set())) or \
                            (self._closing is not None and self._closing.is_alive()):
                        return
                    thread = self._closing = threading.Thread(
                        target=self._close_loop, daemon=True, name="vmm_core-freed-segments")
                thread.start()
        except BaseException as exc:  # noqa: BLE001 - the thread only closes memory sooner
            if thread is not None and not thread.is_alive():  # it never began
                with self._lock:
                    if self._closing is thread:
                        self._closing = None
            if not isinstance(exc, Exception):
                raise  # a Ctrl-C, raised once the books are whole
            if not self._said_no_thread:
                self._said_no_thread = True
                logger.warning("whole-process memory: the thread that closes freed "
                               "segments could not start (%r); they are closed at the next "
                               "allocation instead", exc)

    def _close_loop(self) -> None:
        while not self._stop.is_set():
            listed = self.entry.wait(_WAIT_MS)
            if (listed or self._later) and not self._stop.is_set():
                try:
                    self.close_freed()
                except Exception as exc:  # noqa: BLE001 - the next round tries again
                    logger.warning("whole-process memory: closing freed segments failed: %s",
                                   exc)

    def route(self, device: int) -> None:
        """Ask the backend's adapter to route ``device`` (and, where it can, every device
        the process makes current later) to this routing's entry points."""
        with self._lock:
            routed = device in self._routes
        if routed:  # (a forked child's closing thread is gone: this starts one)
            self._start_closing_thread()
            return
        adapter = self.backend.allocator_adapter(device)
        handle = None
        if adapter is not None:
            # cut between the routing and its record, the handle would be lost: stop()
            # could never end that routing
            with interrupts.held(f"the routing of device {device}'s framework allocations"):
                handle = adapter.route_process(self.entry.path, self.entry.alloc_symbol,
                                               self.entry.free_symbol)
                if handle is not None:
                    with self._lock:
                        self._routes[device] = handle
        if handle is None:
            raise BackendUnavailableError(
                f"the {self.backend.name!r} backend cannot route a whole process's "
                f"framework allocations (its allocator adapter does not offer "
                f"route_process); wrap what should sleep in vmm_core.region() instead")
        self._start_closing_thread()

    def stop(self) -> None:
        """End the routing (memory already made stays tagged until the framework frees
        it) and the closing thread."""
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
        for handle in routes:
            close = getattr(handle, "close", None)
            if close is not None:
                close()
        self._stop.set()
        thread = self._closing
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * _WAIT_MS / 1000)
        self.close_freed()


_lock = threading.Lock()
_routing: ProcessRouting | None = None
_entry: SegmentEntry | None = None


def _fresh_after_fork() -> None:
    """A forked child has only the forking thread: a lock the closing thread held at
    the fork stays held there, and the closing thread is gone (the next route starts
    one)."""
    global _lock
    _lock = threading.Lock()
    if _routing is not None:
        _routing._lock = threading.Lock()
        _routing._closing = None


forksafe.at_fork("framework calls", after_in_child=_fresh_after_fork)


def entry() -> SegmentEntry:
    """The C entry points, loaded once per process."""
    global _entry
    with _lock:
        if _entry is None:
            _entry = SegmentEntry()
        return _entry


def route_process(tag: str, backend=None, device: int | None = None) -> ProcessRouting:
    """Route every framework allocation of this process on ``device`` (None: the current
    one; the adapter may cover devices made current later) into memory tagged ``tag``.

    One routing per process: calling again with the same tag routes one more device and
    returns it; another tag raises VMMError.  Regions, captures and ``outside_regions()``
    entered later keep their threads' and streams' allocations as before."""
    tag_state.check_tag(tag)
    be = registry.resolve(backend)
    dev = tag_state.current_device(be) if device is None else device
    global _routing
    seg = entry()
    with _lock:
        routing = _routing
        if routing is None:
            routing = _routing = ProcessRouting(tag, be, seg)
            seg.install(routing._alloc)
            atexit.register(_at_exit)
    if routing.tag != tag or routing.backend.name != be.name:
        raise VMMError(f"route_process({tag!r}, backend {be.name!r}): this process routes "
                       f"its allocations into {routing.tag!r} on {routing.backend.name!r} "
                       f"already; one routing per process")
    routing.route(dev)
    return routing


def process_routing() -> ProcessRouting | None:
    """The process's routing, or None."""
    return _routing


def _at_exit() -> None:
    """End the routing and stop the closing thread before the interpreter finalizes,
    and let nothing enter Python from the entry points from now on.  The routing ends
    first because finalization destroys the framework's pools, and torch 2.11's pool
    destructor aborts the process while an allocate-to-pool routing is underway."""
    routing = _routing
    try:
        if routing is not None:
            routing.stop()
    finally:
        if _entry is not None:
            _entry.disable()

