"""Which executables policy wins on serving-shaped traffic: budget, sharing, preparing ahead?

Runs the real policy (:mod:`vmm_core.graphs.executables`) on the host backend, whose
emulated executables follow the driver's rules, over the shape of a piecewise Llama-3-8B
capture: 51 decode sizes (vLLM's list), 33 graphs per size (the pieces between the 32
attention layers: the first, 31 alike, the last: three topologies), 1683 graphs.  Each
step replays every graph of one size inside ``pool.replaying(size)``, as a decode step
does; then the pool's own thread may work until the next step (a step of the 8B shape
keeps the device busy for about 12 ms on an H100: ``settle()`` stands for that time).
The benchmark's three traces (``vmm_bench.serving.request_trace``): ``uniform``,
``zipf`` (a few sizes hot) and ``drift`` (a random walk over the sizes).

What it counts is the policy's: executables alive, steps that begin *cold* (their key
lacks executables when its block opens), executables made ahead and made for nothing.
What that costs on a GPU is modelled with the H100 numbers of ARCHITECTURE.md section 4
(instantiate 128 us, update 25 us, the first launch after either 31 us): inline, every
miss's cost is in the step; ahead, a cold step waits for its first piece only (the others
are made while the device runs the earlier ones, as long as one piece's preparation is
shorter than the device time of a piece and its attention).  The benchmark measures the
real step time; this only orders the policies.

    python scripts/executables_policy_trace.py [--steps 1000] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

import vmm_core
from vmm_bench.measure import VLLM_DECODE_SIZES
from vmm_bench.serving import TRACES, request_trace

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


def step(pool, graphs, size: int) -> None:
    with pool.replaying(size):
        for g in graphs[size]:
            g.replay()


def run(policy, sizes: list[int], hints: bool) -> dict:
    """The policy's counts over ``sizes``, after one warm-up step of every size (an
    engine replays each size once after capturing it): what serving then adds."""
    pool, graphs = build(policy)
    for size in VLLM_DECODE_SIZES:
        step(pool, graphs, size)
        pool.settle(60)
    warm = pool.stats()["executables"]
    for i, size in enumerate(sizes):
        step(pool, graphs, size)
        if hints and i + 1 < len(sizes):
            pool.expect(sizes[i + 1])  # what the engine's scheduler knows by now
        pool.settle(60)
    s = pool.stats()["executables"]
    pool.close()
    d = {k: s[k] - warm[k] for k in ("instantiations", "updates", "misses", "cold_blocks",
                                     "prepared_ahead", "unused_ahead")}
    ahead = s["policy"]["ahead"]
    if ahead:  # a cold step waits for one piece: an update where the budget is full
        first = (UPDATE_US if d["updates"] else INSTANTIATE_US) + UPLOAD_US
        modelled = d["cold_blocks"] * first / len(sizes)
    else:
        modelled = (d["instantiations"] * (INSTANTIATE_US + UPLOAD_US)
                    + d["updates"] * (UPDATE_US + UPLOAD_US)) / len(sizes)
    return {"peak": s["peak_resident"], **d, "refused": sum(s["update_refused"].values()),
            "overhead_us": modelled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    total = len(VLLM_DECODE_SIZES) * (LAYERS + 1)
    P = vmm_core.ExecutablePolicy
    policies = [("every executable resident", P(share="off"), False)]
    for frac in (0.5, 0.25):
        n = int(total * frac)
        shared = {"max_count": n, "share": "when_full"}  # the policy the table was made of
        policies += [(f"budget {frac:.0%}, share, inline", P(**shared, ahead=False), False),
                     (f"budget {frac:.0%}, share, ahead", P(**shared, ahead=True), False),
                     (f"budget {frac:.0%}, share, ahead+hint", P(**shared, ahead=True),
                      True)]
    print(f"{total} graphs ({len(VLLM_DECODE_SIZES)} sizes x {LAYERS + 1} pieces); "
          f"{args.steps} steps after one warm-up step per size; executables' memory at "
          f"{EXEC_KIB} KiB each; modelled GPU time per step of what misses add "
          f"(instantiate {INSTANTIATE_US:.0f} us, update {UPDATE_US:.0f} us, upload "
          f"{UPLOAD_US:.0f} us)")
    for kind in TRACES:
        sizes = request_trace(list(VLLM_DECODE_SIZES), args.steps, args.seed, kind)
        print(f"\ntrace {kind}: {len(set(sizes))} distinct sizes")
        print(f"  {'policy':32s} {'peak':>5s} {'MiB':>5s} {'cold':>6s} {'inst':>6s} "
              f"{'upd':>6s} {'ahead':>6s} {'unused':>6s} {'us/step':>8s}")
        for name, policy, hints in policies:
            r = run(policy, sizes, hints)
            print(f"  {name:32s} {r['peak']:5d} {r['peak'] * EXEC_KIB / 1024:5.0f} "
                  f"{r['cold_blocks'] / len(sizes):6.1%} {r['instantiations']:6d} "
                  f"{r['updates']:6d} {r['prepared_ahead']:6d} {r['unused_ahead']:6d} "
                  f"{r['overhead_us']:8.1f}")


if __name__ == "__main__":
    main()
