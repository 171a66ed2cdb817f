"""torch.cuda.CUDAGraph behind the GraphOps interface.

Captures run on a side stream owned by this object; replays of every graph on a device
go through one per-device stream, ordered after the caller's stream and before its next
work, so two graphs sharing physical pages can never run concurrently on the device.
"""

from __future__ import annotations

import contextlib
import threading

from vmm_core.errors import CaptureError
from vmm_core.graph_ops import GraphOps

__all__ = ["CudaGraphOps"]

_replay_streams: dict = {}
_lock = threading.Lock()


def _replay_stream(device: int):
    import torch

    with _lock:
        stream = _replay_streams.get(device)
        if stream is None:
            stream = _replay_streams[device] = torch.cuda.Stream(device=device)
        return stream


class CudaGraphOps(GraphOps):
    device_type = "cuda"

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self._stream = None

    @property
    def stream(self):
        """The capture stream, created on first use (a fresh one per executor, so a
        library's per-stream workspace is created by this executor's warm-up)."""
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def warmup(self, fn) -> None:
        import torch

        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fn()
        current.wait_stream(self.stream)
        self.stream.synchronize()

    def new_graph(self):
        import torch

        return torch.cuda.CUDAGraph()

    def capture(self, graph, fn, pool_handle):
        import torch

        with torch.cuda.device(self.device):
            with torch.cuda.graph(graph, pool=pool_handle, stream=self.stream):
                result = fn()
        return result

    def replay(self, graph) -> None:
        import torch

        current = torch.cuda.current_stream(self.device)
        stream = _replay_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.replay()
        current.wait_stream(stream)

    def shared_pool_handle(self):
        import torch

        return torch.cuda.graph_pool_handle()

    def record_stream_reuse(self, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        import torch

        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        if version < (2, 9):
            raise CaptureError(f"graph_capture_record_stream_reuse needs torch>=2.9, found "
                               f"{torch.__version__}; drop record_stream_reuse=True")
        return _alloc_setting("graph_capture_record_stream_reuse", True)


@contextlib.contextmanager
def _alloc_setting(key: str, value: bool):
    """Set a caching-allocator option for the duration of a capture."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch 2.9-2.10
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    setter(f"{key}:{value}")
    try:
        yield
    finally:
        setter(f"{key}:{not value}")
