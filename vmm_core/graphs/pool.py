"""GraphPool: capture spaces that an engine's own graph runner passes as ``pool=``.

Engines capture with their own runners: vLLM splits the model at attention and captures
every piece per batch size (dozens of graphs per size), keeps a second family of full
graphs for the same sizes, and passes one ``graph_pool_handle()`` to every capture.  The
intermediate piece outputs stay alive in that one pool, so graph memory grows like
``sum(shape)`` again.  A GraphPool gives every *key* (a batch size, ``("piecewise", 256)``,
anything hashable) its own capture space instead:

* a new virtual space of a :class:`~vmm_core.SharedVMMAllocator` and a fresh framework
  pool over it; every space maps the same physical pages, so all keys together hold what
  the largest one needs;
* any number of graphs are captured into one space, one after another; they share the
  space's framework pool, so piece N reuses what piece N-1 freed;
* reopening a key later reopens its space (engines that capture lazily, piece by piece).
* spaces of one allocator are entered one at a time (they do not nest), and every capture
  or replay block holds the process-wide lock of tagged memory, so no sleep starts inside.

This module is the one place that decides spaces, pools, the escape guard and replay
ordering; :class:`vmm_core.GraphExecutor` is a runner built on it.

**The rule engines must follow.**  Memory of one space is the memory of every other
space.  A tensor allocated inside a space and still alive when the ``space()`` block ends
(the static output of piece N that piece N+1 of the same key reads, the last piece's
output the engine returns) must be declared with ``keep()``; it stays valid only until a
graph of *another key* replays.  Anything else still allocated is an escape: it would
silently share pages with later graphs, so the block raises :class:`CaptureEscapeError`
and every pool on the allocator refuses further use.  Graphs of different keys must never
run at the same time: call :meth:`GraphPool.before_replay` (or enter
:meth:`GraphPool.replaying`) before launching a key's graphs, on the stream you launch
them on.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
import time
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import (
    AllocationError,
    CaptureError,
    CaptureEscapeError,
    OutOfMemoryError,
    VMMError,
    VMMFallbackWarning,
    outside_stacklevel,
)
from ..memory import offload, reaper, routing
from ..memory.allocator import SharedVMMAllocator, check_device, check_size
from .executables import executables_for

if TYPE_CHECKING:
    from ..memory.adapter import AllocatorAdapter

__all__ = ["GraphPool", "CaptureSpace", "REUSE_MODES", "POOL_REUSE_MODES"]

#: what GraphExecutor (and GraphPool) take as ``reuse``
REUSE_MODES = ("vmm", "shared", "private")
#: GraphPool also takes "single": every key in one VMM space, as one shared pool
POOL_REUSE_MODES = REUSE_MODES + ("single",)
#: reuse modes whose memory comes from the pool's SharedVMMAllocator
_VMM_BACKED = ("vmm", "single")


class _Group:
    """What every GraphPool over one SharedVMMAllocator shares.

    An escape poisons the whole group (the escaped block lives on pages every other space
    reuses); spaces are claimed group-wide so two pools never capture into one space; the
    stream of the last launch orders the next one, whichever pool it belongs to; and every
    pool captures on one stream, so a warm-up through any of them prepares all (a second
    family on a cold stream put cuBLAS's 32 MiB workspace into its first space, on an H100).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.poisoned: str | None = None
        self.claimed: set[int] = set()
        self.last_stream = None
        self.ops = None  # the graph ops (and so the capture stream) of the group
        #: handles added by captures wait to be merged: by the next switch, or the first
        #: replay of another key (a merge remaps every space; batching them keeps
        #: capture cheap)
        self.compact_pending = False
        self.last_key: tuple | None = None  # (pool id, key) last captured or replayed
        #: open pools on the allocator; one that a pool created closes with the last
        self.users = 0
        self.tags: Counter = Counter()  # tag -> open pools registered under it
        self.owned = None  # the allocator, when a pool created it
        #: blocks a failed capture left alive, re-checked until they are gone; the pool
        #: is held weakly (a strong reference kept a dropped pool, and an allocator it
        #: created, alive for good when no other pool of the group ran a check)
        self.suspects: list = []
        #: the blocks behind ``poisoned`` ((pool weakref, space, blocks) each): checked
        #: again on every use, and the poison is lifted once every one is gone (freed, or
        #: its pool closed): a user's own allocator was otherwise unusable for good
        self.escapes: list = []
        #: spaces of closed or dropped pools that were the allocator's current space then
        #: (it cannot be released): released once another space is current, instead of
        #: one space (address range and mappings) leaking per pool closed
        self.given_back: set[int] = set()
        #: the open pools on the allocator: their kept blocks survive a sleep
        self.pools: weakref.WeakSet = weakref.WeakSet()
        #: the allocator's (preserve_live, live_ranges) before the first pool set them:
        #: given back with the last pool (a caller's allocator is the caller's again)
        self.live_before: tuple | None = None


_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()
#: backends whose unrouted captures were warned about (once per process)
_warned_unrouted: set[str] = set()


def _fresh_group_locks_after_fork() -> None:
    """A GraphPool being made holds these without the tagged-memory lock the fork hooks
    wait for (any thread may make one, also one inside a capture): a child forked then
    inherited them held by a thread it does not have and hung in its first GraphPool.
    They guard a few dict and counter updates, so fresh ones are safe; a group lock the
    forking thread holds (it is the child's thread) stays."""
    global _groups_lock
    _groups_lock = threading.Lock()
    for group in list(_groups.values()):
        if not group.lock._is_owned():
            group.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_group_locks_after_fork)


def group_of(allocator) -> _Group:
    with _groups_lock:
        group = _groups.get(allocator)
        if group is None:
            group = _groups[allocator] = _Group()
        return group


@dataclass(eq=False)
class _KeySpace:
    key: object
    index: int | None = None  # the allocator's space (vmm)
    pool: object = None  # the framework pool over it (vmm)
    handle: object = None  # what the capture call takes as pool=
    kept: list = field(default_factory=list)  # (weakref or None, address, nbytes)
    reads: set = field(default_factory=set)
    entries: int = 0
    captured: int = 0  # entries that ended without an error: replaying() needs one
    nbytes: int = 0


def _extent(obj) -> tuple[object, int, int]:
    """``(weakref or None, address, nbytes)`` of a kept tensor, address or extent.

    Tensors are held weakly, through their storage (a view or an alias keeps it alive as
    long as any tensor uses the memory): once the engine drops the last one its block is
    free again, and a stale extent must not excuse a later block on the same address.
    Raw addresses are declared for the life of the space."""
    if isinstance(obj, bool):
        raise TypeError(f"keep() takes tensors or addresses, not {obj!r}")
    if isinstance(obj, numbers.Integral):  # numpy's too
        return None, _address(obj), 1
    if isinstance(obj, tuple) and len(obj) == 2 and \
            all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in obj):
        if obj[1] < 0:  # an extent of -5 bytes excused a block silently
            raise ValueError(f"keep(): an extent (address, nbytes) needs nbytes >= 0, got "
                             f"{obj!r}")
        return None, _address(obj[0]), max(1, int(obj[1]))
    storage = getattr(obj, "untyped_storage", None)
    if storage is None:
        raise TypeError(f"keep() takes tensors, int addresses or (address, nbytes) tuples, "
                        f"got {type(obj).__name__}")
    s = storage()
    try:
        ref = weakref.ref(s)
    except TypeError:  # a framework whose storages take no weak references
        ref = weakref.ref(obj)
    return ref, int(s.data_ptr()), max(1, int(s.nbytes()))


def _address(value) -> int:
    if not 0 <= value < 1 << 64:
        raise ValueError(f"keep(): {value} is not an address (an int from 0 to 2**64 - 1); "
                         f"pass the tensor, its data_ptr(), or (data_ptr, nbytes)")
    return int(value)


class CaptureSpace:
    """The context manager :meth:`GraphPool.space` returns; ``with`` yields the handle.

    ``handle`` is exactly what the vendor's capture call takes as ``pool=``
    (``torch.cuda.graph(g, pool=handle)``); :meth:`keep` declares space-local tensors.
    """

    def __init__(self, pool: "GraphPool", key, keep=(), record_stream_reuse=False) -> None:
        self._pool = pool
        self.key = key
        self._keep = tuple(keep)
        self._record_stream_reuse = bool(record_stream_reuse)
        self._space: _KeySpace | None = None
        self._stacks: tuple | None = None  # (inner contexts, held locks)
        self._thread: int | None = None

    @property
    def handle(self):
        if self._space is None:
            raise CaptureError("CaptureSpace.handle: enter the space first (with pool.space(key))")
        return self._space.handle

    def keep(self, *tensors) -> None:
        """Declare tensors allocated in this space that outlive the block (space-local).

        They stay valid only until a graph of another key replays."""
        if self._space is None:
            raise CaptureError("keep(): the space is not open; call it inside the with block")
        extents = [_extent(t) for t in tensors]  # all checked first: a refusal keeps none
        self._space.kept.extend(extents)

    def __enter__(self):
        if self._space is not None:
            raise CaptureError(f"the capture space of {self.key!r} is already open; call "
                               f"pool.space(key) again for another entry")
        space, inner, held = self._pool._enter(self.key, self._record_stream_reuse)
        self._space, self._stacks, self._thread = space, (inner, held), threading.get_ident()
        try:
            self.keep(*self._keep)
        except BaseException:
            self._leave(True, None)
            raise
        _open_spaces().append(self)
        return space.handle

    def __exit__(self, exc_type, exc, tb):
        self._leave(exc_type is not None, exc)
        return False

    def _leave(self, failed: bool, exc) -> None:
        if self._thread != threading.get_ident():
            raise CaptureError(f"the capture space of {self.key!r} was opened on another "
                               f"thread; leave it on the thread that entered it")
        if self in _open_spaces():
            _open_spaces().remove(self)
        space, stacks = self._space, self._stacks
        self._space = self._stacks = self._thread = None
        if space is None or stacks is None:
            raise CaptureError(f"the capture space of {self.key!r} is not open")
        self._pool._exit(space, stacks[0], stacks[1], failed, exc)


_tls = threading.local()


def _open_spaces() -> list:
    spaces = getattr(_tls, "spaces", None)
    if spaces is None:
        spaces = _tls.spaces = []
    return spaces


def _replay_blocks() -> list:
    """``(pool, key)`` of the replay blocks open on this thread, innermost last."""
    blocks = getattr(_tls, "replays", None)
    if blocks is None:
        blocks = _tls.replays = []
    return blocks


class GraphPool:
    """One capture space per key; all spaces share one set of physical pages.

    :param device: device index (default: the framework's current device).
    :param backend: backend name or object (default: detected).
    :param tag: sleep/wake tag of the graph memory (``vmm_core.sleep("graph")``).
    :param allocator: a SharedVMMAllocator to share with other GraphPools or executors
        (graph families): physical memory is then the max over all their spaces.
    :param reuse: ``"vmm"`` (default); ``"single"`` (every key captures into one VMM
        space of the pool's own allocator, in capture order, exactly as captures sharing
        one ``graph_pool_handle()`` would: blocks alive after a capture are legal, since
        nothing aliases them, and survive every sleep, while free blocks are discarded;
        what drop-in replacements of a shared pool need, see below); ``"shared"`` (every
        key gets one common ``graph_pool_handle()``, what engines do today) or
        ``"private"`` (``None``: each capture gets its own pool), for comparison.
    :param reads: tags of memory the graphs read (weights, KV cache); a replay while one
        of them sleeps raises :class:`SleepStateError` instead of faulting the device.
        Default: every ``region()`` tag alive on this device when the key was captured.
    :param reserve_bytes: address space each key reserves (default: the backend's, 16 GiB
        on the host); it must hold the largest key's graph memory.  Every key reserves
        this much, so thousands of keys need it smaller: the host runs out of address
        space (128 TiB) after about 8000 keys of 16 GiB.  Only for the allocator the pool
        creates: a given ``allocator`` was sized by whoever made it.
    :param executables: who keeps the executables of the graphs :meth:`new_graph` makes
        (docs/executables.md): None (default) this pool, every one, wherever the backend
        can (elsewhere the framework, as before); an int: at most that many alive, the
        least recently replayed destroyed first and made again by their next replay; a
        :class:`vmm_core.ExecutablePolicy` for a budget in bytes or sharing by update;
        False: always the framework.  A sleep of the pool's memory destroys those it owns.
    """

    def __init__(self, device: int | None = None, *, backend=None, tag: str = "graph",
                 allocator=None, reuse: str = "vmm", reads=None,
                 reserve_bytes: int | None = None, executables=None) -> None:
        import vmm_core

        from ..memory import tagged

        if reuse not in POOL_REUSE_MODES:
            raise ValueError(f"reuse must be one of {POOL_REUSE_MODES}, got {reuse!r}")
        if allocator is not None and not isinstance(allocator, SharedVMMAllocator):
            raise TypeError(f"allocator must be a SharedVMMAllocator (to share its pages "
                            f"with other GraphPools) or None, got {allocator!r}")
        if allocator is not None and reuse == "single":
            raise VMMError("GraphPool(reuse='single') captures into one space of its own "
                           "allocator (a space shared with other pools would alias their "
                           "blocks, which 'single' lets outlive a capture); drop "
                           "allocator=, or use reuse='vmm' to share pages between families")
        if reserve_bytes is not None:
            check_size("GraphPool reserve_bytes", reserve_bytes, "reserve less")
            if allocator is not None:
                raise AllocationError(
                    "GraphPool(reserve_bytes=...) sizes the allocator the pool creates; "
                    "with allocator= pass reserve_bytes to that SharedVMMAllocator instead")
        if backend is None and allocator is not None:
            backend = allocator.backend
        if backend is None or isinstance(backend, str):
            backend = vmm_core.get_backend(backend)
        self.backend = backend
        if device is None:
            device = allocator.device if allocator is not None else \
                tagged.current_device(backend)
        self.device = check_device(device)
        self.tag = tag
        self.requested_reuse = reuse
        group = group_of(allocator) if allocator is not None and reuse == "vmm" else None
        self.ops = group.ops if group is not None and group.ops is not None else \
            backend.graph_ops(self.device)
        if self.ops is None:
            raise CaptureError(f"backend {backend.name!r} has no graph ops (vmm_graph_ops "
                               f"returned None): graphs cannot be captured with it")
        # decided before anything is registered: a refused policy leaves nothing behind
        self._executables = executables_for(self, self.ops, executables)
        self.reads = None if reads is None else _tag_set(reads)
        self.fallback_reason = None
        self.adapter = backend.allocator_adapter(self.device) if reuse in _VMM_BACKED \
            else None
        if reuse in _VMM_BACKED:
            caps = backend.capabilities(self.device)
            if not caps.graph_pool or self.adapter is None or not self.adapter.supports_pools:
                self.fallback_reason = (
                    f"backend {backend.name!r} cannot capture into a custom-allocator pool "
                    f"({caps.notes or 'no pool support'}); using one shared pool instead")
                warnings.warn(f"GraphPool(reuse={reuse!r}): {self.fallback_reason}",
                              VMMFallbackWarning, stacklevel=2)
                reuse, self.adapter = "shared", None
        self.reuse = reuse
        self.allocator = None
        self._finalizer = None
        #: reuse="single": the one framework pool every key captures into, once made
        self._single: list = []
        if reuse in _VMM_BACKED:
            created = allocator is None
            if created:
                # merges copy (scratch=False): space-local tensors survive them
                try:
                    allocator = vmm_core.SharedVMMAllocator(
                        backend, device=self.device, tag=tag, reserve_bytes=reserve_bytes)
                except OutOfMemoryError as exc:
                    raise OutOfMemoryError(_no_address_space("the first key", exc)) from exc
                # each space is mapped by its first replay ("single" has only one)
                allocator.lazy_wake = reuse == "vmm"
            elif allocator.backend is not backend or allocator.device != self.device:
                raise VMMError(f"GraphPool on {backend.name}:{self.device} was given an "
                               f"allocator of {allocator.backend.name}:{allocator.device}; "
                               f"pass one of the same backend and device")
            elif allocator.closed:
                raise VMMError(_CLOSED_GIVEN)
            try:
                self._vmm_adapter().prepare()
            except BaseException:
                if created:
                    allocator.close()
                raise
            self._group = group_of(allocator)
            # checked again with the locks the reaper's give-back takes: a pool dropped
            # just before may close the allocator it created meanwhile, and this pool
            # was then built on a closed allocator
            with tagged.state_lock(), self._group.lock:
                if allocator.closed:
                    raise VMMError(_CLOSED_GIVEN)
                self.allocator = allocator
                tagged.register(tag, allocator)
                if self._group.ops is None:
                    self._group.ops = self.ops
                if created:
                    self._group.owned = allocator
                self._group.users += 1
                self._group.tags[tag] += 1
                self._group.pools.add(self)
                _keep_live_blocks(allocator, self._group, reuse, self.adapter, self._single)
        else:
            self._group = _Group()
        self._shared_handle = self.ops.shared_pool_handle() if reuse == "shared" else None
        self._spaces: dict = {}
        if self.allocator is not None:
            if self._executables is not None:  # held weakly by the allocator
                self.allocator.add_sleep_listener(self._executables.on_memory_event)
                self.allocator.add_stats_provider(self._executables.memory_stats)
            # dropped without close(): give the spaces back as close() does, and the
            # allocator too when this was its last pool (on the reaper thread: the
            # collector may run while a backend lock is held)
            self._finalizer = weakref.finalize(
                self, reaper.close_later, _give_back, self._spaces, self.ops,
                self.adapter, self.allocator, self._group, tag, self._executables, self._single)
        elif self._executables is not None:  # no spaces to give back: only these
            self._finalizer = weakref.finalize(self, reaper.close_later,
                                               self._executables.close)
        self._phase_seconds: dict[str, float] = {}
        self._closed = False

    # ------------------------------------------------------------------ capture
    def space(self, key, keep=(), *, record_stream_reuse: bool = False) -> CaptureSpace:
        """The capture space of ``key``: ``with pool.space(key) as handle:``.

        ``keep`` declares tensors (from an earlier entry of the same key) that may stay
        allocated; more can be declared inside the block with ``.keep()`` on the returned
        object or :meth:`keep`.  Other threads' captures, replay blocks and sleeps wait
        for the block: it holds the process-wide lock of tagged memory (not one per
        allocator: an engine holding tags awake calls ``before_replay``, and only one
        lock taken first by everyone keeps that from deadlocking against another
        thread's replay), so keep capture blocks to capturing.  The graph memory is held
        awake: ``vmm_core.sleep`` inside the block raises SleepStateError.

        ``record_stream_reuse=True`` turns on the caching allocator's
        ``graph_capture_record_stream_reuse`` for the block (torch >= 2.9; PyTorch PR
        158352): a block another stream used (``record_stream``) becomes reusable once
        the capture stream has joined that stream, instead of at the capture's end.  A
        backend or torch without it raises :class:`CaptureError` naming what it found.
        """
        hash(key)  # a TypeError here beats a KeyError later
        return CaptureSpace(self, key, keep, record_stream_reuse)

    def keep(self, *tensors) -> None:
        """Declare space-local tensors of the space open on this thread."""
        self._open_space("GraphPool.keep(): no space of this pool is open on this thread; "
                         "call it inside `with pool.space(key):`").keep(*tensors)

    def _open_space(self, refusal: str) -> CaptureSpace:
        """The innermost space of this pool open on this thread, or CaptureError."""
        spaces = [s for s in _open_spaces() if s._pool is self]
        if not spaces:
            raise CaptureError(refusal)
        return spaces[-1]

    @property
    def capture_stream(self):
        """The stream :meth:`warmup` runs on; capture on it (``stream=``) so libraries'
        per-stream workspaces exist before the first capture."""
        return self.ops.capture_stream

    def new_graph(self):
        """A graph to capture in a space of this pool, exactly as the framework's own
        (``with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream)``, or
        :meth:`capture` on any backend); it replays under the key of the space open at
        its capture.

        Its executable is this pool's (``executables=``): ``g.replay()`` launches it, inside
        ``replaying(key)`` of its key on this thread only that, elsewhere inside such a
        block; ``g.reset()`` destroys it.  Where the framework keeps executables it is the
        framework's plain graph."""
        if self._executables is None:
            return self.ops.new_graph()
        return self._executables.new_graph()

    def capture(self, graph, fn):
        """Capture ``fn()`` into ``graph`` in the space of this pool open on this thread,
        on :attr:`capture_stream`, on every backend (the host included); returns what
        ``fn`` returned."""
        space = self._open_space("GraphPool.capture(): no space of this pool is open on "
                                 "this thread; call it inside `with pool.space(key):`")
        return self.ops.capture(graph, fn, space.handle)

    def open_key(self):
        """The key of the innermost space of this pool open on this thread (a graph of
        :meth:`new_graph` captured now replays under it)."""
        return self._open_space("a graph of GraphPool.new_graph() was captured outside "
                                "every space of its pool: capture it inside `with "
                                "pool.space(key) as handle:` (it replays under that "
                                "key)").key

    def warmup(self, fn) -> None:
        """Run ``fn()`` eagerly on :attr:`capture_stream`, outside every pool.

        cuBLAS creates its 32 MiB workspace on the first use of each stream; created
        inside a capture it would land in the space and be reported as an escape."""
        self.ops.warmup(fn)

    @contextlib.contextmanager
    def _serialized(self):
        """The locks every capture, replay and merge holds, always in this order: first
        the process-wide lock of tagged memory (which sleep, wake and ``hold_awake`` take
        first too, so an engine holding tags awake can call :meth:`before_replay`), then
        the group's.  No sleep starts while a capture or a replay block is open."""
        from ..memory import tagged

        with tagged.state_lock(), self._group.lock:
            yield

    def _enter(self, key, record_stream_reuse: bool = False):
        from ..memory import tagged

        held = contextlib.ExitStack()
        inner = contextlib.ExitStack()
        held.enter_context(self._serialized())
        try:
            self._check_usable()
            # a kept host copy registering on another thread may be a call a device capture
            # in global mode refuses from any thread (the CUDA hooks avoid it in relaxed
            # thread mode; a backend may not): let it finish first.  Holding the
            # tagged-memory lock, no sleep or wake can start another until the block ends
            offload.wait_for_pinning()
            if record_stream_reuse:  # first: an unsupported flag changes nothing
                inner.enter_context(self.ops.record_stream_reuse(True))
            if self.reuse in _VMM_BACKED:
                self._refuse_nesting(f"pool.space({key!r})")
                # asleep: refused every time, before a space or pool is made
                held.enter_context(self._vmm()[0].hold_awake(
                    f"graph memory tagged {self.tag!r}",
                    holder=f"the capture space of {key!r} (GraphPool.space)"))
            space = self._spaces.get(key)
            if space is None:
                space = self._new_space(key)
            elif self.reuse == "vmm":
                self._vmm()[0].activate_space(space.index)
                _release_given_back(self.allocator, self._group)
            space.entries += 1
            space.reads |= self._reads_now()
            self._group.last_key = (id(self), key)
            inner.enter_context(tagged.capture_block(f"the capture space of {key!r} "
                                                     f"(GraphPool.space)"))
            if self.reuse in _VMM_BACKED:
                inner.enter_context(routing.target(self.device, self.allocator))
                if self.ops.capture_needs_use_pool:
                    inner.enter_context(self._vmm()[1].use_pool(space.pool))
            return space, inner, held
        except BaseException:
            inner.close()
            held.close()
            raise

    def _refuse_nesting(self, what: str) -> None:
        """Spaces of one allocator do not nest: the allocator's current space is the inner
        one until it ends, so the outer key would allocate in another key's range."""
        for open_space in _open_spaces():
            if open_space._pool._group is self._group:
                raise CaptureError(f"{what}: the capture space of {open_space.key!r} of the "
                                   f"same allocator is open on this thread; leave it first "
                                   f"(spaces do not nest, and graphs do not replay inside "
                                   f"a capture space)")

    def _new_space(self, key) -> _KeySpace:
        space = _KeySpace(key)
        if self.reuse == "shared":
            space.handle = self._shared_handle
        elif self.reuse == "vmm":
            (alloc, adapter), group = self._vmm(), self._group
            current = alloc.current_space
            if current in group.claimed or alloc.space_used_bytes(current) > 0:
                with self._clock("switch"):
                    try:
                        current = alloc.switch_to_new_virtual_space()  # merges first
                    except OutOfMemoryError as exc:
                        raise OutOfMemoryError(_no_address_space(
                            f"the capture space of {key!r}", exc,
                            f"each key reserves {alloc.reserve_bytes} bytes and "
                            f"{alloc.num_virtual_spaces} spaces exist")) from exc
                group.compact_pending = False
            group.given_back.discard(current)  # reused, if it was one
            _release_given_back(alloc, group)
            with routing.target(self.device, alloc), self._clock("new_pool"):
                space.pool = adapter.new_pool()
            space.handle = adapter.pool_handle(space.pool)
            space.index = current
            group.claimed.add(current)
        elif self.reuse == "single":
            alloc, adapter = self._vmm()
            if not self._single:  # the first key: the one pool every key captures into
                with routing.target(self.device, alloc), self._clock("new_pool"):
                    self._single.append(adapter.new_pool())
                self._group.claimed.add(alloc.current_space)
            space.pool = self._single[0]
            space.handle = adapter.pool_handle(space.pool)
            space.index = alloc.current_space
        self._spaces[key] = space
        return space

    def _exit(self, space: _KeySpace, inner, held, failed: bool, exc=None) -> None:
        try:
            err = routing.last_error() if self.reuse in _VMM_BACKED else None
            inner.close()
            if failed:
                if self.reuse == "vmm":
                    self._suspect(space)
                if err is not None and exc is not None and not isinstance(exc, VMMError):
                    raise CaptureError(f"capture into the space of {space.key!r} failed: "
                                       f"{exc} (the vmm_core allocator reported: {err})") from exc
                return
            if self.reuse not in _VMM_BACKED:
                space.captured += 1
                return
            if self.reuse == "vmm":  # "single": blocks alive now alias nothing: no guard
                with self._clock("escape_guard"):
                    escaped = self._escaped_blocks(space)
                if escaped:
                    self._group.poisoned = _escape_message(space.key,
                                                           [size for _, size in escaped])
                    self._group.escapes.append((weakref.ref(self), space, escaped))
                    raise CaptureEscapeError(self._group.poisoned)
            # merging handles remaps every space: once per key switch or first replay,
            # not after every graph (five pieces per size made ascending capture 1.46x)
            self._group.compact_pending = True
            space.nbytes = self._vmm()[0].space_used_bytes(space.index)
            space.captured += 1
            if not space.nbytes and self.reuse == "vmm":
                self._say_unrouted(space.key)
        finally:
            held.close()

    def _say_unrouted(self, key) -> None:
        """A capture that allocated nothing in its space, on a backend whose framework
        allocator cannot be routed there (the host's CPU allocator): its tensors live
        elsewhere and nothing is shared between keys.  Said in :meth:`stats`, and once
        per backend as a warning, as ``region()`` says it."""
        if self.fallback_reason is not None or routing.framework_routed(self.backend,
                                                                        self.device):
            return
        self.fallback_reason = (
            f"backend {self.backend.name!r} cannot place framework tensors in the pool's "
            f"spaces (its CPU allocator cannot be redirected): the captures allocated "
            f"nothing in vmm memory; allocate from pool.allocator inside a space")
        if self.backend.name not in _warned_unrouted:
            _warned_unrouted.add(self.backend.name)
            warnings.warn(f"GraphPool on the {self.backend.name!r} backend: the capture of "
                          f"key {key!r} allocated nothing in its space. Framework tensors made "
                          f"during a capture (torch.empty, a model's activations, ...) are "
                          f"NOT placed in graph pool memory on this backend, since its CPU "
                          f"allocator cannot be redirected; allocate from pool.allocator "
                          f"inside pool.space(key) (see examples/host_graph_pool.py)",
                          VMMFallbackWarning, stacklevel=outside_stacklevel())

    def _escaped_blocks(self, space: _KeySpace) -> list[tuple[int, int]]:
        """``(address, size)`` of live blocks of the space that no kept tensor lies in."""
        space.kept = [k for k in space.kept if k[0] is None or k[0]() is not None]
        extents = [(address, nbytes) for _, address, nbytes in space.kept]
        # an extent excuses every block it overlaps (one tensor may span several blocks)
        return [(address, size) for address, size in self._vmm()[1].live_blocks(space.pool)
                if not any(a < address + size and address < a + n for a, n in extents)]

    def _suspect(self, space: _KeySpace) -> None:
        """A failed capture may leave blocks alive (a workspace made lazily before the
        error); its traceback can still hold them, so they are checked again later."""
        try:
            left = self._escaped_blocks(space)
        except Exception:  # the framework's state after a failed capture: check later
            left = None
        if left is None or left:
            self._group.suspects.append((weakref.ref(self), space, left))

    def _check_suspects(self) -> None:
        """Poison the group if blocks a failed capture left are still alive now."""
        still = []
        for ref, space, left in self._group.suspects:
            pool = ref()
            if pool is None or space.pool is None:
                continue  # its pool was closed or dropped: its spaces are given back
            now = set(pool._escaped_blocks(space))
            alive = sorted(now if left is None else now & set(left))
            if alive:
                still.append((space.key, alive))
                self._group.escapes.append((ref, space, alive))
        self._group.suspects = []
        if still:
            key, alive = still[0]
            self._group.poisoned = (
                f"a failed capture into the space of {key!r} left {len(alive)} block(s) "
                f"alive ({', '.join(_size(s) for _, s in alive)}) after the error was "
                f"handled; they live in memory every other space reuses. Drop what the "
                f"failed capture allocated before capturing or replaying again. "
                + _REMEDY)
            raise CaptureEscapeError(self._group.poisoned)

    # ------------------------------------------------------------------ replay
    @contextlib.contextmanager
    def replaying(self, key):
        """Hold ``key``'s memory (and the memory its graphs read) awake while you launch.

        On entry: refuses a poisoned pool or sleeping memory (:class:`SleepStateError`
        naming the tag), maps the space if a lazy wake left it unmapped, and makes the
        current stream wait for the stream of the previous launch on this allocator.
        Until the block ends no sleep can start, so launch the key's graphs inside it,
        on the current stream.  Graphs of one allocator are serialized across threads.
        """
        group = self._group
        with self._serialized(), contextlib.ExitStack() as held:
            self._check_usable()
            self._refuse_nesting(f"replaying({key!r})")
            space = self._spaces.get(key)
            if space is None or not space.captured:
                raise CaptureError(self._not_captured(key, space))
            for tag, alloc in self._read_allocators(space):
                what = f"graph memory tagged {tag!r}" if alloc is self.allocator else \
                    f"memory tagged {tag!r}, which the graphs of {key!r} read,"
                held.enter_context(alloc.hold_awake(
                    what, holder=f"the replay block of {key!r} (GraphPool.replaying)"))
            if self.reuse in _VMM_BACKED:
                if group.last_key != (id(self), key):
                    self._compact_pending()
                self._vmm()[0].ensure_mapped(space.index)
            group.last_key = (id(self), key)
            current = self.ops.current_stream()
            if group.last_stream is not None:
                self.ops.wait_stream(current, group.last_stream)
            group.last_stream = current
            blocks = _replay_blocks()
            blocks.append((self, key))
            try:
                yield
            finally:
                blocks.pop()

    def replaying_here(self, key) -> bool:
        """Whether the innermost replay block on this thread is :meth:`replaying` of
        ``key`` of this pool (a graph's replay then only launches)."""
        blocks = _replay_blocks()
        return bool(blocks) and blocks[-1][0] is self and blocks[-1][1] == key

    def _not_captured(self, key, space) -> str:
        why = " (its capture failed or is still open)" if space is not None else ""
        keys = [k for k, s in self._spaces.items() if s.captured]
        shown = ", ".join(repr(k) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
        return (f"no graph was captured in the space of {key!r}{why}; {len(keys)} keys "
                f"captured: {shown}")

    def compact(self) -> None:
        """Merge the physical handles captures added into one, trimmed to what the spaces
        use (their bytes are copied).  The first replay of another key merges the newest
        handles anyway (:meth:`SharedVMMAllocator.merge_tail`, which keeps the cost per
        key flat); call it to see the settled memory before serving."""
        with self._serialized():
            self._check_usable()
            if self.allocator is not None:
                self._compact_pending(force=True)

    def _compact_pending(self, force: bool = False) -> None:
        if self._group.compact_pending or force:
            with self._clock("compact"):
                alloc = self._vmm()[0]
                if force:
                    alloc.compact()
                else:
                    alloc.merge_tail()
            self._group.compact_pending = False

    def before_replay(self, key) -> None:
        """Call before launching the graphs of ``key`` (see :meth:`replaying`).

        Unlike :meth:`replaying` it holds nothing after it returns: the engine itself must
        then keep ``vmm_core.sleep`` of the tags its graphs read from running until the
        launch is queued, and launch on the stream that was current here.
        """
        with self.replaying(key):
            pass

    def _read_allocators(self, space: _KeySpace) -> list:
        """(tag, allocator) pairs to hold awake, in one global order (no lock cycles)."""
        from ..memory import tagged

        pairs = []
        if self.allocator is not None:
            pairs.append((self.tag, self.allocator))
        reads = space.reads if self.reads is None else self.reads
        for tag in sorted(reads):
            for alloc in tagged.allocators(tag):
                if alloc.backend is self.backend and alloc.device == self.device and \
                        all(alloc is not a for _, a in pairs):
                    pairs.append((tag, alloc))
        return sorted(pairs, key=lambda pair: id(pair[1]))

    def _reads_now(self) -> set:
        from ..memory import tagged

        if self.reads is not None:
            return set(self.reads)
        return tagged.region_tags(self.backend, self.device)

    # ------------------------------------------------------------------ state
    def _vmm_adapter(self) -> AllocatorAdapter:
        if self.adapter is None:
            raise CaptureError(f"internal: a capture-space operation ran on a "
                               f"{self.reuse!r} pool, which has no spaces")
        return self.adapter

    def _vmm(self) -> tuple[SharedVMMAllocator, AllocatorAdapter]:
        """The allocator and adapter behind the spaces (only vmm code paths ask)."""
        if self.allocator is None or self.adapter is None:
            raise CaptureError(f"internal: a capture-space operation ran on a "
                               f"{self.reuse!r} pool, which has no spaces")
        return self.allocator, self.adapter

    def _check_usable(self) -> None:
        if self._closed:
            raise CaptureError("this graph pool was closed; create a new one")
        if self.allocator is not None and self.allocator.closed:
            raise CaptureError("the allocator of this graph pool was closed (by its "
                               "owner, not by this pool); create a new pool")
        if self._group.suspects and not self._group.poisoned:
            self._check_suspects()
        if self._group.poisoned and self._escapes_gone():
            self._group.poisoned, self._group.escapes = None, []
        if self._group.poisoned:
            raise CaptureError(f"this graph pool is unusable: {self._group.poisoned}")

    def _escapes_gone(self) -> bool:
        """Whether every block behind the group's poison is gone: freed, or in a space
        given back with its pool (closed or dropped), where it aliases nothing."""
        group = self._group
        if not group.escapes:
            return False  # poisoned by something that cannot be checked again
        try:
            for ref, space, blocks in group.escapes:
                if space.pool is None:
                    continue  # given back with its pool (closed, or dropped and reaped)
                pool = ref()
                if pool is None:
                    return False  # dropped: its spaces go back on the reaper, soon
                if set(pool._escaped_blocks(space)) & set(blocks):
                    return False
        except Exception:  # noqa: BLE001 - the framework cannot say: stay poisoned
            return False
        return True

    def _clock(self, phase: str):
        return timed(self._phase_seconds, phase)

    @property
    def keys(self) -> list:
        return list(self._spaces)

    @property
    def poisoned(self) -> str | None:
        """Why the pools of this allocator refuse work, or None (also once the blocks
        that poisoned them are gone)."""
        with self._group.lock:
            if self._group.poisoned and self._escapes_gone():
                self._group.poisoned, self._group.escapes = None, []
            return self._group.poisoned

    def stats(self) -> dict:
        """Spaces, bytes and timings; ``fallback`` says why vmm was not possible."""
        alloc = self.allocator
        spaces = dict(self._spaces)  # a capture on another thread may add a key meanwhile
        return {
            "backend": self.backend.name,
            "device": self.device,
            "tag": self.tag,
            "reuse": self.reuse,
            "requested_reuse": self.requested_reuse,
            "fallback": self.fallback_reason,
            "keys": list(spaces),
            "space_bytes": {k: s.nbytes for k, s in spaces.items()},
            "largest_space_bytes": max((s.nbytes for s in spaces.values()), default=0),
            "entries": sum(s.entries for s in spaces.values()),
            "reads": {k: sorted(s.reads if self.reads is None else self.reads)
                      for k, s in spaces.items()},
            "physical_bytes": alloc.physical_bytes if alloc else None,
            "virtual_spaces": alloc.num_virtual_spaces if alloc else None,
            "handles": alloc.num_handles if alloc else None,
            "switch_seconds": sum(alloc.switch_seconds) if alloc else 0.0,
            "compact_seconds": sum(alloc.compact_seconds) if alloc else 0.0,
            "phase_seconds": dict(self._phase_seconds),
            "asleep": alloc.asleep if alloc else False,
            "poisoned": self._group.poisoned,
            "executables": self._executables.stats() if self._executables else None,
        }

    def check_can_close(self) -> None:
        """Raise what :meth:`close` would refuse with now, changing nothing: a capture
        space of this pool open, or its allocator held awake on this thread (a capture
        space or replay block of any pool on it, ``hold_awake`` of its tag), whose block
        goes on using the pages close() gives back.  Callers that close the pool after
        work of their own (:meth:`GraphExecutor.close`) ask first."""
        for open_space in _open_spaces():
            if open_space._pool is self:
                raise CaptureError(f"GraphPool.close() inside the capture space of "
                                   f"{open_space.key!r} of this pool: leave that with block "
                                   f"first, then close()")
        held = self.allocator.held_here() if self.allocator is not None else None
        if held is not None and not self._closed:
            raise VMMError(f"GraphPool.close() inside {held}, which holds this pool's "
                           f"memory awake on this thread: leave that with block first, "
                           f"then close()")

    def close(self) -> None:
        """Give the spaces back.  Reset or drop every graph captured into them first.

        Idempotent.  An allocator a pool created is closed with the last pool on it (a
        second family keeps the first family's allocator open).  Refused, changing
        nothing, inside a block that uses the pool's memory (:meth:`check_can_close`)."""
        with self._serialized():
            if self._closed:
                return
            self.check_can_close()  # under the locks: no block starts before the close
            self._closed = True
            if self._finalizer is not None:
                self._finalizer.detach()
            _give_back(self._spaces, self.ops, self.adapter, self.allocator, self._group,
                       self.tag, self._executables,
                       self._single)


@contextlib.contextmanager
def timed(totals: dict, phase: str):
    """Add the block's wall time to ``totals[phase]`` (the per-phase timings of stats())."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - t0


def _tag_set(reads) -> frozenset:
    if isinstance(reads, str):
        reads = (reads,)
    try:
        names = frozenset(reads)
    except TypeError:  # reads=5 was a raw "'int' object is not iterable"
        raise ValueError(f"reads must be a tag name or a list of tag names (the tags of "
                         f"memory the graphs read), got {reads!r}") from None
    bad = [t for t in names if not isinstance(t, str) or not t]
    if bad:
        raise ValueError(f"reads must be tag names (non-empty strings), got {bad}")
    return names


def _give_back(spaces: dict, ops, adapter, allocator, group: _Group, tag: str,
               executables=None, single: list | None = None) -> None:
    """What close() gives back, and a pool collected without close() on the reaper: the
    executables, the framework pools, then the spaces, then this pool's use of the
    allocator, under the pool's locks in their order (re-entered from close()).  The use
    is given back even if the rest fails (a device error in the synchronize, a failed
    unmap): otherwise the tag stayed registered and an allocator a pool created was never
    closed, silently when the reaper ran it."""
    from ..memory import tagged

    # reaper.acquire: at exit the reaper does not wait for a lock that may never come free
    with reaper.acquire(tagged.state_lock()), group.lock:
        try:
            try:
                if executables is not None:
                    executables.close()
            finally:  # spaces go back even if a driver call failed
                _give_back_spaces(spaces, ops, adapter, allocator, group, single or [])
        finally:
            if allocator is not None:
                _release_use(group, tag, allocator)


def _give_back_spaces(spaces: dict, ops, adapter, allocator, group: _Group,
                      single: list) -> None:
    ops.synchronize()
    taken = list(spaces.values())
    spaces.clear()
    if adapter is not None:
        pools = list({id(p): p for p in [s.pool for s in taken if s.pool is not None]
                      + single}.values())  # "single": every key has the one pool
        single.clear()
        for pool in pools:
            adapter.release_pool(pool)
        for s in taken:
            s.pool = None
        del pools
        # the framework may still cache the dropped pools' segments; let it return them
        # before their addresses go back (a new space could get them again)
        adapter.flush()
    if allocator is None or allocator.closed:
        return
    for s in taken:
        group.claimed.discard(s.index)
        group.given_back.add(s.index)  # the current one: released once another is current
    _release_given_back(allocator, group)


def _release_given_back(allocator, group: _Group) -> None:
    """Release the given-back spaces that are no longer current (all are tried; the
    first error is raised after)."""
    if not group.given_back:
        return
    current = allocator.current_space
    stale = sorted(i for i in group.given_back if i != current)
    group.given_back.difference_update(stale)
    error = None
    for index in stale:
        try:
            allocator.release_virtual_space(index)
        except Exception as exc:  # noqa: BLE001 - the others still go back
            error = error or exc
    if error is not None:
        raise error


def _keep_live_blocks(allocator, group: _Group, reuse: str, adapter, single: list) -> None:
    """Tell the allocator which of its bytes a sleep must keep (and keep them even when
    it discards: ``preserve_live``): what replays read and no replay rewrites first.

    "vmm": the blocks declared with ``keep()`` in any pool of the group (valid until
    another key replays, they come back as they were); a raw address declared with
    keep() keeps the block it lies in.  "single": every block alive in the space (blocks
    alive after a capture are legal there), not the free ones."""
    if group.live_before is None:
        group.live_before = (allocator.preserve_live, allocator.live_ranges)
    allocator.preserve_live = True
    if allocator.live_ranges is not None:
        return  # set by the allocator's owner, or by the first pool of the group
    if reuse == "single":
        from ..memory.live_ranges import pool_live_ranges

        allocator.live_ranges = pool_live_ranges(allocator, adapter,
                                                 lambda: single[0] if single else None)
        return
    ref = weakref.ref(group)

    def kept() -> list[tuple[int, int]]:
        g = ref()
        if g is None:
            return []
        out: list[tuple[int, int]] = []
        for pool in list(g.pools):
            for space in list(pool._spaces.values()):
                extents = [(a, n, r is None and n == 1) for r, a, n in list(space.kept)
                           if r is None or r() is not None]
                out += [(a, n) for a, n, raw in extents if not raw]
                raws = [a for a, _, raw in extents if raw]
                if raws and space.pool is not None and pool.adapter is not None:
                    out += [(a, n) for a, n in pool.adapter.live_blocks(space.pool)
                            if any(a <= r < a + n for r in raws)]
        return out

    allocator.live_ranges = kept


def _release_use(group: _Group, tag: str, allocator) -> None:
    """A pool on ``allocator`` is gone; the last one closes an allocator a pool created."""
    from ..memory import tagged

    with tagged.state_lock(), group.lock:
        group.users -= 1
        group.tags[tag] -= 1
        if group.tags[tag] <= 0:
            tagged.unregister(tag, allocator)
        if group.users <= 0 and group.owned is not None:
            group.owned.close()
        elif group.users <= 0 and group.live_before is not None:
            # the last pool on a caller's allocator: what its sleeps keep is the
            # caller's choice again (the pools' kept blocks are gone with them)
            allocator.preserve_live, allocator.live_ranges = group.live_before
            group.live_before = None


def _no_address_space(what: str, exc, state: str = "") -> str:
    return (f"GraphPool: no address space left for {what}"
            f"{': ' + state if state else ''} ({exc}). Create the GraphPool with a smaller "
            f"reserve_bytes (GraphPool(reserve_bytes=...), enough for the largest key's "
            f"graph memory), or close pools you no longer use")


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} B"


_CLOSED_GIVEN = ("GraphPool was given a closed allocator; pass an open one (an allocator a "
                 "GraphPool created closes with the last pool on it, a dropped one too: to "
                 "keep one across pools, create the SharedVMMAllocator yourself and pass "
                 "it to every pool)")

_REMEDY = ("Every pool sharing this allocator refuses further use until those blocks are "
           "gone: free them (drop every tensor that lives there; on the host backend, "
           "deallocate them) or close the pool they were captured in. Then the allocator "
           "and its pools, new ones included, are usable again.")


def _escape_message(key, sizes: list[int]) -> str:
    listed = ", ".join(_size(s) for s in sorted(sizes))
    return (f"capture space {key!r}: {len(sizes)} block(s) allocated there are still alive "
            f"after the capture ({listed}) and were not declared with keep(). They live in "
            f"memory that every other space reuses, so later graphs would silently compute "
            f"wrong results. Typical cause: a library workspace or cache created lazily "
            f"inside the first capture (cuBLAS allocates 32 MiB per stream): warm up on the "
            f"capture stream first (GraphPool.warmup, or GraphExecutor's warmup=True), or "
            f"allocate the cache before capture. If the tensor is an output the next graph "
            f"of the same key reads, declare it with keep(). " + _REMEDY)
