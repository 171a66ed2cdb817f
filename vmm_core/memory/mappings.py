"""Physical handles mapped into virtual spaces: the records, and the backend calls that
change what is mapped where, each all or nothing.

Kept out of the allocator so that its code reads as policy (where to allocate, when to
grow, what to merge) over a few calls that never leave a half-done map behind: a map
that fails unmaps what it mapped, an unmap that fails leaves the handle listed as
mapped (it still is), so a rollback maps back only what really went.  Stateless: the
backend, device and capabilities are the caller's, read at each call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import VMMError

__all__ = ["Physical", "Space", "map_into", "unmap_from", "map_into_spaces", "swap",
           "make_mapped", "unmap_and_release", "release_quietly", "copy_into_handle"]


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


def swap(backend, device: int, caps, spaces: list[Space], old: list[Physical],
         new: Physical | None, on_broken: Callable[[VMMError], None]) -> None:
    """In every one of ``spaces``, unmap the handles of ``old`` it maps and map ``new``
    (None: nothing) in their place; all or nothing, and ``new`` is released on failure.
    Where even the rollback fails a space is left with nothing usable mapped:
    ``on_broken(error)`` is told so, and the first error propagates."""
    def map_back(space: Space, previous: list[Physical]) -> None:
        try:
            map_into(backend, device, caps, space, previous)
        except VMMError as exc:
            on_broken(exc)

    swapped: list[tuple[Space, list]] = []
    try:
        for space in spaces:
            previous = [p for p in space.mapped if p in old]
            try:
                unmap_from(backend, device, space, previous)
            except BaseException:  # half unmapped: map back what went
                map_back(space, [p for p in previous if p not in space.mapped])
                raise
            try:
                if new is not None:
                    map_into(backend, device, caps, space, [new])
            except BaseException:
                map_back(space, previous)
                raise
            swapped.append((space, previous))
    except BaseException:
        for space, previous in swapped:
            if new is not None:
                try:
                    unmap_from(backend, device, space, [new])
                except VMMError as exc:
                    on_broken(exc)
            map_back(space, previous)
        if new is not None:
            release_quietly(backend, device, new.handle)
        raise


def make_mapped(backend, device: int, caps, sizes: list[int],
                spaces: list[Space]) -> list[Physical]:
    """New handles of ``sizes``, laid end to end from offset 0 and mapped into every one
    of ``spaces``; all or nothing."""
    created: list[Physical] = []
    offset = 0
    try:
        for size in sizes:
            created.append(Physical(backend.create_handle(device, size), offset, size))
            offset += size
        map_into_spaces(backend, device, caps, spaces, created)
    except BaseException:
        for p in created:
            release_quietly(backend, device, p.handle)
        raise
    return created


def unmap_and_release(backend, device: int, spaces: list[Space], physicals: list[Physical],
                      on_broken: Callable[[VMMError], None]) -> None:
    """Undo :func:`make_mapped`.  An unmap that fails leaves the handles where they are
    (some space may still map them), and ``on_broken(error)`` is told."""
    try:
        for space in spaces:
            unmap_from(backend, device, space, physicals)
    except VMMError as exc:
        on_broken(exc)
        return
    for p in physicals:
        release_quietly(backend, device, p.handle)


def release_quietly(backend, device: int, handle) -> None:
    """Give a handle back where a failure could not be acted on (a rollback, a close)."""
    try:
        backend.release_handle(device, handle)
    except VMMError:
        pass


def teardown_step(errors: list, fn, *args, tolerated: tuple = (VMMError,)) -> bool:
    """One step of a teardown that goes on whatever a step raises (a close half done
    cannot be done again): True where it was done; a ``tolerated`` error means it was
    not (a driver call that failed: what it holds stays), anything else is kept in
    ``errors`` for the caller to raise once the rest is torn down."""
    try:
        fn(*args)
        return True
    except tolerated:
        return False
    except BaseException as exc:  # noqa: BLE001 - raised by the caller at the end
        errors.append(exc)
        return False


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
