"""What a step of graph launches pays for executables made or updated just before it, or
beside it: the device's share and the host's, apart.

A step here launches the executables of P pieces (RMS norm and an MLP, captured at one
size) and waits for the device, timed host side, median of R rounds, in six ways:

* ``warm``: the same executables as the round before (every executable resident);
* ``updated, uploaded``: before each round every executable was updated to the piece at
  another size and back, then uploaded on a stream of its own and waited for, with the
  device idle (what the preparer does, with nothing beside it);
* ``updated, not uploaded``: the same without the upload (the first launch pays it);
* ``made, uploaded``: destroyed and instantiated anew, then uploaded, device idle;
* ``beside updates``: warm executables, while a thread updates and uploads P other
  executables over and over (a preparer's driver calls beside the step);
* ``beside Python``: warm executables, while a thread runs Python bookkeeping (what the
  interpreter's hand-offs alone cost the launch loop).

``updated, uploaded`` above ``warm`` says an updated executable costs the device
something even uploaded ahead (then only fewer updates help); ``beside ...`` above
``warm`` says preparing beside a step costs it (then the preparer must keep off steps).

    python scripts/probe_exec_step.py [--backend cuda|host] [--pieces 33] [--size 64]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

import vmm_core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "host")
    parser.add_argument("--pieces", type=int, default=33)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    on_cuda = args.backend == "cuda"
    dev = "cuda" if on_cuda else "cpu"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    hidden, ffn = (args.hidden, args.ffn) if on_cuda else (64, 128)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    pool = vmm_core.GraphPool(backend=args.backend, reads=())
    gen = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.randn(hidden, ffn, device=dev, dtype=dtype, generator=gen) / 64
    w2 = torch.randn(ffn, hidden, device=dev, dtype=dtype, generator=gen) / 128
    sizes = (args.size, args.size + 8)
    x = torch.randn(max(sizes), hidden, device=dev, dtype=dtype, generator=gen)

    def piece(h):
        h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
        return torch.nn.functional.silu(h @ w1) @ w2

    pool.warmup(lambda: piece(x))
    graphs = {}
    for size in sizes:
        graphs[size] = []
        with pool.space(size) as handle:
            for _ in range(args.pieces):
                g = pool.new_graph()
                if on_cuda:
                    with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream):
                        pool.keep(piece(x[:size]))
                else:
                    pool.keep(pool.capture(g, lambda s=size: piece(x[:s])))
                graphs[size].append(g)
    calls = pool._executables._calls  # the probe drives the backend's executables itself
    a, b = graphs[sizes[0]], graphs[sizes[1]]
    mine = [calls.instantiate(g) for g in a]
    spare = [calls.instantiate(g) for g in b]
    refused = {calls.update(spare[0], a[0]), calls.update(spare[0], b[0])} - {None}
    if refused:
        print(f"exec step probe: the driver refused an update between sizes {sizes} "
              f"({', '.join(sorted(refused))}); try another --size")
        return

    def step_us(before=None) -> float:
        times = []
        for _ in range(args.rounds):
            if before is not None:
                before()
            sync()
            t0 = time.perf_counter()
            for h in mine:
                calls.launch(h)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def updated(upload: bool):
        def run():
            for h, ga, gb in zip(mine, a, b):
                calls.update(h, gb)
                calls.update(h, ga)
                if upload:
                    calls.preload(h)
        return run

    def made():
        for i, g in enumerate(a):
            calls.destroy(mine[i])
            mine[i] = calls.instantiate(g)
            calls.preload(mine[i])

    def beside(work):
        stop = threading.Event()
        thread = threading.Thread(target=lambda: [work() for _ in iter(stop.is_set, True)],
                                  daemon=True)
        thread.start()
        try:
            return step_us()
        finally:
            stop.set()
            thread.join(30)

    def updates_beside():
        for h, ga, gb in zip(spare, a, b):
            calls.update(h, ga)
            calls.update(h, gb)
            calls.preload(h)

    def bookkeeping():
        sum(sorted({i: -i for i in range(200)}.values()))

    step_us()  # every executable launched once
    rows = [("warm", step_us()), ("updated, uploaded", step_us(updated(True))),
            ("updated, not uploaded", step_us(updated(False))),
            ("made, uploaded", step_us(made)), ("beside updates", beside(updates_beside)),
            ("beside Python", beside(bookkeeping))]
    name = torch.cuda.get_device_name() if on_cuda else "host backend"
    print(f"exec step probe: {args.pieces} pieces at size {sizes[0]} (hidden {hidden}, "
          f"ffn {ffn}), a step = every launch then a synchronize, median of {args.rounds} "
          f"({name}, torch {torch.__version__}):")
    warm = rows[0][1]
    for label, us in rows:
        print(f"exec step probe: {label:22s} {us:9.1f} us  {us / warm:.3f}x warm")
    for h in mine + spare:
        calls.destroy(h)
    pool.close()


if __name__ == "__main__":
    main()
