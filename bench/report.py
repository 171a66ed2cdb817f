"""Table, headline, JSON and picture over a list of configuration records.

Every graph benchmark (whole graphs per size, piecewise, families) reports through these
functions.  A *record* is one configuration, measured in its own process::

    {"strategy": "vmm", "order": "random",   # what ran; any strategy names
     "graphs": 51,                            # graphs captured
     "graph_bytes": ...,                      # device memory all graphs hold at the end
     "growth_bytes": [...],                   # the same after each capture (len == graphs)
     "growth_graphs": [...],                  # optional: graphs captured at each reading
     "pool_bytes": ...,                       # bytes in graph pools (vmm: physical pages)
     "default_pool_bytes": ...,               # caching allocator's default-pool growth
     "capture_s": ..., "replay_us": ...,
     "wrong_graphs": [[size, rel_err], ...], "worst_rel_err": ...}

plus any other keys a benchmark adds.  A record with an ``"error"`` key is a
configuration that failed; it is listed, never used in a ratio.  One strategy (``floor``,
by default ``"alone"``: the largest shape captured alone) is the limit every ratio is
taken against.  docs/json-schema.md documents the keys and units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import textwrap
from typing import Callable

from vmm_core.cli import EXIT_OUTPUT, CLIError

from .exec_policies import DEFAULT as DEFAULT_POLICY
from .exec_policies import is_default

__all__ = ["SCHEMA", "FLOOR", "LITTLE", "Column", "COLUMNS", "executable_bytes", "table",
           "summary", "headline", "document", "write_json", "save_json", "plot", "pyplot",
           "save_figure",
           "plot_path", "strategy_label", "executables_rows", "executables_table",
           "executables_headline"]

#: version of the JSON layout ``vmm-core bench --json`` writes
SCHEMA = "vmm_core.bench/1"
#: the strategy whose graph memory is the floor (largest shape captured alone)
FLOOR = "alone"
#: below this fraction, a saving is "little to gain"
LITTLE = 0.10
MIB = 2**20


def _ok(records) -> list[dict]:
    return [r for r in records if "error" not in r]


def _mib(n: float) -> str:
    return f"{n / MIB:.0f}" if abs(n) >= 100 * MIB else f"{n / MIB:.1f}"


def _size(n: float) -> str:
    return f"{n / MIB:.2f} MiB" if abs(n) >= MIB else f"{n / 1024:.0f} KiB"


def _pct(fraction: float) -> str:
    pct = abs(fraction) * 100
    return f"{pct:.0f}%" if pct >= 10 else f"{pct:.1f}%"


def executable_bytes(record: dict) -> int | None:
    """Bytes outside every pool: graph memory minus the graph pools and the default
    pool's growth (persistent buffers, workspaces).  What is left is held by the graph
    executables themselves.  None when the record has no pool measurement."""
    if record.get("pool_bytes") is None or "graph_bytes" not in record:
        return None
    return record["graph_bytes"] - record["pool_bytes"] - (record.get("default_pool_bytes") or 0)


def strategy_label(record: dict) -> str:
    """A record's strategy as tables, lines and pictures name it: with its graph
    executables policy where that is not the default (``vmm budget:50%+share``)."""
    name = str(record.get("strategy", "?"))
    policy = record.get("executables")
    return name if is_default(policy) else f"{name} {policy}"


def _floor(records, floor: str) -> dict | None:
    return next((r for r in _ok(records) if r["strategy"] == floor), None)


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of :func:`table`: the text of a record's cell, right-aligned, ``-``
    where the record has no such measurement.  ``cell(record, row)`` may compare with
    ``row.base`` (the floor's record) and ``row.same`` (the reference strategy's record
    of the same order; None for the floor and the reference itself)."""

    header: str  # "{reference}" stands for the reference strategy's name
    width: int
    cell: Callable[[dict, "_Row"], str]


@dataclasses.dataclass(frozen=True)
class _Row:
    base: dict | None
    same: dict | None


def _given(key: str, spec: str, scale: float = 1.0) -> Callable[[dict, _Row], str]:
    return lambda r, row: format(r[key] / scale, spec) if r.get(key) is not None else "-"


def _against_reference(key: str, spec: str) -> Callable[[dict, _Row], str]:
    return lambda r, row: format(r[key] / row.same[key], spec) \
        if row.same and row.same.get(key) else "-"


def _per_graph(r: dict, row: _Row) -> str:
    ex = executable_bytes(r)
    return _size(ex / r["graphs"]) if ex is not None and r.get("graphs") else "-"


def _x_floor(r: dict, row: _Row) -> str:
    base = row.base
    return f"{r['graph_bytes'] / base['graph_bytes']:.2f}" \
        if base and base["graph_bytes"] > 0 else "-"


def _max_err(r: dict, row: _Row) -> str:
    err = r.get("worst_rel_err")
    return f"{err:.1e}" if isinstance(err, (int, float)) else "-"


#: the columns after strategy and order; a new measurement is a key in the records and
#: a line here
COLUMNS = (
    Column("graphs", 6, lambda r, row: str(r["graphs"])),
    Column("MiB", 7, lambda r, row: f"{r['graph_bytes'] / MIB:.1f}"),
    Column("x floor", 7, _x_floor),
    Column("pool MiB", 8, _given("pool_bytes", ".1f", MIB)),
    # memory outside every pool, per graph (executable_bytes)
    Column("exec/graph", 10, _per_graph),
    # measured by instantiating graphs (measure.measure_executables), pool-independent
    Column("exe meas.", 9, lambda r, row: _size(r["exec_bytes_per_graph"])
           if r.get("exec_bytes_per_graph") is not None else "-"),
    # the executables a GraphPool owns at the end, estimated (- where torch keeps them)
    Column("exe MiB", 7, _given("exec_resident_bytes", ".1f", MIB)),
    Column("capture s", 9, lambda r, row: f"{r.get('capture_s', float('nan')):.2f}"),
    Column("x {reference}", 0, _against_reference("capture_s", ".2f")),
    # with --repeat: capture_s is the median run's, this the fastest and slowest run's
    Column("runs' s", 9, lambda r, row: f"{r['capture_s_runs'][0]:.2f}-"
           f"{r['capture_s_runs'][-1]:.2f}" if len(r.get("capture_s_runs") or []) > 1
           else "-"),
    Column("replay us", 9, _given("replay_us", ".1f")),
    Column("x {reference}", 0, _against_reference("replay_us", ".3f")),
    Column("switch ms", 9, _given("switch_ms_median", ".3f")),
    Column("wrong", 5, lambda r, row: str(len(r.get("wrong_graphs") or []))),
    Column("max err", 8, _max_err),
)


def table(records, *, floor: str = FLOOR, reference: str = "shared",
          header: str | None = None, columns=COLUMNS) -> str:
    """The result table: memory against the floor, time against ``reference`` (same
    order), the executables' share, correctness."""
    base = _floor(records, floor)
    ref = {r["order"]: r for r in _ok(records) if r["strategy"] == reference}
    sw = max([8] + [len(strategy_label(r)) for r in records])
    ow = max([5] + [len(str(r.get("order", "?"))) for r in records])
    heads = [c.header.format(reference=reference) for c in columns]
    widths = [max(c.width, len(h)) for c, h in zip(columns, heads)]
    lines = [header] if header else []
    lines.append(" ".join([f"{'strategy':{sw}s}", f"{'order':{ow}s}"]
                          + [f"{h:>{w}s}" for h, w in zip(heads, widths)]))
    for r in records:
        name, order = strategy_label(r), str(r.get("order", "?"))
        if "error" in r:
            last = (r["error"].strip().splitlines() or [""])[-1]
            lines.append(f"{name:{sw}s} {order:{ow}s} FAILED: {last[:100]}")
            continue
        is_floor = r["strategy"] == floor
        same = ref.get(r["order"]) if not is_floor and r["strategy"] != reference else None
        row = _Row(base, same)
        lines.append(" ".join([f"{name:{sw}s}", f"{('-' if is_floor else order):{ow}s}"]
                              + [f"{c.cell(r, row):>{w}s}" for c, w in zip(columns, widths)]))
    return "\n".join(lines)


def summary(records, *, vmm: str = "vmm", shared=("shared",), floor: str = FLOOR) -> dict:
    """The numbers behind the headline (also written to the JSON)."""
    ok = _ok(records)
    base = _floor(records, floor)
    # graph memory after the captures: the default policy's (a budget makes executables
    # at replay; executables_rows compares the policies after a serving trace)
    mine = [r for r in ok if r["strategy"] == vmm and is_default(r.get("executables"))]
    theirs = sorted((r for r in ok if r["strategy"] in shared), key=lambda r: r["graph_bytes"])
    out: dict = {"floor_bytes": base["graph_bytes"] if base else None,
                 "vmm_bytes": None, "vmm_bytes_min": None, "best_shared": None,
                 "worst_shared": None, "saving_fraction": None, "verdict": None,
                 "executable": None,
                 "wrong": [{"strategy": strategy_label(r), "order": r["order"],
                            "graphs": len(r["wrong_graphs"]),
                            "worst_rel_err": r.get("worst_rel_err")}
                           for r in ok if r.get("wrong_graphs")],
                 "failed": [{"strategy": strategy_label(r), "order": r.get("order")}
                            for r in records if "error" in r]}
    if mine:
        out["vmm_bytes"] = max(r["graph_bytes"] for r in mine)
        out["vmm_bytes_min"] = min(r["graph_bytes"] for r in mine)
    if theirs:
        def pick(r):
            return {"strategy": r["strategy"], "order": r["order"],
                    "graph_bytes": r["graph_bytes"]}
        out["best_shared"], out["worst_shared"] = pick(theirs[0]), pick(theirs[-1])
    if mine and theirs and theirs[0]["graph_bytes"] > 0:
        saving = 1 - out["vmm_bytes"] / theirs[0]["graph_bytes"]
        out["saving_fraction"] = saving
        out["verdict"] = "nothing" if saving <= 0 else "little" if saving < LITTLE else "saves"
    probed = [r["exec_bytes_per_graph"] for r in ok
              if r.get("exec_bytes_per_graph") is not None]
    if probed:  # engine-runner scenarios: executables measured by instantiating graphs
        out["executable_measured"] = {"bytes_per_graph_min": min(probed),
                                      "bytes_per_graph_max": max(probed),
                                      "configurations": len(probed)}
    measured = [(r, executable_bytes(r)) for r in mine]
    measured = [(r, b) for r, b in measured if b is not None and r.get("graphs")]
    if measured:
        r, b = max(measured, key=lambda rb: rb[0]["graph_bytes"])
        per = [b2 / r2["graphs"] for r2, b2 in measured]
        out["executable"] = {"bytes_per_graph": b / r["graphs"],
                             "bytes_per_graph_min": min(per), "bytes_per_graph_max": max(per),
                             "total_bytes": b, "graphs": r["graphs"], "order": r["order"],
                             "graph_bytes": r["graph_bytes"], "pool_bytes": r["pool_bytes"],
                             "default_pool_bytes": r.get("default_pool_bytes")}
    return out


def headline(records, *, model: str, vmm: str = "vmm", shared=("shared",),
             floor: str = FLOOR) -> list[str]:
    """Plain sentences for under the table: what vmm saves against the best shared-pool
    order of this run (even when it is little), the memory outside every pool, and any
    wrong or failed configuration."""
    s = summary(records, vmm=vmm, shared=shared, floor=floor)
    out = []
    best, worst = s["best_shared"], s["worst_shared"]

    def where(r):
        name = f"{r['strategy']}, " if len(tuple(shared)) > 1 else ""
        return f"{name}{r['order']}, {_mib(r['graph_bytes'])} MiB"

    if s["vmm_bytes"] is None:
        out.append(f"{model}: no vmm configuration ran, so there is nothing to compare.")
    elif best is None:
        out.append(f"{model}: vmm holds {_mib(s['vmm_bytes'])} MiB; no shared-pool "
                   f"configuration ran to compare it with.")
    elif s["saving_fraction"] is None:
        out.append(f"{model}: vmm holds {_mib(s['vmm_bytes'])} MiB and the best shared-pool "
                   f"order ({where(best)}) no measurable memory, so there is no ratio.")
    else:
        held = _mib(s["vmm_bytes"])
        spread = s["vmm_bytes"] - s["vmm_bytes_min"]
        held = f"{held} MiB" + ("" if spread <= s["vmm_bytes"] * 0.01 else
                                f" (its most over the orders; least {_mib(s['vmm_bytes_min'])}"
                                f" MiB)")
        saving = s["saving_fraction"]
        compare = f"{_pct(saving)} {'less' if saving > 0 else 'more'} than the best " \
                  f"shared-pool order ({where(best)})"
        if saving == 0:
            compare = f"the same as the best shared-pool order ({where(best)})"
        if s["verdict"] == "saves":
            verdict = f"it saves {_mib(best['graph_bytes'] - s['vmm_bytes'])} MiB there and " \
                      f"{_mib(worst['graph_bytes'] - s['vmm_bytes'])} MiB against the worst " \
                      f"order ({where(worst)})"
        elif s["verdict"] == "little":
            verdict = "little to gain for this model"
        else:
            verdict = "nothing to gain for this model"
        floor_note = f" (largest shape alone: {_mib(s['floor_bytes'])} MiB)" \
            if s["floor_bytes"] is not None else ""
        out.append(f"{model}: vmm holds {held}, {compare}: {verdict}{floor_note}.")
    split = capture_split(records, vmm=vmm, shared=shared)
    if split:
        out.append(split)
    e = s["executable"]
    if e is not None:
        per = _size(e["bytes_per_graph"])
        lo, hi = e["bytes_per_graph_min"], e["bytes_per_graph_max"]
        if hi - lo > 0.05 * max(abs(hi), 1):
            per = f"{_size(lo)} to {_size(hi)}"
        how = f"vmm's graph memory ({_mib(e['graph_bytes'])} MiB, {e['order']}) minus its " \
              f"physical pool ({_mib(e['pool_bytes'])} MiB)"
        if e["default_pool_bytes"] is not None:
            how += f" and the default pool's growth ({_mib(e['default_pool_bytes'])} MiB: " \
                   f"persistent inputs and outputs, library workspaces)"
        else:
            how += " (this still includes the persistent input and output buffers: the " \
                   "framework's allocator snapshot could not tell the pools apart)"
        out.append(f"Outside every pool the graph executables hold {per} per graph "
                   f"({_mib(e['total_bytes'])} MiB for {e['graphs']} graphs), measured as "
                   f"{how}; a budget on GraphPool's executables bounds them (--executables, "
                   f"docs/executables.md).")
    m = s.get("executable_measured")
    if m is not None:
        lo, hi = m["bytes_per_graph_min"], m["bytes_per_graph_max"]
        per = _size(lo) if hi - lo <= 0.05 * max(abs(hi), 1) else f"{_size(lo)} to {_size(hi)}"
        out.append(f"Instantiating captured graphs (keep_graph=True, then instantiate(); "
                   f"device free memory before and after, no pool accounting) measured "
                   f"{per} per graph executable over {m['configurations']} configuration(s).")
    for w in s["wrong"]:
        out.append(f"WRONG RESULTS: {w['strategy']} {w['order']}: {w['graphs']} graph(s) "
                   f"differ from eager (worst relative error {w['worst_rel_err']:.2g}).")
    for f in s["failed"]:
        out.append(f"FAILED: {f['strategy']} {f['order']} did not finish; its error is "
                   f"above.")
    return out


def capture_split(records, *, vmm: str = "vmm", shared=("shared",)) -> str | None:
    """A sentence splitting each order's capture time, vmm's against a shared pool's, into
    the eager warm-ups (the function run once on every new size before its capture, which
    both do), the captures themselves, and the rest (entering and leaving the spaces, the
    trims): most of a decode capture is the warm-ups.
    None where no order has both records with their phases."""
    ok = _ok(records)
    parts = []
    for r in ok:
        if r["strategy"] != vmm:
            continue
        peer = next((p for p in ok if p["strategy"] in tuple(shared)
                     and p["order"] == r["order"]), None)
        mine, theirs = _phases(r), None if peer is None else _phases(peer)
        if mine and theirs:
            parts.append(f"{r['order']} {mine} s against {theirs} s")
    if not parts:
        return None
    return (f"Capture time as warm-ups + captures + the rest (entering and leaving spaces, "
            f"trims), {vmm} against the shared pool: {'; '.join(parts)}.")


def _phases(r: dict) -> str | None:
    phases, total = r.get("phase_ms") or {}, r.get("capture_s")
    if "warmup" not in phases or "capture" not in phases or total is None:
        return None
    warm, capture = phases["warmup"] / 1e3, phases["capture"] / 1e3
    return f"{warm:.2f} + {capture:.2f} + {max(0.0, total - warm - capture):.2f}"


#: what :func:`executables_rows` copies from a record
_SERVED_KEYS = ("served_graph_bytes", "served_exec_bytes", "exec_resident",
                "exec_resident_bytes", "exec_framework_replayed", "step_us_median",
                "step_us_mean", "trace", "trace_steps", "trace_step_gap_ms", "trace_hits",
                "trace_misses", "trace_updates", "trace_evictions", "trace_prepared_ahead",
                "trace_unused_ahead", "trace_waits", "trace_cold_blocks", "trace_wrong",
                "trace_recaptures",
                "sleep_released", "sleep_released_bytes", "sleep_driver_free_change",
                "wake_ratio_max", "wake_eager_ratio_max", "wake_eager_ms", "wake_eager_made",
                "wake_recaptures", "graphs", "capture_s")


def executables_rows(records, *, reference: str = "vllm", floor: str = FLOOR) -> list[dict]:
    """One row per configuration that replayed the serving trace (the engine-runner
    scenarios): its graph memory after the trace against the ``reference`` strategy's
    (same order where it ran in it, else its first), its step time against the same
    strategy's ``all`` policy in the same order, and what the executables did.  Every
    ratio is of two records of one run."""
    ok = [r for r in _ok(records)
          if r.get("served_graph_bytes") is not None and r["strategy"] != floor]
    refs: dict = {}
    for r in ok:
        if r["strategy"] == reference:
            refs.setdefault(r["order"], r)
    first_ref = next(iter(refs.values()), None)
    alls = {(r["strategy"], r["order"]): r for r in ok
            if r.get("executables") == DEFAULT_POLICY}

    def ratio(a, b):
        return a / b if a is not None and b else None

    rows = []
    for r in ok:
        ref = refs.get(r["order"], first_ref)
        base = alls.get((r["strategy"], r["order"]))
        row = {"strategy": r["strategy"], "order": r["order"],
               "executables": r.get("executables"),
               **{k: r.get(k) for k in _SERVED_KEYS},
               "reference": f"{ref['strategy']} {ref['order']}" if ref else None,
               "x_reference": ratio(r["served_graph_bytes"],
                                    ref["served_graph_bytes"] if ref else None),
               "step_median_x_all": ratio(r.get("step_us_median"),
                                          base.get("step_us_median") if base else None),
               "step_mean_x_all": ratio(r.get("step_us_mean"),
                                        base.get("step_us_mean") if base else None),
               "capture_x_reference": ratio(r.get("capture_s"),
                                            ref.get("capture_s") if ref else None)}
        rows.append(row)
    return rows


def _cell(value, spec: str, scale: float | None = None) -> str:
    return "-" if value is None else format(value / scale if scale else value, spec)


def executables_table(rows) -> str:
    """The table of :func:`executables_rows`."""
    heads = [("strategy", 0), ("order", 0), ("MiB", 7), ("x ref", 6), ("exe", 5),
             ("exe MiB", 7), ("torch's", 7), ("outside", 7), ("step us", 8), ("x all", 6),
             ("mean us", 8), ("x all", 6), ("misses", 6), ("updates", 7), ("evict", 6),
             ("slept", 5), ("wake x", 6), ("eager x", 7), ("recapt", 6)]
    names = [strategy_label(r) for r in rows]
    sw = max([8] + [len(n) for n in names])
    ow = max([5] + [len(str(r["order"])) for r in rows])
    widths = [sw, ow] + [max(w, len(h)) for h, w in heads[2:]]
    reference = next((r["reference"] for r in rows if r.get("reference")), None)
    steps = next((r["trace_steps"] for r in rows if r.get("trace_steps")), "?")
    trace = next((r["trace"] for r in rows if r.get("trace")), "zipf")
    gap = next((r["trace_step_gap_ms"] for r in rows if r.get("trace_step_gap_ms")), 0)
    legend = (f"graph executables after a serving trace of {steps} steps ({trace} sizes"
              + (f", {gap:g} ms of untimed host time after each" if gap else "") + "): "
              f"MiB = graph memory then (drop of free memory since before the first "
              f"capture); x ref = against {reference or 'the reference'}; exe, exe MiB = "
              f"executables the pool owns (estimated bytes); torch's = graphs the pool "
              f"leaves on torch's replay and executable (an operator that may draw random "
              f"numbers); outside = memory outside every pool then (the driver's view of "
              f"the executables); step = one forward, synchronized, median and mean, x all "
              f"= against the same strategy with every executable resident; slept = "
              f"executables a sleep released; wake x = the slowest first replay after a "
              f"lazy wake against a warm one; eager x = the same after wake_up(eager=True), "
              f"which makes the executables resident at the sleep again before it returns")
    header = " ".join(f"{h:<{w}s}" if i < 2 else f"{h:>{w}s}"
                      for i, ((h, _), w) in enumerate(zip(heads, widths)))
    lines = textwrap.wrap(legend, 100) + [header]
    for name, r in zip(names, rows):
        cells = [_cell(r["served_graph_bytes"], ".1f", MIB), _cell(r["x_reference"], ".2f"),
                 _cell(r["exec_resident"], "d"), _cell(r["exec_resident_bytes"], ".1f", MIB),
                 _cell(r["exec_framework_replayed"], "d"),
                 _cell(r["served_exec_bytes"], ".1f", MIB), _cell(r["step_us_median"], ".0f"),
                 _cell(r["step_median_x_all"], ".3f"), _cell(r["step_us_mean"], ".0f"),
                 _cell(r["step_mean_x_all"], ".3f"), _cell(r["trace_misses"], "d"),
                 _cell(r["trace_updates"], "d"), _cell(r["trace_evictions"], "d"),
                 _cell(r["sleep_released"], "d"), _cell(r["wake_ratio_max"], ".2f"),
                 _cell(r.get("wake_eager_ratio_max"), ".2f"), _cell(r["wake_recaptures"], "d")]
        lines.append(" ".join([f"{name:{sw}s}", f"{r['order']:{ow}s}"]
                              + [f"{c:>{w}s}" for c, w in zip(cells, widths[2:])]))
    return "\n".join(lines)


def executables_headline(rows) -> list[str]:
    """One sentence per GraphPool configuration whose policy is not ``all``: its graph
    memory after the trace against the reference, its step time against ``all``, its
    misses, and what its sleep released and its wake cost."""
    out = []
    for r in rows:
        if is_default(r["executables"]):
            continue
        line = (f"{strategy_label(r)} {r['order']}: graph memory after the trace "
                f"{_mib(r['served_graph_bytes'])} MiB")
        if r["x_reference"] is not None:
            line += f", {r['x_reference']:.2f}x {r['reference']}"
        if r["step_median_x_all"] is not None and r["step_mean_x_all"] is not None:
            line += (f"; a step {r['step_median_x_all']:.3f}x (median) and "
                     f"{r['step_mean_x_all']:.3f}x (mean) the same strategy with every "
                     f"executable resident")
        if r["trace_misses"] is not None:
            line += (f"; {r['trace_misses']} misses, {r['trace_updates']} updates, "
                     f"{r['trace_evictions']} evictions in {r['trace_steps']} steps")
        if r["sleep_released"] is not None:
            change = r["sleep_driver_free_change"]
            line += (f"; sleep released {r['sleep_released']} executables "
                     f"({_mib(r['sleep_released_bytes'] or 0)} MiB estimated"
                     + (f", the driver's free memory {change / MIB:+.1f} MiB"
                        if change is not None else "") + ")")
        if r["wake_ratio_max"] is not None:
            line += (f"; the first replay after a lazy wake took at most "
                     f"{r['wake_ratio_max']:.2f}x a warm one")
            if r.get("wake_eager_ratio_max") is not None:
                line += (f", after an eager wake (which made {r['wake_eager_made']} "
                         f"executables in {r['wake_eager_ms']:.0f} ms) "
                         f"{r['wake_eager_ratio_max']:.2f}x")
            line += f", {r['wake_recaptures']} recaptures"
        out.append(line + ".")
    return out


def document(*, kind: str, model: dict, records: list[dict], ok: bool, vmm: str = "vmm",
             shared=("shared",), floor: str = FLOOR, **meta) -> dict:
    """The JSON document of one run: run metadata, the records, summary and headline."""
    name = model.get("name", "model") if isinstance(model, dict) else str(model)
    return {"schema": SCHEMA, "kind": kind, "model": model, **meta,
            "floor_strategy": floor, "records": records,
            "summary": summary(records, vmm=vmm, shared=shared, floor=floor),
            "headline": headline(records, model=name, vmm=vmm, shared=shared, floor=floor),
            "ok": ok}


def _finite(obj):
    """JSON for scripts: NaN and inf (an exploded relative error) become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(doc: dict, path: str) -> None:
    """Write ``doc`` whole or not at all: the rl bench rewrites its file after every
    strategy, so a run stopped by a time limit mid-write (or a value that cannot be
    written) must leave the previous document, not a truncated one.  A path that is not
    a plain file (``/dev/stdout``, a symlink, a pipe) is written in place.  A path that
    takes no bytes at the end of a run (a full disk, ``/dev/full``) is the one-line
    ``--json`` error (exit status 4): the results are on the screen above it."""
    text = json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n"
    try:
        _write_whole(text, path)
    except OSError as exc:
        raise CLIError(f"--json {path}: cannot be written ({exc.strerror or exc}); the "
                       f"results are printed above", EXIT_OUTPUT) from None


def _write_whole(text: str, path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    plain = not os.path.islink(path) and (not os.path.exists(path) or os.path.isfile(path))
    try:
        fh = open(tmp, "x") if plain else None
    except OSError:  # a folder this process may not create files in
        fh = None
    if fh is None:
        with open(path, "w") as out:
            out.write(text)
        return
    try:
        with fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def save_json(doc: dict, path: str) -> None:
    """:func:`write_json`, then say where (the run's last line)."""
    write_json(doc, path)
    print(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot drawing into files (the Agg backend), or None without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: str, dpi: int) -> None:
    """Lay ``fig`` out, write it to ``path`` (its format from the suffix, PNG without one)
    and close it.  Drawn into memory first and written here: matplotlib's own writer lets
    a failed write pass silently.  A path that takes no bytes at the end of a run is the
    one-line ``--plot`` error (exit status 4), as for --json."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        image = io.BytesIO()
        fig.savefig(image, dpi=dpi, format=os.path.splitext(path)[1].lstrip(".") or "png")
        with open(path, "wb") as out:
            out.write(image.getvalue())
    except OSError as exc:
        raise CLIError(f"--plot {path}: cannot be written ({exc.strerror or exc}); the "
                       f"results are printed above", EXIT_OUTPUT) from None
    finally:
        plt.close(fig)


def plot_path(path: str, suffix: str) -> str:
    """``out.png`` -> ``out-SUFFIX.png``: one picture per scenario of one --plot."""
    root, ext = os.path.splitext(path)
    return f"{root}-{suffix}{ext or '.png'}"


_LINESTYLES = {"ascending": "-", "descending": "--", "random": ":"}


def plot(records, path: str, *, title: str, floor: str = FLOOR) -> bool:
    """One PNG, two panels: graph memory as graphs are captured (one line per strategy
    and order, the floor drawn level), and the final bars with values and ratios.
    Returns False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ok = _ok(records)
    base = _floor(records, floor)
    runs = [r for r in ok if r["strategy"] != floor]
    strategies = list(dict.fromkeys(strategy_label(r) for r in runs))
    palette = plt.get_cmap("tab10")
    color = {s: palette(i % 10) for i, s in enumerate(strategies)}
    fig, (grow, bars) = plt.subplots(1, 2, figsize=(15, 5.6),
                                     gridspec_kw={"width_ratios": [1.1, 1]})
    shown = ([base] if base else []) + runs
    values = [r["graph_bytes"] / MIB for r in shown]
    log = bool(values) and min(values) > 0  # else nothing measurable: no log scale
    for r in runs:
        # a non-positive reading has no place on a log scale: leave a gap
        ys = [b / MIB if b > 0 or not log else float("nan") for b in r.get("growth_bytes") or []]
        if ys:  # readings after every capture, or after each group of them
            xs = r.get("growth_graphs") or range(1, len(ys) + 1)
            grow.plot(xs, ys, color=color[strategy_label(r)],
                      linestyle=_LINESTYLES.get(r["order"], "-."), linewidth=1.6,
                      label=f"{strategy_label(r)} {r['order']}")
    if base:
        for ax in (grow, bars):
            ax.axhline(base["graph_bytes"] / MIB, color="0.35", linestyle=(0, (4, 3)),
                       linewidth=1.2, zorder=0,
                       label=f"largest shape alone ({_mib(base['graph_bytes'])} MiB)"
                       if ax is grow else None)
    grow.set_xlabel("graphs captured")
    grow.set_ylabel("device memory held by the graphs (MiB)")
    grow.set_title("graph memory as graphs are captured")
    grow.legend(fontsize=8, ncol=2)

    xs = range(len(shown))
    bars.bar(xs, values, color=[color.get(strategy_label(r), "0.6") for r in shown],
             edgecolor="black", linewidth=0.5)
    for x, r, v in zip(xs, shown, values):
        text = f"{v:.0f} MiB" if v >= 10 else f"{v:.1f} MiB"
        if base and base["graph_bytes"] > 0:
            text += f"\n{r['graph_bytes'] / base['graph_bytes']:.2f}x"
        if r.get("wrong_graphs"):
            text += f"\n{len(r['wrong_graphs'])} WRONG"
        bars.annotate(text, (x, v), xytext=(0, 3), textcoords="offset points",
                      ha="center", va="bottom", fontsize=7)
    bars.set_xticks(list(xs))
    bars.set_xticklabels(["largest\nalone" if r is base
                          else f"{strategy_label(r)}\n{r['order']}"
                          for r in shown], fontsize=7)
    bars.set_ylabel("MiB (ratio: against the largest shape alone)")
    bars.set_title("after all captures")
    for ax in (grow, bars):
        if not log:
            ax.grid(axis="y", alpha=0.25)
            continue
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(axis="y", which="both", alpha=0.25)
    if log:
        bars.set_ylim(min(values) * 0.7, max(values) * 1.6)
    fig.suptitle(title, fontsize=11)
    save_figure(fig, path, dpi=130)
    return True
