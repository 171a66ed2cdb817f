"""Cost of one more GraphPool key on the host backend, at few keys and at many.

    .venv/bin/python scripts/host_key_cost.py [--keys 100 5000]

Two workloads: every key the same size (one page), and every key one page larger than
the last with one-page growth steps (every key adds a physical handle: the worst case for
merging).  For each key count it prints the mean wall time and backend map/unmap calls
per key over the last 100 keys captured.  A measurement, not a test: the numbers depend
on the machine and its load.
"""

from __future__ import annotations

import argparse
import time

import vmm_core
from vmm_core.memory import routing
from vmm_core.testing.tools import HookCounter

PAGE = 4096
WINDOW = 100


def run(keys: int, growing: bool) -> tuple[float, float]:
    host = vmm_core.get_backend("host")
    reserve = max(1 << 20, (keys + 1) * PAGE)
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=reserve,
                                        growth_bytes=PAGE if growing else None)
    pool = vmm_core.GraphPool(backend=host, allocator=alloc)
    t0, calls0 = 0.0, 0
    with HookCounter(host) as counter:
        for key in range(keys):
            if key == keys - WINDOW:
                t0 = time.perf_counter()
                calls0 = counter.calls["vmm_map"] + counter.calls["vmm_unmap"]
            with pool.space(key):
                target = routing.current_target(0)
                pool.keep(target.allocate((key + 1) * PAGE if growing else PAGE))
        seconds = time.perf_counter() - t0
        calls = counter.calls["vmm_map"] + counter.calls["vmm_unmap"] - calls0
    pool.close()
    alloc.close()
    return seconds / WINDOW * 1e3, calls / WINDOW


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[100, 5000])
    args = parser.parse_args()
    print(f"{'workload':<10} {'keys':>6} {'ms/key':>8} {'map+unmap/key':>14}  "
          f"(last {WINDOW} keys)")
    for growing in (False, True):
        for keys in args.keys:
            if keys < WINDOW:
                parser.error(f"--keys must be >= {WINDOW}")
            ms, calls = run(keys, growing)
            name = "growing" if growing else "same size"
            print(f"{name:<10} {keys:>6} {ms:>8.3f} {calls:>14.1f}")


if __name__ == "__main__":
    main()
