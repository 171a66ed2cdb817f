"""Where a step under an executables budget spends its time: the Llama-3-8B piecewise shape
(the benchmark's runner and model, 51 sizes), one GraphPool per variant, each step timed
from a synchronized device to a synchronized device, with its host launch time, its
device time (events around it) and what the pool's thread did during it.

Variants (``VARIANTS``, a comma list; a ``-off`` suffix makes the budget never share by
update, otherwise it shares when full):

* ``all``: every executable resident (the reference; run it first and last: ``all2``);
* ``after``: a quarter of the executables, prepared ahead, the next size named to the
  pool (``GraphPool.expect``) once the step's launches are made, as the benchmark does;
* ``settled``: the same, then untimed until the thread is idle: the step pays nothing
  for preparing, only for the executables it runs (updated or made);
* ``ahead``: a quarter, prepared ahead with no hint (the forecast's bets);
* ``roomy``: a budget that holds every graph, prepared ahead (the budget's machinery,
  nothing evicted);
* ``inline``: a quarter, every miss served by the launching thread.

Each variant replays ``TRACES`` (``uniform``, ``zipf``, ``drift``; the benchmark's traces)
of ``STEPS`` steps after one warm step of every size, and prints median and mean step,
host and device time, and misses, waits, cold steps, updates and instantiations; the
last lines put each against ``all``.  ``OUT`` (a folder) gets every step's record.

    VARIANTS=all,settled,settled-off,after-off,all2 python3 scripts/probe_budget_steps.py
    DEV=cpu LAYERS=2 STEPS=4 python3 scripts/probe_budget_steps.py   # the host backend
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time

import torch

import vmm_core
from vmm_bench.measure import VLLM_DECODE_SIZES
from vmm_bench.models import LlamaStack
from vmm_bench.peers import DISCIPLINES
from vmm_bench.piecewise_runners import PiecewiseRunner
from vmm_bench.serving import request_trace

LAYERS = int(os.environ.get("LAYERS", "32"))
STEPS = int(os.environ.get("STEPS", "60"))
VARIANTS = os.environ.get("VARIANTS", "all,after,settled,ahead").split(",")
TRACES = os.environ.get("TRACES", "uniform").split(",")
DEV = os.environ.get("DEV", "cuda")
ON_CUDA = DEV == "cuda"
COUNTED = ("misses", "updates", "instantiations", "waits", "cold_blocks")


class _HostEvent:
    """A CUDA event's two calls, on the host clock (the host backend has no device)."""

    def __init__(self, **_) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def _sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


def _event():
    return torch.cuda.Event(enable_timing=True) if ON_CUDA else _HostEvent()


def _policy(variant: str, graphs: int):
    if variant.startswith("all"):
        return None
    if variant == "roomy":
        return vmm_core.ExecutablePolicy(max_count=graphs, share="when_full", ahead=True)
    return vmm_core.ExecutablePolicy(
        max_count=(graphs + 3) // 4, share="off" if variant.endswith("-off") else "when_full",
        ahead=not variant.startswith("inline"))


def run_trace(variant, kind, sizes, requests, runner, pool, cache, events) -> dict:
    base = variant.split("-")[0]
    hints = base in ("after", "settled", "roomy")
    trace = request_trace(sizes, STEPS + 10, 11, kind)
    e0, e1 = _event(), _event()
    rows = []
    for i, size in enumerate(trace):
        after_it = trace[i + 1] if i + 1 < len(trace) else None
        _sync()
        c0 = pool.stats()["executables"] if cache is not None else None
        events.clear()
        t0 = time.perf_counter()
        e0.record()
        runner(requests[size]).float()
        e1.record()
        t1 = time.perf_counter()
        if hints and after_it is not None:
            pool.expect(runner.key(after_it))
        _sync()
        t2 = time.perf_counter()
        if base in ("settled", "roomy"):
            pool.settle(10)
        c1 = pool.stats()["executables"] if cache is not None else None
        rows.append({"size": size, "host_us": (t1 - t0) * 1e6, "step_us": (t2 - t0) * 1e6,
                     "dev_us": e0.elapsed_time(e1) * 1e3,
                     **({k: c1[k] - c0[k] for k in COUNTED} if c0 else {}),
                     "prep": [(e[0], e[1], e[2], round((e[3] - t0) * 1e6),
                               round((e[4] - e[3]) * 1e6)) for e in events]})
    rows = rows[10:]

    def med(k):
        return statistics.median(r[k] for r in rows)

    return {"step_med": med("step_us"), "step_mean": statistics.fmean(r["step_us"]
                                                                      for r in rows),
            "host_med": med("host_us"), "dev_med": med("dev_us"),
            **{k: sum(r.get(k, 0) for r in rows) for k in COUNTED}, "rows": rows}


def watch(cache, events) -> None:
    """Record each driver job of the pool's executables (kind, thread, start, end)."""
    execute, upload_all = cache._execute, cache._upload_all

    def timed_execute(job, upload=None):
        a = time.perf_counter()
        execute(job, upload)
        events.append(("x", job.kind, threading.current_thread().name[:4], a,
                       time.perf_counter()))

    def timed_upload_all(jobs):
        a = time.perf_counter()
        upload_all(jobs)
        events.append(("u", len(jobs), threading.current_thread().name[:4], a,
                       time.perf_counter()))

    cache._execute, cache._upload_all = timed_execute, timed_upload_all


def main() -> None:
    sizes = sorted(VLLM_DECODE_SIZES) if ON_CUDA else sorted(VLLM_DECODE_SIZES)[:6]
    hidden = 4096 if ON_CUDA else 256
    model = LlamaStack(layers=LAYERS, hidden=hidden, ffn=14336 if ON_CUDA else 768,
                       heads=32 if ON_CUDA else 4, kv_heads=8 if ON_CUDA else 2, ctx=64,
                       max_batch=max(sizes), device=DEV,
                       dtype=torch.bfloat16 if ON_CUDA else torch.float32)
    requests = {s: torch.randn(s, hidden, device=DEV, dtype=model.dtype) for s in sizes}
    graphs = len(sizes) * model.num_pieces
    out = {}
    for variant in VARIANTS:
        if ON_CUDA:
            clocks = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,"
                                     "power.draw", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
            print(f"{variant}: GPU {clocks}", flush=True)
        kw = {} if ON_CUDA else {"backend": "host"}
        pool = vmm_core.GraphPool(0 if ON_CUDA else None, reuse="vmm", reads=(),
                                  executables=_policy(variant, graphs), **kw)
        x_max = torch.randn(max(sizes), hidden, device=DEV, dtype=model.dtype)
        model(x_max)
        pool.warmup(lambda x_max=x_max: model(x_max))
        runner = PiecewiseRunner(model, pool, sizes, DISCIPLINES["vmm"],
                                 **({} if ON_CUDA else {"weak_ref": lambda o: o}))
        t = time.perf_counter()
        for s in sizes:
            runner.capture(s)
        _sync()
        capture_s = time.perf_counter() - t
        cache, events = pool._executables, []
        if cache is not None:
            watch(cache, events)
        for s in sizes:  # every size once: eager operators' first calls, a full budget
            runner(requests[s])
            _sync()
            if cache is not None:
                pool.settle(10)
        for kind in TRACES:
            summary = run_trace(variant, kind, sizes, requests, runner, pool, cache, events)
            summary["capture_s"] = capture_s
            out[f"{variant} {kind}"] = summary
            shown = {k: round(v, 1) if isinstance(v, float) else v
                     for k, v in summary.items() if k != "rows"}
            print(variant, kind, json.dumps(shown), flush=True)
        pool.close()
        del runner, pool, cache
        _sync()
    for key, s in out.items():
        variant, kind = key.split()
        base = out.get(f"all {kind}")
        if base:
            print(f"{key:20s} step {s['step_med'] / base['step_med']:.3f}x median "
                  f"{s['step_mean'] / base['step_mean']:.3f}x mean; host {s['host_med']:.0f} "
                  f"us, device {s['dev_med']:.0f} us; misses {s['misses']} waits "
                  f"{s['waits']} cold {s['cold_blocks']} updates {s['updates']} "
                  f"instantiations {s['instantiations']}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "budget_steps.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
