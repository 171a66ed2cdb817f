"""torch_npu's graph API (``NPUGraph``, ``torch.npu.graph``) as vmm_core GraphOps.

Warm-up and capture run on one side stream owned by this object, because libraries
create workspaces lazily on the stream that first needs them: warming up anywhere else
would let the first capture's pool own a workspace that outlives it.  ``torch_npu`` is
imported inside methods only; ``torch.npu`` is reached as ``torch_npu.npu``.  Only
exercised against the CPU stand-in in ``tests/standins/torch_npu``: no Ascend hardware
was available.
"""

from __future__ import annotations

from vmm_core.errors import BackendUnavailableError, CaptureError
from vmm_core.graph_ops import GraphOps

__all__ = ["AscendGraphOps"]


def _npu():
    try:
        import torch_npu
    except Exception as exc:  # ImportError, or CANN libraries missing at import time
        raise BackendUnavailableError(
            f"import torch_npu failed ({type(exc).__name__}: {exc}): install torch_npu and "
            f"source CANN's set_env.sh") from exc
    return torch_npu.npu


class AscendGraphOps(GraphOps):
    """Capture and replay with ``torch.npu.NPUGraph`` on one NPU."""

    device_type = "npu"
    # torch_npu's custom allocator serves a pool only inside use_mem_pool (ARCHITECTURE 5)
    capture_needs_use_pool = True

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self._stream = None

    def _capture_stream(self):
        if self._stream is None:
            self._stream = _npu().Stream(device=self.device)
        return self._stream

    def synchronize(self) -> None:
        _npu().synchronize(self.device)

    def warmup(self, fn) -> None:
        npu = _npu()
        side = self._capture_stream()
        caller = npu.current_stream(self.device)
        side.wait_stream(caller)
        with npu.stream(side):
            fn()
        caller.wait_stream(side)
        side.synchronize()

    def new_graph(self):
        return _npu().NPUGraph()

    def capture(self, graph, fn, pool_handle):
        npu = _npu()
        try:
            with npu.graph(graph, pool=pool_handle, stream=self._capture_stream()):
                result = fn()
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(f"torch.npu.graph capture failed ({type(exc).__name__}: "
                               f"{exc}); warm the function up first and keep CPU syncs out "
                               f"of it") from exc
        return result

    def replay(self, graph) -> None:
        graph.replay()

    def shared_pool_handle(self):
        return _npu().graph_pool_handle()
