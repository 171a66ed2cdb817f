"""``vmm-core bench``: the benchmarks, the host demo and the benchmark models.

Nothing in the library imports this package; it only uses the public layers.
"""
