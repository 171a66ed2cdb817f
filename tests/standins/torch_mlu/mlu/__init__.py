"""Stand-in for ``torch_mlu.mlu`` (what ``torch.mlu`` is once torch_mlu is imported)."""

from __future__ import annotations

from . import memory  # noqa: F401
from .graphs import MLUGraph, graph, graph_pool_handle
from .memory import MLUPluggableAllocator, change_current_allocator, empty_cache
from .streams import Stream, current_stream, stream, synchronize

__all__ = [
    "MLUGraph",
    "MLUPluggableAllocator",
    "Stream",
    "change_current_allocator",
    "current_stream",
    "empty_cache",
    "graph",
    "graph_pool_handle",
    "stream",
    "synchronize",
]
