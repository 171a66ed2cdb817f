"""``vmm-core bench --distributed``: rows of mapped and distributed tensors vs NCCL.

Run one process per device, e.g. ``torchrun --nproc-per-node 2 -m vmm_core.cli bench
--distributed --json out.json --plot out.png``.  Every rank, on its own device:

* times the setup of a continuous mapped tensor (default 16 GiB and 1 GiB over all
  ranks; the target is under 1 s for 16 GiB on two GPUs);
* gathers random rows of a continuous mapped tensor with one kernel
  (``index_select``): rows from every rank's part, from the other ranks' parts only,
  and from its own part only;
* moves the same bytes with ``all_gather_into_tensor`` through the group (NCCL on GPUs);
* measures the limits in the same run: a plain copy of a peer's part through the
  mapping (GPU-to-GPU bandwidth) and a copy within its own memory (local bandwidth).

* then, for random rows of 4 KiB and of 256 B, every kind's ``gather``/``scatter``
  side by side: the continuous kind's ``mt.gather`` beside direct indexing of
  ``mt.tensor`` (the same kernel; target: within 5%), and the distributed kind's
  ``mt.gather`` / ``mt.scatter`` (indices bucketed by owner, ``all_to_all_single``)
  beside one ``all_to_all_single`` moving the same bytes, the reference (target:
  the distributed gather of 4 KiB rows >= 80% of it).

Target: the remote gather reaches >= 80% of the GPU-to-GPU copy.  Bandwidths count the
bytes each rank receives.  Without torchrun it runs one rank; on a machine without an
accelerator it runs the same flow on the host backend over gloo and says that the
numbers are host memory, not a device's (a smoke test for CI).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

from .report import pyplot, save_figure, save_json
from .spec import BenchSpec, DistributedSpec, Output

__all__ = ["run_distributed_bench", "main"]

GIB = 1 << 30
TARGET_REMOTE_OF_P2P = 0.8
TARGET_SETUP_S = 1.0
TARGET_DISTRIBUTED_OF_A2A = 0.8
TARGET_GATHER_OF_DIRECT = 0.95
ROW_SIZES = (4096, 256)

#: (device run, host run) defaults
DEFAULTS = {
    "setup_gib": ("16,1", "0.25,0.0625"),
    "table_gib": (4.0, 0.25),
    "gather_rows": (262144, 4096),
}


def _params(spec: DistributedSpec, host_run: bool) -> dict:
    pick = 1 if host_run else 0
    setup = spec.setup_gib or [float(x) for x in str(DEFAULTS["setup_gib"][pick]).split(",")]
    return {"setup_gib": list(setup),
            "table_gib": spec.table_gib or DEFAULTS["table_gib"][pick],
            "row_bytes": spec.row_bytes or 4096,
            "gather_rows": spec.gather_rows or DEFAULTS["gather_rows"][pick],
            "iters": spec.iters or (3 if host_run else 10)}


@contextlib.contextmanager
def joined_group(device_type: str):
    """torchrun's group, or a one-rank group when not under torchrun (its store in a
    folder of its own); yields the note to print.  A group this made is left, and the
    store's folder removed, on the way out, a failed run's too; a group the caller had
    already made is theirs."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield ""
        return
    name = dist.Backend.default_device_backend_map.get(device_type, "gloo")
    with contextlib.ExitStack() as undo:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(name)
            note = ""
        else:
            folder = undo.enter_context(tempfile.TemporaryDirectory(prefix="vmm_core_bench_"))
            store = dist.FileStore(os.path.join(folder, "store"), 1)
            dist.init_process_group(name, store=store, rank=0, world_size=1)
            note = "not under torchrun: one rank (run torchrun --nproc-per-node N for N)"
        undo.callback(dist.destroy_process_group)
        yield note


def _timed(fn, sync, iters: int) -> float:
    """Seconds per call of ``fn`` (after warm-up calls)."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def run_distributed_bench(spec: BenchSpec) -> dict:
    import torch

    import vmm_core

    selection = vmm_core.select_backend(spec.backend)
    backend = selection.backend
    ops = backend.graph_ops(0)
    device_type = ops.device_type if ops is not None else "cpu"
    host_run = device_type == "cpu"
    device = 0 if host_run else int(os.environ.get("LOCAL_RANK", 0))
    if host_run:
        tdev, sync = torch.device("cpu"), (lambda: None)
    else:
        mod = getattr(torch, device_type)  # torch.cuda, torch.npu, torch.mlu
        mod.set_device(device)  # before the group: NCCL binds to the current device
        tdev, sync = torch.device(device_type, device), mod.synchronize
    with joined_group(device_type) as note:
        return _measure(spec, backend, device, host_run, tdev, sync, note)


def _measure(spec: BenchSpec, backend, device: int, host_run: bool, tdev, sync,
             note: str) -> dict:
    import torch
    import torch.distributed as dist

    from vmm_core.distributed import mapped_tensor
    from vmm_core.distributed.group import Group

    rank, world = dist.get_rank(), dist.get_world_size()
    group = Group(None, backend, device)
    p = _params(spec.distributed or DistributedSpec(), host_run)
    cols = p["row_bytes"] // 4
    if rank == 0:
        where = "HOST RUN: no accelerator, host backend over gloo; the bandwidths are host " \
                "memory, not a device's" if host_run else \
            f"{backend.name} devices, {dist.get_backend()} group"
        print(f"vmm-core bench --distributed: {world} rank(s), {where}. {note}".rstrip())

    # 1. setup time of continuous mapped tensors
    setup = []
    for gib in p["setup_gib"]:
        rows = int(gib * GIB) // p["row_bytes"]
        group.gather(None, "bench: before setup")
        t0 = time.perf_counter()
        mt = mapped_tensor((rows, cols), torch.float32, backend=backend, device=device)
        seconds = time.perf_counter() - t0
        slowest = max(group.gather(seconds, "bench: setup time"))
        mt.close()
        setup.append({"gib": gib, "ranks": world, "seconds": slowest})

    # 2. gathers through the mapping, all_gather through the group, the copy limits
    rows = int(p["table_gib"] * GIB) // p["row_bytes"]
    mt = mapped_tensor((rows, cols), torch.float32, backend=backend, device=device)
    part = mt.memory.partition
    r0, r1 = part.row_range(rank)
    if r1 > r0:  # row i holds the value i: a gather can be checked exactly
        mt.local_part().copy_(torch.arange(r0, r1, device=tdev, dtype=torch.float32)
                              [:, None].expand(-1, cols))
    sync()
    group.gather(None, "bench: table filled")
    k = p["gather_rows"]
    gen = torch.Generator().manual_seed(rank)
    pools = {"every part": torch.arange(rows),
             "remote parts": torch.cat([torch.arange(*part.row_range(r))
                                        for r in range(world) if r != rank]
                                       or [torch.empty(0, dtype=torch.long)]),
             "own part": torch.arange(r0, r1)}
    out = torch.empty((k, cols), dtype=torch.float32, device=tdev)
    results = {}
    for label, pool in pools.items():
        if pool.numel() == 0:
            results[label] = None
            continue
        idx = pool[torch.randint(0, pool.numel(), (k,), generator=gen)].to(tdev)
        seconds = _timed(lambda: torch.index_select(mt.tensor, 0, idx, out=out), sync,
                         p["iters"])
        correct = bool(torch.equal(out[:, 0], idx.to(torch.float32)))
        results[label] = {"gib_s": k * p["row_bytes"] / GIB / seconds, "correct": correct}

    share = torch.empty((k // world, cols), dtype=torch.float32, device=tdev)
    gathered = torch.empty((share.shape[0] * world, cols), dtype=torch.float32, device=tdev)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    seconds = _timed(lambda: all_gather(gathered, share), sync, p["iters"])
    results["all_gather"] = {"gib_s": gathered.numel() * 4 / GIB / seconds}

    copy_rows = min(k, r1 - r0)
    peer = (rank + 1) % world
    p0, p1 = part.row_range(peer)
    if world > 1 and p1 > p0:
        n = min(k, p1 - p0)
        src = mt.chunks[peer][:n]
        seconds = _timed(lambda: out[:n].copy_(src), sync, p["iters"])
        results["peer copy"] = {"gib_s": n * p["row_bytes"] / GIB / seconds}
    else:
        results["peer copy"] = None
    if copy_rows:
        src = mt.local_part()[:copy_rows]
        seconds = _timed(lambda: out[:copy_rows].copy_(src), sync, p["iters"])
        results["local copy"] = {"gib_s": copy_rows * p["row_bytes"] / GIB / seconds}
    else:
        results["local copy"] = None
    mt.close()

    # 3. every kind's gather/scatter, beside the all_to_all_single reference
    kinds = {rb: _gather_scatter(p, rb, backend, device, tdev, sync, group)
             for rb in ROW_SIZES}

    everyone = group.gather(results, "bench: results")
    by_kind = {rb: group.gather(kinds[rb], "bench: gather/scatter results")
               for rb in ROW_SIZES}
    report = {"mode": "distributed", "host_run": host_run, "backend": backend.name,
              "ranks": world, "group": str(dist.get_backend()), "params": p,
              "setup": setup, "per_rank": everyone,
              "gather_scatter": {str(rb): rows for rb, rows in by_kind.items()}}
    report.update(_verdict(report))
    if rank == 0:
        _print(report)
        if spec.output.plot:
            _plot(report, spec.output.plot)
    return report


def _gather_scatter(p: dict, row_bytes: int, backend, device, tdev, sync, group) -> dict:
    """GiB/s received per rank for ``gather_rows`` random rows of ``row_bytes``: the
    continuous kind directly indexed and through ``mt.gather``; the distributed kind's
    ``mt.gather`` and ``mt.scatter``; ``all_to_all_single`` of the same bytes."""
    import torch
    import torch.distributed as dist

    from vmm_core.distributed import mapped_tensor

    rank, world = group.rank, group.size
    cols = row_bytes // 4
    rows = int(p["table_gib"] * GIB) // row_bytes
    k, iters = p["gather_rows"], p["iters"]
    moved = k * row_bytes / GIB
    gen = torch.Generator().manual_seed(100 + rank)
    idx = torch.randint(0, rows, (k,), generator=gen).to(tdev)
    # scatter: rows this rank alone writes (i % world == rank), each once, value = index
    mine = torch.arange(rank, rows, world)
    writes = mine[torch.randperm(mine.numel(), generator=gen)[:k]].to(tdev)
    values = writes.to(torch.float32)[:, None].expand(-1, cols).contiguous()
    out: dict = {}

    def fill(mt) -> None:  # row i holds the value i: a gather can be checked exactly
        r0, r1 = mt.memory.row_range()
        if r1 > r0:
            mt.local_part().copy_(torch.arange(r0, r1, device=tdev, dtype=torch.float32)
                                  [:, None].expand(-1, cols))
        sync()
        group.gather(None, "bench: table filled")

    for kind in ("continuous", "distributed"):
        mt = mapped_tensor((rows, cols), torch.float32, kind=kind, backend=backend,
                           device=device)
        try:
            fill(mt)
            if kind == "continuous":
                direct = torch.empty((k, cols), dtype=torch.float32, device=tdev)
                seconds = _timed(lambda: torch.index_select(mt.tensor, 0, idx, out=direct),
                                 sync, iters)
                out["continuous direct"] = {"gib_s": moved / seconds}
            got = mt.gather(idx)
            correct = bool(torch.equal(got[:, 0], idx.to(torch.float32)))
            seconds = _timed(lambda: mt.gather(idx), sync, iters)
            out[f"{kind} gather"] = {"gib_s": moved / seconds, "correct": correct}
            if kind == "distributed":
                seconds = _timed(lambda: mt.scatter(writes, values), sync, iters)
                again = mt.gather(idx)
                out["distributed scatter"] = {
                    "gib_s": moved / seconds,
                    "correct": bool(torch.equal(again[:, 0], idx.to(torch.float32)))}
        finally:
            mt.close()
    on = group._tensor_device()
    send = torch.empty(k * row_bytes, dtype=torch.uint8, device=on)
    recv = torch.empty_like(send)
    seconds = _timed(lambda: dist.all_to_all_single(recv, send), sync, iters)
    out["all_to_all_single"] = {"gib_s": moved / seconds}
    return out


GATHER_LABELS = ["continuous direct", "continuous gather", "distributed gather",
                 "distributed scatter", "all_to_all_single"]


def _verdict(report: dict) -> dict:
    ratios, correct = [], True
    for r in report["per_rank"]:
        for label in ("every part", "remote parts", "own part"):
            if r.get(label) is not None:
                correct &= r[label]["correct"]
        if r.get("remote parts") and r.get("peer copy"):
            ratios.append(r["remote parts"]["gib_s"] / r["peer copy"]["gib_s"])
    of_a2a, of_direct = [], []
    for rb, ranks in report.get("gather_scatter", {}).items():
        for r in ranks:
            for label in ("continuous gather", "distributed gather", "distributed scatter"):
                correct &= r[label]["correct"]
            if rb == "4096":
                of_a2a.append(r["distributed gather"]["gib_s"] /
                              r["all_to_all_single"]["gib_s"])
            of_direct.append(r["continuous gather"]["gib_s"] /
                             r["continuous direct"]["gib_s"])
    big = [s for s in report["setup"] if s["gib"] >= 16]
    verdict = {"gathers_correct": correct,
               "remote_gather_of_peer_copy": min(ratios) if ratios else None}
    verdict["remote_target_met"] = None if not ratios else \
        min(ratios) >= TARGET_REMOTE_OF_P2P
    verdict["setup_16gib_target_met"] = None if not big or report["host_run"] else \
        all(s["seconds"] < TARGET_SETUP_S for s in big)
    verdict["distributed_gather_of_all_to_all"] = min(of_a2a) if of_a2a else None
    verdict["distributed_target_met"] = None if not of_a2a or report["host_run"] else \
        min(of_a2a) >= TARGET_DISTRIBUTED_OF_A2A
    verdict["gather_of_direct"] = min(of_direct) if of_direct else None
    verdict["gather_target_met"] = None if not of_direct or report["host_run"] else \
        min(of_direct) >= TARGET_GATHER_OF_DIRECT
    verdict["ok"] = correct
    return verdict


def _print(report: dict) -> None:
    print("\nsetup of a continuous mapped tensor (slowest rank):")
    for s in report["setup"]:
        print(f"  {s['gib']:8.3f} GiB over {s['ranks']} rank(s): {s['seconds'] * 1e3:9.1f} ms")
    labels = ["every part", "remote parts", "own part", "all_gather", "peer copy",
              "local copy"]
    print(f"\nGiB/s received per rank ({report['params']['gather_rows']} rows of "
          f"{report['params']['row_bytes']} B per gather):")
    print("  rank " + "".join(f"{label:>14s}" for label in labels))
    for rank, r in enumerate(report["per_rank"]):
        cells = []
        for label in labels:
            v = r.get(label)
            cells.append(f"{v['gib_s']:14.1f}" if v else f"{'-':>14s}")
        print(f"  {rank:4d} " + "".join(cells))
    print("  (every/remote/own part: index_select of random rows through the mapping; "
          "all_gather: the same bytes through the group; peer copy: a copy of the next "
          "rank's part through the mapping, the GPU-to-GPU limit; local copy: within own "
          "memory)")
    where = "host memory over gloo" if report["host_run"] else f"{report['group']}"
    for rb, ranks in report.get("gather_scatter", {}).items():
        print(f"\nGiB/s received per rank, {report['params']['gather_rows']} random rows of "
              f"{rb} B ({where}):")
        print("  rank " + "".join(f"{label:>20s}" for label in GATHER_LABELS))
        for rank, r in enumerate(ranks):
            print(f"  {rank:4d} " + "".join(f"{r[label]['gib_s']:20.2f}"
                                            for label in GATHER_LABELS))
    if report.get("gather_scatter"):
        print("  (continuous direct: index_select of mt.tensor; gather: mt.gather, the same "
              "kernel after argument checks; distributed gather/scatter: indices bucketed "
              "by owner and rows moved with all_to_all_single; all_to_all_single: the same "
              "bytes in one call, the reference)")
        for key, target, text in (
                ("distributed_gather_of_all_to_all", TARGET_DISTRIBUTED_OF_A2A,
                 "distributed gather of 4 KiB rows = {:.0%} of all_to_all_single"),
                ("gather_of_direct", TARGET_GATHER_OF_DIRECT,
                 "continuous mt.gather = {:.0%} of direct indexing")):
            if report[key] is not None:
                met = "not judged on a host run" if report["host_run"] else \
                    ("met" if report[key] >= target else "NOT met")
                print(f"{text.format(report[key])} (target >= {target:.0%}): {met}")
    ratio = report["remote_gather_of_peer_copy"]
    if ratio is not None:
        print(f"\nremote gather = {ratio:.0%} of the peer copy (target >= "
              f"{TARGET_REMOTE_OF_P2P:.0%}): {'met' if report['remote_target_met'] else 'NOT met'}")
    if report["setup_16gib_target_met"] is not None:
        print(f"16 GiB setup under {TARGET_SETUP_S:.0f} s: "
              f"{'met' if report['setup_16gib_target_met'] else 'NOT met'}")
    print(f"gathered rows correct on every rank: {report['gathers_correct']}")
    if report["host_run"]:
        print("HOST RUN: these are host-memory numbers from the host backend, not GPU ones.")


def _plot(report: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: pip install 'vmm_core[plot]' for --plot")
        return
    labels = ["every part", "remote parts", "own part", "all_gather", "peer copy",
              "local copy"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(report["per_rank"])
    for rank, r in enumerate(report["per_rank"]):
        values = [r[label]["gib_s"] if r.get(label) else 0 for label in labels]
        ax.bar([i + rank * width for i in range(len(labels))], values, width,
               label=f"rank {rank}")
    ax.set_xticks([i + width * (len(report["per_rank"]) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels)
    ax.set_ylabel("GiB/s received per rank")
    kind = "host run" if report["host_run"] else report["backend"]
    ax.set_title(f"vmm_core mapped tensor gather vs all_gather ({report['ranks']} ranks, {kind})")
    ax.legend()
    save_figure(fig, path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    """``python -m vmm_bench.distributed`` with sizes of one's own choosing."""
    parser = argparse.ArgumentParser(prog="python -m vmm_bench.distributed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--dist-setup-gib", default=None, help="comma-separated, e.g. 16,1")
    parser.add_argument("--dist-table-gib", type=float, default=None)
    parser.add_argument("--dist-row-bytes", type=int, default=None)
    parser.add_argument("--dist-gather-rows", type=int, default=None)
    parser.add_argument("--dist-iters", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    setup = tuple(float(x) for x in args.dist_setup_gib.split(",")) \
        if args.dist_setup_gib else None
    spec = BenchSpec(backend=args.backend, output=Output(json=args.json, plot=args.plot),
                     distributed=DistributedSpec(setup, args.dist_table_gib,
                                                 args.dist_row_bytes, args.dist_gather_rows,
                                                 args.dist_iters))
    result = run_distributed_bench(spec)
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        save_json(result, args.json)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
