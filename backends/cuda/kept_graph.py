"""``torch.cuda.CUDAGraph`` made with ``keep_graph=True``, for executables vmm_core owns.

torch's own ``CUDAGraph`` instantiates its executable at the end of the capture and frees
it only with the graph.  With ``keep_graph=True`` the capture keeps the ``cudaGraph_t``
(``raw_cuda_graph()``) and instantiates nothing, so :mod:`.graph_exec` can make and destroy
executables of it on demand.  Engines capture the subclass exactly as the framework's
class (``torch.cuda.graph(g, pool=..., stream=...)``).

Checked with torch 2.11 on an H100 (ARCHITECTURE.md section 4): the Python class passes
``keep_graph`` to pybind's constructor from ``__new__``, but pybind constructs in
``__init__``, so the flag must reach both; ``torch.cuda.graph`` calls
``capture_begin(*pool, capture_error_mode=...)`` (torch 2.13 adds
``check_input_liveness=``), which the mixin passes on whole.
"""

from __future__ import annotations

from vmm_core.plugin import KeptGraphMixin

__all__ = ["kept_graph_class"]

_class = None


def kept_graph_class():
    """The class, made on first use (importing this module needs no torch)."""
    global _class
    if _class is None:
        import torch

        class KeptCUDAGraph(KeptGraphMixin, torch.cuda.CUDAGraph):
            def __new__(cls):
                return super().__new__(cls, True)

            def __init__(self):
                super().__init__(True)

        _class = KeptCUDAGraph
    return _class
