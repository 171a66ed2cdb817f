"""``TMS_INIT_ENABLE=1``: every allocation of the process in torch_memory_saver's default
region, from the process's start, as RL training engines (slime, miles, AReaL) run their
training processes.

torch_memory_saver does it by intercepting ``cudaMalloc`` (its ``LD_PRELOAD`` library).
Here the framework's allocator routes the whole process into vmm_core memory tagged
``tms:default`` (``:cpu_backup`` with ``TMS_INIT_ENABLE_CPU_BACKUP``, ``:disk_backup`` with
``TMS_INIT_ENABLE_DISK_BACKUP``) through :mod:`vmm_core.memory.whole_process`, with the
caching allocator in front; regions nest in it with their own tags on their threads, and
``disable()`` takes a thread out.

The routing must begin before the first allocation, and without touching the device
earlier than the process would (a launcher may set ``CUDA_VISIBLE_DEVICES`` after the
interpreter started): :func:`arm`, called at interpreter start by the alias's
``sitecustomize`` and again when ``torch_memory_saver`` is imported, waits for torch and
queues :func:`start` with torch's lazy device initialization (``torch.cuda._lazy_call``,
which runs it right after torch initializes its device, before the allocation that
triggered it).  A start that fails there is not raised into torch's initialization; the
next torch_memory_saver call raises it.  The first torch_memory_saver call also starts
it (the host backend, where torch never initializes a device).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading

from . import settings, state

__all__ = ["arm", "start", "started"]

logger = logging.getLogger("vmm_core")

_lock = threading.RLock()
_armed = False
_routing = None
_failure: BaseException | None = None


def started() -> bool:
    return _routing is not None


def _kind(s: settings.Settings) -> str:
    return "disk" if s.init_disk_backup else "cpu" if s.init_cpu_backup else "none"


def start(backend=None) -> None:
    """Route the process into the default region (idempotent)."""
    global _routing, _failure
    from ...memory import whole_process

    if _failure is not None:
        failure, _failure = _failure, None
        raise failure
    with _lock:
        if _routing is not None:
            return
        s = settings.settings()
        vtag = state.claim("default", _kind(s))
        _routing = whole_process.route_process(vtag, backend=backend)


def _start_at_device_init() -> None:
    global _failure
    try:
        start()
    except Exception as exc:  # noqa: BLE001 - never fail torch's initialization over it
        _failure = exc
        logger.error("TMS_INIT_ENABLE: the process's allocations could not be routed into "
                     "tagged memory (%s); the next torch_memory_saver call raises it", exc)


def _queue_with_torch() -> None:
    """Have torch start the routing when it initializes its device (now if it has)."""
    torch = sys.modules["torch"]
    for module in (getattr(torch, "cuda", None),):
        lazy_call = getattr(module, "_lazy_call", None)
        if lazy_call is not None:
            lazy_call(_start_at_device_init)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Runs :func:`_queue_with_torch` once ``import torch`` has finished."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_queue(module):
            exec_module(module)
            _remove_finder()
            _queue_with_torch()

        loader.exec_module = exec_then_queue  # type: ignore[method-assign]
        return spec


_finder: _AfterTorch | None = None


def _remove_finder() -> None:
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


def arm() -> None:
    """When ``TMS_INIT_ENABLE`` asks for it, start the routing as soon as torch
    initializes its device (see the module docstring).  Costs nothing otherwise."""
    global _armed, _finder
    try:
        enabled = settings.bool_env("TMS_INIT_ENABLE")
    except Exception:  # noqa: BLE001 - a bad value is raised by the first call
        return
    if not enabled:
        return
    with _lock:
        if _armed:
            return
        _armed = True
        if "torch" in sys.modules and hasattr(sys.modules["torch"], "cuda"):
            _queue_with_torch()
        else:
            _finder = _AfterTorch()
            sys.meta_path.insert(0, _finder)
