"""Huawei Ascend backend: vmm_api on libascendcl's virtual memory calls (aclrt*).

Importing this package imports nothing vendor-specific, so it works on any machine; the
driver library is loaded by the ``vmm_probe`` hook and ``torch_npu`` only inside the
allocator adapter and graph ops.  Verified against the emulated libascendcl in
``tests/emulated/ascendcl_emu.c`` only: not run on Ascend hardware.
"""
