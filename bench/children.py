"""One fresh process per benchmark configuration, and the parent that runs them.

A configuration's pools, library workspaces and allocator caches must not leak into the
next, so each runs in its own ``python -m vmm_core.cli bench --one ...`` child
(:meth:`.spec.BenchSpec.child_argv`).  The child prints its record as one
``VMMBENCH {json}`` line on stdout and, when the parent draws bars, ``VMMPROGRESS``
lines (see :mod:`.progress`).  The parent reads stdout line by line and keeps stderr for
the error report of a child that failed.
"""

from __future__ import annotations

import json
import subprocess
import tempfile

from . import progress as _progress
from .errors import BenchModelError

__all__ = ["RESULT_PREFIX", "emit_result", "merge_repeats", "run_child", "run_configurations"]

RESULT_PREFIX = "VMMBENCH "


def emit_result(record: dict) -> None:
    """Child side: hand the record to the parent."""
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def run_child(argv: list[str], *, on_progress=None, env=None) -> tuple[dict | None, int, str]:
    """Run one child; returns ``(record or None, exit code, stderr)``.

    ``on_progress(done, total, phase)`` is called for each progress line.
    """
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        record = None
        assert proc.stdout is not None
        for line in proc.stdout:
            step = _progress.parse_progress(line)
            if step is not None:
                if on_progress is not None:
                    on_progress(*step)
            elif line.startswith(RESULT_PREFIX):
                record = json.loads(line[len(RESULT_PREFIX):])
        rc = proc.wait()
        err.seek(0)
        stderr = err.read()
    return record, rc, stderr


def run_configurations(configs: list[tuple[dict, list[str]]], *, quiet: bool = False,
                       describe=None, env=None, bad_config_exit: int | None = None,
                       on_record=None, repeat: int = 1) -> list[dict]:
    """Run ``(identity, argv)`` children in turn; one record per configuration.

    ``identity`` names the configuration (e.g. ``{"strategy": "vmm", "order":
    "random"}``).  A child that fails or prints no record gives ``{**identity, "error":
    stderr tail}``; a record whose child exited 1 (wrong graphs) is kept as it is, since it
    says why.  ``describe(record)`` makes the line printed when a configuration is done.
    A child exiting with ``bad_config_exit`` says the benchmark itself is misconfigured
    (every child would fail alike): that raises BenchModelError with the child's message.
    ``on_record(record)`` is called with each record as soon as its child ends (quiet or
    not), so a run stopped from outside keeps what finished.  ``repeat``: every
    configuration runs that many times, in rounds of all of them, and the records of one
    configuration are folded by :func:`merge_repeats`.
    """
    configs = [config for _ in range(repeat) for config in configs]
    draw = _progress.bars_enabled(quiet)
    outer = _progress.bar(len(configs), "configurations", enabled=draw, unit="config")
    inner = _progress.bar(0, "", enabled=draw, position=1, leave=False)
    shown = {"phase": None}
    records = []

    def on_progress(done: int, total: int, phase: str) -> None:
        if shown["phase"] != phase:
            inner.reset(total=total)
            inner.set_description_str(phase)
            shown["phase"] = phase
        inner.update(done - inner.n)

    try:
        for identity, argv in configs:
            label = " ".join(str(v) for v in identity.values())
            outer.set_description_str(label)
            record, rc, stderr = run_child(argv + (["--progress-lines"] if draw else []),
                                           on_progress=on_progress if draw else None,
                                           env=env)
            if bad_config_exit is not None and rc == bad_config_exit:
                lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
                message = lines[-1] if lines else f"child exited {rc}"
                raise BenchModelError(message.removeprefix("vmm-core: error: "))
            if record is None or rc not in (0, 1):
                tail = stderr[-3000:]
                record = {**identity, "error": f"child exited {rc}: {tail}"}
                _progress.say(f"{label}: child failed (exit {rc}):\n{tail}", enabled=draw)
            elif not quiet:
                _progress.say(describe(record) if describe else f"  done {label}",
                              enabled=draw)
            records.append(record)
            if on_record is not None:
                on_record(record)
            outer.update()
    finally:
        inner.close()
        outer.close()
    if repeat == 1:
        return records
    return merge_repeats(records, [identity for identity, _ in configs])


def merge_repeats(records: list[dict], identities: list[dict]) -> list[dict]:
    """One record per configuration, in first appearance order, from several runs of
    each (``identities[i]`` names the configuration ``records[i]`` measured).

    The run of median ``capture_s`` stands for the configuration, with ``runs`` (how
    many) and ``capture_s_runs`` (every run's, sorted) beside it; its own other values
    are kept together, not mixed with other runs'.  Nothing a run found wrong is lost:
    ``wrong_graphs`` gathers every run's, and a configuration with a failed run is that
    run's error record, saying which of how many failed."""
    groups: dict = {}
    for record, identity in zip(records, identities, strict=True):
        key = json.dumps(identity, sort_keys=True, default=str)
        groups.setdefault(key, []).append(record)
    merged = []
    for runs in groups.values():
        failed = [r for r in runs if "error" in r]
        if failed:
            merged.append({**failed[0], "error": f"{len(failed)} of {len(runs)} runs "
                           f"failed; the first: {failed[0]['error']}"})
            continue
        timed = sorted(runs, key=lambda r: r.get("capture_s", 0.0))
        median = dict(timed[(len(timed) - 1) // 2])
        median["runs"] = len(runs)
        median["capture_s_runs"] = [r.get("capture_s") for r in timed]
        if any("wrong_graphs" in r for r in runs):
            median["wrong_graphs"] = [w for r in runs for w in r.get("wrong_graphs", [])]
        merged.append(median)
    return merged
