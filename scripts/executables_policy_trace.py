"""Which executables policy wins on serving-shaped traffic: budget, sharing, or both?

Runs the real policy (:mod:`vmm_core.graphs.executables`) on the host backend, whose
emulated executables follow the driver's rules, over the shape of a piecewise Llama-3-8B
capture: 51 decode sizes (vLLM's list), 33 graphs per size (the pieces between the 32
attention layers: the first, 31 alike, the last: three topologies), 1683 graphs.  Each
step replays every graph of one size inside ``pool.replaying(size)``, as a decode step
does.  Two traces of sizes: ``zipf`` (independent draws, a few sizes hot: the hard case)
and ``drift`` (a random walk over the sizes: continuous batching, where the batch changes
a little per step).

What it counts is the policy's (resident executables, instantiations, updates); what it
costs on a GPU is modelled with the H100 numbers of ARCHITECTURE.md section 4: instantiate
128 us, update 25 us, the first launch after either 31 us (upload), a resident launch
2.7 us.  The benchmark measures the real step time; this only orders the policies.

    python scripts/executables_policy_trace.py [--steps 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import vmm_core
from vmm_core.graphs.shapes import VLLM_DECODE_SIZES

INSTANTIATE_US, UPDATE_US, UPLOAD_US = 128.0, 25.0, 31.0
EXEC_KIB = 220  # per executable of an 8B piece (H100, ARCHITECTURE.md section 4)
LAYERS = 32


def first_piece(buf):
    return lambda: buf.add(1)


def middle_piece(buf):
    return lambda: buf.mul(1)


def last_piece(buf):
    return lambda: buf.sub(1)


def build(policy):
    pool = vmm_core.GraphPool(backend="host", reads=(), executables=policy)
    graphs = {}
    buf = torch.zeros(1)
    for size in VLLM_DECODE_SIZES:
        with pool.space(size):
            pieces = [first_piece(buf)] + [middle_piece(buf) for _ in range(LAYERS - 1)] \
                + [last_piece(buf)]
            graphs[size] = []
            for fn in pieces:
                g = pool.new_graph()
                pool.capture(g, fn)
                graphs[size].append(g)
    return pool, graphs


def trace(kind: str, steps: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    sizes = list(VLLM_DECODE_SIZES)
    if kind == "zipf":
        ranked = sizes[:]
        rng.shuffle(ranked)
        weights = [1.0 / (i + 1) for i in range(len(ranked))]
        return rng.choices(ranked, weights=weights, k=steps)
    i, out = len(sizes) // 2, []
    for _ in range(steps):
        i = min(len(sizes) - 1, max(0, i + rng.choice((-1, 0, 0, 1))))
        out.append(sizes[i])
    return out


def step(pool, graphs, size: int) -> None:
    with pool.replaying(size):
        for g in graphs[size]:
            g.replay()


def run(name: str, policy, sizes: list[int]) -> dict:
    """The policy's counts over ``sizes``, after one warm-up step of every size (an
    engine replays each size once after capturing it): what serving then adds."""
    pool, graphs = build(policy)
    for size in VLLM_DECODE_SIZES:
        step(pool, graphs, size)
    warm = pool.stats()["executables"]
    t0 = time.perf_counter()
    for size in sizes:
        step(pool, graphs, size)
    wall = time.perf_counter() - t0
    s = pool.stats()["executables"]
    pool.close()
    made = s["instantiations"] - warm["instantiations"]
    updated = s["updates"] - warm["updates"]
    modelled = (made * (INSTANTIATE_US + UPLOAD_US) + updated * (UPDATE_US + UPLOAD_US)) \
        / len(sizes)
    return {"policy": name, "peak": s["peak_resident"], "instantiations": made,
            "updates": updated, "refused": sum(s["update_refused"].values()),
            "overhead_us": modelled, "host_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    total = len(VLLM_DECODE_SIZES) * (LAYERS + 1)
    P = vmm_core.ExecutablePolicy
    policies = [("every executable resident", P(share="off"))]
    for frac in (0.5, 0.25):
        n = int(total * frac)
        policies += [(f"budget {frac:.0%}, no sharing", P(max_count=n, share="off")),
                     (f"budget {frac:.0%}, share when full", P(max_count=n))]
    # with any budget, "always" keeps one executable per topology: the same as this
    policies += [("share always (any budget)", P(share="always"))]
    print(f"{total} graphs ({len(VLLM_DECODE_SIZES)} sizes x {LAYERS + 1} pieces); "
          f"{args.steps} steps after one warm-up step per size; modelled GPU time per "
          f"step of what misses add "
          f"(instantiate {INSTANTIATE_US:.0f} us, update {UPDATE_US:.0f} us, upload "
          f"{UPLOAD_US:.0f} us); executables' memory at {EXEC_KIB} KiB each")
    for kind in ("zipf", "drift"):
        sizes = trace(kind, args.steps, args.seed)
        print(f"\ntrace {kind}: {len(set(sizes))} distinct sizes")
        print(f"  {'policy':34s} {'peak':>5s} {'MiB':>5s} {'inst':>6s} {'upd':>6s} "
              f"{'refused':>7s} {'us/step':>8s}")
        for name, policy in policies:
            r = run(name, policy, sizes)
            print(f"  {name:34s} {r['peak']:5d} {r['peak'] * EXEC_KIB / 1024:5.0f} "
                  f"{r['instantiations']:6d} {r['updates']:6d} {r['refused']:7d} "
                  f"{r['overhead_us']:8.1f}")


if __name__ == "__main__":
    main()
