"""Stand-in for ``torch_npu.npu`` (registered as ``torch.npu`` by the real package)."""

from . import memory  # noqa: F401
from .graphs import NPUGraph, graph, graph_pool_handle
from .memory import MemPool, NPUPluggableAllocator, empty_cache, host_empty_cache, use_mem_pool
from .streams import Stream
from .utils import current_device, current_stream, set_device, stream, synchronize

__all__ = [
    "MemPool", "NPUGraph", "NPUPluggableAllocator", "Stream", "current_device",
    "current_stream", "empty_cache", "graph", "graph_pool_handle", "host_empty_cache", "memory",
    "set_device",
    "stream", "synchronize", "use_mem_pool",
]
