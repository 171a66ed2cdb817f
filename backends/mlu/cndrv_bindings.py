"""Every ctypes declaration of libcndrv the MLU backend uses, in one place.

Signatures, struct layouts, enum values, CNresult codes and the rule that turns a CNresult
into a vmm_core exception live here, next to the header text they were read from (see
``vmm_api``'s docstring for the sources), so a header change is one edit and ``vmm_api.py``
holds the hooks alone.  Nothing here loads a library at import time; :class:`Driver`
opens one and applies the signatures.
"""

from __future__ import annotations

import ctypes

from vmm_core.errors import BackendError, MappingError, OutOfMemoryError

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
SIGNATURES = {
    "cnInit": [ctypes.c_uint],
    "cnGetLibVersion": [_P(ctypes.c_int), _P(ctypes.c_int), _P(ctypes.c_int)],
    "cnDeviceGetCount": [_P(ctypes.c_int)],
    "cnDeviceGet": [_P(CNdev), ctypes.c_int],
    "cnSharedContextAcquire": [_P(CNcontext), CNdev],
    "cnCtxSetCurrent": [CNcontext],
    "cnCtxGetCurrent": [_P(CNcontext)],
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
REQUIRED = tuple(n for n in SIGNATURES if n != "cnGetLibVersion")

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
SHARING_SIGNATURES = {
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
        missing = [n for n in REQUIRED if not hasattr(self.lib, n)]
        if missing:
            raise BackendError(
                f"{path} lacks {', '.join(missing)}: this libcndrv has no virtual memory "
                f"management; install CNToolkit/Neuware with cnMem* VMM support")
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = CNresult
        self.emulated = hasattr(self.lib, "emu_is_emulated")
        #: the library can export handles as file descriptors (every sharing symbol exists)
        self.sharing = all(hasattr(self.lib, n) for n in SHARING_SIGNATURES)
        if self.sharing:
            for name, argtypes in SHARING_SIGNATURES.items():
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
