"""MLUGraph on the CPU: capture records state, replay counts (no kernels exist to record)."""

from __future__ import annotations

import gc
import itertools

from .streams import Stream, stream as _stream_ctx, synchronize

_CAPTURE_MODES = ("global", "thread_local", "relaxed")
_pool_ids = itertools.count(1)
_capturing: list = []  # graphs whose capture is under way


def graph_pool_handle():
    return (0, next(_pool_ids))


class MLUGraph:
    """Mirrors ``torch_mlu.mlu.graphs.MLUGraph``'s public methods."""

    def __new__(cls):
        self = super().__new__(cls)
        self._state = "empty"
        self._pool = None
        self.capture_error_mode = None
        self.replays = 0
        return self

    def capture_begin(self, pool=None, capture_error_mode="relaxed"):
        if capture_error_mode not in _CAPTURE_MODES:
            raise RuntimeError(f"unknown capture_error_mode {capture_error_mode!r}")
        if self._state != "empty":
            raise RuntimeError("capture_begin on a graph that was already captured")
        if _capturing:
            raise RuntimeError("only one MLU graph capture may be under way at a time")
        self._pool = pool if pool is not None else graph_pool_handle()
        self.capture_error_mode = capture_error_mode
        self._state = "capturing"
        _capturing.append(self)

    def capture_end(self):
        if self._state != "capturing":
            raise RuntimeError("capture_end without capture_begin")
        _capturing.remove(self)
        self._state = "captured"

    def replay(self):
        if self._state != "captured":
            raise RuntimeError("replay of a graph that was not captured")
        self.replays += 1

    def reset(self):
        self._state = "empty"
        self._pool = None

    def pool(self):
        return self._pool


class graph:
    """Mirrors ``torch_mlu.mlu.graphs.graph`` (a context manager class)."""

    _side_stream = None  # shared by captures that pass no stream, as in torch_mlu

    def __init__(self, mlu_graph, pool=None, stream=None, capture_error_mode: str = "relaxed"):
        if stream is None:
            if graph._side_stream is None:
                graph._side_stream = Stream()
            stream = graph._side_stream
        self._graph, self._pool, self._mode = mlu_graph, pool, capture_error_mode
        self._ctx = _stream_ctx(stream)

    def __enter__(self):
        # as torch_mlu/mlu/graphs.py graph.__enter__ (Cambricon/torch_mlu d578002, lines
        # 168-180): synchronize, gc.collect(), empty_cache(), then capture_begin
        from . import memory

        synchronize()
        gc.collect()
        memory.empty_cache()
        self._ctx.__enter__()
        self._graph.capture_begin(pool=self._pool, capture_error_mode=self._mode)

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            self._graph.capture_end()
        finally:
            self._ctx.__exit__(exc_type, exc_value, traceback)
