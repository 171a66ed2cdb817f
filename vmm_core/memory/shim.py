"""Every ctypes declaration of the C shim (csrc/vmm_shim.c) in one place.

The shim is built by ``pip install`` as ``vmm_core._vmm_shim``; the frameworks'
pluggable allocators load its ``vmm_shim_alloc`` / ``vmm_shim_free`` symbols by path.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import threading

from .. import forksafe, interrupts
from ..errors import BackendUnavailableError

__all__ = ["ABI_VERSION", "ALLOC_SYMBOL", "FREE_SYMBOL", "ALLOC_CALLBACK", "c_alloc_callback",
           "Shim", "load_shim", "loaded_shim", "keep_for_process_life"]

ABI_VERSION = 5
#: what to do about a C library of this package built by another release of it
REBUILD = ("reinstall vmm_core to rebuild it (pip install -e . in a checkout; pip install "
           "--force-reinstall --no-deps vmm_core otherwise)")
ALLOC_SYMBOL = "vmm_shim_alloc"
FREE_SYMBOL = "vmm_shim_free"

#: ``void cb(size_t size, int device, void *stream, void **out, int *state)``, the alloc
#: callback of both C entry points (csrc/vmm_interrupt.h says how they call it)
ALLOC_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.POINTER(ctypes.c_int))
#: the callback's state word (csrc/vmm_interrupt.h): 0 as C calls it, or a Ctrl-C that C
#: took from Python's pending signals first; the callback sets INTERRUPTED to pass one on
#: (C reads nothing else), and BEGUN once it holds Ctrl-C and makes the memory
INTERRUPTED, CTRL_C_BEFORE, BEGUN = 1, 2, 4


def c_alloc_callback(fn):
    """``fn(size, device, stream) -> address or 0`` as the C entry points' alloc callback.

    The address travels through ``out``, which C sets to NULL before the call, and not
    as a return value: when an exception escapes a ctypes callback, ctypes returns
    whatever its result buffer held, which the framework would take as memory.  An
    ``out`` never written stays NULL: out of memory.  The caller keeps the object alive.

    Ctrl-C waits while ``fn`` makes the memory, and is then handed to C (``state``),
    which signals it again once the callback has returned: raised here, inside the
    framework's allocator, it became out of memory, or was lost with the memory handed
    out.  One that came before (C runs the pending signal handlers before the call) or
    was raised before the hold is handed on too, and the memory made under a hold all
    the same: an engine may catch the out of memory an empty ``out`` means and go on as
    if no Ctrl-C had come.  Only Python's own handler's interrupts, on the main thread,
    are handed on: a program's handler is never called twice for one Ctrl-C, and what it
    raises in an allocation is out of memory."""

    def write_address(size: int, device: int, stream, out, state) -> None:
        try:
            try:
                if state[0] == CTRL_C_BEFORE:
                    state[0] = 0
                    raise KeyboardInterrupt  # where Python would have raised it
                with interrupts.held("a framework allocation", note=state):
                    state[0] = state[0] or BEGUN  # a Ctrl-C noted as it armed stays
                    out[0] = fn(size, device, stream) or None
            except KeyboardInterrupt:
                if state[0] or out[0] or not interrupts.pythons_own_ctrl_c():
                    raise  # came while held, or from fn, or after, or a program's own
                state[0] = INTERRUPTED  # came before the hold: the memory under one now
                with interrupts.held("a framework allocation"):
                    out[0] = fn(size, device, stream) or None
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and interrupts.pythons_own_ctrl_c():
                state[0] = INTERRUPTED  # Python's own, outside every hold
            if not (state[0] == INTERRUPTED and isinstance(exc, KeyboardInterrupt)):
                raise  # escapes ctypes: ``out`` stays NULL, out of memory

    return ALLOC_CALLBACK(write_address)


class Shim:
    """The loaded shim library and the one alloc callback installed into it."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        # The version first: a shim of another ABI may lack (or change) the other symbols.
        try:
            lib.vmm_shim_abi_version.restype = ctypes.c_int
        except AttributeError as exc:
            raise BackendUnavailableError(
                f"{path} is not a vmm_core shim (no vmm_shim_abi_version symbol): "
                f"{REBUILD}") from exc
        version = lib.vmm_shim_abi_version()
        if version != ABI_VERSION:
            raise BackendUnavailableError(
                f"{path} has shim ABI {version}, this vmm_core expects {ABI_VERSION}: "
                f"{REBUILD}")
        lib.vmm_shim_set_alloc_callback.argtypes = [ALLOC_CALLBACK]
        lib.vmm_shim_set_alloc_callback.restype = None
        lib.vmm_shim_counter.argtypes = [ctypes.c_int]
        lib.vmm_shim_counter.restype = ctypes.c_ulonglong
        lib.vmm_shim_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.vmm_shim_alloc.restype = ctypes.c_void_p
        lib.vmm_shim_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_void_p]
        lib.vmm_shim_free.restype = None
        lib.vmm_shim_holds.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        lib.vmm_shim_holds.restype = ctypes.c_int
        lib.vmm_shim_segments.argtypes = []
        lib.vmm_shim_segments.restype = ctypes.c_ulonglong
        self.lib = lib
        self._callback = None  # kept alive for the life of the process
        self._retired: list = []

    @property
    def installed(self) -> bool:
        """Whether an alloc callback was installed in this process."""
        return self._callback is not None

    def install(self, fn) -> None:
        """Route every shim alloc to ``fn(size, device, stream) -> int address or 0``.

        The callback it replaces is retired, not freed: a call on another thread may
        still be inside it."""
        if self._callback is not None:
            self._retired.append(self._callback)
        self._callback = c_alloc_callback(fn)  # never released: the allocator may call late
        self.lib.vmm_shim_set_alloc_callback(self._callback)
        atexit.register(self.disable)

    def ensure_routing(self) -> None:
        """Install vmm_core's routing callback once per process (every adapter calls this)."""
        with _lock:
            if self._callback is None:
                from .routing import alloc_callback

                self.install(alloc_callback)

    def disable(self) -> None:
        """After this, alloc returns NULL without entering Python (interpreter shutdown).

        The old callback object is retired, not freed: a call already inside it may
        still be running.  ``ensure_routing()`` installs routing again."""
        self.lib.vmm_shim_set_alloc_callback(ALLOC_CALLBACK())
        if self._callback is not None:
            self._retired.append(self._callback)
            self._callback = None

    def holds(self, base: int, size: int) -> bool:
        """Whether the framework holds a segment of this shim inside ``[base, base+size)``
        (returned by alloc, not yet given to free).  Asks only the shim's own table."""
        return bool(self.lib.vmm_shim_holds(base, size))

    def segments(self) -> int:
        """How many segments the framework holds now."""
        return int(self.lib.vmm_shim_segments())

    def counters(self) -> dict[str, int]:
        c = self.lib.vmm_shim_counter
        return {"allocs": c(0), "alloc_bytes": c(1), "frees": c(2), "free_bytes": c(3),
                "alloc_failures": c(4)}


_shim: Shim | None = None
_lock = threading.Lock()


def _fresh_lock_after_fork() -> None:
    """Another thread may have held the lock at the fork (loading the shim, installing
    routing); the child does not have it.  The C side has its own fork handlers."""
    global _lock
    _lock = threading.Lock()


forksafe.at_fork("framework calls", after_in_child=_fresh_lock_after_fork)


def keep_for_process_life(obj):
    """Give ``obj`` a reference nothing drops, not even interpreter shutdown; return it.

    A framework pool built on a pluggable allocator (``torch.cuda.MemPool``) holds only
    a raw pointer to it, and a pool that is still alive at shutdown (held by a module
    global) frees its segments through that pointer from its destructor.  A module-level
    reference is not enough: shutdown clears module globals in an order nobody chooses,
    and if the allocator goes first, torch aborts the process at exit ("Trying to free
    a pointer not allocated here", ``CUDAPluggableAllocator::raw_delete``)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj


def loaded_shim() -> Shim | None:
    """The shim if this process loaded it, else None (no framework can hold its memory)."""
    return _shim


def load_shim() -> Shim:
    global _shim
    with _lock:
        if _shim is None:
            spec = importlib.util.find_spec("vmm_core._vmm_shim")
            if spec is None or not spec.origin:
                raise BackendUnavailableError(
                    "the C shim vmm_core._vmm_shim is not built; install vmm_core with pip "
                    "(pip install -e .) so that the system C compiler builds csrc/vmm_shim.c")
            _shim = Shim(spec.origin)
        return _shim
