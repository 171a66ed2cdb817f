"""Two RL loops in one process, as the GPU suite once ran them (device only).

Found on the H100: after a `vmm` loop, closing the tagged allocators it left (what a test
fixture did) made the next loop's first matrix multiply hit an illegal memory access, and
clearing PyTorch's cuBLAS workspaces after the close made it pass.  This reproduces it.

Usage: python3 scripts/probe_rl_sequence.py FIRST SECOND BETWEEN
  FIRST, SECOND: vmm | vllm | recapture
  BETWEEN: none | drain (the teardown thread) | close (every tagged allocator)
           | close+clear (close, then clear the cuBLAS workspaces)
"""

from __future__ import annotations

import gc
import sys

import torch

import vmm_core
from vmm_bench import rl
from vmm_core.memory import reaper, tagged

SPEC = rl.small_spec(steps=3)


def close_every_tag() -> None:
    gc.collect()
    reaper.drain(30)
    for tag in list(tagged._registry):
        for alloc in tagged._registry.get(tag, []):
            print("closing", tag, alloc.physical_bytes, flush=True)
            alloc.close()
    tagged._registry.clear()
    tagged._region_allocators.clear()
    tagged._pools.clear()


def main(first: str, second: str, between: str) -> None:
    record = rl.run_one_rl(f"rl:{first}", SPEC)
    print("first done", first, [s["wrong_sizes"] for s in record["steps"]], flush=True)
    if between.startswith("close"):
        close_every_tag()
        if between == "close+clear":
            torch._C._cuda_clearCublasWorkspaces()
            print("cleared cublas workspaces", flush=True)
    elif between == "drain":
        gc.collect()
        print("drained", reaper.drain(30), flush=True)
    torch.cuda.synchronize()
    print("summary after first:", {t: (v["device_bytes"], v["asleep"])
                                   for t, v in vmm_core.memory_summary().items()}, flush=True)
    record = rl.run_one_rl(f"rl:{second}", SPEC)
    print("second done", second, [s["wrong_sizes"] for s in record["steps"]], flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
