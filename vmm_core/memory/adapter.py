"""The allocator-adapter role every backend fills: framework pools served by vmm_core.

A backend returns one of these from its ``vmm_allocator_adapter`` hook.  Core uses it
for graph capture pools (one fresh pool per capture space) and for tagged regions; it
never touches ``torch.cuda.MemPool`` / ``torch.npu.MemPool`` itself.
"""

from __future__ import annotations

import abc
import contextlib

__all__ = ["AllocatorAdapter"]


class AllocatorAdapter(abc.ABC):
    """Framework memory pools whose segments come from the C shim (and so from vmm_core)."""

    #: False where the framework has no pool object usable during capture (old torch_mlu).
    supports_pools: bool = True

    @abc.abstractmethod
    def new_pool(self):
        """A fresh framework pool backed by the vmm_core shim allocator."""

    @abc.abstractmethod
    def use_pool(self, pool) -> contextlib.AbstractContextManager:
        """Route the calling thread's framework allocations into ``pool``."""

    @abc.abstractmethod
    def pool_handle(self, pool):
        """The id the framework's graph capture takes as ``pool=``."""

    @abc.abstractmethod
    def live_blocks(self, pool) -> list[tuple[int, int]]:
        """``(address, size)`` of every block of ``pool`` still allocated.

        The escape guard compares them with the tensors a capture declared space-local;
        blocks waiting for another stream before they are freed do not count."""

    def free_blocks(self, pool) -> list[tuple[int, int]]:
        """``(address, size)`` of the blocks of ``pool``'s segments the framework holds
        free (cached for reuse), optional.

        An offloading sleep leaves them out (:mod:`vmm_core.memory.live_ranges`).  The
        default reports none, so every allocated byte is copied: only a framework that
        can say which cached bytes are free saves the copy."""
        return []

    def use_framework_allocator(self) -> contextlib.AbstractContextManager:
        """Route the calling thread's framework allocations to the framework's own
        allocator for the block, even inside a vmm_core region or capture (optional).

        What ``torch_memory_saver``'s ``disable()`` does: memory made inside is ordinary
        device memory, never put to sleep.  The default routes nothing, which is right
        where the framework's allocations never reach vmm_core (the host backend)."""
        return contextlib.nullcontext()

    def route_process(self, path: str, alloc_symbol: str, free_symbol: str):
        """Route every framework allocation of the process on this device (all threads,
        all streams) that no thread- or stream-scoped routing claims to the allocator
        whose C entry points are ``alloc_symbol`` / ``free_symbol`` in the library at
        ``path``, with the framework's caching allocator in front (optional).

        Routings begun later (``use_pool`` of a region, a capture, the framework
        allocator of :meth:`use_framework_allocator`) keep their threads' and streams'
        allocations.  Returns an object whose ``close()`` ends the routing; None (the
        default) where the framework offers no way (:mod:`vmm_core.memory.whole_process`
        then refuses with the reason).  An adapter whose framework can follow devices
        the process makes current later routes those too, and says so."""
        return None

    def alias_pool(self, handle, pool_handle) -> contextlib.AbstractContextManager:
        """For the block, calls of the framework's pool-routing API that name the
        caller's pool ``handle`` reach vmm_core's ``pool_handle`` instead (optional).

        A capture into vmm_core's pool on behalf of a caller who passed its own pool
        (SGLang's ``graph_pool_handle()``) may see the caller stop and restart
        allocation to *its* pool in the middle of the capture; without this, those
        calls would name a pool nobody records to.  The default changes nothing: a
        framework without such calls has nothing to translate."""
        return contextlib.nullcontext()

    def prepare(self) -> None:
        """Do one-time setup (load the shim, build the framework allocator) up front, so
        that the first capture does not pay for it (optional)."""
        return None

    def flush(self) -> None:
        """Return the segments of dropped pools to vmm_core now (optional).  Called by a
        GraphPool's teardown, and by a closing allocator whose range the framework still
        holds, with no allocator lock held; it may run while another thread captures."""
        return None

    def holds_memory_in(self, base: int, size: int) -> bool:
        """Whether the framework's allocator still holds a segment inside
        ``[base, base + size)`` (live or cached, in any pool).

        A range it holds is not given back when its allocator closes
        (:mod:`vmm_core.memory.address_quarantine`).  Frameworks get vmm_core memory
        through the C shim, which records every segment it hands out until the framework
        frees it, so the default asks the shim: no framework call, no framework lock.  An
        adapter whose framework gets memory another way overrides this."""
        from .shim import loaded_shim

        shim = loaded_shim()
        return shim is not None and shim.holds(base, size)

    def release_pool(self, pool) -> None:
        """Drop ``pool`` so the framework may return its segments (optional).  May run on
        any thread, under allocator locks, while another thread captures or a routing is
        active: a framework whose pool destructor refuses that (torch's MemPool) keeps
        the pool and releases it another way (the CUDA adapter)."""
        return None

    def shim_counters(self) -> dict[str, int]:
        """Counters of the C shim (allocs, frees, bytes), for tests and stats."""
        from .shim import load_shim

        return load_shim().counters()
