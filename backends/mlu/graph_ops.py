"""Graph ops over torch_mlu's MLUGraph, so GraphExecutor's one policy runs on MLUs.

The API used is torch_mlu's public one (``torch_mlu/mlu/graphs.py``, ``streams.py`` and
``__init__.py`` of Cambricon/torch_mlu, branch r2.4_develop): ``torch.mlu.MLUGraph()``,
``torch.mlu.graph(g, pool=None, stream=None, capture_error_mode="relaxed")``,
``torch.mlu.graph_pool_handle()``, ``torch.mlu.Stream``, ``torch.mlu.stream``,
``torch.mlu.current_stream`` and ``torch.mlu.synchronize``.  ``torch.mlu`` only exists after
``import torch_mlu`` registers it, so every method imports torch_mlu itself: importing this
module stays cheap and works without Neuware.

Warm-up and capture share one side stream owned by this object, so workspaces that libraries
create lazily on a stream are made during warm-up, outside any graph pool.

Verified only against the CPU stand-in in ``tests/standins/torch_mlu``; no MLU hardware.
"""

from __future__ import annotations

from vmm_core.graph_ops import GraphOps

__all__ = ["MLUGraphOps", "CAPTURE_ERROR_MODE"]

#: torch_mlu's own default (MLUGraph.capture_begin and torch.mlu.graph): unsafe calls such as
#: the C shim's allocations from Python must not abort a capture
CAPTURE_ERROR_MODE = "relaxed"


def _mlu():
    import torch
    import torch_mlu  # noqa: F401  (registers torch.mlu)

    return torch.mlu


class MLUGraphOps(GraphOps):
    """``torch.mlu.MLUGraph`` capture and replay on one MLU."""

    device_type = "mlu"

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self._stream = None

    def _capture_stream(self):
        if self._stream is None:
            self._stream = _mlu().Stream(device=self.device)
        return self._stream

    def synchronize(self) -> None:
        _mlu().synchronize(self.device)

    def warmup(self, fn) -> None:
        mlu = _mlu()
        stream = self._capture_stream()
        stream.wait_stream(mlu.current_stream(self.device))
        with mlu.stream(stream):
            fn()
        mlu.current_stream(self.device).wait_stream(stream)
        mlu.synchronize(self.device)

    def new_graph(self):
        return _mlu().MLUGraph()

    def capture(self, graph, fn, pool_handle):
        mlu = _mlu()
        with mlu.graph(graph, pool=pool_handle, stream=self._capture_stream(),
                       capture_error_mode=CAPTURE_ERROR_MODE):
            out = fn()
        return out

    def replay(self, graph) -> None:
        graph.replay()

    def shared_pool_handle(self):
        return _mlu().graph_pool_handle()
