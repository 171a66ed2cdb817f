"""Graph executables apart from torch: the three driver calls an executable cache needs.

torch instantiates a ``CUDAGraph`` once and frees the executable only with the graph.  A
cache that drops executables of sizes not replayed lately and makes them again on demand
needs the captured graph kept (``CUDAGraph(keep_graph=True)``, whose ``raw_cuda_graph()``
gives the ``cudaGraph_t``) and the driver's instantiate, launch and destroy, declared here
as ``cuda.h`` declares them:

* ``CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
  unsigned long long flags)``
* ``CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)``
* ``CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)``
* ``CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph,
  CUgraphExecUpdateResultInfo *resultInfo)`` (CUDA 12+), where
  ``CUgraphExecUpdateResultInfo`` is ``{CUgraphExecUpdateResult result; CUgraphNode
  errorNode; CUgraphNode errorFromNode;}`` and a refused update returns
  ``CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE`` (910) with the reason in ``result``.
"""

from __future__ import annotations

import ctypes

from vmm_core.errors import CaptureError

__all__ = ["GraphExecutables", "UPDATE_REFUSED"]

#: ``CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE``: the update broke a rule of the driver's
UPDATE_REFUSED = 910
#: ``CUgraphExecUpdateResult`` values (cuda.h), the reason a refused update gives
_UPDATE_REASONS = {1: "error", 2: "topology changed", 3: "node type changed",
                   4: "function changed", 5: "parameters changed", 6: "not supported",
                   7: "unsupported function change", 8: "attributes changed"}


class _UpdateResultInfo(ctypes.Structure):
    _fields_ = [("result", ctypes.c_int), ("errorNode", ctypes.c_void_p),
                ("errorFromNode", ctypes.c_void_p)]


class GraphExecutables:
    """Instantiate, launch and destroy executables of kept CUDA graphs (libcuda, once)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._instantiate = lib.cuGraphInstantiateWithFlags
        self._instantiate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                      ctypes.c_ulonglong]
        self._launch = lib.cuGraphLaunch
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._destroy = lib.cuGraphExecDestroy
        self._destroy.argtypes = [ctypes.c_void_p]
        self._update = lib.cuGraphExecUpdate_v2
        self._update.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.POINTER(_UpdateResultInfo)]
        for f in (self._instantiate, self._launch, self._destroy, self._update):
            f.restype = ctypes.c_int

    def instantiate(self, graph) -> ctypes.c_void_p:
        """An executable of ``graph`` (a ``torch.cuda.CUDAGraph`` captured with
        ``keep_graph=True``), made with the driver's default flags."""
        handle = ctypes.c_void_p()
        _check(self._instantiate(ctypes.byref(handle), graph.raw_cuda_graph(), 0),
               "cuGraphInstantiateWithFlags")
        return handle

    def launch(self, handle, stream: int) -> None:
        """Launch an executable on ``stream`` (a ``cudaStream_t`` as an int)."""
        _check(self._launch(handle, ctypes.c_void_p(stream)), "cuGraphLaunch")

    def destroy(self, handle) -> None:
        _check(self._destroy(handle), "cuGraphExecDestroy")

    def update(self, handle, graph) -> str | None:
        """Make the executable ``handle`` run ``graph``'s nodes from its next launch (one
        executable for graphs of one topology, such as the batch sizes of one model).
        None when the driver did it, else its reason (910: the update "was not
        performed", in the driver's words; callers should not launch the handle again on
        that reading alone: the bench destroys it and instantiates anew).  An update does
        not change launches already made (CUDA programming guide, graph update: they are
        not impacted "even if they are running at the time of the update")."""
        info = _UpdateResultInfo()
        rc = self._update(handle, graph.raw_cuda_graph(), ctypes.byref(info))
        if rc == UPDATE_REFUSED:
            return _UPDATE_REASONS.get(info.result, f"result {info.result}")
        _check(rc, "cuGraphExecUpdate_v2")
        return None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CaptureError(f"{what} failed with CUresult {rc}")
