"""The host copy of one allocator's pages: which bytes an offloading sleep keeps, where it
keeps them, and the copy made ahead of that sleep.

An allocator owns one :class:`AllocatorHostCopy` (its ``_host``) and passes itself to
each call, as it does to its :class:`~vmm_core.memory.sleep_wake.SleepWake`.  Kept apart
from the allocator because its questions are not about virtual spaces or handles: how
large a copy is, whether a kept one still fits, whether a copy made in the background is
done, what to give back and when.  The allocator's lock guards it: every method here
runs under that lock (taken by the allocator's entry points, or here where they are the
entry points).  How the bytes move is :mod:`vmm_core.memory.offload`'s.
"""

from __future__ import annotations

from ..errors import SleepStateError
from . import live_ranges as _ranges
from .host_memory import HostCopy
from .offload import pipeline
from .offload.pinning import pin_later
from .offload.prepared import PendingCopy, prepare_later, prepared_copy
from .offload.settings import keeps_host_buffers
from .offload.staging import release
from .pages import PageOwner

__all__ = ["AllocatorHostCopy"]


class AllocatorHostCopy:
    """The host side of one allocator: its offloaded bytes or kept buffers (``copy``),
    the physical ranges they hold, and a copy being made in the background."""

    def __init__(self) -> None:
        #: the offloaded bytes, or host buffers kept by keep_host_buffers
        self.copy: HostCopy | None = None
        #: physical (offset, size) ranges whose bytes the copy holds, in order
        self.saved_ranges: list[tuple[int, int]] | None = None
        #: a host copy being made in the background (prepare_host_copy(background=True))
        self.pending: PendingCopy | None = None
        #: the copy holds the bytes of the released pages (an offloading sleep)
        self.offloaded = False
        #: the last offload save/restore, for reports
        self.last_transfer: pipeline.Transfer | None = None

    # ------------------------------------------------------------------ sleep
    def plan(self, alloc: PageOwner) -> tuple[list[tuple[int, int]], list[int]]:
        """What an offloading sleep copies now: physical ``(offset, size)`` ranges in
        order, and the host copy's layout (one buffer per handle when every byte is
        copied, one for all the live ranges otherwise)."""
        if alloc.live_ranges is None:
            ranges = alloc._page_ranges()
            return ranges, [size for _, size in ranges]
        live = _ranges.checked(alloc.live_ranges(), "SharedVMMAllocator.live_ranges")
        mapped = alloc._mapped_bytes()
        offsets = []
        for address, nbytes in live:
            start = alloc._offset_of(address)
            if start is None or nbytes == 0:
                continue  # not this allocator's memory: nothing of it to keep
            end = min(start + nbytes, mapped)
            if end > start:
                offsets.append((start, end - start))
        ranges = _ranges.merge(offsets)
        return ranges, ([sum(n for _, n in ranges)] if ranges else [])

    def save(self, alloc: PageOwner, ranges: list[tuple[int, int]],
             layout: list[int]) -> HostCopy | None:
        """Copy ``ranges`` of the current space to host memory (the sleep's copy);
        returns the host copy, or None when nothing is live."""
        be, dev = alloc.backend, alloc.device
        # a copy made in the background since the region ended: wait for its pages
        # (work any fresh copy needs too), never for its registration
        pending, self.pending = self.pending, None
        prepared = pending.take() if pending is not None else None
        kept = self.copy
        if kept is not None and not kept.fits(layout):
            # the tag changed size: free the kept copy before a new one is filled,
            # so that host memory never holds both
            self.copy = None
            self.saved_ranges = None
            release(kept)
        if prepared is not None:
            if self.copy is None and prepared.fits(layout):
                self.copy = prepared
            else:
                release(prepared)
                prepared = None
        if not ranges:  # nothing live: nothing to keep either
            host, self.copy = self.copy, None
            release(host)
            return None
        base = alloc.space_base()
        regions = [(base + offset, size) for offset, size in ranges]
        saved, self.last_transfer = pipeline.save(
            be, dev, regions, reuse=self.copy, pin=keeps_host_buffers(alloc.tag),
            layout=layout, wait_pinned=prepared is None or self.copy is not prepared)
        if saved is not self.copy:
            release(self.copy)  # a kept buffer that did not fit
        self.copy = saved
        return saved

    def slept(self, saved: HostCopy | None, ranges: list[tuple[int, int]] | None) -> None:
        """The pages are released: the copy ``saved`` (None: discarded) holds ``ranges``."""
        self.offloaded = saved is not None
        self.saved_ranges = ranges if saved is not None else None

    def drop(self) -> None:
        """Give back the kept host copy and one being made: a sleep that discards leaves
        their bytes meaningless, and host memory holds copies only of memory that is
        offloaded (a tag offloaded again makes its copy again)."""
        host, self.copy, self.saved_ranges = self.copy, None, None
        release(host)
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.abandon()

    # ------------------------------------------------------------------ wake
    def restore(self, alloc: PageOwner, base: int,
                everything: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Copy the offloaded bytes back into the new pages of the space at ``base``
        (``everything``: their ``(offset, size)``); returns the ranges no copy filled."""
        if not (self.offloaded and self.copy is not None):
            return everything
        saved = self.saved_ranges if self.saved_ranges is not None else everything
        self.last_transfer = pipeline.restore(
            alloc.backend, alloc.device, [(base + o, n) for o, n in saved], self.copy)
        return _ranges.subtract(everything, saved)

    def woke(self, alloc: PageOwner, keep_host_buffers: bool | None) -> None:
        """Awake again: keep the copy for the next sleep (registered once the wake's
        deferred pinning ends) or give it back, as ``keep_host_buffers`` or the tag's
        policy says."""
        self.offloaded = False
        if keep_host_buffers is None:
            keep_host_buffers = keeps_host_buffers(alloc.tag)
        if not keep_host_buffers:
            host, self.copy = self.copy, None
            self.saved_ranges = None
            release(host)
        elif self.copy is not None:  # kept against the tag's policy: the
            pin_later(alloc.backend, alloc.device, self.copy)  # sleep did not pin it

    # ------------------------------------------------------------------ awake
    @property
    def held_bytes(self) -> int:
        host, pending = self.copy, self.pending
        return (host.held_bytes if host is not None else 0) + \
            (pending.held_bytes if pending is not None else 0)

    @property
    def pinned_bytes(self) -> int:
        host, pending = self.copy, self.pending
        return (host.pinned_bytes if host is not None else 0) + \
            (pending.pinned_bytes if pending is not None else 0)

    def _layout_to_prepare(self, alloc: PageOwner) -> list[int]:
        """The layout of the host copy a prepare makes now (empty: nothing mapped or
        nothing live); refuses a closed or sleeping allocator (its copy is made already).
        Under the allocator's lock."""
        alloc._check_open()
        if alloc.asleep:
            how = f"vmm_core.wake_up({alloc.tag!r})" if alloc.tag else "wake()"
            raise SleepStateError(f"offload.prepare: the memory is asleep (its host copy "
                                  f"is made already); call {how} first")
        if not alloc._page_ranges():
            return []
        return self.plan(alloc)[1]

    def wanted(self, alloc: PageOwner) -> int:
        """Bytes of host memory :meth:`prepare` would make now (0: the kept copy is
        pinned and fits, or nothing is live), or what it would refuse with (closed,
        asleep).  Callers that prepare several allocators ask each one first, so a
        refusal prepares none."""
        with alloc._lock:
            layout = self._layout_to_prepare(alloc)
            host = self.copy
            if not layout:
                return 0
            if host is not None and host.fits(layout):
                host.wait_pinned()  # a registration in flight: the copy is pinned soon
                if host.pinned_bytes:
                    return 0
            return sum(layout)

    def address(self, alloc: PageOwner, address: int, nbytes: int) -> int | None:
        """Host address of the device bytes ``[address, address + nbytes)`` in the host
        copy (offloaded now, or kept from the last sleep, holding the bytes as they were
        then), or None when no copy holds them: memory discarded, a copy given back at
        wake, or bytes the sleep left out as free.  For ``torch_memory_saver``'s
        ``get_cpu_backup``."""
        with alloc._lock:
            host, ranges = self.copy, self.saved_ranges
            if host is None or ranges is None or not host.held_bytes:
                return None
            start = alloc._offset_of(address)
            if start is None:
                return None
            offset = 0
            for o, n in ranges:
                if o <= start and start + nbytes <= o + n:
                    return host.address(offset + start - o, nbytes)
                offset += n
            return None

    def prepare(self, alloc: PageOwner, background: bool) -> None:
        """Make the pinned host copy the next offloading sleep fills, now
        (``vmm_core.memory.offload.prepare``), sized to what that sleep would copy now
        (the live ranges when the allocator's ``live_ranges`` is set).

        With ``background`` only the ranges are asked for here; the copy's pages are
        faulted in and registered off the calling thread (``region(tag,
        prepare_offload=True)``).  A sleep that comes first waits for the pages, work any
        fresh copy needs too, but never for the registration: until that finishes it
        copies through the staging ring into them, which is faster than waiting (on an
        H100 registering 4 GiB took 0.32 s, a whole staged copy of 4 GiB 0.22 s)."""
        with alloc._lock:
            layout = self._layout_to_prepare(alloc)
            if not layout:
                return
            host, pending = self.copy, self.pending
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
            self.copy, self.saved_ranges, self.pending = None, None, None
            release(host)
            if pending is not None:
                pending.abandon()
            if background:
                self.pending = prepare_later(alloc.backend, alloc.device, sum(layout))
            else:
                self.copy = prepared_copy(alloc.backend, alloc.device, layout)
