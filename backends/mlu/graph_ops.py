"""Graph ops over torch_mlu's MLUGraph, so GraphExecutor's one policy runs on MLUs.

The API used is torch_mlu's public one (``torch_mlu/mlu/graphs.py``, ``streams.py`` and
``__init__.py`` of Cambricon/torch_mlu, branch r2.4_develop): ``torch.mlu.MLUGraph()``,
``torch.mlu.graph(g, pool=None, stream=None, capture_error_mode="relaxed")``,
``torch.mlu.graph_pool_handle()``, ``torch.mlu.Stream``, ``torch.mlu.stream``,
``torch.mlu.current_stream`` and ``torch.mlu.synchronize``.  ``torch.mlu`` only exists after
``import torch_mlu`` registers it, so every method imports torch_mlu itself: importing this
module stays cheap and works without Neuware.

The stream, warm-up and replay policy is shared with CUDA and Ascend
(:class:`vmm_core.plugin.TorchStreamGraphOps`).

Verified only against the CPU stand-in in ``tests/standins/torch_mlu``; no MLU hardware.
"""

from __future__ import annotations

from vmm_core.errors import BackendError
from vmm_core.plugin import TorchStreamGraphOps

__all__ = ["MLUGraphOps", "CAPTURE_ERROR_MODE"]

#: torch_mlu's own default (MLUGraph.capture_begin and torch.mlu.graph): unsafe calls such as
#: the C shim's allocations from Python must not abort a capture
CAPTURE_ERROR_MODE = "relaxed"


def _mlu():
    import torch
    import torch_mlu  # noqa: F401  (registers torch.mlu)

    return torch.mlu


class MLUGraphOps(TorchStreamGraphOps):
    """Capture and replay with ``torch.mlu.MLUGraph`` on one MLU."""

    device_type = "mlu"
    graph_class = "MLUGraph"

    def module(self):
        return _mlu()

    def capture_kwargs(self) -> dict:
        return {"capture_error_mode": CAPTURE_ERROR_MODE}

    def non_owning_view(self, address: int, nbytes: int):
        """Refused: torch_mlu offers no public way to make a tensor over MLU memory it did
        not allocate.  Its own API support list marks ``torch.from_dlpack``,
        ``torch.utils.dlpack.from_dlpack`` and ``torch.frombuffer`` unsupported
        (``tools/autogen_torch_api/api_support_lists/torch_api.yaml``, r2.4_develop), it
        binds no ``from_blob`` to Python, and ``__cuda_array_interface__`` is CUDA's."""
        raise BackendError(
            "non-owning views of MLU memory cannot be made: torch_mlu offers no public "
            "way to build a tensor over memory it did not allocate (from_dlpack and "
            "frombuffer are unsupported, no from_blob is bound to Python). Keep the "
            "graph's output tensors themselves and declare them with GraphPool.keep(), "
            "or copy what you need out after each replay")

    def executables(self):
        """None: torch_mlu keeps no captured graph apart from its executable.
        ``MLUGraph::capture_end`` instantiates the captured task topology
        (``cnrtTaskTopoInstantiate``) and deletes the topology, and ``MLUGraph`` offers
        only capture_begin/end, replay, reset, pool and the debug calls: no keep-graph
        flag, raw handle, instantiate or update (Cambricon/torch_mlu
        ``torch_mlu/mlu/graphs.py`` and ``torch_mlu/csrc/framework/graphs/MLUGraph.h``,
        r2.4_develop).  GraphPools on MLUs leave executables to the framework."""
        return None
