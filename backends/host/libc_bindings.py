"""Every ctypes declaration of the C library the host backend uses, in one place.

The host backend's "driver" is the kernel's memory calls: ``mmap`` reserves (``PROT_NONE``)
and maps (``MAP_FIXED | MAP_SHARED`` of a memfd), ``mprotect`` grants access and
``munmap`` gives a range back.  Declared here, as ``<sys/mman.h>`` declares them, so that
ctypes passes ``size_t`` and ``off_t`` arguments whole and reads ``void *`` results
unclipped; the flag values are Linux's (``<bits/mman-linux.h>``), the only platform the
backend probes as usable.  Nothing is loaded at import time.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["PROT_NONE", "PROT_RW", "MAP_SHARED", "MAP_PRIVATE", "MAP_FIXED", "MAP_ANONYMOUS",
           "MAP_NORESERVE", "MAP_FAILED", "libc"]

PROT_NONE = 0x0
PROT_RW = 0x1 | 0x2  # PROT_READ | PROT_WRITE
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value

_lock = threading.Lock()
_lib = None


def libc():
    """The C library with ``mmap``, ``munmap`` and ``mprotect`` declared (errno kept)."""
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(None, use_errno=True)
            # void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t off)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_long]
            # int munmap(void *addr, size_t length)
            lib.munmap.restype = ctypes.c_int
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            # int mprotect(void *addr, size_t len, int prot)
            lib.mprotect.restype = ctypes.c_int
            lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _lib = lib
        return _lib
