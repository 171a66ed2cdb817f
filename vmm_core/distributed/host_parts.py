"""Host memory that mapped and distributed tensors place with ``location="host"``.

The rules both kinds share: every rank of a node decides from the same agreed numbers
whether the node can hold the parts (so they refuse together), and an mmap's address is
read without keeping a buffer export that would block its close.
"""

from __future__ import annotations

import mmap

from ..errors import OutOfMemoryError
from ..memory.host_memory import host_refusal

__all__ = ["refuse_host_overflow", "address_of"]


def refuse_host_overflow(sizes: list[int], rooms: list) -> None:
    """Raise OutOfMemoryError, the same on every rank, if host allocations of ``sizes``
    on one node exceed the room its ranks reported (:func:`host_room`, None where the
    kernel does not say): decided from agreed values, so every rank refuses alike and
    the group stays in step."""
    known = [room for room in rooms if room is not None]
    if not known:
        return
    room, available, margin = min(known)
    if sum(sizes) > room:
        raise OutOfMemoryError(host_refusal(
            "mapped memory with location='host'", sum(sizes), room, available, margin,
            "ask for fewer rows, or use kind='distributed' over more nodes"))


def address_of(mm: mmap.mmap) -> int:
    """The address of an mmap, without keeping a buffer export that blocks its close()."""
    import ctypes

    probe = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(probe)
    del probe
    return address
