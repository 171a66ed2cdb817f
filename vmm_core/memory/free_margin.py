"""A free-memory margin that allocations of tagged memory must leave on the device.

torch_memory_saver's ``memory_margin_bytes``: an allocation in a region (a segment the
framework's pool asks for) is refused as out of memory when fewer than the margin's
bytes of the device would stay free after it, so that what runs beside the process (an
inference engine waking up on the same GPU) keeps room.  The reading is the backend's
``vmm_mem_get_info`` (free memory as the driver counts it for every process); a backend
without it cannot set a margin.  0 (the default) checks nothing and costs nothing.
"""

from __future__ import annotations

import numbers

from ..errors import BackendError, OutOfMemoryError

__all__ = ["set_margin", "margin", "check"]

_margin = 0


def set_margin(nbytes: int, backend=None) -> None:
    """Leave at least ``nbytes`` of device memory free after every tagged allocation of
    this process; 0 turns the check off.  ``backend`` (a Backend) is the one that must
    read free memory: refused, changing nothing, when it cannot."""
    global _margin
    if not isinstance(nbytes, numbers.Integral) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"the free-memory margin must be an int >= 0 (bytes), got {nbytes!r}")
    if nbytes and backend is not None and not backend.implements("vmm_mem_get_info"):
        raise BackendError(f"backend {backend.name!r} cannot read its devices' free memory "
                           f"(no vmm_mem_get_info hook), so no free-memory margin can be "
                           f"kept on it; leave the headroom in the engine (its memory "
                           f"fraction) instead, or set 0")
    _margin = int(nbytes)


def margin() -> int:
    return _margin


def check(backend, device: int, nbytes: int, what: str) -> None:
    """Raise OutOfMemoryError if allocating ``nbytes`` on ``device`` would leave less
    than the margin free."""
    if not _margin:
        return
    reading = backend.mem_get_info(device)
    if reading is None:
        return  # refused when the margin was set on a backend that cannot read it
    free = reading[0]
    if nbytes + _margin > free:
        raise OutOfMemoryError(
            f"{what} on {backend.name}:{device} refused: {free} bytes are free and the "
            f"free-memory margin is {_margin} bytes (torch_memory_saver's "
            f"memory_margin_bytes); free memory, or lower the margin")
