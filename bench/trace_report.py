"""The engine-runner scenarios' graph executables, per serving trace, against the targets.

A configuration replays every trace of ``--trace`` in turn (uniform, Zipf, drift) and keeps
each one's numbers under its record's ``traces``; the keys of the first also stand at the
top of the record.  Here each trace gets the rows of :func:`.report.executables_rows` (as
if the configurations had replayed that trace alone), its table, and one line per
GraphPool policy other than ``all`` saying whether it meets the targets:

* graph memory after the trace at most :data:`MEMORY_TARGET` of vLLM's discipline;
* a step (median and mean) at most :data:`STEP_TARGET` of the same strategy with every
  executable resident;
* the slowest first replay after a wake at most :data:`WAKE_TARGET` of a warm one, after
  a lazy wake (each graph's first replay makes its executable) or after an eager one
  (``wake_up(eager=True)`` makes those resident at the sleep first; the line gives that
  wake's own time, the cost it moves out of the first step);
* every replay equal to eager, no graph captured again.

A policy prepared ahead (``+ahead``, ``+ahead+hint``) also gets an ``ahead`` line against
the same budget served inline (the policy without ``+ahead``) where the run has it: what
preparing ahead changes in the same run, the step and the misses.

Before them, one line per GraphPool policy (``all`` too) for the capture of every graph,
which no trace changes: its time at most :data:`CAPTURE_TARGET` of vLLM's discipline's.
"""

from __future__ import annotations

from . import report
from .exec_policies import is_default

__all__ = ["per_trace", "trace_rows", "target_lines", "capture_lines", "ahead_lines",
           "print_traces",
           "MEMORY_TARGET", "STEP_TARGET", "WAKE_TARGET", "CAPTURE_TARGET"]

MEMORY_TARGET = 0.5
STEP_TARGET = 1.02
WAKE_TARGET = 1.2
CAPTURE_TARGET = 1.1


def per_trace(records) -> dict[str, list[dict]]:
    """trace -> the records as they read after that trace alone (its keys on top).  A
    record that replayed no trace (the floor, a failed configuration) stays as it is."""
    kinds = list(dict.fromkeys(k for r in records for k in (r.get("traces") or {})))
    out = {}
    for kind in kinds:
        out[kind] = [{**r, **r["traces"][kind]} if kind in (r.get("traces") or {}) else r
                     for r in records]
    return out


def trace_rows(records, reference: str) -> dict[str, list[dict]]:
    """trace -> :func:`.report.executables_rows` of the records after that trace."""
    return {kind: report.executables_rows(rs, reference=reference)
            for kind, rs in per_trace(records).items()}


def _verdict(value, target: float, spec: str) -> tuple[str, bool]:
    if value is None:
        return "-", False
    return format(value, spec), value <= target


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def capture_lines(scenario: str, rows: list[dict]) -> list[str]:
    """Per GraphPool policy, ``all`` (no budget) included: the capture of every graph
    against the reference's in the same run, and whether it is within the target."""
    out = []
    for r in rows:
        if r.get("exec_resident") is None:  # a peer: torch keeps its executables
            continue
        ratio, ok = _verdict(r.get("capture_x_reference"), CAPTURE_TARGET, ".2f")
        seconds = r.get("capture_s")
        out.append(f"capture {scenario}: {report.strategy_label(r)} "
                   f"{'-' if seconds is None else format(seconds, '.1f')} s for "
                   f"{r.get('graphs')} graphs, {ratio}x {r['reference']} "
                   f"(<= {CAPTURE_TARGET}): " + ("met" if ok else "NOT MET"))
    return out


def _inline_of(name: str) -> str | None:
    """The policy ``name`` without preparation ahead, or None if it prepares none."""
    for tail in ("+ahead+hint", "+ahead"):
        if name.endswith(tail):
            return name[:-len(tail)]
    return None


def ahead_lines(scenario: str, kind: str, rows: list[dict]) -> list[str]:
    """Per policy prepared ahead whose inline twin ran in the same run: its step
    (median, mean) against the twin's, and both their misses."""
    out = []
    by_name = {(r["strategy"], r["order"], r["executables"]): r for r in rows}
    for r in rows:
        inline = _inline_of(str(r["executables"] or ""))
        twin = by_name.get((r["strategy"], r["order"], inline)) if inline else None
        if twin is None or not (twin.get("step_us_median") and twin.get("step_us_mean")) \
                or not (r.get("step_us_median") and r.get("step_us_mean")):
            continue
        out.append(f"ahead {scenario} {kind}: {report.strategy_label(r)} a step "
                   f"{r['step_us_median'] / twin['step_us_median']:.3f}x median, "
                   f"{r['step_us_mean'] / twin['step_us_mean']:.3f}x mean of "
                   f"{report.strategy_label(twin)} in this run (misses "
                   f"{r.get('trace_misses')} against {twin.get('trace_misses')}, updates "
                   f"{r.get('trace_updates')} against {twin.get('trace_updates')})")
    return out


def target_lines(scenario: str, rows_by_trace: dict[str, list[dict]]) -> list[str]:
    """The capture lines (:func:`capture_lines`), then per trace: the launch path (every
    executable resident, the pool's launches, against the reference's torch replays),
    then one line per GraphPool policy other than ``all``: each target's number and
    whether it is met, then ``met`` or what is not."""
    first = next(iter(rows_by_trace.values()), [])
    out = capture_lines(scenario, first)
    for kind, rows in rows_by_trace.items():
        alls = [r for r in rows if r["executables"] == "all"]
        refs = {f"{r['strategy']} {r['order']}": r for r in rows
                if r.get("exec_resident") is None}
        for r in alls:
            ref = refs.get(r["reference"] or "")
            if ref and ref.get("step_us_median") and ref.get("step_us_mean"):
                out.append(f"launch path {scenario} {kind}: {report.strategy_label(r)} "
                           f"(every executable resident) a step "
                           f"{r['step_us_median'] / ref['step_us_median']:.3f}x median, "
                           f"{r['step_us_mean'] / ref['step_us_mean']:.3f}x mean of "
                           f"{r['reference']} (torch's replay())")
        for r in rows:
            if is_default(r["executables"]) or r.get("exec_resident") is None:
                continue
            memory, memory_ok = _verdict(r["x_reference"], MEMORY_TARGET, ".2f")
            median, median_ok = _verdict(r["step_median_x_all"], STEP_TARGET, ".3f")
            mean, mean_ok = _verdict(r["step_mean_x_all"], STEP_TARGET, ".3f")
            wake, wake_ok = _verdict(r["wake_ratio_max"], WAKE_TARGET, ".2f")
            eager, eager_ok = _verdict(r.get("wake_eager_ratio_max"), WAKE_TARGET, ".2f")
            wrong = len(r.get("trace_wrong") or [])
            recaptures = (r.get("trace_recaptures") or 0) + (r.get("wake_recaptures") or 0)
            missed = [name for name, ok in (("memory", memory_ok), ("step median", median_ok),
                                            ("step mean", mean_ok),
                                            ("wake", wake_ok or eager_ok),
                                            ("wrong", wrong == 0),
                                            ("recaptures", recaptures == 0)) if not ok]
            gap = r.get("trace_step_gap_ms") or 0
            out.append(
                f"target {scenario} {kind}"
                + (f" ({gap:g} ms of host time between steps)" if gap else "")
                + f" {report.strategy_label(r)}: graph memory "
                f"{memory}x {r['reference']} (<= {MEMORY_TARGET}); step {median}x median, "
                f"{mean}x mean of every executable resident (<= {STEP_TARGET}); first "
                f"replay after wake {wake}x warm lazily, {eager}x after an eager wake "
                f"of {_ms(r.get('wake_eager_ms'))} (<= {WAKE_TARGET}); {wrong} wrong, "
                f"{recaptures} recaptures; steps begun cold {r.get('trace_cold_blocks')} "
                f"of {r.get('trace_steps')}, misses {r.get('trace_misses')}, prepared ahead "
                f"{r.get('trace_prepared_ahead')} ({r.get('trace_unused_ahead')} unused), "
                f"waits {r.get('trace_waits')}: "
                + ("NOT MET (" + ", ".join(missed) + ")" if missed else
                   "met" if wake_ok else "met (the first replay after a wake: through the "
                   "eager wake only)"))
        out += ahead_lines(scenario, kind, rows)
    return out


def print_traces(scenario: str, records, reference: str) -> dict[str, list[dict]]:
    """Print each trace's table, then the target lines; returns the rows per trace.
    Records of one trace (from before ``--trace``) get their one table."""
    rows_by_trace = trace_rows(records, reference)
    if not rows_by_trace:
        rows = report.executables_rows(records, reference=reference)
        if rows:
            print(report.executables_table(rows))
    for kind, rows in rows_by_trace.items():
        if rows:
            print(f"\n{scenario}, trace {kind}:")
            print(report.executables_table(rows))
    for line in target_lines(scenario, rows_by_trace):
        print(line)
    return rows_by_trace
