"""``vmm-core bench --scenario rl`` under torchrun: the vmm loop on every rank, with
``vmm_core.sleep(group=...)`` and ``vmm_core.wake_up(group=...)`` (every rank sleeps or
none does).

Each rank joins the group and prepares it (:func:`.group_run.join`), runs
:func:`.rl.run_one_rl` on its own device (its pinned limit measured alone and with every
rank copying, a barrier before every timed sleep and wake, its phases recorded), and
rank 0 prints the slowest rank per step, then every rank's line
(:func:`.group_report.rank_table`) and the targets of rounds 2..N.
"""

from __future__ import annotations

import os
import sys
import traceback

from . import report
from .group_run import under_torchrun
from .rl import run_one_rl, run_rl_bench
from .rl_report import _ok, _plot, _print, _summarize
from .spec import BenchSpec

__all__ = ["run_rl_scenario", "run_rl_group"]


def run_rl_scenario(spec: BenchSpec, backend) -> dict:
    """``--scenario rl``: the strategies side by side on one device, or under torchrun
    (one rank per device) the vmm loop over the group."""
    if under_torchrun():
        return run_rl_group(spec, backend)
    return run_rl_bench(spec, backend)


def run_rl_group(spec: BenchSpec, backend) -> dict:
    """One torchrun rank: the vmm loop with group sleep and wake; rank 0 prints, per
    step, the slowest rank's times and the least memory any rank freed, then every
    rank's times, rates against its own pinned limit and phases."""

    from .group_run import joined, local_rank

    device = local_rank()
    device_type = backend.graph_ops(device).device_type
    with joined(device_type, device) as group:  # the communicator set up now
        try:
            return _rl_group_rank(spec, device, group)
        except BaseException:
            # the group's shutdown on the way out first waits for this rank's collectives
            # (torch's NCCL group finalizes its communicators), which a peer that never
            # joins them leaves unfinished until a timeout kills the run: the cause
            # reaches the log before that
            print(f"rank {os.environ.get('RANK', 0)} failed; destroying its process group:",
                  file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            raise


def _rl_group_rank(spec: BenchSpec, device: int, joined: dict) -> dict:
    import torch.distributed as dist

    from .group_report import rank_table, rl_group_targets

    rank, world = dist.get_rank(), dist.get_world_size()
    record = run_one_rl("rl:vmm", spec, device=device, group=dist.group.WORLD)
    records: list = [None] * world
    dist.all_gather_object(records, record)
    steps = []
    for i in range(len(record["steps"])):
        per_rank = [r["steps"][i] for r in records]
        slowest = {key: max(s[key] for s in per_rank)
                   for key in ("sleep_s", "wake_s", "first_replay_s", "step_s")}
        slowest["slowest_rank"] = max(range(world), key=lambda r: per_rank[r]["step_s"])
        steps.append({**per_rank[0], **slowest, "step": i + 1,
                      "freed_bytes": min(s["freed_bytes"] for s in per_rank),
                      "first_replay_ok": all(s["first_replay_ok"] for s in per_rank),
                      "train_ok": all(s["train_ok"] for s in per_rank),
                      "wrong_sizes": [w for s in per_rank for w in s["wrong_sizes"]]})
    group_record = {**record, "strategy": f"vmm, {world} ranks (slowest)", "steps": steps,
                    "wrong_before_sleep": [w for r in records
                                           for w in r["wrong_before_sleep"]],
                    "ranks": world}
    limit = records[0]["pinned_limit_gib_s"]
    summary = _summarize([group_record], limit)
    targets = rl_group_targets(records)
    if rank == 0:
        print(f"group prepared in {joined['prepare_group_s'] * 1e3:.1f} ms (its "
              f"communicator set up there, outside any sleep)")
        _print([group_record], summary, group_record, limit)
        print("\n".join(rank_table(records)))
        if spec.output.plot:
            path = report.plot_path(spec.output.plot, "rl-group")
            if _plot([group_record], path,
                     f"RL steps, group sleep over {world} ranks (slowest rank)"):
                print(f"wrote {path}")
    ok = _ok(group_record)
    dist.barrier()
    return {"schema": report.SCHEMA, "kind": "rl-group", "records": records,
            "slowest": group_record, "summary": summary, "targets": targets,
            "prepare_group_s": joined["prepare_group_s"], "ok": ok}
