"""Allocator adapter over torch_mlu's MLUPluggableAllocator, loaded on the vmm_core C shim.

torch_mlu (Cambricon/torch_mlu, every branch in the public repository up to r2.4_develop)
has ``torch.mlu.memory.MLUPluggableAllocator(path_to_so_file, alloc_fn_name, free_fn_name)``
and ``torch.mlu.memory.change_current_allocator(allocator)``, but no ``MemPool`` and no
``use_mem_pool``: a pluggable allocator can only replace the process-wide caching allocator.
So there is no framework pool that one capture could own, ``supports_pools`` is False, the
backend declares ``graph_pool=False`` and GraphExecutor captures every graph into one shared
pool (``torch.mlu.graph_pool_handle()``) instead of one VMM space per capture.

What remains useful here is :meth:`MLUAllocatorAdapter.pluggable_allocator` (the shim
loaded as an MLUPluggableAllocator, created once per process because the frameworks keep
allocator objects alive) and :meth:`MLUAllocatorAdapter.install_as_current_allocator` for
callers that route *every* MLU allocation of the process through vmm_core.

Verified only against the CPU stand-in in ``tests/standins/torch_mlu``; no MLU hardware.
"""

from __future__ import annotations

import threading

from vmm_core.errors import CaptureError
from vmm_core.plugin import ALLOC_SYMBOL, FREE_SYMBOL, AllocatorAdapter, load_shim

__all__ = ["MLUAllocatorAdapter"]

_lock = threading.Lock()
_allocator = None  # the one MLUPluggableAllocator of this process (never released)


def _mlu():
    import torch
    import torch_mlu  # noqa: F401  (registers torch.mlu)

    return torch.mlu


def _no_pool(what: str) -> CaptureError:
    return CaptureError(
        f"{what}: the installed torch_mlu has no MemPool usable during graph capture "
        f"(only MLUPluggableAllocator + change_current_allocator, process-wide), so vmm_core "
        f"cannot give each capture its own pool on MLU. The mlu backend declares "
        f"graph_pool=False and GraphExecutor falls back to one shared pool "
        f"(torch.mlu.graph_pool_handle()) for all graphs; do not call the pool methods of "
        f"this adapter")


class MLUAllocatorAdapter(AllocatorAdapter):
    """Shim-backed MLUPluggableAllocator; no per-capture pools (torch_mlu has no MemPool)."""

    supports_pools = False

    def __init__(self, device: int = 0) -> None:
        self.device = device

    # -- what torch_mlu offers ------------------------------------------------------------
    def pluggable_allocator(self):
        """The C shim as a ``torch.mlu.memory.MLUPluggableAllocator`` (one per process)."""
        global _allocator
        with _lock:
            if _allocator is None:
                shim = load_shim()
                shim.ensure_routing()
                _allocator = _mlu().memory.MLUPluggableAllocator(
                    shim.path, ALLOC_SYMBOL, FREE_SYMBOL)
            return _allocator

    def install_as_current_allocator(self) -> None:
        """Route every MLU allocation of this process to vmm_core (irreversible).

        torch_mlu refuses the switch once its caching allocator was used, and afterwards
        every allocation needs vmm_core to route the thread to an allocator (a region or a
        capture space) or it fails as out of memory; only embedders that own all
        allocations should call this.
        """
        _mlu().memory.change_current_allocator(self.pluggable_allocator())

    # -- AllocatorAdapter pool API: not available on torch_mlu ----------------------------
    def new_pool(self):
        raise _no_pool("MLUAllocatorAdapter.new_pool")

    def use_pool(self, pool):
        raise _no_pool("MLUAllocatorAdapter.use_pool")

    def pool_handle(self, pool):
        raise _no_pool("MLUAllocatorAdapter.pool_handle")

    def live_blocks(self, pool) -> list[tuple[int, int]]:
        raise _no_pool("MLUAllocatorAdapter.live_blocks")
