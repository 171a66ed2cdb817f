"""Tagged memory: put framework allocations under a tag, then sleep and wake by tag.

``region(tag)`` routes the calling thread's framework allocations into a pool served by
a SharedVMMAllocator registered under ``tag``; GraphExecutors register their graph
allocator under their own tag ("graph" by default).  ``sleep`` releases the physical
pages of tagged allocators (copying them to host first for tags in ``offload``) and
``wake_up`` re-creates them at the same virtual addresses, so tensors and captured
graphs that point there stay valid.
"""

from __future__ import annotations

import contextlib
import threading

from . import routing
from ..errors import SleepStateError, VMMError

__all__ = ["region", "sleep", "wake_up", "tags", "allocators", "register", "unregister"]

_registry: dict[str, list] = {}
_pools: dict[int, object] = {}  # id(allocator) -> framework pool of a region
_region_allocators: dict[tuple, object] = {}
_lock = threading.RLock()


def register(tag: str, allocator) -> None:
    """Put ``allocator`` under ``tag`` (executors and regions call this)."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag must be a non-empty string, got {tag!r}")
    with _lock:
        allocs = _registry.setdefault(tag, [])
        if not any(a is allocator for a in allocs):
            allocs.append(allocator)


def unregister(tag: str, allocator) -> None:
    with _lock:
        allocs = [a for a in _registry.get(tag, []) if a is not allocator]
        if allocs:
            _registry[tag] = allocs
        else:
            _registry.pop(tag, None)


def tags() -> list[str]:
    """Tags that currently have memory."""
    with _lock:
        return sorted(t for t, allocs in _registry.items() if any(not a.closed for a in allocs))


def allocators(tag: str) -> list:
    with _lock:
        return [a for a in _registry.get(tag, []) if not a.closed]


def _resolve(tag_list) -> list[str]:
    if tag_list is None:
        return tags()
    if isinstance(tag_list, str):
        tag_list = [tag_list]
    tag_list = list(tag_list)
    unknown = [t for t in tag_list if t not in _registry]
    if unknown:
        raise VMMError(f"no memory is tagged {unknown}; known tags: {tags()}")
    return tag_list


@contextlib.contextmanager
def region(tag: str = "weights", backend=None, device: int | None = None,
           reserve_bytes: int | None = None):
    """Framework allocations made inside come from VMM memory under ``tag``.

    Yields the tag's SharedVMMAllocator (on the host backend, where the framework's CPU
    allocator cannot be redirected, allocate from it directly).  Entering a region of a
    sleeping tag raises SleepStateError: its memory is not mapped.
    """
    import vmm_core

    be = backend if isinstance(backend, vmm_core.Backend) else vmm_core.get_backend(backend)
    if device is None:
        device = _current_device(be)
    with _lock:
        key = (tag, be.name, device)
        alloc = _region_allocators.get(key)
        if alloc is None or alloc.closed:
            alloc = vmm_core.SharedVMMAllocator(be, device=device, reserve_bytes=reserve_bytes,
                                                tag=tag)
            _region_allocators[key] = alloc
            register(tag, alloc)
        adapter = be.allocator_adapter(device)
        pool = _pools.get(id(alloc))
        if pool is None and adapter is not None and adapter.supports_pools:
            with routing.target(device, alloc):
                pool = _pools[id(alloc)] = adapter.new_pool()
    if alloc.asleep:
        raise SleepStateError(f"memory tagged {tag!r} is asleep; call "
                              f"vmm_core.wake_up({tag!r}) before allocating in its region")
    with routing.target(device, alloc):
        ctx = adapter.use_pool(pool) if pool is not None else contextlib.nullcontext()
        with ctx:
            yield alloc


def _current_device(backend) -> int:
    """The framework's current device for this backend (PyTorch's ``device=None``)."""
    ops = backend.graph_ops(0)
    if ops is None or ops.device_type == "cpu":
        return 0
    import torch

    module = getattr(torch, ops.device_type, None)  # torch.cuda, torch.npu, torch.mlu
    return module.current_device() if module is not None else 0


def sleep(tags=None, offload=(), group=None) -> None:
    """Release the physical memory of ``tags`` (default: all); keep virtual addresses.

    Tags listed in ``offload`` are copied to (pinned) host memory first and restored by
    :func:`wake_up`; the others are discarded.  Device work that may still read the
    memory is synchronized before unmapping.  Sleeping a sleeping tag is a no-op.
    With a ``torch.distributed`` ``group``, every rank sleeps or none does
    (:mod:`vmm_core.memory.collective`).
    """
    if group is not None:
        from . import collective

        return collective.sleep(group, tags, offload)
    if isinstance(offload, str):
        offload = (offload,)
    offload = set(offload)
    with _lock:
        chosen = _resolve(tags)
        unknown = offload - set(chosen)
        if unknown:
            raise VMMError(f"offload names {sorted(unknown)}, which are not being put to "
                           f"sleep ({chosen})")
        for tag in chosen:
            for alloc in allocators(tag):
                alloc.sleep(offload=tag in offload)


def wake_up(tags=None, keep_host_buffers: bool = False, group=None) -> None:
    """Re-create the physical memory of ``tags`` (default: all) at the same addresses.

    Offloaded bytes are copied back.  On OutOfMemoryError the allocators already woken
    stay awake and the rest stay asleep (none is half-mapped): free memory and call
    again.  Waking an awake tag is a no-op.  With a ``torch.distributed`` ``group``,
    every rank wakes or none does (:mod:`vmm_core.memory.collective`).
    """
    if group is not None:
        from . import collective

        return collective.wake_up(group, tags, keep_host_buffers)
    with _lock:
        for tag in _resolve(tags):
            for alloc in allocators(tag):
                alloc.wake(keep_host_buffers=keep_host_buffers)
