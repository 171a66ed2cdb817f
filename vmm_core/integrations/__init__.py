"""Engines' own memory APIs served by vmm_core, so adopting it is one import or one flag.

* :mod:`vmm_core.integrations.torch_memory_saver`: torch_memory_saver 0.0.10's Python API
  (SGLang, verl, slime), with an opt-in alias for code that imports ``torch_memory_saver``.
* :mod:`vmm_core.integrations.vllm`: a vLLM general plugin registering the ``vmm``
  sleep-mode backend and a ``MemAllocator`` on vmm_core, and routing vLLM's worker to
  it when ``vmm`` is selected (vLLM 0.33 offers no extension point for that).

Each module only translates names and arguments; every decision (what is copied, when
host memory is pinned, what a graph pool keeps) is vmm_core's own.  Nothing here is
imported by ``import vmm_core``.  See docs/integrations.md.
"""
