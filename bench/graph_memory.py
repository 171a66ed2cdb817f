"""The device benchmark: graph memory of one model at many batch sizes, by strategy.

Each configuration (the largest size captured alone, then every strategy in every order)
runs in a fresh process, so no pool, workspace or cache of one run leaks into the next.
The child captures one graph at a time and reads device memory after each (the growth
curve), then checks every graph against eager in a shuffled order on fresh inputs, then
times replays.  The parent prints the table and the headline and writes the picture and
the JSON (:mod:`.report`).
"""

from __future__ import annotations

import random

from . import report
from .children import run_configurations
from .measure import GrowthRecorder, measure_executables, open_device, ordered
from .progress import child_bar
from .serving import resident_keys
from .spec import BenchSpec
from .torch_pools import BASELINES
from .workload import (
    EXIT_BAD_MODEL,
    check_options,
    fresh_inputs,
    load_workload,
    relative_error,
    resolve_factory,
)

__all__ = ["run_device_bench", "run_child", "run_one", "WRONG_ABOVE"]

#: relative error above which a graph counts as wrong (bf16 graphs vs eager are ~1e-3;
#: the aliasing hazard gave 0.30)
WRONG_ABOVE = 0.02

#: the configuration every ratio is taken against: the largest size captured alone
FLOOR_CONFIG = f"{report.FLOOR}:largest"


def run_one(config: str, spec: BenchSpec) -> dict:
    """Child process: one ``strategy:order`` configuration on the device."""
    import torch

    import vmm_core

    strategy, order = config.split(":")
    backend, ops, mod, dev, memory = open_device(spec.backend)
    sizes = sorted(set(spec.sizes))
    max_n = max(sizes)
    name = spec.model.named("mlp")
    workload = load_workload(name, device=dev, dtype=getattr(torch, spec.model.dtype),
                             max_batch=max_n, seed=spec.seed, options=spec.model.options)
    forward = spec.child is not None and spec.child.forward_progress
    alone = strategy == report.FLOOR
    buckets = [max_n] if alone else sizes
    capture_order = buckets if alone else ordered(buckets, order, spec.seed)
    label = f"{strategy} {order}"

    # the floor and the peers are plain torch graphs (the benchmark's own pools, which
    # leave the executables to torch); vmm is GraphPool's, owning its executables
    reuse = "private" if alone else strategy
    if reuse in BASELINES:
        ex = vmm_core.GraphExecutor(workload.fn, workload.inputs, buckets=buckets,
                                    pool=BASELINES[reuse](ops.device, backend=backend))
    else:
        ex = vmm_core.GraphExecutor(workload.fn, workload.inputs, buckets=buckets,
                                    reuse=reuse, backend=backend)
    with torch.no_grad():
        workload.fn(*workload.inputs)  # library handles and default-stream workspaces exist
        # ... and the capture stream's: per-stream library state (cuBLAS, cuDNN handles and
        # workspaces) is paid once per stream, not per graph (measured: 70 MiB for Llama)
        ex.pool.warmup(lambda: workload.fn(*workload.inputs))
    recorder = GrowthRecorder(memory.used_bytes, ops.synchronize)  # the baseline reading
    segments_before = memory.segment_bytes()
    with child_bar(len(buckets), f"{label}: capture", forward=forward,
                   quiet=spec.output.quiet) as bar, torch.no_grad():  # inference, as engines run
        for b in capture_order:
            recorder.capture(lambda b=b: ex.capture_all([b]))
            bar.update()
    segments_after = memory.segment_bytes()  # settled by the last reading

    # correctness: every graph, shuffled, fresh inputs, against eager
    check = list(buckets)
    random.Random(spec.seed + 1).shuffle(check)
    worst, wrong = 0.0, []
    with child_bar(len(check), f"{label}: check against eager", forward=forward,
                   quiet=spec.output.quiet) as bar, torch.no_grad():
        for b in check:
            n = b if b < 3 else random.Random(b).randint(b // 2 + 1, b)
            x = fresh_inputs(workload.inputs, n, seed=spec.seed * 100003 + b)
            got = ex(*x)
            err = relative_error(got, workload.fn(*x))
            worst = err if err != err else max(worst, err)
            if not err <= WRONG_ABOVE:
                wrong.append((b, err))
            bar.update()

    # replay time: every bucket, several rounds, device time between events
    inputs = {b: fresh_inputs(workload.inputs, b, seed=b) for b in buckets}
    start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
    rounds = 5
    with torch.no_grad():
        for b in buckets:
            ex(*inputs[b])
        mod.synchronize()
        start.record()
        for _ in range(rounds):
            for b in buckets:
                ex(*inputs[b])
        end.record()
    mod.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / (rounds * len(buckets))

    # the executables, measured apart from any pool accounting: instantiate fresh captures
    per_graph = measure_executables(ops, lambda: [lambda: workload.fn(*workload.inputs)],
                                    memory)
    stats = ex.stats()
    alloc = ex.allocator
    switches = sorted(alloc.switch_seconds) if alloc else []
    pool_bytes = default_bytes = None
    if segments_before is not None and segments_after is not None:
        default_bytes = segments_after["default"] - segments_before["default"]
        pool_bytes = segments_after["pools"] - segments_before["pools"]
    if alloc is not None:  # vmm: the pool segments are virtual; the pages are the pool
        pool_bytes = alloc.physical_bytes
    return {
        "strategy": strategy, "order": order, "graphs": len(buckets),
        "capture_order": capture_order,
        "graph_bytes": recorder.total_bytes, "growth_bytes": recorder.growth_bytes,
        "pool_bytes": pool_bytes, "default_pool_bytes": default_bytes,
        "exec_bytes_per_graph": per_graph, **resident_keys([ex.pool]),
        "capture_s": recorder.capture_s, "probe_s": recorder.probe_s,
        "replay_us": replay_us, "wrong_graphs": wrong, "worst_rel_err": worst,
        "physical_bytes": stats["physical_bytes"], "handles": stats["handles"],
        "switch_ms_median": 1e3 * switches[len(switches) // 2] if switches else None,
        "switch_ms_max": 1e3 * switches[-1] if switches else None,
        "compact_ms_total": 1e3 * stats["compact_seconds"],
        "phase_ms": {k: 1e3 * v for k, v in stats["phase_seconds"].items()},
        "space_bytes": stats["space_bytes"], "fallback": stats["fallback"],
        "reserved_bytes": mod.memory_reserved(dev),
        "model_description": workload.description,
        "torch": torch.__version__, "device": mod.get_device_name(dev),
    }


def _done_line(r: dict) -> str:
    return (f"  done {r['strategy']} {r['order']}: {r['graph_bytes'] / 2**20:.0f} MiB, "
            f"{len(r['wrong_graphs'])} wrong, capture {r['capture_s']:.2f} s")


def run_child(spec: BenchSpec) -> tuple[dict, bool]:
    """Child process: the record of ``spec.child``'s configuration, and whether every
    graph matched eager."""
    assert spec.child is not None
    record = run_one(spec.child.config, spec)
    return record, not record["wrong_graphs"]


def run_device_bench(spec: BenchSpec, backend) -> dict:
    model = spec.model.named("mlp")
    resolve_factory(model)  # a bad spec or option fails here, once, not in every child
    check_options(model, spec.model.options)
    sizes = list(spec.sizes)
    configs = [FLOOR_CONFIG] + [f"{m}:{o}" for m in spec.decode.modes for o in spec.orders]
    runs = []
    for config in configs:
        strategy, order = config.split(":")
        runs.append(({"strategy": strategy, "order": order},
                     spec.child_argv(config, backend.name, model=model)))
    records = run_configurations(runs, quiet=spec.output.quiet, describe=_done_line,
                                 bad_config_exit=EXIT_BAD_MODEL, repeat=spec.repeat)
    first = next((r for r in records if "error" not in r), {})
    device, torch_version = first.get("device", "?"), first.get("torch", "?")
    description = first.get("model_description", model)
    print(report.table(records, header=(
        f"\n{device}, torch {torch_version}, backend {backend.name}; model: {description}; "
        f"{len(sizes)} sizes {min(sizes)}..{max(sizes)}.\ngraph memory = drop of "
        f"mem_get_info free bytes from before the first capture (caching allocator emptied "
        f"before every reading); exec/graph = memory outside every pool, per graph")))
    ok = bool(first) and all("error" not in r and not r["wrong_graphs"] for r in records)
    doc = report.document(kind="graph-memory", records=records, ok=ok,
                          model={"name": model, "description": description,
                                 "dtype": spec.model.dtype,
                                 "options": dict(spec.model.options)},
                          backend=backend.name, device=device, torch=torch_version,
                          sizes=sizes)
    print()
    for sentence in doc["headline"]:
        print(sentence)
    plot = spec.output.plot
    if plot:
        title = f"{model}: {description}\n{len(sizes)} sizes on {device}, torch {torch_version}"
        if report.plot(records, plot, title=title):
            print(f"wrote {plot}")
        else:
            print("--plot: matplotlib is not installed: pip install 'vmm_core[bench]'")
    return doc
