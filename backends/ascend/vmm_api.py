"""vmm_api for Huawei Ascend NPUs through ctypes on ``libascendcl.so`` (CANN).

Why ctypes and not torch_npu: detection must stay cheap and work where ``import
torch_npu`` fails (it needs the CANN libraries), and the primitives must not depend on a
framework.  The library is opened lazily by ``vmm_probe``; ``$VMM_CORE_ASCEND_LIB``
overrides its path (the test-suite points it at an emulated library).

Every ctypes signature, struct, enum value and error code lives in :mod:`.acl_bindings`,
next to the vendor header it was read from; this module holds the hooks alone.  The
backend was verified only against the emulated libascendcl in
``tests/emulated/ascendcl_emu.c``: not run on Ascend hardware, so nothing here is
hardware-verified.

Ascend-specific semantics the capabilities declare:

* ``aclrtMapMem`` maps one whole handle at offset 0 (``partial_map=False``).
* ``aclrtMapMem`` grants access itself (``aclrtMemMapNoAccess`` is the variant that does
  not), so ``needs_set_access=False`` and :meth:`vmm_set_access` only validates.
* ``aclrtMemSetAccess``: virPtr and size "must be the same as aclrtMapMem's" (CANN runtime
  API, aclrtMemSetAccess, aclcppdevg_03_2044), so ``set_access_spans_mappings=False``.
* ``aclrtMapMem``, parameter ``handle`` (aclcppdevg_03_0116, CANN 8.5.0): a reservation the
  user partitions may not hold handles of two devices, nor aclrtMallocPhysical handles
  beside imported ones, at once -> ``mixed_handle_reservations=False``.
* Export and import "cannot be called in the same process. Only cross-process calling is
  supported" (aclrtMemImportFromShareableHandle, aclcppdevg_03_0121, CANN 8.0.0,
  "Restrictions") -> ``same_process_import=False``.
* ``aclrtFreePhysical`` of a mapped handle succeeds and frees at the last unmap (CANN 9.0.0,
  aclcppdevg_03_0113).  vmm_core refuses it anyway (:meth:`AscendBackend.vmm_release_handle`)
  so that ``physical_bytes`` never leaves out memory the driver still holds.
* Exporting one handle twice "returns an error" (aclrtMemExportToShareableHandleV2,
  parameter ``handle``): each handle is exported once and its value remembered.
* Memory of another device needs ``aclrtDeviceEnablePeerAccess`` (acl_rt.h line 3021;
  import page "Restrictions"): enabled once per device pair, before the first import.
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

from vmm_core.errors import BackendError, BackendUnavailableError, MappingError
from vmm_core.plugin import BackendCapabilities, Probe, hookimpl, library_env

from .acl_bindings import (
    ACL_ERROR_REPEAT_INITIALIZE,
    ACL_HBM_MEM_HUGE,
    ACL_MEM_ALLOCATION_TYPE_PINNED,
    ACL_MEM_HANDLE_TYPE_NONE,
    ACL_MEM_LOCATION_TYPE_DEVICE,
    ACL_MEMCPY_DEVICE_TO_DEVICE,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_RT_MEM_ACCESS_FLAGS_READWRITE,
    ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
    ACL_RT_VMM_EXPORT_FLAG_DEFAULT,
    ACL_SUCCESS,
    SHARING_SIGNATURES,
    AclLibrary,
    AclrtMemAccessDesc,
    AclrtPhysicalMemProp,
    describe,
    error_for,
)

__all__ = ["ENV_LIBRARY", "DEFAULT_LIBRARY", "AscendBackend", "AscendHandle", "backend"]

ENV_LIBRARY = library_env("ascend")  # VMM_CORE_ASCEND_LIB
DEFAULT_LIBRARY = "libascendcl.so"


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


@dataclass(eq=False)
class AscendHandle:
    """An ``aclrtDrvMemHandle`` (``ptr``) with the size and device it was created for."""

    ptr: int
    size: int
    device: int
    mapped: int = 0  # live aclrtMapMem mappings of it
    exported: int | None = None  # its shareableHandle: exported at most once


class AscendBackend:
    """The vmm_api hooks on libascendcl.  Device indices are ACL device ids."""

    name = "ascend"

    def __init__(self) -> None:
        self._acl: AclLibrary | None = None
        self._requested: str | None = None  # the candidate list the library came from
        self._device_count = 0
        self._lock = threading.Lock()
        self._granularity: dict[int, int] = {}
        self._bases: dict[tuple[int, int], int] = {}  # aligned start -> reserved base
        # (device, address) -> (mapped size, handle)
        self._maps: dict[tuple[int, int], tuple[int, AscendHandle]] = {}
        self._peers: set[tuple[int, int]] = set()  # (device, peer) with peer access enabled

    # -- library ----------------------------------------------------------------------
    def _open(self) -> AclLibrary:
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
                acl = AclLibrary(path, lib)
                self._acl, self._requested = acl, wanted
                self._granularity.clear()
                self._bases.clear()
                self._maps.clear()
                self._peers.clear()
                return acl
            raise BackendUnavailableError(
                f"{DEFAULT_LIBRARY} not found: install CANN and source set_env.sh, or set "
                f"{ENV_LIBRARY} to the library's path (tried {'; '.join(errors)})")

    def _acl_for(self, device) -> AclLibrary:
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
                return Probe(False, f"aclInit failed with {describe(code)} ({acl.path}): "
                                    f"check the CANN installation and driver")
            count = ctypes.c_uint32(0)
            code = acl.aclrtGetDeviceCount(ctypes.byref(count))
            if code != ACL_SUCCESS:
                return Probe(False, f"aclrtGetDeviceCount failed with {describe(code)} "
                                    f"({acl.path}): is the NPU driver loaded?")
            if count.value == 0:
                return Probe(False, f"{acl.path} loaded but no NPU is visible: check "
                                    f"ASCEND_RT_VISIBLE_DEVICES and npu-smi")
            self._device_count = count.value
            return Probe(True, f"libascendcl at {acl.path}: {count.value} NPU(s)",
                         device_count=count.value, priority=100, library=acl.path)
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
            set_access_spans_mappings=False,  # aclrtMemSetAccess: one aclrtMapMem range
            graph_pool=graph_pool,
            default_reserve_bytes=max(granularity, (1 << 36) // granularity * granularity),
            notes=f"aclrtMapMem maps whole handles and grants access itself; graph pools: "
                  f"{why}",
            shareable_handles="integer" if self._acl.sharing else None,
            peer_access=self._acl.sharing and self._acl.peer,  # aclrtDeviceEnablePeerAccess
            mixed_handle_reservations=False,  # aclrtMapMem, parameter handle
            same_process_import=False,  # aclrtMemImportFromShareableHandle, Restrictions
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

    def _reserve(self, acl: AclLibrary, size: int) -> int:
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
        if handle.mapped:
            # CANN (aclrtFreePhysical, aclcppdevg_03_0113, 9.0.0) would succeed and free at
            # the last aclrtUnmapMem; vmm_core refuses so that physical_bytes never drops
            # memory the driver still holds
            raise MappingError(f"aclrtFreePhysical: handle {handle.ptr:#x} still has "
                               f"{handle.mapped} mapping(s); unmap it everywhere first")
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
        with self._lock:
            self._maps[(device, address)] = (size, handle)
            handle.mapped += 1

    @hookimpl
    def vmm_set_access(self, device, address, size):
        # aclrtMapMem already made the range readable and writable; only check the request,
        # by the rule aclrtMemSetAccess has (aclcppdevg_03_2044: virPtr and size must be
        # those of one aclrtMapMem call)
        self._one_mapping("vmm_set_access", device, address, size)

    def _one_mapping(self, call: str, device, address, size) -> None:
        entry = self._maps.get((device, address))
        if entry is None or entry[0] != size:
            raise MappingError(f"{call}: [{address:#x}, +{size}) is not exactly one live "
                               f"aclrtMapMem mapping on device {device} (CANN requires "
                               f"virPtr and size of one map call)")

    @hookimpl
    def vmm_unmap(self, device, address, size):
        acl = self._acl_for(device)
        self._check("aclrtUnmapMem", acl.aclrtUnmapMem(address), hex(address))
        with self._lock:
            entry = self._maps.pop((device, address), None)
            if entry is not None:
                entry[1].mapped -= 1

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
    def _sharing(self, device) -> AclLibrary:
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
        if handle.exported is not None:
            # exporting a handle twice is an error in CANN (handle and shareableHandle are
            # one-to-one, aclrtMemExportToShareableHandleV2 "handle"): reuse the value and
            # only add the new importers to its allow-list
            out.value = handle.exported
        else:
            self._check("aclrtMemExportToShareableHandle",
                        acl.aclrtMemExportToShareableHandle(
                            handle.ptr, ACL_MEM_HANDLE_TYPE_NONE,
                            ACL_RT_VMM_EXPORT_FLAG_DEFAULT, ctypes.byref(out)),
                        f"{handle.ptr:#x}, ACL_MEM_HANDLE_TYPE_NONE, FLAG_DEFAULT")
            handle.exported = out.value
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
        self._enable_peers(acl, device)
        out = ctypes.c_void_p()
        self._check("aclrtMemImportFromShareableHandle",
                    acl.aclrtMemImportFromShareableHandle(shareable, device, ctypes.byref(out)),
                    f"{shareable:#x}, deviceId={device}")
        return AscendHandle(int(out.value), size, device)

    def _enable_peers(self, acl: AclLibrary, device: int) -> None:
        """Peer access from ``device`` to every device it can reach, once per pair.

        Cross-device sharing "needs aclrtDeviceEnablePeerAccess" (import page,
        "Restrictions"), and an integer shareable handle does not say which device
        exported it, so every reachable peer (aclrtDeviceCanAccessPeer) is enabled before
        the first import; pairs the hardware cannot link stay off and such an import
        fails with the driver's code.
        """
        if not acl.peer:
            return
        with self._lock:
            for peer in range(self._device_count):
                if peer == device or (device, peer) in self._peers:
                    continue
                can = ctypes.c_int32(0)
                self._check("aclrtDeviceCanAccessPeer",
                            acl.aclrtDeviceCanAccessPeer(ctypes.byref(can), device, peer),
                            f"device={device}, peer={peer}")
                if can.value:
                    self._check("aclrtDeviceEnablePeerAccess",
                                acl.aclrtDeviceEnablePeerAccess(peer, 0),
                                f"peerDeviceId={peer}, flags=0 (current device {device})")
                self._peers.add((device, peer))

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

    # -- the calling thread's device (ACL devices are per thread) ----------------
    @hookimpl
    def vmm_thread_device(self):
        acl = self._acl
        if acl is None:
            return (-1,)
        current = ctypes.c_int32(-1)
        if acl.aclrtGetDevice(ctypes.byref(current)) != ACL_SUCCESS:
            return (-1,)  # none set on this thread yet: nothing to restore
        return (current.value,)

    @hookimpl
    def vmm_set_thread_device(self, state):
        acl = self._acl
        if acl is None or state[0] < 0:
            return
        current = ctypes.c_int32(-1)
        if acl.aclrtGetDevice(ctypes.byref(current)) != ACL_SUCCESS or \
                current.value != state[0]:
            self._check("aclrtSetDevice", acl.aclrtSetDevice(state[0]), f"{state[0]}")

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
        from .allocator_adapter import AscendAllocatorAdapter

        # core keeps it, one per device, as the pools it keeps alive need
        return AscendAllocatorAdapter(device)


#: the plugin object registered under the entry point ``ascend``
backend = AscendBackend()
