"""torch.cuda.CUDAGraph behind the GraphOps interface (the shared logic is in
:mod:`vmm_core.torch_graph_ops`); adds the CUDA-only record-stream capture option."""

from __future__ import annotations

import contextlib

from vmm_core.errors import CaptureError
from vmm_core.torch_graph_ops import TorchStreamGraphOps

__all__ = ["CudaGraphOps"]


class CudaGraphOps(TorchStreamGraphOps):
    device_type = "cuda"
    graph_class = "CUDAGraph"

    def module(self):
        import torch

        return torch.cuda

    def capture(self, graph, fn, pool_handle):
        import torch

        with torch.cuda.device(self.device):
            return super().capture(graph, fn, pool_handle)

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
