"""What asking a region for its live blocks costs: the question every offloading sleep of
a region asks (``SharedVMMAllocator.live_ranges``), and ``prepare_offload`` asks when a
region ends.

A region gets ``--tensors`` allocations; every other one is freed, so the pool holds as
many free blocks as live ones.  Prints the median time of one question over ``--repeat``
calls and how many ranges it returned.  On the host backend the allocations come from
the region's allocator (the CPU allocator cannot be routed) and the question reads its
own table; on CUDA they are torch tensors and the question reads the pool's snapshot.

    python scripts/live_blocks_cost.py --backend host
    python scripts/live_blocks_cost.py --backend cuda --tensors 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

import vmm_core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="vmm_core backend (default: detected)")
    parser.add_argument("--tensors", type=int, default=1000, help="allocations in the region")
    parser.add_argument("--nbytes", type=int, default=1 << 20, help="bytes of each")
    parser.add_argument("--repeat", type=int, default=20, help="questions timed")
    args = parser.parse_args()
    if args.tensors < 2 or args.nbytes < 1 or args.repeat < 1:
        parser.error("--tensors >= 2, --nbytes >= 1 and --repeat >= 1")
    backend = vmm_core.get_backend(args.backend)
    keep = []
    with vmm_core.region("live-cost", backend=backend) as alloc:
        ops = backend.graph_ops(0)
        on_device = ops is not None and ops.device_type != "cpu"
        for i in range(args.tensors):
            if on_device:
                import torch

                keep.append(torch.empty(args.nbytes, dtype=torch.uint8,
                                        device=ops.torch_device))
            else:
                keep.append(alloc.allocate(args.nbytes))
    for i in range(0, args.tensors, 2):  # every other one freed: a hole between each
        if on_device:
            keep[i] = None
        else:
            alloc.deallocate(keep[i])
    times = []
    ranges = alloc.live_ranges()
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        ranges = alloc.live_ranges()
        times.append(time.perf_counter() - t0)
    print(f"{backend.name}: {args.tensors} allocations of {args.nbytes} B, half freed: "
          f"live_ranges() returned {len(ranges)} ranges in {statistics.median(times) * 1e3:.3f} "
          f"ms (median of {args.repeat}; min {min(times) * 1e3:.3f} ms)")
    alloc.close()


if __name__ == "__main__":
    main()
