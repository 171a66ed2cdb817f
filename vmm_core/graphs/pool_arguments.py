"""Every argument of a GraphPool, checked before anything is made.

A pool registers a tag, claims address space and may create an allocator; a bad argument
found halfway would leave some of that behind.  :func:`check_pool_arguments` finds every
bad value first, with the remedy in the message, and resolves the defaults (backend,
device) into one :class:`PoolArguments` the pool is then wired from.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import registry
from ..backend import Backend
from ..errors import AllocationError, VMMError
from ..memory.allocator import SharedVMMAllocator, check_device, check_size
from ..memory.tag_state import check_tag, tag_list
from .executables import policy_of

__all__ = ["PoolArguments", "check_pool_arguments", "check_reuse", "REUSE_MODES",
           "BENCHMARK_BASELINES", "CLOSED_ALLOCATOR"]

#: what GraphPool takes as ``reuse``: "vmm" (a space per key) and "single" (every key
#: in one space, as captures sharing one torch pool handle)
REUSE_MODES = ("vmm", "single")

#: reuse values that name plain torch pools, which are the benchmark's baselines, not
#: library modes: value -> the pool that stands for it (GraphExecutor takes one as
#: ``pool=``), named in the error such a value gets
BENCHMARK_BASELINES = {
    "shared": "vmm_bench.torch_pools.SharedTorchPool",
    "private": "vmm_bench.torch_pools.PrivateTorchPool",
}

CLOSED_ALLOCATOR = (
    "GraphPool was given a closed allocator; pass an open one (an allocator a GraphPool "
    "created closes with the last pool on it, a dropped one too: to keep one across "
    "pools, create the SharedVMMAllocator yourself and pass it to every pool)")


@dataclass(frozen=True)
class PoolArguments:
    """A GraphPool's arguments, checked, with the defaults resolved."""

    backend: Backend
    device: int
    tag: str
    reuse: str
    allocator: SharedVMMAllocator | None
    reads: frozenset | None
    reserve_bytes: int | None
    executables: object


def check_reuse(who: str, reuse, modes: tuple) -> str:
    """``reuse`` if it is one of ``modes``; ValueError naming the benchmark's pool for a
    mode that moved there, or the modes there are."""
    if isinstance(reuse, str) and reuse in BENCHMARK_BASELINES:
        replacement = BENCHMARK_BASELINES[reuse]
        raise ValueError(
            f"{who}(reuse={reuse!r}): plain torch pools are not a mode of the library; "
            f"they are the benchmark's baselines: pass pool={replacement}(...) to "
            f"GraphExecutor (or capture into that pool's spaces directly). The library "
            f"modes are {modes}")
    if reuse not in modes:
        raise ValueError(f"reuse must be one of {modes}, got {reuse!r}")
    return reuse


def check_pool_arguments(device, *, backend, tag, allocator, reuse, reads, reserve_bytes,
                         executables) -> PoolArguments:
    """Every argument of ``GraphPool(...)`` checked (ValueError, TypeError,
    AllocationError or VMMError naming the remedy), nothing made yet."""
    from ..memory import tagged

    check_reuse("GraphPool", reuse, REUSE_MODES)
    check_tag(tag)
    if allocator is not None and not isinstance(allocator, SharedVMMAllocator):
        raise TypeError(f"allocator must be a SharedVMMAllocator (to share its pages "
                        f"with other GraphPools) or None, got {allocator!r}")
    if allocator is not None and reuse == "single":
        raise VMMError("GraphPool(reuse='single') captures into one space of its own "
                       "allocator (a space shared with other pools would alias their "
                       "blocks, which 'single' lets outlive a capture); drop "
                       "allocator=, or use reuse='vmm' to share pages between families")
    if allocator is not None and allocator.closed:
        raise VMMError(CLOSED_ALLOCATOR)
    if reserve_bytes is not None:
        reserve_bytes = check_size("GraphPool reserve_bytes", reserve_bytes, "reserve less")
        if allocator is not None:
            raise AllocationError(
                "GraphPool(reserve_bytes=...) sizes the allocator the pool creates; "
                "with allocator= pass reserve_bytes to that SharedVMMAllocator instead")
    policy_of(executables)  # its type; whether the backend can is the wiring's question
    reads = None if reads is None else frozenset(tag_list(reads, "reads"))
    if backend is None and allocator is not None:
        backend = allocator.backend
    backend = registry.resolve(backend)
    if device is None:
        device = allocator.device if allocator is not None else \
            tagged.current_device(backend)
    device = check_device(device)
    if allocator is not None and (allocator.backend is not backend
                                  or allocator.device != device):
        raise VMMError(f"GraphPool on {backend.name}:{device} was given an allocator of "
                       f"{allocator.backend.name}:{allocator.device}; pass one of the same "
                       f"backend and device")
    return PoolArguments(backend=backend, device=device, tag=tag, reuse=reuse,
                         allocator=allocator, reads=reads, reserve_bytes=reserve_bytes,
                         executables=executables)
