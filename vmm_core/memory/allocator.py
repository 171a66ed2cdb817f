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

from .. import registry
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
from .handle_growth import growth_step, merge_start, round_up
from .host_copy import AllocatorHostCopy
from .mappings import Physical, Space
from .offload.pipeline import Transfer
from .sleep_wake import SleepWake, check_wake_options, weak_callable

# growth_step and check_wake_options live with the pieces that use them, and resolve here
# too for code that imports them from the allocator
__all__ = ["SharedVMMAllocator", "growth_step", "check_wake_options"]


def check_size(what: str, value, remedy: str) -> int:
    """``value`` as a positive byte count any backend call can take (the bound of
    :func:`vmm_core.sizes.byte_count`), or AllocationError."""
    return byte_count(what, value, error=AllocationError, positive=True, remedy=remedy)


def check_device(device) -> int:
    """A device index: a non-negative int (``"0"`` or ``0.7`` would silently pick 0)."""
    if not isinstance(device, numbers.Integral) or isinstance(device, bool) or device < 0:
        raise AllocationError(f"device must be a device index (an int >= 0), got {device!r}")
    return int(device)


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
        self.backend = backend = registry.resolve(backend)
        self.device = check_device(device)
        self.tag = tag
        self.scratch = scratch
        self.caps = backend.capabilities(self.device)
        g = self.caps.granularity
        self.granularity = g
        if reserve_bytes is None:
            reserve_bytes = self.caps.default_reserve_bytes
        reserve_bytes = check_size("reserve_bytes", reserve_bytes, "reserve less")
        self.reserve_bytes = check_size("reserve_bytes", round_up(reserve_bytes, g),
                                        "reserve less")
        if growth_bytes is not None:
            growth_bytes = check_size("growth_bytes", growth_bytes, "grow by less")
        self.growth_bytes = None if growth_bytes is None else round_up(growth_bytes, g)
        reaper.start()  # dropped allocators are closed there, not inside the collector
        self._lock = threading.RLock()
        # before a fork can see it: the fork hooks reach the holds through _sleep
        self._host = AllocatorHostCopy()
        self._sleep = SleepWake(self._host)
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
        self._broken: BaseException | None = None  # a rollback that failed: refuse all work
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
            size = round_up(nbytes, self.granularity)
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
            self._floor = max(self._floor, round_up(nbytes, self.granularity))

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
            size = min(max(self.growth_bytes, round_up(needed - held, self.granularity)), limit)
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
        """Merge the newest handles, keeping the cost of merging amortized per space, or
        trim the last growth step (:func:`~vmm_core.memory.handle_growth.merge_start`):
        physical memory is then what the spaces use.  Returns True when it changed."""
        with self._lock:
            self._check_awake("merge_tail")
            first = merge_start([p.spaces for p in self._physical],
                                tail_unused=self._kept_end() < self._mapped_bytes())
            return first is not None and self._merge_from(first)

    def _kept_end(self) -> int:
        """Where the bytes the spaces use (or :meth:`extend_mapping` promised) end."""
        if self._used is None:
            self._used = max([s.cursor for s in self._spaces.values()], default=0)
        used = max(self._used, self._floor)
        return min(round_up(used, self.granularity), self._mapped_bytes())

    def _merge_from(self, first: int) -> bool:
        """Replace handles ``first:`` by one (trimmed to what the spaces use), remapping
        only the spaces they are mapped into; all or nothing."""
        old = self._physical[first:]
        if not old:
            return False
        start = old[0].offset
        end = self._kept_end()
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
        mappings.swap(be, dev, self.caps, targets, old, new, self._mark_broken)
        for p in old:
            self._release_quietly(p.handle)
        self._physical = self._physical[:first] + ([new] if new is not None else [])
        self.compact_seconds.append(time.perf_counter() - t0)
        return True

    def _mark_broken(self, error: VMMError) -> None:
        """A rollback failed: some space has nothing usable mapped, so the allocator
        refuses all further work instead of handing out addresses with nothing behind."""
        self._broken = error

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
        except BaseException as exc:  # whatever it was: some spaces unmapped, some not,
            self._broken = exc  # neither awake nor asleep
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
        # lazy: only the current space now; the others when first used
        targets = [self._current] if self.lazy_wake else list(self._spaces.values())
        created = mappings.make_mapped(self.backend, self.device, self.caps,
                                       self._sleep_sizes, targets)
        return targets, created

    def _keep_pages(self, targets: list[Space], created: list[Physical]) -> None:
        """Awake on the handles :meth:`_remake_pages` made."""
        self._physical = created
        self._dormant = {s.index for s in self._spaces.values() if s not in targets}
        self._asleep = False

    def _unmake_pages(self, targets: list[Space], created: list[Physical]) -> None:
        """Undo :meth:`_remake_pages` (a wake whose copy failed): asleep again."""
        mappings.unmap_and_release(self.backend, self.device, targets, created,
                                   self._mark_broken)

    # ------------------------------------------------------------------ sleep / wake
    # the rules are SleepWake's (self._sleep) and AllocatorHostCopy's (self._host): their
    # methods say the whole of what these promise
    def sleep(self, offload: bool = False) -> None:
        """Release every physical page; virtual addresses stay reserved.  With
        ``offload=True`` the bytes (or only the :attr:`live_ranges`) come back on
        :meth:`wake`; a copy that fails leaves the allocator awake and untouched
        (:meth:`.SleepWake.sleep`)."""
        self._sleep.sleep(self, offload)

    def wake(self, keep_host_buffers: bool | None = None, zero: bool = False,
             eager: bool = False) -> None:
        """Re-create the physical pages at the same addresses and restore offloaded bytes
        (``zero``: zero the rest; ``keep_host_buffers``: keep the host copy for the next
        sleep, None: the tag's policy; ``eager``: told to the sleep listeners).  A failure
        leaves it asleep with its host copy intact (:meth:`.SleepWake.wake`)."""
        self._sleep.wake(self, keep_host_buffers, zero, eager)

    def add_sleep_listener(self, fn) -> None:
        """Call ``fn(event, **kw)`` after every sleep and wake; held weakly, called
        outside the lock, its errors logged, with Ctrl-C held until it returns (it must
        not block: :mod:`vmm_core.interrupts`; :meth:`.SleepWake.add_listener`)."""
        self._sleep.add_listener(self, fn)

    def remove_sleep_listener(self, fn) -> None:
        self._sleep.remove_listener(self, fn)

    def hold_awake(self, what: str = "this memory", holder: str = "a hold_awake block"):
        """A block in which no sleep slips in (this thread's raise SleepStateError
        naming ``holder``), refused unless awake (:meth:`.SleepWake.hold_awake`)."""
        return self._sleep.hold_awake(self, what, holder)

    def check_can_sleep(self) -> None:
        """Raise what :meth:`sleep` would refuse with now, without sleeping
        (:meth:`.SleepWake.check_can_sleep`)."""
        self._sleep.check_can_sleep(self)

    def held_by(self) -> str | None:
        """What holds this allocator awake (:meth:`hold_awake`), or None."""
        return self._sleep.held_by()

    def held_here(self) -> str | None:
        """What holds this allocator awake on the calling thread, or None."""
        return self._sleep.held_here(self)

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
        """Bytes of host memory :meth:`prepare_host_copy` would make now
        (:meth:`.AllocatorHostCopy.wanted`)."""
        return self._host.wanted(self)

    def host_copy_address(self, address: int, nbytes: int) -> int | None:
        """Host address of the device bytes ``[address, address + nbytes)`` in the host
        copy, or None when no copy holds them (:meth:`.AllocatorHostCopy.address`)."""
        return self._host.address(self, address, nbytes)

    def prepare_host_copy(self, background: bool = False) -> None:
        """Make the pinned host copy the next offloading sleep fills, now or (with
        ``background``) off the calling thread (:meth:`.AllocatorHostCopy.prepare`)."""
        self._host.prepare(self, background)

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
        """Unmap and release everything.  Idempotent.  A step that raises does not stop
        the others: what can be given back is, then the first error is raised.

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
            errors: list[BaseException] = []
            step = mappings.teardown_step  # every step runs; the first error is raised last
            step(errors, be.synchronize, dev)
            # a space still mapped keeps its pages, so must it keep its addresses
            unmapped = [(space.base, space.size) for space in list(self._spaces.values())
                        if step(errors, self._unmap_from, space, list(space.mapped))]
            # a region's framework pool goes with its allocator (no later allocator
            # reuses it); the range waits for the segments the framework still holds
            step(errors, tag_state.closing, self, tolerated=())
            ranges_held = address_quarantine.give_back(be, dev, unmapped)  # never raises
            for p in self._physical:
                self._release_quietly(p.handle)
            self._spaces.clear()
            self._bases.clear()
            self._physical = []
            self._current = None  # type: ignore[assignment]  # closed: see _check_open
            step(errors, self._host.drop, tolerated=())  # one being made: freed once made
        if ranges_held:  # a pool let go of keeps its cached segments until the cache empties
            address_quarantine.flush_and_retry(be, dev)
        if errors:
            raise errors[0]

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
                           f"({type(self._broken).__name__}: {self._broken}); its spaces may "
                           f"have nothing mapped. close() "
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

