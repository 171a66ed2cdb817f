"""torch_npu memory pools whose segments come from the vmm_core C shim.

torch_npu's custom allocator (``NPUPluggableAllocator``) is used only inside
``torch.npu.use_mem_pool(pool)`` for a ``torch.npu.MemPool`` built on it, which is what a
capture needs: the graph's segments come from vmm_core's current virtual space.
``torch_npu`` is imported inside methods only (``import torch_npu`` fails without CANN),
and ``torch.npu`` is reached as ``torch_npu.npu`` (the module torch_npu registers under
that name).  Only exercised against the CPU stand-in in ``tests/standins/torch_npu``: not
run on Ascend hardware.

The release-path hazard: torch_npu releases before the fix below free every segment of a
released pool with ``aclrtFree``, even segments a custom allocator handed out.  Those
addresses belong to vmm_core's reservations, so such a release would corrupt driver
state.  The adapter therefore refuses those releases unless the user states that pools
are never released (``VMM_CORE_ASCEND_POOLS_NEVER_RELEASED=1``), and then keeps every
pool it creates alive so that the statement stays true.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import threading

from vmm_core.errors import BackendError, BackendUnavailableError
from vmm_core.plugin import (
    ALLOC_SYMBOL,
    FREE_SYMBOL,
    AllocatorAdapter,
    keep_for_process_life,
    load_shim,
)

__all__ = [
    "ENV_POOLS_NEVER_RELEASED",
    "SAFE_RELEASE_MIN_VERSION",
    "SAFE_RELEASE_MIN_DEV_DATE",
    "AscendAllocatorAdapter",
    "graph_pool_verdict",
    "release_path_verdict",
]

ENV_POOLS_NEVER_RELEASED = "VMM_CORE_ASCEND_POOLS_NEVER_RELEASED"

#: First torch_npu release line whose NPUCachingAllocator ``release_block`` returns a
#: custom-allocator pool's segments through that allocator's ``raw_delete`` instead of
#: ``aclrtFree``.  Source: Ascend/pytorch commit c1d20496828cb3b8f0b384a46478dab09104f676
#: ("[feat]mempool基本结构对齐pytorch", merged to master 2026-07-02, PR !39284), file
#: torch_npu/csrc/core/npu/NPUCachingAllocator.cpp.  It is in tag
#: v26.2.0-beta.1-pytorch2.13.0 and branch compatibility_release-pytorch2.13.0; the
#: release branches v2.8.0 ... v2.12.0 and v2.12.0-26.1.0 (version 2.12.0.post1) still
#: call aclrtFree unconditionally (checked 2026-08-22).
SAFE_RELEASE_MIN_VERSION = (2, 13, 0)
#: 2.13.0 nightlies (``.devYYYYMMDD``) built before the fix merged are unsafe too.
SAFE_RELEASE_MIN_DEV_DATE = 20260702

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")
_DEV = re.compile(r"\.dev(\d{8})")


def release_path_verdict(version: str | None, environ=None) -> tuple[bool, str]:
    """Whether pools of torch_npu ``version`` may be used, and the sentence saying why."""
    environ = os.environ if environ is None else environ
    if not version:
        return False, "torch_npu is not installed (pip install torch_npu matching torch)"
    match = _VERSION.match(version)
    parsed = tuple(int(x) for x in match.groups()) if match else None
    dev = _DEV.search(version)
    safe = parsed is not None and parsed >= SAFE_RELEASE_MIN_VERSION and not (
        dev and parsed[:2] == SAFE_RELEASE_MIN_VERSION[:2]
        and int(dev.group(1)) < SAFE_RELEASE_MIN_DEV_DATE)
    if safe:
        return True, (f"torch_npu {version} returns custom-allocator segments to the "
                      f"allocator's free function")
    cutoff = ".".join(map(str, SAFE_RELEASE_MIN_VERSION))
    if environ.get(ENV_POOLS_NEVER_RELEASED) == "1":
        return True, (f"torch_npu {version} would aclrtFree custom-allocator segments on pool "
                      f"release; allowed because {ENV_POOLS_NEVER_RELEASED}=1 states pools are "
                      f"never released (vmm_core keeps every pool alive)")
    return False, (f"torch_npu {version} (older than {cutoff}) frees custom-allocator "
                   f"segments with aclrtFree when a MemPool is released, which would free "
                   f"vmm_core's memory: upgrade torch_npu to >= {cutoff}, or set "
                   f"{ENV_POOLS_NEVER_RELEASED}=1 if your pools are never released")


def graph_pool_verdict() -> tuple[bool, str]:
    """The ``graph_pool`` capability from the installed torch_npu, without importing it."""
    try:
        version = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return release_path_verdict(version)


# One pluggable allocator per process: torch_npu keeps raw function pointers into the
# shim, and the allocator object must outlive every pool built on it.
_pluggable = None
_pluggable_lock = threading.Lock()


def _torch_npu():
    try:
        import torch_npu
    except Exception as exc:  # ImportError, or CANN libraries missing at import time
        raise BackendUnavailableError(
            f"import torch_npu failed ({type(exc).__name__}: {exc}): install torch_npu and "
            f"source CANN's set_env.sh") from exc
    return torch_npu


class AscendAllocatorAdapter(AllocatorAdapter):
    """``torch.npu.MemPool`` over ``NPUPluggableAllocator`` on the vmm_core shim."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._never_release = False
        self._kept: list = []

    def _allocator(self):
        """The process-wide pluggable allocator, after the release-path check."""
        global _pluggable
        torch_npu = _torch_npu()
        npu = torch_npu.npu
        version = str(torch_npu.__version__)
        ok, why = release_path_verdict(version)
        if not ok:
            raise BackendUnavailableError(f"ascend allocator adapter refused: {why}")
        if not (hasattr(npu, "MemPool") and hasattr(npu, "use_mem_pool")):
            raise BackendUnavailableError(
                f"torch_npu {version} has no torch.npu.MemPool/use_mem_pool: upgrade "
                f"torch_npu to >= {'.'.join(map(str, SAFE_RELEASE_MIN_VERSION))}")
        self._never_release = release_path_verdict(version, {})[0] is False
        with _pluggable_lock:
            if _pluggable is None:
                shim = load_shim()
                shim.ensure_routing()
                # the MemPools built on it must never outlive it, shutdown included
                _pluggable = keep_for_process_life(
                    npu.memory.NPUPluggableAllocator(shim.path, ALLOC_SYMBOL, FREE_SYMBOL))
            return _pluggable

    def new_pool(self):
        allocator = self._allocator()
        pool = _torch_npu().npu.MemPool(allocator.allocator())
        if self._never_release:
            self._kept.append(pool)  # the user promised pools are never released
        return pool

    def use_pool(self, pool) -> contextlib.AbstractContextManager:
        return _torch_npu().npu.use_mem_pool(pool, device=self.device)

    def pool_handle(self, pool):
        return pool.id

    @contextlib.contextmanager
    def use_framework_allocator(self):
        npu = _torch_npu().npu
        pool = npu.MemPool()  # torch_npu's own allocator, for the block only
        with npu.use_mem_pool(pool, device=self.device):
            yield
        del pool

    def live_blocks(self, pool) -> list[tuple[int, int]]:
        return [(int(block["address"]), int(block["size"]))
                for segment in self._segments(pool)
                for block in segment.get("blocks", ())
                if block.get("state") == "active_allocated"]

    def free_blocks(self, pool) -> list[tuple[int, int]]:
        return [(int(block["address"]), int(block["size"]))
                for segment in self._segments(pool)
                for block in segment.get("blocks", ())
                if block.get("state") == "inactive"]

    def _segments(self, pool) -> list:
        """The pool's segments in torch's snapshot format.

        ``MemPool.snapshot()`` exists from torch_npu 2.13; in 2.1-2.12 MemPool has only
        ``__init__``, ``id`` and ``allocator`` and ``memory_snapshot()`` takes no
        ``mempool_id``, so the pool's segments are picked from
        the whole snapshot by ``segment_pool_id``, the key torch's snapshot gives every
        segment.  That key is unverified against a real torch_npu 2.12 (no NPU run yet):
        a snapshot without it is refused rather than read as "no live blocks".
        """
        if hasattr(pool, "snapshot"):
            return pool.snapshot()
        pool_id = tuple(pool.id)
        segments = _torch_npu().npu.memory.memory_snapshot()
        if any("segment_pool_id" not in segment for segment in segments):
            raise BackendError(
                f"torch_npu {_torch_npu().__version__}: MemPool has no snapshot() and "
                f"torch.npu.memory_snapshot() names no segment_pool_id, so the blocks a "
                f"capture left allocated cannot be listed; upgrade torch_npu to >= "
                f"{'.'.join(map(str, SAFE_RELEASE_MIN_VERSION))}")
        return [segment for segment in segments
                if tuple(segment["segment_pool_id"]) == pool_id]

    def release_pool(self, pool) -> None:
        if self._never_release:
            return None  # dropping it would reach aclrtFree on this torch_npu
        with contextlib.suppress(ValueError):
            self._kept.remove(pool)
        _torch_npu().npu.empty_cache()
        return None
