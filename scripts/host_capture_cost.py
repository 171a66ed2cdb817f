"""Driver calls and wall time per capture of GraphExecutor on the host backend.

    .venv/bin/python scripts/host_capture_cost.py [--sizes 51] [--width 256] [--row-kib 184]

The decode benchmark's way of capturing: one ``capture_all([size])`` per size of
vLLM's decode sizes (up to 51), ascending, descending and in a random order, of a
function whose intermediates grow with the batch (so larger sizes grow the physical
pool).  For each order it prints the backend's map/unmap/create calls per capture (mean
and the largest), the wall time per capture, the physical bytes against the largest
space's, and the handles left.  A measurement, not a test: the times depend on the
machine and its load; the call counts do not.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import vmm_core
from vmm_bench.measure import VLLM_DECODE_SIZES
from vmm_core.memory import routing
from vmm_core.testing.tools import HookCounter

DRIVER_HOOKS = ("vmm_map", "vmm_unmap", "vmm_create_handle", "vmm_release_handle",
                "vmm_set_access", "vmm_reserve", "vmm_release_range")


def run(order: str, sizes: list[int], width: int, row_bytes: int) -> dict:
    host = vmm_core.get_backend("host")
    w = torch.randn(width, 4 * width)

    def fn(x):
        # activations proportional to the batch, in the capture space as a device
        # framework's would be (the host's CPU allocator is not redirected)
        target = routing.current_target(0)
        if target is not None:
            target.deallocate(target.allocate(x.shape[0] * row_bytes))
        h = torch.relu(x @ w)
        return h @ w.t()

    capture = sorted(sizes, reverse=order == "descending")
    if order == "random":
        random.Random(3).shuffle(capture)
    ex = vmm_core.GraphExecutor(fn, torch.zeros(max(sizes), width), buckets=sizes,
                                backend=host, executables=False)
    calls, seconds = [], []
    with HookCounter(host) as counter:
        for size in capture:
            before = sum(counter.calls[h] for h in DRIVER_HOOKS)
            t0 = time.perf_counter()
            ex.capture_all([size])
            seconds.append(time.perf_counter() - t0)
            calls.append(sum(counter.calls[h] for h in DRIVER_HOOKS) - before)
    for size in random.Random(4).sample(sizes, len(sizes)):
        x = torch.randn(size, width)
        torch.testing.assert_close(ex(x), fn(x))
    stats = ex.stats()
    ex.close()
    return {"calls": calls, "seconds": seconds, "physical": stats["physical_bytes"],
            "largest": stats["largest_space_bytes"], "handles": stats["handles"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, default=len(VLLM_DECODE_SIZES))
    parser.add_argument("--width", type=int, default=256)
    # the decode benchmark's 4-layer MLP (hidden 4096, bf16) holds about 92 MiB at 512
    parser.add_argument("--row-kib", type=int, default=184,
                        help="activation bytes per batch row, in KiB")
    args = parser.parse_args()
    sizes = VLLM_DECODE_SIZES[:args.sizes]
    print(f"{'order':<11} {'calls/capture':>13} {'max':>5} {'ms/capture':>10} "
          f"{'physical MiB':>12} {'largest MiB':>11} {'handles':>7}")
    for order in ("ascending", "descending", "random"):
        r = run(order, sizes, args.width, args.row_kib << 10)
        n = len(r["calls"])
        print(f"{order:<11} {sum(r['calls']) / n:>13.1f} {max(r['calls']):>5} "
              f"{1e3 * sum(r['seconds']) / n:>10.3f} {r['physical'] / 2**20:>12.2f} "
              f"{r['largest'] / 2**20:>11.2f} {r['handles']:>7}")


if __name__ == "__main__":
    main()
