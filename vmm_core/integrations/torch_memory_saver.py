"""torch_memory_saver 0.0.10's Python API, served by vmm_core: change one import line.

    from torch_memory_saver import torch_memory_saver                        # before
    from vmm_core.integrations.torch_memory_saver import torch_memory_saver  # after

The same names, defaults and semantics: one global ``torch_memory_saver`` object of
class :class:`TorchMemorySaver`, ``region`` / ``cuda_graph`` / ``disable`` blocks,
``pause(tag=None)`` / ``resume(tag=None)`` (None: every tag), CPU backup per region,
nested regions, ``get_cpu_backup``.  What differs, and why, is listed in
docs/integrations.md; in short: errors are raised (vmm_core's hierarchy, with the
remedy) where torch_memory_saver exits the process; it runs on every vmm_core backend;
graph memory captured with ``cuda_graph`` keeps its live blocks through a pause (what
replays read) and gives back the rest; host copies are kept pinned between pauses unless
``retain_cpu_backup = False``.

For code that cannot be edited, an opt-in alias makes ``import torch_memory_saver``
resolve here, in this process and the ones it starts: put the directory
``python -m vmm_core.integrations.torch_memory_saver`` prints first on PYTHONPATH, or call
:func:`install` before anything imports torch_memory_saver.

Every decision is vmm_core's own: a region is ``vmm_core.region`` (with
``prepare_offload`` for a CPU backup, so the first pause copies at the pinned rate), a
graph is captured into a ``GraphPool(reuse="single")`` per torch pool handle, a pause is
``vmm_core.sleep`` and a resume ``vmm_core.wake_up``.  This module translates names.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ..errors import SleepStateError, VMMError

if TYPE_CHECKING:
    from ..backend import Backend
    from ..graphs.pool import GraphPool

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "alias_path",
           "install", "vmm_tags", "CpuBackupBackend", "HookMode"]

HookMode = Literal["preload", "torch"]
CpuBackupBackend = Literal["mmap", "pinned"]

_TAG_DEFAULT = "default"
#: vmm_core tags of memory made here: "tms:<tag>", and "tms:<tag>:cpu_backup" for the
#: memory a pause copies to the host (a vmm_core tag is offloaded or discarded whole)
_PREFIX = "tms:"
_BACKUP = ":cpu_backup"

_lock = threading.RLock()  # taken before vmm_core's own locks, never inside them
#: torch_memory_saver tag -> the vmm_core tags holding its memory
_tags: dict[str, set[str]] = {}
#: (vmm tag, torch pool handle or a private key, backend name, device) -> GraphPool
_graph_pools: dict[tuple, GraphPool] = {}
#: pools of captures without ``pool=`` (torch gives each a private pool): closed once
#: their graph is gone and nothing in them is alive
_private: list[tuple[Callable[[], object] | None, tuple]] = []
_private_keys = itertools.count()
_open = threading.local()  # .blocks: region / cuda_graph blocks open on this thread


def _fresh_lock_after_fork() -> None:
    """A pause or resume holds ``_lock`` while it waits for vmm_core's locks, which a fork
    waits for only a bounded time: a child forked then inherited ``_lock`` held by a
    thread it does not have, and hung in its first pause, resume or region.  The forking
    thread's own hold stays (it is the child's thread)."""
    global _lock
    if not _lock._is_owned():  # type: ignore[attr-defined]  # CPython's RLock has it
        _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def _blocks() -> list:
    blocks = getattr(_open, "blocks", None)
    if blocks is None:
        blocks = _open.blocks = []
    return blocks


def _vmm_tag(tag: str, cpu_backup: bool) -> str:
    return _PREFIX + tag + (_BACKUP if cpu_backup else "")


def vmm_tags(tag: str | None = None) -> list[str]:
    """The vmm_core tags (``vmm_core.memory_summary()``) of a torch_memory_saver tag, or
    of every tag made here (None)."""
    with _lock:
        names = list(_tags) if tag is None else [tag]
        return sorted(t for name in names for t in _tags.get(name, ()))


def _check_tag(tag) -> str:
    from ..memory import tag_state

    tag_state.check_tag(tag)  # the rule every vmm_core tag follows
    return tag


def _bool_env(name: str) -> bool | None:
    """torch_memory_saver's reading of a boolean variable (None: unset)."""
    value = os.environ.get(name)
    if value is None:
        return None
    if value in ("1", "true", "TRUE", "yes", "YES"):
        return True
    if value in ("0", "false", "FALSE", "no", "NO"):
        return False
    raise VMMError(f"{name}={value!r} is not a boolean; use 1/0, true/false or yes/no")


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` on vmm_core.

    ``backend`` (an addition: torch_memory_saver has none) picks the vmm_core backend,
    by default the detected one.  Every instance shares one state, as torch_memory_saver's
    instances share its library's: ``pause()`` on one pauses what another made."""

    def __init__(self, backend=None) -> None:
        self._backend_arg = backend
        self._backend: Backend | None = None
        self._hook_mode: HookMode = "preload"
        #: None: vmm_core's keep-host-buffers policy (keep); set by retain_cpu_backup
        #: or TMS_RETAIN_CPU_BACKUP
        self._retain: bool | None = None
        self._env_checked = False

    # ---------------------------------------------------------------- setup
    def _ensure_initialized(self):
        """The vmm_core backend, and torch_memory_saver's process-wide variables read
        once (torch_memory_saver reads them in its library's constructor)."""
        if not self._env_checked:
            if _bool_env("TMS_INIT_ENABLE"):
                raise VMMError(
                    "TMS_INIT_ENABLE=1 puts every device allocation of the process in a "
                    "region, which needs torch_memory_saver's LD_PRELOAD hook of cudaMalloc; "
                    "vmm_core routes only allocations made inside region() or cuda_graph(). "
                    "Unset TMS_INIT_ENABLE and wrap what should be paused in region()")
            if _bool_env("TMS_INIT_ENABLE_DISK_BACKUP"):
                raise _no_disk_backup("TMS_INIT_ENABLE_DISK_BACKUP=1")
            retain = _bool_env("TMS_RETAIN_CPU_BACKUP")
            if retain is not None and self._retain is None:
                self._retain = retain
            self._env_checked = True
        if self._backend is None:
            import vmm_core

            arg = self._backend_arg
            self._backend = arg if isinstance(arg, vmm_core.Backend) else \
                vmm_core.get_backend(arg)
        return self._backend

    def _device(self) -> int:
        from ..memory import tagged

        return tagged.current_device(self._ensure_initialized())

    # ---------------------------------------------------------------- blocks
    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False,
               cpu_backup_backend: CpuBackupBackend | None = None):
        """Device allocations made inside are paused and resumed with ``tag``.

        With ``enable_cpu_backup`` their bytes are copied to host memory by ``pause`` and
        back by ``resume``; that copy is made (pinned) in the background when the block
        ends, so the first pause copies at the pinned rate too.  Regions nest; the inner
        tag applies inside.  Yields the tag's vmm_core allocator (torch_memory_saver
        yields None): on the host backend, where framework tensors cannot be routed,
        allocate from it."""
        import vmm_core

        _check_backup_args(enable_cpu_backup, cpu_backup_backend)
        if enable_disk_backup:
            raise _no_disk_backup("region(enable_disk_backup=True)")
        tag = _check_tag(tag)
        backend = self._ensure_initialized()
        vtag = self._claim(tag, enable_cpu_backup)
        prepare = bool(enable_cpu_backup) and self._retain is not False
        with vmm_core.region(vtag, backend=backend, prepare_offload=prepare) as alloc:
            _blocks().append(f"region({tag!r})")
            try:
                yield alloc
            finally:
                _blocks().pop()

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: CpuBackupBackend | None = None):
        """``torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
        capture_error_mode=...)`` whose memory pauses and resumes with ``tag``.

        Captures passing the same ``pool`` share one vmm_core space, as they share one
        torch pool; a capture without ``pool`` gets a space of its own, as torch gives
        it a private pool.  Blocks still alive after a capture (outputs the engine keeps,
        state a library made lazily) keep their bytes through a pause whether or not
        ``enable_cpu_backup`` is set; free blocks are given back.  Yields the capture
        pool's handle (torch_memory_saver yields None)."""
        from ..graphs.pool import GraphPool

        _check_backup_args(enable_cpu_backup, cpu_backup_backend)
        tag = _check_tag(tag)
        backend = self._ensure_initialized()
        device = self._device()
        vtag = self._claim(tag, enable_cpu_backup)
        _close_unused_private_pools()
        with _lock:
            key = (vtag, pool if pool is not None else ("private", next(_private_keys)),
                   backend.name, device)
            graph_pool = _graph_pools.get(key)
            if graph_pool is None:
                graph_pool = _graph_pools[key] = GraphPool(
                    device, backend=backend, tag=vtag, reuse="single")
                if pool is None:
                    _private.append((_weak(cuda_graph), key))
        with graph_pool.space("capture") as handle:
            _blocks().append(f"cuda_graph(tag={tag!r})")
            try:
                with graph_pool.ops.capture_context(cuda_graph, handle, stream=stream,
                                         capture_error_mode=capture_error_mode):
                    yield handle
            finally:
                _blocks().pop()

    @contextlib.contextmanager
    def disable(self):
        """Inside a region or cuda_graph block: allocations made in here are ordinary
        device memory again, never paused (freed as usual when dropped)."""
        from ..memory import tagged

        backend = self._ensure_initialized()
        if not _blocks():
            raise VMMError("disable() is only meaningful inside region() or cuda_graph() on "
                           "the same thread (torch_memory_saver asserts it is active): "
                           "allocations outside them are ordinary memory already")
        with tagged.outside_regions(backend, self._device()):
            yield

    # ---------------------------------------------------------------- pause / resume
    def pause(self, tag: str | None = None) -> None:
        """Release the device memory of ``tag`` (None: every tag), copying regions made
        with ``enable_cpu_backup`` to the host first.  Virtual addresses stay.

        Pausing a paused tag raises SleepStateError and changes nothing
        (torch_memory_saver exits the process); a tag with no memory is a no-op.  A
        pause that failed midway (a copy that could not be made) is finished by calling
        it again."""
        import vmm_core

        self._ensure_initialized()
        _close_unused_private_pools()
        with _lock:
            awake = self._to_turn(tag, asleep=False, refusal=(
                "torch_memory_saver.pause({tag!r}): memory tagged {names} is paused already; "
                "resume it first (or pause only the tags that run)"))
            if awake:
                vmm_core.sleep(awake, offload=[t for t in awake if t.endswith(_BACKUP)])

    def resume(self, tag: str | None = None) -> None:
        """Re-create the device memory of ``tag`` (None: every tag) at the same
        addresses; backed-up regions get their bytes back, the rest holds undefined
        bytes.  Resuming a running tag raises SleepStateError and changes nothing
        (torch_memory_saver exits the process); a tag with no memory is a no-op.  A
        resume that failed midway (out of device memory) is finished by calling it
        again once memory is free."""
        import vmm_core

        self._ensure_initialized()
        with _lock:
            asleep = self._to_turn(tag, asleep=True, refusal=(
                "torch_memory_saver.resume({tag!r}): memory tagged {names} is not paused; "
                "pause it first (or resume only the paused tags)"))
            if asleep:
                vmm_core.wake_up(asleep, keep_host_buffers=self._retain)

    def _to_turn(self, tag, asleep: bool, refusal: str) -> list[str]:
        """The vmm_core tags of ``tag`` (None: every tag) whose memory is ``asleep``
        (False: running), the ones a pause (resume) turns; refuses, changing nothing,
        when a torch_memory_saver tag has none in that state (paused already, running)."""
        chosen = self._with_memory(tag)
        wrong = [name for name, vtags in chosen.items()
                 if not any(_any_allocator(t, asleep=asleep) for t in vtags)]
        if wrong:
            raise SleepStateError(refusal.format(tag=tag, names=sorted(wrong)))
        return [t for vtags in chosen.values() for t in vtags
                if _any_allocator(t, asleep=asleep)]

    def _with_memory(self, tag) -> dict[str, list[str]]:
        """torch_memory_saver tag -> its vmm_core tags that have memory (tags with none
        left out: pausing or resuming them is a no-op)."""
        from ..memory import tagged

        if tag is not None and not isinstance(tag, str):
            raise ValueError(f"tag must be a string or None (every tag), got {tag!r}")
        alive = set(tagged.tags())
        with _lock:
            names = list(_tags) if not tag else [tag]  # "": every tag, as it reads it
            chosen = {name: sorted(t for t in _tags.get(name, ()) if t in alive)
                      for name in names}
        return {name: vtags for name, vtags in chosen.items() if vtags}

    def _claim(self, tag: str, cpu_backup: bool) -> str:
        vtag = _vmm_tag(tag, bool(cpu_backup))
        with _lock:
            _tags.setdefault(tag, set()).add(vtag)
        return vtag

    # ---------------------------------------------------------------- CPU backup
    def get_cpu_backup(self, x, zero_copy: bool = False):
        """The host copy of tensor ``x`` made by the last pause of its region: while
        paused with a CPU backup, or after a resume while the copy is retained
        (``retain_cpu_backup``, vmm_core's default); None when no copy holds it (the
        region has no backup and runs, or the copy was given back).  A clone, unless
        ``zero_copy`` (a view of the copy, valid until a resume gives it back)."""
        from ..memory import tagged
        from ..memory.torch_views import raw_tensor

        self._ensure_initialized()
        if not x.is_contiguous():
            raise VMMError(f"get_cpu_backup: x of shape {tuple(x.shape)} and strides "
                           f"{tuple(x.stride())} is not contiguous; pass x.contiguous()'s "
                           f"source tensor or a contiguous view")
        address, nbytes = int(x.data_ptr()), int(x.numel() * x.element_size())
        for vtag in vmm_tags():
            for alloc in tagged.allocators(vtag):
                if not _holds(alloc, address):
                    continue
                host = alloc.host_copy_address(address, max(nbytes, 1))
                if host is None:
                    if alloc.asleep:
                        raise SleepStateError(
                            f"get_cpu_backup: x lies in memory tagged "
                            f"{_tms_names([vtag])} that is paused without a CPU backup "
                            f"(its bytes are gone); make its region with "
                            f"enable_cpu_backup=True to keep them")
                    return None
                view = raw_tensor(host, nbytes, "cpu").view(x.dtype).view(x.shape)
                return view if zero_copy else view.clone()
        raise VMMError(f"get_cpu_backup: x (at {address:#x}) was not allocated inside "
                       f"region() or cuda_graph() of torch_memory_saver")

    def set_disk_backup_dir(self, path: str):
        raise _no_disk_backup("set_disk_backup_dir()")

    # ---------------------------------------------------------------- settings
    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> HookMode:
        """Accepted for compatibility: both modes behave the same here, since vmm_core
        routes allocations through the framework's pluggable allocator (graphs can be
        paused in either)."""
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
        if value:
            raise VMMError(
                f"memory_margin_bytes={value}: vmm_core has no device-wide free-memory "
                f"reading to refuse allocations against; leave the headroom in the engine "
                f"(its memory fraction) instead, or set 0")

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether ``resume`` keeps the host copies (pinned) for the next pause.

        vmm_core keeps them by default (torch_memory_saver does not): every later pause
        then copies at the pinned rate, at the cost of host memory the size of the
        backed-up regions while running.  ``retain_cpu_backup = False`` (or
        ``TMS_RETAIN_CPU_BACKUP=0``) gives them back at each resume."""
        self._ensure_initialized()
        if self._retain is not None:
            return self._retain
        from ..memory import offload

        return offload.config().keep_host_buffers

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"retain_cpu_backup must be True or False, got {value!r}")
        self._ensure_initialized()
        self._retain = value


# -------------------------------------------------------------------- helpers
def _check_backup_args(enable_cpu_backup, cpu_backup_backend) -> None:
    if not isinstance(enable_cpu_backup, bool):
        raise ValueError(f"enable_cpu_backup must be True or False, got {enable_cpu_backup!r}")
    if cpu_backup_backend is None:
        return
    if not enable_cpu_backup:
        raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
    if cpu_backup_backend not in ("mmap", "pinned"):
        raise ValueError(f"cpu_backup_backend must be 'mmap' or 'pinned', got "
                         f"{cpu_backup_backend!r}")


def _no_disk_backup(what: str) -> VMMError:
    return VMMError(f"{what}: vmm_core does not back paused memory up to disk; use "
                    f"enable_cpu_backup=True (host memory), or torch_memory_saver itself for "
                    f"memory that must go to disk")


def _any_allocator(vtag: str, asleep: bool) -> bool:
    from ..memory import tagged

    return any(a.asleep == asleep for a in tagged.allocators(vtag))


def _holds(alloc, address: int) -> bool:
    try:
        alloc.translate(address, alloc.current_space)
    except VMMError:
        return False
    return True


def _tms_names(vtags: list[str]) -> list[str]:
    return sorted({t[len(_PREFIX):].removesuffix(_BACKUP) for t in vtags})


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return None  # not weakly referenceable: its pool stays until the process ends


def _close_unused_private_pools() -> None:
    """Close the pools of dropped private captures that hold nothing alive (torch frees
    a private pool with its graph).  One whose outputs are still alive stays."""
    with _lock:
        for item in list(_private):
            ref, key = item
            if ref is None or ref() is not None:
                continue
            pool = _graph_pools.get(key)
            alloc = pool.allocator if pool is not None else None
            if pool is None or alloc is None or alloc.closed:
                _private.remove(item)
                _graph_pools.pop(key, None)
                continue
            try:
                alive = alloc.asleep or bool(alloc.live_ranges and alloc.live_ranges())
            except Exception:  # noqa: BLE001 - a pool we cannot read is kept, not closed
                alive = True
            if alive:
                continue  # outputs still alive (or paused): checked again later
            _private.remove(item)
            _graph_pools.pop(key, None)
            pool.close()


# -------------------------------------------------------------------- the alias
_ALIAS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tms_alias")
#: the module name the alias directory serves (the package it holds)
_ALIAS_NAME = "torch_memory_saver"


def alias_path() -> str:
    """The directory whose ``torch_memory_saver`` package is this module: first on
    PYTHONPATH, it makes ``import torch_memory_saver`` resolve here."""
    return _ALIAS_DIR


def _alias_active() -> bool:
    module = sys.modules.get(_ALIAS_NAME)
    return module is not None and getattr(module, "__vmm_core_alias__", False)


def _with_alias_on_pythonpath(env: dict) -> None:
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _ALIAS_DIR not in parts:
        env["PYTHONPATH"] = os.pathsep.join([_ALIAS_DIR] + parts)


def install() -> None:
    """Make ``import torch_memory_saver`` resolve to this module, in this process and in
    the processes it starts from now on (PYTHONPATH): for code that cannot be edited.

    Call it before anything imports torch_memory_saver; once the real package is
    imported its objects are in use, and this raises VMMError instead of mixing both."""
    import importlib

    existing = sys.modules.get(_ALIAS_NAME)
    if existing is not None and not getattr(existing, "__vmm_core_alias__", False):
        raise VMMError(f"torch_memory_saver is imported already from "
                       f"{getattr(existing, '__file__', existing)!r}; call "
                       f"vmm_core.integrations.torch_memory_saver.install() before anything "
                       f"imports it, or put {_ALIAS_DIR!r} first on PYTHONPATH")
    if _ALIAS_DIR not in sys.path:
        sys.path.insert(0, _ALIAS_DIR)
    _with_alias_on_pythonpath(os.environ)  # type: ignore[arg-type]
    module = importlib.import_module(_ALIAS_NAME)
    if not getattr(module, "__vmm_core_alias__", False):  # a stale entry on sys.path
        raise VMMError(f"import torch_memory_saver found {module.__file__!r}, not the "
                       f"alias in {_ALIAS_DIR!r}")


@contextlib.contextmanager
def configure_subprocess():
    """torch_memory_saver sets LD_PRELOAD for processes started inside; here, when
    ``torch_memory_saver`` resolves to this module through the alias, processes started
    inside get the alias on their PYTHONPATH (nothing else is needed)."""
    if not _alias_active():
        yield
        return
    previous = os.environ.get("PYTHONPATH")
    _with_alias_on_pythonpath(os.environ)  # type: ignore[arg-type]
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


#: the global object, as torch_memory_saver's ``torch_memory_saver``
torch_memory_saver = TorchMemorySaver()


if __name__ == "__main__":
    print(alias_path())
