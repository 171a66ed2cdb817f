"""Graph ops of the host backend: there is no graph API on a CPU, so a "graph"
remembers its function and a replay calls it eagerly.

That is enough for CI to run the whole capture policy for real (buckets, padding,
persistent buffers, space switching, the escape guard): what matters is where the memory
comes from, and that is real virtual memory on this backend.
"""

from __future__ import annotations

import contextlib
import threading

from vmm_core.errors import CaptureError
from vmm_core.graphs.graph_ops import GraphOps

__all__ = ["HostGraphOps", "HostGraph", "current_stream"]

_tls = threading.local()


def current_stream():
    """The host "stream" work runs on: None by default, the ops' own during warm-up and
    capture.  Libraries that cache per stream (as cuBLAS does) can key on it."""
    return getattr(_tls, "stream", None)


@contextlib.contextmanager
def _on_stream(stream):
    previous = current_stream()
    _tls.stream = stream
    try:
        yield
    finally:
        _tls.stream = previous


class HostGraph:
    def __init__(self) -> None:
        self.fn = None
        self.outputs = None  # the tensors the capture returned: replay rewrites them

    def reset(self) -> None:
        self.fn = self.outputs = None

    def replay(self) -> None:
        """Re-run the function and write its results into the tensors the capture
        returned, as a device graph rewrites its static outputs in place."""
        if self.fn is None:
            raise CaptureError("replay of a graph that was reset or never captured")
        _copy_into(self.outputs, self.fn())


def _copy_into(static, fresh) -> None:
    if isinstance(static, (tuple, list)):
        for s, f in zip(static, fresh):
            _copy_into(s, f)
    elif hasattr(static, "copy_"):
        static.copy_(fresh)


class HostGraphOps(GraphOps):
    device_type = "cpu"

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self.stream = object()

    @property
    def capture_stream(self):
        return self.stream

    def current_stream(self):
        return current_stream()

    def synchronize(self) -> None:
        return None

    def warmup(self, fn) -> None:
        with _on_stream(self.stream):
            fn()

    def new_graph(self):
        return HostGraph()

    def capture(self, graph, fn, pool_handle):
        graph.fn = fn
        with _on_stream(self.stream):
            graph.outputs = fn()
        return graph.outputs

    @contextlib.contextmanager
    def capture_context(self, graph, pool_handle, stream=None,
                        capture_error_mode: str | None = None):
        """A capture block on the host: the block runs once, on the capture "stream",
        and ``graph`` records nothing (a host graph replays a function, which a block
        does not give).  Its allocations go where the caller routed them, as a device
        capture's go to ``pool_handle``."""
        if capture_error_mode not in (None, "global", "thread_local", "relaxed"):
            raise CaptureError(f"capture_error_mode must be 'global', 'thread_local' or "
                               f"'relaxed', got {capture_error_mode!r}")
        with _on_stream(self.stream if stream is None else stream):
            yield

    def replay(self, graph) -> None:
        graph.replay()

    def shared_pool_handle(self):
        return object()
