"""Which live blocks a `vmm` RL loop leaves in torch pools other than the default one, and
the Python stack that allocated each (device only).

A cuBLAS workspace among them would be the one found living in tagged memory on the H100
(docs/failures.md); its stack says which call made it there.  With
``--no-prime`` the CUDA adapter does not create the current stream's workspace before a
region (what vmm_core did before that fix): the control.

Usage: python3 scripts/probe_workspace_origin.py [--no-prime]
"""

from __future__ import annotations

import sys

import torch

from vmm_bench import rl

SPEC = rl.small_spec(steps=1)


def main() -> None:
    if "--no-prime" in sys.argv:
        from vmm_backends.cuda import allocator_adapter

        allocator_adapter.prime_library_workspaces = lambda device: None
        print("control: workspaces not primed", flush=True)
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    rl.run_one_rl("rl:vmm", SPEC)
    torch.cuda.synchronize()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool == (0, 0):
            continue
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}"
                      for f in block.get("frames", [])][:14]
            print("pool", pool, "stream", seg.get("stream"), "address",
                  hex(block["address"]), "size", block["size"], flush=True)
            for frame in frames:
                print("   ", frame)
    print("probe done")


if __name__ == "__main__":
    main()
