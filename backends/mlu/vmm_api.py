"""vmm_api for Cambricon MLUs, through ctypes on libcndrv (CNDrv's cnMem* calls).

Why ctypes and not torch_mlu: detection must work (and say what is missing) on machines
without Neuware, and the primitives must not depend on a framework version.  Every ctypes
declaration of the driver lives in :mod:`.cndrv_bindings`, in one place, so that a header
change is one edit; this module holds the hooks alone.

Header facts (struct layouts, enum values, CNresult codes, signatures) come from the text of
Cambricon's ``cn_api.h`` (CNDrv 2.15.5, "Copyright (C) [2023] by Cambricon") as stored in the
public code-search index (file id 3117644529; the index did not name the repository that
holds it), and from the CNDrv developer guide section 6.5.8 "Virtual Memory Management"
(index file id 2543233744).  Constraints from them that shape this backend:

* ``cnMemMap``: ``offset`` "must be zero currently" and the size must equal the handle's
  size (guide 6.5.8.5) -> ``partial_map=False``;
* ``cnMemSetAccess``: ``count`` "must be one currently" (one descriptor per call); the range
  must be "a fully mapped address range".  torch_mlu's ``caching_allocator.cpp`` is
  reported to call it once over a run of several mappings, so
  ``set_access_spans_mappings=True``.  That torch_mlu call is not in Cambricon/torch_mlu
  d578002 (2024-09, which has no expandable segments): unverified;
* ``cnMemExportToShareableHandle`` writes the descriptor through ``void *``; cn_api.h does not
  say how wide it is, so the backend hands it 8 bytes and reads the fd from the low 32 bits;
* ``CN_MEM_ACCESS_FLAGS_PROT_READWRITE`` is 0 (not 3 as in CUDA);
* ``CNdev`` is an opaque ``uint64`` from ``cnDeviceGet``, while ``CNmemLocation.id`` is the
  device ordinal;
* ``cnMemRelease`` of a mapped handle is legal and defers the free (guide 6.5.8.2); vmm_core
  refuses it anyway (see :meth:`MLUBackend.vmm_release_handle`).

Not run on MLU hardware: this module is verified only against the emulated driver in
``tests/emulated/cndrv_emu.c``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

from vmm_core.errors import BackendError, MappingError
from vmm_core.plugin import BackendCapabilities, Probe, hookimpl, library_env

from .cndrv_bindings import (
    CN_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    CN_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CN_MEM_ALLOC_GRANULARITY_MINIMUM,
    CN_MEM_ALLOCATION_TYPE_DEFAULT,
    CN_MEM_CACHE_NON_PINNED,
    CN_MEM_HANDLE_TYPE_NONE,
    CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CN_MEM_LOCATION_TYPE_DEVICE,
    CN_MEM_NON_CACHEABLE,
    CNaddr,
    CNcontext,
    CNdev,
    CNmemAccessDesc,
    CNmemAllocationProp,
    CNmemGenericAllocationHandle,
    Driver,
)

__all__ = ["ENV_LIBRARY", "DEFAULT_LIBRARY", "MLUBackend", "MLUHandle", "backend"]

ENV_LIBRARY = library_env("mlu")  # VMM_CORE_MLU_LIB
DEFAULT_LIBRARY = "libcndrv.so"


@dataclass(eq=False)
class MLUHandle:
    """A ``CNmemGenericAllocationHandle`` and what vmm_core must know about it."""

    value: int
    size: int
    device: int
    mapped: int = 0
    released: bool = False


class MLUBackend:
    """vmm_api on libcndrv.  Loads the library on the first probe, never at import."""

    name = "mlu"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._drv: Driver | None = None
        self._count = 0
        self._contexts: dict[int, int] = {}  # device ordinal -> CNcontext (shared context)
        self._granularity: dict[int, int] = {}
        self._maps: dict[tuple[int, int], tuple[int, MLUHandle]] = {}
        self._tls = threading.local()

    # -- loading ----------------------------------------------------------------
    @staticmethod
    def library_path() -> str:
        return os.environ.get(ENV_LIBRARY) or DEFAULT_LIBRARY

    def _load(self) -> Driver:
        """Open (or re-open, when the env var changed) and cnInit the driver."""
        path = self.library_path()
        with self._lock:
            if self._drv is not None and self._drv.path == path:
                return self._drv
            drv = Driver(path)
            drv.call("cnInit", 0)
            count = ctypes.c_int(0)
            drv.call("cnDeviceGetCount", ctypes.byref(count))
            self._drv, self._count = drv, count.value
            self._contexts.clear()
            self._granularity.clear()
            self._maps.clear()
            self._tls = threading.local()
            return drv

    def driver(self) -> Driver:
        """The loaded driver (loading it now if needed).  A method, not a property: pluggy
        reads every attribute of a plugin when registering it, which must not load."""
        return self._drv if self._drv is not None else self._load()

    def _bind(self, device) -> Driver:
        """Make ``device``'s shared context current on this thread (contexts are per thread)."""
        drv = self.driver()
        if not isinstance(device, int) or isinstance(device, bool) or \
                not 0 <= device < self._count:
            raise BackendError(f"mlu device {device!r} does not exist: this machine has "
                               f"{self._count} MLU(s) (indices 0..{self._count - 1})")
        ctx = self._contexts.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(device)
                if ctx is None:
                    dev = CNdev()
                    drv.call("cnDeviceGet", ctypes.byref(dev), device, detail=f"{device}")
                    handle = CNcontext()
                    drv.call("cnSharedContextAcquire", ctypes.byref(handle), dev,
                             detail=f"device {device}")
                    ctx = self._contexts[device] = handle.value
        if getattr(self._tls, "ctx", None) != ctx:
            drv.call("cnCtxSetCurrent", CNcontext(ctx), detail=f"device {device}")
            self._tls.ctx = ctx
        return drv

    @staticmethod
    def _prop(device: int) -> CNmemAllocationProp:
        prop = CNmemAllocationProp()
        prop.type = CN_MEM_ALLOCATION_TYPE_DEFAULT
        prop.requestedHandleTypes = CN_MEM_HANDLE_TYPE_NONE
        prop.location.type = CN_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        return prop

    @staticmethod
    def _positive(call: str, name: str, value) -> int:
        # ctypes would silently wrap a negative value into a huge uint64
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise MappingError(f"{call}: {name} {value!r} must be a positive int multiple "
                               f"of the granularity")
        return value

    # -- detection ----------------------------------------------------------------
    @hookimpl
    def vmm_probe(self):
        path = self.library_path()
        try:
            drv = self._load()
        except OSError as exc:
            if os.environ.get(ENV_LIBRARY):
                return Probe(False, f"{ENV_LIBRARY}={path} could not be loaded ({exc}): point "
                                    f"{ENV_LIBRARY} at libcndrv.so of Cambricon Neuware/"
                                    f"CNToolkit")
            return Probe(False, f"{DEFAULT_LIBRARY} not found: install Cambricon Neuware/"
                                f"CNToolkit, or set {ENV_LIBRARY} to the library's path")
        except Exception as exc:  # never raise from a probe
            return Probe(False, f"{path}: {exc}")
        if self._count < 1:
            return Probe(False, f"{path} loaded but cnDeviceGetCount found no MLU: check "
                                f"the driver (cnmon) and MLU_VISIBLE_DEVICES")
        kind = "EMULATED libcndrv (tests only, no MLU hardware)" if drv.emulated \
            else "libcndrv"
        return Probe(True, f"{kind} {path}: {self._count} MLU(s)",
                     device_count=self._count, priority=100,
                     versions={"cndrv": drv.version() or "unknown"}, library=path)

    def granularity(self, device: int) -> int:
        """The driver's MINIMUM granularity, what every backend declares (hookspecs).  The
        guide recommends RECOMMENDED against fragmentation, for callers that make one
        handle per allocation; core grows physical memory in large handles itself, and
        rounds every allocation to the granularity, so a larger unit would only waste."""
        g = self._granularity.get(device)
        if g is None:
            drv = self._bind(device)
            prop = self._prop(device)
            minimum = ctypes.c_uint64()
            drv.call("cnMemGetAllocationGranularity", ctypes.byref(minimum),
                     ctypes.byref(prop), CN_MEM_ALLOC_GRANULARITY_MINIMUM, detail="MINIMUM")
            g = self._granularity[device] = minimum.value
        return g

    @hookimpl
    def vmm_capabilities(self, device):
        g = self.granularity(device)
        return BackendCapabilities(
            granularity=g,
            partial_map=False,
            needs_set_access=True,
            set_access_spans_mappings=True,  # a run of mappings, as torch_mlu (see above)
            graph_pool=False,
            default_reserve_bytes=(1 << 36) // g * g,
            notes=("graph_pool=False: torch_mlu has no MemPool usable during capture "
                   "(MLUPluggableAllocator can only replace the process-wide allocator), so "
                   "GraphExecutor falls back to one shared pool (torch.mlu.graph_pool_handle) "
                   "for all graphs. cnMemMap maps whole handles at offset 0; one "
                   "cnMemSetAccess (count 1) may cover a run of mappings. Verified only "
                   "against an emulated libcndrv; no MLU hardware was tested."),
            shareable_handles=self._shareable_kind(device),
            peer_access=False,
        )

    # -- ranges ----------------------------------------------------------------------
    @hookimpl
    def vmm_reserve(self, device, size, alignment):
        self._positive("cnMemAddressReserve", "size", size)
        drv = self._bind(device)
        addr = CNaddr()
        drv.call("cnMemAddressReserve", ctypes.byref(addr), size, int(alignment or 0), 0, 0,
                 detail=f"size={size}, alignment={alignment}")
        return addr.value

    @hookimpl
    def vmm_release_range(self, device, address, size):
        self._positive("cnMemAddressFree", "size", size)
        drv = self._bind(device)
        drv.call("cnMemAddressFree", address, size, detail=f"{address:#x}, {size}")

    # -- handles -----------------------------------------------------------------------
    @hookimpl
    def vmm_create_handle(self, device, size):
        self._positive("cnMemCreate", "size", size)
        drv = self._bind(device)
        prop = self._prop(device)
        value = CNmemGenericAllocationHandle()
        drv.call("cnMemCreate", ctypes.byref(value), size, ctypes.byref(prop), 0,
                 detail=f"size={size}, device={device}")
        return MLUHandle(value.value, size, device)

    @hookimpl
    def vmm_release_handle(self, device, handle):
        if not isinstance(handle, MLUHandle) or handle.released:
            raise MappingError(f"cnMemRelease: {handle!r} is not a live MLU handle of this "
                               f"backend (double release?)")
        if handle.mapped:
            # cn_api.h would accept this and free at the last cnMemUnmap; vmm_core's contract
            # refuses it so that physical_bytes never counts memory the driver still holds
            raise MappingError(f"cnMemRelease: handle {handle.value:#x} still has "
                               f"{handle.mapped} mapping(s); unmap it everywhere first")
        drv = self._bind(device)
        drv.call("cnMemRelease", handle.value, detail=f"{handle.value:#x}")
        handle.released = True

    # -- mapping -------------------------------------------------------------------------
    @hookimpl
    def vmm_map(self, device, address, size, handle, offset):
        if not isinstance(handle, MLUHandle) or handle.released:
            raise MappingError(f"cnMemMap: {handle!r} is not a live MLU handle")
        self._positive("cnMemMap", "size", size)
        if not isinstance(offset, int) or offset < 0:
            raise MappingError(f"cnMemMap: offset {offset!r} must be 0 (whole handle only)")
        drv = self._bind(device)
        drv.call("cnMemMap", address, size, offset, handle.value, 0,
                 detail=f"{address:#x}, size={size}, offset={offset}, "
                        f"handle of {handle.size} bytes")
        with self._lock:
            self._maps[(device, address)] = (size, handle)
            handle.mapped += 1

    @hookimpl
    def vmm_set_access(self, device, address, size):
        self._grant(device, address, size, device)

    def _grant(self, device: int, address: int, size: int, target: int) -> None:
        """One ``cnMemSetAccess`` (count "must be one currently"): read-write for ``target``."""
        self._positive("cnMemSetAccess", "size", size)
        drv = self._bind(device)
        desc = CNmemAccessDesc()
        desc.location.type = CN_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = target
        desc.accessFlags = CN_MEM_ACCESS_FLAGS_PROT_READWRITE
        desc.cacheType = CN_MEM_NON_CACHEABLE
        desc.pinnedType = CN_MEM_CACHE_NON_PINNED
        drv.call("cnMemSetAccess", address, size, ctypes.byref(desc), 1,
                 detail=f"{address:#x}, {size}, READWRITE for device {target}, count=1")

    @hookimpl
    def vmm_unmap(self, device, address, size):
        self._positive("cnMemUnmap", "size", size)
        drv = self._bind(device)
        drv.call("cnMemUnmap", address, size, detail=f"{address:#x}, {size}")
        with self._lock:
            entry = self._maps.pop((device, address), None)
            if entry is not None:
                entry[1].mapped -= 1

    # -- data movement -------------------------------------------------------------------
    @hookimpl
    def vmm_synchronize(self, device):
        self._bind(device).call("cnCtxSync", detail=f"device {device}")

    @hookimpl
    def vmm_copy_to_host(self, device, address, host_address, size):
        self._bind(device).call("cnMemcpyDtoH", host_address, address, size,
                                detail=f"host {host_address:#x} <- {address:#x}, {size}")

    @hookimpl
    def vmm_copy_from_host(self, device, host_address, address, size):
        self._bind(device).call("cnMemcpyHtoD", address, host_address, size,
                                detail=f"{address:#x} <- host {host_address:#x}, {size}")

    @hookimpl
    def vmm_copy_device(self, device, src_address, dst_address, size):
        self._bind(device).call("cnMemcpyDtoD", dst_address, src_address, size,
                                detail=f"{dst_address:#x} <- {src_address:#x}, {size}")

    # -- sharing between processes (file descriptors; see cndrv_bindings) ----------------
    def _shareable_kind(self, device: int) -> str | None:
        drv = self._bind(device)
        if not drv.sharing:
            return None
        dev = CNdev()
        drv.call("cnDeviceGet", ctypes.byref(dev), device, detail=f"{device}")
        supported = ctypes.c_int(0)
        drv.call("cnDeviceGetAttribute", ctypes.byref(supported),
                 CN_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev,
                 detail="HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
        return "fd" if supported.value == 1 else None

    @hookimpl
    def vmm_create_shareable_handle(self, device, size):
        self._positive("cnMemCreate", "size", size)
        drv = self._bind(device)
        prop = self._prop(device)
        prop.requestedHandleTypes = CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        value = CNmemGenericAllocationHandle()
        drv.call("cnMemCreate", ctypes.byref(value), size, ctypes.byref(prop), 0,
                 detail=f"size={size}, device={device}, requestedHandleTypes=POSIX_FD")
        return MLUHandle(value.value, size, device)

    @hookimpl
    def vmm_export_handle(self, device, handle, importers):
        if not isinstance(handle, MLUHandle) or handle.released:
            raise MappingError(f"cnMemExportToShareableHandle: {handle!r} is not a live MLU "
                               f"handle")
        drv = self._bind(device)
        # cn_api.h does not say how many bytes the descriptor takes behind `void *`: give
        # the driver 8, so one that writes a 64-bit value cannot overrun the buffer, and
        # read the descriptor from the low 32 bits (an int either way)
        out = ctypes.c_uint64(0)
        drv.call("cnMemExportToShareableHandle", ctypes.byref(out), handle.value,
                 CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0,
                 detail=f"{handle.value:#x}, POSIX_FILE_DESCRIPTOR")
        return out.value & 0xFFFFFFFF

    @hookimpl
    def vmm_import_handle(self, device, shareable, size):
        self._positive("cnMemImportFromShareableHandle", "size", size)
        drv = self._bind(device)
        value = CNmemGenericAllocationHandle()
        drv.call("cnMemImportFromShareableHandle", ctypes.byref(value),
                 ctypes.c_void_p(shareable), CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                 detail=f"fd {shareable}, POSIX_FILE_DESCRIPTOR")
        return MLUHandle(value.value, size, device)

    @hookimpl
    def vmm_set_access_for(self, device, address, size, devices):
        for d in devices:  # one call per device
            self._grant(device, address, size, d)

    # -- the calling thread's context (contexts are per thread) ------------------
    @hookimpl
    def vmm_thread_device(self):
        drv = self.driver()
        ctx = CNcontext()
        drv.call("cnCtxGetCurrent", ctypes.byref(ctx))
        return (ctx.value,)

    @hookimpl
    def vmm_set_thread_device(self, state):
        drv = self.driver()
        if getattr(self._tls, "ctx", None) != state[0]:
            drv.call("cnCtxSetCurrent", CNcontext(state[0]), detail="the caller's context")
            self._tls.ctx = state[0]

    # -- framework integration (torch_mlu imported only when these objects are used) ------
    @hookimpl
    def vmm_graph_ops(self, device):
        from .graph_ops import MLUGraphOps

        return MLUGraphOps(device)

    @hookimpl
    def vmm_allocator_adapter(self, device):
        from .allocator_adapter import MLUAllocatorAdapter

        return MLUAllocatorAdapter(device)


#: the plugin object registered under the entry point ``mlu``
backend = MLUBackend()
