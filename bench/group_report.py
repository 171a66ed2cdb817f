"""The RL step under torchrun, rank by rank, and its targets against one GPU.

:func:`rank_table` prints every rank's sleep and wake per step: time, the rate of what
the sleep copied against the rank's own pinned limit (alone and with every rank
copying), the wait at the barrier before (not in the time) and the phases
(:func:`vmm_core.distributed.last_timings`).  :func:`rl_group_targets` judges rounds
2..N on the slowest rank.  Round 1 is judged against one GPU's round 1 on the same
shape, measured by a separate one-GPU run; :func:`main` reads both JSON files::

    python -m vmm_bench.group_report --one-gpu rl.json --group rl_group.json
"""

from __future__ import annotations

import argparse
import json

from .group_run import GIB, phase_line

__all__ = ["rank_table", "rl_group_targets", "round1_ratio", "main", "TARGET_LATER",
           "TARGET_FIRST_RATIO"]

TARGET_LATER = 0.90
TARGET_FIRST_RATIO = 1.2


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def rank_table(records: list[dict]) -> list[str]:
    """One line per step and rank (``records``: every rank's RL record)."""
    lines = ["\nper rank (sleep / wake: ms, GiB/s of the bytes a sleep copies, share of "
             "the rank's pinned limit alone | with every rank copying; wait: at the "
             "barrier before, not in the time):",
             f"  {'step':>4s} {'rank':>4s} {'sleep ms':>9s} {'GiB/s':>6s} {'alone':>5s} "
             f"{'tgthr':>5s} {'wake ms':>8s} {'GiB/s':>6s} {'alone':>5s} {'tgthr':>5s} "
             f"{'wait ms':>7s}  sleep phases (ms) | wake phases (ms)"]
    for i in range(len(records[0]["steps"])):
        for rank, r in enumerate(records):
            s = r["steps"][i]
            gib = (r.get("offloaded_bytes") or r["weight_bytes"]) / GIB
            lim = (r.get("rank_limits") or {}).get(rank) or {}
            alone, together = lim.get("alone"), lim.get("together")

            def share(rate, limit, way):
                return f"{rate / limit[way]:5.0%}" if limit else f"{'?':>5s}"

            sr, wr = gib / s["sleep_s"], gib / s["wake_s"]
            lines.append(
                f"  {s['step']:4d} {rank:4d} {s['sleep_s'] * 1e3:9.1f} {sr:6.1f} "
                f"{share(sr, alone, 0)} {share(sr, together, 0)} {s['wake_s'] * 1e3:8.1f} "
                f"{wr:6.1f} {share(wr, alone, 1)} {share(wr, together, 1)} "
                f"{s.get('arrival_wait_s', 0.0) * 1e3:7.1f}  "
                f"{phase_line(s.get('sleep_phases'))} | {phase_line(s.get('wake_phases'))}")
    return lines


def rl_group_targets(records: list[dict]) -> dict:
    """Rounds 2..N, the slowest rank: its sleep and wake rates against its own pinned
    limit (alone) at >= TARGET_LATER.  Printed and returned."""
    sleep_pct, wake_pct = {}, {}
    for rank, r in enumerate(records):
        later = r["steps"][1:]
        lim = (r.get("rank_limits") or {}).get(rank)
        if not later or not lim:
            continue
        gib = (r.get("offloaded_bytes") or r["weight_bytes"]) / GIB
        sleep_pct[rank] = gib / _mean(s["sleep_s"] for s in later) / lim["alone"][0]
        wake_pct[rank] = gib / _mean(s["wake_s"] for s in later) / lim["alone"][1]
    if not sleep_pct:
        return {}
    worst = {"sleep": min(sleep_pct.values()), "wake": min(wake_pct.values())}
    out = {"sleep_pct_of_limit": sleep_pct, "wake_pct_of_limit": wake_pct,
           "slowest": worst,
           "round1_sleep_s": max(r["steps"][0]["sleep_s"] for r in records),
           "met": {k: v >= TARGET_LATER for k, v in worst.items()}}
    for way in ("sleep", "wake"):
        print(f"target: rounds 2..N {way} >= {TARGET_LATER:.0%} of each rank's pinned limit "
              f"(alone): slowest rank {worst[way]:.0%}: "
              f"{'met' if out['met'][way] else 'NOT met'}")
    print(f"round 1 sleep, slowest rank: {out['round1_sleep_s'] * 1e3:.1f} ms (against one "
          f"GPU: python -m vmm_bench.group_report --one-gpu ONE.json --group GROUP.json)")
    return out


def round1_ratio(one_gpu: dict, group: dict) -> dict:
    """Round 1's sleep of the group's slowest rank against one GPU's vmm row, from the
    two runs' JSON documents (``--scenario rl`` without and with torchrun)."""
    vmm = next(r for r in one_gpu["records"] if r.get("strategy") == "vmm")
    alone = vmm["steps"][0]["sleep_s"]
    together = max(r["steps"][0]["sleep_s"] for r in group["records"])
    ratio = together / alone
    return {"one_gpu_s": alone, "group_s": together, "ratio": ratio,
            "met": ratio <= TARGET_FIRST_RATIO,
            "same_shape": vmm.get("model_description") ==
            group["records"][0].get("model_description")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmm_bench.group_report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--one-gpu", required=True, help="JSON of --scenario rl on one GPU")
    parser.add_argument("--group", required=True, help="JSON of --scenario rl under torchrun")
    args = parser.parse_args(argv)
    with open(args.one_gpu) as fh:
        one = json.load(fh)
    with open(args.group) as fh:
        group = json.load(fh)
    r = round1_ratio(one, group)
    shape = "" if r["same_shape"] else " (NOT the same model shape: not comparable)"
    print(f"target: round 1 sleep of the slowest rank within {TARGET_FIRST_RATIO:g}x of one "
          f"GPU's: {r['group_s'] * 1e3:.1f} ms against {r['one_gpu_s'] * 1e3:.1f} ms = "
          f"{r['ratio']:.2f}x: {'met' if r['met'] and r['same_shape'] else 'NOT met'}{shape}")
    return 0  # a target is printed as met or NOT met, as every benchmark prints it


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
