"""The ``TorchMemorySaver`` class: torch_memory_saver 0.0.10's methods on vmm_core.

Every decision is vmm_core's own: a region is ``vmm_core.region`` (with
``prepare_offload`` for a backed-up region when ``retain_cpu_backup`` asks for the copy to
stay), a graph is captured into a ``GraphPool(reuse="single")`` per torch pool handle, a
pause is ``vmm_core.sleep`` (or a sleep to disk), a resume ``vmm_core.wake_up``.  This
module translates names and arguments; :mod:`.pausing` turns tags, :mod:`.captures`
captures, :mod:`.process_mode` serves ``TMS_INIT_ENABLE``, :mod:`.private_api` the
private names callers reach into.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Literal

from ... import registry
from ...errors import VMMError
from . import captures, pausing, process_mode, settings, state

if TYPE_CHECKING:
    from ...backend import Backend
    from .private_api import Impl

__all__ = ["TorchMemorySaver", "HookMode", "CpuBackupBackend"]

HookMode = Literal["preload", "torch"]
CpuBackupBackend = Literal["mmap", "pinned"]

_TAG_DEFAULT = "default"


def _check_tag(tag) -> str:
    from ...memory import tag_state

    tag_state.check_tag(tag)  # the rule every vmm_core tag follows
    return tag


def _kind(enable_cpu_backup: bool, enable_disk_backup: bool) -> str:
    return "disk" if enable_disk_backup else "cpu" if enable_cpu_backup else "none"


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` on vmm_core.

    ``backend`` (an addition: torch_memory_saver has none) picks the vmm_core backend,
    by default the detected one.  Every instance shares one state, as torch_memory_saver's
    instances share its library's: ``pause()`` on one pauses what another made, and
    ``retain_cpu_backup`` and the disk directory are the process's."""

    def __init__(self, backend=None) -> None:
        self._backend_arg = backend
        self._backend: Backend | None = None
        self._hook_mode: HookMode = "preload"
        #: torch_memory_saver's private implementation object, made by the first call
        self._impl: Impl | None = None

    # ---------------------------------------------------------------- setup
    def _ensure_initialized(self):
        """The vmm_core backend, torch_memory_saver's variables (read once for the
        process), and the whole-process region when ``TMS_INIT_ENABLE`` asks for it."""
        s = settings.settings()
        state.set_base(state.Config(
            tag="default", interesting=s.init_enable, cpu_backup=s.init_cpu_backup,
            cpu_backup_backend=s.init_cpu_backup_backend, disk_backup=s.init_disk_backup))
        if self._backend is None:
            self._backend = registry.resolve(self._backend_arg)
        if s.init_enable:
            process_mode.start(self._backend)
        if self._impl is None:
            from .private_api import Impl

            self._impl = Impl(self)
        return self._backend

    def _device(self) -> int:
        from ...memory import tagged

        return tagged.current_device(self._ensure_initialized())

    # ---------------------------------------------------------------- blocks
    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False,
               cpu_backup_backend: CpuBackupBackend | None = None):
        """Device allocations made inside are paused and resumed with ``tag``.

        With ``enable_cpu_backup`` a pause copies their bytes to host memory and a resume
        copies them back (and gives the host memory back unless ``retain_cpu_backup``);
        with ``enable_disk_backup`` a pause writes them to files under the disk backup
        directory instead.  Regions nest; the inner tag applies inside.  Yields the tag's
        vmm_core allocator (torch_memory_saver yields None): on the host backend, where
        framework tensors cannot be routed, allocate from it."""
        import vmm_core

        settings.check_backup_args(enable_cpu_backup, cpu_backup_backend, enable_disk_backup)
        tag = _check_tag(tag)
        backend = self._ensure_initialized()
        device = self._device()
        kind = _kind(enable_cpu_backup, enable_disk_backup)
        vtag = state.claim(tag, kind)
        chosen = cpu_backup_backend or state.config().cpu_backup_backend
        state.region_keys[(tag, enable_cpu_backup, enable_disk_backup,
                           chosen if enable_cpu_backup else "", device)] = vtag
        pausing.refuse_paused(tag, vtag, backend, device)
        # the host copy made ahead is what a retained backup reuses: opt-in, as there
        prepare = kind == "cpu" and settings.retain()
        with vmm_core.region(vtag, backend=backend, prepare_offload=prepare) as alloc:
            state.push(tag=tag, interesting=True, cpu_backup=enable_cpu_backup,
                       cpu_backup_backend=chosen, disk_backup=enable_disk_backup)
            try:
                yield alloc
            finally:
                state.pop()

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: CpuBackupBackend | None = None,
                   auto_dispatch_capture: bool = False):
        """``torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
        capture_error_mode=...)`` whose memory pauses and resumes with ``tag``.

        Captures passing the same ``pool`` share one vmm_core space, as they share one
        torch pool, and while one runs, torch's routing calls that name ``pool`` reach
        that space (a caller that stops and restarts allocation to its pool mid-capture
        keeps working); a capture without ``pool`` gets a space of its own.  Blocks
        still alive after a capture keep their bytes through a pause whether or not
        ``enable_cpu_backup`` is set; free blocks are given back.
        ``auto_dispatch_capture`` is torch_npu's capture option (sgl-kernel-npu's build
        passes it to ``torch.npu.graph``): passed on where the backend's capture takes
        it, refused where it does not.  Yields the capture pool's handle
        (torch_memory_saver yields None)."""
        settings.check_backup_args(enable_cpu_backup, cpu_backup_backend)
        tag = _check_tag(tag)
        backend = self._ensure_initialized()
        device = self._device()
        vtag = state.claim(tag, _kind(enable_cpu_backup, False))
        pausing.refuse_paused(tag, vtag, backend, device)
        with captures.capture(cuda_graph, backend, device, vtag, pool, stream,
                              capture_error_mode, auto_dispatch_capture) as handle:
            state.push(tag=tag, interesting=True, cpu_backup=enable_cpu_backup,
                       cpu_backup_backend=cpu_backup_backend or
                       state.config().cpu_backup_backend)
            try:
                yield handle
            finally:
                state.pop()

    @contextlib.contextmanager
    def disable(self):
        """Inside a region, a capture, or anywhere in a process under ``TMS_INIT_ENABLE``:
        allocations made in here are ordinary device memory, never paused (freed as
        usual when dropped)."""
        from ...memory import tagged

        backend = self._ensure_initialized()
        if not state.config().interesting:
            raise VMMError("disable() is only meaningful inside region() or cuda_graph() on "
                           "the same thread, or in a process started with TMS_INIT_ENABLE=1 "
                           "(torch_memory_saver asserts it is active): allocations outside "
                           "them are ordinary memory already")
        with tagged.outside_regions(backend, self._device()):
            state.push(interesting=False)
            try:
                yield
            finally:
                state.pop()

    # ---------------------------------------------------------------- pause / resume
    def pause(self, tag: str | None = None) -> None:
        """Release the device memory of ``tag`` (None or "": every tag), copying regions
        with a CPU backup to host memory and writing regions with a disk backup to
        files first.  Virtual addresses stay.

        Pausing a paused tag raises SleepStateError and changes nothing
        (torch_memory_saver exits the process); a tag with no memory is a no-op.  A
        pause that failed midway (a copy or a file that could not be made) is finished
        by calling it again.  It returns once the host copies of ``pinned`` CPU backups
        are page-locked (a registration that fails leaves one pageable, logged), as
        torch_memory_saver's are, so the device memory that takes is in place by then;
        ``mmap`` backups are not waited for."""
        self._ensure_initialized()
        pausing.pause(tag)

    def resume(self, tag: str | None = None) -> None:
        """Re-create the device memory of ``tag`` (None or "": every tag) at the same
        addresses; backed-up regions get their bytes back, the rest holds undefined
        bytes.  Host copies are given back unless ``retain_cpu_backup``; disk files are
        removed.  Resuming a running tag raises SleepStateError and changes nothing
        (torch_memory_saver exits the process); a tag with no memory is a no-op.  A
        resume that failed midway (out of device memory) is finished by calling it
        again once memory is free.  The caller's current device is the same after."""
        self._ensure_initialized()
        pausing.resume(tag)

    # ---------------------------------------------------------------- CPU backup
    def get_cpu_backup(self, x, zero_copy: bool = False):
        """The host copy of tensor ``x``: while paused with a CPU backup, or after a
        resume while ``retain_cpu_backup`` kept it; None when no copy holds it (the
        region has no backup and runs, the copy was given back, or its backup is on
        disk).  A clone, unless ``zero_copy`` (a view of the copy, valid until a resume
        gives it back)."""
        self._ensure_initialized()
        if not x.is_contiguous():
            raise VMMError(f"get_cpu_backup: x of shape {tuple(x.shape)} and strides "
                           f"{tuple(x.stride())} is not contiguous; pass x.contiguous()'s "
                           f"source tensor or a contiguous view")
        return pausing.cpu_backup(x, zero_copy)

    def set_disk_backup_dir(self, path: str):
        """Where regions with ``enable_disk_backup`` write paused memory (created if
        needed; the process's, as ``TMS_DISK_BACKUP_DIR``)."""
        self._ensure_initialized()
        settings.set_disk_dir(path)

    # ---------------------------------------------------------------- settings
    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> HookMode:
        """Accepted for compatibility (torch_memory_saver's getter raises): both modes
        behave the same here, since vmm_core routes allocations through the framework's
        allocator (graphs can be paused in either)."""
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode) -> None:
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', got {hook_mode!r}")
        self._hook_mode = hook_mode

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        """Refuse, as out of memory, any allocation of paused-able memory that would
        leave fewer than ``value`` bytes of the device free (0: no check)."""
        from ...memory import free_margin

        free_margin.set_margin(value, self._ensure_initialized())

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether ``resume`` keeps the host copies for the next pause (False unless set
        here or by ``TMS_RETAIN_CPU_BACKUP=1``, as in torch_memory_saver).  Kept, every
        later pause copies straight into page-locked memory, and regions with a CPU
        backup make their copy ahead when they end, at the cost of host memory the size
        of the backed-up regions' live bytes while running."""
        self._ensure_initialized()
        return settings.retain()

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized()
        settings.set_retain(value)

