"""torch.cuda.MemPool pools whose segments come from the vmm_core C shim.

One ``CUDAPluggableAllocator`` is created per process and kept alive forever (past
interpreter shutdown: :func:`vmm_core.plugin.keep_for_process_life`): the caching
allocator may call its free entry point at any time, up to the destructor of the last
MemPool, and the MemPools built on it must never outlive it.
"""

from __future__ import annotations

import contextlib
import functools
import logging

from vmm_core.errors import BackendUnavailableError
from vmm_core.plugin import (
    ALLOC_SYMBOL,
    FREE_SYMBOL,
    AllocatorAdapter,
    installed_version,
    keep_for_process_life,
    load_shim,
    version_tuple,
)

from .pool_snapshot import pool_segments

logger = logging.getLogger("vmm_core")

__all__ = ["CudaAllocatorAdapter", "check_torch", "prime_library_workspaces"]

_pluggable = None  # process lifetime


def check_torch() -> None:
    """Refuse torch < 2.8 (capture ignores custom pools) and expandable segments."""
    import os

    version = installed_version("torch")
    if version_tuple(version) < (2, 8):
        raise BackendUnavailableError(
            f"torch {version} cannot route graph-capture allocations to a custom allocator "
            f"pool (it silently uses the default pool): upgrade to torch>=2.8, or capture "
            f"into torch's own pools (torch.cuda.graph_pool_handle()) without vmm_core")
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + \
        os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise BackendUnavailableError(
            "PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True bypasses "
            "custom-allocator pools (torch>=2.10) or raises (2.7-2.9): unset it for "
            "processes that use vmm_core pools")


def _allocator():
    global _pluggable
    if _pluggable is None:
        from torch.cuda.memory import CUDAPluggableAllocator

        shim = load_shim()
        shim.ensure_routing()
        _pluggable = keep_for_process_life(
            CUDAPluggableAllocator(shim.path, ALLOC_SYMBOL, FREE_SYMBOL))
    return _pluggable


class CudaAllocatorAdapter(AllocatorAdapter):
    def __init__(self, device: int) -> None:
        self.device = device

    def prepare(self) -> None:
        check_torch()
        _allocator()

    def new_pool(self):
        import torch

        if _pluggable is None:
            self.prepare()  # checks once; importlib.metadata costs ~0.5 ms per call
        from .pool_routing import keep

        # on this adapter's device, where release_pool hands its use back; never
        # destroyed, even where an error drops it unreleased (pool_routing.let_go)
        with torch.cuda.device(self.device):
            return keep(torch.cuda.MemPool(_allocator().allocator()))

    def use_pool(self, pool):
        import torch

        prime_library_workspaces(self.device)
        return torch.cuda.use_mem_pool(pool, device=self.device)

    def pool_handle(self, pool):
        return pool.id

    def live_blocks(self, pool) -> list[tuple[int, int]]:
        # "active_pending_free" blocks were freed during capture with stream uses
        # recorded; the allocator releases them once their events complete: not escapes
        return [(int(block["address"]), int(block["size"]))
                for segment in pool_segments(pool, self.device)
                for block in segment.get("blocks", [])
                if block.get("state") == "active_allocated"]

    def free_blocks(self, pool) -> list[tuple[int, int]]:
        return [(int(block["address"]), int(block["size"]))
                for segment in pool_segments(pool, self.device)
                for block in segment.get("blocks", [])
                if block.get("state") == "inactive"]

    def use_framework_allocator(self):
        return _default_pool_block(self.device)

    def release_pool(self, pool) -> None:
        """Let go of the pool without destroying it: its destructor would abort the
        process while any routing or capture is underway on the device, on any thread
        (:func:`vmm_backends.cuda.pool_routing.let_go`); :meth:`flush` frees its
        segments."""
        from .pool_routing import let_go

        let_go(self.device, pool)

    def route_process(self, path: str, alloc_symbol: str, free_symbol: str):
        """``torch._C._cuda_beginAllocateToPool`` over a MemPool of the pluggable
        allocator, kept behind every later routing; devices the process makes current
        later are routed then (:mod:`vmm_backends.cuda.pool_routing`)."""
        from .pool_routing import route_process

        check_torch()
        return route_process(self.device, path, alloc_symbol, free_symbol)

    def alias_pool(self, handle, pool_handle):
        from .pool_routing import alias_pool

        return alias_pool(handle, pool_handle)

    def flush(self) -> None:
        import torch

        # frees the segments of pools let go of, also while a routing or a capture is
        # underway (torch then skips only what it does with none; freeing vmm_core's
        # segments calls no driver function, the shim's free only forgets them)
        torch.cuda.empty_cache()


def prime_library_workspaces(device: int) -> None:
    """Create the current stream's cuBLAS and cuBLASLt workspaces now, outside every pool.

    PyTorch makes one cuBLAS workspace (32 MiB on the H100) and one cuBLASLt workspace
    (1 MiB) per (handle, stream) on the first matrix multiply that needs each, from
    whatever pool the thread routes to, and keeps them for the life of the process.
    Made inside a tagged region they would live in tagged memory: once that tag sleeps
    without offload, or its allocator is closed, later multiplies on that stream write
    into unmapped memory (an illegal memory access: a model's rotary table computed while
    its weights load in ``region("weights")`` puts the default stream's workspace
    there).  Asking for the cuBLAS handle creates the first;
    only a multiply on the cuBLASLt path creates the second (torch 2.11 exposes no other
    way), so a tiny half-precision ``addmm`` with a bias runs here.  Made in the default
    pool, where nothing sleeps, they are found there by every later multiply.

    It covers the stream current when the region is entered; a stream first made current
    inside the region is the caller's to prime (docs/failures.md).  Inside
    a capture nothing runs: the capture stream's workspaces come from its warm-up."""
    import torch

    with torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_blas_handle()
        ones = torch.ones(8, 8, device=f"cuda:{device}", dtype=torch.float16)
        torch.addmm(ones[0], ones, ones)


@contextlib.contextmanager
def _default_pool_block(device: int):
    """The thread's allocations go to a pool of torch's own allocator (cudaMalloc) for
    the block, even inside a vmm_core region or the process-wide routing; what was freed
    inside is given back to the device when the block ends (torch_memory_saver's
    ``disable()`` makes a pool per block and drops it after).

    A fresh pool per block, let go of after it, never destroyed
    (:func:`vmm_backends.cuda.pool_routing.let_go`: these blocks run inside a routing,
    a region's, a capture's or the whole process's), and ``torch.cuda.empty_cache()``
    releases its unused segments, which torch does for pools let go of while routings
    are active.  Tensors still alive after the block keep
    their segments until they are freed and the cache is emptied again.  Inside a
    capture on this thread (begun before the block or inside it) the pool is kept as it
    is, never released: the captured graph may use its memory.  Another thread's
    capture in torch's global mode is not seen: emptying the cache there fails (logged,
    never raised) and breaks that capture, as any ``torch.cuda.empty_cache()`` would."""
    import torch

    from .pool_routing import keep

    with torch.cuda.device(device):  # a MemPool belongs to the current device
        # kept from the start: a pool of a block inside a capture is never let go of
        pool = keep(torch.cuda.MemPool())
    capturing = torch.cuda.is_current_stream_capturing()
    try:
        with torch.cuda.use_mem_pool(pool, device=device):
            yield
    finally:
        # a graph captured here may use the pool's memory: then it stays
        try:
            keep = capturing or torch.cuda.is_current_stream_capturing()
        except Exception:  # noqa: BLE001 - a device in error: the block's error stands
            keep = True
        if not keep:
            _give_back(device, pool)


def _give_back(device: int, pool) -> None:
    """Drop ``pool``'s own reference and empty torch's cache; never raises (it runs as
    a block ends, maybe with the block's own error in flight)."""
    import torch

    from .pool_routing import let_go

    steps = (("releasing its pool", functools.partial(let_go, device, pool)),
             ("emptying torch's cache", torch.cuda.empty_cache))
    for step, call in steps:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the block's own error, if any, stands
            logger.warning("leaving outside_regions(): %s failed (%s); what was freed in "
                           "the block stays cached until torch gives it back", step, exc)
