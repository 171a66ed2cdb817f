"""What one launch of a GraphPool's graph costs on the host, against the framework's own.

A piecewise step launches dozens of graphs of one key through Python, so the pool's path
from ``g.replay()`` to the driver is paid dozens of times a step.  This times, host side,
the launch of one small graph (one kernel) four ways, best of 5 rounds of 2000:

* ``torch replay``: the framework's own ``CUDAGraph.replay()`` of the same kernel (CUDA);
* ``pool, in its block``: ``g.replay()`` inside ``pool.replaying(key)`` of its key, the
  fast path of a step (no lock, no dictionary work);
* ``backend launch``: the backend's launch of the same executable, called directly (what
  the pool's path adds is the difference);
* ``pool, outside a block``: ``g.replay()`` with no block open (opens one per launch).

It prints each in microseconds and the fast path against torch's replay.  On the host
backend (no device) it runs the same calls on emulated executables.

    python scripts/probe_launch_path.py [--backend cuda|host]
"""

from __future__ import annotations

import argparse
import time

import torch

import vmm_core

ROUNDS, LAUNCHES = 5, 2000


def per_launch_us(fn, synchronize) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(LAUNCHES):
            fn()
        best = min(best, (time.perf_counter() - t0) / LAUNCHES)
        synchronize()
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "host")
    args = parser.parse_args()
    on_cuda = args.backend == "cuda"
    device = "cuda" if on_cuda else "cpu"
    synchronize = torch.cuda.synchronize if on_cuda else (lambda: None)
    pool = vmm_core.GraphPool(backend=args.backend, reads=())  # every executable resident
    x = torch.zeros(1, device=device)
    pool.warmup(lambda: x.add_(1))
    g = pool.new_graph()
    with pool.space(1):
        pool.capture(g, lambda: x.add_(1))
    calls, handle = pool._executables._calls, g._vmm_exec  # the probe reads the pool's state
    rows = []
    if on_cuda:
        own = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(own, stream=stream):
            x.add_(1)
        rows.append(("torch replay", per_launch_us(own.replay, synchronize)))

    def in_block() -> float:
        with pool.replaying(1):
            return per_launch_us(g.replay, synchronize)

    rows.append(("pool, in its block", in_block()))
    rows.append(("backend launch", per_launch_us(lambda: calls.launch(handle), synchronize)))
    rows.append(("pool, outside a block", per_launch_us(g.replay, synchronize)))
    name = torch.cuda.get_device_name() if on_cuda else "host backend"
    print(f"launch of one small graph, host side, best of {ROUNDS} x {LAUNCHES} "
          f"({name}, torch {torch.__version__}):")
    for label, us in rows:
        print(f"  {label:24s} {us:7.2f} us")
    times = dict(rows)
    fast = times["pool, in its block"]
    if "torch replay" in times:
        print(f"launch path: the pool's fast path {fast / times['torch replay']:.3f}x "
              f"torch's replay(); it adds "
              f"{fast - times['backend launch']:+.2f} us to the backend's launch")
    else:
        print(f"launch path: the pool's fast path adds "
              f"{fast - times['backend launch']:+.2f} us to the backend's launch")
    pool.close()


if __name__ == "__main__":
    main()
