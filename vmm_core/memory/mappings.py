"""Physical handles mapped into virtual spaces: the records, and the backend calls that
change what is mapped where, each all or nothing.

Kept out of the allocator so that its code reads as policy (where to allocate, when to
grow, what to merge) over a few calls that never leave a half-done map behind: a map
that fails unmaps what it mapped, an unmap that fails leaves the handle listed as
mapped (it still is), so a rollback maps back only what really went.  Stateless: the
backend, device and capabilities are the caller's, read at each call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import VMMError

__all__ = ["Physical", "Space", "map_into", "unmap_from", "map_into_spaces",
           "release_quietly", "copy_into_handle"]


@dataclass(eq=False)
class Physical:
    """One physical handle, at ``offset`` in every space it is mapped into."""

    handle: object
    offset: int
    size: int
    #: indices of the spaces it is mapped into: a merge remaps only those
    spaces: set = field(default_factory=set)


@dataclass(eq=False)
class Space:
    """One reserved virtual range, its bump pointer and the allocations it handed out."""

    index: int
    base: int
    size: int
    mapped: list = field(default_factory=list)  # Physical objects mapped here
    cursor: int = 0
    live: dict = field(default_factory=dict)  # address -> size


def map_into(backend, device: int, caps, space: Space, physicals: list[Physical]) -> None:
    """Map ``physicals`` into ``space`` and grant access; all or nothing."""
    done: list[Physical] = []
    try:
        for p in physicals:
            backend.map(device, space.base + p.offset, p.size, p.handle, 0)
            done.append(p)
            space.mapped.append(p)
            p.spaces.add(space.index)
        if caps.needs_set_access and physicals:
            if caps.set_access_spans_mappings:
                start = min(p.offset for p in physicals)
                end = max(p.offset + p.size for p in physicals)
                backend.set_access(device, space.base + start, end - start)
            else:
                for p in physicals:
                    backend.set_access(device, space.base + p.offset, p.size)
    except BaseException:
        unmap_from(backend, device, space, done)
        raise


def unmap_from(backend, device: int, space: Space, physicals: list[Physical]) -> None:
    """Unmap ``physicals`` from ``space``; one whose unmap failed stays listed as
    mapped (it still is), so a rollback maps back only what really went."""
    errors = []
    for p in physicals:
        try:
            backend.unmap(device, space.base + p.offset, p.size)
        except VMMError as exc:
            errors.append(exc)
            continue
        if p in space.mapped:
            space.mapped.remove(p)
        p.spaces.discard(space.index)
    if errors:
        raise errors[0]


def map_into_spaces(backend, device: int, caps, spaces: list[Space],
                    physicals: list[Physical]) -> None:
    """Map ``physicals`` into every one of ``spaces``, or into none of them."""
    done: list[Space] = []
    try:
        for space in spaces:
            map_into(backend, device, caps, space, physicals)
            done.append(space)
    except BaseException:
        for space in done:
            unmap_from(backend, device, space, physicals)
        raise


def release_quietly(backend, device: int, handle) -> None:
    """Give a handle back where a failure could not be acted on (a rollback, a close)."""
    try:
        backend.release_handle(device, handle)
    except VMMError:
        pass


def copy_into_handle(backend, device: int, caps, granularity: int, source_base: int,
                     new: Physical) -> None:
    """Copy the bytes at ``new``'s offset in the space at ``source_base`` into ``new``,
    through a scratch range that maps it alone."""
    tmp = backend.reserve(device, new.size, granularity)
    scratch = Space(-1, tmp - new.offset, new.size)  # maps new at its own offset
    try:
        map_into(backend, device, caps, scratch, [new])
        try:
            backend.copy_device(device, source_base + new.offset, tmp, new.size)
            backend.synchronize(device)
        finally:
            unmap_from(backend, device, scratch, [new])
    finally:
        backend.release_range(device, tmp, new.size)
