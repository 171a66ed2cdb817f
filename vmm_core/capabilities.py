"""Value types a backend returns from its detection hooks.

Core code never asks *which* vendor it runs on; it reads these declarations instead, in
one vocabulary for every vendor (:mod:`vmm_core.hookspecs` lists it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Probe", "BackendCapabilities", "SHAREABLE_HANDLE_KINDS", "library_env"]

#: What ``BackendCapabilities.shareable_handles`` may say: handles cannot leave the
#: process (None), they leave as POSIX file descriptors ("fd") or as vendor integers
#: with an allow-list ("integer").  :class:`vmm_core.Backend` refuses any other value.
SHAREABLE_HANDLE_KINDS = (None, "fd", "integer")


def library_env(backend: str) -> str:
    """The environment variable that overrides the path of ``backend``'s driver library:
    ``VMM_CORE_<NAME>_LIB`` after the entry-point name (``VMM_CORE_ASCEND_LIB``), the
    same rule for every backend, beside ``VMM_CORE_BACKEND`` which selects one."""
    return f"VMM_CORE_{backend.upper().replace('-', '_')}_LIB"


@dataclass(frozen=True)
class Probe:
    """Result of ``vmm_probe``: whether the backend can run here, and why (not).

    ``reason`` is shown verbatim by ``vmm-core info``; make it say what is missing and how
    to get it ("libcuda.so.1 not found: install the NVIDIA driver").  ``priority`` orders
    usable backends during auto-detection: accelerators use 100, the host fallback 0.
    ``versions`` maps a component (a driver, a binding, a framework) to its version
    string; ``library`` is the driver library the probe loaded (a path or a soname), or
    None where there is none, so ``vmm-core info`` shows every backend's the same way.
    """

    available: bool
    reason: str
    device_count: int = 0
    priority: int = 100
    versions: dict = field(default_factory=dict)
    library: str | None = None


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend's primitives can do on one device.

    granularity:
        The driver's *minimum* allocation granularity (CUDA, ACL and CNDrv all call the
        option ``..._GRANULARITY_MINIMUM``), a power of two: every reservation, handle,
        mapping, offset and alignment core passes is a multiple of it, and allocations
        are rounded up to it.  Not a larger "recommended" one: core grows physical memory
        in large handles itself, so a larger unit would only round every allocation up.
    partial_map:
        One map call may cover part of a handle or start at a non-zero offset in it.
        Ascend and MLU cannot: a map always covers a whole handle at offset 0.
    needs_set_access:
        Mapped memory is inaccessible until ``vmm_set_access`` is called on it.
    set_access_spans_mappings:
        One ``vmm_set_access`` call may cover several adjacent mappings.
        When False it is called once per mapping.
    graph_pool:
        A pool backed by a custom allocator can be used during graph capture, so
        every capture can get its own virtual space.  When False the graph executor
        falls back to one shared pool (and says so in ``stats()``).
    default_reserve_bytes:
        Size of one virtual space when the user does not choose one.
    notes:
        Free text shown by ``vmm-core info`` (e.g. why graph_pool is False).
    async_copies:
        The copies of the queue ``vmm_copy_queue`` returns run on a copy engine, not on
        the calling thread.  Offload then streams through pinned staging chunks by
        default (see :mod:`vmm_core.memory.offload`); without it, offload copies
        directly.

    Sharing memory between processes and devices (``vmm_core.distributed``):

    shareable_handles:
        What ``vmm_export_handle`` turns a handle into, one of
        :data:`SHAREABLE_HANDLE_KINDS`: ``"fd"`` (a POSIX file descriptor, passed to
        other processes over a Unix socket), ``"integer"`` (a vendor value, passed by
        value, that only the processes put on its allow-list may import) or None
        (handles cannot leave the process).
    peer_access:
        A mapping on one device may hold memory created on another device of this
        backend (``vmm_set_access_for`` grants the access).  When False, processes can
        share memory only when they use the same device.
    mixed_handle_reservations:
        One reserved range may hold, at the same time, mappings of handles of different
        origins: handles this process created beside handles imported from another
        process, or memory of several devices.  When False, every imported part gets a
        range of its own, so ``kind="continuous"`` mapped memory over several ranks is
        refused (``kind="chunked"`` works).
    same_process_import:
        A process may import a shareable handle it exported itself.  When False, import
        only works in another process (the contract suite then imports in a child).
    """

    granularity: int
    partial_map: bool = True
    needs_set_access: bool = True
    set_access_spans_mappings: bool = True
    graph_pool: bool = True
    default_reserve_bytes: int = 1 << 36
    notes: str = ""
    async_copies: bool = False
    # -- sharing memory between processes and devices (vmm_core.distributed) --
    shareable_handles: str | None = None
    peer_access: bool = False
    mixed_handle_reservations: bool = True
    same_process_import: bool = True
