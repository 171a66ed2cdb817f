"""The graph-ops role every backend fills: the framework's graph API, nothing more.

The reuse policy (capture spaces, the escape guard, replay ordering) lives in
:class:`vmm_core.GraphPool` and the runner policy (buckets, persistent buffers) in
:class:`vmm_core.GraphExecutor`; a backend only says how to warm up, capture into a given
pool, replay, and order work between streams.  Backends return an instance from their
``vmm_graph_ops`` hook.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Hashable

__all__ = ["GraphOps", "Executables"]


class Executables(abc.ABC):
    """The optional capability of owning graph executables apart from the framework.

    A framework makes one executable per captured graph and frees it only with the graph;
    :mod:`vmm_core.graphs.executables` instead instantiates executables of *kept* graphs
    (``GraphOps.new_graph(keep=True)``) on demand, under a budget, and destroys them on
    sleep.  A backend that can do this returns an instance from
    :meth:`GraphOps.executables`; handles are opaque to the policy.
    """

    #: :meth:`random_kernels` reads a captured graph's kernels: a pool may then tell the
    #: graphs that draw random numbers without watching every captured operator through
    #: the dispatcher, a Python call each (``ExecutablePolicy(random_numbers="kernels")``)
    reads_random_kernels: bool = False
    #: where :attr:`reads_random_kernels` is False on a backend that can read kernels in
    #: general, why not here (an old driver, a helper library not built), for errors
    why_not_reading: str | None = None
    #: an executable updated to another graph runs it slower than one made from it, on
    #: every launch: a pool that prepares ahead makes such executables again from their
    #: own graphs while its thread has nothing else to do
    updated_runs_slower: bool = False

    def sees_generator_state(self) -> bool:
        """Whether :meth:`random_kernels` sees every kernel handed the framework
        generator's captured state, inside a parameter struct as well as by value (then
        a pool's default reads kernels instead of watching every captured operator).
        May do work once (CUDA: one probe capture per device)."""
        return False

    def random_kernels(self, graph) -> tuple[str, ...]:
        """What in the captured ``graph`` draws random numbers from the framework's
        generator: the names of such kernels, and a description of any part the backend
        could not read (either keeps the graph on the framework's replay, the only one
        that advances the generator).  Called only where :attr:`reads_random_kernels`
        and the pool's policy asks for it."""
        return ()

    @abc.abstractmethod
    def instantiate(self, graph):
        """A new executable (a handle) of the kept, captured ``graph``."""

    @abc.abstractmethod
    def launch(self, handle, stream=None) -> None:
        """Launch the executable on ``stream`` (one :meth:`GraphOps.current_stream`
        returned), by default on the caller's current stream of the device (the launch
        is the hot path: a backend may read its current stream faster than the ops can
        hand it over)."""

    @abc.abstractmethod
    def update(self, handle, graph) -> str | None:
        """Make ``handle`` run ``graph`` from its next launch: None when done, else the
        reason it was refused (the handle must then not be launched again; destroy it)."""

    @abc.abstractmethod
    def destroy(self, handle) -> None:
        """Free the executable; launches already queued still run."""

    @abc.abstractmethod
    def topology(self, graph) -> Hashable:
        """A key equal for graphs whose executables can probably be updated into each
        other (the update itself has the last word)."""

    @abc.abstractmethod
    def nbytes(self, graph) -> int:
        """Estimated device bytes an executable of ``graph`` holds (budgets count these)."""

    def upload(self, handle, stream=None) -> None:
        """Do ahead what the first launch of a new executable would (optional; ``stream``
        as for :meth:`launch`)."""
        return None

    def preload(self, handle) -> None:
        """What :meth:`upload` does, on a stream of the backend's own, returning once it
        is done: an executable made ahead on another thread (optional).  Like
        :meth:`instantiate`, :meth:`update` and :meth:`destroy`, it may be called from
        a thread the framework never used (a backend makes its device current there)."""
        return None

    def preload_all(self, handles) -> None:
        """:meth:`preload` of each of ``handles``, returning once all are done (a
        backend may upload them all, then wait once)."""
        for handle in handles:
            self.preload(handle)

    def launcher(self):
        """A callable ``launch(handle)`` on the caller's current stream, bound once: the
        launch of every graph of a step goes through it (optional; by default
        :meth:`launch`)."""
        return self.launch

    def device_free_bytes(self) -> int | None:
        """The device's free memory as the driver reports it, or None if unknown."""
        return None


class GraphOps(abc.ABC):
    """Thin wrapper of one framework's graph API on one device."""

    #: "cuda", "npu", "mlu", "cpu": the torch device type tensors must live on.
    device_type: str = "cpu"

    #: The framework sends allocations to a custom-allocator pool only inside its
    #: ``use_mem_pool`` context (torch_npu), so VMM captures must also enter it.
    capture_needs_use_pool: bool = False

    #: keyword arguments of the framework's capture block beyond pool, stream and error
    #: mode that :meth:`capture_context` passes on (``options``), e.g. torch_npu's
    #: ``auto_dispatch_capture``
    capture_options: frozenset = frozenset()

    def __init__(self, device: int = 0) -> None:
        self.device = device

    @property
    def torch_device(self):
        import torch

        return torch.device(self.device_type, self.device) if self.device_type != "cpu" \
            else torch.device("cpu")

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work on the device."""

    @abc.abstractmethod
    def warmup(self, fn) -> None:
        """Run ``fn()`` eagerly on the capture stream, outside any graph pool.

        Libraries create their workspaces lazily on the stream that first needs them
        (cuBLAS: 32 MiB); doing that here keeps them out of the capture's pool, where
        they would outlive it and alias every later graph.
        """

    def warmup_overlapping(self, fn, meanwhile) -> None:
        """:meth:`warmup` of ``fn``, and ``meanwhile()`` on the host: a pool prepares the
        space of the key about to be captured (driver calls).  This default runs one
        after the other; a backend whose warmup queues work on the device overrides it
        to run ``meanwhile`` once the work is queued and before waiting for it."""
        self.warmup(fn)
        meanwhile()

    @abc.abstractmethod
    def new_graph(self, keep: bool = False):
        """An empty graph object.

        With ``keep=True`` a graph whose capture keeps what was captured, so that
        :meth:`executables` can make executables of it (CUDA: ``keep_graph=True``), and
        that follows :class:`vmm_core.graphs.kept_graphs.KeptGraphMixin`; a backend
        without :meth:`executables` raises :class:`CaptureError`."""

    @abc.abstractmethod
    def capture(self, graph, fn, pool_handle):
        """Capture ``fn()`` into ``graph`` with allocations from ``pool_handle``.

        ``pool_handle`` is None for a private pool, else a shared-pool handle or the
        handle of a vmm_core pool.  Returns what ``fn`` returned.
        """

    def capture_context(self, graph, pool_handle, stream=None,
                        capture_error_mode: str | None = None, options=None):
        """The framework's capture block (``torch.cuda.graph(graph, pool=pool_handle,
        stream=stream, capture_error_mode=...)``): work inside is captured into
        ``graph``, allocations into ``pool_handle``.  For callers that, like an engine's
        runner, capture a block rather than a function (optional).

        ``stream=None``: the framework's own default capture stream, as the framework's
        call does; ``capture_error_mode=None``: the backend's default; ``options``: more
        keyword arguments of the framework's capture block, only names in
        :attr:`capture_options`."""
        from ..errors import CaptureError

        raise CaptureError(f"{type(self).__name__} has no capture block; capture a "
                           f"function with capture(graph, fn, pool_handle)")

    @abc.abstractmethod
    def replay(self, graph) -> None:
        """Launch ``graph`` (ordered after the caller's current stream)."""

    @property
    def capture_stream(self):
        """The stream this object warms up and captures on (None where there are none)."""
        return None

    def current_stream(self):
        """The caller's current stream on this device (None where there are none)."""
        return None

    def wait_stream(self, waiter, stream) -> None:
        """Make future work on ``waiter`` wait for the work already queued on ``stream``.

        Graphs of different capture spaces share physical pages, so a launch must not
        overlap the previous launch when the two were queued on different streams."""
        return None

    def order_after_replays(self) -> None:
        """Make the caller's next work wait for replays already launched (optional).

        Called before the executor overwrites its input buffers, which a replay launched
        by another thread may still be reading."""
        return None

    @abc.abstractmethod
    def shared_pool_handle(self):
        """A new pool handle that several captures can share (``graph_pool_handle()``)."""

    def reset(self, graph) -> None:
        """Free what ``graph`` holds (optional)."""
        reset = getattr(graph, "reset", None)
        if reset is not None:
            reset()

    def prepare_capture_stream(self, stream=None):
        """Create the per-stream library state of the stream a capture will run on now,
        outside every pool, and return that stream (None: the framework's default
        capture stream, made now as the framework would make it).

        Libraries make such state lazily on a stream's first use (cuBLAS: a 32 MiB
        workspace per stream, kept for the life of the process).  Made during a capture
        into a pool that sleeps or closes, later work on that stream would use memory
        that is gone; made here it lives in the framework's default pool.  Optional:
        backends whose libraries keep no such state return ``stream`` unchanged."""
        return stream

    def non_owning_view(self, address: int, nbytes: int):
        """A ``torch.uint8`` tensor of ``nbytes`` (> 0) over ``[address, address + nbytes)``
        on this device that does not keep the memory allocated (what
        :func:`vmm_core.weak_ref_tensors` returns for a graph's outputs).  Optional: a
        framework with no public way to make a tensor over memory it did not allocate
        raises :class:`BackendError` saying so."""
        from ..errors import BackendError

        raise BackendError(f"{type(self).__name__} cannot make a non-owning view of "
                           f"{self.device_type} memory (GraphOps.non_owning_view is not "
                           f"implemented): keep the output tensor itself, or declare it "
                           f"with GraphPool.keep()")

    def executables(self) -> Executables | None:
        """The :class:`Executables` of this device, or None where the framework offers no
        graph kept apart from its executable (the framework then owns them, as today)."""
        return None

    def refuse_kept_graphs(self):
        """What :meth:`new_graph` raises for ``keep=True`` on a backend without
        :meth:`executables`."""
        from ..errors import CaptureError

        return CaptureError(f"{type(self).__name__} cannot keep a captured graph apart from "
                            f"its executable (GraphOps.executables() is None): create "
                            f"graphs with keep=False, and let the framework own their "
                            f"executables")

    def record_stream_reuse(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Allow intra-capture reuse of blocks across streams (CUDA, torch >= 2.9)."""
        if enabled:
            from ..errors import CaptureError

            raise CaptureError(f"{type(self).__name__} does not support record-stream "
                               f"reuse during capture; drop record_stream_reuse=True")
        return contextlib.nullcontext()
