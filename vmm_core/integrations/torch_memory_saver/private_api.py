"""torch_memory_saver's private names that callers reach into, served here.

* ``torch_memory_saver._impl._binary_wrapper.cdll``: its C library's ``tms_*`` functions.
  slime patches DeepEP's ``Buffer.__init__`` with ``tms_get_interesting_region`` /
  ``tms_set_interesting_region(False)`` around it, so that DeepEP's buffers stay out of
  the whole-process region; torch_memory_saver's own tests read the thread's region
  configuration (``tms_get_current_tag``, ``tms_get_enable_cpu_backup``, ...) and call
  ``tms_pause`` / ``tms_resume``.  Here ``cdll`` is a Python object with those names
  (strings come back as ``bytes``, as ctypes returns them); any other name (CUDA runtime
  functions such as ``cudaHostGetFlags``, which that library re-exports) is looked up in
  the CUDA runtime the process loaded.
  ``tms_set_interesting_region(False)`` on a thread whose allocations go to a region
  makes them ordinary memory until ``tms_set_interesting_region(True)`` (as ``disable()``
  does for a block); ``True`` on a thread outside every region puts its allocations in
  a region of the thread's current tag.  Calls must nest with the thread's blocks.
* ``_impl._mem_pools``: the framework pool of each region, under torch_memory_saver's key
  ``(tag, enable_cpu_backup, enable_disk_backup, cpu backup backend, device)``.  Popping
  one hands its pool over: once the caller drops it, the region's memory (and its host
  copy) is closed, at the end of the next ``_impl._with_region_config`` block at the
  latest, as torch_memory_saver frees an allocation's backup with the allocation.
* ``_impl._with_region_config(tag, enable_cpu_backup, cpu_backup_backend,
  enable_disk_backup=False)``: the thread's configuration for a block (what
  ``tms_get_*`` return), routing nothing.
* The ``tms_pause`` / ``tms_resume`` symbols of the preloaded library
  (``csrc/tms_preload.c``) reach :func:`install_preload_callbacks`'s callbacks.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading

from ...memory.shim import REBUILD
from . import settings, state

__all__ = ["Impl", "Library", "install_preload_callbacks"]

logger = logging.getLogger("vmm_core")


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


class _Manual(threading.local):
    """The blocks ``tms_set_interesting_region`` entered on this thread."""

    def __init__(self) -> None:
        self.blocks: list[contextlib.ExitStack] = []


class Library:
    """``_impl._binary_wrapper.cdll``: torch_memory_saver's C functions (see the module
    docstring)."""

    def __init__(self, saver) -> None:
        self._saver = saver
        self._manual = _Manual()
        self._runtime = None

    # -- the thread's configuration ---------------------------------------------------
    def tms_get_interesting_region(self) -> bool:
        return state.config().interesting

    def tms_set_interesting_region(self, value) -> None:
        value = bool(value)
        if value == state.config().interesting:
            return
        manual = self._manual.blocks
        if not value:
            stack = contextlib.ExitStack()
            stack.enter_context(self._saver.disable())
        elif manual and not state.config().interesting:
            manual.pop().close()  # the matching set(False)
            return
        else:
            cfg = state.config()
            stack = contextlib.ExitStack()
            stack.enter_context(self._saver.region(
                cfg.tag, enable_cpu_backup=cfg.cpu_backup,
                enable_disk_backup=cfg.disk_backup,
                cpu_backup_backend=cfg.cpu_backup_backend if cfg.cpu_backup else None))
        manual.append(stack)

    def tms_get_current_tag(self) -> bytes:
        return state.config().tag.encode("utf-8")

    def tms_set_current_tag(self, tag) -> None:
        state.set_current(tag=_text(tag))

    def tms_get_enable_cpu_backup(self) -> bool:
        return state.config().cpu_backup

    def tms_set_enable_cpu_backup(self, value) -> None:
        state.set_current(cpu_backup=bool(value))

    def tms_get_cpu_backup_backend(self) -> bytes:
        return state.config().cpu_backup_backend.encode("utf-8")

    def tms_set_cpu_backup_backend(self, value) -> None:
        name = _text(value)
        settings.check_backup_args(True, name)
        state.set_current(cpu_backup_backend=name)

    def tms_get_enable_disk_backup(self) -> bool:
        return state.config().disk_backup

    def tms_set_enable_disk_backup(self, value) -> None:
        state.set_current(disk_backup=bool(value))

    # -- the library's calls ----------------------------------------------------------
    def tms_set_disk_backup_dir(self, path) -> None:
        self._saver.set_disk_backup_dir(_text(path))

    def tms_pause(self, tag=None) -> int:
        self._saver.pause(_text(tag) if tag else None)
        return 0

    def tms_resume(self, tag=None) -> int:
        self._saver.resume(_text(tag) if tag else None)
        return 0

    def set_memory_margin_bytes(self, value) -> None:
        self._saver.memory_margin_bytes = int(value)

    def tms_set_retain_cpu_backup(self, value) -> None:
        settings.set_retain(bool(value))

    def tms_get_retain_cpu_backup(self) -> bool:
        return settings.retain()

    def tms_get_cpu_backup_pointer(self, pointer, nbytes):
        """The host address of the backup of ``nbytes`` at device ``pointer``."""
        from .pausing import cpu_backup

        address = ctypes.cast(pointer, ctypes.c_void_p).value or 0
        backend = self._saver._ensure_initialized()
        tensor = backend.torch_tensor(self._saver._device(), address, int(nbytes))
        copy = cpu_backup(tensor, zero_copy=True)
        if copy is None:
            return ctypes.POINTER(ctypes.c_uint8)()
        return ctypes.cast(copy.data_ptr(), ctypes.POINTER(ctypes.c_uint8))

    # -- anything else: the CUDA runtime the process loaded -----------------------------
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        runtime = self._cuda_runtime()
        if runtime is None:
            raise AttributeError(f"torch_memory_saver's library has no {name!r} here: no "
                                 f"CUDA runtime is loaded in this process")
        return getattr(runtime, name)

    def _cuda_runtime(self):
        if self._runtime is None:
            import glob
            import os

            candidates = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
            try:  # the runtime torch's wheels load, by path
                import nvidia

                for base in nvidia.__path__:
                    candidates += sorted(glob.glob(os.path.join(base, "*", "lib",
                                                                "libcudart.so*")))
            except ImportError:
                pass
            for name in candidates:
                try:
                    self._runtime = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
        return self._runtime


class _BinaryWrapper:
    def __init__(self, saver) -> None:
        self.cdll = Library(saver)


class _RegionPool:
    """A region's framework pool handed over by ``_mem_pools.pop``: dropping it frees
    the pool, then closes the region's memory (see the module docstring)."""

    def __init__(self, alloc, pool) -> None:
        self._alloc, self._pool = alloc, pool

    def __del__(self) -> None:
        from ...memory import reaper, tag_state

        alloc, pool, self._pool = self._alloc, self._pool, None
        try:
            if pool is not None:  # the framework frees the pool's segments (or holds it
                tag_state.release_pool(alloc, pool)  # while the process is routed)
            del pool
            reaper.close_later(alloc.close)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _MemPools:
    """``_impl._mem_pools``: torch_memory_saver's key -> the region's pool."""

    def _find(self, key):
        from ...memory import tagged

        vtag = state.region_keys.get(tuple(key))
        if vtag is None:
            return None
        device = key[-1]
        for (tag, _, dev), alloc in list(tagged._region_allocators.items()):
            if tag == vtag and dev == device and not alloc.closed:
                return alloc
        return None

    def __contains__(self, key) -> bool:
        return self._find(key) is not None

    def __getitem__(self, key):
        from ...memory import tag_state

        alloc = self._find(key)
        if alloc is None:
            raise KeyError(key)
        return tag_state._pools.get(id(alloc))

    def pop(self, key, *default):
        from ...memory import tag_state, tagged

        alloc = self._find(key)
        if alloc is None:
            if default:
                return default[0]
            raise KeyError(key)
        pool = tag_state._pools.pop(id(alloc), None)
        with tag_state.state_lock():  # a later region of the tag makes new memory
            for region_key, region_alloc in list(tagged._region_allocators.items()):
                if region_alloc is alloc:
                    del tagged._region_allocators[region_key]
        state.region_keys.pop(tuple(key), None)
        return _RegionPool(alloc, pool)

    def keys(self):
        return [k for k in state.region_keys if self._find(k) is not None]

    def __len__(self) -> int:
        return len(self.keys())


class Impl:
    """``torch_memory_saver._impl`` (made by the first call, as there)."""

    _is_xpu = False

    def __init__(self, saver) -> None:
        self._saver = saver
        self._hook_mode = saver._hook_mode
        self._binary_wrapper = _BinaryWrapper(saver)
        self._mem_pools = _MemPools()
        install_preload_callbacks(saver)

    @contextlib.contextmanager
    def _with_region_config(self, tag: str, enable_cpu_backup: bool, cpu_backup_backend=None,
                            enable_disk_backup: bool = False):
        from ...memory import reaper

        state.push(tag=tag, interesting=True, cpu_backup=bool(enable_cpu_backup),
                   cpu_backup_backend=cpu_backup_backend or state.config().cpu_backup_backend,
                   disk_backup=bool(enable_disk_backup))
        try:
            yield
        finally:
            state.pop()
            reaper.drain()  # the memory of pools dropped inside is closed by now

    def pause(self, tag) -> None:
        self._saver.pause(tag)

    def resume(self, tag) -> None:
        self._saver.resume(tag)


# ---------------------------------------------------------------- the preloaded library
#: ``void cb(const char *tag, int *rc)``: the outcome goes into ``rc``, which the C
#: symbol sets to -1 first (csrc/tms_preload.c says why)
_TAG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int))
PRELOAD_ABI_VERSION = 2
_callbacks: list = []  # kept for the life of the process


def install_preload_callbacks(saver) -> bool:
    """If the preload library is loaded in this process, make its ``tms_pause`` /
    ``tms_resume`` call ``saver``'s; whether they do.  A preloaded library built by
    another vmm_core (its callbacks of another shape) is left answering -1, said once."""
    try:
        lib = ctypes.CDLL(None)
        install = lib.vmm_tms_preload_install
        version = lib.vmm_tms_preload_abi_version
    except (AttributeError, OSError):
        return False
    version.restype = ctypes.c_int
    found = version()
    if found != PRELOAD_ABI_VERSION:
        logger.error("the preloaded torch_memory_saver_hook_mode_preload.abi3.so has ABI %d, "
                     "this vmm_core expects %d: tms_pause / tms_resume answer -1; %s",
                     found, PRELOAD_ABI_VERSION, REBUILD)
        return False

    def turn(method):
        def call(tag, rc):
            try:
                method(tag.decode("utf-8") if tag else None)
            except Exception as exc:  # noqa: BLE001 - never into C; said instead
                logger.error("tms_%s: %s", method.__name__, exc)
                return  # rc stays -1
            rc[0] = 0
        return _TAG_CALLBACK(call)

    pause, resume = turn(saver.pause), turn(saver.resume)
    _callbacks.extend([pause, resume])
    install.argtypes = [_TAG_CALLBACK, _TAG_CALLBACK]
    install.restype = None
    install(pause, resume)
    return True
