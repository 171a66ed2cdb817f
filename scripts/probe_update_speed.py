"""Does an executable updated to a graph run it as fast as one instantiated from it?

Sixteen pieces of a Llama MLP (RMS norm, SwiGLU, hidden 4096, ffn 14336, bf16) are
captured at each of nine batch sizes.  For a target size, a step (every piece launched,
then a synchronize, median of 20 after three warm ones) over executables instantiated
from the target's graphs is the reference; then over executables instantiated from
another size's graphs and updated to the target's (uploaded), and over the target's own
executables updated to another size and back.  It prints each size's kernels first:
whether an update changed the kernels or only their parameters.  On an H200 (driver
580, CUDA 13, torch 2.11, 2026-11-29) the updated executables ran 1.00-1.14x the
reference (median 1.03x), and those updated away and back 1.02-1.15x, launch after
launch (ExecutablePolicy's ``share`` defaults to ``"off"``).
The 512 graphs have one node fewer: their update is refused (``ok False``).

    python3 scripts/probe_update_speed.py     # one CUDA GPU, about ten seconds
"""
import ctypes
import statistics
import time

import torch

import vmm_core
from vmm_backends.cuda.generator_state import KernelNodeParams

PIECES = 16
HIDDEN, FFN = 4096, 14336
SIZES = (8, 16, 24, 64, 72, 128, 256, 264, 512)
TARGETS = (8, 64, 256)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_update_speed.py needs a CUDA GPU")
    pool = vmm_core.GraphPool(backend="cuda", reads=())
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(HIDDEN, FFN, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
    w2 = torch.randn(FFN, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) / 128
    x = torch.randn(max(SIZES), HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)

    def piece(h):
        h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
        return torch.nn.functional.silu(h @ w1) @ w2

    pool.warmup(lambda: piece(x))
    graphs = {}
    for s in SIZES:
        graphs[s] = []
        with pool.space(s) as handle:
            for _ in range(PIECES):
                g = pool.new_graph()
                with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream):
                    pool.keep(piece(x[:s]))
                graphs[s].append(g)
    calls = pool._executables._calls  # the probe drives the backend's executables itself

    def kernels(g) -> list[str]:
        names = []
        for node in calls._nodes(g.raw_cuda_graph()):
            p = KernelNodeParams()
            if calls._kernel_params(node, ctypes.byref(p)) == 0:
                names.append(calls._name(p.func, p.kern))
        return names

    sig = {s: kernels(graphs[s][0]) for s in SIZES}
    for s in SIZES:
        print(s, [name[-30:] for name in sig[s]], flush=True)

    def step_us(execs, rounds: int = 20) -> float:
        for _ in range(3):
            for h in execs:
                calls.launch(h)
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for h in execs:
                calls.launch(h)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    for a in TARGETS:
        own = [calls.instantiate(g) for g in graphs[a]]
        calls.preload_all(own)
        base = step_us(own)
        print(f"target {a}: own {base:.0f} us", flush=True)
        for b in SIZES:
            if b == a:
                continue
            execs = [calls.instantiate(g) for g in graphs[b]]
            ok = all(calls.update(h, g) is None for h, g in zip(execs, graphs[a]))
            calls.preload_all(execs)
            t = step_us(execs)
            same = sig[a] == sig[b]
            back = [calls.instantiate(g) for g in graphs[a]]  # updated away and back
            for h, gb, ga in zip(back, graphs[b], graphs[a]):
                calls.update(h, gb)
                calls.update(h, ga)
            calls.preload_all(back)
            tb = step_us(back)
            print(f"  from {b:4d}: ok {ok} same kernels {same}: {t:.0f} us {t / base:.3f}x; "
                  f"instantiated {a}->{b}->{a}: {tb / base:.3f}x", flush=True)
            for h in execs + back:
                calls.destroy(h)
        for h in own:
            calls.destroy(h)


if __name__ == "__main__":
    main()
