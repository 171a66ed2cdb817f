"""Builds the C libraries with the system C compiler; none needs a vendor SDK.

* vmm_core._vmm_shim: the alloc/free the frameworks' pluggable allocators load for
  capture spaces and regions;
* vmm_core._vmm_segments: the alloc/free of the pool that routes a whole process into
  tagged memory (vmm_core.memory.whole_process);
* torch_memory_saver_hook_mode_preload.abi3.so beside the torch_memory_saver alias
  (vmm_core/integrations/tms_alias/), under the name RL launchers look for to put in
  LD_PRELOAD: it links nothing but libc and libdl, so it loads into any process;
* vmm_backends.cuda._kernel_scan (backends/cuda/kernel_scan.c, beside the one backend
  that loads it): one pass over a captured graph's kernel nodes, the driver's entry
  points handed in as addresses.
"""

from setuptools import Extension, setup

_C = ["-O2", "-std=c11", "-Wall"]

setup(
    ext_modules=[
        Extension("vmm_core._vmm_shim", sources=["csrc/vmm_shim.c"],
                  depends=["csrc/vmm_interrupt.h"], extra_compile_args=_C),
        Extension("vmm_core._vmm_segments", sources=["csrc/vmm_segments.c"],
                  depends=["csrc/vmm_interrupt.h"], extra_compile_args=_C),
        Extension("vmm_core.integrations.tms_alias.torch_memory_saver_hook_mode_preload",
                  sources=["csrc/tms_preload.c"], extra_compile_args=_C, libraries=["dl"],
                  py_limited_api=True),
        Extension("vmm_backends.cuda._kernel_scan", sources=["backends/cuda/kernel_scan.c"],
                  extra_compile_args=_C),
    ]
)
