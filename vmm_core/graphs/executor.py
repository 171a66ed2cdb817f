"""GraphExecutor: the one reuse policy for captured graphs, on every backend.

Policy (identical for every vendor; backends only supply graph ops and pools):

* Inputs are copied into persistent buffers allocated once at the largest shape,
  outside every graph pool; a call pads its batch up to the smallest bucket and
  replays that bucket's graph, which reads the buffers' leading slices.
* A bucket is captured on first use and never re-captured.
* Outputs are copied *inside the graph* into persistent buffers outside the pools, so
  a returned output stays valid until this executor runs again, whatever other graphs
  of the group replay in between.
* ``reuse="vmm"``: before each capture, warm up on the capture stream outside any pool
  (libraries create their workspaces there, not in the pool), switch the allocator to a
  new virtual space and capture into a fresh pool.  All graphs share physical pages.
* Escape guard: after a VMM capture nothing may remain allocated in its pool (outputs
  were copied out).  Anything that does (a lazily created library workspace, a cache)
  would alias every later graph's intermediates, so it is an error, never silence.
* Graphs of one group never run concurrently: calls serialize on the group's lock and
  the backend replays on one stream per device.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref

from ..errors import CaptureError, CaptureEscapeError, SleepStateError, VMMFallbackWarning
from ..memory import routing
from .shapes import default_buckets, pick_bucket

__all__ = ["GraphExecutor", "REUSE_MODES"]

REUSE_MODES = ("vmm", "shared", "private")


def _flatten(outputs):
    import torch

    if isinstance(outputs, torch.Tensor):
        return [outputs], True
    if isinstance(outputs, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in outputs):
        return list(outputs), False
    raise CaptureError(f"the captured function must return a tensor or a tuple/list of "
                       f"tensors, got {type(outputs).__name__}")


class _Group:
    """State shared by the executors that share one SharedVMMAllocator.

    An escape poisons the whole group, not only the executor that captured it: the
    escaped block lives on pages that every other space of the allocator reuses.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.poisoned: str | None = None


_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


def _group_of(allocator) -> _Group:
    with _groups_lock:
        group = _groups.get(allocator)
        if group is None:
            group = _groups[allocator] = _Group()
        return group


class GraphExecutor:
    """Capture ``fn`` once per bucket and replay it; graph memory at max(bucket).

    :param fn: ``fn(*inputs) -> tensor | tuple of tensors``; every input and output has
        the batch dimension first.
    :param max_inputs: example inputs at the largest batch (dim 0 is dynamic).
    :param buckets: batch sizes to capture (default 1, 2, 4, 8, then multiples of 16).
    :param reuse: ``"vmm"`` (default), ``"shared"`` (one pool for all graphs, vLLM's way)
        or ``"private"`` (a pool per graph).
    :param backend: backend name or object (default: detected).
    :param allocator: a SharedVMMAllocator to share with other executors (a group).
    :param tag: sleep/wake tag of this executor's graph memory (``vmm_core.sleep``).
    :param warmup: warm up on the capture stream before each capture.  Turning it off
        is only for reproducing the workspace hazard.
    :param record_stream_reuse: enable ``graph_capture_record_stream_reuse`` during
        capture (CUDA, torch >= 2.9).
    """

    def __init__(self, fn, max_inputs, buckets=None, reuse: str = "vmm", *, backend=None,
                 allocator=None, tag: str = "graph", warmup: bool = True,
                 record_stream_reuse: bool = False, shared_pool=None) -> None:
        import torch

        import vmm_core

        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {REUSE_MODES}, got {reuse!r}")
        if isinstance(max_inputs, torch.Tensor):
            max_inputs = (max_inputs,)
        max_inputs = tuple(max_inputs)
        if not max_inputs or not all(isinstance(t, torch.Tensor) for t in max_inputs):
            raise TypeError("max_inputs must be a tensor or a non-empty tuple of tensors")
        if any(t.dim() == 0 for t in max_inputs):
            raise ValueError("every input needs a batch dimension (dim 0); got a 0-d tensor")
        sizes = {t.shape[0] for t in max_inputs}
        if len(sizes) != 1:
            raise ValueError(f"all max_inputs must share dim 0 (the batch); got {sorted(sizes)}")
        self.max_size = sizes.pop()
        if buckets is None:
            buckets = default_buckets(self.max_size)
        else:
            buckets = sorted(set(int(b) for b in buckets))
            if not buckets or buckets[0] < 1 or buckets[-1] > self.max_size:
                raise ValueError(f"buckets must lie in [1, {self.max_size}] (the batch of "
                                 f"max_inputs); got {buckets}")
        self.buckets = buckets
        self.fn = fn
        self.requested_reuse = reuse
        self.tag = tag
        self._warmup = warmup
        self._record_stream_reuse = record_stream_reuse

        if backend is None or isinstance(backend, str):
            backend = vmm_core.get_backend(backend)
        self.backend = backend
        first = max_inputs[0]
        self.device = first.device.index if first.device.index is not None else 0
        self.ops = backend.graph_ops(self.device)
        if self.ops is None:
            raise CaptureError(f"backend {backend.name!r} has no graph ops (vmm_graph_ops "
                               f"returned None): graphs cannot be captured with it")
        if first.device.type != self.ops.device_type:
            raise ValueError(f"max_inputs live on {first.device} but backend "
                             f"{backend.name!r} captures {self.ops.device_type} graphs; move "
                             f"them or pick the matching backend")
        self.fallback_reason = None
        caps = backend.capabilities(self.device)
        self.adapter = backend.allocator_adapter(self.device) if reuse == "vmm" else None
        if reuse == "vmm" and (not caps.graph_pool or self.adapter is None
                               or not self.adapter.supports_pools):
            self.fallback_reason = (f"backend {backend.name!r} cannot capture into a "
                                    f"custom-allocator pool ({caps.notes or 'no pool support'}); "
                                    f"using one shared pool instead")
            warnings.warn(f"GraphExecutor(reuse='vmm'): {self.fallback_reason}",
                          VMMFallbackWarning, stacklevel=2)
            reuse = "shared"
        self.reuse = reuse

        self.allocator = None
        if reuse == "vmm":
            if allocator is None:
                allocator = vmm_core.SharedVMMAllocator(backend, device=self.device, tag=tag,
                                                        scratch=True)
                allocator.lazy_wake = True  # each graph maps its space on first replay
                self._owns_allocator = True
            else:
                self._owns_allocator = False
            self.allocator = allocator
            from ..memory import tagged

            tagged.register(tag, allocator)  # sleep/wake of the graph pools by tag
            self.adapter.prepare()
            if self._owns_allocator:
                # dropped without close(): still give the device memory back
                self._finalizer = weakref.finalize(self, _close_allocator, tag, allocator)
            self._group = _group_of(allocator)
        else:
            self._owns_allocator = False
            self._group = _Group()
        self._shared_pool = shared_pool
        if reuse == "shared" and shared_pool is None:
            self._shared_pool = self.ops.shared_pool_handle()

        # persistent buffers, outside every pool
        self._inputs = [t.clone() for t in max_inputs]
        self._outputs = None
        self._single_output = True
        self._graphs: dict[int, object] = {}
        self._pools: dict[int, object] = {}
        self._spaces: dict[int, int] = {}
        self._capture_seconds: dict[int, float] = {}
        self._spaces_used = 0
        self._phase_seconds: dict[str, float] = {}
        self._space_bytes: dict[int, int] = {}
        self.replays = 0

    # ------------------------------------------------------------------ calling
    def __call__(self, *inputs):
        import torch

        self._check_poison()
        if len(inputs) != len(self._inputs):
            raise TypeError(f"expected {len(self._inputs)} input tensor(s), got {len(inputs)}")
        n = None
        for i, (x, buf) in enumerate(zip(inputs, self._inputs)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} is {type(x).__name__}, not a tensor")
            if x.dtype != buf.dtype or x.shape[1:] != buf.shape[1:] or x.device != buf.device:
                raise ValueError(
                    f"input {i} is {tuple(x.shape)} {x.dtype} on {x.device}; this executor "
                    f"takes [batch, {', '.join(map(str, buf.shape[1:]))}] {buf.dtype} on "
                    f"{buf.device}")
            if n is None:
                n = x.shape[0]
            elif x.shape[0] != n:
                raise ValueError(f"inputs disagree on the batch size: {n} vs {x.shape[0]}")
        if n < 1:
            raise ValueError("batch size must be >= 1")
        bucket = pick_bucket(self.buckets, n)
        # The allocator's lock is held from the asleep check to the launch, so a sleep
        # from another thread cannot unmap the pages in between.
        awake_lock = self.allocator._lock if self.allocator is not None else \
            contextlib.nullcontext()
        with self._group.lock, awake_lock:
            self._check_poison()
            if self.allocator is not None and self.allocator.asleep:
                raise SleepStateError(
                    f"graph memory tagged {self.tag!r} is asleep: replaying now would fault "
                    f"the device; call vmm_core.wake_up({self.tag!r}) first")
            # the input buffers may still be read by this group's previous replay
            self.ops.order_after_replays()
            for x, buf in zip(inputs, self._inputs):
                buf[:n].copy_(x)
                if bucket > n:
                    buf[n:bucket].zero_()
            graph = self._graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket)
            elif self.reuse == "vmm":
                self.allocator.ensure_mapped(self._spaces[bucket])
            self.ops.replay(graph)
            self.replays += 1
        outs = [o[:n] for o in self._outputs]
        return outs[0] if self._single_output else tuple(outs)

    def capture_all(self, order=None) -> None:
        """Capture every bucket now (in ``order`` if given) instead of on first use."""
        with self._group.lock:
            for b in (order or self.buckets):
                if b not in self._graphs:
                    self._capture(b)

    # ------------------------------------------------------------------ capture
    def _capture(self, bucket: int):
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not one of this executor's buckets")
        static = [buf[:bucket] for buf in self._inputs]

        def run_eager():
            return self.fn(*static)

        first = self._outputs is None
        kept = []  # the first run's outputs give the persistent buffers' shapes
        if self._warmup:
            with self._clock("warmup"):
                self.ops.warmup(lambda: kept.append(run_eager()) if first else run_eager())
        elif first:
            # on the caller's stream, not the capture stream: that one stays unwarmed
            kept.append(run_eager())
        if first:
            self._make_output_buffers(kept.pop(), bucket)

        outputs = self._outputs

        def run_and_copy():
            flat, _ = _flatten(self.fn(*static))
            if len(flat) != len(outputs):
                raise CaptureError(f"fn returned {len(flat)} outputs for batch {bucket} but "
                                   f"{len(outputs)} before; the output structure must not "
                                   f"depend on the batch")
            for o, buf in zip(flat, outputs):
                if o.shape[0] != bucket or o.shape[1:] != buf.shape[1:] or o.dtype != buf.dtype:
                    raise CaptureError(
                        f"output {tuple(o.shape)} {o.dtype} for batch {bucket} does not fit "
                        f"[batch, {', '.join(map(str, buf.shape[1:]))}] {buf.dtype}: outputs "
                        f"must have the batch dimension first")
                buf[:bucket].copy_(o)

        graph = self.ops.new_graph()
        t0 = time.perf_counter()
        with self.ops.record_stream_reuse(self._record_stream_reuse):
            if self.reuse == "vmm":
                self._capture_vmm(bucket, graph, run_and_copy)
            else:
                pool = self._shared_pool if self.reuse == "shared" else None
                with self._clock("capture"):
                    self.ops.capture(graph, run_and_copy, pool)
        self._capture_seconds[bucket] = time.perf_counter() - t0
        self._graphs[bucket] = graph
        return graph

    def _capture_vmm(self, bucket: int, graph, run_and_copy) -> None:
        alloc, adapter, ops, clock = self.allocator, self.adapter, self.ops, self._clock
        if self._spaces_used or alloc.space_used_bytes() > 0:
            with clock("switch"):
                alloc.switch_to_new_virtual_space()
        space = alloc.current_space
        self._spaces_used += 1
        with routing.target(self.device, alloc):
            with clock("new_pool"):
                pool = adapter.new_pool()
            inside = adapter.use_pool(pool) if ops.capture_needs_use_pool else \
                contextlib.nullcontext()
            try:
                with clock("capture"), inside:
                    ops.capture(graph, run_and_copy, adapter.pool_handle(pool))
            except BaseException as exc:
                err = routing.last_error()
                if err is not None and not isinstance(exc, CaptureError):
                    raise CaptureError(f"capture of batch {bucket} failed: {exc} (the "
                                       f"vmm_core allocator reported: {err})") from exc
                raise
            with clock("escape_guard"):
                live = adapter.live_blocks(pool)
        if live:
            ops.reset(graph)
            self._group.poisoned = _escape_message(bucket, live)
            raise CaptureEscapeError(self._group.poisoned)
        with clock("compact"):
            alloc.compact()
        self._pools[bucket] = pool
        self._spaces[bucket] = space
        self._space_bytes[bucket] = alloc.space_used_bytes(space)

    @contextlib.contextmanager
    def _clock(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._phase_seconds[phase] = self._phase_seconds.get(phase, 0.0) + \
                time.perf_counter() - t0

    def _check_poison(self) -> None:
        if self._group.poisoned:
            raise CaptureError(f"this executor's graph group is unusable: "
                               f"{self._group.poisoned}")

    def _make_output_buffers(self, out, bucket: int) -> None:
        import torch

        flat, single = _flatten(out)
        buffers = []
        for o in flat:
            if o.dim() == 0 or o.shape[0] != bucket:
                raise CaptureError(
                    f"output of shape {tuple(o.shape)} for batch {bucket}: outputs must have "
                    f"the batch dimension first so they can be sliced to the real batch")
            buffers.append(torch.empty((self.max_size,) + tuple(o.shape[1:]),
                                       dtype=o.dtype, device=o.device))
        self._outputs = buffers
        self._single_output = single

    # ------------------------------------------------------------------ introspection
    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._graphs)

    def stats(self) -> dict:
        """What was captured and what it costs."""
        alloc = self.allocator
        return {
            "backend": self.backend.name,
            "reuse": self.reuse,
            "requested_reuse": self.requested_reuse,
            "fallback": self.fallback_reason,
            "captured_buckets": self.captured_buckets,
            "physical_bytes": alloc.physical_bytes if alloc else None,
            "virtual_spaces": alloc.num_virtual_spaces if alloc else None,
            "handles": alloc.num_handles if alloc else None,
            "capture_seconds": sum(self._capture_seconds.values()),
            "switch_seconds": sum(alloc.switch_seconds) if alloc else 0.0,
            "compact_seconds": sum(alloc.compact_seconds) if alloc else 0.0,
            "phase_seconds": dict(self._phase_seconds),
            "space_bytes": dict(self._space_bytes),
            "replays": self.replays,
            "asleep": alloc.asleep if alloc else False,
        }

    def close(self) -> None:
        """Drop every graph; release the spaces (and allocator, if this executor made it)."""
        with self._group.lock:
            self.ops.synchronize()
            for graph in self._graphs.values():
                self.ops.reset(graph)
            self._graphs.clear()
            pools = list(self._pools.values())
            self._pools.clear()
            if self.adapter is not None:
                for pool in pools:
                    self.adapter.release_pool(pool)
                del pools
                # the framework may still cache the dropped pools' segments; let it return
                # them before their addresses go back (a new space could get them again)
                self.adapter.flush()
            if self.allocator is not None:
                if self._owns_allocator:
                    self._finalizer()
                else:
                    current = self.allocator.current_space
                    for space in set(self._spaces.values()) - {current}:
                        self.allocator.release_virtual_space(space)
            self._spaces.clear()


def _close_allocator(tag: str, allocator) -> None:
    from ..memory import tagged

    tagged.unregister(tag, allocator)
    allocator.close()


def _escape_message(bucket: int, live: list[int]) -> str:
    sizes = ", ".join(f"{s / 2**20:.2f} MiB" if s >= 2**20 else f"{s} B" for s in sorted(live))
    return (f"capture of batch {bucket}: {len(live)} block(s) allocated during the capture "
            f"are still alive after it ({sizes}). They live in memory that every later "
            f"graph reuses, so those graphs would silently compute wrong results. Typical "
            f"cause: a library workspace or cache created lazily inside the first capture "
            f"(cuBLAS allocates 32 MiB per stream). Fix: keep warmup=True (the default), run "
            f"fn once on the capture stream before capturing, or allocate the cache before "
            f"capture. The executors sharing this allocator refuse further use; create new "
            f"ones after fixing.")
