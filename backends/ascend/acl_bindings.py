"""Every ctypes declaration of libascendcl the Ascend backend uses, in one place.

Signatures, struct layouts, enum values, error codes and the rule that turns an aclError
into a vmm_core exception live here, next to the vendor header they were read from, so a
header change is one edit and ``vmm_api.py`` holds the hooks alone.  Nothing here loads a
library at import time; :class:`AclLibrary` applies the signatures to one opened library.
"""

from __future__ import annotations

import ctypes

from vmm_core.errors import (
    BackendError,
    BackendUnavailableError,
    MappingError,
    OutOfMemoryError,
)

# ----------------------------------------------------------------------------------------
# Vendor facts.  Read (not copied) from hicann/runtime, commit 681ef7610df1 (CANN runtime,
# acl_rt.h "Current version is 1.17.0"); the values used here are identical in the 1.15.0
# header of the same repository:
#   include/external/acl/acl_rt.h                     enums, structs, signatures
#   include/external/acl/acl_base_rt.h                typedef int aclError; ACL_ERROR_*
#   include/external/acl/error_codes/rt_error_codes.h ACL_ERROR_RT_*
# ----------------------------------------------------------------------------------------

# enum aclrtMemHandleType
ACL_MEM_HANDLE_TYPE_NONE = 0
# enum aclrtMemAllocationType
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
# enum aclrtMemAttr: ACL_DDR_MEM=0, ACL_HBM_MEM=1, ACL_DDR_MEM_HUGE=2, ACL_DDR_MEM_NORMAL=3,
# ACL_HBM_MEM_HUGE=4 (2 MiB pages; what torch_npu's own VMM code passes)
ACL_HBM_MEM_HUGE = 4
# enum aclrtMemLocationType: HOST=0, DEVICE=1, UNREGISTERED=2
ACL_MEM_LOCATION_TYPE_DEVICE = 1
# enum aclrtMemGranularityOptions
ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0
ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
# enum aclrtMemcpyKind
ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3

# aclError codes (acl_base_rt.h, rt_error_codes.h)
ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_BAD_ALLOC = 200000
ACL_ERROR_STORAGE_OVER_LIMIT = 300000
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_ADDR_UNALIGNED = 107008
ACL_ERROR_RT_INVALID_HANDLE = 107017
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001  # "only used by out of memory"
ACL_ERROR_RT_NO_DEVICE = 207004
ACL_ERROR_RT_RESOURCE_ALLOC_FAIL = 207005
ACL_ERROR_RT_DEVICE_OOM = 207018

ERROR_NAMES = {
    ACL_ERROR_INVALID_PARAM: "ACL_ERROR_INVALID_PARAM",
    ACL_ERROR_UNINITIALIZE: "ACL_ERROR_UNINITIALIZE",
    ACL_ERROR_REPEAT_INITIALIZE: "ACL_ERROR_REPEAT_INITIALIZE",
    ACL_ERROR_BAD_ALLOC: "ACL_ERROR_BAD_ALLOC",
    ACL_ERROR_STORAGE_OVER_LIMIT: "ACL_ERROR_STORAGE_OVER_LIMIT",
    ACL_ERROR_RT_PARAM_INVALID: "ACL_ERROR_RT_PARAM_INVALID",
    ACL_ERROR_RT_INVALID_DEVICEID: "ACL_ERROR_RT_INVALID_DEVICEID",
    ACL_ERROR_RT_CONTEXT_NULL: "ACL_ERROR_RT_CONTEXT_NULL",
    ACL_ERROR_RT_ADDR_UNALIGNED: "ACL_ERROR_RT_ADDR_UNALIGNED",
    ACL_ERROR_RT_INVALID_HANDLE: "ACL_ERROR_RT_INVALID_HANDLE",
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    ACL_ERROR_RT_MEMORY_ALLOCATION: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    ACL_ERROR_RT_NO_DEVICE: "ACL_ERROR_RT_NO_DEVICE",
    ACL_ERROR_RT_RESOURCE_ALLOC_FAIL: "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL",
    ACL_ERROR_RT_DEVICE_OOM: "ACL_ERROR_RT_DEVICE_OOM",
}

#: codes that mean "not enough memory": they become OutOfMemoryError
OUT_OF_MEMORY_CODES = frozenset({
    ACL_ERROR_BAD_ALLOC,
    ACL_ERROR_STORAGE_OVER_LIMIT,
    ACL_ERROR_RT_MEMORY_ALLOCATION,
    ACL_ERROR_RT_DEVICE_OOM,
})

#: calls whose other failures are misuse of reservations/mappings: they become MappingError
MAPPING_CALLS = frozenset({
    "aclrtMemExportToShareableHandle",
    "aclrtMemImportFromShareableHandle",
    "aclrtMemSetAccess",
    "aclrtReserveMemAddress",
    "aclrtReleaseMemAddress",
    "aclrtMapMem",
    "aclrtUnmapMem",
    "aclrtFreePhysical",
})


class AclrtMemLocation(ctypes.Structure):
    """``aclrtMemLocation``: ``{uint32_t id; aclrtMemLocationType type;}`` (enum = int)."""

    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class AclrtPhysicalMemProp(ctypes.Structure):
    """``aclrtPhysicalMemProp``: three enums, a location, ``uint64_t reserve`` (32 bytes)."""

    _fields_ = [
        ("handleType", ctypes.c_int),
        ("allocationType", ctypes.c_int),
        ("memAttr", ctypes.c_int),
        ("location", AclrtMemLocation),
        ("reserve", ctypes.c_uint64),
    ]


_P = ctypes.POINTER
_err = ctypes.c_int  # typedef int aclError

#: every libascendcl function this backend calls: name -> (restype, argtypes)
SIGNATURES = {
    "aclInit": (_err, [ctypes.c_char_p]),
    "aclrtGetDeviceCount": (_err, [_P(ctypes.c_uint32)]),
    "aclrtSetDevice": (_err, [ctypes.c_int32]),
    "aclrtGetDevice": (_err, [ctypes.POINTER(ctypes.c_int32)]),
    "aclrtSynchronizeDevice": (_err, []),
    # (void** virPtr, size_t size, size_t alignment, void* expectPtr, uint64_t flags)
    "aclrtReserveMemAddress": (_err, [_P(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t,
                                      ctypes.c_void_p, ctypes.c_uint64]),
    "aclrtReleaseMemAddress": (_err, [ctypes.c_void_p]),
    # (aclrtDrvMemHandle* handle, size_t size, const aclrtPhysicalMemProp* prop, uint64_t flags)
    "aclrtMallocPhysical": (_err, [_P(ctypes.c_void_p), ctypes.c_size_t,
                                   _P(AclrtPhysicalMemProp), ctypes.c_uint64]),
    "aclrtFreePhysical": (_err, [ctypes.c_void_p]),
    # (void* virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags)
    "aclrtMapMem": (_err, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_uint64]),
    "aclrtUnmapMem": (_err, [ctypes.c_void_p]),
    # (aclrtPhysicalMemProp* prop, aclrtMemGranularityOptions option, size_t* granularity)
    "aclrtMemGetAllocationGranularity": (_err, [_P(AclrtPhysicalMemProp), ctypes.c_int,
                                                _P(ctypes.c_size_t)]),
    # (void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind)
    "aclrtMemcpy": (_err, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_int]),
}

# ----------------------------------------------------------------------------------------
# Sharing physical memory between processes (optional: bound only when the library has
# these symbols).  Read from the same acl_rt.h (hicann/runtime 681ef7610df1):
#   aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle, aclrtMemHandleType
#       handleType /*"reserved param, must be MEM_HANDLE_TYPE_NONE"*/, uint64_t flags,
#       uint64_t* shareableHandle)
#   aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId,
#       aclrtDrvMemHandle* handle)
#   aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t* pid, size_t pidNum)
#       "only the process configured in the whitelist can use this shareableHandle"
#   aclrtDeviceGetBareTgid(int32_t* pid)  "the pid for the current process on the
#       physical device": the id the allow-list takes (the header's sample
#       example/1_basic_features/memory/7_physical_memory_sharing_withpid does exactly
#       export -> SetPid(importer's BareTgid) -> import(deviceId) -> aclrtMapMem ->
#       aclrtMemSetAccess, and frees the imported handle with aclrtFreePhysical)
#   aclrtMemSetAccess(void* virPtr, size_t size, aclrtMemAccessDesc* desc, size_t count)
#   typedef struct { aclrtMemAccessFlags flags; aclrtMemLocation location;
#                    uint8_t rsv[12]; } aclrtMemAccessDesc;
#   ACL_RT_VMM_EXPORT_FLAG_DEFAULT 0x0 (pid validation on), ACL_RT_MEM_ACCESS_FLAGS_READWRITE
#   0x3.  The runtime maps the driver's DRV_ERROR_OPER_NOT_PERMITTED to
#   ACL_ERROR_RT_NO_PERMISSION 207006 (src/runtime/core/src/common/errcode_manage.cc).
# ----------------------------------------------------------------------------------------
ACL_RT_VMM_EXPORT_FLAG_DEFAULT = 0x0
ACL_RT_MEM_ACCESS_FLAGS_READWRITE = 0x3
ACL_ERROR_RT_NO_PERMISSION = 207006
ERROR_NAMES[ACL_ERROR_RT_NO_PERMISSION] = "ACL_ERROR_RT_NO_PERMISSION"


class AclrtMemAccessDesc(ctypes.Structure):
    """``aclrtMemAccessDesc``: ``{aclrtMemAccessFlags flags; aclrtMemLocation location;
    uint8_t rsv[12];}`` (24 bytes)."""

    _fields_ = [("flags", ctypes.c_int), ("location", AclrtMemLocation),
                ("rsv", ctypes.c_uint8 * 12)]


#: the sharing functions: name -> (restype, argtypes); all of them or none are used
SHARING_SIGNATURES = {
    "aclrtMemExportToShareableHandle": (_err, [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64,
                                               _P(ctypes.c_uint64)]),
    "aclrtMemImportFromShareableHandle": (_err, [ctypes.c_uint64, ctypes.c_int32,
                                                 _P(ctypes.c_void_p)]),
    "aclrtMemSetPidToShareableHandle": (_err, [ctypes.c_uint64, _P(ctypes.c_int32),
                                               ctypes.c_size_t]),
    "aclrtDeviceGetBareTgid": (_err, [_P(ctypes.c_int32)]),
    "aclrtMemSetAccess": (_err, [ctypes.c_void_p, ctypes.c_size_t, _P(AclrtMemAccessDesc),
                                 ctypes.c_size_t]),
}

# ----------------------------------------------------------------------------------------
# Peer access between devices (optional: bound only when the library has both).
#   acl_rt.h line 3021: aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags)
#   "flags: reserved, must be 0"; peerDeviceId "cannot be the current device" (CANN runtime
#   API, aclrtDeviceEnablePeerAccess, aclcppdevg_03_0052).  aclrtDeviceCanAccessPeer(
#   int32_t* canAccessPeer, int32_t deviceId, int32_t peerDeviceId) is the documented
#   pre-check.  Cross-device sharing of physical memory "needs aclrtDeviceEnablePeerAccess"
#   (aclrtMemImportFromShareableHandle, aclcppdevg_03_0121, "Restrictions").
# ----------------------------------------------------------------------------------------
PEER_SIGNATURES = {
    "aclrtDeviceCanAccessPeer": (_err, [_P(ctypes.c_int32), ctypes.c_int32, ctypes.c_int32]),
    "aclrtDeviceEnablePeerAccess": (_err, [ctypes.c_int32, ctypes.c_uint32]),
}

#: what each misuse code means for the call that returned it, and what to do about it
_REMEDIES = {
    ("aclrtMapMem", ACL_ERROR_RT_PARAM_INVALID):
        "a map must cover one whole handle (size == the handle's size) at offset 0, inside "
        "one reservation of the same device, without overlapping a live mapping",
    ("aclrtMapMem", ACL_ERROR_RT_ADDR_UNALIGNED):
        "align the address to the allocation granularity",
    ("aclrtUnmapMem", ACL_ERROR_RT_PARAM_INVALID):
        "pass the start address of a live mapping",
    ("aclrtFreePhysical", ACL_ERROR_RT_PARAM_INVALID):
        "unmap every mapping of the handle (aclrtUnmapMem) before freeing it",
    ("aclrtReleaseMemAddress", ACL_ERROR_RT_PARAM_INVALID):
        "pass the start of a reservation and unmap everything mapped in it first",
    ("aclrtReserveMemAddress", ACL_ERROR_RT_PARAM_INVALID):
        "reserve a positive multiple of the allocation granularity",
    ("aclrtMemImportFromShareableHandle", ACL_ERROR_RT_NO_PERMISSION):
        "this process is not on the handle's allow-list: the exporter must pass its "
        "aclrtDeviceGetBareTgid to aclrtMemSetPidToShareableHandle",
    ("aclrtMemExportToShareableHandle", ACL_ERROR_RT_PARAM_INVALID):
        "only handles this process made with aclrtMallocPhysical can be exported, not "
        "imported ones, and each handle only once (handle and shareableHandle are "
        "one-to-one in a process)",
    ("aclrtMemImportFromShareableHandle", ACL_ERROR_RT_FEATURE_NOT_SUPPORT):
        "import only in another process than the exporter's (CANN does not support both "
        "in one process), and enable peer access (aclrtDeviceEnablePeerAccess) from the "
        "importing device to the exporter's device first",
    ("aclrtMemImportFromShareableHandle", ACL_ERROR_RT_PARAM_INVALID):
        "this process already imported this shareable handle and still holds that import "
        "(handle and shareableHandle are one-to-one in a process): use the handle the first "
        "import returned, or release it before importing again",
    ("aclrtMemImportFromShareableHandle", ACL_ERROR_RT_INVALID_HANDLE):
        "no exported handle has this value any more (its exporter freed it or exited)",
}
_GENERIC_REMEDIES = {
    ACL_ERROR_INVALID_PARAM: "an argument was rejected by ACL's parameter checks",
    ACL_ERROR_UNINITIALIZE: "aclInit was not called; vmm_probe must run first",
    ACL_ERROR_RT_CONTEXT_NULL: "no device is set on this thread (aclrtSetDevice)",
    ACL_ERROR_RT_INVALID_DEVICEID: "use a device index below aclrtGetDeviceCount",
    ACL_ERROR_RT_INVALID_HANDLE: "the handle was already freed or never came from "
                                 "aclrtMallocPhysical",
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT: "this CANN/driver does not support the request",
}


def describe(code: int) -> str:
    name = ERROR_NAMES.get(code)
    return f"aclError {code}" + (f" ({name})" if name else "")


def error_for(call: str, code: int, detail: str = "") -> Exception:
    """The vmm_core exception for ``call`` returning ``code`` (one rule for every hook)."""
    where = f"{call}({detail})" if detail else call
    if code in OUT_OF_MEMORY_CODES:
        return OutOfMemoryError(f"{where} failed with {describe(code)}: the NPU is out of "
                                f"memory; free device memory or ask for less")
    remedy = _REMEDIES.get((call, code)) or _GENERIC_REMEDIES.get(code) or \
        "see the CANN aclError reference for this code"
    cls = MappingError if call in MAPPING_CALLS else BackendError
    return cls(f"{where} failed with {describe(code)}: {remedy}")


class AclLibrary:
    """One opened libascendcl with every signature from :data:`SIGNATURES` applied."""

    def __init__(self, path: str, lib: ctypes.CDLL) -> None:
        self.path = path
        self.lib = lib
        missing = [n for n in SIGNATURES if not hasattr(lib, n)]
        if missing:
            raise BackendUnavailableError(
                f"{path} lacks {', '.join(missing)}: this CANN has no virtual memory API; "
                f"install a CANN release that provides aclrtReserveMemAddress/aclrtMapMem")
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
        #: the library can share handles between processes (every sharing symbol exists)
        self.sharing = all(hasattr(lib, n) for n in SHARING_SIGNATURES)
        if self.sharing:
            for name, (restype, argtypes) in SHARING_SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
                setattr(self, name, fn)
        #: the library can enable peer access between devices (both peer symbols exist)
        self.peer = all(hasattr(lib, n) for n in PEER_SIGNATURES)
        if self.peer:
            for name, (restype, argtypes) in PEER_SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
                setattr(self, name, fn)
