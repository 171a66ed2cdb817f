"""How long the capture of the 8B piecewise shape takes, one strategy per process.

The benchmark's engine-runner child also checks every size against eager, replays
traces and sleeps; this times only the capture loop, with the same runner, model and
sizes (``bench.piecewise_runners.PiecewiseRunner``, the Llama-3-8B shape, vLLM's 51
decode sizes, random order), so that runs alternating strategies on one machine can be
compared.  It prints the capture time, the pool's phases and, with ``PROFILE=1``, where
the time went (cProfile).

    python scripts/probe_piecewise_capture.py vllm|vmm     # from the checkout's root
    LAYERS=8 ORDER=ascending POLICY=all+kernels python scripts/probe_piecewise_capture.py vmm
    TINY=1 python scripts/probe_piecewise_capture.py vmm    # the host backend, a tiny model
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.getcwd())


def main(strategy: str) -> None:
    import torch

    from bench.exec_policies import pool_executables
    from bench.measure import VLLM_DECODE_SIZES, open_device, ordered
    from bench.models import LlamaStack
    from bench.peers import DISCIPLINES
    from bench.piecewise_runners import PiecewiseRunner
    from bench.torch_pools import make_pool
    from bench.workload import check_options

    tiny = bool(os.environ.get("TINY"))
    backend, ops, _, dev, memory = open_device("host" if tiny else "cuda")
    sizes = [1, 2, 4, 8] if tiny else VLLM_DECODE_SIZES
    options = {"layers": int(os.environ.get("LAYERS", 32))}
    if tiny:
        options |= {"hidden": 64, "ffn": 128, "heads": 4, "kv_heads": 2}
    model = LlamaStack(**check_options("llama8b", options), device=dev,
                       dtype=torch.float32 if tiny else torch.bfloat16, seed=0,
                       max_batch=max(sizes))
    discipline = DISCIPLINES[strategy]
    if discipline.graph_pool:
        policy = pool_executables(os.environ.get("POLICY", "all"),
                                  len(sizes) * model.num_pieces)
        pool = make_pool(discipline.reuse, 0, backend=backend, reads=(), executables=policy)
    else:
        pool = make_pool(discipline.reuse, 0, backend=backend)
    runner = PiecewiseRunner(model, pool, sizes, discipline, memory=memory,
                             weak_ref=(lambda out: out) if tiny else None)
    x = torch.randn(max(sizes), model.hidden, device=dev, dtype=model.dtype)
    model(x)
    pool.warmup(lambda: model(x))
    ops.synchronize()
    profile = cProfile.Profile() if os.environ.get("PROFILE") else None
    start = time.perf_counter()
    for size in ordered(sizes, os.environ.get("ORDER", "random"), 0):
        if profile:
            profile.enable()
        runner.capture(size)
        if profile:
            profile.disable()
        ops.synchronize()
    total = time.perf_counter() - start
    print(f"{strategy}: {runner.num_graphs} graphs captured in {total:.3f} s")
    if discipline.graph_pool:
        stats = pool.stats()
        print("  phases (ms):", {k: round(1e3 * v, 1) for k, v in stats["phase_seconds"].items()})
        policy = (stats.get("executables") or {}).get("policy") or {}
        print("  random numbers told by:", policy.get("random_numbers", "the framework"))
    if profile:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("vllm", "vmm"):
        sys.exit(__doc__)
    main(sys.argv[1])
