"""The vmm_api: every hook a backend implements.

This module is the whole contract between vmm_core's platform-agnostic policy and a
vendor backend; :mod:`vmm_core.plugin` re-exports what a backend needs to fill it (the
markers, the declarations, the role bases), and is the one module of vmm_core besides
:mod:`vmm_core.errors` a backend imports.  A backend is one plugin object (usually a
module-level instance) whose methods carry ``@hookimpl`` and the names below; it is
registered through the ``vmm_core.backends`` entry-point group.  Core calls one
backend's hooks at a time, so every hook is ``firstresult``: it returns its value (or
``None``) directly.

One vocabulary, whatever the vendor calls things (core compares these values, so a
vendor's own spelling would take the wrong branch; :class:`vmm_core.Backend` refuses
capabilities outside it):

* ``device``: an integer device index of this backend (0 on the host backend).
* Addresses are plain ``int`` virtual addresses.  ``granularity`` is the driver's
  *minimum* allocation granularity (``CU_MEM_ALLOC_GRANULARITY_MINIMUM``,
  ``ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM``, ``CN_MEM_ALLOC_GRANULARITY_MINIMUM``), a power
  of two, declared by :func:`vmm_capabilities`; sizes, offsets and alignments are
  multiples of it.  Every byte count (``size``, ``nbytes``, ``offset``, ``alignment``)
  that reaches a hook through :class:`vmm_core.Backend` is an ``int`` from 0 to
  ``vmm_core.plugin.MAX_BYTES``: nothing a ``size_t`` would wrap.  Zero and granularity
  are the hook's to refuse.
* A *handle* (what :func:`vmm_create_handle` and :func:`vmm_import_handle` return) is
  opaque: core reads nothing from it and hands it back, unchanged, only to the backend
  and device that made it.  Keep what you need to know about it (its size, its
  mappings) in it or beside it.
* A *shareable* (what :func:`vmm_export_handle` returns) is an ``int``: a file
  descriptor where the capabilities say ``shareable_handles="fd"``, a vendor value with
  an allow-list where they say ``"integer"`` (``SHAREABLE_HANDLE_KINDS``).
* :func:`vmm_probe`'s :class:`~vmm_core.capabilities.Probe` names the driver library it
  loaded in ``library`` and versions in ``versions`` (component -> version string).  A
  backend that loads its driver library by path reads an override from
  ``VMM_CORE_<NAME>_LIB`` (``vmm_core.plugin.library_env(name)``, ``NAME`` the entry-point
  name), never from a variable of its own naming.
* Roles: :func:`vmm_allocator_adapter` is asked once per device and kept by core;
  :func:`vmm_graph_ops` and :func:`vmm_copy_queue` make a new object per call.
* Failures raise an exception from :mod:`vmm_core.errors` whose message names the vendor
  call and its error code; core converts anything else into ``BackendError``.
* Hooks never call ``exit()`` and never abort the process.

Third-party vendors: start from :mod:`vmm_core.plugin`'s docstring (a page), copy
``backends/ascend`` (ctypes on a C driver library) as a template, then run
:mod:`vmm_core.testing.contract` against your plugin.  Give the plugin object no
properties that do work (load a library, import a framework): pluggy reads every
attribute when it registers a plugin, so such a property runs, or fails, at load time.
"""

from __future__ import annotations

import pluggy

PROJECT = "vmm_core"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Hooks a plugin must implement to be accepted as a backend.
REQUIRED_HOOKS = (
    "vmm_probe",
    "vmm_capabilities",
    "vmm_reserve",
    "vmm_release_range",
    "vmm_create_handle",
    "vmm_release_handle",
    "vmm_map",
    "vmm_set_access",
    "vmm_unmap",
    "vmm_synchronize",
    "vmm_copy_to_host",
    "vmm_copy_from_host",
)


# -------------------------------------------------------------------------
# Detection and capabilities
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_probe():
    """Say whether this backend can run on this machine, cheaply.

    :returns: a :class:`vmm_core.plugin.Probe`.

    Called during auto-detection for every registered backend, so it must be fast and
    must not import a vendor framework that may be absent (``torch_npu``, ``torch_mlu``).
    Probe the driver library with ctypes instead (``libcuda.so.1``: ``cuInit``,
    ``cuDeviceGetCount``).  Never raise: return ``Probe(False, reason)`` where the reason
    names what is missing and how to install it.
    """


@hookspec(firstresult=True)
def vmm_capabilities(device):
    """Declare what the primitives can do on ``device``.

    :param int device: device index.
    :returns: a :class:`vmm_core.plugin.BackendCapabilities`.

    Only called after a successful probe.  Core reads these instead of asking which
    vendor it runs on (granularity, whole-handle-only mapping, access per mapping,
    whether a custom-allocator pool can be used during graph capture).
    """


# -------------------------------------------------------------------------
# Virtual address ranges
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_reserve(device, size, alignment):
    """Reserve ``size`` bytes of virtual addresses, with no physical memory behind them.

    :param int device: device index.
    :param int size: bytes, a positive multiple of the granularity.
    :param int alignment: required alignment of the start address (a granularity multiple).
    :returns: the start address (``int``).
    :raises OutOfMemoryError: the address space is exhausted.
    """


@hookspec(firstresult=True)
def vmm_release_range(device, address, size):
    """Give back a range returned by :func:`vmm_reserve`; nothing may be mapped in it.

    :param int address: the start address returned by ``vmm_reserve``.
    :param int size: the reserved size (backends whose driver takes no size ignore it).
    """


# -------------------------------------------------------------------------
# Physical memory handles
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_create_handle(device, size):
    """Allocate ``size`` bytes of physical memory and return an opaque handle for it.

    :param int size: a positive multiple of the granularity.
    :raises OutOfMemoryError: the device has not enough free memory; nothing is leaked.
    """


@hookspec(firstresult=True)
def vmm_release_handle(device, handle):
    """Free the physical memory of ``handle``; every mapping of it was unmapped first."""


# -------------------------------------------------------------------------
# Mapping
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_map(device, address, size, handle, offset):
    """Map ``size`` bytes of ``handle`` starting at ``offset`` at virtual ``address``.

    ``address`` lies inside a reserved range and is granularity-aligned.  Backends whose
    capabilities say ``partial_map=False`` must raise ``MappingError`` unless
    ``offset == 0`` and ``size`` equals the handle's size.  The mapping is not accessible
    until :func:`vmm_set_access` when ``needs_set_access`` is declared.
    """


@hookspec(firstresult=True)
def vmm_set_access(device, address, size):
    """Make ``[address, address + size)`` readable and writable from ``device``.

    May span several mappings when ``set_access_spans_mappings`` is declared; otherwise
    core calls it once per mapping, with exactly that mapping's address and size.
    """


@hookspec(firstresult=True)
def vmm_unmap(device, address, size):
    """Unmap ``[address, address + size)``; the virtual range stays reserved.

    Core only unmaps exactly what one ``vmm_map`` mapped.
    """


# -------------------------------------------------------------------------
# Data movement and ordering (sleep / wake)
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_synchronize(device):
    """Wait until all work queued on ``device`` has finished.

    Called before memory is unmapped, so that no kernel still reads it.
    """


@hookspec(firstresult=True)
def vmm_copy_to_host(device, address, host_address, size):
    """Copy ``size`` bytes from device ``address`` to host memory at ``host_address``.

    The host buffer may be pinned; the copy must be complete when the hook returns.
    """


@hookspec(firstresult=True)
def vmm_copy_from_host(device, host_address, address, size):
    """Copy ``size`` bytes from host memory at ``host_address`` to device ``address``."""


@hookspec(firstresult=True)
def vmm_copy_device(device, src_address, dst_address, size):
    """Copy ``size`` bytes between two device addresses (optional, used by compaction).

    Backends without it get a copy through a host buffer.
    """


# -------------------------------------------------------------------------
# Framework integration (optional)
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_graph_ops(device):
    """Return a new :class:`vmm_core.plugin.GraphOps` for ``device``, or None.

    Graph ops wrap the framework's graph API (``torch.cuda.CUDAGraph``, ``NPUGraph``,
    ``MLUGraph``) so that the one reuse policy in :class:`vmm_core.GraphPool` and
    :class:`vmm_core.GraphExecutor` runs unchanged on every vendor.  A new object on
    every call: each owns the capture stream its pool or executor warms up, so a
    library's per-stream workspace is made by that pool's own warm-up.
    """


@hookspec(firstresult=True)
def vmm_allocator_adapter(device):
    """Return the :class:`vmm_core.plugin.AllocatorAdapter` of ``device``, or None.

    It creates framework memory pools (``torch.cuda.MemPool`` over a pluggable
    allocator, ``torch.npu.MemPool``, ...) whose segments come from the vmm_core C shim.
    Must import the vendor framework only when called, never at module import.

    Core asks once per device and keeps the adapter for the life of the backend
    (:meth:`vmm_core.Backend.allocator_adapter`): every pool, region and check of a
    device sees the same object, so process-wide framework state (the pluggable
    allocator, pools that must be kept alive) can live in it, and the backend need not
    cache it.  Return None when the framework is not installed; core asks again later
    rather than keeping that answer.
    """


@hookspec(firstresult=True)
def vmm_host_buffer(device, size, pinned):
    """Return a host buffer object of ``size`` bytes for offloading ``device``'s memory
    (optional).

    The object exposes ``.address`` (int) and ``.size``; pinned buffers make device
    copies asynchronous-capable.  Backends without a pinned allocator return None and
    core uses pageable memory.
    """


# -------------------------------------------------------------------------
# Queued copies and fills (optional; offload and zeroed wake use them)
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_copy_queue(device):
    """Return a new :class:`vmm_core.plugin.CopyQueue` for ``device`` (optional), or
    None.

    A queue runs host<->device copies in order and lets core wait for them through
    markers.  Offload streams device memory through a small ring of pinned staging
    chunks with it, so that the device copies of one chunk overlap the host copies of
    another and no host memory needs pinning per sleep.  Declare
    ``BackendCapabilities.async_copies`` when the queue's copies really run without the
    calling thread (a copy engine); a queue whose copies complete inside the call (the
    host backend's) is still correct, and core then prefers plain copies by default.
    Core closes every queue it gets.
    """


@hookspec(firstresult=True)
def vmm_memset(device, address, value, size):
    """Set ``size`` bytes at device ``address`` to the byte ``value`` (optional).

    Complete when the hook returns.  ``wake(zero=True)`` uses it; backends without it
    get a copy from a host buffer filled with ``value``.
    """


# -------------------------------------------------------------------------
# Sharing physical memory between processes and devices (optional)
#
# Used by vmm_core.distributed.  A backend declares what it can do through
# ``BackendCapabilities.shareable_handles`` and ``peer_access``; core never calls these
# hooks unless the capability says so.
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_create_shareable_handle(device, size):
    """Like :func:`vmm_create_handle`, but the handle can be given to :func:`vmm_export_handle`.

    Drivers must be told at creation that a handle will be exported (CUDA:
    ``requestedHandleTypes``); backends whose handles are always exportable create a
    plain handle.
    :raises OutOfMemoryError: as :func:`vmm_create_handle`.
    """


@hookspec(firstresult=True)
def vmm_export_handle(device, handle, importers):
    """Turn a handle made by :func:`vmm_create_shareable_handle` into an OS-level handle.

    :param list importers: the :func:`vmm_process_id` of every process that will import
        it.  Backends whose shareable handles are file descriptors ignore it (holding the
        descriptor is the permission); those with integer handles put exactly these
        processes on the handle's allow-list.
    :returns: ``int``: for ``shareable_handles == "fd"`` a new file descriptor that the
        caller owns and closes after sending it; for ``"integer"`` the vendor's value.
    """


@hookspec(firstresult=True)
def vmm_process_id(device):
    """This process as the vendor's allow-lists know it (an ``int``).

    Needed only by backends whose shareable handles are integers with an allow-list
    (Ascend: ``aclrtDeviceGetBareTgid``, which differs from ``os.getpid()`` inside
    containers).  Core uses ``os.getpid()`` when a backend does not implement it.
    """


@hookspec(firstresult=True)
def vmm_import_handle(device, shareable, size):
    """Import a handle another process exported, for mapping on ``device``.

    :param int shareable: the value :func:`vmm_export_handle` returned in the exporting
        process (for ``"fd"`` backends: a descriptor of *this* process received over a
        Unix socket; the caller keeps it and closes it after this call).
    :param int size: the size of the exported handle.
    :returns: a handle that :func:`vmm_map` accepts and :func:`vmm_release_handle`
        releases (releasing it does not free the exporter's memory).
    :raises MappingError: the memory cannot be used from ``device`` (no peer access,
        not on the allow-list), with the remedy in the message.
    """


@hookspec(firstresult=True)
def vmm_set_access_for(device, address, size, devices):
    """Make ``[address, address + size)`` readable and writable from every device in
    ``devices``.

    Unlike :func:`vmm_set_access`, the memory mapped there may live on another device
    (an imported handle).  ``address`` and ``size`` cover exactly one mapping unless
    ``set_access_spans_mappings`` is declared.
    :raises MappingError: a device in ``devices`` cannot reach that memory.
    """


@hookspec(firstresult=True)
def vmm_host_register(device, address, size):
    """Make host memory ``[address, address + size)`` (page aligned; private, or shared
    with other processes) accessible to ``device``; returns the device address to use
    for it.

    Registered memory must be page-locked, so that device copies into and out of it run
    at full bandwidth: offload registers the host copies it keeps between sleeps once,
    and copies straight into them afterwards (CUDA: ``cuMemHostRegister``).  Backends
    whose device is the host return ``address`` itself (a no-op).
    """


@hookspec(firstresult=True)
def vmm_host_unregister(device, address):
    """Undo :func:`vmm_host_register` for the range starting at host ``address``."""


# -------------------------------------------------------------------------
# Framework views of raw memory (optional)
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_torch_tensor(device, address, nbytes):
    """A ``torch.uint8`` tensor of ``nbytes`` over ``[address, address + nbytes)``, on
    the torch device that ``device`` is; it does not own the memory.

    Must import the framework only when called.
    """


# -------------------------------------------------------------------------
# Device-wide readings and the calling thread's device (optional)
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def vmm_mem_get_info(device):
    """``(free, total)`` bytes of ``device``'s memory, as the driver counts them for
    every process (optional).

    A free-memory margin (``vmm_core.memory.free_margin``, torch_memory_saver's
    ``memory_margin_bytes``) refuses allocations against it; backends without it cannot
    set a margin.
    """


@hookspec(firstresult=True)
def vmm_thread_device():
    """An opaque value for the device (or context) current on the calling thread, which
    hooks change to reach the device they are given (optional).

    Sleep and wake of memory on several devices restore it before they return
    (:func:`vmm_set_thread_device`), so that the caller's current device is the one it
    had; backends whose hooks never change it leave both out.
    """


@hookspec(firstresult=True)
def vmm_set_thread_device(state):
    """Make ``state`` (a value :func:`vmm_thread_device` returned) current on the calling
    thread again."""
