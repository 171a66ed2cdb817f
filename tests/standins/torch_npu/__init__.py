"""CPU stand-in for ``torch_npu``: the public names vmm_core's Ascend adapter and graph ops
use, with the real signatures, implemented on host memory so the wiring can run in CI.

It is not torch_npu and emulates no NPU; tests/test_ascend_wiring.py compares every
signature here with the real one (recorded there with its source path).  Only tests put
``tests/standins`` on ``sys.path``, and only for the duration of one test.
"""

import os

from . import npu  # noqa: F401  (real torch_npu imports its npu package eagerly too)

#: a release whose MemPool segment release returns segments to the custom allocator;
#: ``VMM_CORE_STANDIN_TORCH_NPU=2.12`` (read at import) mimics 2.12 instead: MemPool without
#: ``snapshot()``, ``memory_snapshot()`` without ``mempool_id`` (see npu/memory.py)
__version__ = "2.12.0.post1" if os.environ.get("VMM_CORE_STANDIN_TORCH_NPU") == "2.12" \
    else "2.13.0"
