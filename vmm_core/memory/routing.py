"""Which SharedVMMAllocator serves the C shim's alloc calls on this thread.

Every framework pool backed by vmm_core uses the same C entry point, which carries no
pool identity.  Whoever opens a VMM pool (a capture, a tagged region) pushes its
allocator here for the current thread, matching how the frameworks scope
``use_mem_pool`` and graph capture to the calling thread.
"""

from __future__ import annotations

import contextlib
import threading

from . import free_margin

__all__ = ["target", "current_target", "alloc_callback", "last_error", "framework_routed"]

_tls = threading.local()


def _stack(device: int) -> list:
    stacks = getattr(_tls, "stacks", None)
    if stacks is None:
        stacks = _tls.stacks = {}
    return stacks.setdefault(device, [])


@contextlib.contextmanager
def target(device: int, allocator):
    """Route this thread's shim allocations on ``device`` to ``allocator``."""
    stack = _stack(device)
    depth = len(stack)
    stack.append(allocator)
    _tls.last_error = None  # an error reported later belongs to this scope
    try:
        yield allocator
    finally:
        _remove(stack, depth, allocator)


def _remove(stack: list, depth: int, allocator) -> None:
    """Take this block's own entry off: a block abandoned unfinished and closed later
    (by the garbage collector, on any thread) must not take away the entry of a block
    opened since, whose allocations would then go to another allocator.  The entry is
    where it was pushed, or lower where entries below it went first."""
    for index in range(min(depth, len(stack) - 1), -1, -1):
        if stack[index] is allocator:
            del stack[index]
            return


def framework_routed(backend, device: int) -> bool:
    """Whether framework tensors made inside a region or a capture space land in vmm_core
    memory: not on a backend without device graphs, whose framework allocator (the CPU
    allocator) cannot be redirected; code there allocates from the allocator itself."""
    ops = backend.graph_ops(device)
    return ops is not None and ops.device_type != "cpu"


def current_target(device: int):
    """The allocator this thread's allocations on ``device`` are routed to now, or None.

    Core calls ``AllocatorAdapter.new_pool()`` inside :func:`target`, so an adapter whose
    framework cannot be redirected (the host's) finds here the allocator its pool is for;
    backends reach it as ``vmm_core.plugin.routed_allocator``."""
    stack = _stack(device)
    return stack[-1] if stack else None


def alloc_callback(size: int, device: int, stream) -> int:
    """Called by the C shim (under the GIL); returns an address or 0 (= out of memory).
    An interrupt once the address is had hands it out all the same."""
    address = 0
    try:
        allocator = current_target(device)
        if allocator is None:
            raise RuntimeError(
                f"no vmm_core pool is active on this thread for device {device}: the "
                f"framework asked the vmm_core allocator for {size} bytes outside a "
                f"vmm_core capture or region")
        if free_margin.margin():  # the common case pays one read, not a message
            free_margin.check(allocator.backend, allocator.device, int(size),
                              f"an allocation of {int(size)} bytes in memory tagged "
                              f"{allocator.tag!r}")
        address = allocator.allocate(int(size))
    except BaseException as exc:  # never propagate into C
        _tls.last_error = exc
    return address


def last_error():
    """The exception behind this thread's most recent failed shim allocation since it
    last entered :func:`target` (or None)."""
    return getattr(_tls, "last_error", None)
