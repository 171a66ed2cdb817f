"""SharedVMMAllocator: many virtual spaces, one set of physical pages.

Every virtual space is a reserved range; physical handles are laid end to end from
offset 0 and each one is mapped at the *same offset* in every space.  A bump pointer per
space hands out addresses, so the first byte allocated in a new space lands on the same
physical page as the first byte of every older space: graphs captured in different spaces
share memory (``max(shape)``) while the framework's allocator sees unique addresses.

Physical memory grows in a few large handles (see :func:`growth_step`) because switching
spaces costs one map per handle.  Every failure leaves the allocator as it was: a handle
that cannot be mapped everywhere is unmapped and released before the error propagates.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import logging
import numbers
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

# imported before this module registers its fork hooks, so that the registry's are
# registered first: Python runs before-fork hooks in reverse order, and a fork must take
# the tagged-memory and allocator locks before the registry's (a capture block holding
# the tagged-memory lock may look a backend up; the other order stalled such a fork for
# the whole FORK_WAIT_SECONDS)
from .. import registry as _registry  # noqa: F401
from ..backend import Backend
from ..errors import (
    AllocationError,
    MappingError,
    OutOfMemoryError,
    ReservationExceededError,
    SleepStateError,
    VMMError,
)
from ..sizes import byte_count
from . import address_quarantine, reaper, tag_state
from . import live_ranges as _ranges
from . import offload as _offload

__all__ = ["SharedVMMAllocator", "growth_step"]

logger = logging.getLogger("vmm_core")

#: Growth never adds less than this fraction of what is already held ...
GROWTH_FRACTION = 32
#: ... nor more than this in one handle (bounds unused memory to one step).
MAX_GROWTH_BYTES = 1 << 30
#: Up to this many spaces a merge takes every handle (switches then map one handle, as
#: the H100/H200 numbers were measured); beyond, only the newest ones (see merge_tail).
FULL_MERGE_SPACES = 64


def check_size(what: str, value, remedy: str) -> int:
    """``value`` as a positive byte count any backend call can take (the bound of
    :func:`vmm_core.sizes.byte_count`), or AllocationError."""
    return byte_count(what, value, error=AllocationError, positive=True, remedy=remedy)


def check_wake_options(keep_host_buffers, eager) -> None:
    """The options of a wake, checked (ValueError): callers that wake several allocators,
    or ranks that must all wake or none, ask before any of them wakes."""
    if not isinstance(eager, bool):
        raise ValueError(f"wake_up: eager must be True or False, got {eager!r}")
    if keep_host_buffers is not None and not isinstance(keep_host_buffers, bool):
        raise ValueError(f"wake_up: keep_host_buffers must be True, False or None (the "
                         f"tag's policy), got {keep_host_buffers!r}")


def _weak(fn):
    """A weak reference to a callable: a bound method's dies with its object."""
    return weakref.WeakMethod(fn) if inspect.ismethod(fn) else weakref.ref(fn)


def check_device(device) -> int:
    """A device index: a non-negative int (``"0"`` or ``0.7`` would silently pick 0)."""
    if not isinstance(device, numbers.Integral) or isinstance(device, bool) or device < 0:
        raise AllocationError(f"device must be a device index (an int >= 0), got {device!r}")
    return int(device)


#: every allocator of this process, for the fork hooks below
_live: weakref.WeakSet = weakref.WeakSet()
#: held while an allocator joins ``_live``, and by a fork from its last look at ``_live``
#: until the child exists: no allocator is made unseen in between
_live_lock = threading.Lock()
_forking: list = []  # the locks taken for the fork in progress (None: forked without)
#: how long a fork waits for other threads to leave vmm_core's locks
FORK_WAIT_SECONDS = 10.0


def _before_fork() -> None:
    """Fork while no other thread is inside tagged memory or an allocator: a child that
    inherited a lock held by a thread it does not have hung on its first use of that
    memory (the reaper closing a dropped pool, a direct sleep/wake, ``memory_summary``),
    or got a fresh lock over a half-done map.  The tagged-memory lock first, as
    everywhere, so waiting closes no cycle among vmm_core's locks.  The wait is bounded:
    a thread holding a capture, replay or hold_awake block may itself wait for the
    forking thread, and os.fork() then hung forever; past ``FORK_WAIT_SECONDS`` the fork
    goes on and the child gets fresh locks (those threads only wait: no map is half
    done under them).

    The allocators are listed once the wait for the tagged-memory lock is over, and again
    once no new one can be made (``_live_lock``): listed before that wait, an allocator
    another thread made during it (and went on using) was forked with its lock held, and
    the child's first call on it never returned."""
    deadline = time.monotonic() + FORK_WAIT_SECONDS
    taken: list = []

    def take(lock) -> bool:
        if lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            taken.append(lock)
            return True
        for held in reversed(taken):
            held.release()
        taken.clear()
        return False

    def take_new() -> bool:
        mine = {id(lock) for lock in taken}
        return all(take(a._lock) for a in sorted(list(_live), key=id)
                   if id(a._lock) not in mine)

    # the allocators made so far, then the lock that keeps new ones out, then those made
    # meanwhile (their makers took no lock of ours: waiting for them closes no cycle)
    ok = take(tag_state.state_lock()) and take_new() and take(_live_lock) and take_new()
    _forking.append(taken if ok else None)


def _after_fork_in_parent() -> None:
    for lock in reversed(_forking.pop() or []):
        lock.release()


def _after_fork_in_child() -> None:
    global _live_lock
    taken = _forking.pop()
    if taken is not None:
        for lock in reversed(taken):
            lock.release()
        return
    tag_state._fresh_lock_in_child()
    _live_lock = threading.Lock()
    for alloc in list(_live):
        if not alloc._lock._is_owned():  # the forking thread's own holds stay
            alloc._lock = threading.RLock()
            alloc._holds = []  # holds of threads the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def _round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


def growth_step(shortfall: int, physical: int, granularity: int, limit: int) -> int:
    """Size of the next physical handle.

    At least the shortfall (so one allocation never needs two handles), and at least
    ``physical / GROWTH_FRACTION`` so that a slowly growing pool makes O(log) handles,
    not one per request: switching a space costs one map call per handle (measured on an
    H200: 2 MiB handles made 51 switches 11x slower than 64 MiB ones).  Unused memory is
    bounded by one step (about 3% of what is held, and never more than
    ``MAX_GROWTH_BYTES``).  ``limit`` is what the reservation still has room for.
    """
    want = max(shortfall, min(MAX_GROWTH_BYTES, physical // GROWTH_FRACTION))
    return min(_round_up(want, granularity), limit)


@dataclass(eq=False)
class _Physical:
    handle: object
    offset: int
    size: int
    #: indices of the spaces it is mapped into: a merge remaps only those
    spaces: set = field(default_factory=set)


@dataclass(eq=False)
class _Space:
    index: int
    base: int
    size: int
    mapped: list = field(default_factory=list)  # _Physical objects mapped here
    cursor: int = 0
    live: dict = field(default_factory=dict)  # address -> size


class SharedVMMAllocator:
    """Bump allocator over per-capture virtual spaces sharing one physical pool.

    :param backend: a :class:`vmm_core.Backend`, a backend name, or None (auto-detect).
    :param device: device index of that backend.
    :param reserve_bytes: size of each virtual space (default: the backend's).
    :param growth_bytes: fixed size of each new physical handle, overriding
        :func:`growth_step` (handles never get smaller than a request).
    :param tag: sleep/wake tag (informational; :mod:`vmm_core.memory.tagged` registers it).
    :param scratch: the bytes need not survive :meth:`compact` (graph pools: every
        replay rewrites its intermediates, and the escape guard ensures nothing else
        lives there), so compaction skips copying them.

    Thread-safe.  Not picklable: addresses are only meaningful in this process.
    """

    def __init__(self, backend: Backend | str | None = None, device: int = 0,
                 reserve_bytes: int | None = None, growth_bytes: int | None = None,
                 tag: str | None = None, scratch: bool = False) -> None:
        from .. import get_backend

        if backend is None or isinstance(backend, str):
            backend = get_backend(backend)
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a vmm_core Backend or a name, got {backend!r}")
        self.backend = backend
        self.device = check_device(device)
        self.tag = tag
        self.scratch = scratch
        self.caps = backend.capabilities(self.device)
        g = self.caps.granularity
        self.granularity = g
        if reserve_bytes is None:
            reserve_bytes = self.caps.default_reserve_bytes
        reserve_bytes = check_size("reserve_bytes", reserve_bytes, "reserve less")
        self.reserve_bytes = check_size("reserve_bytes", _round_up(reserve_bytes, g),
                                        "reserve less")
        if growth_bytes is not None:
            growth_bytes = check_size("growth_bytes", growth_bytes, "grow by less")
        self.growth_bytes = None if growth_bytes is None else _round_up(growth_bytes, g)
        reaper.start()  # dropped allocators are closed there, not inside the collector
        self._lock = threading.RLock()
        with _live_lock:  # a fork in progress sees it (and waits for its lock) or not yet
            _live.add(self)
        self._physical: list[_Physical] = []
        self._spaces: dict[int, _Space] = {}
        self._bases: list[tuple[int, int]] = []  # sorted (base, index): deallocate's lookup
        self._next_index = 0
        # the space allocate() uses; None only once closed, and every entry point checks
        self._current: _Space = None  # type: ignore[assignment]  # set by _new_space()
        self._closed = False
        self._asleep = False
        self._sleep_sizes: list[int] = []
        #: the offloaded bytes, or host buffers kept by keep_host_buffers
        self._host_copy: _offload.HostCopy | None = None
        #: physical (offset, size) ranges whose bytes the host copy holds, in order
        self._saved_ranges: list[tuple[int, int]] | None = None
        #: a host copy being made in the background (prepare_host_copy(background=True))
        self._pending_copy: _offload.PendingCopy | None = None
        self._offloaded = False
        #: the ``(address, nbytes)`` ranges whose bytes an offloading sleep keeps (a
        #: callable set by the allocator's owner, :mod:`vmm_core.memory.live_ranges`),
        #: or None: every mapped byte
        self.live_ranges: Callable[[], list[tuple[int, int]]] | None = None
        #: when True a sleep that discards still keeps the live ranges (graph pools:
        #: blocks alive after a capture, which replays read, never come back as garbage)
        self.preserve_live = False
        self._holds: list[str] = []  # what holds it awake (hold_awake), on the lock's thread
        #: the last offload save/restore (offload.Transfer), for reports
        self.last_transfer: _offload.Transfer | None = None
        self.switch_seconds: list[float] = []
        self.compact_seconds: list[float] = []
        self.merge_on_switch = True
        self._floor = 0  # bytes promised by extend_mapping; compaction keeps them
        #: the largest cursor of any space (what a merge keeps), None once a space went:
        #: recomputed by the next merge, not by every release
        self._used: int | None = 0
        self._broken: Exception | None = None  # a rollback that failed: refuse all work
        #: wake maps only the current space; the others on ensure_mapped() (graph pools:
        #: a wake then costs one map, not one per captured graph)
        self.lazy_wake = False
        self._dormant: set[int] = set()  # spaces left unmapped by a lazy wake
        #: weak references to what is told of sleeps and wakes, and what adds to
        #: memory_stats (graph pools: their executables), see add_sleep_listener
        self._listeners: list = []
        self._stats_providers: list = []
        self._new_space()

    # ------------------------------------------------------------------ properties
    @property
    def physical_bytes(self) -> int:
        """Bytes of physical memory currently held (0 while asleep or closed)."""
        with self._lock:
            return sum(p.size for p in self._physical)

    @property
    def num_virtual_spaces(self) -> int:
        with self._lock:
            return len(self._spaces)

    @property
    def num_handles(self) -> int:
        with self._lock:
            return len(self._physical) if not self._asleep else len(self._sleep_sizes)

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def current_space(self) -> int:
        """Index of the space ``allocate`` uses now."""
        self._check_open()
        return self._current.index

    def space_indices(self) -> list[int]:
        with self._lock:
            return sorted(self._spaces)

    def space_base(self, index: int | None = None) -> int:
        return self._space(index).base

    def space_used_bytes(self, index: int | None = None) -> int:
        """High-water mark of the bump pointer in that space."""
        return self._space(index).cursor

    def translate(self, address: int, to_space: int) -> int:
        """The address in ``to_space`` that aliases ``address`` (same physical byte)."""
        with self._lock:
            src = self._space_of(address)
            if src is None:
                raise MappingError(f"translate: {address:#x} is in no live virtual space")
            return self._space(to_space).base + (address - src.base)

    def live_allocations(self, index: int | None = None) -> dict[int, int]:
        """Addresses allocated in a space and not deallocated (address -> size)."""
        with self._lock:
            return dict(self._space(index).live)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("asleep" if self._asleep else "awake")
        return (f"<SharedVMMAllocator {self.backend.name}:{self.device} {state} "
                f"physical={self.physical_bytes} spaces={self.num_virtual_spaces}>")

    # ------------------------------------------------------------------ allocation
    def allocate(self, nbytes: int) -> int:
        """Return an address of ``nbytes`` (granularity-rounded) in the current space."""
        if not isinstance(nbytes, numbers.Integral) or isinstance(nbytes, bool) \
                or nbytes <= 0:
            raise AllocationError(f"allocate: nbytes must be a positive int, got {nbytes!r}")
        nbytes = int(nbytes)
        with self._lock:
            self._check_awake("allocate")
            space = self._current
            size = _round_up(nbytes, self.granularity)
            end = space.cursor + size
            if end > space.size:
                raise ReservationExceededError(
                    f"allocate({nbytes}): space {space.index} would need {end} bytes but "
                    f"reserves {space.size}; create the SharedVMMAllocator with a larger "
                    f"reserve_bytes (GraphPool(reserve_bytes=...) or region(tag, "
                    f"reserve_bytes=...) where those made it), or allocate the rest in a "
                    f"new space (a new GraphPool key)")
            if end > self._mapped_bytes():
                self._grow_to(end)
            address = space.base + space.cursor
            space.cursor = end
            if self._used is not None and end > self._used:
                self._used = end
            space.live[address] = size
            return address

    def deallocate(self, address: int) -> None:
        """Forget an allocation.  Physical memory is not reused until a new space.

        Never raises: the framework calls it from its free path, where an exception
        cannot be handled.
        """
        try:
            with self._lock:
                space = self._space_of(address)
                if space is not None:
                    space.live.pop(address, None)
        except Exception:
            pass

    def extend_mapping(self, nbytes: int) -> None:
        """Ensure at least ``nbytes`` of physical memory, mapped into every space."""
        if not isinstance(nbytes, numbers.Integral) or isinstance(nbytes, bool) \
                or nbytes < 0:
            raise AllocationError(f"extend_mapping: nbytes must be an int >= 0, got {nbytes!r}")
        nbytes = int(nbytes)
        with self._lock:
            self._check_awake("extend_mapping")
            if nbytes > self.reserve_bytes:
                raise ReservationExceededError(
                    f"extend_mapping({nbytes}) exceeds the virtual space of "
                    f"{self.reserve_bytes} bytes; create the allocator with a larger "
                    f"reserve_bytes")
            self._map_missing()
            if nbytes > self._mapped_bytes():
                self._grow_to(nbytes, everywhere=True)
            # promised only once it is really held: compaction keeps this many bytes
            self._floor = max(self._floor, _round_up(nbytes, self.granularity))

    def _mapped_bytes(self) -> int:
        return self._physical[-1].offset + self._physical[-1].size if self._physical else 0

    def _grow_to(self, needed: int, everywhere: bool = False) -> None:
        """Add one handle covering ``needed``; map it into the current space, or all.

        Growth driven by ``allocate`` maps only into the current space: older spaces
        never allocate past their own cursor, so they do not need it, and mapping it
        everywhere would make every growth cost O(spaces).  They receive it at the next
        compaction (every switch) or :meth:`extend_mapping`.
        """
        held = self._mapped_bytes()
        limit = self.reserve_bytes - held
        if self.growth_bytes is not None:
            size = min(max(self.growth_bytes, _round_up(needed - held, self.granularity)), limit)
        else:
            size = growth_step(needed - held, held, self.granularity, limit)
        handle = self.backend.create_handle(self.device, size)  # raises OutOfMemoryError
        phys = _Physical(handle, held, size)
        targets = list(self._spaces.values()) if everywhere else [self._current]
        try:
            self._map_into_spaces(targets, [phys])
        except BaseException:
            self._release_quietly(handle)
            raise
        self._physical.append(phys)

    def _map_into_spaces(self, spaces: list, physicals: list[_Physical]) -> None:
        """Map ``physicals`` into every one of ``spaces``, or into none of them."""
        done: list[_Space] = []
        try:
            for space in spaces:
                self._map_into(space, physicals)
                done.append(space)
        except BaseException:
            for space in done:
                self._unmap_from(space, physicals)
            raise

    def _map_missing(self) -> None:
        """Map into every space the handles that lazy growth left out of it."""
        for space in self._spaces.values():
            missing = [p for p in self._physical if p not in space.mapped]
            if missing:
                self._map_into(space, missing)
            self._dormant.discard(space.index)

    # ------------------------------------------------------------------ spaces
    def switch_to_new_virtual_space(self) -> int:
        """Reserve a new range, map every physical handle into it, make it current.

        Returns the new space's index.  Costs one map per handle (plus one access call).
        """
        with self._lock:
            self._check_awake("switch_to_new_virtual_space")
            if self.merge_on_switch and len(self._physical) > 1:
                self.merge_tail()
            t0 = time.perf_counter()
            space = self._new_space()
            self.switch_seconds.append(time.perf_counter() - t0)
            return space.index

    def _new_space(self) -> _Space:
        self._check_open()
        address_quarantine.retry(self.backend, self.device)
        base = self.backend.reserve(self.device, self.reserve_bytes, self.granularity)
        space = _Space(self._next_index, base, self.reserve_bytes)
        try:
            if not self._asleep:
                self._map_into(space, self._physical)
        except BaseException:
            try:
                self.backend.release_range(self.device, base, self.reserve_bytes)
            except VMMError:
                pass
            raise
        self._next_index += 1
        self._spaces[space.index] = space
        bisect.insort(self._bases, (space.base, space.index))
        self._current = space
        return space

    def compact(self) -> bool:
        """Replace all handles by one, trimmed to what the spaces use.  Keeps contents.

        Growth adds a handle per step, and every later switch pays one map per handle;
        merging keeps switches at one map and drops the unused tail of the last growth
        step.  It remaps every space, so switches and replays call :meth:`merge_tail`
        instead.  Transiently needs the used bytes twice; if that memory is not available
        nothing changes and False is returned.  Returns True when it merged.
        """
        with self._lock:
            self._check_awake("compact")
            return self._merge_from(0)

    def merge_tail(self) -> bool:
        """Merge the newest handles, keeping the cost of merging amortized per space.

        Merging handles remaps every space that maps one of them.  Merging everything at
        every switch made each new key remap all older spaces when every key grew (26 ms
        per key at 500 keys, 640 ms at 2500, on the host).  Here the newest handles are
        merged only while the next older one is mapped into at most twice as many spaces
        as they are (a binary counter): a space is remapped O(log spaces) times over its
        life and a switch maps O(log spaces) handles.  Up to ``FULL_MERGE_SPACES`` spaces
        everything is merged, as :meth:`compact` does.  Returns True when it merged.
        """
        with self._lock:
            self._check_awake("merge_tail")
            physical = self._physical
            i = len(physical) - 1
            if i < 1:
                return False
            if len(self._spaces) <= FULL_MERGE_SPACES:
                return self._merge_from(0)
            spaces = set(physical[i].spaces)
            while i >= 1 and len(physical[i - 1].spaces) <= 2 * len(spaces):
                i -= 1
                spaces |= physical[i].spaces
            return i < len(physical) - 1 and self._merge_from(i)

    def _merge_from(self, first: int) -> bool:
        """Replace handles ``first:`` by one (trimmed to what the spaces use), remapping
        only the spaces they are mapped into; all or nothing."""
        if self._used is None:
            self._used = max([s.cursor for s in self._spaces.values()], default=0)
        used = max(self._used, self._floor)
        old = self._physical[first:]
        if not old:
            return False
        start = old[0].offset
        end = min(_round_up(used, self.granularity), self._mapped_bytes())
        size = end - start
        if (len(old) == 1 and old[0].size == size) or (size <= 0 and first == 0):
            return False
        t0 = time.perf_counter()
        be, dev = self.backend, self.device
        new = None
        if size > 0:
            try:
                new = _Physical(be.create_handle(dev, size), start, size)
            except OutOfMemoryError:
                return False
        be.synchronize(dev)  # kernels may still be writing the bytes we copy or unmap
        if new is not None and not self.scratch:
            try:
                self._copy_into_handle(new)
            except BaseException:
                self._release_quietly(new.handle)
                raise
        indices = set().union(*(p.spaces for p in old))
        targets = [self._spaces[i] for i in sorted(indices) if i in self._spaces]
        swapped: list[tuple[_Space, list]] = []
        try:
            for space in targets:
                previous = [p for p in space.mapped if p in old]
                try:
                    self._unmap_from(space, previous)
                except BaseException:  # half unmapped: map back what went
                    self._restore(space, [p for p in previous if p not in space.mapped])
                    raise
                try:
                    if new is not None:
                        self._map_into(space, [new])
                except BaseException:
                    self._restore(space, previous)
                    raise
                swapped.append((space, previous))
        except BaseException:
            for space, previous in swapped:
                if new is not None:
                    try:
                        self._unmap_from(space, [new])
                    except VMMError as exc:
                        self._broken = exc
                self._restore(space, previous)
            if new is not None:
                self._release_quietly(new.handle)
            raise
        for p in old:
            self._release_quietly(p.handle)
        self._physical = self._physical[:first] + ([new] if new is not None else [])
        self.compact_seconds.append(time.perf_counter() - t0)
        return True

    def _restore(self, space: _Space, previous: list) -> None:
        """Map ``previous`` back into ``space`` after a failed swap.  If even that fails
        the space is unusable: the allocator refuses all further work instead of handing
        out addresses with nothing behind them."""
        try:
            self._map_into(space, previous)
        except VMMError as exc:
            self._broken = exc

    def _copy_into_handle(self, new: _Physical) -> None:
        """Copy the bytes of the current space at ``new``'s offset into ``new``."""
        be, dev = self.backend, self.device
        tmp = be.reserve(dev, new.size, self.granularity)
        scratch = _Space(-1, tmp - new.offset, new.size)  # maps new at its own offset
        try:
            self._map_into(scratch, [new])
            try:
                be.copy_device(dev, self._current.base + new.offset, tmp, new.size)
                be.synchronize(dev)
            finally:
                self._unmap_from(scratch, [new])
        finally:
            be.release_range(dev, tmp, new.size)

    def activate_space(self, index: int) -> None:
        """Make an existing space current again, so ``allocate`` bumps on in it.

        A graph runner that captures lazily reopens a key's space to capture more graphs
        into it.  Handles that growth added while another space was current are mapped in
        first: ``allocate`` only ever grows the current space.
        """
        with self._lock:
            self._check_awake("activate_space")
            space = self._space(index)
            if space is self._current:
                return
            missing = [p for p in self._physical if p not in space.mapped]
            if missing:
                self._map_into(space, missing)
            self._dormant.discard(index)
            self._current = space

    def ensure_mapped(self, index: int) -> None:
        """Map the physical pages into space ``index`` if a lazy wake left it unmapped."""
        with self._lock:
            if index in self._dormant:
                self._check_awake("ensure_mapped")
                self._map_into(self._space(index), list(self._physical))
                self._dormant.discard(index)

    def release_virtual_space(self, index: int) -> None:
        """Unmap and give back a space whose graphs were dropped.  Not the current one."""
        with self._lock:
            space = self._space(index)
            if space is self._current:
                raise VMMError(f"release_virtual_space({index}): it is the current space; "
                               f"switch_to_new_virtual_space() first")
            self.backend.synchronize(self.device)
            self._unmap_from(space, list(space.mapped))
            address_quarantine.give_back(self.backend, self.device, [(space.base, space.size)])
            del self._spaces[index]
            self._bases.remove((space.base, index))
            self._used = None
            self._dormant.discard(index)

    def _map_into(self, space: _Space, physicals: list[_Physical]) -> None:
        """Map ``physicals`` into ``space`` and grant access; all or nothing."""
        caps, dev, be = self.caps, self.device, self.backend
        done: list[_Physical] = []
        try:
            for p in physicals:
                be.map(dev, space.base + p.offset, p.size, p.handle, 0)
                done.append(p)
                space.mapped.append(p)
                p.spaces.add(space.index)
            if caps.needs_set_access and physicals:
                if caps.set_access_spans_mappings:
                    start = min(p.offset for p in physicals)
                    end = max(p.offset + p.size for p in physicals)
                    be.set_access(dev, space.base + start, end - start)
                else:
                    for p in physicals:
                        be.set_access(dev, space.base + p.offset, p.size)
        except BaseException:
            self._unmap_from(space, done)
            raise

    def _unmap_from(self, space: _Space, physicals: list[_Physical]) -> None:
        """Unmap ``physicals`` from ``space``; one whose unmap failed stays listed as
        mapped (it still is), so a rollback maps back only what really went."""
        errors = []
        for p in physicals:
            try:
                self.backend.unmap(self.device, space.base + p.offset, p.size)
            except VMMError as exc:
                errors.append(exc)
                continue
            if p in space.mapped:
                space.mapped.remove(p)
            p.spaces.discard(space.index)
        if errors:
            raise errors[0]

    def _release_quietly(self, handle) -> None:
        try:
            self.backend.release_handle(self.device, handle)
        except VMMError:
            pass

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, offload: bool = False) -> None:
        """Release every physical page; virtual addresses stay reserved.

        With ``offload=True`` the bytes are copied to host memory first (see
        :mod:`vmm_core.memory.offload` for how) and come back on :meth:`wake`: every
        mapped byte, or only the ranges :attr:`live_ranges` names when the allocator's
        owner set it (the rest comes back undefined, as discarded memory does).  With
        :attr:`preserve_live` those ranges are kept even when ``offload`` is False.  If
        the copy fails the allocator stays awake with its memory untouched.  Sleeping
        while asleep is a no-op; sleeping inside :meth:`hold_awake` raises
        SleepStateError.
        """
        # a kept copy is registered once the handles are released, not beside that
        with _offload.deferred_pinning(), self._lock:
            self.check_can_sleep()
            if self._asleep:
                return
            be, dev = self.backend, self.device
            be.synchronize(dev)
            saved, ranges = None, None
            if (offload or self.preserve_live) and self._physical:
                # asked first: a live_ranges that fails refuses the sleep, nothing changed
                ranges, layout = self._copy_plan()
                saved = self._save(ranges, layout)
            else:
                self._drop_host_copy()  # discarded bytes need no host copy
            try:
                for space in self._spaces.values():
                    self._unmap_from(space, list(space.mapped))
            except VMMError as exc:
                self._broken = exc  # some spaces unmapped, some not: neither awake nor asleep
                raise
            self._dormant.clear()
            self._sleep_sizes = [p.size for p in self._physical]
            for p in self._physical:
                self._release_quietly(p.handle)
            self._physical = []
            self._offloaded = saved is not None
            self._saved_ranges = ranges if saved is not None else None
            self._asleep = True
        self._notify("sleep")  # outside the lock: listeners take their own

    def _drop_host_copy(self) -> None:
        """Give back the kept host copy and one being made: a sleep that discards leaves
        their bytes meaningless, and host memory holds copies only of memory that is
        offloaded (a tag offloaded again makes its copy again)."""
        host, self._host_copy, self._saved_ranges = self._host_copy, None, None
        _offload.release(host)
        pending, self._pending_copy = self._pending_copy, None
        if pending is not None:
            pending.abandon()

    def _copy_plan(self) -> tuple[list[tuple[int, int]], list[int]]:
        """What an offloading sleep copies now: physical ``(offset, size)`` ranges in
        order, and the host copy's layout (one buffer per handle when every byte is
        copied, one for all the live ranges otherwise)."""
        if self.live_ranges is None:
            ranges = [(p.offset, p.size) for p in self._physical]
            return ranges, [size for _, size in ranges]
        live = _ranges.checked(self.live_ranges(), "SharedVMMAllocator.live_ranges")
        mapped = self._mapped_bytes()
        offsets = []
        for address, nbytes in live:
            space = self._space_of(address)
            if space is None or nbytes == 0:
                continue  # not this allocator's memory: nothing of it to keep
            start = address - space.base
            end = min(start + nbytes, mapped)
            if end > start:
                offsets.append((start, end - start))
        ranges = _ranges.merge(offsets)
        return ranges, ([sum(n for _, n in ranges)] if ranges else [])

    def _save(self, ranges: list[tuple[int, int]], layout: list[int]):
        """Copy ``ranges`` of the current space to host memory (the sleep's copy);
        returns the host copy, or None when nothing is live."""
        be, dev = self.backend, self.device
        # a copy made in the background since the region ended: wait for its pages
        # (work any fresh copy needs too), never for its registration
        pending, self._pending_copy = self._pending_copy, None
        prepared = pending.take() if pending is not None else None
        kept = self._host_copy
        if kept is not None and not kept.fits(layout):
            # the tag changed size: free the kept copy before a new one is filled,
            # so that host memory never holds both
            self._host_copy = None
            self._saved_ranges = None
            _offload.release(kept)
        if prepared is not None:
            if self._host_copy is None and prepared.fits(layout):
                self._host_copy = prepared
            else:
                _offload.release(prepared)
                prepared = None
        if not ranges:  # nothing live: nothing to keep either
            host, self._host_copy = self._host_copy, None
            _offload.release(host)
            return None
        src = self._current
        regions = [(src.base + offset, size) for offset, size in ranges]
        saved, self.last_transfer = _offload.save(
            be, dev, regions, reuse=self._host_copy,
            pin=_offload.keeps_host_buffers(self.tag), layout=layout,
            wait_pinned=prepared is None or self._host_copy is not prepared)
        if saved is not self._host_copy:
            _offload.release(self._host_copy)  # a kept buffer that did not fit
        self._host_copy = saved
        return saved

    def wake(self, keep_host_buffers: bool | None = None, zero: bool = False,
             eager: bool = False) -> None:
        """Re-create the physical pages at the same addresses (and restore offloaded bytes).

        Memory that was discarded (slept without offload) holds undefined bytes after
        wake: fresh physical pages may hold anything (on CUDA, whatever the device last
        stored there).  ``zero=True`` fills it with zeros before wake returns; offloaded
        memory gets its bytes back either way.

        With ``keep_host_buffers`` the host copy is kept (pinned) for the next offloading
        sleep, which then copies straight into it; with False it is freed before wake
        returns; None (default) follows the tag's policy
        (:func:`vmm_core.memory.offload.keeps_host_buffers`: keep, unless configured).
        If the memory cannot be had (OutOfMemoryError), or the copy back or the zeroing
        fails, the allocator stays asleep with its host copy intact: call again.  Waking
        while awake is a no-op.  ``eager`` is passed to the sleep listeners
        (:meth:`add_sleep_listener`): graph pools then make their executables again now
        instead of on each graph's first replay.
        """
        check_wake_options(keep_host_buffers, eager)
        # a copy kept against the tag's policy is registered once this lock is let go
        with _offload.deferred_pinning(), self._lock:
            self._check_open()
            if not self._asleep:
                return
            be, dev = self.backend, self.device
            created: list[_Physical] = []
            offset = 0
            try:
                for size in self._sleep_sizes:
                    created.append(_Physical(be.create_handle(dev, size), offset, size))
                    offset += size
                # lazy: only the current space now; the others when first used
                targets = [self._current] if self.lazy_wake else list(self._spaces.values())
                self._map_into_spaces(targets, created)
            except BaseException:
                for p in created:
                    self._release_quietly(p.handle)
                raise
            dst = self._current
            everything = [(p.offset, p.size) for p in created]
            try:
                blank = everything
                if self._offloaded and self._host_copy is not None:
                    saved = self._saved_ranges if self._saved_ranges is not None else everything
                    self.last_transfer = _offload.restore(
                        be, dev, [(dst.base + o, n) for o, n in saved], self._host_copy)
                    blank = _ranges.subtract(everything, saved)
                if zero and blank:
                    for offset, size in blank:
                        be.memset(dev, dst.base + offset, 0, size)
                    be.synchronize(dev)
            except BaseException:
                self._back_to_sleep(targets, created)
                raise
            self._physical = created
            self._dormant = {s.index for s in self._spaces.values() if s not in targets}
            self._asleep = False
            self._offloaded = False
            if keep_host_buffers is None:
                keep_host_buffers = _offload.keeps_host_buffers(self.tag)
            if not keep_host_buffers:
                host, self._host_copy = self._host_copy, None
                self._saved_ranges = None
                _offload.release(host)
            elif self._host_copy is not None:  # kept against the tag's policy: the
                _offload._pin_later(be, dev, self._host_copy)  # sleep did not pin it
        self._notify("wake", eager=eager)

    # ------------------------------------------------------------------ listeners
    def add_sleep_listener(self, fn) -> None:
        """Call ``fn(event, **kw)`` after every sleep (``event="sleep"``, once the pages
        are released) and wake (``event="wake", eager=<bool>``, once it is complete).

        Held weakly (a bound method of a dropped object disappears; a lambda nobody else
        holds disappears at once), called outside this allocator's lock, and an exception
        it raises is logged and swallowed: the sleep or wake already happened."""
        with self._lock:
            self._listeners.append(_weak(fn))

    def remove_sleep_listener(self, fn) -> None:
        with self._lock:
            self._listeners = [r for r in self._listeners if r() is not None and r() != fn]

    def add_stats_provider(self, fn) -> None:
        """Add what ``fn()`` returns (a dict of numbers) to :meth:`memory_stats`, summed
        over providers (held weakly, as listeners are): what lives beside these pages and
        goes with them, such as a graph pool's executables."""
        with self._lock:
            self._stats_providers.append(_weak(fn))

    def _notify(self, event: str, **kw) -> None:
        with self._lock:
            self._listeners = [r for r in self._listeners if r() is not None]
            listeners = [r() for r in self._listeners]
        for fn in listeners:
            if fn is None:
                continue
            try:
                fn(event, **kw)
            except Exception:
                logger.exception("a listener of %s of %r failed (the %s itself is done)",
                                 event, self, event)

    def _back_to_sleep(self, targets: list, created: list) -> None:
        """Undo the mapping half of a wake whose copy failed: asleep again, host copy kept."""
        try:
            for space in targets:
                self._unmap_from(space, created)
        except VMMError as exc:
            self._broken = exc
            return
        for p in created:
            self._release_quietly(p.handle)

    @contextlib.contextmanager
    def hold_awake(self, what: str = "this memory", holder: str = "a hold_awake block"):
        """Hold the lock and refuse to run unless awake: no sleep slips in until the block
        ends (other threads' sleeps wait; this thread's raise SleepStateError naming
        ``holder``).

        Takes the process-wide lock of tagged memory first, as every sleep, wake and
        graph capture or replay does: one lock order for every entry point, so a replay
        (or ``before_replay``) inside the block cannot deadlock against another thread's
        replay, which holds that lock while it waits for this allocator."""
        with tag_state.state_lock(), self._lock:
            self._check_open()
            if self._asleep:
                how = f"vmm_core.wake_up({self.tag!r})" if self.tag else "wake()"
                raise SleepStateError(f"{what} is asleep; call {how} first")
            self._holds.append(holder)
            try:
                yield self
            finally:
                self._holds.pop()

    def check_can_sleep(self) -> None:
        """Raise what :meth:`sleep` would refuse with now, without sleeping: memory closed
        or inconsistent after a failed rollback (VMMError), or held awake on this thread
        (SleepStateError).  Callers that sleep several allocators, or ranks that must all
        sleep or none, ask each one first, so none sleeps when one would refuse."""
        with self._lock:
            self._check_open()
            if self._holds and not self._asleep:
                raise SleepStateError(f"sleep: the allocator is held awake on this thread by "
                                      f"{self._holds[-1]}; leave that block first")

    def held_by(self) -> str | None:
        """What holds this allocator awake (:meth:`hold_awake`), or None.  Only the thread
        holding the lock of tagged memory can see a hold: every hold takes that lock."""
        holds = self._holds
        return holds[-1] if holds else None

    def held_here(self) -> str | None:
        """What holds this allocator awake on the calling thread, or None.  A hold owns
        the allocator's lock for its whole block, so another thread's is never seen: a
        close from there waits for the block instead of being refused."""
        holds = self._holds
        mine = self._lock._is_owned()  # type: ignore[attr-defined]  # CPython's RLock has it
        return holds[-1] if holds and mine else None

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held for this allocator (offloaded or kept buffers, and
        a copy being made in the background once its pages are there)."""
        host, pending = self._host_copy, self._pending_copy
        return (host.held_bytes if host is not None else 0) + \
            (pending.held_bytes if pending is not None else 0)

    @property
    def pinned_host_bytes(self) -> int:
        """Of :attr:`host_bytes`, those pinned (registered with the backend)."""
        host, pending = self._host_copy, self._pending_copy
        return (host.pinned_bytes if host is not None else 0) + \
            (pending.pinned_bytes if pending is not None else 0)

    def _layout_to_prepare(self) -> list[int]:
        """The layout of the host copy a prepare makes now (empty: nothing mapped or
        nothing live); refuses a closed or sleeping allocator (its copy is made already).
        Under the allocator's lock."""
        self._check_open()
        if self._asleep:
            how = f"vmm_core.wake_up({self.tag!r})" if self.tag else "wake()"
            raise SleepStateError(f"offload.prepare: the memory is asleep (its host copy "
                                  f"is made already); call {how} first")
        if not self._physical:
            return []
        return self._copy_plan()[1]

    def host_copy_wanted(self) -> int:
        """Bytes of host memory :meth:`prepare_host_copy` would make now (0: its kept copy
        is pinned and fits, or nothing is live), or what it would refuse with (closed,
        asleep).  Callers that prepare several allocators ask each one first, so a refusal
        prepares none."""
        with self._lock:
            layout = self._layout_to_prepare()
            host = self._host_copy
            if not layout:
                return 0
            if host is not None and host.fits(layout):
                host.wait_pinned()  # a registration in flight: the copy is pinned soon
                if host.pinned_bytes:
                    return 0
            return sum(layout)

    def host_copy_address(self, address: int, nbytes: int) -> int | None:
        """Host address of the device bytes ``[address, address + nbytes)`` in this
        allocator's host copy (offloaded now, or kept from the last sleep, holding the
        bytes as they were then), or None when no copy holds them: memory discarded,
        a copy given back at wake, or bytes the sleep left out as free.  For
        ``torch_memory_saver``'s ``get_cpu_backup``."""
        with self._lock:
            host, ranges = self._host_copy, self._saved_ranges
            if host is None or ranges is None or not host.held_bytes:
                return None
            space = self._space_of(address)
            if space is None:
                return None
            start = address - space.base
            offset = 0
            for o, n in ranges:
                if o <= start and start + nbytes <= o + n:
                    return host.address(offset + start - o, nbytes)
                offset += n
            return None

    def prepare_host_copy(self, background: bool = False) -> None:
        """Make the pinned host copy the next offloading sleep fills, now
        (``vmm_core.memory.offload.prepare``), sized to what that sleep would copy now
        (the live ranges when :attr:`live_ranges` is set).

        With ``background`` only the ranges are asked for here; the copy's pages are
        faulted in and registered off the calling thread (``region(tag,
        prepare_offload=True)``).  A sleep that comes first waits for the pages, work any
        fresh copy needs too, but never for the registration: until that finishes it
        copies through the staging ring into them, which is faster than waiting (on an
        H100 registering 4 GiB took 0.32 s, a whole staged copy of 4 GiB 0.22 s)."""
        with self._lock:
            layout = self._layout_to_prepare()
            if not layout:
                return
            host, pending = self._host_copy, self._pending_copy
            if host is not None and host.fits(layout):
                if background:
                    return  # made already (its registration, if any, goes on)
                host.wait_pinned()  # a registration in flight: the copy is pinned soon
                if host.pinned_bytes:
                    return
            if background and pending is not None and pending.fits(layout):
                return  # being made already
            # awake, the copy's bytes mean nothing: free it before the new one is made,
            # so that host memory never holds both
            self._host_copy, self._saved_ranges, self._pending_copy = None, None, None
            _offload.release(host)
            if pending is not None:
                pending.abandon()
            if background:
                self._pending_copy = _offload.prepare_later(self.backend, self.device,
                                                            sum(layout))
            else:
                self._host_copy = _offload.prepared_copy(self.backend, self.device, layout)

    def memory_stats(self) -> dict:
        """Device and host bytes, spaces, handles and sleep state (``memory_summary``),
        plus the numbers of the stats providers (:meth:`add_stats_provider`)."""
        with self._lock:
            stats = {"backend": self.backend.name, "device": self.device,
                     "device_bytes": self.physical_bytes, "host_bytes": self.host_bytes,
                     "pinned_host_bytes": self.pinned_host_bytes,
                     "spaces": len(self._spaces), "handles": self.num_handles,
                     "asleep": self._asleep, "offloaded": self._asleep and self._offloaded}
            providers = [r() for r in self._stats_providers]
        for fn in providers:  # outside the lock: providers take their own
            if fn is None:
                continue
            for name, value in fn().items():
                stats[name] = stats.get(name, 0) + value
        return stats

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unmap and release everything.  Idempotent.

        Refused on the thread that holds it awake (a capture space, a replay block,
        ``hold_awake``): that block goes on using the memory, so closing under it
        unmapped what its kept outputs point at.  Other threads wait for the block."""
        with self._lock:
            if self._closed:
                return
            held = self.held_here()
            if held is not None:
                raise VMMError(f"SharedVMMAllocator.close() inside {held}, which holds it "
                               f"awake on this thread: leave that with block first, then "
                               f"close()")
            self._closed = True
            be, dev = self.backend, self.device
            try:
                be.synchronize(dev)
            except VMMError:
                pass
            unmapped = []
            for space in list(self._spaces.values()):
                try:
                    self._unmap_from(space, list(space.mapped))
                    unmapped.append((space.base, space.size))
                except VMMError:
                    pass  # still mapped: the pages stay, so must the addresses
            # a region's framework pool goes with its allocator: its cached segments are
            # freed (the range can then go back), and no later allocator reuses it
            tag_state.forget_pool(self)
            address_quarantine.give_back(be, dev, unmapped)  # never raises
            for p in self._physical:
                self._release_quietly(p.handle)
            self._spaces.clear()
            self._bases.clear()
            self._physical = []
            self._current = None  # type: ignore[assignment]  # closed: see _check_open
            self._drop_host_copy()  # one being made is freed once made

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # never close inside the garbage collector: it may run while a backend lock is held
        try:
            if not self._closed:
                reaper.close_later(self.close)
        except Exception:  # a half-built object, or interpreter shutdown
            pass

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise VMMError("the SharedVMMAllocator is closed; create a new one")
        if self._broken is not None:
            raise VMMError(f"the SharedVMMAllocator is inconsistent after a failed rollback "
                           f"({self._broken}); its spaces may have nothing mapped. close() "
                           f"it and create a new one")

    def _check_awake(self, what: str) -> None:
        self._check_open()
        if self._asleep:
            how = f"vmm_core.wake_up({self.tag!r})" if self.tag else "wake()"
            raise SleepStateError(f"{what}: the memory is asleep; call {how} first")

    def _space(self, index: int | None) -> _Space:
        self._check_open()
        if index is None:
            return self._current
        try:
            return self._spaces[index]
        except KeyError:
            raise VMMError(f"no live virtual space with index {index}; live: "
                           f"{sorted(self._spaces)}") from None

    def _space_of(self, address: int) -> _Space | None:
        """The space holding ``address``: a bisection, since the framework's free path
        calls it once per block whatever the number of spaces."""
        i = bisect.bisect_right(self._bases, (address, sys.maxsize)) - 1
        if i < 0:
            return None
        space = self._spaces[self._bases[i][1]]
        return space if address < space.base + space.size else None

