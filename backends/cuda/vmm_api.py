"""vmm_api on the CUDA driver's virtual memory management (cuMem*), via cuda-bindings.

Detection loads ``libcuda.so.1`` with ctypes (cuInit, cuDeviceGetCount) and checks that
``cuda.bindings`` is installed, without importing torch or the bindings.  Every
primitive makes the device's primary context current on the calling thread first,
because the caching allocator may call us from a thread that never touched CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import threading

from vmm_core.errors import BackendError, MappingError, OutOfMemoryError
from vmm_core.plugin import (
    BackendCapabilities,
    CopyQueue,
    Probe,
    hookimpl,
    installed_version,
    raw_tensor,
    version_tuple,
)

__all__ = ["CudaBackend", "backend"]

_MIN_TORCH = (2, 8)


class _PinnedBuffer:
    """Page-locked host memory from cuMemHostAlloc, freed when dropped.

    Portable, so it counts as pinned for every context, not only the device's."""

    def __init__(self, backend: "CudaBackend", device: int, size: int) -> None:
        portable = getattr(backend._drv(), "CU_MEMHOSTALLOC_PORTABLE", 0x01)
        ptr = backend._run(device, f"cuMemHostAlloc({size}, PORTABLE)", "cuMemHostAlloc",
                           size, portable)
        self._backend, self._device = backend, device
        self.address = int(ptr)
        self.size = size

    def __del__(self) -> None:
        try:  # may run on a thread with no current context: make one current
            self._backend._ctx(self._device)
            self._backend._drv().cuMemFreeHost(self.address)
        except Exception:
            pass  # interpreter shutdown: the process is leaving anyway


class _CudaCopyQueue(CopyQueue):
    """A non-blocking stream for offload copies, and a free list of events as markers.

    The events block (CU_EVENT_BLOCKING_SYNC): the waiting thread sleeps instead of
    spinning on a core the host copy threads need.  cuda-bindings releases the GIL
    around every driver call, so a wait lets those threads run."""

    def __init__(self, backend: "CudaBackend", device: int) -> None:
        drv = backend._drv()
        self._backend, self._device = backend, device
        self._stream = backend._run(device, "cuStreamCreate(NON_BLOCKING)", "cuStreamCreate",
                                    drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self._flags = (drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC
                       | drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._free: list = []
        self._events: list = []  # every event made, destroyed by close()

    def to_host(self, address, host_address, size):
        self._backend._run(self._device, f"cuMemcpyDtoHAsync({address:#x}, {size})",
                           "cuMemcpyDtoHAsync", host_address, address, size, self._stream)

    def from_host(self, host_address, address, size):
        self._backend._run(self._device, f"cuMemcpyHtoDAsync({address:#x}, {size})",
                           "cuMemcpyHtoDAsync", address, host_address, size, self._stream)

    def record(self):
        if self._free:
            event = self._free.pop()
        else:
            event = self._backend._run(self._device, "cuEventCreate", "cuEventCreate",
                                       self._flags)
            self._events.append(event)
        self._backend._run(self._device, "cuEventRecord", "cuEventRecord", event, self._stream)
        return event

    def wait(self, marker):
        self._backend._run(self._device, "cuEventSynchronize (offload copy)",
                           "cuEventSynchronize", marker)
        self._free.append(marker)

    def synchronize(self):
        self._backend._run(self._device, "cuStreamSynchronize (offload copies)",
                           "cuStreamSynchronize", self._stream)
        self._free = list(self._events)

    def close(self):
        stream, self._stream = self._stream, None
        if stream is None:
            return
        run = self._backend._run
        try:
            run(self._device, "cuStreamSynchronize", "cuStreamSynchronize", stream)
        except Exception:
            pass  # a failed copy was already reported; free what we own regardless
        for event in self._events:
            try:
                run(self._device, "cuEventDestroy", "cuEventDestroy", event)
            except Exception:
                pass
        self._events, self._free = [], []
        try:
            run(self._device, "cuStreamDestroy", "cuStreamDestroy", stream)
        except Exception:
            pass


def _check(driver, err, call: str) -> None:
    if err == driver.CUresult.CUDA_SUCCESS:
        return
    _, name = driver.cuGetErrorName(err)
    name = name.decode() if isinstance(name, bytes) else str(err)
    if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        raise OutOfMemoryError(f"{call} failed: {name}; free device memory (or sleep "
                               f"tagged memory) and retry")
    if err in (driver.CUresult.CUDA_ERROR_INVALID_VALUE,
               driver.CUresult.CUDA_ERROR_INVALID_HANDLE,
               driver.CUresult.CUDA_ERROR_INVALID_ADDRESS_SPACE,
               driver.CUresult.CUDA_ERROR_NOT_MAPPED,
               driver.CUresult.CUDA_ERROR_NOT_SUPPORTED):
        raise MappingError(f"{call} failed: {name}")
    raise BackendError(f"{call} failed: {name}")


class CudaBackend:
    name = "cuda"

    def __init__(self) -> None:
        self._driver = None
        self._contexts: dict[int, object] = {}
        self._lock = threading.Lock()
        self._granularity: dict[int, int] = {}
        self._handle_sizes: dict[int, int] = {}

    # -- lazy driver -----------------------------------------------------------
    # (a method, not a property: pluggy inspects every attribute at registration)
    def _drv(self):
        if self._driver is None:
            from cuda.bindings import driver

            (err,) = driver.cuInit(0)
            _check(driver, err, "cuInit(0)")
            self._driver = driver
        return self._driver

    def _ctx(self, device: int) -> None:
        """Make the primary context of ``device`` current on this thread."""
        drv = self._drv()
        ctx = self._contexts.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(device)
                if ctx is None:
                    err, dev = drv.cuDeviceGet(device)
                    _check(drv, err, f"cuDeviceGet({device})")
                    err, ctx = drv.cuDevicePrimaryCtxRetain(dev)
                    _check(drv, err, f"cuDevicePrimaryCtxRetain({device})")
                    self._contexts[device] = ctx
        err, cur = drv.cuCtxGetCurrent()
        if err != drv.CUresult.CUDA_SUCCESS or int(cur) != int(ctx):
            (err,) = drv.cuCtxSetCurrent(ctx)
            _check(drv, err, f"cuCtxSetCurrent(primary context of device {device})")

    def _run(self, device: int, what: str, call: str, *args):
        """Run driver function ``call`` with ``device``'s primary context current.

        Raises the vmm_core error for a failure (``what`` names the call and its
        arguments in the message); returns the call's value, if it has one.
        """
        self._ctx(device)
        drv = self._drv()
        err, *value = getattr(drv, call)(*args)
        _check(drv, err, what)
        return value[0] if value else None

    def _prop(self, device: int):
        drv = self._drv()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        return prop

    # -- detection ---------------------------------------------------------------
    @hookimpl
    def vmm_probe(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return Probe(False, "libcuda.so.1 not found: no NVIDIA driver on this machine")
        if lib.cuInit(0) != 0:
            return Probe(False, "cuInit failed: the NVIDIA driver sees no usable GPU")
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
            return Probe(False, "cuDeviceGetCount reports no CUDA device")
        if importlib.util.find_spec("cuda.bindings") is None:
            return Probe(False, "NVIDIA driver found but cuda-bindings is not installed: "
                                "pip install 'vmm_core[cuda]'")
        versions = {}
        for dist in ("cuda-bindings", "torch"):
            versions[dist] = installed_version(dist) or "not installed"
        drv_version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(drv_version)) == 0:
            v = drv_version.value
            versions["driver API"] = f"{v // 1000}.{v % 1000 // 10}"
        return Probe(True, f"{count.value} CUDA device(s) via libcuda.so.1",
                     device_count=count.value, priority=100, versions=versions,
                     library="libcuda.so.1")

    @hookimpl
    def vmm_capabilities(self, device):
        drv = self._drv()
        gran = self._run(device, "cuMemGetAllocationGranularity",
                         "cuMemGetAllocationGranularity", self._prop(device),
                         drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self._granularity[device] = int(gran)
        dev = self._run(device, f"cuDeviceGet({device})", "cuDeviceGet", device)
        total = self._run(device, "cuDeviceTotalMem", "cuDeviceTotalMem", dev)
        torch_ok, note = _torch_pool_support()
        return BackendCapabilities(
            granularity=int(gran),
            partial_map=False,
            needs_set_access=True,
            set_access_spans_mappings=True,
            graph_pool=torch_ok,
            default_reserve_bytes=(int(total) + int(gran) - 1) // int(gran) * int(gran),
            notes=note,
            async_copies=True,  # cuMemcpy*Async on a stream of its own (_CudaCopyQueue)
            shareable_handles=self._shareable_kind(device),
            peer_access=True,  # checked per pair (cuDeviceCanAccessPeer) at import
        )

    # -- ranges ---------------------------------------------------------------------
    @hookimpl
    def vmm_reserve(self, device, size, alignment):
        self._check_size("cuMemAddressReserve", size, device)
        return int(self._run(device, f"cuMemAddressReserve({size}, align={alignment})",
                             "cuMemAddressReserve", size, alignment or 0, 0, 0))

    @hookimpl
    def vmm_release_range(self, device, address, size):
        self._run(device, f"cuMemAddressFree({address:#x}, {size})", "cuMemAddressFree",
                  address, size)

    # -- handles ----------------------------------------------------------------------
    @hookimpl
    def vmm_create_handle(self, device, size):
        self._check_size("cuMemCreate", size, device)
        handle = self._run(device, f"cuMemCreate({size})", "cuMemCreate", size,
                           self._prop(device), 0)
        self._handle_sizes[int(handle)] = size
        return handle

    @hookimpl
    def vmm_release_handle(self, device, handle):
        self._run(device, "cuMemRelease", "cuMemRelease", handle)
        self._handle_sizes.pop(int(handle), None)

    # -- mapping --------------------------------------------------------------------------
    @hookimpl
    def vmm_map(self, device, address, size, handle, offset):
        g = self._granularity.get(device)
        whole = self._handle_sizes.get(int(handle))
        if offset != 0 or (whole is not None and size != whole):
            # measured on an H200 (driver 580): cuMemMap with offset != 0 returns
            # CUDA_ERROR_NOT_SUPPORTED, so we declare partial_map=False and say it first
            raise MappingError(f"cuMemMap: size {size} / offset {offset}: this driver maps "
                               f"whole handles only (size {whole}, offset 0)")
        if g and address % g:
            raise MappingError(f"cuMemMap: address {address:#x} / offset {offset} is not "
                               f"aligned to the granularity {g}")
        self._run(device, f"cuMemMap({address:#x}, {size}, offset={offset})", "cuMemMap",
                  address, size, offset, handle, 0)

    @hookimpl
    def vmm_set_access(self, device, address, size):
        drv = self._drv()
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._run(device, f"cuMemSetAccess({address:#x}, {size})", "cuMemSetAccess",
                  address, size, [desc], 1)

    @hookimpl
    def vmm_unmap(self, device, address, size):
        self._run(device, f"cuMemUnmap({address:#x}, {size})", "cuMemUnmap", address, size)

    # -- data movement ------------------------------------------------------------------------
    @hookimpl
    def vmm_synchronize(self, device):
        self._run(device, "cuCtxSynchronize", "cuCtxSynchronize")

    @hookimpl
    def vmm_copy_to_host(self, device, address, host_address, size):
        self._run(device, f"cuMemcpyDtoH({size})", "cuMemcpyDtoH", host_address, address, size)

    @hookimpl
    def vmm_copy_from_host(self, device, host_address, address, size):
        self._run(device, f"cuMemcpyHtoD({size})", "cuMemcpyHtoD", address, host_address, size)

    @hookimpl
    def vmm_copy_device(self, device, src_address, dst_address, size):
        self._run(device, f"cuMemcpyDtoD({size})", "cuMemcpyDtoD", dst_address, src_address,
                  size)

    @hookimpl
    def vmm_host_buffer(self, device, size, pinned):
        if not pinned:
            return None
        return _PinnedBuffer(self, device, size)

    # -- queued copies and fills ---------------------------------------------------------------
    @hookimpl
    def vmm_copy_queue(self, device):
        return _CudaCopyQueue(self, device)

    @hookimpl
    def vmm_memset(self, device, address, value, size):
        self._run(device, f"cuMemsetD8({address:#x}, {value}, {size})", "cuMemsetD8",
                  address, value, size)
        self._run(device, "cuCtxSynchronize", "cuCtxSynchronize")

    # -- framework integration -------------------------------------------------------------------
    @hookimpl
    def vmm_graph_ops(self, device):
        from .graph_ops import CudaGraphOps

        return CudaGraphOps(device)

    @hookimpl
    def vmm_allocator_adapter(self, device):
        from .allocator_adapter import CudaAllocatorAdapter

        return CudaAllocatorAdapter(device)  # core keeps it: asked once per device

    # -- sharing between processes and devices ----------------------------------------------
    # Checked on two H200s with cuda-bindings 13.3.1 (ARCHITECTURE.md section 4): the
    # POSIX-fd attribute and cuDeviceCanAccessPeer were 1, and a handle exported as an fd,
    # passed over a Unix socket and imported on the other GPU was read by a torch kernel.
    def _shareable_kind(self, device: int) -> str | None:
        drv = self._drv()
        dev = self._run(device, f"cuDeviceGet({device})", "cuDeviceGet", device)
        attr = getattr(drv.CUdevice_attribute,
                       "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
        supported = self._run(device, "cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
                              "_SUPPORTED)", "cuDeviceGetAttribute", attr, dev)
        return "fd" if int(supported) else None

    def _fd_type(self):
        return self._drv().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    @hookimpl
    def vmm_create_shareable_handle(self, device, size):
        self._check_size("cuMemCreate", size, device)
        prop = self._prop(device)
        prop.requestedHandleTypes = self._fd_type()
        handle = self._run(device, f"cuMemCreate({size}, requestedHandleTypes=POSIX_FD)",
                           "cuMemCreate", size, prop, 0)
        self._handle_sizes[int(handle)] = size
        return handle

    @hookimpl
    def vmm_export_handle(self, device, handle, importers):
        fd = self._run(device, "cuMemExportToShareableHandle(POSIX_FD)",
                       "cuMemExportToShareableHandle", handle, self._fd_type(), 0)
        return int(fd)

    @hookimpl
    def vmm_import_handle(self, device, shareable, size):
        drv = self._drv()
        handle = self._run(device, f"cuMemImportFromShareableHandle(fd={shareable})",
                           "cuMemImportFromShareableHandle", shareable, self._fd_type())
        try:
            prop = self._run(device, "cuMemGetAllocationPropertiesFromHandle",
                             "cuMemGetAllocationPropertiesFromHandle", handle)
            owner = int(prop.location.id)
            if owner != device:
                this = self._run(device, f"cuDeviceGet({device})", "cuDeviceGet", device)
                peer = self._run(device, f"cuDeviceGet({owner})", "cuDeviceGet", owner)
                can = self._run(device, f"cuDeviceCanAccessPeer({device}, {owner})",
                                "cuDeviceCanAccessPeer", this, peer)
                if not int(can):
                    raise MappingError(
                        f"GPU {device} cannot access memory of GPU {owner} "
                        f"(cuDeviceCanAccessPeer = 0): put the ranks on GPUs with peer "
                        f"access (NVLink or PCIe P2P), or use location='host'")
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        self._handle_sizes[int(handle)] = size
        return handle

    @hookimpl
    def vmm_set_access_for(self, device, address, size, devices):
        drv = self._drv()
        descs = []
        for d in devices:
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = d
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(desc)
        self._run(device, f"cuMemSetAccess({address:#x}, {size}, devices={list(devices)})",
                  "cuMemSetAccess", address, size, descs, len(descs))

    @contextlib.contextmanager
    def _relaxed_capture_mode(self):
        """This thread in CU_STREAM_CAPTURE_MODE_RELAXED for the block.

        Offload registers kept host copies on a background thread after a sleep, while
        the caller goes on, maybe capturing graphs of its own that vmm_core never sees
        (a training step's).  Measured on an H100 (scripts/probe_capture_pinning.py): a
        cuMemHostRegister on another thread during a capture in torch's default (global)
        mode fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and breaks that capture;
        with the registering thread in relaxed mode both succeed and the graph replays
        correctly.  The mode is per thread, and restored afterwards."""
        drv = self._drv()
        err, previous = drv.cuThreadExchangeStreamCaptureMode(
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        _check(drv, err, "cuThreadExchangeStreamCaptureMode(RELAXED)")
        try:
            yield
        finally:
            drv.cuThreadExchangeStreamCaptureMode(previous)

    @hookimpl
    def vmm_host_register(self, device, address, size):
        drv = self._drv()
        flags = drv.CU_MEMHOSTREGISTER_PORTABLE | drv.CU_MEMHOSTREGISTER_DEVICEMAP
        with self._relaxed_capture_mode():
            self._run(device, f"cuMemHostRegister({address:#x}, {size}, PORTABLE|DEVICEMAP)",
                      "cuMemHostRegister", address, size, flags)
            try:
                ptr = self._run(device, f"cuMemHostGetDevicePointer({address:#x})",
                                "cuMemHostGetDevicePointer", address, 0)
            except BaseException:
                drv.cuMemHostUnregister(address)
                raise
        return int(ptr)

    @hookimpl
    def vmm_host_unregister(self, device, address):
        with self._relaxed_capture_mode():  # a kept copy may be freed during a capture
            self._run(device, f"cuMemHostUnregister({address:#x})", "cuMemHostUnregister",
                      address)

    @hookimpl
    def vmm_torch_tensor(self, device, address, nbytes):
        # an explicit device: a mapping of another GPU's memory would otherwise be
        # attributed to that GPU (see vmm_core.plugin.raw_tensor)
        return raw_tensor(address, nbytes, f"cuda:{device}")

    # -- the calling thread's context; the device's free memory -----------------
    @hookimpl
    def vmm_thread_device(self):
        drv = self._drv()
        err, ctx = drv.cuCtxGetCurrent()
        _check(drv, err, "cuCtxGetCurrent()")
        return (ctx,)  # a tuple: no context current is a value too, and None means "no hook"

    @hookimpl
    def vmm_set_thread_device(self, state):
        drv = self._drv()
        err, ctx = drv.cuCtxGetCurrent()
        if err != drv.CUresult.CUDA_SUCCESS or int(ctx) != int(state[0]):
            (err,) = drv.cuCtxSetCurrent(state[0])
            _check(drv, err, "cuCtxSetCurrent(the caller's context)")

    @hookimpl
    def vmm_mem_get_info(self, device):
        state = self.vmm_thread_device()
        try:
            self._ctx(device)
            drv = self._drv()
            err, free, total = drv.cuMemGetInfo()
            _check(drv, err, f"cuMemGetInfo() on device {device}")
        finally:
            self.vmm_set_thread_device(state)
        return int(free), int(total)

    def _check_size(self, call: str, size, device: int) -> None:
        g = self._granularity.get(device, 1)
        if not isinstance(size, int) or size <= 0 or size % g:
            raise MappingError(f"{call}: size {size!r} must be a positive multiple of the "
                               f"granularity {g}")


def _torch_pool_support() -> tuple[bool, str]:
    """Whether capture pools work with the installed torch, and the note to show.

    torch < 2.8 still reports True: the backend implements pools, and the adapter refuses
    them at use with the reason (an explicit error, not a silent fallback to a shared
    pool, which would change the memory a user planned for)."""
    version = installed_version("torch")
    if version is None:
        return False, "torch is not installed: graphs need torch>=2.8"
    if version_tuple(version) < _MIN_TORCH:
        return True, (f"torch {version} silently ignores custom-allocator pools during "
                      f"graph capture (fixed in 2.8): reuse='vmm' and regions are refused "
                      f"until torch is upgraded")
    return True, f"torch {version}: torch.cuda.MemPool over the vmm_core C shim"


#: the plugin object registered under the entry point ``cuda``
backend = CudaBackend()
