"""``vmm-core bench --scenario exec-cache``: can graph executables be cached under a budget?

Once the pool is at max(shape), the executables are the largest term of graph memory
(a few hundred KiB per graph, thousands of graphs for a large model).  This experiment
keeps every *captured* graph (``keep_graph=True``: the capture does not instantiate) and
instantiates executables on demand, dropping the least recently replayed ones when their
bytes pass a budget.  It reports the executables' bytes, measured from the device's free
memory around instantiation, and what a miss costs (instantiate) against what it delays
(the replay), over a skewed request trace.

Three configurations, each in its own process, on whole graphs of the Llama stack in a
GraphPool (outputs kept):

* ``all``: every executable instantiated (what engines do today);
* ``budget``: executables made from the kept graphs and destroyed through the graph
  ops' ``executables()`` (CUDA: ``vmm_backends/cuda/graph_exec.py``) under a budget of
  :data:`BUDGET_FRACTION` of all of them (the framework can drop an executable only with
  its graph);
* ``update``: one executable for every size, pointed at the requested size's graph with
  the driver's executable update (``cuGraphExecUpdate``) whenever the size changes; where
  the driver refuses an update (the sizes' graphs differ in topology or kernels) a fresh
  executable replaces it, and the reasons are counted.  If every update goes through, the
  executables cost one graph's bytes, and the price is an update per size change.

It needs a backend whose graph ops offer ``executables()`` (CUDA today).  It offers no
API: the numbers decide whether GraphPool should.
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict

from .measure import open_device
from .models import LlamaStack
from .spec import BenchSpec
from .workload import check_options, llama_model, relative_error

__all__ = ["run_one_exec_cache", "print_exec_cache", "BUDGET_FRACTION", "request_trace",
           "hot_requests", "check_order"]

#: the budget of the ``budget`` configuration, as a fraction of all executables
BUDGET_FRACTION = 0.25
#: requests in the trace
REQUESTS = 2000


def request_trace(sizes, n: int, seed: int) -> list[int]:
    """``n`` batch sizes drawn with a Zipf-like skew (weight 1/rank over a shuffled order
    of ``sizes``): a few sizes are hot, most are rare, as decode batches under a varying
    load are."""
    rng = random.Random(seed)
    ranked = list(sizes)
    rng.shuffle(ranked)
    weights = [1.0 / (i + 1) for i in range(len(ranked))]
    return rng.choices(ranked, weights=weights, k=n)


def check_order(sizes, strategy: str) -> tuple[list[int], list[int]]:
    """The sizes served before the check against eager (unchecked) and the sizes checked,
    in order.  ``update`` first serves the largest size, so that each checked size is a
    size change: its launch runs an executable the driver updated (or, where it refused,
    made anew), never only the instantiation of the first size."""
    sizes = list(sizes)
    warm = sizes[-1:] if strategy == "update" and len(sizes) > 1 else []
    return warm, sizes


def hot_requests(trace, n: int = 50) -> list[int]:
    """The timed replays: up to ``n`` requests of ``trace``'s most requested size.
    Replayed twice, the second pass launches only an executable that every configuration
    keeps present (a budget keeps at least the one just launched), so its time is the
    replay a miss delays, and the rows compare (a mix of sizes would weigh each row's sizes
    apart; the first ``n`` of the trace would miss in a cache holding fewer sizes)."""
    size, count = Counter(trace).most_common(1)[0]
    return [size] * min(n, count)


class _ExecCache:
    """Executables of kept graphs, least recently launched dropped over ``budget``.

    ``executables`` is what the backend's graph ops return from ``executables()``."""

    def __init__(self, executables, budget: int, per_graph: float) -> None:
        self.executables, self.budget, self.per_graph = executables, budget, per_graph
        self.execs: OrderedDict = OrderedDict()
        self.hits = self.misses = self.evictions = 0
        self.instantiate_s: list[float] = []

    def launch(self, key, graph, stream: int) -> None:
        exe = self.execs.get(key)
        if exe is None:
            self.misses += 1
            t0 = time.perf_counter()
            exe = self.execs[key] = self.executables.instantiate(graph)
            self.instantiate_s.append(time.perf_counter() - t0)
            while len(self.execs) * self.per_graph > self.budget and len(self.execs) > 1:
                _, old = self.execs.popitem(last=False)
                self.executables.destroy(old)
                self.evictions += 1
        else:
            self.hits += 1
            self.execs.move_to_end(key)
        self.executables.launch(exe, stream)

    def close(self) -> None:
        for exe in self.execs.values():
            self.executables.destroy(exe)
        self.execs.clear()


class _OneExecutable:
    """One executable, updated to the graph of each requested size as sizes change."""

    def __init__(self, executables) -> None:
        self.executables = executables
        self.key = self.exe = None
        self.updates = 0
        self.refused: Counter = Counter()
        self.update_s: list[float] = []
        self.instantiate_s: list[float] = []

    def launch(self, key, graph, stream: int) -> None:
        if self.exe is None or key != self.key:
            reason = "no executable yet"
            if self.exe is not None:
                t0 = time.perf_counter()
                reason = self.executables.update(self.exe, graph)
                if reason is None:
                    self.update_s.append(time.perf_counter() - t0)
                    self.updates += 1
                else:
                    self.refused[reason] += 1
                    self.executables.destroy(self.exe)
                    self.exe = None
            if reason is not None:
                t0 = time.perf_counter()
                self.exe = self.executables.instantiate(graph)
                self.instantiate_s.append(time.perf_counter() - t0)
            self.key = key
        self.executables.launch(self.exe, stream)

    def close(self) -> None:
        if self.exe is not None:
            self.executables.destroy(self.exe)
            self.exe = None


def _us(name: str, seconds: list) -> dict:
    """``{name}_us_median`` and ``{name}_us_max`` of ``seconds`` (None when empty)."""
    ordered = sorted(seconds)
    return {f"{name}_us_median": 1e6 * ordered[len(ordered) // 2] if ordered else None,
            f"{name}_us_max": 1e6 * ordered[-1] if ordered else None}


def run_one_exec_cache(config: str, spec: BenchSpec) -> dict:
    """Child process: ``exec-cache:all:-``, ``exec-cache:budget:-`` or
    ``exec-cache:update:-``."""
    import torch

    import vmm_core

    _, strategy, _ = config.split(":")
    backend, ops, _, dev, memory = open_device(spec.backend)
    executables = ops.executables()
    if executables is None:
        raise RuntimeError(f"--scenario exec-cache needs a backend whose graph ops offer "
                           f"executables(); {backend.name!r} does not")
    sizes = sorted(set(spec.sizes))
    name = llama_model(spec.model.name, "exec-cache")
    model = LlamaStack(**check_options(name, spec.model.options), device=dev,
                       dtype=getattr(torch, spec.model.dtype), seed=spec.seed,
                       max_batch=max(sizes))
    pool = vmm_core.GraphPool(0, backend=backend, reads=())
    inputs = torch.zeros(max(sizes), model.hidden, device=dev, dtype=model.dtype)
    x_max = torch.randn(max(sizes), model.hidden, device=dev, dtype=model.dtype)
    model(x_max)
    pool.warmup(lambda: model(x_max))
    graphs, outputs = {}, {}
    for size in sorted(sizes, reverse=True):
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with pool.space(size) as handle, torch.no_grad():
            with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream):
                out = model(inputs[:size])
            pool.keep(out)
        graphs[size], outputs[size] = g, out
    pool.compact()
    stream = torch.cuda.current_stream(dev)
    trace = request_trace(sizes, REQUESTS, spec.seed)
    requests = {s: torch.randn(s, model.hidden, device=dev, dtype=model.dtype) for s in sizes}

    # the executables' bytes: instantiate every graph through the driver, read the
    # device's free memory around it, destroy them again
    before = memory.used_bytes()
    handles = [executables.instantiate(graphs[s]) for s in sizes]
    per_graph = (memory.used_bytes() - before) / len(sizes)
    for handle in handles:
        executables.destroy(handle)
    memory.used_bytes()
    # the cache counts in executables of the measured size; a reading that did not move
    # (mem_get_info steps by 2 MiB) still keeps BUDGET_FRACTION of them
    unit = per_graph if per_graph > 0 else 1.0
    cache: _ExecCache | _OneExecutable | None = None
    if strategy == "budget":
        cache = _ExecCache(executables, int(BUDGET_FRACTION * unit * len(sizes)), unit)
    elif strategy == "update":
        cache = _OneExecutable(executables)

    def serve(size: int):
        with pool.replaying(size):
            inputs[:size].copy_(requests[size])
            if cache is None:
                graphs[size].replay()  # instantiates on first replay
            else:
                cache.launch(size, graphs[size], stream.cuda_stream)
            return outputs[size].float()

    if cache is None:
        for s in sizes:
            graphs[s].instantiate()
    wrong = []
    # every size once, checked against eager; the updated executable is first made for
    # the largest size, so that every checked size (the smallest too) runs through an
    # update, not through the executable's own instantiation
    unchecked, checked = check_order(sizes, strategy)
    for s in unchecked:
        serve(s)
    for s in checked:
        err = relative_error(serve(s), model(requests[s]).float())
        if not err <= 0.02:
            wrong.append([s, err])
    torch.cuda.synchronize(dev)
    peak = memory.used_bytes()
    t0 = time.perf_counter()
    for s in trace:
        serve(s)
    torch.cuda.synchronize(dev)
    trace_s = time.perf_counter() - t0
    peak = max(peak, memory.used_bytes())
    # replay alone: the most requested size (the hot path a miss delays)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hot = hot_requests(trace)
    for s in hot:
        serve(s)
    start.record()
    for s in hot:
        serve(s)
    end.record()
    torch.cuda.synchronize(dev)
    record = {
        "scenario": "exec-cache", "strategy": strategy, "order": "-", "sizes": len(sizes),
        "graphs": len(sizes), "requests": len(trace),
        "exec_bytes_per_graph": per_graph, "used_bytes_after_trace": peak,
        "trace_s": trace_s, "replay_us": start.elapsed_time(end) * 1e3 / len(hot),
        "replay_size": hot[0],
        "wrong_graphs": wrong, "physical_bytes": pool.stats()["physical_bytes"],
        "model_description": f"{name}: {len(model.layers)} layers, hidden {model.hidden}, "
                             f"whole graphs",
        "torch": torch.__version__, "device": torch.cuda.get_device_name(dev),
    }
    if cache is not None:
        record.update(_us("instantiate", cache.instantiate_s))
        if isinstance(cache, _ExecCache):
            record.update({"budget_bytes": cache.budget, "hits": cache.hits,
                           "misses": cache.misses, "evictions": cache.evictions})
        else:
            record.update({"updates": cache.updates, "refused": dict(cache.refused),
                           "instantiations": len(cache.instantiate_s),
                           **_us("update", cache.update_s)})
        cache.close()
    return record


def print_exec_cache(rows) -> None:
    by = {r["strategy"]: r for r in rows if "error" not in r}
    print(f"executables instantiated on demand from kept graphs, least recently used "
          f"dropped over a budget of {BUDGET_FRACTION:.0%} of all; {REQUESTS} requests, "
          f"Zipf-like sizes")
    for name in ("all", "budget", "update"):
        r = by.get(name)
        if r is None:
            if any(x.get("strategy") == name for x in rows):
                print(f"  {name:6s}: FAILED")
            continue
        line = (f"  {name:6s}: {r['exec_bytes_per_graph'] / 1024:.0f} KiB per executable "
                f"(measured), device used after the trace {r['used_bytes_after_trace'] / 2**20:.0f}"
                f" MiB, trace {r['trace_s']:.2f} s, replay {r['replay_us']:.1f} us (size "
                f"{r.get('replay_size', '?')}), "
                f"{len(r['wrong_graphs'])} wrong")
        if name == "budget":
            line += (f"; {r['hits']} hits, {r['misses']} misses, {r['evictions']} dropped, "
                     f"instantiate median {r['instantiate_us_median'] or 0:.0f} us "
                     f"(max {r['instantiate_us_max'] or 0:.0f} us)")
        if name == "update":
            refused = ", ".join(f"{n} {why}" for why, n in r["refused"].items()) or "none"
            line += (f"; {r['updates']} updates (median {r['update_us_median'] or 0:.0f} us, "
                     f"max {r['update_us_max'] or 0:.0f} us), refused: {refused}, "
                     f"{r['instantiations']} instantiations")
        print(line)
    for name, what in (("budget", "the budget"), ("update", "one updated executable")):
        if "all" in by and name in by:
            saved = by["all"]["used_bytes_after_trace"] - by[name]["used_bytes_after_trace"]
            print(f"  {what} saves {saved / 2**20:.0f} MiB; the trace takes "
                  f"{by[name]['trace_s'] / by['all']['trace_s']:.2f}x as long")
