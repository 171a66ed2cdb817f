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

__all__ = ["GraphOps"]


class GraphOps(abc.ABC):
    """Thin wrapper of one framework's graph API on one device."""

    #: "cuda", "npu", "mlu", "cpu": the torch device type tensors must live on.
    device_type: str = "cpu"

    #: The framework sends allocations to a custom-allocator pool only inside its
    #: ``use_mem_pool`` context (torch_npu), so VMM captures must also enter it.
    capture_needs_use_pool: bool = False

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

    @abc.abstractmethod
    def new_graph(self):
        """An empty graph object."""

    @abc.abstractmethod
    def capture(self, graph, fn, pool_handle):
        """Capture ``fn()`` into ``graph`` with allocations from ``pool_handle``.

        ``pool_handle`` is None for a private pool, else a shared-pool handle or the
        handle of a vmm_core pool.  Returns what ``fn`` returned.
        """

    def capture_context(self, graph, pool_handle, stream=None,
                        capture_error_mode: str | None = None):
        """The framework's capture block (``torch.cuda.graph(graph, pool=pool_handle,
        stream=stream, capture_error_mode=...)``): work inside is captured into
        ``graph``, allocations into ``pool_handle``.  For callers that, like an engine's
        runner, capture a block rather than a function (optional).

        ``stream=None``: the framework's own default capture stream, as the framework's
        call does; ``capture_error_mode=None``: the backend's default."""
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

    def executables(self):
        """Instantiate, launch, update and destroy executables of kept graphs apart from
        the framework (``instantiate(graph)``, ``launch(handle, stream)``,
        ``update(handle, graph)`` -> None or the reason it was refused, ``destroy(handle)``),
        or None where the backend offers no such calls (optional)."""
        return None

    def record_stream_reuse(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Allow intra-capture reuse of blocks across streams (CUDA, torch >= 2.9)."""
        if enabled:
            from ..errors import CaptureError

            raise CaptureError(f"{type(self).__name__} does not support record-stream "
                               f"reuse during capture; drop record_stream_reuse=True")
        return contextlib.nullcontext()
