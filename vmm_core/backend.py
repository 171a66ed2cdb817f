"""A registered backend seen through its hooks.

:class:`Backend` is the only object core code talks to.  It calls one plugin's hooks
(never a vendor module directly) and turns any non-vmm_core exception a hook raises
into :class:`BackendError` naming the backend and the hook, so every vendor fails the
same way.
"""

from __future__ import annotations

import threading
import weakref

from . import forksafe
from .capabilities import SHAREABLE_HANDLE_KINDS, BackendCapabilities, Probe
from .errors import BackendError, BackendUnavailableError, VMMError
from .sizes import MAX_BYTES, byte_count

__all__ = ["Backend", "MAX_BYTES"]

#: hook arguments that are byte counts, checked for every backend before its hook runs
_BYTE_ARGS = frozenset({"size", "nbytes", "offset", "alignment"})

_instances: weakref.WeakSet = weakref.WeakSet()


class Backend:
    """Typed access to one backend plugin's vmm_api hooks."""

    def __init__(self, name: str, plugin: object, plugin_manager) -> None:
        self.name = name
        self.plugin = plugin
        self._pm = plugin_manager
        self._callers: dict = {}
        self._caps: dict[int, BackendCapabilities] = {}
        self._adapters: dict[int, object] = {}
        self._probe: Probe | None = None
        # reentrant: a role hook may read the capabilities it is asked under the lock
        self._lock = threading.RLock()
        _instances.add(self)

    def __repr__(self) -> str:
        return f"<vmm_core.Backend {self.name!r}>"

    # -- plumbing ---------------------------------------------------------
    def _caller(self, hook: str):
        """This plugin's implementation of ``hook`` (validated by pluggy at registration).

        Called directly rather than through a pluggy subset caller: a backend has exactly
        one implementation per hook, and the hot paths (map, set-access per space) would
        otherwise pay pluggy's dispatch on every call.
        """
        fn = self._callers.get(hook)
        if fn is None:
            impls = [i for i in getattr(self._pm.hook, hook).get_hookimpls()
                     if i.plugin is self.plugin]
            if not impls:
                raise BackendError(f"backend {self.name!r} does not implement {hook}")
            fn = self._callers[hook] = impls[0].function
        return fn

    def call(self, hook: str, **kwargs):
        """Call ``hook`` on this backend only; normalise foreign exceptions.

        Byte counts are checked here, once for every backend, before the plugin sees
        them: a third-party backend written in an afternoon gets no size it could wrap."""
        for key in _BYTE_ARGS.intersection(kwargs):
            value = kwargs[key]
            # a plain int in range (nearly every call) skips the full check
            if type(value) is not int or not 0 <= value <= MAX_BYTES:
                kwargs[key] = _byte_count(hook, key, value)
        try:
            return self._caller(hook)(**kwargs)
        except VMMError:
            raise
        except Exception as exc:  # a vendor bug must still surface as our error type
            raise BackendError(
                f"backend {self.name!r}: {hook}({_fmt(kwargs)}) raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def implements(self, hook: str) -> bool:
        return any(impl.plugin is self.plugin
                   for impl in getattr(self._pm.hook, hook).get_hookimpls())

    # -- detection --------------------------------------------------------
    def probe(self, refresh: bool = False) -> Probe:
        if self._probe is None or refresh:
            try:
                result = self.call("vmm_probe")
            except VMMError as exc:
                result = Probe(False, f"probe raised: {exc}")
            if not isinstance(result, Probe):
                result = Probe(False, f"vmm_probe returned {result!r}, not a Probe")
            self._probe = result
        return self._probe

    @property
    def available(self) -> bool:
        return self.probe().available

    def require_available(self) -> None:
        probe = self.probe()
        if not probe.available:
            raise BackendUnavailableError(
                f"backend {self.name!r} is not usable on this machine: {probe.reason}. "
                f"Run `vmm-core info` to see every backend and why it was (not) chosen."
            )

    def capabilities(self, device: int = 0) -> BackendCapabilities:
        with self._lock:
            caps = self._caps.get(device)
            if caps is None:
                self.require_available()
                caps = self.call("vmm_capabilities", device=device)
                if not isinstance(caps, BackendCapabilities):
                    raise BackendError(
                        f"backend {self.name!r}: vmm_capabilities returned {caps!r}; "
                        f"it must return vmm_core.plugin.BackendCapabilities"
                    )
                _check_vocabulary(self.name, caps)
                self._caps[device] = caps
            return caps

    # -- roles (optional hooks) --------------------------------------------
    def graph_ops(self, device: int = 0):
        """A new :class:`~vmm_core.graphs.graph_ops.GraphOps` of ``device`` on every call
        (each owns its capture stream), or None without the hook."""
        if not self.implements("vmm_graph_ops"):
            return None
        return self.call("vmm_graph_ops", device=device)

    def allocator_adapter(self, device: int = 0):
        """The one :class:`~vmm_core.memory.adapter.AllocatorAdapter` of ``device``, or
        None.

        Asked of the backend once per device and kept here, for the life of this object:
        an adapter holds process-wide framework state (the pluggable allocator, pools it
        must keep alive), so every GraphPool, region and quarantine check of a device
        must see the same one, and no backend has to cache it.  A None answer (the
        framework is not installed) is not kept: it is asked again next time."""
        adapter = self._adapters.get(device)
        if adapter is not None or not self.implements("vmm_allocator_adapter"):
            return adapter
        with self._lock:
            adapter = self._adapters.get(device)
            if adapter is None:
                adapter = self.call("vmm_allocator_adapter", device=device)
                if adapter is not None:
                    self._adapters[device] = adapter
            return adapter

    # -- primitives (thin, typed) -----------------------------------------
    def reserve(self, device: int, size: int, alignment: int) -> int:
        return int(self.call("vmm_reserve", device=device, size=size, alignment=alignment))

    def release_range(self, device: int, address: int, size: int) -> None:
        self.call("vmm_release_range", device=device, address=address, size=size)

    def create_handle(self, device: int, size: int):
        return self.call("vmm_create_handle", device=device, size=size)

    def release_handle(self, device: int, handle) -> None:
        self.call("vmm_release_handle", device=device, handle=handle)

    def map(self, device: int, address: int, size: int, handle, offset: int = 0) -> None:
        self.call("vmm_map", device=device, address=address, size=size,
                  handle=handle, offset=offset)

    def set_access(self, device: int, address: int, size: int) -> None:
        self.call("vmm_set_access", device=device, address=address, size=size)

    def unmap(self, device: int, address: int, size: int) -> None:
        self.call("vmm_unmap", device=device, address=address, size=size)

    def synchronize(self, device: int) -> None:
        self.call("vmm_synchronize", device=device)

    def copy_to_host(self, device: int, address: int, host_address: int, size: int) -> None:
        self.call("vmm_copy_to_host", device=device, address=address,
                  host_address=host_address, size=size)

    def copy_from_host(self, device: int, host_address: int, address: int, size: int) -> None:
        self.call("vmm_copy_from_host", device=device, host_address=host_address,
                  address=address, size=size)

    def copy_device(self, device: int, src_address: int, dst_address: int, size: int) -> None:
        size = _byte_count("vmm_copy_device", "size", size)  # the fallback's too
        if self.implements("vmm_copy_device"):
            self.call("vmm_copy_device", device=device, src_address=src_address,
                      dst_address=dst_address, size=size)
            return
        import ctypes

        bounce = (ctypes.c_char * size)()
        self.copy_to_host(device, src_address, ctypes.addressof(bounce), size)
        self.copy_from_host(device, ctypes.addressof(bounce), dst_address, size)

    def host_buffer(self, device: int, size: int, pinned: bool = True):
        if not self.implements("vmm_host_buffer"):
            return None
        return self.call("vmm_host_buffer", device=device, size=size, pinned=pinned)

    # -- queued copies and fills (optional hooks) ---------------------------
    def copy_queue(self, device: int):
        """A new :class:`~vmm_core.memory.copy_queue.CopyQueue` on ``device``, or None."""
        if not self.implements("vmm_copy_queue"):
            return None
        return self.call("vmm_copy_queue", device=device)

    def memset(self, device: int, address: int, value: int, size: int) -> None:
        """Fill device memory with the byte ``value``; through the host without the hook."""
        size = _byte_count("vmm_memset", "size", size)  # the fallback's too
        if size == 0:
            return
        if self.implements("vmm_memset"):
            self.call("vmm_memset", device=device, address=address, value=value, size=size)
            return
        import ctypes

        chunk = min(size, _FILL_CHUNK)
        source = ctypes.create_string_buffer(chunk)  # zeroed
        if value:
            ctypes.memset(source, value, chunk)
        for offset in range(0, size, chunk):
            self.copy_from_host(device, ctypes.addressof(source), address + offset,
                                min(chunk, size - offset))

    # -- sharing memory between processes and devices (optional hooks) ------
    def require_sharing(self, device: int, what: str) -> None:
        """Raise unless handles of ``device`` can be exported to other processes."""
        if self.capabilities(device).shareable_handles is None:
            raise BackendError(
                f"backend {self.name!r} cannot share physical memory between processes "
                f"(capability shareable_handles is None), so {what} is not possible on "
                f"it; use a backend that declares shareable handles")

    def create_shareable_handle(self, device: int, size: int):
        self.require_sharing(device, "creating an exportable handle")
        return self.call("vmm_create_shareable_handle", device=device, size=size)

    def export_handle(self, device: int, handle, importers=()) -> int:
        return int(self.call("vmm_export_handle", device=device, handle=handle,
                             importers=list(importers)))

    def process_id(self, device: int) -> int:
        if not self.implements("vmm_process_id"):
            import os

            return os.getpid()
        return int(self.call("vmm_process_id", device=device))

    def import_handle(self, device: int, shareable: int, size: int):
        return self.call("vmm_import_handle", device=device, shareable=shareable, size=size)

    def set_access_for(self, device: int, address: int, size: int, devices) -> None:
        self.call("vmm_set_access_for", device=device, address=address, size=size,
                  devices=list(devices))

    def host_register(self, device: int, address: int, size: int) -> int:
        if not self.implements("vmm_host_register"):
            raise BackendError(
                f"backend {self.name!r} cannot make shared host memory accessible to its "
                f"devices (it has no vmm_host_register hook); use location='device'")
        return int(self.call("vmm_host_register", device=device, address=address,
                             size=size))

    def host_unregister(self, device: int, address: int) -> None:
        self.call("vmm_host_unregister", device=device, address=address)

    # -- device-wide readings and the thread's device (optional hooks) ----------
    def mem_get_info(self, device: int) -> tuple[int, int] | None:
        """``(free, total)`` bytes of the device's memory, or None without the hook."""
        if not self.implements("vmm_mem_get_info"):
            return None
        free, total = self.call("vmm_mem_get_info", device=device)
        return int(free), int(total)

    def thread_device(self):
        """The calling thread's current device as the backend's hooks leave it (an
        opaque value for :meth:`set_thread_device`), or None without the hook."""
        if not self.implements("vmm_thread_device"):
            return None
        return self.call("vmm_thread_device")

    def set_thread_device(self, state) -> None:
        if state is not None and self.implements("vmm_set_thread_device"):
            self.call("vmm_set_thread_device", state=state)

    # -- framework views (optional hook) ----------------------------------------
    def require_torch_tensors(self) -> None:
        """Raise unless this backend can view raw memory as torch tensors."""
        if not self.implements("vmm_torch_tensor"):
            raise BackendError(
                f"backend {self.name!r} cannot wrap a device address in a torch tensor "
                f"(it has no vmm_torch_tensor hook); use the raw addresses instead "
                f"(vmm_core.distributed.mapped_memory)")

    def torch_tensor(self, device: int, address: int, nbytes: int):
        """A non-owning ``torch.uint8`` tensor over raw memory of ``device``."""
        self.require_torch_tensors()
        return self.call("vmm_torch_tensor", device=device, address=address, nbytes=nbytes)


def _check_vocabulary(name: str, caps: BackendCapabilities) -> None:
    """Refuse capabilities outside the one vocabulary every backend speaks (hookspecs'
    docstring): core compares these values, so a vendor's own spelling of one ("posix_fd",
    a granularity that is not a power of two) would silently take the wrong branch."""
    g = caps.granularity
    wrong = []
    if type(g) is not int or g <= 0 or g & (g - 1):
        wrong.append(f"granularity={g!r} (a positive power of two: the driver's minimum)")
    elif type(caps.default_reserve_bytes) is not int or caps.default_reserve_bytes <= 0 \
            or caps.default_reserve_bytes % g:
        wrong.append(f"default_reserve_bytes={caps.default_reserve_bytes!r} (a positive "
                     f"multiple of the granularity {g})")
    if caps.shareable_handles not in SHAREABLE_HANDLE_KINDS:
        wrong.append(f"shareable_handles={caps.shareable_handles!r} (one of "
                     f"{', '.join(map(repr, SHAREABLE_HANDLE_KINDS))})")
    if wrong:
        raise BackendError(f"backend {name!r}: vmm_capabilities declared "
                           f"{'; '.join(wrong)}: fix the backend's declaration")


def _byte_count(hook: str, key: str, value) -> int:
    return byte_count(f"{hook}: {key}", value)  # the bound every byte count goes through


def _fresh_locks_after_fork() -> None:
    """A thread of the parent may have held a backend's lock at the fork (reading its
    capabilities); the child does not have that thread.  The lock guards a cache only."""
    for backend in list(_instances):
        backend._lock = threading.RLock()


forksafe.at_fork("backends", after_in_child=_fresh_locks_after_fork)


#: host buffer size of the memset fallback (one copy per this many bytes)
_FILL_CHUNK = 16 << 20


def _fmt(kwargs: dict) -> str:
    parts = []
    for key, value in kwargs.items():
        address = key.endswith("address") and isinstance(value, int)
        parts.append(f"{key}={hex(value) if address else repr(value)}")
    return ", ".join(parts)
