"""Layer 2: memory.  Many virtual spaces over one set of physical pages
(:class:`SharedVMMAllocator`), the routing of framework allocations to it through the C
shim, the allocator-adapter role every backend fills, and tagged sleep/wake.

Usable without anything in :mod:`vmm_core.graphs`; imports no framework up front.  Its
modules import one way: tagged -> allocator -> sleep_wake -> host_copy -> offload ->
tag_state; beside that chain, the allocator's helpers (mappings, handle_growth, fork_locks,
and pages: the protocol its pieces see it through) import nothing above tag_state.
"""
