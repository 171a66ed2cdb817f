"""``vmm-core bench --scenario piecewise|families|record-stream``: an engine's own runner.

Engines do not hand their model to our runner.  vLLM captures *piecewise* (the model is
split at attention; every piece is captured per batch size and attention runs eagerly in
between) and, in FULL_AND_PIECEWISE mode, keeps a second family of full graphs for the
same sizes, passing one ``graph_pool_handle()`` to every capture.  The runners below are
shaped like that; the only vmm_core lines in them are where the engine passes ``pool=``
(``pool.space(key)``) and before it launches a key's graphs (``pool.replaying(key)``).

Strategies compared on the same sizes and orders, each in a fresh process:

* ``vmm``: a :class:`vmm_core.GraphPool`, one virtual space per size (and per family);
  otherwise vLLM's runner (piece outputs kept, the last one a non-owning view);
* ``vllm``: one shared pool; intermediate piece outputs kept, the last piece's output
  turned into a non-owning view (vLLM's piecewise backend);
* ``sglang``: one shared pool, every output kept;
* ``private``: a private pool per graph;
* ``alone``: the largest size only, in one shared pool (the floor).

Every configuration checks every size against eager on fresh inputs after all captures.
"""

from __future__ import annotations

import os
import random

from ..graphs.shapes import pick_bucket
from . import report
from .children import emit_result, python_cli, run_configurations
from .measure import DeviceMemory, GrowthRecorder, ordered
from .progress import child_bar
from .workload import EXIT_BAD_MODEL, check_options, model_options

__all__ = ["PiecewiseRunner", "FullRunner", "run_piecewise_bench", "run_one_piecewise",
           "STRATEGIES", "SCENARIOS", "print_scenario"]

STRATEGIES = {
    "vmm": "GraphPool: a virtual space per size over shared pages",
    "vllm": "one shared pool; piece outputs kept, the last one a non-owning view (vLLM)",
    "sglang": "one shared pool; every output kept (SGLang)",
    "private": "a private pool per graph",
}
SCENARIOS = ("piecewise", "families", "record-stream", "rl")  # rl: bench/rl.py
#: relative error above which a size counts as wrong (bf16 graphs vs eager are ~1e-3)
WRONG_ABOVE = 0.02


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
            if last and self.last_output == "weak":
                # the owning tensors are dropped here, before the guard looks
                out = tuple(map(_non_owning, out)) if isinstance(out, tuple) else \
                    _non_owning(out)
            else:
                pool.keep(*(out if isinstance(out, tuple) else (out,)))
        return graph, out

    def __call__(self, x):
        n = x.shape[0]
        size = pick_bucket(self.sizes, n)
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
    memory = DeviceMemory(ops)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if strategy == report.FLOOR:
        sizes = [sizes[-1]]
    options = check_options("llama", model_options(args))
    model = LlamaStack(**options, device=dev, dtype=getattr(torch, args.dtype),
                       seed=args.seed, max_batch=max(sizes),
                       side_stream=scenario == "record-stream")
    families = ("full", "piecewise") if scenario == "families" else ("piecewise",)
    reuse = {"vmm": "vmm", "private": "private", "on": "vmm", "off": "vmm"}.get(strategy,
                                                                               "shared")
    # vmm runs vLLM's runner unchanged but for pool=: the last output a non-owning view
    last_output = "weak" if strategy in ("vllm", "vmm", report.FLOOR) else "keep"
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
    recorder = GrowthRecorder(memory.used_bytes, ops.synchronize)
    segments_before = memory.segment_bytes()
    growth_graphs = []
    rsr = ops.record_stream_reuse(strategy == "on")
    label = f"{scenario} {strategy} {order}"
    with rsr, child_bar(len(sizes), f"{label}: capture", forward=args.progress_lines,
                        quiet=args.quiet, unit="size") as bar:
        capture_order = ordered(sizes, order, args.seed)
        for i, size in enumerate(capture_order):
            def step(size=size, last=i == len(capture_order) - 1):
                for r in runners:
                    r.capture(size)
                if last:  # what the first replay does: merge what the captures added
                    for p in dict.fromkeys(pools.values()):
                        p.compact()
            recorder.capture(step)
            growth_graphs.append(sum(r.num_graphs for r in runners))
            bar.update()
    segments_after = memory.segment_bytes()
    alloc = pool.allocator
    default_pool = pool_bytes = None
    if segments_before is not None and segments_after is not None:
        default_pool = segments_after["default"] - segments_before["default"]
        pool_bytes = segments_after["pools"] - segments_before["pools"]
    if alloc is not None:  # the framework counts every space's segments: take the pages
        pool_bytes = alloc.physical_bytes

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
            wrong.append([f"{runner.family} {size}", err])

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
    stats = pool.stats()
    largest = max(p.stats()["largest_space_bytes"] for p in pools.values())
    return {
        "scenario": scenario, "strategy": strategy, "order": order, "sizes": len(sizes),
        "graphs": sum(r.num_graphs for r in runners), "graph_bytes": recorder.total_bytes,
        "growth_bytes": recorder.growth_bytes, "growth_graphs": growth_graphs,
        "pool_bytes": pool_bytes, "default_pool_bytes": default_pool,
        "largest_space_bytes": largest if alloc is not None else None,
        "physical_bytes": stats["physical_bytes"], "handles": stats["handles"],
        "capture_s": recorder.capture_s, "probe_s": recorder.probe_s,
        "replay_us": start.elapsed_time(end) * 1e3 / (rounds * len(sizes)),
        "wrong_graphs": wrong, "worst_rel_err": worst,
        "phase_ms": {k: 1e3 * v for k, v in stats["phase_seconds"].items()},
        "model_description": f"{len(model.layers)} transformers LlamaDecoderLayers, hidden "
                             f"{model.hidden}, {model.num_pieces} pieces per size",
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
        specs.append(f"{scenario}:{report.FLOOR}:ascending")
        specs += [f"{scenario}:{s}:{o}" for s in strategies for o in args.orders.split(",")]
    return specs


def _child_argv(args, backend, sizes, spec: str) -> list[str]:
    argv = python_cli() + ["bench", "--one", spec, "--scenario", spec.split(":")[0],
                           "--backend", backend.name, "--model", "llama",
                           "--dtype", args.dtype, "--seed", str(args.seed),
                           "--sizes", ",".join(map(str, sizes))]
    for name, value in model_options(args).items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def run_piecewise_bench(args, backend, sizes) -> dict:
    if getattr(args, "one", None):
        record = run_one_piecewise(args.one, args)
        emit_result(record)
        return {"ok": not record["wrong_graphs"], **record}
    check_options("llama", model_options(args))
    configs = []
    for spec in _specs(args):
        scenario, strategy, order = spec.split(":")
        configs.append(({"scenario": scenario, "strategy": strategy, "order": order},
                        _child_argv(args, backend, sizes, spec)))
    records = run_configurations(configs, quiet=args.quiet, bad_config_exit=EXIT_BAD_MODEL,
                                 describe=lambda r: f"  done {r['scenario']} {r['strategy']} "
                                                    f"{r['order']}: {r['graphs']} graphs, "
                                                    f"{r['graph_bytes'] / 2**20:.0f} MiB, "
                                                    f"{len(r['wrong_graphs'])} wrong")
    first = next((r for r in records if "error" not in r), {})
    device, torch_version = first.get("device", "?"), first.get("torch", "?")
    docs = {}
    # the largest key alone is the largest size's piecewise space: with families, its own
    # run (the families' floor holds both families of that size in one shared pool)
    key_alone = next((r for r in records if r["scenario"] == "piecewise"
                      and r["strategy"] == report.FLOOR and "error" not in r), None)
    for scenario in dict.fromkeys(r["scenario"] for r in records):
        rows = [r for r in records if r["scenario"] == scenario]
        print_scenario(scenario, rows, device, torch_version, first.get("model_description"),
                       key_alone=key_alone)
        ok = all("error" not in r and not r["wrong_graphs"] for r in rows)
        docs[scenario] = report.document(
            kind=scenario, records=rows, ok=ok, shared=("vllm", "sglang"),
            model={"name": "llama", "description": first.get("model_description"),
                   "dtype": args.dtype, "options": check_options("llama", model_options(args))},
            backend=backend.name, device=device, torch=torch_version, sizes=sizes)
        if scenario != "record-stream":
            for sentence in docs[scenario]["headline"]:
                print(sentence)
        if args.plot and scenario != "record-stream":
            root, ext = os.path.splitext(args.plot)
            path = f"{root}-{scenario}{ext or '.png'}"
            title = (f"llama {scenario}: {first.get('model_description')}\n{len(sizes)} sizes "
                     f"on {device}, torch {torch_version}")
            if report.plot(rows, path, title=title):
                print(f"wrote {path}")
    ok = bool(first) and all(d["ok"] for d in docs.values())
    return {"schema": report.SCHEMA, "kind": "engine-runner", "scenarios": docs, "ok": ok}


def _mib(n) -> str:
    return f"{n / 2**20:.1f}" if n is not None else "-"


def print_scenario(scenario, rows, device, torch_version, description,
                   key_alone=None) -> None:
    """The table, then per vmm order: the physical pool against the largest space, and
    graph memory against the target (largest key alone + the measured executables of
    every other graph).  ``key_alone`` is the largest key's own run, when the scenario's
    floor is not one key (families)."""
    print(f"\n{scenario}: {description}; {device}, torch {torch_version}")
    if scenario == "record-stream":
        _print_record_stream(rows)
        return
    print(report.table(rows, reference="vllm", header=(
        "graph memory = drop of mem_get_info free bytes from before the first capture; "
        "exec/graph = memory outside every pool, per graph")))
    ok = [r for r in rows if "error" not in r]
    alone = key_alone or next((r for r in ok if r["strategy"] == report.FLOOR), None)
    for r in (r for r in ok if r["strategy"] == "vmm"):
        line = (f"  vmm {r['order']}: physical pool {_mib(r['physical_bytes'])} MiB = "
                f"{r['physical_bytes'] / r['largest_space_bytes']:.3f}x the largest space's "
                f"own bytes ({_mib(r['largest_space_bytes'])} MiB), {r['handles']} handle(s)")
        ex, ex_alone = report.executable_bytes(r), report.executable_bytes(alone or {})
        if alone and ex is not None and ex_alone is not None and r["graphs"] > alone["graphs"]:
            per_graph = ex / r["graphs"]  # measured on the run with many graphs
            target = alone["graph_bytes"] + per_graph * (r["graphs"] - alone["graphs"])
            line += (f"; graph memory / (largest key alone, {_mib(alone['graph_bytes'])} MiB, "
                     f"+ executables of the other {r['graphs'] - alone['graphs']} graphs) = "
                     f"{r['graph_bytes'] / target:.3f}")
        print(line)


def _print_record_stream(rows) -> None:
    by = {r["strategy"]: r for r in rows if "error" not in r}
    print("the MLP's gate on a side stream (record_stream), vmm GraphPool, capture with "
          "graph_capture_record_stream_reuse off and on")
    for flag in ("off", "on"):
        r = by.get(flag)
        if r:
            print(f"  {flag:3s}: largest space {_mib(r['largest_space_bytes'])} MiB, graph "
                  f"memory {_mib(r['graph_bytes'])} MiB, {len(r['wrong_graphs'])} wrong")
        elif flag in {r.get("strategy") for r in rows}:
            print(f"  {flag:3s}: FAILED")
    if "off" in by and "on" in by:
        saved = by["off"]["largest_space_bytes"] - by["on"]["largest_space_bytes"]
        print(f"  the flag saves {saved / 2**20:.1f} MiB of the largest space "
              f"({saved / max(1, by['off']['largest_space_bytes']):.1%})")
