"""CPU stand-in for ``torch_npu``: the public names vmm_core's Ascend adapter and graph ops
use, with the real signatures, implemented on host memory so the wiring can run in CI.

It is not torch_npu and emulates no NPU; tests/test_ascend_wiring.py compares every
signature here with the real one (recorded there with its source path).  Only tests put
``tests/standins`` on ``sys.path``, and only for the duration of one test.
"""

from . import npu  # noqa: F401  (real torch_npu imports its npu package eagerly too)

#: a release whose MemPool segment release returns segments to the custom allocator
__version__ = "2.13.0"
