"""GraphExecutor: a complete graph runner for people without one, on every backend.

It is a thin runner over :class:`vmm_core.GraphPool`, which decides spaces, pools, the
escape guard and replay ordering; this module only adds what a runner needs:

* Inputs are copied into persistent buffers allocated once at the largest shape,
  outside every graph pool; a call pads its batch up to the smallest bucket and
  replays that bucket's graph, which reads the buffers' leading slices.
* A bucket is captured on first use, into the GraphPool space keyed by the bucket, and
  never re-captured.  Before each capture the function is warmed up on the capture stream
  outside any pool, so libraries create their workspaces there and not in the space.
* Outputs are copied *inside the graph* into persistent buffers outside the pools, so
  a returned output stays valid until this executor runs again, whatever other graphs
  of the group replay in between; nothing of a capture stays alive in its space.
* Calls of executors sharing an allocator serialize on the group's lock, and the backend
  replays on one stream per device.
"""

from __future__ import annotations

import numbers
import time

from ..errors import CaptureError
from .capture_pool import missing_from_interface, warmup_takes_key
from .pool import GraphPool, timed
from .pool_arguments import check_reuse
from .shapes import default_buckets, pick_bucket

__all__ = ["GraphExecutor", "REUSE_MODES"]

#: what GraphExecutor takes as ``reuse`` (another kind of pool comes as ``pool=``)
REUSE_MODES = ("vmm",)


def _flatten(outputs):
    import torch

    if isinstance(outputs, torch.Tensor):
        return [outputs], True
    if isinstance(outputs, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in outputs):
        return list(outputs), False
    raise CaptureError(f"the captured function must return a tensor or a tuple/list of "
                       f"tensors, got {type(outputs).__name__}")


class GraphExecutor:
    """Capture ``fn`` once per bucket and replay it; graph memory at max(bucket).

    :param fn: ``fn(*inputs) -> tensor | tuple of tensors``; every input and output has
        the batch dimension first.
    :param max_inputs: example inputs at the largest batch (dim 0 is dynamic).
    :param buckets: batch sizes to capture (default 1, 2, 4, 8, then multiples of 16).
    :param reuse: ``"vmm"`` (the default and only mode of the pool the executor makes;
        plain torch pools, the benchmark's baselines, come as ``pool=``).
    :param backend: backend name or object (default: detected).
    :param allocator: a SharedVMMAllocator to share with other executors or GraphPools
        (a group: physical memory is the max over all their spaces).
    :param tag: sleep/wake tag of this executor's graph memory (``vmm_core.sleep``).
    :param reads: tags of memory ``fn`` reads (see :class:`GraphPool`); by default every
        ``region()`` tag alive on the device when a bucket is captured.
    :param warmup: warm up on the capture stream before each capture.  Turning it off
        is only for reproducing the workspace hazard.
    :param record_stream_reuse: enable ``graph_capture_record_stream_reuse`` during
        capture (CUDA, torch >= 2.9).
    :param executables: who keeps the buckets' graph executables, and under which budget
        (:class:`GraphPool`'s ``executables=``; docs/executables.md).
    :param pool: capture into this pool instead of a GraphPool the executor makes: any
        object with the interface of :class:`~vmm_core.graphs.capture_pool.CapturePool`
        (a GraphPool shared with the engine's own runner, or the benchmark's plain torch
        pools, ``vmm_bench.torch_pools``).  It brings its backend, device, memory and
        executables, so ``reuse``, ``backend``, ``allocator``, ``tag``, ``reads`` and
        ``executables`` are left out; :meth:`close` leaves it open (its owner closes it).
    """

    def __init__(self, fn, max_inputs, buckets=None, reuse: str = "vmm", *, backend=None,
                 allocator=None, tag: str = "graph", reads=None, warmup: bool = True,
                 record_stream_reuse: bool = False, executables=None, pool=None) -> None:
        import torch

        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        check_reuse("GraphExecutor", reuse, REUSE_MODES)
        if pool is not None:
            _check_given_pool(pool, reuse=reuse, backend=backend, allocator=allocator,
                              tag=tag, reads=reads, executables=executables)
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
            buckets = list(buckets)
            loose = [b for b in buckets
                     if not isinstance(b, numbers.Integral) or isinstance(b, bool)]
            if loose:  # int(1.5) would silently capture batch 1
                raise ValueError(f"buckets must be ints (batch sizes), got {loose[0]!r}")
            buckets = sorted(set(int(b) for b in buckets))
            if not buckets or buckets[0] < 1 or buckets[-1] > self.max_size:
                raise ValueError(f"buckets must lie in [1, {self.max_size}] (the batch of "
                                 f"max_inputs); got {buckets}")
        self.buckets = buckets
        self.fn = fn
        self._warmup = warmup
        self._record_stream_reuse = record_stream_reuse

        first = max_inputs[0]
        device = first.device.index if first.device.index is not None else 0
        #: whether close() closes the pool (the one this executor made)
        self._owns_pool = pool is None
        self.pool = GraphPool(device, backend=backend, tag=tag, allocator=allocator,
                              reuse=reuse, reads=reads, executables=executables) \
            if pool is None else pool
        self.backend, self.device, self.ops = self.pool.backend, device, self.pool.ops
        if first.device.type != self.ops.device_type:
            raise ValueError(f"max_inputs live on {first.device} but backend "
                             f"{self.backend.name!r} captures {self.ops.device_type} graphs; "
                             f"move them or pick the matching backend")
        if pool is not None and first.device.type != "cpu" and device != pool.device:
            raise ValueError(f"max_inputs live on {first.device} but the given pool "
                             f"captures on device {pool.device}; move them or pass a pool "
                             f"of that device")
        self._warmup_key = warmup_takes_key(self.pool)
        self.tag = getattr(self.pool, "tag", tag)
        self.requested_reuse = getattr(self.pool, "requested_reuse", self.pool.reuse)
        self.reuse = self.pool.reuse
        self.allocator = self.pool.allocator

        # persistent buffers, outside every pool
        self._inputs = [t.clone() for t in max_inputs]
        self._outputs: list | None = None  # persistent output buffers, from the first run
        self._single_output = True
        self._graphs: dict[int, object] = {}
        self._capture_seconds: dict[int, float] = {}
        self._phase_seconds: dict[str, float] = {}
        self.replays = 0
        self._closed = False

    # ------------------------------------------------------------------ calling
    def __call__(self, *inputs):
        import torch

        if self._closed:
            raise CaptureError("this GraphExecutor was closed (close()); create a new one")
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
        if n is None or n < 1:
            raise ValueError("batch size must be >= 1")
        bucket = pick_bucket(self.buckets, n)
        with self.pool.serialized():  # space() and replaying() refuse an unusable pool
            graph = self._graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket)
            # held awake from the check to the launch: a sleep cannot slip in between
            with self.pool.replaying(bucket):
                self._copy_inputs(inputs, n, bucket)
                self.ops.replay(graph)
            self.replays += 1
        assert self._outputs is not None  # made by the first capture
        outs = [o[:n] for o in self._outputs]
        return outs[0] if self._single_output else tuple(outs)

    def _copy_inputs(self, inputs, n: int, bucket: int) -> None:
        # the input buffers may still be read by this group's previous replay
        self.ops.order_after_replays()
        for x, buf in zip(inputs, self._inputs):
            buf[:n].copy_(x)
            if bucket > n:
                buf[n:bucket].zero_()

    def capture_all(self, order=None) -> None:
        """Capture every bucket now (in ``order`` if given) instead of on first use."""
        with self.pool.serialized():
            try:
                for b in (order or self.buckets):
                    if b not in self._graphs:
                        self._capture(b)
            finally:
                # give back what the captures' growth left unused, a failed capture's
                # too (outputs live outside); a full compact() would remap every space
                # after each growth
                self.pool.trim()

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
                self.pool.warmup(lambda: kept.append(run_eager()) if first else run_eager(),
                                 **({"key": bucket} if self._warmup_key else {}))
        elif first:
            # on the caller's stream, not the capture stream: that one stays unwarmed
            kept.append(run_eager())
        if first:
            self._make_output_buffers(kept.pop(), bucket)

        outputs = self._outputs
        assert outputs is not None

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

        graph = self.pool.new_graph()
        t0 = time.perf_counter()
        try:
            with self.ops.record_stream_reuse(self._record_stream_reuse), \
                    self.pool.space(bucket) as handle, self._clock("capture"):
                self.ops.capture(graph, run_and_copy, handle)
        except BaseException:
            self.ops.reset(graph)
            raise
        self._capture_seconds[bucket] = time.perf_counter() - t0
        self._graphs[bucket] = graph
        return graph

    def _clock(self, phase: str):
        return timed(self._phase_seconds, phase)

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

    @property
    def fallback_reason(self) -> str | None:
        """Why graph memory is not shared as ``reuse="vmm"`` asked, or None."""
        return self.pool.fallback_reason

    def stats(self) -> dict:
        """What was captured and what it costs (the GraphPool's stats plus the runner's)."""
        pool = self.pool.stats()
        phases = dict(pool.pop("phase_seconds"))
        for phase, seconds in self._phase_seconds.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
        pool.pop("keys")
        return {
            **pool,
            "captured_buckets": self.captured_buckets,
            "capture_seconds": sum(self._capture_seconds.values()),
            "phase_seconds": phases,
            "replays": self.replays,
        }

    def close(self) -> None:
        """Drop every graph; close the pool this executor made (its spaces, and the
        allocator if the pool made it).  A pool given as ``pool=`` stays open.

        Refused, changing nothing, inside a block that holds its memory awake on this
        thread (:meth:`GraphPool.check_can_close`)."""
        if self._owns_pool:
            self.pool.check_can_close()
        self._closed = True
        with self.pool.serialized():
            self.ops.synchronize()
            for graph in self._graphs.values():
                self.ops.reset(graph)
            self._graphs.clear()
            if self._owns_pool:
                self.pool.close()


def _check_given_pool(pool, **given) -> None:
    """``pool=`` brings what the pool arguments would make: refuse them beside it, and
    refuse an object without the pool interface."""
    missing = missing_from_interface(pool)
    if missing:
        raise TypeError(f"GraphExecutor(pool=...) takes a pool with the interface of "
                        f"vmm_core.graphs.capture_pool.CapturePool (a vmm_core.GraphPool, "
                        f"or the benchmark's vmm_bench.torch_pools); {type(pool).__name__} "
                        f"lacks {', '.join(missing)}")
    defaults = {"reuse": "vmm", "backend": None, "allocator": None, "tag": "graph",
                "reads": None, "executables": None}
    clashing = [name for name, value in given.items() if value != defaults[name]]
    if clashing:
        raise ValueError(f"GraphExecutor(pool=...): the pool brings its own "
                         f"{', '.join(clashing)}; drop {', '.join(n + '=' for n in clashing)} "
                         f"(set them on the pool)")
