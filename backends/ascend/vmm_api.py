"""vmm_api for Huawei Ascend NPUs through ctypes on ``libascendcl.so`` (CANN).

Why ctypes and not torch_npu: detection must stay cheap and work where ``import
torch_npu`` fails (it needs the CANN libraries), and the primitives must not depend on a
framework.  The library is opened lazily by ``vmm_probe``; ``$VMM_CORE_ASCENDCL_LIB``
overrides its path (the test-suite points it at an emulated library).

Every ctypes signature, struct, enum value and error code lives in this one module, next
to the vendor header it was read from.  The backend was verified only against the
emulated libascendcl in ``tests/emulated/ascendcl_emu.c``: no Ascend hardware was
available, so nothing here is hardware-verified.

Ascend-specific semantics the capabilities declare:

* ``aclrtMapMem`` maps one whole handle at offset 0 (``partial_map=False``).
* ``aclrtMapMem`` grants access itself (``aclrtMemMapNoAccess`` is the variant that does
  not), so ``needs_set_access=False`` and :meth:`vmm_set_access` only validates.
* ``aclrtReserveMemAddress`` takes ``alignment=0`` (reserved); addresses come back
  granularity-aligned, and a larger alignment is obtained by over-reserving.
* The device is per thread (``aclrtSetDevice``), so every hook selects it on the calling
  thread first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from dataclasses import dataclass

from vmm_core.capabilities import BackendCapabilities, Probe
from vmm_core.errors import (
    BackendError,
    BackendUnavailableError,
    MappingError,
    OutOfMemoryError,
)
from vmm_core.hookspecs import hookimpl

__all__ = [
    "ENV_LIBRARY",
    "DEFAULT_LIBRARY",
    "AclrtMemLocation",
    "AclrtPhysicalMemProp",
    "AscendBackend",
    "AscendHandle",
    "AclrtMemAccessDesc",
    "SHARING_SIGNATURES",
    "SIGNATURES",
    "backend",
]

ENV_LIBRARY = "VMM_CORE_ASCENDCL_LIB"
DEFAULT_LIBRARY = "libascendcl.so"

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
        "imported ones",
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


def _describe(code: int) -> str:
    name = ERROR_NAMES.get(code)
    return f"aclError {code}" + (f" ({name})" if name else "")


def error_for(call: str, code: int, detail: str = "") -> Exception:
    """The vmm_core exception for ``call`` returning ``code`` (one rule for every hook)."""
    where = f"{call}({detail})" if detail else call
    if code in OUT_OF_MEMORY_CODES:
        return OutOfMemoryError(f"{where} failed with {_describe(code)}: the NPU is out of "
                                f"memory; free device memory or ask for less")
    remedy = _REMEDIES.get((call, code)) or _GENERIC_REMEDIES.get(code) or \
        "see the CANN aclError reference for this code"
    cls = MappingError if call in MAPPING_CALLS else BackendError
    return cls(f"{where} failed with {_describe(code)}: {remedy}")


def _candidates() -> list[str]:
    """Where libascendcl may be: the override alone, else the loader path and CANN homes."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        return [override]
    found = [DEFAULT_LIBRARY]
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        home = os.environ.get(var)
        if home:
            found.append(os.path.join(home, "lib64", DEFAULT_LIBRARY))
    found.append("/usr/local/Ascend/ascend-toolkit/latest/lib64/" + DEFAULT_LIBRARY)
    return list(dict.fromkeys(found))


class _Acl:
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


@dataclass(eq=False)
class AscendHandle:
    """An ``aclrtDrvMemHandle`` (``ptr``) with the size and device it was created for."""

    ptr: int
    size: int
    device: int


class AscendBackend:
    """The vmm_api hooks on libascendcl.  Device indices are ACL device ids."""

    name = "ascend"

    def __init__(self) -> None:
        self._acl: _Acl | None = None
        self._requested: str | None = None  # the candidate list the library came from
        self._device_count = 0
        self._lock = threading.Lock()
        self._granularity: dict[int, int] = {}
        self._adapters: dict[int, object] = {}
        self._bases: dict[tuple[int, int], int] = {}  # aligned start -> reserved base
        self._maps: dict[tuple[int, int], int] = {}  # (device, address) -> mapped size

    # -- library ----------------------------------------------------------------------
    def _open(self) -> _Acl:
        """Open the library named by the current environment (again if it changed)."""
        wanted = "|".join(_candidates())
        with self._lock:
            if self._acl is not None and self._requested == wanted:
                return self._acl
            errors = []
            for path in _candidates():
                try:
                    lib = ctypes.CDLL(path)
                except OSError as exc:
                    errors.append(f"{path}: {exc}")
                    continue
                acl = _Acl(path, lib)
                self._acl, self._requested = acl, wanted
                self._granularity.clear()
                self._bases.clear()
                self._maps.clear()
                return acl
            raise BackendUnavailableError(
                f"{DEFAULT_LIBRARY} not found: install CANN and source set_env.sh, or set "
                f"{ENV_LIBRARY} to the library's path (tried {'; '.join(errors)})")

    def _acl_for(self, device) -> _Acl:
        """The library, with ``device`` current on this thread (ACL devices are per thread)."""
        acl = self._acl
        if acl is None:
            raise BackendUnavailableError(
                "the ascend backend was used before vmm_probe succeeded; select it with "
                "vmm_core.get_backend('ascend')")
        if not isinstance(device, int) or isinstance(device, bool) or not \
                0 <= device < self._device_count:
            raise BackendError(f"ascend: device {device!r} is not one of the "
                               f"{self._device_count} NPU(s) aclrtGetDeviceCount reports")
        # ask the runtime, not a cache: torch.npu.set_device may have changed it
        current = ctypes.c_int32(-1)
        if acl.aclrtGetDevice(ctypes.byref(current)) != ACL_SUCCESS or current.value != device:
            self._check("aclrtSetDevice", acl.aclrtSetDevice(device), f"{device}")
        return acl

    @staticmethod
    def _check(call: str, code: int, detail: str = "") -> None:
        if code != ACL_SUCCESS:
            raise error_for(call, code, detail)

    @staticmethod
    def _prop(device: int) -> AclrtPhysicalMemProp:
        prop = AclrtPhysicalMemProp()
        prop.handleType = ACL_MEM_HANDLE_TYPE_NONE
        prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED
        prop.memAttr = ACL_HBM_MEM_HUGE
        prop.location.id = device
        prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE
        prop.reserve = 0
        return prop

    @staticmethod
    def _check_size(call: str, size) -> None:
        # ctypes would wrap a negative size to a huge size_t: refuse it before the driver
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise MappingError(f"{call}: size {size!r} must be a positive int (a multiple of "
                               f"the allocation granularity)")

    # -- detection ----------------------------------------------------------------------
    @hookimpl
    def vmm_probe(self):
        try:
            acl = self._open()
            code = acl.aclInit(None)
            if code not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
                return Probe(False, f"aclInit failed with {_describe(code)} ({acl.path}): "
                                    f"check the CANN installation and driver")
            count = ctypes.c_uint32(0)
            code = acl.aclrtGetDeviceCount(ctypes.byref(count))
            if code != ACL_SUCCESS:
                return Probe(False, f"aclrtGetDeviceCount failed with {_describe(code)} "
                                    f"({acl.path}): is the NPU driver loaded?")
            if count.value == 0:
                return Probe(False, f"{acl.path} loaded but no NPU is visible: check "
                                    f"ASCEND_RT_VISIBLE_DEVICES and npu-smi")
            self._device_count = count.value
            return Probe(True, f"libascendcl at {acl.path}: {count.value} NPU(s)",
                         device_count=count.value, priority=100,
                         versions={"libascendcl": acl.path})
        except BackendUnavailableError as exc:
            return Probe(False, str(exc))
        except Exception as exc:  # the probe never raises
            return Probe(False, f"probing libascendcl failed: {type(exc).__name__}: {exc}")

    @hookimpl
    def vmm_capabilities(self, device):
        from .allocator_adapter import graph_pool_verdict

        granularity = self._query_granularity(device)
        graph_pool, why = graph_pool_verdict()
        return BackendCapabilities(
            granularity=granularity,
            partial_map=False,
            needs_set_access=False,
            set_access_spans_mappings=True,
            graph_pool=graph_pool,
            default_reserve_bytes=max(granularity, (1 << 36) // granularity * granularity),
            notes=f"aclrtMapMem maps whole handles and grants access itself; graph pools: "
                  f"{why}",
            shareable_handles="integer" if self._acl.sharing else None,
            peer_access=self._acl.sharing,  # import takes the importing device's id
        )

    def _query_granularity(self, device) -> int:
        cached = self._granularity.get(device)
        if cached is not None:
            return cached
        acl = self._acl_for(device)
        out = ctypes.c_size_t(0)
        prop = self._prop(device)
        self._check("aclrtMemGetAllocationGranularity",
                    acl.aclrtMemGetAllocationGranularity(
                        ctypes.byref(prop), ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
                        ctypes.byref(out)),
                    f"device={device}, ACL_HBM_MEM_HUGE, MINIMUM")
        g = out.value
        if g <= 0 or g & (g - 1):
            raise BackendError(f"aclrtMemGetAllocationGranularity returned {g}, not a power "
                               f"of two: the CANN runtime does not match this backend")
        self._granularity[device] = g
        return g

    # -- ranges --------------------------------------------------------------------------
    @hookimpl
    def vmm_reserve(self, device, size, alignment):
        self._check_size("aclrtReserveMemAddress", size)
        acl = self._acl_for(device)
        g = self._query_granularity(device)
        alignment = max(int(alignment or 0), g)
        if alignment % g:
            raise MappingError(f"aclrtReserveMemAddress: alignment {alignment} is not a "
                               f"multiple of the granularity {g}")
        base = self._reserve(acl, size)
        if base % alignment == 0:
            return base
        # ACL takes no alignment (reserved, must be 0): over-reserve and align inside
        self._check("aclrtReleaseMemAddress", acl.aclrtReleaseMemAddress(base), hex(base))
        base = self._reserve(acl, size + alignment)
        start = (base + alignment - 1) // alignment * alignment
        self._bases[(device, start)] = base
        return start

    def _reserve(self, acl: _Acl, size: int) -> int:
        ptr = ctypes.c_void_p()
        self._check("aclrtReserveMemAddress",
                    acl.aclrtReserveMemAddress(ctypes.byref(ptr), size, 0, None, 0),
                    f"size={size}, alignment=0, expectPtr=NULL, flags=0")
        return int(ptr.value or 0)

    @hookimpl
    def vmm_release_range(self, device, address, size):
        acl = self._acl_for(device)
        base = self._bases.get((device, address), address)
        self._check("aclrtReleaseMemAddress", acl.aclrtReleaseMemAddress(base), hex(base))
        self._bases.pop((device, address), None)

    # -- handles ---------------------------------------------------------------------------
    @hookimpl
    def vmm_create_handle(self, device, size):
        self._check_size("aclrtMallocPhysical", size)
        acl = self._acl_for(device)
        prop = self._prop(device)
        out = ctypes.c_void_p()
        self._check("aclrtMallocPhysical",
                    acl.aclrtMallocPhysical(ctypes.byref(out), size, ctypes.byref(prop), 0),
                    f"size={size}, device={device}, ACL_HBM_MEM_HUGE")
        return AscendHandle(int(out.value), size, device)

    @hookimpl
    def vmm_release_handle(self, device, handle):
        if not isinstance(handle, AscendHandle) or not handle.ptr:
            raise MappingError(f"aclrtFreePhysical: {handle!r} is not a live ascend handle")
        acl = self._acl_for(device)
        self._check("aclrtFreePhysical", acl.aclrtFreePhysical(handle.ptr), hex(handle.ptr))
        handle.ptr = 0

    # -- mapping -----------------------------------------------------------------------------
    @hookimpl
    def vmm_map(self, device, address, size, handle, offset):
        if not isinstance(handle, AscendHandle) or not handle.ptr:
            raise MappingError(f"aclrtMapMem: {handle!r} is not a live ascend handle")
        self._check_size("aclrtMapMem", size)
        if not isinstance(offset, int) or offset < 0:
            raise MappingError(f"aclrtMapMem: offset {offset!r} must be 0")
        acl = self._acl_for(device)
        # the driver enforces whole-handle/offset-0/alignment; its code names the violation
        self._check("aclrtMapMem", acl.aclrtMapMem(address, size, offset, handle.ptr, 0),
                    f"{address:#x}, size={size}, offset={offset}, handle size={handle.size}")
        self._maps[(device, address)] = size

    @hookimpl
    def vmm_set_access(self, device, address, size):
        # aclrtMapMem already made the range readable and writable; only check the request
        covered, cursor = 0, address
        while cursor < address + size:
            mapped = self._maps.get((device, cursor))
            if mapped is None:
                break
            covered += mapped
            cursor += mapped
        if covered != size:
            raise MappingError(f"vmm_set_access: [{address:#x}, +{size}) is not exactly a run "
                               f"of live aclrtMapMem mappings on device {device}")

    @hookimpl
    def vmm_unmap(self, device, address, size):
        acl = self._acl_for(device)
        self._check("aclrtUnmapMem", acl.aclrtUnmapMem(address), hex(address))
        self._maps.pop((device, address), None)

    # -- data movement ----------------------------------------------------------------------------
    @hookimpl
    def vmm_synchronize(self, device):
        acl = self._acl_for(device)
        self._check("aclrtSynchronizeDevice", acl.aclrtSynchronizeDevice(), f"device={device}")

    def _memcpy(self, device, dst: int, src: int, size: int, kind: int, label: str) -> None:
        acl = self._acl_for(device)
        self._check("aclrtMemcpy", acl.aclrtMemcpy(dst, size, src, size, kind),
                    f"dst={dst:#x}, destMax={size}, src={src:#x}, count={size}, {label}")

    @hookimpl
    def vmm_copy_to_host(self, device, address, host_address, size):
        self._memcpy(device, host_address, address, size, ACL_MEMCPY_DEVICE_TO_HOST,
                     "ACL_MEMCPY_DEVICE_TO_HOST")

    @hookimpl
    def vmm_copy_from_host(self, device, host_address, address, size):
        self._memcpy(device, address, host_address, size, ACL_MEMCPY_HOST_TO_DEVICE,
                     "ACL_MEMCPY_HOST_TO_DEVICE")

    @hookimpl
    def vmm_copy_device(self, device, src_address, dst_address, size):
        self._memcpy(device, dst_address, src_address, size, ACL_MEMCPY_DEVICE_TO_DEVICE,
                     "ACL_MEMCPY_DEVICE_TO_DEVICE")

    # -- sharing between processes (integers with a pid allow-list, see SHARING_SIGNATURES) ----
    def _sharing(self, device) -> _Acl:
        acl = self._acl_for(device)
        if not acl.sharing:
            raise BackendUnavailableError(
                f"{acl.path} lacks "
                f"{', '.join(n for n in SHARING_SIGNATURES if not hasattr(acl.lib, n))}: "
                f"this CANN cannot share physical memory between processes; upgrade CANN")
        return acl

    @hookimpl
    def vmm_create_shareable_handle(self, device, size):
        # acl_rt.h: any aclrtMallocPhysical handle can be exported (handleType stays NONE)
        return self.vmm_create_handle(device, size)

    @hookimpl
    def vmm_export_handle(self, device, handle, importers):
        if not isinstance(handle, AscendHandle) or not handle.ptr:
            raise MappingError(f"aclrtMemExportToShareableHandle: {handle!r} is not a live "
                               f"ascend handle")
        acl = self._sharing(device)
        out = ctypes.c_uint64(0)
        self._check("aclrtMemExportToShareableHandle",
                    acl.aclrtMemExportToShareableHandle(handle.ptr, ACL_MEM_HANDLE_TYPE_NONE,
                                                        ACL_RT_VMM_EXPORT_FLAG_DEFAULT,
                                                        ctypes.byref(out)),
                    f"{handle.ptr:#x}, ACL_MEM_HANDLE_TYPE_NONE, FLAG_DEFAULT")
        pids = [int(p) for p in importers if p is not None]
        if pids:  # pid validation is on: only these processes may import it
            array = (ctypes.c_int32 * len(pids))(*pids)
            self._check("aclrtMemSetPidToShareableHandle",
                        acl.aclrtMemSetPidToShareableHandle(out.value, array, len(pids)),
                        f"{out.value:#x}, pids={pids}")
        return out.value

    @hookimpl
    def vmm_process_id(self, device):
        acl = self._sharing(device)
        pid = ctypes.c_int32(0)
        self._check("aclrtDeviceGetBareTgid", acl.aclrtDeviceGetBareTgid(ctypes.byref(pid)))
        return pid.value

    @hookimpl
    def vmm_import_handle(self, device, shareable, size):
        self._check_size("aclrtMemImportFromShareableHandle", size)
        acl = self._sharing(device)
        out = ctypes.c_void_p()
        self._check("aclrtMemImportFromShareableHandle",
                    acl.aclrtMemImportFromShareableHandle(shareable, device, ctypes.byref(out)),
                    f"{shareable:#x}, deviceId={device}")
        return AscendHandle(int(out.value), size, device)

    @hookimpl
    def vmm_set_access_for(self, device, address, size, devices):
        acl = self._sharing(device)
        descs = (AclrtMemAccessDesc * len(devices))()
        for desc, d in zip(descs, devices):
            desc.flags = ACL_RT_MEM_ACCESS_FLAGS_READWRITE
            desc.location.id = d
            desc.location.type = ACL_MEM_LOCATION_TYPE_DEVICE
        self._check("aclrtMemSetAccess", acl.aclrtMemSetAccess(address, size, descs, len(devices)),
                    f"{address:#x}, {size}, READWRITE for devices {list(devices)}")

    # -- framework integration (torch_npu, imported only when used) ------------------------------
    @hookimpl
    def vmm_graph_ops(self, device):
        if importlib.util.find_spec("torch_npu") is None:
            return None
        from .graph_ops import AscendGraphOps

        return AscendGraphOps(device)

    @hookimpl
    def vmm_allocator_adapter(self, device):
        if importlib.util.find_spec("torch_npu") is None:
            return None
        with self._lock:  # one per device: it keeps pools alive when they must not be freed
            adapter = self._adapters.get(device)
            if adapter is None:
                from .allocator_adapter import AscendAllocatorAdapter

                adapter = self._adapters[device] = AscendAllocatorAdapter(device)
            return adapter


#: the plugin object registered under the entry point ``ascend``
backend = AscendBackend()
