"""``vmm-core bench --sleep-only`` under torchrun: every rank's offload, alone and together.

One rank per device (``torchrun --nproc-per-node N -m vmm_core.cli bench --sleep-only
--sleep-gib 4``); every rank offloads the first ``--sleep-gib`` size of its own device
memory (random bytes, checked after every wake).  Rows, each from round 1 (a host copy
made fresh, through the staging ring) to the last (kept, pinned copies):

``alone``
    each rank in turn, the others idle: what one GPU of this host does (the reference
    of the round-1 target);
``together, local``
    every rank's own ``vmm_core.sleep`` at the same moment, no group: what the host
    gives every rank's copies at once, without any of vmm_core's group steps;
``group``
    ``vmm_core.sleep(group=...)`` / ``wake_up(group=...)`` over the prepared group,
    with each rank's phases (:func:`vmm_core.distributed.last_timings`);
``group, cold communicator``
    round 1 over a group made for it and never used before: its communicator is set
    up inside that sleep (what ``prepare_group`` takes out of it).

Every timed call starts after a barrier; the rows give each rank's time, its rate and
that rate against the rank's own pinned-copy limit, alone and with every rank copying
(:func:`.group_run.rank_limits`).  Targets (the slowest rank): the group's rounds 2..N
sleep and wake at >= 90% of the rank's limit, and its round 1 within 1.2x of the rank's
own round 1 alone.
"""

from __future__ import annotations

import time

from .group_run import (
    GIB,
    barrier,
    joined,
    limits_lines,
    local_rank,
    phase_line,
    rank_limits,
)
from .spec import BenchSpec

__all__ = ["run_group_sleep_bench", "TARGET_LATER", "TARGET_FIRST_RATIO"]

TARGET_LATER = 0.90
TARGET_FIRST_RATIO = 1.2
ROUNDS = 3
TAG = "bench-group-offload"


def run_group_sleep_bench(spec: BenchSpec, backend) -> dict:
    """One torchrun rank.  On a backend without device graphs (the host backend) the same
    rows run over host memory and gloo, the limits are memcpy rates, and no target is
    judged (a smoke test of the flow)."""
    import torch

    assert spec.sleep is not None
    device = local_rank()
    ops = backend.graph_ops(device)
    host_run = ops is None or ops.device_type == "cpu"
    with joined("cpu" if host_run else ops.device_type, device) as group:
        if host_run:
            return _measure(spec, backend, _HostDevice(), torch.device("cpu"), group)
        return _measure(spec, backend, getattr(torch, ops.device_type), ops.torch_device,
                        group)


class _HostDevice:
    """What the rows ask of ``torch.cuda`` when the bytes are host memory."""

    def synchronize(self, device=None) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return "host backend"


def _measure(spec: BenchSpec, backend, mod, device, joined: dict) -> dict:
    import torch
    import torch.distributed as dist

    import vmm_core
    from vmm_core.memory import offload

    from .sleep import _Bytes, _HostBytes, _pinned_limit

    rank, world = joined["rank"], joined["world"]
    host_run = isinstance(mod, _HostDevice)
    gib = spec.sleep.sizes(on_device=not host_run)[0] if spec.sleep else 4.0
    size = int(gib * GIB)
    if rank == 0:
        where = "HOST RUN: host memory and memcpy rates, no device" if host_run else \
            f"{joined['backend']}"
        print(f"vmm-core bench --sleep-only over {world} ranks ({where}): {gib:g} GiB "
              f"offloaded a rank; the group prepared in "
              f"{joined['prepare_group_s'] * 1e3:.1f} ms (its communicator set up there, "
              f"outside any sleep)", flush=True)
    if host_run:
        limits = rank_limits(lambda: (_memcpy_rate(size),) * 2, mod, device)
    else:
        limits = rank_limits(lambda: _pinned_limit(backend, mod, device, GIB), mod, device)
    if rank == 0:
        print("\n".join(limits_lines(limits)), flush=True)
    offload.prepare_staging(backend, device.index or 0)
    region = vmm_core.region(TAG, backend=backend)
    if host_run:
        with region as alloc:
            data = _HostBytes(torch, alloc, size)
    else:
        data = _Bytes(torch, mod, device, size, region)
    rows: list[dict] = []
    for turn in range(world):  # alone: one rank at a time
        barrier(mod, device)
        if turn == rank:
            rows += _rounds("alone", data, mod, device, None, synchronized=False)
        barrier(mod, device)
    rows += _rounds("together, local", data, mod, device, None)
    rows += _rounds("group", data, mod, device, dist.group.WORLD, rounds=ROUNDS + 1)
    cold = dist.new_group(list(range(world)))  # never used: set up inside the sleep
    rows += _rounds("group, cold communicator", data, mod, device, cold, rounds=1)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, rows)
    records = [r for per_rank in everyone for r in per_rank]
    targets = _targets(records, limits, size)
    if rank == 0:
        _print(records, limits, size, targets, host_run)
    ok = all(r["intact"] for r in records)
    return {"schema": 1, "kind": "group-sleep", "host_run": host_run, "ranks": world,
            "bytes": size, "prepare_group_s": joined["prepare_group_s"], "limits": limits,
            "records": records, "targets": targets, "ok": ok}


def _memcpy_rate(size: int) -> float:
    """GiB/s of one memmove of ``size`` bytes between two host buffers (the host run's
    stand-in for a copy limit: what the rows' copies move at there)."""
    import ctypes

    src, dst = ctypes.create_string_buffer(size), ctypes.create_string_buffer(size)
    ctypes.memmove(dst, src, size)  # pages faulted in first
    t0 = time.perf_counter()
    ctypes.memmove(dst, src, size)
    return size / GIB / (time.perf_counter() - t0)


def _rounds(row: str, data, mod, device, group, rounds: int = ROUNDS,
            synchronized: bool = True) -> list[dict]:
    """``rounds`` offload sleeps and wakes of this rank's bytes, round 1 from a fresh host
    copy; ``group``: with ``group=`` (None: each rank's own call); ``synchronized``:
    every rank starts each call after a barrier (the row runs on every rank)."""
    import torch.distributed as dist

    import vmm_core
    from vmm_core.distributed import last_timings
    from vmm_core.memory import tagged

    alloc = tagged.allocators(TAG)[0]
    vmm_core.sleep(TAG)  # discard: no host copy kept from a row before (untimed)
    vmm_core.wake_up(TAG, keep_host_buffers=False)
    out = []
    for rnd in range(1, rounds + 1):
        data.randomize()
        waited = barrier(mod, device) if synchronized else 0.0
        t0 = time.perf_counter()
        vmm_core.sleep(TAG, offload=TAG, group=group)
        sleep_s = time.perf_counter() - t0
        saved = alloc.last_transfer
        sleep_phases = last_timings("sleep") if group is not None else _local(saved, sleep_s,
                                                                               "unmap+release")
        if synchronized:
            barrier(mod, device)
        t1 = time.perf_counter()
        vmm_core.wake_up(TAG, group=group)
        mod.synchronize()
        wake_s = time.perf_counter() - t1
        restored = alloc.last_transfer
        wake_phases = last_timings("wake_up") if group is not None else _local(restored, wake_s,
                                                                              "map")
        out.append({"row": row, "rank": dist.get_rank(), "round": rnd, "sleep_s": sleep_s,
                    "wake_s": wake_s, "arrival_wait_s": waited,
                    "sleep_strategy": saved.strategy, "wake_strategy": restored.strategy,
                    "sleep_phases": sleep_phases, "wake_phases": wake_phases,
                    "intact": data.intact()})
    return out


def _local(transfer, seconds: float, rest: str) -> dict:
    """A local call's phases in the group calls' terms: the copy and the rest."""
    copy = transfer.seconds - transfer.pin_wait_seconds
    return {"phases": {"copy": copy, "pin wait": transfer.pin_wait_seconds,
                       rest: max(0.0, seconds - transfer.seconds)}, "total_s": seconds}


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def _targets(records: list[dict], limits: dict, size: int) -> dict:
    """The slowest rank's share of its own limit in the group's rounds 2..N, and its
    group round 1 against its own round 1 alone."""
    def pick(row, rank, first):
        return [r for r in records if r["row"] == row and r["rank"] == rank
                and (r["round"] == 1) == first]

    ranks = sorted(limits)
    sleep_pct, wake_pct, first = {}, {}, {}
    for rank in ranks:
        later = pick("group", rank, first=False)
        alone = limits[rank]["alone"]
        sleep_pct[rank] = size / GIB / _mean(r["sleep_s"] for r in later) / alone[0]
        wake_pct[rank] = size / GIB / _mean(r["wake_s"] for r in later) / alone[1]
        group1, alone1 = pick("group", rank, first=True), pick("alone", rank, first=True)
        first[rank] = group1[0]["sleep_s"] / alone1[0]["sleep_s"]
    worst = {"sleep": min(sleep_pct.values()), "wake": min(wake_pct.values()),
             "round 1": max(first.values())}
    return {"sleep_pct_of_limit": sleep_pct, "wake_pct_of_limit": wake_pct,
            "round1_vs_alone": first, "slowest": worst,
            "met": {"sleep": worst["sleep"] >= TARGET_LATER,
                    "wake": worst["wake"] >= TARGET_LATER,
                    "round 1": worst["round 1"] <= TARGET_FIRST_RATIO}}


def _print(records: list[dict], limits: dict, size: int, targets: dict,
           host_run: bool) -> None:
    gib = size / GIB
    print(f"\n{'row':26s} {'rnd':>3s} {'rank':>4s} {'sleep ms':>9s} {'GiB/s':>6s} "
          f"{'alone':>5s} {'tgthr':>5s}  {'wake ms':>8s} {'GiB/s':>6s} {'alone':>5s} "
          f"{'tgthr':>5s}  {'wait ms':>7s}  sleep phases (ms) | wake phases (ms)")
    for r in records:
        lim = limits[r["rank"]]
        s_rate, w_rate = gib / r["sleep_s"], gib / r["wake_s"]
        print(f"{r['row']:26s} {r['round']:3d} {r['rank']:4d} {r['sleep_s'] * 1e3:9.1f} "
              f"{s_rate:6.1f} {s_rate / lim['alone'][0]:5.0%} "
              f"{s_rate / lim['together'][0]:5.0%}  {r['wake_s'] * 1e3:8.1f} "
              f"{w_rate:6.1f} {w_rate / lim['alone'][1]:5.0%} "
              f"{w_rate / lim['together'][1]:5.0%}  {r['arrival_wait_s'] * 1e3:7.1f}  "
              f"{phase_line(r['sleep_phases'])} | {phase_line(r['wake_phases'])}"
              f"{'' if r['intact'] else '  BYTES WRONG'}")
    print("  (alone / tgthr: the rate against the rank's pinned limit measured alone and "
          "with every rank copying; wait: this rank's wait at the barrier before the "
          "sleep, not in its time)")
    worst, met = targets["slowest"], targets["met"]
    if host_run:
        print("HOST RUN: host memory over gloo; the targets are judged on devices only "
              f"(slowest rank here: sleep {worst['sleep']:.0%}, wake {worst['wake']:.0%} of "
              f"memcpy, round 1 {worst['round 1']:.2f}x alone)")
        return
    print(f"target: group rounds 2..N sleep >= {TARGET_LATER:.0%} of each rank's limit "
          f"(alone): slowest rank {worst['sleep']:.0%}: {'met' if met['sleep'] else 'NOT met'}")
    print(f"target: group rounds 2..N wake >= {TARGET_LATER:.0%}: slowest rank "
          f"{worst['wake']:.0%}: {'met' if met['wake'] else 'NOT met'}")
    print(f"target: group round 1 within {TARGET_FIRST_RATIO:g}x of the rank's round 1 "
          f"alone: slowest rank {worst['round 1']:.2f}x: "
          f"{'met' if met['round 1'] else 'NOT met'}")
