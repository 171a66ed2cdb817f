"""What serving traffic costs under an executables policy, and what a sleep gives back.

After an engine-runner child has captured and checked its graphs (:mod:`.piecewise`),
two measurements, both read through GraphPool's own counters
(``stats()["executables"]``):

* :func:`serve_trace`: a replay trace shaped like serving traffic, each step a whole
  forward of one batch size (every graph of the size in order, with the eager attention
  between pieces), the sizes drawn by one of :data:`TRACES` (:func:`request_trace`):
  ``uniform`` (any size alike: a stress test), ``zipf`` (a Zipf-like skew, a few sizes
  hot, most rare) or ``drift`` (a random walk over the sizes, as a batch under
  continuous batching changes by a little per step).  Each step is timed from a
  synchronized device to a synchronized device, as a decode step ends in the sampled
  tokens on the host, so a miss (an instantiation or an update on the host) is in the
  step's time whatever the device was doing.  An engine that knows its next batch size
  says so while the step runs (``hint``: ``GraphPool.expect``), as vLLM's scheduler
  picks the next batch while the device runs the current one.  Some steps are checked
  against eager on fresh inputs, untimed.
* :func:`sleep_check`: ``vmm_core.sleep`` of the pool's tag, what the executables' part
  of it released (count, estimated bytes, the driver's free-memory change), a lazy wake,
  then the first replay of a few sizes (which maps the space again and makes its
  executables again) against a warm replay of the same size, every result checked
  against eager, the runner's captures counted (a wake must recapture nothing).

The callables come from the child, so this module knows nothing of runners or models:
``serve(size, x=None)`` runs one step at ``size`` (its fixed request, or ``x``) and
returns the output copied out; ``fresh(size)`` makes a fresh input served by ``size``;
``eager(x)`` computes the reference; ``hint(size)``, where given, tells the pools the
next step's size.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter

from .workload import relative_error

__all__ = ["request_trace", "StepClock", "exec_counts", "resident_keys", "serve_trace",
           "serve_traces", "sleep_check", "wake_sizes", "TRACE_STEPS", "TRACES", "CHECK_EVERY",
           "COUNTED"]

#: steps of each serving trace when --trace-steps is not given
TRACE_STEPS = 300
#: the serving traces (--trace), in the order a configuration replays them
TRACES = ("uniform", "zipf", "drift")
#: every this many steps of the trace one (untimed) step is checked against eager
CHECK_EVERY = 20
#: the counters of ``stats()["executables"]`` a trace reports as its deltas
COUNTED = ("hits", "misses", "instantiations", "updates", "evictions", "prepared_ahead",
           "unused_ahead", "waits", "cold_blocks")


def request_trace(sizes, n: int, seed: int, kind: str = "zipf") -> list[int]:
    """``n`` batch sizes of ``sizes``: ``zipf`` draws with a Zipf-like skew (weight 1/rank
    over a shuffled order of ``sizes``: a few sizes hot, most rare, as decode batches
    under a varying load are); ``uniform`` draws any size alike; ``drift`` walks from the
    middle size one size down, one up or none (twice as likely) per step."""
    rng = random.Random(seed)
    ordered = sorted(sizes)
    if kind == "uniform":
        return [rng.choice(ordered) for _ in range(n)]
    if kind == "drift":
        i, out = len(ordered) // 2, []
        for _ in range(n):
            i = min(len(ordered) - 1, max(0, i + rng.choice((-1, 0, 0, 1))))
            out.append(ordered[i])
        return out
    if kind != "zipf":
        raise ValueError(f"unknown trace {kind!r}; choose from {', '.join(TRACES)}")
    ranked = list(sizes)
    rng.shuffle(ranked)
    weights = [1.0 / (i + 1) for i in range(len(ranked))]
    return rng.choices(ranked, weights=weights, k=n)


class StepClock:
    """Wall time of ``fn()`` from a synchronized device to a synchronized device."""

    def __init__(self, synchronize) -> None:
        self._synchronize = synchronize

    def time(self, fn) -> tuple[float, object]:
        """``(seconds, what fn returned)``."""
        self._synchronize()
        t0 = time.perf_counter()
        out = fn()
        self._synchronize()
        return time.perf_counter() - t0, out


def exec_counts(pools) -> dict | None:
    """The executables counters summed over ``pools`` (each pool once), or None where
    no pool owns its executables (the framework's, as the peers keep them)."""
    stats = [s for s in (p.stats()["executables"] for p in dict.fromkeys(pools))
             if s is not None]
    if not stats:
        return None
    keys = COUNTED + ("resident", "resident_bytes", "peak_resident", "peak_resident_bytes",
                      "graphs", "framework_replayed", "released_on_sleep",
                      "released_on_sleep_bytes", "wait_seconds", "eager_instantiations")
    out = {k: sum(s[k] for s in stats) for k in keys}
    out["update_refused"] = dict(sum((Counter(s["update_refused"]) for s in stats),
                                     Counter()))
    out["policy"] = [s["policy"] for s in stats]
    return out


def resident_keys(pools) -> dict:
    """A record's ``exec_*`` keys: the executables ``pools`` own now (estimated bytes),
    their peak, the graphs that kept the framework's replay (they draw random numbers,
    or hold an operator tagged so: attention with a dropout argument is), and each
    pool's policy; None where the framework keeps every executable."""
    counts = exec_counts(pools)
    keys = ("graphs", "resident", "resident_bytes", "peak_resident", "peak_resident_bytes",
            "framework_replayed", "update_refused", "policy")
    return {f"exec_{k}": None if counts is None else counts[k] for k in keys}


def _us(seconds: float) -> float:
    return seconds * 1e6


def _check(serve, fresh, eager, size: int, wrong_above: float) -> tuple[float, bool]:
    x = fresh(size)
    err = relative_error(serve(size, x), eager(x))
    return err, err <= wrong_above


def serve_trace(serve, fresh, eager, sizes, *, pools, steps: int, seed: int,
                clock: StepClock, wrong_above: float, check_every: int = CHECK_EVERY,
                label: str = "", kind: str = "zipf", hint=None, gap_s: float = 0.0) -> dict:
    """Replay ``steps`` steps of :func:`request_trace` (``kind``) over ``sizes``; every
    ``check_every``-th step is followed by an untimed step of the same size on a fresh
    input, compared with eager.  With ``hint``, each timed step names the next step's
    size once its own work is launched.  ``gap_s``: untimed host time after each step
    (after its check), the engine's own work between two forwards.  The record keys
    ``trace_*`` and ``step_us_*``."""
    trace = request_trace(sizes, steps, seed + 11, kind)
    before = exec_counts(pools)
    times, wrong, checked, worst = [], [], 0, 0.0
    for i, size in enumerate(trace):
        after_it = trace[i + 1] if hint is not None and i + 1 < len(trace) else None

        def step(size=size, after_it=after_it):
            out = serve(size)
            if after_it is not None:
                hint(after_it)
            return out

        seconds, _ = clock.time(step)
        times.append(seconds)
        if i % check_every == 0:
            if after_it is not None:
                hint(size)  # the checked step repeats this size, then the trace goes on
            err, ok = _check(serve, fresh, eager, size, wrong_above)
            if after_it is not None:
                hint(after_it)
            checked += 1
            worst = max(worst, err)
            if not ok:
                wrong.append([f"{label}{size} (trace step {i})", err])
        if gap_s:
            time.sleep(gap_s)
    after = exec_counts(pools)
    record = {"trace": kind, "trace_steps": len(trace), "trace_sizes": len(set(trace)),
              "trace_step_gap_ms": 1e3 * gap_s,
              "step_us_median": _us(statistics.median(times)),
              "step_us_mean": _us(statistics.fmean(times)),
              "step_us_max": _us(max(times)),
              "trace_checked": checked, "trace_wrong": wrong, "trace_worst_rel_err": worst}
    for key in COUNTED + ("wait_seconds",):
        record[f"trace_{key}"] = None if after is None else after[key] - before[key]
    return record


def serve_traces(serve, fresh, eager, sizes, *, kinds, captures, after, label: str = "",
                 **options) -> dict:
    """:func:`serve_trace` of each trace of ``kinds`` in turn (``options`` as there):
    trace -> its record, with ``trace_recaptures`` (graphs ``captures()`` counted during
    it) and what ``after(record)`` adds once it ends.  The keys of the first trace are
    the ones a record carries at its top (the report of one trace reads them)."""
    out = {}
    for kind in kinds:
        captured = captures()
        record = serve_trace(serve, fresh, eager, sizes, kind=kind, label=f"{label}{kind} ",
                             **options)
        record["trace_recaptures"] = captures() - captured
        after(record)
        out[kind] = record
    return out


def wake_sizes(sizes, n: int = 4) -> list[int]:
    """The sizes whose first replay after a wake is timed: spread over ``sizes`` (the
    smallest, the largest and between), at most ``n``."""
    ordered = sorted(set(sizes))
    if len(ordered) <= n:
        return ordered
    picks = [ordered[round(i * (len(ordered) - 1) / (n - 1))] for i in range(n)]
    return list(dict.fromkeys(picks))


def sleep_check(tag: str, serve, fresh, eager, sizes, *, pools, clock: StepClock,
                used_bytes, captures, wrong_above: float, warm_rounds: int = 3,
                label: str = "", hint=None) -> dict:
    """Serve each of ``sizes`` ``warm_rounds`` times (the engine's last steps before it
    sleeps: those sizes are in the working set the sleep releases), sleep ``tag`` and read
    what was released, then two wakes, each followed by the first replay of every size
    against the median of ``warm_rounds`` warm replays of it: a lazy wake (``wake_*``:
    each space mapped, each executable made, by its first replay) and, after a second
    sleep, an eager one (``wake_eager_*``: ``wake_up(eager=True)`` makes again the
    executables resident at the sleep before it returns; its own time is
    ``wake_eager_ms``; the sizes in reverse order, the one served last first).  With
    ``hint``, each first replay starts by naming its own size (no time ahead of it)."""
    import vmm_core

    unique = list(dict.fromkeys(pools))
    for size in sizes:
        for _ in range(warm_rounds):
            serve(size)
    used_before = used_bytes()
    vmm_core.sleep(tag)
    used_asleep = used_bytes()
    owned = [s for s in (p.stats()["executables"] for p in unique) if s is not None]
    slept = [s["last_sleep"] for s in owned if s["last_sleep"] is not None]
    changes = [s["driver_free_change"] for s in slept if s["driver_free_change"] is not None]
    captured = captures()
    wrong: list = []
    # lazy: each space is mapped, each executable made, on replay
    lazy_s, _ = clock.time(lambda: vmm_core.wake_up(tag))
    rows, worst = _first_replays(serve, fresh, eager, sizes, pools=pools, clock=clock,
                                 wrong_above=wrong_above, warm_rounds=warm_rounds,
                                 label=label, hint=hint, wrong=wrong, after="wake")
    vmm_core.sleep(tag)
    before = exec_counts(pools)
    eager_s, _ = clock.time(lambda: vmm_core.wake_up(tag, eager=True))
    made = exec_counts(pools)
    # the size served last first: under a budget smaller than these sizes' graphs it is
    # the one surely resident at the sleep
    eager_rows, eager_worst = _first_replays(
        serve, fresh, eager, list(reversed(sizes)), pools=pools, clock=clock,
        wrong_above=wrong_above, warm_rounds=warm_rounds, label=label, hint=hint,
        wrong=wrong, after="eager wake")
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    eager_ratios = [r["ratio"] for r in eager_rows if r["ratio"] is not None]
    return {
        "sleep_released": sum(s["executables"] for s in slept) if owned else None,
        "sleep_released_bytes": sum(s["bytes"] for s in slept) if owned else None,
        "sleep_driver_free_change": sum(changes) if changes else None,
        "sleep_freed_bytes": used_before - used_asleep,
        "wake_ms": 1e3 * lazy_s,
        "wake_replays": rows, "wake_ratio_max": max(ratios) if ratios else None,
        "wake_eager_ms": 1e3 * eager_s, "wake_eager_replays": eager_rows,
        "wake_eager_made": None if made is None or before is None
        else made["eager_instantiations"] - before["eager_instantiations"],
        "wake_eager_ratio_max": max(eager_ratios) if eager_ratios else None,
        "wake_recaptures": captures() - captured,
        "wake_wrong": wrong, "wake_worst_rel_err": max(worst, eager_worst),
    }


def _first_replays(serve, fresh, eager, sizes, *, pools, clock: StepClock,
                   wrong_above: float, warm_rounds: int, label: str, hint, wrong: list,
                   after: str) -> tuple[list[dict], float]:
    """Per size, its first replay (checked against eager on a fresh input), then the
    median of ``warm_rounds`` warm ones, then one more check; appends to ``wrong``."""
    rows, worst = [], 0.0
    for size in sizes:
        x = fresh(size)
        before = exec_counts(pools)

        def first_step(size=size, x=x):
            if hint is not None:
                hint(size)
            return serve(size, x)

        first, out = clock.time(first_step)
        made = exec_counts(pools)
        err = relative_error(out, eager(x))
        worst = max(worst, err)
        if not err <= wrong_above:
            wrong.append([f"{label}{size} (first replay after the {after})", err])
        warm = statistics.median(clock.time(lambda size=size: serve(size))[0]
                                 for _ in range(warm_rounds))
        err, ok = _check(serve, fresh, eager, size, wrong_above)
        worst = max(worst, err)
        if not ok:
            wrong.append([f"{label}{size} (after the {after})", err])
        rows.append({"size": size, "first_us": _us(first), "warm_us": _us(warm),
                     "ratio": first / warm if warm > 0 else None,
                     **{key: None if made is None else made[key] - before[key]
                        for key in ("instantiations", "updates", "misses", "waits")}})
    return rows, worst
