"""vmm_api for Cambricon MLUs, through ctypes on libcndrv (CNDrv's cnMem* calls).

Why ctypes and not torch_mlu: detection must work (and say what is missing) on machines
without Neuware, and the primitives must not depend on a framework version.  Every ctypes
declaration of the driver lives in :data:`_SIGNATURES` below, in one place, so that a header
change is one edit.

Header facts (struct layouts, enum values, CNresult codes, signatures) come from the text of
Cambricon's ``cn_api.h`` (CNDrv 2.15.5, "Copyright (C) [2023] by Cambricon") as stored in the
public code-search index (file id 3117644529; the index did not name the repository that
holds it), and from the CNDrv developer guide section 6.5.8 "Virtual Memory Management"
(index file id 2543233744).  Constraints from them that shape this backend:

* ``cnMemMap``: ``offset`` "must be zero currently" and the size must equal the handle's
  size (guide 6.5.8.5) -> ``partial_map=False``;
* ``cnMemSetAccess``: ``count`` "must be one currently"; the header does not say one call may
  span several mappings and the guide sets access per handle -> one call per mapping;
* ``CN_MEM_ACCESS_FLAGS_PROT_READWRITE`` is 0 (not 3 as in CUDA);
* ``CNdev`` is an opaque ``uint64`` from ``cnDeviceGet``, while ``CNmemLocation.id`` is the
  device ordinal;
* ``cnMemRelease`` of a mapped handle is legal and defers the free (guide 6.5.8.2); vmm_core
  refuses it anyway (see :meth:`MLUBackend.vmm_release_handle`).

No MLU hardware was available: this module is verified only against the emulated driver in
``tests/emulated/cndrv_emu.c``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

from vmm_core.capabilities import BackendCapabilities, Probe
from vmm_core.errors import BackendError, MappingError, OutOfMemoryError
from vmm_core.hookspecs import hookimpl

__all__ = ["ENV_LIB", "DEFAULT_LIB", "MLUBackend", "MLUHandle", "backend"]

ENV_LIB = "VMM_CORE_CNDRV_LIB"
DEFAULT_LIB = "libcndrv.so"

# ----------------------------------------------------------------------------------------
# cn_api.h constants (values checked against the header text named in the module docstring)
# ----------------------------------------------------------------------------------------
CN_SUCCESS = 0
CN_ERROR_NAMES = {
    1: "CN_ERROR_NOT_READY",
    100002: "CN_ERROR_NOT_INITIALIZED",
    100003: "CN_ERROR_DEINITIALIZED",
    100004: "CN_ERROR_NO_DEVICE",
    100005: "CN_ERROR_INVALID_DEVICE",
    100006: "CN_ERROR_INVALID_VALUE",
    100007: "CN_ERROR_OPERATING_SYSTEM",
    100008: "CN_ERROR_SYSTEM_NOT_READY",
    100009: "CN_ERROR_SYSTEM_DRIVER_MISMATCH",
    100010: "CN_ERROR_SYSTEM_OUT_OF_MEMORY",
    100011: "CN_ERROR_INVALID_ADDRESS",
    100014: "CN_ERROR_INVALID_HANDLE",
    100015: "CN_ERROR_ILLEGAL_STATE",
    100050: "CN_OPS_ERROR_NOT_SUPPORTED",
    100051: "CN_OPS_ERROR_NOT_PERMITTED",
    100053: "CN_OPS_ERROR_OUT_OF_RESOURCES",
    100100: "CN_MEMORY_ERROR_OUT_OF_MEMORY",
    100101: "CN_MEMORY_ERROR_OUT_OF_PROCESS_MAX_MEMORY",
    100102: "CN_MEMORY_ERROR_INVALID_ADDRESS",
    100201: "CN_CONTEXT_ERROR_INVALID",
    100202: "CN_CONTEXT_ERROR_OUT_OF_RESOURCES",
}
_CODE = {name: code for code, name in CN_ERROR_NAMES.items()}

#: codes that mean "no memory left": they become OutOfMemoryError
OUT_OF_MEMORY_CODES = frozenset(_CODE[n] for n in (
    "CN_MEMORY_ERROR_OUT_OF_MEMORY", "CN_MEMORY_ERROR_OUT_OF_PROCESS_MAX_MEMORY",
    "CN_ERROR_SYSTEM_OUT_OF_MEMORY", "CN_OPS_ERROR_OUT_OF_RESOURCES"))
#: calls whose argument errors are mapping misuse (MappingError)
MAPPING_CALLS = frozenset(("cnMemAddressReserve", "cnMemAddressFree", "cnMemMap",
                           "cnMemSetAccess", "cnMemUnmap", "cnMemRelease",
                           "cnMemExportToShareableHandle", "cnMemImportFromShareableHandle"))
MAPPING_MISUSE_CODES = frozenset(_CODE[n] for n in (
    "CN_ERROR_INVALID_VALUE", "CN_MEMORY_ERROR_INVALID_ADDRESS", "CN_OPS_ERROR_NOT_SUPPORTED",
    "CN_ERROR_INVALID_ADDRESS"))

_REMEDY = {
    "CN_ERROR_NOT_INITIALIZED": "cnInit was not called or failed; re-probe the backend",
    "CN_ERROR_NO_DEVICE": "no MLU is visible; check MLU_VISIBLE_DEVICES and `cnmon`",
    "CN_ERROR_INVALID_DEVICE": "use a device index below the probed device count",
    "CN_ERROR_INVALID_VALUE": "an argument breaks a documented cnMem* rule (granularity "
                              "alignment, whole-handle map at offset 0, count 1, exact "
                              "reservation size)",
    "CN_MEMORY_ERROR_INVALID_ADDRESS": "the address is not inside a reservation / mapping "
                                       "of this process, or is already mapped",
    "CN_OPS_ERROR_NOT_SUPPORTED": "this driver or device does not support the request "
                                  "(e.g. one cnMemSetAccess over several mappings)",
    "CN_CONTEXT_ERROR_INVALID": "no valid context is bound to this thread",
    "CN_ERROR_SYSTEM_DRIVER_MISMATCH": "libcndrv and the MLU kernel driver do not match: "
                                       "reinstall Neuware matching the driver",
}
_OOM_REMEDY = "free MLU memory (sleep other allocators, lower reserve/pool sizes) and retry"

# enums
CN_MEM_LOCATION_TYPE_DEVICE = 0x1
CN_MEM_ALLOCATION_TYPE_DEFAULT = 0x1
CN_MEM_HANDLE_TYPE_NONE = 0x0
CN_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CN_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
CN_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x0
CN_MEM_ACCESS_FLAGS_PROT_READONLY = 0x1
CN_MEM_NON_CACHEABLE = 0x0
CN_MEM_CACHE_NON_PINNED = 0x0

# C enums are int-sized; the header's enums have no negative values.
_enum = ctypes.c_uint
CNresult = ctypes.c_int
CNaddr = ctypes.c_uint64
CNdev = ctypes.c_uint64
CNmemGenericAllocationHandle = ctypes.c_uint64
CNcontext = ctypes.c_void_p


class CNmemLocation(ctypes.Structure):
    """``struct cn_mem_location``: ``{CNmemLocationType type; cn_uint32_t id;}``."""

    _fields_ = [("type", _enum), ("id", ctypes.c_uint32)]


class _CNmemAllocFlags(ctypes.Structure):
    """The anonymous ``allocFlags`` struct inside ``CNmemAllocationProp``."""

    _fields_ = [("compressionType", ctypes.c_ubyte), ("securityType", ctypes.c_ubyte)]


class CNmemAllocationProp(ctypes.Structure):
    """``struct cn_mem_allocation_prop``: type, requestedHandleTypes, location, allocFlags."""

    _fields_ = [("type", _enum), ("requestedHandleTypes", _enum),
                ("location", CNmemLocation), ("allocFlags", _CNmemAllocFlags)]


class CNmemAccessDesc(ctypes.Structure):
    """``struct cn_mem_access_desc``: location, accessFlags, cacheType, pinnedType."""

    _fields_ = [("location", CNmemLocation), ("accessFlags", _enum),
                ("cacheType", _enum), ("pinnedType", _enum)]


_P = ctypes.POINTER
#: every driver symbol this backend calls: name -> argtypes (restype is always CNresult)
_SIGNATURES = {
    "cnInit": [ctypes.c_uint],
    "cnGetLibVersion": [_P(ctypes.c_int), _P(ctypes.c_int), _P(ctypes.c_int)],
    "cnDeviceGetCount": [_P(ctypes.c_int)],
    "cnDeviceGet": [_P(CNdev), ctypes.c_int],
    "cnSharedContextAcquire": [_P(CNcontext), CNdev],
    "cnCtxSetCurrent": [CNcontext],
    "cnCtxSync": [],
    "cnMemGetAllocationGranularity": [_P(ctypes.c_uint64), _P(CNmemAllocationProp), _enum],
    "cnMemCreate": [_P(CNmemGenericAllocationHandle), ctypes.c_uint64,
                    _P(CNmemAllocationProp), ctypes.c_uint64],
    "cnMemRelease": [CNmemGenericAllocationHandle],
    "cnMemAddressReserve": [_P(CNaddr), ctypes.c_uint64, ctypes.c_uint64, CNaddr,
                            ctypes.c_uint64],
    "cnMemAddressFree": [CNaddr, ctypes.c_uint64],
    "cnMemMap": [CNaddr, ctypes.c_uint64, ctypes.c_uint64, CNmemGenericAllocationHandle,
                 ctypes.c_uint64],
    "cnMemSetAccess": [CNaddr, ctypes.c_uint64, _P(CNmemAccessDesc), ctypes.c_uint64],
    "cnMemUnmap": [CNaddr, ctypes.c_uint64],
    "cnMemcpyHtoD": [CNaddr, ctypes.c_void_p, ctypes.c_uint64],
    "cnMemcpyDtoH": [ctypes.c_void_p, CNaddr, ctypes.c_uint64],
    "cnMemcpyDtoD": [CNaddr, CNaddr, ctypes.c_uint64],
}
#: symbols without which VMM cannot work (the rest are nice to have)
_REQUIRED = tuple(n for n in _SIGNATURES if n != "cnGetLibVersion")

# ----------------------------------------------------------------------------------------
# Sharing memory between processes (optional: bound only if the library has all of them).
# From the same cn_api.h (CNDrv 2.15.5, index file id 3117644529):
#   cnMemExportToShareableHandle(void *shareableHandle, CNmemGenericAllocationHandle handle,
#       CNmemAllocationHandleType handleType, cn_uint64_t flags /*"must be zero"*/)
#   cnMemImportFromShareableHandle(CNmemGenericAllocationHandle *handle, void *osHandle,
#       CNmemAllocationHandleType shHandleType)
#   cnDeviceGetAttribute(int *pi, CNdevice_attribute attrib, CNdev dev)
#   CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1 ("supports exporting memory to a POSIX
#   file descriptor"), requested in CNmemAllocationProp.requestedHandleTypes at cnMemCreate;
#   CN_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0x30C.
#   cnMemRelease: "Each time a consumer process imports a shareable handle, it needs to pair
#   the handle with cnMemRelease()".
# The header does not say how a descriptor travels in ``void *osHandle``; the descriptor's
# value is passed as the pointer, which is the convention of the CUDA driver API that these
# calls mirror (cuMemImportFromShareableHandle).  Not checked on MLU hardware.
# cn_api.h offers no peer-access query for VMM mappings, so peer_access is False: ranks
# share memory only on one MLU.
# ----------------------------------------------------------------------------------------
CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CN_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0x30C
_SHARING_SIGNATURES = {
    "cnDeviceGetAttribute": [_P(ctypes.c_int), _enum, CNdev],
    "cnMemExportToShareableHandle": [ctypes.c_void_p, CNmemGenericAllocationHandle, _enum,
                                     ctypes.c_uint64],
    "cnMemImportFromShareableHandle": [_P(CNmemGenericAllocationHandle), ctypes.c_void_p,
                                       _enum],
}


def error_name(code: int) -> str:
    return CN_ERROR_NAMES.get(code, f"CNresult {code}")


def raise_for(call: str, code: int, detail: str = "") -> None:
    """Turn a failed CNresult into the one vmm_core exception type it stands for."""
    name = error_name(code)
    where = f"{call}({detail})" if detail else call
    if code in OUT_OF_MEMORY_CODES:
        raise OutOfMemoryError(f"{where} failed: {name} ({code}); {_OOM_REMEDY}")
    remedy = _REMEDY.get(name, "see cn_api.h for this code")
    if call in MAPPING_CALLS and code in MAPPING_MISUSE_CODES:
        raise MappingError(f"{where} failed: {name} ({code}); {remedy}")
    raise BackendError(f"{where} failed: {name} ({code}); {remedy}")


class Driver:
    """A loaded libcndrv with every signature declared; calls raise vmm_core errors."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)
        missing = [n for n in _REQUIRED if not hasattr(self.lib, n)]
        if missing:
            raise BackendError(
                f"{path} lacks {', '.join(missing)}: this libcndrv has no virtual memory "
                f"management; install CNToolkit/Neuware with cnMem* VMM support")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = CNresult
        self.emulated = hasattr(self.lib, "emu_is_emulated")
        #: the library can export handles as file descriptors (every sharing symbol exists)
        self.sharing = all(hasattr(self.lib, n) for n in _SHARING_SIGNATURES)
        if self.sharing:
            for name, argtypes in _SHARING_SIGNATURES.items():
                fn = getattr(self.lib, name)
                fn.argtypes = argtypes
                fn.restype = CNresult

    def call(self, name: str, *args, detail: str = "") -> None:
        code = getattr(self.lib, name)(*args)
        if code != CN_SUCCESS:
            raise_for(name, code, detail)

    def version(self) -> str | None:
        if not hasattr(self.lib, "cnGetLibVersion"):
            return None
        v = [ctypes.c_int() for _ in range(3)]
        if self.lib.cnGetLibVersion(*(ctypes.byref(x) for x in v)) != CN_SUCCESS:
            return None
        return ".".join(str(x.value) for x in v)


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
        return os.environ.get(ENV_LIB) or DEFAULT_LIB

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
            if os.environ.get(ENV_LIB):
                return Probe(False, f"{ENV_LIB}={path} could not be loaded ({exc}): point "
                                    f"{ENV_LIB} at libcndrv.so of Cambricon Neuware/CNToolkit")
            return Probe(False, f"{DEFAULT_LIB} not found: install Cambricon Neuware/"
                                f"CNToolkit, or set {ENV_LIB} to the library's path")
        except Exception as exc:  # never raise from a probe
            return Probe(False, f"{path}: {exc}")
        if self._count < 1:
            return Probe(False, f"{path} loaded but cnDeviceGetCount found no MLU: check "
                                f"the driver (cnmon) and MLU_VISIBLE_DEVICES")
        kind = "EMULATED libcndrv (tests only, no MLU hardware)" if drv.emulated \
            else "libcndrv"
        versions = {"cndrv": drv.version() or "unknown", "library": path}
        return Probe(True, f"{kind} {path}: {self._count} MLU(s)",
                     device_count=self._count, priority=100, versions=versions)

    def granularity(self, device: int) -> int:
        g = self._granularity.get(device)
        if g is None:
            drv = self._bind(device)
            prop = self._prop(device)
            minimum, recommended = ctypes.c_uint64(), ctypes.c_uint64()
            drv.call("cnMemGetAllocationGranularity", ctypes.byref(minimum),
                     ctypes.byref(prop), CN_MEM_ALLOC_GRANULARITY_MINIMUM, detail="MINIMUM")
            drv.call("cnMemGetAllocationGranularity", ctypes.byref(recommended),
                     ctypes.byref(prop), CN_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                     detail="RECOMMENDED")
            # the guide recommends RECOMMENDED against fragmentation; sizes must stay
            # multiples of MINIMUM, which a sane RECOMMENDED is
            g = recommended.value if recommended.value and \
                recommended.value % minimum.value == 0 else minimum.value
            self._granularity[device] = g
        return g

    @hookimpl
    def vmm_capabilities(self, device):
        g = self.granularity(device)
        return BackendCapabilities(
            granularity=g,
            partial_map=False,
            needs_set_access=True,
            set_access_spans_mappings=False,
            graph_pool=False,
            default_reserve_bytes=(1 << 36) // g * g,
            notes=("graph_pool=False: torch_mlu has no MemPool usable during capture "
                   "(MLUPluggableAllocator can only replace the process-wide allocator), so "
                   "GraphExecutor falls back to one shared pool (torch.mlu.graph_pool_handle) "
                   "for all graphs. cnMemMap maps whole handles at offset 0; one "
                   "cnMemSetAccess (count 1) per mapping. Verified only against an emulated "
                   "libcndrv; no MLU hardware was tested."),
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

    # -- sharing between processes (file descriptors; see _SHARING_SIGNATURES) -------------
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
        fd = ctypes.c_int(-1)
        drv.call("cnMemExportToShareableHandle", ctypes.byref(fd), handle.value,
                 CN_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0,
                 detail=f"{handle.value:#x}, POSIX_FILE_DESCRIPTOR")
        return fd.value

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
