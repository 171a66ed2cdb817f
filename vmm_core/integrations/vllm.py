"""vLLM's sleep mode on vmm_core: the ``vmm`` sleep-mode backend and a ``MemAllocator``.

vLLM (0.33) selects a sleep-mode backend by name (``--sleep-mode-backend``) from
``SleepModeBackendFactory``, where third parties register from a ``vllm.general_plugins``
entry point.  vmm_core's entry point (``pyproject.toml``) calls :func:`register`, which
registers :class:`VmmSleepModeBackend` under the name ``vmm``.

The backend puts to sleep what :class:`VmmMemAllocator` allocated: vLLM's
``MemAllocator`` protocol on vmm_core regions, one per vLLM tag (``weights``,
``kv_cache``, ``runtime``, ``workspace``, ``default``), and ``cudagraph_pool()`` as a
``GraphPool(reuse="single")`` tagged ``cudagraph``.  Levels are vLLM's: every level
offloads ``runtime`` and ``cudagraph``, level 1 also ``weights``; the rest is
discarded; a wake may defer only ``weights`` and ``kv_cache`` (vLLM's
``DEFERRABLE_TAGS``).  The ``weights`` region announces its offload
(``region(..., prepare_offload=True)``), so even the first sleep copies at the pinned
rate; an offload copies live blocks only.

What vLLM 0.33 does not offer: a way for the selected backend to provide the allocator.
The GPU worker allocates through ``vllm.device_allocator.get_mem_allocator_instance()``,
which returns ``CuMemAllocator`` on CUDA whatever backend is selected, and routes graph
captures to an allocator's graph pool only when the backend is named ``cumem``.  Until
vLLM asks the backend (docs/integrations.md says exactly what is missing), the ``vmm``
backend refuses to run over memory that ``CuMemAllocator`` holds, with that explanation,
instead of freeing nothing.  Everything here is importable without vLLM, so that a
benchmark can drive the allocator and the levels directly (:class:`VmmSleepMode`).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import threading
import weakref
from typing import TYPE_CHECKING

from ..errors import VMMError

if TYPE_CHECKING:
    from ..graphs.pool import GraphPool

# VmmSleepModeBackend is here too, built on first access (it needs vLLM's base class)
__all__ = ["BACKEND_NAME", "DEFERRABLE_TAGS", "OFFLOADED_AT_EVERY_LEVEL", "VmmMemAllocator",
           "VmmSleepMode", "register", "deferrable_tags"]

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


def deferrable_tags() -> tuple[str, ...]:
    """vLLM's ``DEFERRABLE_TAGS`` when vLLM is importable, else the 0.33 value."""
    try:
        from vllm.device_allocator import DEFERRABLE_TAGS as theirs
    except ImportError:
        return DEFERRABLE_TAGS
    return tuple(theirs)


def _tag_tuple(tags, what: str) -> tuple[str, ...]:
    if isinstance(tags, str):
        tags = (tags,)
    try:
        tags = tuple(tags)
    except TypeError:
        raise ValueError(f"{what}: tags must be a tag or a sequence of tags, got "
                         f"{tags!r}") from None
    bad = [t for t in tags if not isinstance(t, str) or not t]
    if bad:
        raise ValueError(f"{what}: tags must be non-empty strings, got {bad[0]!r}")
    return tags


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
        self._backend_arg = backend
        self._tags: set[str] = set()
        self._graph_pool: GraphPool | None = None
        self._lock = threading.RLock()
        _allocators.add(self)

    def _backend(self):
        import vmm_core

        arg = self._backend_arg
        return arg if isinstance(arg, vmm_core.Backend) else vmm_core.get_backend(arg)

    # ---------------------------------------------------------------- allocation
    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None):
        """Allocations made inside are vLLM memory tagged ``tag`` (None: "default").
        The ``weights`` region prepares its host copy when the block ends.  Yields the
        tag's vmm_core allocator (vLLM's yields None): on the host backend allocate from
        it."""
        import vmm_core

        tag = self.default_tag if tag is None else tag
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"use_memory_pool: tag must be a non-empty string or None, "
                             f"got {tag!r}")
        with self._lock:
            self._tags.add(tag)
        with vmm_core.region(tag, backend=self._backend(),
                             prepare_offload=tag == "weights") as alloc:
            yield alloc

    @contextlib.contextmanager
    def cudagraph_pool(self):
        """Graph captures inside allocate from vLLM's ``cudagraph`` memory; yields the
        pool handle to capture with (``torch.cuda.graph(g, pool=handle)``).  One space
        for every capture, as one torch pool: what a capture leaves alive stays valid
        and keeps its bytes through every sleep; free blocks are given back."""
        from ..graphs.pool import GraphPool

        with self._lock:
            if self._graph_pool is None or self._graph_pool._closed:
                self._graph_pool = GraphPool(backend=self._backend(), tag=CUDAGRAPH_TAG,
                                             reuse="single")
                self._tags.add(CUDAGRAPH_TAG)
            pool = self._graph_pool
        # vLLM captures on its current stream; torch.cuda.graph without stream= on its
        # own: both get their library workspaces outside the pool before the capture
        pool.ops.prepare_capture_stream(pool.ops.current_stream())
        pool.ops.prepare_capture_stream(None)
        with pool.space(CUDAGRAPH_TAG) as handle:
            yield handle

    # ---------------------------------------------------------------- sleep / wake
    def _with_memory(self) -> list[str]:
        from ..memory import tagged

        with self._lock:
            ours = set(self._tags)
        return sorted(t for t in tagged.tags() if t in ours)

    def _asleep(self, tag: str) -> bool:
        from ..memory import tagged

        return all(a.asleep for a in tagged.allocators(tag))

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Release every tag's device memory; ``offload_tags`` (default: "default") are
        copied to host memory first, the rest is discarded.  A tag asleep already keeps
        how it went to sleep (vLLM logs the same)."""
        import vmm_core

        offload = (self.default_tag,) if offload_tags is None else \
            _tag_tuple(offload_tags, "sleep")
        tags = self._with_memory()
        awake = [t for t in tags if not self._asleep(t)]
        conflicts = [t for t in tags if t not in awake and (t in offload) != self._offloaded(t)]
        if awake:
            vmm_core.sleep(awake, offload=[t for t in awake if t in offload])
        if conflicts:
            logger.warning("vLLM sleep on vmm_core: %s slept already; how each went to sleep "
                           "(offloaded or discarded) was kept", conflicts)

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Release the device memory of ``tags`` without copying it."""
        import vmm_core

        wanted = _tag_tuple(tags, "discard")
        chosen = [t for t in self._with_memory() if t in wanted and not self._asleep(t)]
        if chosen:
            vmm_core.sleep(chosen)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-create the memory of ``tags`` (None: every tag) at the same addresses; a
        tag that cannot be deferred (all but ``weights`` and ``kv_cache``) always wakes.
        Offloaded bytes come back; discarded memory holds undefined bytes."""
        import vmm_core

        wanted = None if tags is None else _tag_tuple(tags, "wake_up")
        deferrable = deferrable_tags()
        chosen = [t for t in self._with_memory() if self._asleep(t) and (
            wanted is None or t in wanted or t not in deferrable)]
        if chosen:
            vmm_core.wake_up(chosen)

    def _offloaded(self, tag: str) -> bool:
        from ..memory import tagged

        return any(a.memory_stats()["offloaded"] for a in tagged.allocators(tag))

    def get_current_usage(self) -> int:
        """Bytes allocated in vLLM's memory (asleep or not), as ``CuMemAllocator``
        counts them: the worker checks it is 0 before loading weights."""
        from ..memory import tagged

        total = 0
        for tag in self._with_memory():
            for alloc in tagged.allocators(tag):
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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_after_fork)


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
    """vLLM 0.33's worker allocates through ``CuMemAllocator`` whatever sleep-mode backend
    is selected: refuse to 'sleep' nothing while that allocator holds the engine."""
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
        f"({cumem.get_current_usage()} bytes) through CuMemAllocator, because "
        f"vllm.device_allocator.get_mem_allocator_instance() returns CuMemAllocator on "
        f"CUDA whichever sleep-mode backend is selected; vmm_core can put to sleep only "
        f"memory it allocated. Until vLLM lets the selected backend provide the allocator "
        f"(docs/integrations.md, 'vLLM'), use --sleep-mode-backend cumem")


_backend_class = None


def _make_backend_class():
    global _backend_class
    if _backend_class is None:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

        class VmmSleepModeBackend(VmmSleepMode, SleepModeBackend):
            """vLLM's ``SleepModeBackend`` on vmm_core (``--sleep-mode-backend vmm``)."""

            def __init__(self) -> None:
                SleepModeBackend.__init__(self)
                VmmSleepMode.__init__(self)

        VmmSleepModeBackend.__module__ = __name__
        _backend_class = VmmSleepModeBackend
    return _backend_class


def __getattr__(name: str):
    # built on first use: vLLM's base class is imported only where vLLM is installed
    if name == "VmmSleepModeBackend":
        return _make_backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``vmm`` backend.  vLLM may
    load plugins more than once per process; a second call changes nothing."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    try:
        SleepModeBackendFactory.register_backend(BACKEND_NAME, __name__, "VmmSleepModeBackend")
    except ValueError:
        registered = SleepModeBackendFactory.get_backend_class(BACKEND_NAME)
        if registered is not _make_backend_class():
            raise VMMError(f"vLLM's sleep-mode backend {BACKEND_NAME!r} is registered by "
                           f"{registered.__module__}.{registered.__qualname__}, not vmm_core; "
                           f"uninstall one of them") from None
