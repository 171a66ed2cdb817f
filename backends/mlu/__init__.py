"""Cambricon MLU backend: vmm_api on libcndrv's cnMem* virtual memory calls.

Importing this package loads nothing: the driver library is opened by the ``vmm_probe``
hook and ``torch_mlu`` is imported only by the graph ops and the allocator adapter when
they are used, so ``vmm-core info`` works on machines without Neuware.

Not run on MLU hardware: it is verified only against the emulated libcndrv in
``tests/emulated/cndrv_emu.c`` (built from the public ``cn_api.h`` text) and against a
CPU stand-in of ``torch_mlu``.  Treat it as unverified on real MLUs.
"""

__all__: list[str] = []
