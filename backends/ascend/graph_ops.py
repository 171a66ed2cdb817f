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
    # torch_npu's ``torch.npu.graph(..., auto_dispatch_capture=True)`` records the
    # dispatch of operators whose parameters ``NPUGraph.update`` may change later (the
    # attention's sequence lengths), which SGLang's NPU graph runners rely on
    capture_options = frozenset({"auto_dispatch_capture"})

    def module(self):
        return _torch_npu().npu

    def executables(self):
        """None: torch_npu keeps no captured graph apart from its executable.
        ``NPUGraph::capture_end`` ends the capture with ``aclmdlRICaptureEnd``, whose
        model runtime instance is at once what ``replay`` runs (``aclmdlRIExecuteAsync``)
        and what ``reset`` destroys (``aclmdlRIDestroy``), and the ``_NPUGraph`` binding
        offers only capture_begin/end, replay, reset, pool, register_generator_state and
        the debug calls: no keep-graph flag, raw handle, instantiate or update
        (torch_npu's ``torch_npu/npu/graphs.py`` and ``NPUGraph.cpp``, master read on
        2026-11-25).  GraphPools on Ascend leave executables to the framework."""
        return None
