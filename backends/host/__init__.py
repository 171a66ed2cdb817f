"""The embedded ``host`` backend: real VMM semantics on Linux memfd + mmap.

It is the default where no accelerator is present and what CI tests for real.  Like every
vendor folder it has ``vmm_api`` (the hooks), ``allocator_adapter`` (pools) and
``graph_ops`` (graphs; on the CPU a replay re-runs the function eagerly).
"""
