"""``vmm-core bench``: one spec in, one result document out.

The backend decides what runs: a device backend (graph ops of a device) runs the
scenarios of :mod:`.scenarios`; a backend without device graphs (the host backend, or a
third party's without graph ops) runs the allocator scenario of :mod:`.host_demo`.  A
benchmark child (``spec.child``) measures its one configuration and hands the record to
its parent.  Only rank 0 of a torchrun group writes files.
"""

from __future__ import annotations

import os

from . import report, scenarios
from .children import emit_result
from .extras import require
from .group_run import under_torchrun
from .host_demo import run_host_bench
from .spec import BenchSpec

__all__ = ["run_bench"]


def run_bench(spec: BenchSpec) -> dict:
    """Run ``spec`` and return its result document (``ok``: every check passed); writes
    ``spec.output.json`` when asked."""
    result = _run(spec)
    if spec.output.json and spec.child is None and os.environ.get("RANK", "0") == "0":
        report.save_json(result, spec.output.json)
    return result


def _run(spec: BenchSpec) -> dict:
    import vmm_core

    if spec.distributed is not None:
        from .distributed import run_distributed_bench

        return run_distributed_bench(spec)
    selection = vmm_core.select_backend(spec.backend)
    backend = selection.backend
    ops = backend.graph_ops(0)
    if ops is None or ops.device_type == "cpu":  # no device graphs to capture
        return run_host_bench(spec, selection)
    if spec.child is not None:
        record, ok = scenarios.child(spec.scenarios)(spec)
        emit_result(record)
        return {"ok": ok, **record}
    for name in spec.scenarios:  # refused before any child starts
        extra = scenarios.SCENARIOS[name].extra
        if extra is not None:
            require(extra, f"--scenario {name}")
    if spec.scenarios != (scenarios.DEFAULT,):
        _say_unused(spec)
        return scenarios.runner(spec.scenarios)(spec, backend)
    result: dict = {"ok": True}
    sleep = spec.sleep
    if sleep is None or not sleep.only:
        result = scenarios.runner(spec.scenarios)(spec, backend)
    if sleep is not None:
        if under_torchrun():  # one rank per device: the group's rows
            from .group_sleep import run_group_sleep_bench as run_sleep_bench
        else:
            from .sleep import run_sleep_bench

        result["sleep"] = run_sleep_bench(spec, backend)
        result["ok"] = result["ok"] and result["sleep"]["ok"]
    return result


def _say_unused(spec: BenchSpec) -> None:
    """One line for each flag the chosen scenarios do not use."""
    chosen = [scenarios.SCENARIOS[n] for n in spec.scenarios]
    if spec.sleep is not None and not any(s.uses_sleep for s in chosen):
        print(f"note: --sleep{'-only' if spec.sleep.only else ''}: scenario {spec.scenario} "
              f"does not measure sleep/wake (--scenario decode does); ignored")
    if spec.model.name is not None and not any(s.uses_model for s in chosen):
        print(f"note: --model {spec.model.name}: scenario {spec.scenario} builds its own "
              f"model (--scenario decode takes --model); ignored")
