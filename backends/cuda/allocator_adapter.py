"""torch.cuda.MemPool pools whose segments come from the vmm_core C shim.

One ``CUDAPluggableAllocator`` is created per process and kept alive forever: the caching
allocator may call its free entry point at any time, up to interpreter shutdown, and the
MemPools built on it must never outlive it.
"""

from __future__ import annotations

from vmm_core.errors import BackendUnavailableError
from vmm_core.memory.adapter import AllocatorAdapter
from vmm_core.memory.shim import ALLOC_SYMBOL, FREE_SYMBOL, load_shim
from vmm_core.versions import installed_version, version_tuple

__all__ = ["CudaAllocatorAdapter", "check_torch"]

_pluggable = None  # process lifetime


def check_torch() -> None:
    """Refuse torch < 2.8 (capture ignores custom pools) and expandable segments."""
    import os

    version = installed_version("torch")
    if version_tuple(version) < (2, 8):
        raise BackendUnavailableError(
            f"torch {version} cannot route graph-capture allocations to a custom allocator "
            f"pool (it silently uses the default pool): upgrade to torch>=2.8, or pass "
            f"reuse='shared'")
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
        _pluggable = CUDAPluggableAllocator(shim.path, ALLOC_SYMBOL, FREE_SYMBOL)
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
        return torch.cuda.MemPool(_allocator().allocator())

    def use_pool(self, pool):
        import torch

        return torch.cuda.use_mem_pool(pool, device=self.device)

    def pool_handle(self, pool):
        return pool.id

    def live_blocks(self, pool) -> list[tuple[int, int]]:
        # "active_pending_free" blocks were freed during capture with stream uses
        # recorded; the allocator releases them once their events complete: not escapes
        return [(int(block["address"]), int(block["size"]))
                for segment in _pool_segments(pool, self.device)
                for block in segment.get("blocks", [])
                if block.get("state") == "active_allocated"]

    def release_pool(self, pool) -> None:
        return None  # dropping the last reference makes the pool freeable

    def flush(self) -> None:
        import torch

        torch.cuda.empty_cache()  # frees the segments of freeable (dropped) pools


def _pool_segments(pool, device: int) -> list[dict]:
    import torch

    snapshot = getattr(pool, "snapshot", None)
    if snapshot is None:
        segments = torch.cuda.memory_snapshot()
    else:
        try:
            segments = snapshot(include_traces=False)  # torch >= 2.12: much cheaper
        except TypeError:
            segments = snapshot()
    return [s for s in segments
            if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)
            and s.get("device", device) == device]
