"""``vmm-core bench --scenario piecewise|families|whole|ondemand|record-stream``.

Engines do not hand their model to our runner.  vLLM captures *piecewise* (the model is
split at attention; every piece is captured per batch size and attention runs eagerly in
between) and, in FULL_AND_PIECEWISE mode, keeps a second family of full graphs for the
same sizes, passing one ``graph_pool_handle()`` to every capture; SGLang captures whole
graphs, largest first.  The runners (:mod:`.piecewise_runners`) are shaped like theirs;
the only vmm_core lines in them are where the engine passes ``pool=`` (``pool.space(key)``)
and before it launches a key's graphs (``pool.replaying(key)``).

Every strategy is a peer's *discipline* (:mod:`.peers`: which pool, which outputs stay
referenced), each naming the file and function it follows.  Scenarios:

* ``piecewise``: one graph per piece per size (vLLM PIECEWISE);
* ``families``: FULL then PIECEWISE graphs of every size in one pool (vLLM
  FULL_AND_PIECEWISE);
* ``whole``: one graph per size (SGLang's runner, vLLM FULL);
* ``ondemand``: whole graphs captured lazily as sizes first appear in a request trace,
  interleaved with replays of sizes already captured (SGLang/xLLM-style runners that
  capture on demand, our GraphExecutor);
* ``record-stream``: PyTorch PR 158352's case (:mod:`.record_stream`).

The floor (``alone``) is the largest size alone in one shared pool with the scenario's
cheapest faithful discipline.  Every configuration runs in a fresh process and checks every
size against eager on fresh inputs after all captures.

Every GraphPool strategy runs once per graph executables policy (``--executables``,
:mod:`.exec_policies`): its graphs come from ``pool.new_graph()`` and replay through the
pool's executables; the peers keep torch's.  Each configuration then replays a
serving-shaped trace and, for GraphPool, sleeps and wakes its graph memory
(:mod:`.serving`), so graph memory, step time and misses of each policy stand beside
vLLM's discipline and the same strategy's ``all`` in one run.
"""

from __future__ import annotations

import json
import os
import random

from . import report
from .children import run_configurations
from .exec_policies import FRAMEWORK, gives_hints, pool_executables
from .measure import GrowthRecorder, device_name, measure_executables, open_device, ordered
from .peers import DISCIPLINES, Discipline
from .piecewise_report import _done_line, _reference, print_scenario
from .piecewise_runners import FullRunner, PiecewiseRunner
from .progress import child_bar
from .serving import StepClock, resident_keys, serve_traces, sleep_check, wake_sizes
from .spec import BenchSpec
from .torch_pools import SharedTorchPool, make_pool
from .trace_report import trace_rows
from .workload import EXIT_BAD_MODEL, check_options, llama_model, relative_error

__all__ = ["run_piecewise_bench", "run_one_piecewise", "run_child", "configurations", "runs",
           "child_policy", "STRATEGIES", "SCENARIOS", "PEERS", "records_log_path",
           "space_accounting", "fresh_pools", "key_text"]  # the runners: .piecewise_runners

#: strategy name -> one line (the disciplines of :mod:`.peers`)
STRATEGIES = {name: d.what for name, d in DISCIPLINES.items()}
#: the shared-pool peers a vmm row is compared with in the headline
PEERS = ("vllm", "sglang", "keep")
SCENARIOS = ("piecewise", "families", "whole", "ondemand", "record-stream")
#: scenarios that capture one graph per size
WHOLE_SCENARIOS = ("whole", "ondemand")
#: scenarios whose configurations are fixed (not strategies x orders)
FIXED_CONFIGS = {"record-stream": ("torch-off", "torch-on", "vmm-off", "vmm-on")}
#: relative error above which a size counts as wrong (bf16 graphs vs eager are ~1e-3)
WRONG_ABOVE = 0.02


# ---------------------------------------------------------------------- one configuration
def _check_strategy(scenario: str, strategy: str) -> Discipline:
    if strategy == report.FLOOR:
        # the floor follows the scenario's cheapest faithful discipline
        return DISCIPLINES["sglang" if scenario in WHOLE_SCENARIOS else "vllm"]
    if strategy not in DISCIPLINES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from "
                         f"{', '.join(DISCIPLINES)}")
    d = DISCIPLINES[strategy]
    if d.whole_only and scenario not in WHOLE_SCENARIOS:
        raise ValueError(f"--strategies {strategy}: SGLang's CudaGraphRunner captures whole "
                         f"graphs; use it with --scenario {' or '.join(WHOLE_SCENARIOS)}")
    return d


def _trace(sizes, order: str, seed: int, scenario: str) -> list[tuple[int, list[int]]]:
    """``(new size, replays of sizes already captured)`` per step.  ``ondemand``: sizes
    appear as requests do (random first appearance), two replays of earlier sizes after
    each new one; otherwise the capture order and no replays."""
    if scenario != "ondemand":
        return [(s, []) for s in ordered(sizes, order, seed)]
    rng = random.Random(seed + 7)
    first = ordered(sizes, "random", seed)
    return [(s, [rng.choice(first[:i]) for _ in range(2)] if i else [])
            for i, s in enumerate(first)]


def child_policy(spec: BenchSpec, strategy: str) -> str:
    """The executables policy a child measures: its spec's one policy for a GraphPool
    strategy; torch's executables for the peers and the floor, as their engines keep."""
    if strategy == report.FLOOR or not DISCIPLINES[strategy].graph_pool:
        return FRAMEWORK
    if len(spec.engine.executables) != 1:
        raise ValueError(f"a child measures one --executables policy, got "
                         f"{','.join(spec.engine.executables)}")
    return spec.engine.executables[0]


def run_one_piecewise(config: str, spec: BenchSpec) -> dict:
    """Child process: one ``scenario:strategy:order`` configuration on the device (or on
    the host backend, whose graphs replay eagerly and whose executables are emulated:
    what the tests run)."""
    scenario = config.split(":")[0]
    if scenario == "record-stream":
        from .record_stream import run_one_record_stream

        return run_one_record_stream(config, spec)
    import torch

    from vmm_bench.models import LlamaStack

    scenario, strategy, order = config.split(":")
    discipline = _check_strategy(scenario, strategy)
    policy = child_policy(spec, strategy)
    backend, ops, mod, dev, memory = open_device(spec.backend)
    on_host = ops.device_type == "cpu"
    sizes = sorted(set(spec.sizes))
    all_sizes = sizes
    if strategy == report.FLOOR:
        sizes = [sizes[-1]]
    name = llama_model(spec.model.name, scenario)
    options = check_options(name, spec.model.options)
    model = LlamaStack(**options, device=dev, dtype=getattr(torch, spec.model.dtype),
                       seed=spec.seed, max_batch=max(sizes))
    families = ("full", "piecewise") if scenario == "families" else \
        ("full",) if scenario in WHOLE_SCENARIOS else ("piecewise",)
    # a CPU gives freed memory back to malloc, where a device pool keeps it for the graph
    # that wrote it: on the host the runners hold their outputs instead of views
    weak_ref = (lambda out: out) if on_host else None
    pools, runners = {}, []
    for family in families:
        first = next(iter(pools.values()), None)
        if discipline.reuse == "shared" and first is not None:
            pool = first  # one graph_pool_handle() for every family, as engines do
        else:
            graphs = len(sizes) * (model.num_pieces if family == "piecewise" else 1)
            pool = make_pool(discipline.reuse, 0, backend=backend, reads=(),
                             allocator=first.allocator if first else None,
                             executables=pool_executables(policy, graphs))
        pools[family] = pool
        cls = FullRunner if family == "full" else PiecewiseRunner
        runners.append(cls(model, pool, sizes, discipline, memory=memory, weak_ref=weak_ref))
    pool = pools[families[0]]
    # engines run warm-up forwards first: libraries create per-stream workspaces then
    x_max = torch.randn(max(sizes), model.hidden, device=dev, dtype=model.dtype)
    model(x_max)
    pool.warmup(lambda: model(x_max))
    requests = {s: torch.randn(s, model.hidden, device=dev, dtype=model.dtype) for s in sizes}
    recorder = GrowthRecorder(memory.used_bytes, ops.synchronize)
    segments_before = memory.segment_bytes()
    growth_graphs = []
    label = f"{scenario} {strategy} {order}" + ("" if policy == FRAMEWORK else f" {policy}")
    trace = _trace(sizes, order, spec.seed, scenario)
    # a step: which runners capture which size, then the replays that follow it.  vLLM's
    # FULL_AND_PIECEWISE captures every PIECEWISE size first, then every FULL size, into
    # the same pool (ARCHITECTURE.md, facts): families do the same
    by_family = {r.family: r for r in runners}
    if scenario == "families":
        plan = [([by_family[f]], size, []) for f in ("piecewise", "full") for size, _ in trace]
    else:
        plan = [(runners, size, replays) for size, replays in trace]
    forward = spec.child is not None and spec.child.forward_progress
    with child_bar(len(plan), f"{label}: capture", forward=forward,
                   quiet=spec.output.quiet, unit="step") as bar:
        for i, (these, size, replays) in enumerate(plan):
            def step(these=these, size=size, replays=replays, last=i == len(plan) - 1):
                for r in these:
                    if scenario == "ondemand":
                        r(requests[size])  # captured lazily by the request that needs it
                    else:
                        r.capture(size)
                for s in replays:
                    for r in these:
                        r(requests[s])
                if last:  # what the first replay does: merge what the captures added
                    for p in dict.fromkeys(pools.values()):
                        if p.allocator is not None:
                            p.compact()
            recorder.capture(step)
            growth_graphs.append(sum(r.num_graphs for r in runners))
            bar.update()
    segments_after = memory.segment_bytes()
    alloc = pool.allocator
    default_pool, pool_bytes = _pool_growth(segments_before, segments_after, alloc)

    # correctness: every size of every family, shuffled, fresh inputs, against eager; the
    # output is copied out (.float()) before another size replays, as the discipline asks
    checks = [(r, s) for r in runners for s in sizes] * 2
    random.Random(spec.seed + 1).shuffle(checks)
    worst, wrong = 0.0, []
    for runner, size in checks:
        x = _fresh(model, size)
        err = relative_error(runner(x).float(), model(x).float())
        worst = max(worst, err)
        if not err <= WRONG_ABOVE:
            wrong.append([f"{runner.family} {size}", err])

    # replay: a whole step (graphs and eager attention) per size, every size in turn
    runner = runners[-1]
    rounds = 3
    replay_us = _sweep_us(mod, on_host, lambda: [runner(requests[s]) for s in sizes],
                          rounds) / (rounds * len(sizes))

    # serving: a trace of steps over the sizes, then the graph memory it leaves; then
    # (GraphPool) a sleep and wake of the graph memory with the first replays after it
    def serve(size, x=None):
        return runner(requests[size] if x is None else x).float()

    def eager(x):
        return model(x).float()

    clock = StepClock(ops.synchronize)
    shown = f"{runner.family} "
    # the next step's size, named to the pool (GraphPool.expect; never to a peer's)
    hint = (lambda s: runner.pool.expect(runner.key(s))) if gives_hints(policy) else None
    served: dict = {}
    traces: dict = {}
    if strategy != report.FLOOR:  # the floor is one size: nothing to serve
        def after_trace(record: dict) -> None:  # graph memory, and what is outside pools
            record["served_graph_bytes"] = used = memory.used_bytes() - recorder.baseline
            record["served_exec_bytes"] = _outside_pools(used, segments_before,
                                                         memory.segment_bytes(), alloc)

        traces = serve_traces(serve, lambda s: _fresh(model, s), eager, sizes,
                              kinds=spec.engine.traces, pools=pools.values(),
                              steps=spec.engine.trace_steps, seed=spec.seed, clock=clock,
                              gap_s=spec.engine.step_gap_ms / 1e3,
                              wrong_above=WRONG_ABOVE, label=shown, hint=hint,
                              captures=lambda: sum(r.captures for r in runners),
                              after=after_trace)
        wrong += [w for part in traces.values() for w in part["trace_wrong"]]
        served = {**traces[spec.engine.traces[0]], "traces": traces}
    resident = resident_keys(pools.values())
    stats = pool.stats()  # before the sleep: a lazy wake maps each space on its replay
    largest = max(p.stats()["largest_space_bytes"] for p in pools.values())
    slept: dict = {}
    if alloc is not None and strategy != report.FLOOR:
        slept = sleep_check(pool.tag, serve, lambda s: _fresh(model, s), eager,
                            wake_sizes(sizes), pools=pools.values(), clock=clock,
                            used_bytes=memory.used_bytes,
                            captures=lambda: sum(r.captures for r in runners),
                            wrong_above=WRONG_ABOVE, label=shown, hint=hint)
    wrong += slept.pop("wake_wrong", [])
    for part in (*traces.values(), slept):
        worst = max(worst, part.get("trace_worst_rel_err") or 0.0,
                    part.get("wake_worst_rel_err") or 0.0)
    for p in dict.fromkeys(pools.values()):  # the probes below capture outside the pools
        getattr(p, "settle", lambda timeout: True)(60)

    graphs = sum(r.num_graphs for r in runners)
    # the executables, measured apart from any pool accounting (see measure.py)
    per_graph = measure_executables(ops, lambda: _forward_graphs(runners, max(sizes)),
                                    memory)
    extra: dict = {}
    if alloc is not None:
        extra["spaces"] = space_accounting(pools.values(), memory)
    if strategy == report.FLOOR and len(runners) == 1:
        # every size alone in a fresh pool of its own: the floor of each key's space
        fresh = fresh_pools(model, type(runners[0]), all_sizes, discipline, runners[0].ops,
                            memory, backend)
        if fresh is not None:
            extra["fresh_pool_bytes"] = {s: sum(segs) for s, segs in fresh.items()}
            extra["fresh_pool_segments"] = fresh
    return {
        **extra,
        "scenario": scenario, "strategy": strategy, "order": order, "sizes": len(sizes),
        "executables": policy,
        "graphs": graphs, "graph_bytes": recorder.total_bytes,
        "growth_bytes": recorder.growth_bytes, "growth_graphs": growth_graphs,
        "capture_order": [s for s, _ in trace],
        "pool_bytes": pool_bytes, "default_pool_bytes": default_pool,
        "largest_space_bytes": largest if alloc is not None else None,
        "physical_bytes": stats["physical_bytes"], "handles": stats["handles"],
        "exec_bytes_per_graph": per_graph,
        "capture_s": recorder.capture_s, "probe_s": recorder.probe_s,
        "replay_us": replay_us,
        **served, **resident, **slept,
        "wrong_graphs": wrong, "worst_rel_err": worst,
        "phase_ms": {k: 1e3 * v for k, v in stats["phase_seconds"].items()},
        "peer": discipline.source,
        "model_description": f"{name}: {len(model.layers)} transformers LlamaDecoderLayers, "
                             f"hidden {model.hidden}, {runners[-1].__class__.__name__} "
                             f"({len(runners[-1]._graph_fns())} graphs per size)",
        "torch": torch.__version__, "device": device_name(mod, dev),
    }


def _fresh(model, size: int):
    """Fresh random inputs served by bucket ``size`` (a partial batch above 2: padding)."""
    import torch

    n = size if size < 3 else random.Random(size).randint(size // 2 + 1, size)
    return torch.randn(n, model.hidden, device=model.device, dtype=model.dtype)


def _pool_growth(before, after, alloc) -> tuple[int | None, int | None]:
    """(default pool growth, bytes in graph pools) since ``before``: the caching
    allocator's segments where it tells pools apart, a vmm pool's physical pages."""
    default_pool = pool_bytes = None
    if before is not None and after is not None:
        default_pool = after["default"] - before["default"]
        pool_bytes = after["pools"] - before["pools"]
    if alloc is not None:  # the framework counts every space's segments: take the pages
        pool_bytes = alloc.physical_bytes
    return default_pool, pool_bytes


def _outside_pools(graph_bytes: int, before, now, alloc) -> int | None:
    """Of ``graph_bytes``, what lies outside every graph pool and the default pool's
    growth (the executables, as the driver's free memory sees them); None where the
    pools cannot be told apart."""
    default_pool, pool_bytes = _pool_growth(before, now, alloc)
    if pool_bytes is None:
        return None
    return graph_bytes - pool_bytes - (default_pool or 0)


def _sweep_us(mod, on_host: bool, sweep, rounds: int) -> float:
    """Microseconds of ``rounds`` calls of ``sweep()`` after one untimed: device time
    between events (the host: wall time to the end of the work)."""
    sweep()
    if on_host:
        seconds, _ = StepClock(mod.synchronize).time(lambda: [sweep() for _ in range(rounds)])
        return seconds * 1e6
    mod.synchronize()
    start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        sweep()
    end.record()
    mod.synchronize()
    return start.elapsed_time(end) * 1e3


def _forward_graphs(runners, size: int) -> list:
    """Callables of one forward's graphs at ``size`` (every family), for the
    executable probe: fresh captures of the same kernels."""
    import torch

    fns = []
    for r in runners:
        inputs = (r.inputs[:size],)
        for fn in r._graph_fns():
            fns.append(lambda fn=fn, inputs=inputs: fn(*inputs))
            with torch.no_grad():
                out = fn(*inputs)
            inputs = r._next_inputs(out) if isinstance(out, tuple) else ()
    return fns


def key_text(key) -> str:
    """A GraphPool key as JSON can hold it: ``("full", 464)`` -> ``"full:464"``."""
    return ":".join(map(str, key)) if isinstance(key, tuple) else str(key)


def space_accounting(pools, memory) -> dict:
    """Per key of every vmm pool: ``bytes``, what the space's bump cursor reached (what it
    asked the allocator for), and ``torch_segment_bytes``, the segments the framework's
    pool over that space holds now (where it can tell).  Equal: the framework never gave
    a segment back and asked again inside the space (the bump allocator would count
    both); the space then holds exactly what the framework's own pool for that key does.
    The largest space sets the physical pool, and it need not be the largest size's."""
    held = memory.pool_segments() if memory is not None else None
    out: dict = {}
    for pool in dict.fromkeys(pools):
        if pool.allocator is None:
            continue
        for key, space in list(pool._spaces.items()):  # the bench reads the pool's state
            entry: dict = {"bytes": space.nbytes}
            if held is not None and isinstance(space.handle, tuple):
                segments = held.get(tuple(space.handle), [])
                entry["torch_segment_bytes"] = sum(segments)
                entry["torch_segments"] = segments
            out[key_text(key)] = entry
    return out


def fresh_pools(model, runner_cls, sizes, discipline, ops, memory, backend) -> dict | None:
    """Per size: the segments (sizes, largest first) the framework's caching allocator
    reserves when that size alone is captured into a fresh ``graph_pool_handle()`` pool
    with the scenario's discipline (``{"464": [n, ...]}``), or None where segments cannot
    be read.

    A GraphPool space is a fresh pool too, so this is the floor of every key's space,
    taken on the framework's own pools.  It is not monotonic in the size: the caching
    allocator carves 1-10 MiB requests out of 20 MiB segments and rounds larger ones to
    2 MiB, so how well a size's blocks pack depends on the size (``get_allocation_size``,
    ``should_split`` in c10/cuda/CUDACachingAllocator.cpp).  ``ops`` must be the warmed
    ones (a cold capture stream would put the library workspace into the pool).  Each
    size's graphs are reset and its pool dropped before the next size."""

    if memory.pool_segments() is None:
        return None
    out = {}
    for size in sizes:
        memory.used_bytes()  # synchronize and empty the cache: the last pool is gone
        before = memory.pool_segments() or {}
        pool = SharedTorchPool(0, backend=backend)  # torch's own pool and graphs
        runner = runner_cls(model, pool, [size], discipline, ops=ops)
        try:
            runner.capture(size)
            ops.synchronize()
            after = memory.pool_segments() or {}
            new = [n for pid, segs in after.items() if pid not in before for n in segs]
            out[str(size)] = sorted(new, reverse=True)
        finally:
            for entries in runner.entries.values():
                for entry in entries:
                    ops.reset(entry.graph)
            runner.entries.clear()
            pool.close()
            del runner, pool
    memory.used_bytes()
    return out


# ---------------------------------------------------------------------- the parent
def configurations(spec: BenchSpec) -> list[str]:
    """The ``scenario:strategy:order`` configurations of ``spec``, one child each: the
    floor, then every strategy in every order (a fixed list for some scenarios)."""
    unknown = [s for s in spec.scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    strategies = list(spec.engine.strategies)
    bad = [s for s in strategies if s not in DISCIPLINES]
    if bad:
        raise ValueError(f"unknown strategies {bad}; choose from {', '.join(DISCIPLINES)}")
    configs = []
    for scenario in spec.scenarios:
        if scenario in FIXED_CONFIGS:
            configs += [f"{scenario}:{s}:-" for s in FIXED_CONFIGS[scenario]]
            continue
        mine = [s for s in strategies if not (DISCIPLINES[s].whole_only
                                              and scenario not in WHOLE_SCENARIOS)]
        if strategies and not mine:  # e.g. only sglang for piecewise: say so, run nothing
            _check_strategy(scenario, strategies[0])
        if scenario == "ondemand":  # the order is the request trace's
            configs.append(f"{scenario}:{report.FLOOR}:-")
            configs += [f"{scenario}:{s}:ondemand" for s in mine]
            continue
        configs.append(f"{scenario}:{report.FLOOR}:ascending")
        configs += [f"{scenario}:{s}:{o}" for s in mine for o in spec.orders]
    return configs


def runs(spec: BenchSpec) -> list[tuple[str, str]]:
    """``(configuration, executables policy)`` of every child of ``spec``: each GraphPool
    strategy once per ``--executables`` policy, the peers and the floor once with torch's
    executables."""
    out = []
    for config in configurations(spec):
        scenario, strategy, _ = config.split(":")
        if scenario in FIXED_CONFIGS or strategy == report.FLOOR \
                or not DISCIPLINES[strategy].graph_pool:
            out.append((config, FRAMEWORK))
        else:
            out += [(config, policy) for policy in spec.engine.executables]
    return out


def run_child(spec: BenchSpec) -> tuple[dict, bool]:
    """Child process: the record of ``spec.child``'s configuration, and whether every
    size matched eager."""
    assert spec.child is not None
    record = run_one_piecewise(spec.child.config, spec)
    return record, not record.get("wrong_graphs")


def run_piecewise_bench(spec: BenchSpec, backend) -> dict:
    name = llama_model(spec.model.name, spec.scenario)
    options = check_options(name, spec.model.options)
    sizes = list(spec.sizes)
    children = []
    for config, policy in runs(spec):
        scenario, strategy, order = config.split(":")
        identity = {"scenario": scenario, "strategy": strategy, "order": order,
                    "executables": policy}
        children.append((identity, spec.child_argv(config, backend.name, model=name,
                                                   scenario=scenario,
                                                   extra=spec.engine.argv(policy))))
    records = run_configurations(children, quiet=spec.output.quiet,
                                 bad_config_exit=EXIT_BAD_MODEL, describe=_done_line,
                                 on_record=_record_log(spec.output.json),
                                 repeat=spec.repeat)
    first = next((r for r in records if "error" not in r), {})
    device, torch_version = first.get("device", "?"), first.get("torch", "?")
    docs = {}
    # the largest key alone is the largest size's piecewise space: with families, its own
    # run (the families' floor holds both families of that size in one shared pool)
    key_alone = next((r for r in records if r["scenario"] == "piecewise"
                      and r["strategy"] == report.FLOOR and "error" not in r), None)
    for scenario in dict.fromkeys(r["scenario"] for r in records):
        rows = [r for r in records if r["scenario"] == scenario]
        description = next((r.get("model_description") for r in rows
                            if r.get("model_description")), None)
        print_scenario(scenario, rows, device, torch_version, description,
                       key_alone=key_alone if scenario == "families" else None)
        ok = all("error" not in r and not r.get("wrong_graphs") for r in rows)
        served = report.executables_rows(rows, reference=_reference(rows))
        by_trace = trace_rows(rows, _reference(rows))
        docs[scenario] = report.document(
            kind=scenario, records=rows, ok=ok, shared=PEERS,
            model={"name": name, "description": description, "dtype": spec.model.dtype,
                   "options": options},
            backend=backend.name, device=device, torch=torch_version, sizes=sizes,
            peers={s: DISCIPLINES[s].source for s in DISCIPLINES
                   if any(r.get("strategy") == s for r in rows)},
            executables=served, executables_traces=by_trace)
        if scenario not in FIXED_CONFIGS:
            for sentence in docs[scenario]["headline"] + report.executables_headline(served):
                print(sentence)
        if spec.output.plot and scenario not in FIXED_CONFIGS:
            path = report.plot_path(spec.output.plot, scenario)
            title = (f"{name} {scenario}: {description}\n{len(sizes)} sizes "
                     f"on {device}, torch {torch_version}")
            if report.plot(rows, path, title=title):
                print(f"wrote {path}")
    ok = bool(first) and all(d["ok"] for d in docs.values())
    return {"schema": report.SCHEMA, "kind": "engine-runner", "scenarios": docs, "ok": ok}


def records_log_path(json_path: str) -> str:
    """Where each configuration's record is appended as it ends: ``X.json`` ->
    ``X.records.jsonl``.  A run stopped from outside (a device call's time limit) never
    writes its ``--json``; the records of the configurations that finished are here."""
    return os.path.splitext(json_path)[0] + ".records.jsonl"


def _record_log(json_path):
    if not json_path:
        return None
    path = records_log_path(json_path)
    open(path, "w").close()  # this run's records only

    def append(record: dict) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps(report._finite(record), allow_nan=False) + "\n")
    return append
