"""vLLM's ``MemAllocator`` protocol and its sleep levels on vmm_core.

:class:`VmmMemAllocator` serves the protocol vLLM's worker allocates through
(``use_memory_pool``, ``sleep``, ``discard``, ``wake_up``, ``get_current_usage``, and
``cudagraph_pool`` as ``CuMemAllocator`` has it): one vmm_core region per vLLM tag, and
one ``GraphPool(reuse="single")`` for the graphs.  :class:`VmmSleepMode` is the ``vmm``
backend's behaviour (vLLM's levels) without vLLM's base class, so that a benchmark can
drive it where vLLM is not installed.

The plugin's memory is its own: every vLLM tag lives under the vmm_core tag
``vllm:<tag>`` (:func:`vmm_tags`), as torch_memory_saver's API files its own under
``tms:``.  A user's ``vmm_core.region("weights")`` in the same process is then a
different allocator: vLLM's level-2 sleep never discards it, and ``get_current_usage``
never counts it.  ``vmm_core.sleep()`` without tags still means every tag, vLLM's too.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import threading
import weakref
from typing import TYPE_CHECKING

from ... import forksafe
from ...errors import VMMError
from ...memory.tag_state import tag_list

if TYPE_CHECKING:
    from ...graphs.pool import GraphPool

__all__ = ["BACKEND_NAME", "DEFERRABLE_TAGS", "OFFLOADED_AT_EVERY_LEVEL", "TAG_PREFIX",
           "VmmMemAllocator", "VmmSleepMode", "deferrable_tags", "vmm_tags"]

logger = logging.getLogger("vmm_core")

#: the name ``--sleep-mode-backend`` takes
BACKEND_NAME = "vmm"
#: vLLM 0.33 ``vllm/device_allocator/__init__.py``: the tags a wake may leave asleep;
#: vLLM's own constant is used when vLLM is importable (:func:`deferrable_tags`)
DEFERRABLE_TAGS = ("weights", "kv_cache")
#: vLLM 0.33 ``CuMemBackend.suspend``: offloaded at every level (weights at level 1 too)
OFFLOADED_AT_EVERY_LEVEL = ("runtime", "cudagraph")
#: vLLM's tag of its graph pool, and of allocations made without a tag
CUDAGRAPH_TAG = "cudagraph"
DEFAULT_TAG = "default"
#: vmm_core tags of vLLM's memory: "vllm:<vLLM's tag>" (``vllm:weights``, ...)
TAG_PREFIX = "vllm:"

_claimed_lock = threading.Lock()
_claimed: set[str] = set()  # vLLM tags some VmmMemAllocator of this process has used


def _vmm_tag(tag: str) -> str:
    return TAG_PREFIX + tag


def vmm_tags(tag: str | None = None) -> list[str]:
    """The vmm_core tag of a vLLM tag (``"weights"`` -> ``["vllm:weights"]``), or of
    every vLLM tag that has memory now (None): the names ``vmm_core.memory_summary()``
    lists vLLM's memory under and ``vmm_core.sleep`` / ``wake_up`` take (which refuse a
    tag without memory, so none is listed)."""
    if tag is not None:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"vmm_tags: tag must be a non-empty string or None, got "
                             f"{tag!r}")
        return [_vmm_tag(tag)]
    from ...memory import tagged

    with _claimed_lock:
        ours = {_vmm_tag(t) for t in _claimed}
    return sorted(ours & set(tagged.tags()))


def deferrable_tags() -> tuple[str, ...]:
    """vLLM's ``DEFERRABLE_TAGS`` when vLLM is importable, else the 0.33 value."""
    try:
        from vllm.device_allocator import DEFERRABLE_TAGS as theirs
    except ImportError:
        return DEFERRABLE_TAGS
    return tuple(theirs)


class VmmMemAllocator:
    """vLLM's ``MemAllocator`` protocol (``use_memory_pool``, ``sleep``, ``discard``,
    ``wake_up``, ``get_current_usage``, and ``cudagraph_pool`` as ``CuMemAllocator``
    has it) on vmm_core.

    One per process (:meth:`get_instance`), as vLLM's allocators are.  ``backend``
    picks the vmm_core backend (default: detected)."""

    instance: VmmMemAllocator | None = None
    _instance_lock = threading.Lock()
    default_tag = DEFAULT_TAG

    @classmethod
    def get_instance(cls) -> VmmMemAllocator:
        with cls._instance_lock:
            if cls.instance is None:
                cls.instance = cls()
            return cls.instance

    def __init__(self, backend=None) -> None:
        self._backend = backend  # read as every backend= of vmm_core (registry.resolve)
        self._tags: set[str] = set()
        self._graph_pool: GraphPool | None = None
        self._lock = threading.RLock()
        _allocators.add(self)

    # ---------------------------------------------------------------- allocation
    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None):
        """Allocations made inside are vLLM memory tagged ``tag`` (None: "default"),
        held in vmm_core's region ``vllm:<tag>``.  The ``weights`` region prepares its
        host copy when the block ends.  Yields the tag's vmm_core allocator (vLLM's
        yields None): on the host backend allocate from it."""
        import vmm_core

        tag = self.default_tag if tag is None else tag
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"use_memory_pool: tag must be a non-empty string or None, "
                             f"got {tag!r}")
        self._claim(tag)
        with vmm_core.region(_vmm_tag(tag), backend=self._backend,
                             prepare_offload=tag == "weights") as alloc:
            yield alloc

    @contextlib.contextmanager
    def cudagraph_pool(self):
        """Graph captures inside allocate from vLLM's ``cudagraph`` memory; yields the
        pool handle to capture with (``torch.cuda.graph(g, pool=handle)``).  One space
        for every capture, as one torch pool: what a capture leaves alive stays valid
        and keeps its bytes through every sleep; free blocks are given back."""
        from ...graphs.pool import GraphPool

        with self._lock:
            if self._graph_pool is None or self._graph_pool._closed:
                # vLLM captures into graphs of its own (torch's executables)
                self._graph_pool = GraphPool(backend=self._backend,
                                             tag=_vmm_tag(CUDAGRAPH_TAG), reuse="single",
                                             executables=False)
                self._claim(CUDAGRAPH_TAG)
            pool = self._graph_pool
        # vLLM captures on its current stream; torch.cuda.graph without stream= on its
        # own: both get their library workspaces outside the pool before the capture
        pool.ops.prepare_capture_stream(pool.ops.current_stream())
        pool.ops.prepare_capture_stream(None)
        with pool.space(CUDAGRAPH_TAG) as handle:
            yield handle

    def _claim(self, tag: str) -> None:
        with self._lock:
            self._tags.add(tag)
        with _claimed_lock:
            _claimed.add(tag)

    # ---------------------------------------------------------------- sleep / wake
    def _with_memory(self) -> list[str]:
        """vLLM's tags (their own names) of this allocator that have memory now."""
        from ...memory import tagged

        with self._lock:
            ours = set(self._tags)
        alive = set(tagged.tags())
        return sorted(t for t in ours if _vmm_tag(t) in alive)

    def _asleep(self, tag: str) -> bool:
        from ...memory import tagged

        return all(a.asleep for a in tagged.allocators(_vmm_tag(tag)))

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Release every tag's device memory; ``offload_tags`` (default: "default") are
        copied to host memory first, the rest is discarded.  A tag asleep already keeps
        how it went to sleep (vLLM logs the same)."""
        import vmm_core

        offload = (self.default_tag,) if offload_tags is None else \
            tag_list(offload_tags, "sleep: offload_tags")
        tags = self._with_memory()
        awake = [t for t in tags if not self._asleep(t)]
        conflicts = [t for t in tags if t not in awake and (t in offload) != self._offloaded(t)]
        if awake:
            vmm_core.sleep([_vmm_tag(t) for t in awake],
                           offload=[_vmm_tag(t) for t in awake if t in offload])
        if conflicts:
            logger.warning("vLLM sleep on vmm_core: %s slept already; how each went to sleep "
                           "(offloaded or discarded) was kept", conflicts)

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Release the device memory of ``tags`` without copying it."""
        import vmm_core

        wanted = tag_list(tags, "discard: tags")
        chosen = [t for t in self._with_memory() if t in wanted and not self._asleep(t)]
        if chosen:
            vmm_core.sleep([_vmm_tag(t) for t in chosen])

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-create the memory of ``tags`` (None: every tag) at the same addresses; a
        tag that cannot be deferred (all but ``weights`` and ``kv_cache``) always wakes.
        Offloaded bytes come back; discarded memory holds undefined bytes."""
        import vmm_core

        wanted = None if tags is None else tag_list(tags, "wake_up: tags")
        deferrable = deferrable_tags()
        chosen = [t for t in self._with_memory() if self._asleep(t) and (
            wanted is None or t in wanted or t not in deferrable)]
        if chosen:
            vmm_core.wake_up([_vmm_tag(t) for t in chosen])

    def _offloaded(self, tag: str) -> bool:
        from ...memory import tagged

        return any(a.memory_stats()["offloaded"] for a in tagged.allocators(_vmm_tag(tag)))

    def get_current_usage(self) -> int:
        """Bytes allocated in vLLM's memory (asleep or not), as ``CuMemAllocator``
        counts them: the worker checks it is 0 before loading weights.  Memory of other
        vmm_core tags (a user's own ``region("weights")``) is not vLLM's."""
        from ...memory import tagged

        total = 0
        for tag in self._with_memory():
            for alloc in tagged.allocators(_vmm_tag(tag)):
                for index in alloc.space_indices():
                    total += sum(alloc.live_allocations(index).values())
        return total


_allocators: weakref.WeakSet = weakref.WeakSet()


def _fresh_locks_after_fork() -> None:
    """An allocator's lock is held while its graph pool is made, which waits for the
    tagged-memory lock (a capture on another thread), and a fork waits for that only a
    bounded time: a child forked then inherited the lock held by a thread it does not
    have, and hung in its first ``use_memory_pool``.  The forking thread's own holds stay."""
    for allocator in list(_allocators):
        if not allocator._lock._is_owned():  # CPython's RLock has it
            allocator._lock = threading.RLock()
    VmmMemAllocator._instance_lock = threading.Lock()  # held only inside get_instance


forksafe.at_fork("integrations", after_in_child=_fresh_locks_after_fork)


class VmmSleepMode:
    """The ``vmm`` backend's behaviour without vLLM's base class: ``suspend(level)``,
    ``resume(tags)``, ``discard(tags)``, ``state()``, on :class:`VmmMemAllocator`.
    :class:`VmmSleepModeBackend` is this on vLLM's ``SleepModeBackend``; a benchmark
    drives this one directly."""

    def __init__(self, allocator: VmmMemAllocator | None = None) -> None:
        self._allocator = allocator
        self._state = "RUNNING"

    @classmethod
    def mem_allocator(cls) -> VmmMemAllocator:
        """The allocator whose memory this backend puts to sleep (the one a vLLM that
        asked the selected backend for its allocator would allocate through)."""
        return VmmMemAllocator.get_instance()

    @property
    def allocator(self) -> VmmMemAllocator:
        return self._allocator if self._allocator is not None else self.mem_allocator()

    def state(self) -> str:
        return self._state

    def suspend(self, level: int = 1) -> None:
        """vLLM's levels: ``runtime`` and ``cudagraph`` are offloaded at every level,
        ``weights`` at level 1 (discarded at 2, reloaded by vLLM); the rest discarded."""
        if not isinstance(level, numbers.Integral) or isinstance(level, bool) or level < 1:
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard them), "
                             f"got {level!r}")
        allocator = self.allocator
        _refuse_memory_of_cumem(allocator)
        offload = OFFLOADED_AT_EVERY_LEVEL + (("weights",) if level == 1 else ())
        allocator.sleep(offload_tags=offload)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        self.allocator.wake_up(tags)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        self.allocator.discard(tags)
        self._state = "SUSPENDED"

    # -- capabilities (vLLM's SleepModeBackend asks these of the class)
    @classmethod
    def is_supported(cls) -> bool:
        """True when vmm_core has a usable backend in this process."""
        import vmm_core

        try:
            vmm_core.get_backend()
        except VMMError:
            return False
        return True

    @classmethod
    def preserves_communicators(cls) -> bool:
        # communicators' buffers are allocated outside these pools, as with cumem
        return True

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        # only tagged device memory is released: the process, its compiled kernels and
        # the driver's module memory stay
        return True

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        # graph memory keeps its addresses and live bytes, but a communicator that
        # registered the graph pool's pages (NCCL graph registration) holds the old pages
        return False

    @classmethod
    def supports_durable_storage(cls) -> bool:
        return False


def _refuse_memory_of_cumem(allocator: VmmMemAllocator) -> None:
    """Refuse to 'sleep' nothing while ``CuMemAllocator`` holds the engine: vLLM's worker
    allocates through it unless the plugin's patches routed it here
    (:mod:`vmm_core.integrations.vllm.patches`), which happens when the worker is built
    with ``sleep_mode_backend="vmm"``; a worker built first with another backend in the
    same process left vLLM as it was."""
    if allocator.get_current_usage():
        return
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return
    cumem = CuMemAllocator.instance
    if cumem is None or not cumem.get_current_usage():
        return
    raise VMMError(
        f"--sleep-mode-backend {BACKEND_NAME}: this vLLM worker allocated its memory "
        f"({cumem.get_current_usage()} bytes) through CuMemAllocator, not vmm_core, so "
        f"there is nothing of it vmm_core can put to sleep. The plugin routes the "
        f"worker's allocations to vmm_core when the worker is built with "
        f"--enable-sleep-mode --sleep-mode-backend {BACKEND_NAME} and vmm_core installed "
        f"in the worker's environment; an earlier worker of this process built with "
        f"another backend leaves vLLM as it was. Start the engine in a fresh process, or "
        f"use --sleep-mode-backend cumem")
