"""Stand-in for ``torch_npu/npu/graphs.py``: capture brackets the work, replay counts.

Work captured on the CPU runs eagerly during capture; replay records that it was asked
for, which is all the wiring tests need.
"""

import itertools
import threading

from .utils import stream as _stream_ctx
from .utils import synchronize

_pool_ids = itertools.count(1)
_tls = threading.local()


def graph_pool_handle():
    return (next(_pool_ids), 0)


def capturing_pool():
    """The pool id of the capture running on this thread (None outside a capture)."""
    return getattr(_tls, "pool", None)


class NPUGraph:
    def __init__(self):
        self.replay_count = 0
        self._pool = None
        self._captured = False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"unknown capture_error_mode {capture_error_mode!r}")
        if capturing_pool() is not None:
            raise RuntimeError("a capture is already underway on this thread")
        self._pool = graph_pool_handle() if pool is None else pool
        _tls.pool = self._pool

    def capture_end(self):
        _tls.pool = None
        self._captured = True

    def replay(self):
        if not self._captured:
            raise RuntimeError("replay() of a graph that was never captured")
        self.replay_count += 1

    def reset(self):
        self._captured = False

    def pool(self):
        return self._pool


class graph:
    default_capture_stream = None

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
                 capture_error_mode="global"):
        if not isinstance(npu_graph, NPUGraph):
            raise TypeError(f"graph() takes an NPUGraph, got {type(npu_graph).__name__}")
        if self.__class__.default_capture_stream is None:
            from .streams import Stream

            self.__class__.default_capture_stream = Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else self.default_capture_stream
        self.stream_ctx = _stream_ctx(self.capture_stream)
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        # as torch_npu/npu/graphs.py graph.__enter__ (Ascend/pytorch 0dc3742d): synchronize,
        # gc.collect() only when force_npugraph_gc is set (off by default), then release
        # cached device memory and flush the pinned-host cache before capture_begin
        from . import memory

        synchronize()
        memory.empty_cache()
        memory.host_empty_cache()
        self.stream_ctx.__enter__()
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, exc_type, exc_value, traceback):
        self.npu_graph.capture_end()
        self.stream_ctx.__exit__(exc_type, exc_value, traceback)
