"""What the sleep pieces of an allocator ask of it: the seam between
:class:`~vmm_core.memory.allocator.SharedVMMAllocator` (spaces and handles) and the
pieces it owns (:mod:`~vmm_core.memory.sleep_wake`, :mod:`~vmm_core.memory.host_copy`).

A Protocol rather than the allocator's class, so that the pieces never import the
allocator that imports them, and so that this list, short on purpose, is the whole of
what they may touch: the lock, the owner's settings, and a few calls that release and
re-create the pages all or nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from ..backend import Backend
from .mappings import Physical, Space

__all__ = ["PageOwner"]


class PageOwner(Protocol):
    """An allocator as its sleep pieces see it (every call under ``_lock``)."""

    _lock: threading.RLock
    backend: Backend
    device: int
    tag: str | None
    #: the ``(address, nbytes)`` ranges an offloading sleep keeps (None: every byte)
    live_ranges: Callable[[], list[tuple[int, int]]] | None
    #: a sleep that discards still keeps the live ranges
    preserve_live: bool

    @property
    def asleep(self) -> bool: ...

    def _check_open(self) -> None:
        """Raise unless usable (closed, or inconsistent after a failed rollback)."""

    def space_base(self, index: int | None = None) -> int: ...

    def _page_ranges(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every physical handle, in order."""

    def _mapped_bytes(self) -> int: ...

    def _offset_of(self, address: int) -> int | None:
        """The physical offset behind ``address``, or None when it is not this memory."""

    def _release_pages(self) -> None:
        """Unmap every space and release every handle: asleep."""

    def _remake_pages(self) -> tuple[list[Space], list[Physical]]:
        """Handles of the released sizes, mapped again; all or nothing."""

    def _keep_pages(self, targets: list[Space], created: list[Physical]) -> None:
        """Awake on what :meth:`_remake_pages` made."""

    def _unmake_pages(self, targets: list[Space], created: list[Physical]) -> None:
        """Undo :meth:`_remake_pages`: asleep again."""
