"""Fresh pageable host memory, as an offload's first round copies into: the host limits
the sleep benchmark reports beside each row are measured on it.

The benchmark maps its own memory (Python's ``mmap``, huge pages advised) rather than
borrowing the library's host copies, so a change inside vmm_core's offload cannot
change the limit it is compared with.
"""

from __future__ import annotations

import ctypes
import mmap

__all__ = ["HostMapping", "stripes"]

_HUGE = 2 << 20  # one x86-64 / aarch64 transparent huge page


def stripes(size: int, parts: int) -> list[tuple[int, int]]:
    """``[0, size)`` as at most ``parts`` (offset, length) pieces on huge-page bounds, so
    that each thread faults whole huge pages of its own."""
    step = -(-max(size // max(parts, 1), 1) // _HUGE) * _HUGE
    return [(o, min(step, size - o)) for o in range(0, size, step)]


class HostMapping:
    """One anonymous private mapping of ``size`` bytes; ``base`` is its address."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._map: mmap.mmap | None = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # a hint: ignored where THP is off
            self._map.madvise(mmap.MADV_HUGEPAGE)
        view = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(view)
        del view  # an exported buffer would keep close() from unmapping

    def release(self, pool=None, threads: int = 1) -> None:
        """Unmap; with a thread ``pool``, the pages are freed by ``threads`` threads at
        once first (freeing is per-page work), as a parallel release would."""
        if self._map is None:
            return
        if pool is not None and threads > 1:
            for f in [pool.submit(self._map.madvise, mmap.MADV_DONTNEED, o, n)
                      for o, n in stripes(self.size, threads)]:
                f.result()
        self._map.close()
        self._map = None
