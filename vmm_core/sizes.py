"""The one bound on byte counts that reach a system call or a vendor library.

Sizes reach ``mmap``, ``ftruncate`` or a driver as ``size_t`` or ``off_t`` through ctypes
or bindings, which wrap silently: ``2**64`` becomes 0, ``MAP_FIXED`` then maps over the
process's own memory, and a host copy of ``2**64`` bytes would be a 2 MiB mapping filled
as if it held 2**64 bytes (a segmentation fault).  So every byte count, whoever passes it on
(:class:`vmm_core.Backend` for every hook, the allocator, the host copies of offload,
mapped host tables), is checked here first.
"""

from __future__ import annotations

import numbers
import sys

from .errors import MappingError

__all__ = ["MAX_BYTES", "byte_count"]

#: The largest byte count (size, offset, alignment) vmm_core passes on.  Half of
#: ``sys.maxsize`` leaves room for a reservation to add its alignment, and for a host copy
#: its huge-page slack, without reaching what a ``size_t`` or ``off_t`` holds.
MAX_BYTES = sys.maxsize // 2


def byte_count(what: str, value, *, error: type = MappingError, positive: bool = False,
               remedy: str = "ask for less") -> int:
    """``value`` as a plain int from 0 (1 with ``positive``) to :data:`MAX_BYTES`, or
    ``error`` naming ``what``.  Any integer type is a size (numpy's too:
    ``np.prod(shape) * itemsize`` is one); a bool is not."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        kind = "a positive int" if positive else "an int"
        raise error(f"{what} must be {kind}, got {value!r}")
    value = int(value)
    if positive and value <= 0:
        raise error(f"{what} must be a positive int, got {value!r}")
    if not 0 <= value <= MAX_BYTES:
        raise error(f"{what}={value} is outside 0..{MAX_BYTES}, the byte counts this "
                    f"platform can pass to a system call; {remedy}")
    return value
