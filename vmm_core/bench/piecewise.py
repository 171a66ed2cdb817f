"""``vmm-core bench --scenario piecewise|families|record-stream``: an engine's own runner.

Engines do not hand their model to our runner.  vLLM captures *piecewise* (the model is
split at attention; every piece is captured per batch size and attention runs eagerly in
between) and, in FULL_AND_PIECEWISE mode, keeps a second family of full graphs for the
same sizes, passing one ``graph_pool_handle()`` to every capture.  The runners below are
shaped like that; the only vmm_core lines in them are where the engine passes ``pool=``
(``pool.space(key)``) and before it launches a key's graphs (``pool.replaying(key)``).

Strategies compared on the same sizes and orders, each in a fresh process:

* ``vmm``: a :class:`vmm_core.GraphPool`, one virtual space per size (and per family);
* ``vllm``: one shared pool; intermediate piece outputs kept, the last piece's output
  turned into a non-owning view (vLLM's piecewise backend);
* ``sglang``: one shared pool, every output kept;
* ``private``: a private pool per graph;
* ``alone``: the largest size only, in one shared pool (the floor).

Every configuration checks every size against eager on fresh inputs after all captures.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

__all__ = ["PiecewiseRunner", "FullRunner", "run_piecewise_bench", "run_one_piecewise",
           "STRATEGIES", "SCENARIOS"]

STRATEGIES = {
    "vmm": "GraphPool: a virtual space per size over shared pages",
    "vllm": "one shared pool; piece outputs kept, the last one a non-owning view (vLLM)",
    "sglang": "one shared pool; every output kept (SGLang)",
    "private": "a private pool per graph",
}
SCENARIOS = ("piecewise", "families", "record-stream")
#: relative error above which a size counts as wrong (bf16 graphs vs eager are ~1e-3)
WRONG_ABOVE = 0.02


def _bucket(sizes, n: int) -> int:
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"batch {n} exceeds the largest captured size {sizes[-1]}")


def _non_owning(t):
    """A view of ``t``'s memory that does not keep its block allocated (vLLM's
    ``weak_ref_tensors``): the pool may hand the block to a later capture."""
    import torch

    if t.device.type != "cuda" or not t.is_contiguous():
        raise ValueError("non-owning views are made for contiguous CUDA tensors only")

    class _Memory:
        __cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),),
                                    "typestr": "|u1", "data": (t.data_ptr(), False),
                                    "version": 3}

    return torch.as_tensor(_Memory(), device=t.device).view(t.dtype).view(t.shape)


class _Runner:
    """What both runners share: a persistent input buffer and per-size entries."""

    family = ""

    def __init__(self, model, pool, sizes, last_output: str = "keep") -> None:
        import torch

        if last_output not in ("keep", "weak"):
            raise ValueError(f"last_output must be 'keep' or 'weak', got {last_output!r}")
        self.model, self.pool, self.last_output = model, pool, last_output
        self.sizes = sorted(sizes)
        self.inputs = torch.zeros(self.sizes[-1], model.hidden, device=model.device,
                                  dtype=model.dtype)  # outside every pool
        self.entries: dict[int, list] = {}

    def key(self, size: int):
        return (self.family, size) if self.family else size

    def _capture_graph(self, size: int, fn, last: bool):
        """One capture the way an engine's wrapper does it: the engine's ``pool=`` line
        becomes ``pool.space(key)``; outputs the runner keeps are declared space-local."""
        pool = self.pool
        graph = pool.ops.new_graph()
        with pool.space(self.key(size)) as handle:
            out = pool.ops.capture(graph, fn, handle)
            flat = list(out) if isinstance(out, tuple) else [out]
            if last and self.last_output == "weak":
                flat = [_non_owning(t) for t in flat]
            else:
                pool.keep(*flat)
        if last and self.last_output == "weak":
            out = tuple(flat) if isinstance(out, tuple) else flat[0]
        return graph, out

    def __call__(self, x):
        n = x.shape[0]
        size = _bucket(self.sizes, n)
        if size not in self.entries:
            self.capture(size)
        with self.pool.replaying(self.key(size)):
            self.inputs[:n].copy_(x)
            self.inputs[n:size].zero_()
            out = self._replay(size)
        return out[:n]

    @property
    def num_graphs(self) -> int:
        return sum(len(e) for e in self.entries.values())


class PiecewiseRunner(_Runner):
    """vLLM-shaped: per size one graph per piece; attention runs eagerly between pieces.

    Piece i's outputs (residual, q, k, v, attention buffer) are the next piece's static
    inputs, so they stay alive: declared space-local with ``keep``.  They are valid until
    a graph of another size replays, which is all the runner needs.
    """

    family = "piecewise"

    def capture(self, size: int) -> None:
        model = self.model
        args = (self.inputs[:size],)
        entries = []
        last = model.num_pieces - 1
        for i in range(model.num_pieces):
            graph, out = self._capture_graph(
                size, lambda i=i, args=args: model.piece(i, *args), i == last)
            entries.append((graph, out))
            if i < last:
                residual, _, _, _, attn = out
                args = (residual, attn)
        self.entries[size] = entries

    def _replay(self, size: int):
        entries = self.entries[size]
        for i, (graph, out) in enumerate(entries):
            graph.replay()
            if i < len(entries) - 1:
                _, q, k, v, attn = out
                self.model.attention(i, q, k, v, attn)  # eager, outside every graph
        return entries[-1][1]


class FullRunner(_Runner):
    """One graph for the whole step per size (vLLM's FULL family)."""

    family = "full"

    def capture(self, size: int) -> None:
        x = self.inputs[:size]
        self.entries[size] = [self._capture_graph(size, lambda: self.model(x), True)]

    def _replay(self, size: int):
        graph, out = self.entries[size][0]
        graph.replay()
        return out


# ---------------------------------------------------------------------- one configuration
def _order(sizes, order: str, seed: int) -> list[int]:
    sizes = sorted(sizes)
    if order == "descending":
        return sizes[::-1]
    if order == "random":
        random.Random(seed).shuffle(sizes)
    return sizes


def run_one_piecewise(spec: str, args) -> dict:
    """Child process: one ``scenario:strategy:order`` configuration on the device."""
    import torch

    import vmm_core
    from vmm_core.bench.models import LlamaStack

    scenario, strategy, order = spec.split(":")
    backend = vmm_core.get_backend(args.backend)
    ops = backend.graph_ops(0)
    mod = getattr(torch, ops.device_type)
    dev = ops.torch_device
    sizes = sorted(args.sizes_list)
    if strategy == "alone":
        sizes = [sizes[-1]]
    torch.manual_seed(args.seed)
    model = LlamaStack(layers=args.layers, device=dev, seed=args.seed,
                       max_batch=max(sizes), side_stream=scenario == "record-stream")
    families = ("full", "piecewise") if scenario == "families" else ("piecewise",)
    reuse = {"vmm": "vmm", "private": "private"}.get(strategy, "shared")
    last_output = "weak" if strategy in ("vllm", "alone") else "keep"
    pools, runners = {}, []
    for family in families:
        first = next(iter(pools.values()), None)
        if reuse == "shared" and first is not None:
            pool = first  # one graph_pool_handle() for every family, as engines do
        else:
            pool = vmm_core.GraphPool(0, backend=backend, reuse=reuse, reads=(),
                                      allocator=first.allocator if first else None)
        pools[family] = pool
        cls = FullRunner if family == "full" else PiecewiseRunner
        runners.append(cls(model, pool, sizes, last_output=last_output))
    pool = pools[families[0]]
    # engines run warm-up forwards first: libraries create per-stream workspaces then
    x_max = torch.randn(max(sizes), model.hidden, device=dev, dtype=model.dtype)
    model(x_max)
    pool.warmup(lambda: model(x_max))
    mod.synchronize()
    mod.empty_cache()
    free0, reserved0 = mod.mem_get_info(dev)[0], mod.memory_reserved(dev)
    growth, capture_s = [], 0.0
    rsr = ops.record_stream_reuse(scenario == "record-stream" and strategy == "on")
    with rsr:
        for size in _order(sizes, order, args.seed):
            t0 = time.perf_counter()
            for runner in runners:
                runner.capture(size)
            mod.synchronize()
            capture_s += time.perf_counter() - t0
            mod.empty_cache()  # measure held memory, not what the caching allocator keeps
            growth.append([sum(r.num_graphs for r in runners), free0 - mod.mem_get_info(dev)[0]])
    graph_bytes = growth[-1][1]
    reserved_delta = mod.memory_reserved(dev) - reserved0
    alloc = pool.allocator
    pool_bytes = alloc.physical_bytes if alloc is not None else reserved_delta

    # correctness: every size of every family, shuffled, fresh inputs, against eager
    checks = [(r, s) for r in runners for s in sizes] * 2
    random.Random(args.seed + 1).shuffle(checks)
    worst, wrong = 0.0, []
    for runner, size in checks:
        n = size if size < 3 else random.Random(size).randint(size // 2 + 1, size)
        x = torch.randn(n, model.hidden, device=dev, dtype=model.dtype)
        got = runner(x).float()
        ref = model(x).float()
        err = ((got - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        if not err <= WRONG_ABOVE:
            wrong.append([runner.family, size, err])

    # replay: a whole step (graphs and eager attention) per size, device time
    inputs = {s: torch.randn(s, model.hidden, device=dev, dtype=model.dtype) for s in sizes}
    runner = runners[-1]
    for s in sizes:
        runner(inputs[s])
    mod.synchronize()
    start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
    rounds = 3
    start.record()
    for _ in range(rounds):
        for s in sizes:
            runner(inputs[s])
    end.record()
    mod.synchronize()
    step_us = start.elapsed_time(end) * 1e3 / (rounds * len(sizes))
    stats = pool.stats()
    graphs = sum(r.num_graphs for r in runners)
    largest_space = max((p.stats()["largest_space_bytes"] for p in pools.values()), default=0)
    return {
        "scenario": scenario, "strategy": strategy, "order": order, "sizes": len(sizes),
        "graphs": graphs, "graph_bytes": graph_bytes, "growth": growth,
        "pool_bytes": pool_bytes, "reserved_delta_bytes": reserved_delta,
        "outside_pool_bytes": graph_bytes - pool_bytes,
        "largest_space_bytes": largest_space if alloc is not None else None,
        "physical_bytes": stats["physical_bytes"], "handles": stats["handles"],
        "capture_s": capture_s, "step_us": step_us, "wrong": wrong, "worst_rel_err": worst,
        "phase_ms": {k: 1e3 * v for k, v in stats["phase_seconds"].items()},
        "torch": torch.__version__, "device": mod.get_device_name(dev),
    }


# ---------------------------------------------------------------------- the parent
def _specs(args) -> list[str]:
    scenarios = [s for s in args.scenario.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise ValueError(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    specs = []
    for scenario in scenarios:
        if scenario == "record-stream":
            specs += ["record-stream:off:ascending", "record-stream:on:ascending"]
            continue
        specs.append(f"{scenario}:alone:ascending")
        specs += [f"{scenario}:{s}:{o}" for s in strategies for o in args.orders.split(",")]
    return specs


def run_piecewise_bench(args, backend, sizes) -> dict:
    if getattr(args, "one", None):
        args.sizes_list = sizes
        result = run_one_piecewise(args.one, args)
        print("VMMBENCH " + json.dumps(result))
        return {"ok": not result["wrong"], **result}
    results = []
    for spec in _specs(args):
        cmd = [sys.executable, "-m", "vmm_core.cli", "bench", "--one", spec,
               "--scenario", spec.split(":")[0], "--backend", backend.name,
               "--layers", str(args.layers), "--seed", str(args.seed),
               "--sizes", ",".join(map(str, sizes))]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("VMMBENCH ")]
        scenario, strategy, order = spec.split(":")
        if proc.returncode not in (0, 1) or not line:
            print(f"{spec}: child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            results.append({"scenario": scenario, "strategy": strategy, "order": order,
                            "error": proc.stderr[-3000:]})
            continue
        r = json.loads(line[-1][len("VMMBENCH "):])
        results.append(r)
        print(f"  done {spec}: {r['graphs']} graphs, {r['graph_bytes'] / 2**20:.0f} MiB, "
              f"{len(r['wrong'])} wrong", flush=True)
    print_piecewise_table(results)
    ok = all("error" not in r and not r["wrong"] for r in results)
    return {"mode": "piecewise", "backend": backend.name, "sizes": sizes,
            "results": results, "ok": ok}


def _mib(n) -> str:
    return f"{n / 2**20:8.1f}" if n is not None else "       -"


def print_piecewise_table(results) -> None:
    ok = [r for r in results if "error" not in r]
    if not ok:
        print("no configuration completed")
        return
    print(f"\n{ok[0]['device']}, torch {ok[0]['torch']}; graph memory = drop of "
          f"mem_get_info free bytes over all captures")
    for scenario in dict.fromkeys(r["scenario"] for r in results):
        rows = [r for r in results if r["scenario"] == scenario]
        if scenario == "record-stream":
            _print_record_stream(rows)
            continue
        alone = next((r for r in rows if r.get("strategy") == "alone" and "error" not in r),
                     None)
        ref = {r["order"]: r for r in rows if r.get("strategy") == "vllm" and "error" not in r}
        print(f"\n{scenario}: {STRATEGIES.get('vmm')} vs the engines' pools")
        print(f"{'strategy':8s} {'order':11s} {'graphs':>6s} {'MiB':>8s} {'x alone':>7s} "
              f"{'pool MiB':>8s} {'outside':>8s} {'x target':>8s} {'capture':>8s} "
              f"{'x vllm':>6s} {'step us':>8s} {'x vllm':>6s} {'wrong':>5s}")
        per_graph = None
        if alone is not None:
            per_graph = alone["outside_pool_bytes"] / alone["graphs"]
        vmm_rows = [r for r in rows if r.get("strategy") == "vmm" and "error" not in r]
        if vmm_rows:  # measured on the strategy with many graphs: per-graph executable bytes
            per_graph = sum(r["outside_pool_bytes"] / r["graphs"] for r in vmm_rows) / \
                len(vmm_rows)
        for r in rows:
            if "error" in r:
                print(f"{r['strategy']:8s} {r['order']:11s} FAILED")
                continue
            base = alone["graph_bytes"] if alone else None
            target = None
            if alone and per_graph is not None:
                target = alone["graph_bytes"] + per_graph * (r["graphs"] - alone["graphs"])
            v = ref.get(r["order"])
            cap = f"{r['capture_s'] / v['capture_s']:6.2f}" if v and r is not v else "     -"
            step = f"{r['step_us'] / v['step_us']:6.3f}" if v and r is not v else "     -"
            print(f"{r['strategy']:8s} {r['order']:11s} {r['graphs']:6d} "
                  f"{_mib(r['graph_bytes'])} "
                  f"{r['graph_bytes'] / base if base else 0:7.2f} {_mib(r['pool_bytes'])} "
                  f"{_mib(r['outside_pool_bytes'])} "
                  f"{r['graph_bytes'] / target if target else 0:8.3f} "
                  f"{r['capture_s']:8.2f} {cap} {r['step_us']:8.1f} {step} "
                  f"{len(r['wrong']):5d}")
        for r in vmm_rows:
            print(f"  vmm {r['order']}: physical pool {_mib(r['physical_bytes']).strip()} MiB "
                  f"= {r['physical_bytes'] / r['largest_space_bytes']:.3f}x the largest "
                  f"space's own bytes ({_mib(r['largest_space_bytes']).strip()} MiB); "
                  f"{r['handles']} handle(s)")
        if per_graph is not None:
            print(f"  memory outside every pool (graph executables), measured: "
                  f"{per_graph / 2**10:.0f} KiB per graph; 'x target' = graph memory / "
                  f"(largest size alone + that per extra graph)")


def _print_record_stream(rows) -> None:
    by = {r["strategy"]: r for r in rows if "error" not in r}
    print("\nrecord-stream: the MLP's gate on a side stream (record_stream), vmm GraphPool")
    for flag in ("off", "on"):
        r = by.get(flag)
        if r:
            print(f"  graph_capture_record_stream_reuse {flag:3s}: largest space "
                  f"{_mib(r['largest_space_bytes']).strip()} MiB, graph memory "
                  f"{_mib(r['graph_bytes']).strip()} MiB, {len(r['wrong'])} wrong")
    if "off" in by and "on" in by:
        saved = by["off"]["largest_space_bytes"] - by["on"]["largest_space_bytes"]
        print(f"  the flag saves {saved / 2**20:.1f} MiB of the largest space "
              f"({saved / max(1, by['off']['largest_space_bytes']):.1%})")
