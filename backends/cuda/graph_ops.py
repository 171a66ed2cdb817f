"""torch.cuda.CUDAGraph behind the GraphOps interface (the shared logic is in
:mod:`vmm_core.graphs.torch_graph_ops`); adds the CUDA-only record-stream capture option."""

from __future__ import annotations

import contextlib

from vmm_core.errors import CaptureError
from vmm_core.graphs.torch_graph_ops import TorchStreamGraphOps
from vmm_core.versions import installed_version, version_tuple

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
        version = installed_version("torch")
        if version_tuple(version) < (2, 9):
            raise CaptureError(f"graph_capture_record_stream_reuse needs torch>=2.9, found "
                               f"{version}; drop record_stream_reuse=True")
        return _alloc_setting("graph_capture_record_stream_reuse", True)


@contextlib.contextmanager
def _alloc_setting(key: str, value: bool):
    """Set a caching-allocator option for one capture, then restore the user's value.

    The setting is process-wide; the user's own value is the one PYTORCH_CUDA_ALLOC_CONF
    (or PYTORCH_ALLOC_CONF) gives, which is what we put back."""
    import os

    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch 2.9-2.10
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," +
            os.environ.get("PYTORCH_ALLOC_CONF", "")).replace(" ", "").lower()
    user_value = f"{key.lower()}:true" in conf
    setter(f"{key}:{value}")
    try:
        yield
    finally:
        setter(f"{key}:{user_value}")
