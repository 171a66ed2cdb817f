"""torch_npu's graph API (``NPUGraph``, ``torch.npu.graph``) as vmm_core GraphOps.

The stream, warm-up and replay policy is shared with CUDA and MLU
(:mod:`vmm_core.graphs.torch_graph_ops`).  ``torch_npu`` is imported inside methods only;
``torch.npu`` is reached as ``torch_npu.npu``.  Only
exercised against the CPU stand-in in ``tests/standins/torch_npu``: no Ascend hardware
was available.
"""

from __future__ import annotations

from vmm_core.graphs.torch_graph_ops import TorchStreamGraphOps

from .allocator_adapter import _torch_npu

__all__ = ["AscendGraphOps"]


class AscendGraphOps(TorchStreamGraphOps):
    """Capture and replay with ``torch.npu.NPUGraph`` on one NPU."""

    device_type = "npu"
    graph_class = "NPUGraph"
    # torch_npu's custom allocator serves a pool only inside use_mem_pool (ARCHITECTURE 5)
    capture_needs_use_pool = True

    def module(self):
        return _torch_npu().npu
