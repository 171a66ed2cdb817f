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

This module decides spaces, pools and replay ordering; the capture block and the escape
guard are :mod:`.capture_space`, what pools of one allocator share and give back is
:mod:`.pool_group`, and the arguments are checked by :mod:`.pool_arguments`.
:class:`vmm_core.GraphExecutor` is a runner built on it.

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
import time
import warnings
import weakref

from ..errors import CaptureError, VMMError, VMMFallbackWarning
from ..memory import offload, reaper, routing
from ..memory.allocator import SharedVMMAllocator
from .capture_space import CaptureSpace, KeySpace, open_spaces, replay_blocks, unrouted_reason
from .exec_ahead import preparation_paused
from .exec_blocks import replay_block
from .executables import executables_for
from .pool_arguments import REUSE_MODES, PoolArguments, check_pool_arguments
from .pool_group import (
    PoolGroup,
    give_back,
    group_of,
    join_allocator,
    release_given_back,
)

__all__ = ["GraphPool", "CaptureSpace", "REUSE_MODES", "FALLBACK", "timed"]

#: what a pool whose backend cannot capture into a custom-allocator pool does instead:
#: one framework pool handle shared by every key (stats()["reuse"] says so)
FALLBACK = "shared"


class GraphPool:
    """One capture space per key; all spaces share one set of physical pages.

    :param device: device index (default: the framework's current device).
    :param backend: backend name or object (default: detected).
    :param tag: sleep/wake tag of the graph memory (``vmm_core.sleep("graph")``).
    :param allocator: a SharedVMMAllocator to share with other GraphPools or executors
        (graph families): physical memory is then the max over all their spaces.
    :param reuse: ``"vmm"`` (default) or ``"single"``: every key captures into one VMM
        space of the pool's own allocator, in capture order, exactly as captures sharing
        one ``graph_pool_handle()`` would (blocks alive after a capture are legal, since
        nothing aliases them, and survive every sleep, while free blocks are discarded);
        what drop-in replacements of a shared pool need.  A backend that cannot capture
        into a custom-allocator pool gets one shared framework pool instead, with a
        :class:`VMMFallbackWarning` (``stats()["reuse"] == "shared"``).  Plain torch pools
        for comparison are the benchmark's (``vmm_bench.torch_pools``).
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
        args = check_pool_arguments(device, backend=backend, tag=tag, allocator=allocator,
                                    reuse=reuse, reads=reads, reserve_bytes=reserve_bytes,
                                    executables=executables)
        self.backend, self.device, self.tag = args.backend, args.device, args.tag
        self.requested_reuse, self.reads = args.reuse, args.reads
        self.allocator: SharedVMMAllocator | None = None
        self._spaces: dict = {}
        #: reuse="single": the one framework pool every key captures into, once made
        self._single: list = []
        self._phase_seconds: dict[str, float] = {}
        self._closed = False
        self._finalizer: weakref.finalize | None = None
        self.ops = self._graph_ops(args)
        # decided before anything is registered: a refused policy leaves nothing behind
        self._executables = executables_for(self, self.ops, args.executables)
        self.reuse, self.adapter, self.fallback_reason = self._capture_pools(args.reuse)
        if self.adapter is not None:
            self.allocator, self._group = join_allocator(self, args)
        else:
            self._group = PoolGroup()
        self._shared_handle = self.ops.shared_pool_handle() if self.reuse == FALLBACK \
            else None
        self._arm_finalizer()

    # ------------------------------------------------------------------ wiring
    def _graph_ops(self, args: PoolArguments):
        """The group's graph ops where this pool joins pools of a given allocator (one
        capture stream for all), else the backend's."""
        if args.allocator is not None and args.reuse == "vmm":
            ops = group_of(args.allocator).ops
            if ops is not None:
                return ops
        ops = self.backend.graph_ops(self.device)
        if ops is None:
            raise CaptureError(f"backend {self.backend.name!r} has no graph ops "
                               f"(vmm_graph_ops returned None): graphs cannot be captured "
                               f"with it")
        return ops

    def _capture_pools(self, reuse: str) -> tuple:
        """``(reuse, adapter, fallback reason)``: the backend's allocator adapter, or the
        fallback to one shared framework pool where the framework cannot capture into a
        custom-allocator pool."""
        adapter = self.backend.allocator_adapter(self.device)
        caps = self.backend.capabilities(self.device)
        if caps.graph_pool and adapter is not None and adapter.supports_pools:
            return reuse, adapter, None
        reason = (f"backend {self.backend.name!r} cannot capture into a custom-allocator "
                  f"pool ({caps.notes or 'no pool support'}); using one shared pool instead")
        warnings.warn(f"GraphPool(reuse={reuse!r}): {reason}", VMMFallbackWarning,
                      stacklevel=3)
        return FALLBACK, None, reason

    def _arm_finalizer(self) -> None:
        """Dropped without close(): give the spaces back as close() does, and the
        allocator too when this was its last pool (on the reaper thread: the collector
        may run while a backend lock is held)."""
        if self.allocator is not None:
            self._finalizer = weakref.finalize(
                self, reaper.close_later, give_back, self._spaces, self.ops, self.adapter,
                self.allocator, self._group, self.tag, self._executables, self._single)
        elif self._executables is not None:  # no spaces to give back: only these
            self._finalizer = weakref.finalize(self, reaper.close_later,
                                               self._executables.close)

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
        spaces = [s for s in open_spaces() if s._pool is self]
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

    def warmup(self, fn, key=None) -> None:
        """Run ``fn()`` eagerly on :attr:`capture_stream`, outside every pool.

        cuBLAS creates its 32 MiB workspace on the first use of each stream; created
        inside a capture it would land in the space and be reported as an escape.

        With ``key`` (the key about to be captured), a key without a space gets it while
        the device runs ``fn``: a new virtual space costs driver calls (reserve, map,
        grant access; about 0.25 ms on an H200), which the wait for the warmup's kernels
        then hides in part, and ``space(key)`` only enters it.  With ``key`` the whole
        warm-up holds the pool's locks as :meth:`space` does: another thread's capture or
        replay block of the allocator ends first (its capture stream is this one)."""
        if key is None or self.reuse != "vmm" or self.adapter is None:
            self.ops.warmup(fn)
            return
        with self.serialized():
            self.ops.warmup_overlapping(fn, lambda: self._prepare_space(key))

    def _prepare_space(self, key) -> None:
        """Make ``key``'s space now, as :meth:`space` would on entry; nothing where it
        exists, where a space of this allocator is open on this thread (it is the
        allocator's current space until it ends), or where the pool could not capture
        now: :meth:`space` then raises what it raised before (a poison is first
        raised as the escape it is, so nothing here consumes the guard's suspects).

        The allocator's current space stays the one it was: a lazy wake maps only the
        current space, and the key captured last (whose kept tensors an engine reads
        next) must not lose that to a space nothing was captured in yet.  Called by
        :meth:`warmup`, which holds the pool's locks."""
        hash(key)
        alloc = self._vmm()[0]
        guard = self._group.guard
        if key in self._spaces or self._closed or alloc.closed or alloc.asleep \
                or guard.poisoned or guard.suspects or self._open_space_of_group():
            return
        with alloc.hold_awake(f"graph memory tagged {self.tag!r}",
                              holder=f"the preparation of the space of {key!r} "
                                     f"(GraphPool.warmup)"):
            before = alloc.current_space
            self._new_space(key)
            if before in alloc.space_indices():  # not given back meanwhile
                alloc.activate_space(before)

    @contextlib.contextmanager
    def serialized(self):
        """The locks every capture, replay and merge holds, always in this order: first
        the process-wide lock of tagged memory (which sleep, wake and ``hold_awake`` take
        first too, so an engine holding tags awake can call :meth:`before_replay`), then
        the group's.  No sleep starts while a capture or a replay block is open; a runner
        holds it across its own check, capture and launch (:class:`GraphExecutor`)."""
        from ..memory import tagged

        with tagged.state_lock(), self._group.lock:
            yield

    def _enter(self, key, record_stream_reuse: bool = False):
        from ..memory import tagged

        held = contextlib.ExitStack()
        inner = contextlib.ExitStack()
        held.enter_context(self.serialized())
        try:
            self._check_usable()
            # a kept host copy registering on another thread may be a call a device capture
            # in global mode refuses from any thread (the CUDA hooks avoid it in relaxed
            # thread mode; a backend may not): let it finish first.  Holding the
            # tagged-memory lock, no sleep or wake can start another until the block ends
            offload.wait_for_pinning()
            # likewise an executable being made ahead on another thread: none while open
            inner.enter_context(preparation_paused())
            if record_stream_reuse:  # first: an unsupported flag changes nothing
                inner.enter_context(self.ops.record_stream_reuse(True))
            if self.adapter is not None:
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
                release_given_back(self.allocator, self._group)
            space.entries += 1
            space.reads |= self._reads_now()
            self._group.last_key = (id(self), key)
            inner.enter_context(tagged.capture_block(f"the capture space of {key!r} "
                                                     f"(GraphPool.space)"))
            if self.adapter is not None:
                inner.enter_context(routing.target(self.device, self.allocator))
                if self.ops.capture_needs_use_pool:
                    inner.enter_context(self._vmm()[1].use_pool(space.pool))
            return space, inner, held
        except BaseException:
            inner.close()
            held.close()
            raise

    def _open_space_of_group(self):
        """A capture space of this pool's allocator open on this thread, or None."""
        return next((s for s in open_spaces() if s._pool._group is self._group), None)

    def _refuse_nesting(self, what: str) -> None:
        """Spaces of one allocator do not nest: the allocator's current space is the inner
        one until it ends, so the outer key would allocate in another key's range."""
        open_space = self._open_space_of_group()
        if open_space is not None:
            raise CaptureError(f"{what}: the capture space of {open_space.key!r} of the "
                               f"same allocator is open on this thread; leave it first "
                               f"(spaces do not nest, and graphs do not replay inside "
                               f"a capture space)")

    def _new_space(self, key) -> KeySpace:
        space = KeySpace(key)
        if self.reuse == FALLBACK:
            space.handle = self._shared_handle
        elif self.reuse == "vmm":
            self._switch_space(space)
        else:  # "single": every key in the one pool of the first
            alloc, adapter = self._vmm()
            if not self._single:
                with routing.target(self.device, alloc), self._clock("new_pool"):
                    self._single.append(adapter.new_pool())
                self._group.claimed.add(alloc.current_space)
            space.pool = self._single[0]
            space.handle = adapter.pool_handle(space.pool)
            space.index = alloc.current_space
        self._spaces[key] = space
        return space

    def _switch_space(self, space: KeySpace) -> None:
        """Give ``space`` a virtual space of its own and a fresh framework pool over it."""
        (alloc, adapter), group = self._vmm(), self._group
        index = group.space_for_new_key(alloc, space.key, self._clock)
        with routing.target(self.device, alloc), self._clock("new_pool"):
            space.pool = adapter.new_pool()
        space.handle = adapter.pool_handle(space.pool)
        space.index = index
        group.claimed.add(index)

    def _exit(self, space: KeySpace, inner, held, failed: bool, exc=None) -> None:
        try:
            err = routing.last_error() if self.adapter is not None else None
            inner.close()
            if failed:
                if self.reuse == "vmm":
                    self._group.guard.suspect(self, space)
                if err is not None and exc is not None and not isinstance(exc, VMMError):
                    raise CaptureError(f"capture into the space of {space.key!r} failed: "
                                       f"{exc} (the vmm_core allocator reported: {err})") from exc
                return
            if self.adapter is None:
                space.captured += 1
                return
            if self.reuse == "vmm":  # "single": blocks alive now alias nothing: no guard
                with self._clock("escape_guard"):
                    self._group.guard.check_capture(self, space)
            # merging handles remaps every space: once per key switch or first replay,
            # not after every graph (five pieces per size made ascending capture 1.46x)
            self._group.compact_pending = True
            space.nbytes = self._vmm()[0].space_used_bytes(space.index)
            space.captured += 1
            if not space.nbytes and self.reuse == "vmm" and self.fallback_reason is None:
                self.fallback_reason = unrouted_reason(self.backend, self.device, space.key)
        finally:
            held.close()

    # ------------------------------------------------------------------ replay
    def replaying(self, key):
        """Hold ``key``'s memory (and the memory its graphs read) awake while you launch.

        On entry: refuses a poisoned pool or sleeping memory (:class:`SleepStateError`
        naming the tag), maps the space if a lazy wake left it unmapped, and makes the
        current stream wait for the stream of the previous launch on this allocator.
        Until the block ends no sleep can start, so launch the key's graphs inside it,
        on the current stream.  Graphs of one allocator are serialized across threads.
        """
        return self._replay_block(key, step=True)

    @contextlib.contextmanager
    def _replay_block(self, key, step: bool):
        """:meth:`replaying`; ``step=False``: one graph's launch outside a block of its
        key, not a step of the engine (what comes next is not learned from it)."""
        group = self._group
        with self.serialized(), contextlib.ExitStack() as held:
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
            if self.adapter is not None:
                if group.last_key != (id(self), key):
                    self._compact_pending()
                self._vmm()[0].ensure_mapped(space.index)
            group.last_key = (id(self), key)
            current = self.ops.current_stream()
            if group.last_stream is not None:
                self.ops.wait_stream(current, group.last_stream)
            group.last_stream = current
            # its graphs' fast launch path
            block = replay_block(self._executables, key, replay_blocks(), self, step)
            try:
                with block:
                    yield
            except BaseException as exc:  # completes an end a Ctrl-C cut (ends it once)
                block.close(abandoned=isinstance(exc, GeneratorExit))
                raise

    def replaying_here(self, key) -> bool:
        """Whether the innermost replay block on this thread is :meth:`replaying` of
        ``key`` of this pool (a graph's replay then only launches)."""
        blocks = replay_blocks()
        return bool(blocks) and blocks[-1][0] is self and blocks[-1][1] == key

    def _not_captured(self, key, space) -> str:
        why = "" if space is None else \
            " (its space was made by warmup(fn, key); nothing was captured in it yet)" \
            if not space.entries else " (its capture failed or is still open)"
        keys = [k for k, s in self._spaces.items() if s.captured]
        shown = ", ".join(repr(k) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
        return (f"no graph was captured in the space of {key!r}{why}; {len(keys)} keys "
                f"captured: {shown}")

    def expect(self, *keys) -> None:
        """Say which keys the next replay blocks will be, the next first (an engine knows
        its next padded batch size before it launches).  Under a policy that prepares
        executables ahead (``ExecutablePolicy(ahead=True)``, the default under a budget)
        their executables are made or updated now on a thread of the pool's own, in
        place of the keys the pool values least; elsewhere nothing happens.  A hint, not
        a promise: a key never replayed costs only that work.  See docs/executables.md."""
        if self._executables is not None:
            self._executables.expect(keys)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no executable is being prepared ahead (False if ``timeout`` passed
        first).  Call it before capturing a graph outside this pool's spaces in global
        capture mode, which some driver calls on other threads would invalidate (the
        pool's own spaces pause the preparation themselves)."""
        if self._executables is None:
            return True
        return self._executables.settle(timeout)

    def compact(self) -> None:
        """Merge the physical handles captures added into one, trimmed to what the spaces
        use (their bytes are copied).  It remaps every space; :meth:`trim` gives the same
        memory back remapping only the newest handles' spaces."""
        with self.serialized():
            self._check_usable()
            if self.allocator is not None:
                self._compact_pending(force=True)

    def trim(self) -> None:
        """Give back the physical memory no space uses (the unused tail of the last
        growth step), merging the newest handles as a switch of keys does
        (:meth:`SharedVMMAllocator.merge_tail`): physical memory is then what the
        largest key uses, at a cost that does not grow with the number of keys.  A
        runner calls it after capturing (:meth:`GraphExecutor.capture_all`); the first
        replay of another key does it anyway."""
        with self.serialized():
            self._check_usable()
            if self.allocator is not None:
                self._merge(full=False)

    def _compact_pending(self, force: bool = False) -> None:
        if self._group.compact_pending or force:
            self._merge(full=force)

    def _merge(self, full: bool) -> None:
        """All handles into one (``full``), or the newest ones and the unused tail."""
        with self._clock("compact"):
            alloc = self._vmm()[0]
            if full:
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

    def _read_allocators(self, space: KeySpace) -> list:
        """(tag, allocator) pairs to hold awake, in one global order (no lock cycles)."""
        from ..memory import tagged

        pairs: list = []
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
    def _vmm(self) -> tuple:
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
        self._group.guard.refuse_if_poisoned()

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
            return self._group.guard.current()

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
        for open_space in open_spaces():
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
        with self.serialized():
            if self._closed:
                return
            self.check_can_close()  # under the locks: no block starts before the close
            self._closed = True
            if self._finalizer is not None:
                self._finalizer.detach()
            give_back(self._spaces, self.ops, self.adapter, self.allocator, self._group,
                      self.tag, self._executables, self._single)


@contextlib.contextmanager
def timed(totals: dict, phase: str):
    """Add the block's wall time to ``totals[phase]`` (the per-phase timings of stats())."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - t0
