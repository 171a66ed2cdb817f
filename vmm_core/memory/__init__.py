"""Layer 2: memory.  Many virtual spaces over one set of physical pages
(:class:`SharedVMMAllocator`), the routing of framework allocations to it through the C
shim, the allocator-adapter role every backend fills, and tagged sleep/wake.

Usable without anything in :mod:`vmm_core.graphs`; imports no framework up front.
"""
