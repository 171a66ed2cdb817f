"""torch_npu's graph API (``NPUGraph``, ``torch.npu.graph``) as vmm_core GraphOps.

The stream, warm-up and replay policy is shared with CUDA and MLU
(:class:`vmm_core.plugin.TorchStreamGraphOps`).  ``torch_npu`` is imported inside methods only;
``torch.npu`` is reached as ``torch_npu.npu``.  Only
exercised against the CPU stand-in in ``tests/standins/torch_npu``: not run on Ascend
hardware.
"""

from __future__ import annotations

from vmm_core.errors import BackendError
from vmm_core.plugin import TorchStreamGraphOps, dlpack_bytes

from .allocator_adapter import _torch_npu

__all__ = ["AscendGraphOps"]

#: dlpack.h ``kDLExtDev``: the DLPack device torch_npu maps its tensors (PrivateUse1) to
#: and from (``torch_npu/csrc/aten/common/DLConvertor.cpp``, ``getATenDevice``)
_DL_EXT_DEV = 12


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

    def non_owning_view(self, address: int, nbytes: int):
        """Through DLPack, torch_npu's one public way to make a tensor over NPU memory it
        did not allocate: in its releases since November 2025 (branches v2.7.1-7.3.0,
        v2.8.0-7.3.0, v2.9.0 and later; not v2.7.1-7.2.0) ``import torch_npu`` makes
        ``torch.utils.dlpack.from_dlpack`` take kDLExtDev capsules
        (``torch_npu/utils/dlpack.py``, ``_apply_dlpack_patch``, applied by
        ``torch_npu/_init/patches/api_patches.py``), which ``at_npu::native::from_blob``
        wraps with the capsule's deleter (``torch_npu/csrc/aten/common/DLConvertor.cpp``,
        ``fromDLPack``); the capsule's deleter is NULL, so the view owns nothing.
        Earlier torch_npu has no public way: refused, naming the releases that have one."""
        import torch
        import torch.utils.dlpack

        torch_npu = _torch_npu()
        if not hasattr(getattr(torch_npu, "_C", None), "_npu_from_dlpack"):
            raise BackendError(
                f"non-owning views of NPU memory need torch_npu's DLPack import, which "
                f"torch_npu {getattr(torch_npu, '__version__', '?')} lacks (it came with "
                f"the torch_npu releases of November 2025, the 7.3.0 line for torch 2.7.1 "
                f"and later: torch.utils.dlpack.from_dlpack of NPU memory); upgrade "
                f"torch_npu, or keep the graph's output tensors themselves and declare "
                f"them with GraphPool.keep()")
        try:
            view = torch.utils.dlpack.from_dlpack(
                dlpack_bytes(address, nbytes, _DL_EXT_DEV, self.device))
        except Exception as exc:  # noqa: BLE001 - the framework's reason, with ours
            raise BackendError(f"torch_npu could not view {nbytes} bytes of NPU memory at "
                               f"{address:#x} on npu:{self.device} through DLPack: "
                               f"{exc}") from exc
        if view.device.type != "npu" or view.data_ptr() != address:
            raise BackendError(f"torch_npu's from_dlpack returned a tensor on {view.device} "
                               f"at {view.data_ptr():#x}, not a view of npu:{self.device} "
                               f"memory at {address:#x}")
        return view

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
