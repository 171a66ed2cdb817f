"""SharedVMMAllocator: many virtual spaces, one set of physical pages.

Every virtual space is a reserved range; physical handles are laid end to end from
offset 0 and each one is mapped at the *same offset* in every space.  A bump pointer per
space hands out addresses, so the first byte allocated in a new space lands on the same
physical page as the first byte of every older space: graphs captured in different spaces
share memory (``max(shape)``) while the framework's allocator sees unique addresses.

Physical memory grows in a few large handles (see :func:`growth_step`) because switching
spaces costs one map per handle.  Every failure leaves the allocator as it was: a handle
that cannot be mapped everywhere is unmapped and released before the error propagates.

Sleep and wake are pieces of their own that the allocator owns and calls into
(:mod:`~vmm_core.memory.sleep_wake`: when the pages may go, how they come back, who is
told; :mod:`~vmm_core.memory.host_copy`: the host copy an offload keeps).  This module
keeps the virtual spaces, the physical handles, growth and merging, and releases and
re-creates the pages when the sleep piece asks.
"""

from __future__ import annotations

import bisect
import numbers
import sys
import threading
import time
from collections.abc import Callable

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
from . import address_quarantine, fork_locks, mappings, reaper, tag_state
from .host_copy import AllocatorHostCopy
from .mappings import Physical, Space
from .offload.pipeline import Transfer
from .sleep_wake import SleepWake, check_wake_options, weak_callable

__all__ = ["SharedVMMAllocator", "growth_step", "check_wake_options"]

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


def check_device(device) -> int:
    """A device index: a non-negative int (``"0"`` or ``0.7`` would silently pick 0)."""
    if not isinstance(device, numbers.Integral) or isinstance(device, bool) or device < 0:
        raise AllocationError(f"device must be a device index (an int >= 0), got {device!r}")
    return int(device)


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
        # before a fork can see it: the fork hooks reach the holds through _sleep
        self._host = AllocatorHostCopy(self)
        self._sleep = SleepWake(self, self._host)
        fork_locks.track(self)  # a fork in progress sees it (and waits for its lock) or not
        self._physical: list[Physical] = []
        self._spaces: dict[int, Space] = {}
        self._bases: list[tuple[int, int]] = []  # sorted (base, index): deallocate's lookup
        self._next_index = 0
        # the space allocate() uses; None only once closed, and every entry point checks
        self._current: Space = None  # type: ignore[assignment]  # set by _new_space()
        self._closed = False
        self._asleep = False  # the pages are released (sleep_wake asked)
        self._sleep_sizes: list[int] = []  # ... and these are the handles to re-create
        #: the ``(address, nbytes)`` ranges whose bytes an offloading sleep keeps (a
        #: callable set by the allocator's owner, :mod:`vmm_core.memory.live_ranges`),
        #: or None: every mapped byte
        self.live_ranges: Callable[[], list[tuple[int, int]]] | None = None
        #: when True a sleep that discards still keeps the live ranges (graph pools:
        #: blocks alive after a capture, which replays read, never come back as garbage)
        self.preserve_live = False
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
        #: weak references to what adds to memory_stats (graph pools: their executables)
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
        phys = Physical(handle, held, size)
        targets = list(self._spaces.values()) if everywhere else [self._current]
        try:
            self._map_into_spaces(targets, [phys])
        except BaseException:
            self._release_quietly(handle)
            raise
        self._physical.append(phys)

    def _map_into_spaces(self, spaces: list[Space], physicals: list[Physical]) -> None:
        mappings.map_into_spaces(self.backend, self.device, self.caps, spaces, physicals)

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

    def _new_space(self) -> Space:
        self._check_open()
        address_quarantine.retry(self.backend, self.device)
        base = self.backend.reserve(self.device, self.reserve_bytes, self.granularity)
        space = Space(self._next_index, base, self.reserve_bytes)
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
                new = Physical(be.create_handle(dev, size), start, size)
            except OutOfMemoryError:
                return False
        be.synchronize(dev)  # kernels may still be writing the bytes we copy or unmap
        if new is not None and not self.scratch:
            try:
                mappings.copy_into_handle(be, dev, self.caps, self.granularity,
                                          self._current.base, new)
            except BaseException:
                self._release_quietly(new.handle)
                raise
        indices = set().union(*(p.spaces for p in old))
        targets = [self._spaces[i] for i in sorted(indices) if i in self._spaces]
        swapped: list[tuple[Space, list]] = []
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

    def _restore(self, space: Space, previous: list) -> None:
        """Map ``previous`` back into ``space`` after a failed swap.  If even that fails
        the space is unusable: the allocator refuses all further work instead of handing
        out addresses with nothing behind them."""
        try:
            self._map_into(space, previous)
        except VMMError as exc:
            self._broken = exc

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

    def _map_into(self, space: Space, physicals: list[Physical]) -> None:
        mappings.map_into(self.backend, self.device, self.caps, space, physicals)

    def _unmap_from(self, space: Space, physicals: list[Physical]) -> None:
        mappings.unmap_from(self.backend, self.device, space, physicals)

    def _release_quietly(self, handle) -> None:
        mappings.release_quietly(self.backend, self.device, handle)

    # ------------------------------------------------------------------ pages
    # what the sleep piece (sleep_wake.SleepWake) asks of the handles, under the lock
    def _page_ranges(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every physical handle, in order (none while asleep)."""
        return [(p.offset, p.size) for p in self._physical]

    def _offset_of(self, address: int) -> int | None:
        """The physical offset behind ``address`` (the same in every space), or None
        when no space of this allocator holds it."""
        space = self._space_of(address)
        return None if space is None else address - space.base

    def _release_pages(self) -> None:
        """Unmap every space and release every handle, remembering their sizes."""
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
        self._asleep = True

    def _remake_pages(self) -> tuple[list[Space], list[Physical]]:
        """Handles of the released sizes at their old offsets, mapped into every space
        (with ``lazy_wake`` only the current one); all or nothing.  Returns the spaces
        and the handles, for :meth:`_keep_pages` or :meth:`_unmake_pages`."""
        be, dev = self.backend, self.device
        created: list[Physical] = []
        offset = 0
        try:
            for size in self._sleep_sizes:
                created.append(Physical(be.create_handle(dev, size), offset, size))
                offset += size
            # lazy: only the current space now; the others when first used
            targets = [self._current] if self.lazy_wake else list(self._spaces.values())
            self._map_into_spaces(targets, created)
        except BaseException:
            for p in created:
                self._release_quietly(p.handle)
            raise
        return targets, created

    def _keep_pages(self, targets: list[Space], created: list[Physical]) -> None:
        """Awake on the handles :meth:`_remake_pages` made."""
        self._physical = created
        self._dormant = {s.index for s in self._spaces.values() if s not in targets}
        self._asleep = False

    def _unmake_pages(self, targets: list[Space], created: list[Physical]) -> None:
        """Undo :meth:`_remake_pages` (a wake whose copy failed): asleep again."""
        try:
            for space in targets:
                self._unmap_from(space, created)
        except VMMError as exc:
            self._broken = exc
            return
        for p in created:
            self._release_quietly(p.handle)

    # ------------------------------------------------------------------ sleep / wake
    # kept by self._sleep (sleep_wake.SleepWake) and self._host (host_copy.AllocatorHostCopy)
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
        self._sleep.sleep(offload)

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
        self._sleep.wake(keep_host_buffers, zero, eager)

    def add_sleep_listener(self, fn) -> None:
        """Call ``fn(event, **kw)`` after every sleep (``event="sleep"``, once the pages
        are released) and wake (``event="wake", eager=<bool>``, once it is complete).

        Held weakly (a bound method of a dropped object disappears; a lambda nobody else
        holds disappears at once), called outside this allocator's lock, and an exception
        it raises is logged and swallowed: the sleep or wake already happened."""
        self._sleep.add_listener(fn)

    def remove_sleep_listener(self, fn) -> None:
        self._sleep.remove_listener(fn)

    def hold_awake(self, what: str = "this memory", holder: str = "a hold_awake block"):
        """Hold the lock and refuse to run unless awake: no sleep slips in until the block
        ends (other threads' sleeps wait; this thread's raise SleepStateError naming
        ``holder``).

        Takes the process-wide lock of tagged memory first, as every sleep, wake and
        graph capture or replay does: one lock order for every entry point, so a replay
        (or ``before_replay``) inside the block cannot deadlock against another thread's
        replay, which holds that lock while it waits for this allocator."""
        return self._sleep.hold_awake(what, holder)

    def check_can_sleep(self) -> None:
        """Raise what :meth:`sleep` would refuse with now, without sleeping: memory closed
        or inconsistent after a failed rollback (VMMError), or held awake on this thread
        (SleepStateError).  Callers that sleep several allocators, or ranks that must all
        sleep or none, ask each one first, so none sleeps when one would refuse."""
        self._sleep.check_can_sleep()

    def held_by(self) -> str | None:
        """What holds this allocator awake (:meth:`hold_awake`), or None.  Only the thread
        holding the lock of tagged memory can see a hold: every hold takes that lock."""
        return self._sleep.held_by()

    def held_here(self) -> str | None:
        """What holds this allocator awake on the calling thread, or None.  A hold owns
        the allocator's lock for its whole block, so another thread's is never seen: a
        close from there waits for the block instead of being refused."""
        return self._sleep.held_here()

    @property
    def last_transfer(self) -> Transfer | None:
        """The last offload save or restore (how, how many bytes, how long), for reports."""
        return self._host.last_transfer

    @last_transfer.setter
    def last_transfer(self, transfer: Transfer | None) -> None:
        self._host.last_transfer = transfer

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held for this allocator (offloaded or kept buffers, and
        a copy being made in the background once its pages are there)."""
        return self._host.held_bytes

    @property
    def pinned_host_bytes(self) -> int:
        """Of :attr:`host_bytes`, those pinned (registered with the backend)."""
        return self._host.pinned_bytes

    def host_copy_wanted(self) -> int:
        """Bytes of host memory :meth:`prepare_host_copy` would make now (0: its kept copy
        is pinned and fits, or nothing is live), or what it would refuse with (closed,
        asleep).  Callers that prepare several allocators ask each one first, so a refusal
        prepares none."""
        return self._host.wanted()

    def host_copy_address(self, address: int, nbytes: int) -> int | None:
        """Host address of the device bytes ``[address, address + nbytes)`` in this
        allocator's host copy (offloaded now, or kept from the last sleep, holding the
        bytes as they were then), or None when no copy holds them: memory discarded,
        a copy given back at wake, or bytes the sleep left out as free.  For
        ``torch_memory_saver``'s ``get_cpu_backup``."""
        return self._host.address(address, nbytes)

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
        self._host.prepare(background)

    # ------------------------------------------------------------------ stats
    def add_stats_provider(self, fn) -> None:
        """Add what ``fn()`` returns (a dict of numbers) to :meth:`memory_stats`, summed
        over providers (held weakly, as listeners are): what lives beside these pages and
        goes with them, such as a graph pool's executables."""
        with self._lock:
            self._stats_providers.append(weak_callable(fn))

    def memory_stats(self) -> dict:
        """Device and host bytes, spaces, handles and sleep state (``memory_summary``),
        plus the numbers of the stats providers (:meth:`add_stats_provider`)."""
        with self._lock:
            stats = {"backend": self.backend.name, "device": self.device,
                     "device_bytes": self.physical_bytes, "host_bytes": self.host_bytes,
                     "pinned_host_bytes": self.pinned_host_bytes,
                     "spaces": len(self._spaces), "handles": self.num_handles,
                     "asleep": self._asleep,
                     "offloaded": self._asleep and self._host.offloaded}
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
            self._host.drop()  # one being made is freed once made

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

    def _space(self, index: int | None) -> Space:
        self._check_open()
        if index is None:
            return self._current
        try:
            return self._spaces[index]
        except KeyError:
            raise VMMError(f"no live virtual space with index {index}; live: "
                           f"{sorted(self._spaces)}") from None

    def _space_of(self, address: int) -> Space | None:
        """The space holding ``address``: a bisection, since the framework's free path
        calls it once per block whatever the number of spaces."""
        i = bisect.bisect_right(self._bases, (address, sys.maxsize)) - 1
        if i < 0:
            return None
        space = self._spaces[self._bases[i][1]]
        return space if address < space.base + space.size else None

