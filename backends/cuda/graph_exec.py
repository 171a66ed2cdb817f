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
"""

from __future__ import annotations

import ctypes

from vmm_core.errors import CaptureError

__all__ = ["GraphExecutables"]


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
        for f in (self._instantiate, self._launch, self._destroy):
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


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CaptureError(f"{what} failed with CUresult {rc}")
