"""Device facts behind a group sleep's time, printed by every rank of one torchrun run.

A group sleep of two ranks measured slower than one GPU's: round 1 (1180 against 588 ms
on the 16-layer 8B shape) and rounds 2..N (326 against 140 ms, 39% of the pinned limit).
Each section answers one candidate cause:

``communicator``
    what the first collective on a group never used costs, in time and device memory,
    against the second: the setup that landed inside the first sleep before
    ``prepare_group`` (line ``first collective``);
``copies``
    the device<->host copy rate of each rank with the other ranks idle and with every
    rank copying at once, into page-locked memory of three kinds: the runtime's pinned
    allocation, an mmap registered as offload registers a kept copy (huge pages
    advised), and the same mmap with its pages placed on the GPU's NUMA node and on
    another node (first touched by a thread bound there; where the host has several
    nodes).  A rate halved "together" only is a host resource the ranks share (a PCIe
    switch, a memory controller, the socket link); one halved on the far node only is
    placement (lines ``copy ...``);
``kept copy``
    where vmm_core's own kept host copy of a 1 GiB offload landed (pages per NUMA node,
    from /proc/self/numa_maps) after a real round 1, beside the GPU's node (line
    ``kept copy``);
``communicator suspend``
    whether the group's backend can release its communicator's memory (torch >= 2.12
    over NCCL >= 2.29.7), and if so the bytes freed and what suspend and resume cost
    (line ``suspend``).

Usage (two GPUs, about 40 s):
    torchrun --standalone --nproc-per-node 2 scripts/probe_group_copy.py
Without a GPU it runs the communicator section over gloo and says the rest was skipped.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
import time

GIB = 1 << 30
SIZE = GIB


def say(rank: int, text: str) -> None:
    print(f"[rank {rank}] {text}", flush=True)


def _numa_nodes() -> dict[int, set[int]]:
    """node -> its CPUs, from sysfs ({} where not told)."""
    nodes = {}
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        node = int(path.split("/node")[-1].split("/")[0])
        cpus: set[int] = set()
        with open(path) as fh:
            for part in fh.read().strip().split(","):
                if part:
                    lo, _, hi = part.partition("-")
                    cpus.update(range(int(lo), int(hi or lo) + 1))
        nodes[node] = cpus
    return nodes


def _gpu_node(torch, index: int) -> int | None:
    try:
        p = torch.cuda.get_device_properties(index)
        address = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{address}/numa_node") as fh:
            return int(fh.read().strip())
    except (AttributeError, OSError, ValueError):
        return None


def _pages_per_node(address: int) -> str:
    """Pages per node (numa_maps' ``N<k>=``) of the mapping that holds ``address``: the
    line with the highest start at or below it."""
    best, words = -1, "unknown"
    try:
        with open("/proc/self/numa_maps") as fh:
            for line in fh:
                start = int(line.split()[0], 16)
                if best < start <= address:
                    best = start
                    words = " ".join(w for w in line.split() if w.startswith("N")) or "?"
    except (OSError, ValueError):
        pass
    return words


def _barrier(torch, dist, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    if device.type == "cuda":
        torch.cuda.synchronize()


def communicator(torch, dist, device, rank: int) -> None:
    group = dist.new_group(list(range(dist.get_world_size())))  # never used yet
    free = (lambda: torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" \
        else (lambda: 0)
    row = torch.ones(3, dtype=torch.int64, device=device)
    times, taken = [], []
    for _ in range(2):
        before = free()
        out = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        t0 = time.perf_counter()
        dist.all_gather(out, row, group=group)
        [o.tolist() for o in out]
        times.append(time.perf_counter() - t0)
        taken.append((before - free()) / 2**20)
    say(rank, f"first collective on a fresh {dist.get_backend(group)} group: "
              f"{times[0] * 1e3:.1f} ms, device memory +{taken[0]:.0f} MiB; second: "
              f"{times[1] * 1e3:.2f} ms, +{taken[1]:.0f} MiB")
    suspend(torch, dist, device, group, rank, free)


def suspend(torch, dist, device, group, rank, free) -> None:
    backend = group._get_backend(device)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
    if not hasattr(backend, "suspend"):
        say(rank, f"suspend: not available (torch {torch.__version__}, NCCL {nccl}: torch "
                  f"has no suspend() on process-group backends before 2.12, and NCCL has "
                  f"no ncclCommSuspend before 2.29.7)")
        return
    try:
        stats = backend.memory_stats()
    except Exception as exc:  # the library under it cannot
        say(rank, f"suspend: not available here (torch {torch.__version__}, NCCL {nccl}): "
                  f"{type(exc).__name__}: {exc}")
        return
    torch.cuda.synchronize()
    before = free()
    t0 = time.perf_counter()
    backend.suspend()
    t1 = time.perf_counter()
    after = free()
    backend.resume()
    t2 = time.perf_counter()
    back = free()
    check = torch.full((1,), rank + 1.0, device=device)
    dist.all_reduce(check, group=group)
    world = dist.get_world_size()
    say(rank, f"suspend: freed {(after - before) / 2**20:.0f} MiB in {(t1 - t0) * 1e3:.1f} "
              f"ms; resume took {(t2 - t1) * 1e3:.1f} ms and {(before - back) / 2**20:.0f} "
              f"MiB back; a collective after it right: "
              f"{check.item() == world * (world + 1) / 2}; memory_stats before: {stats}")


def _mmap_copy(backend, index: int, cpus: set[int] | None):
    """A registered mmap like offload's kept copy; its pages first touched by a thread
    bound to ``cpus`` (None: this process's threads, as offload's)."""
    from vmm_core.memory.host_memory import MappedHostCopy

    copy = MappedHostCopy(SIZE)

    def touch():
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only
        ctypes.memset(copy.base, 1, SIZE)

    worker = threading.Thread(target=touch)
    worker.start()
    worker.join()
    copy.register(backend, index)
    return copy


def _rate(backend, index: int, dev, host_address: int) -> tuple[float, float]:
    queue = backend.copy_queue(index)
    out = []
    try:
        for way in ("to_host", "from_host"):
            for rep in range(4):
                if rep == 1:
                    t0 = time.perf_counter()
                if way == "to_host":
                    queue.to_host(dev.data_ptr(), host_address, SIZE)
                else:
                    queue.from_host(host_address, dev.data_ptr(), SIZE)
                queue.wait(queue.record())
            out.append(3 * SIZE / GIB / (time.perf_counter() - t0))
    finally:
        queue.close()
    return out[0], out[1]


def copies(torch, dist, device, rank: int) -> None:
    import vmm_core

    backend = vmm_core.get_backend("cuda")
    index = device.index
    nodes = _numa_nodes()
    gpu = _gpu_node(torch, index)
    far = next((n for n in sorted(nodes) if n != gpu), None)
    say(rank, f"GPU {index} ({torch.cuda.get_device_name(index)}) on NUMA node {gpu}; host "
              f"nodes {sorted(nodes) or '?'}; this process may run on "
              f"{len(os.sched_getaffinity(0))} CPUs")
    dev = torch.empty(SIZE, dtype=torch.uint8, device=device)
    pinned = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    kinds = {"runtime pinned": (pinned, pinned.data_ptr()),
             "mmap registered": _mmap_copy(backend, index, None)}
    if gpu is not None and gpu in nodes and far is not None:
        kinds[f"mmap on GPU's node {gpu}"] = _mmap_copy(backend, index, nodes[gpu])
        kinds[f"mmap on far node {far}"] = _mmap_copy(backend, index, nodes[far])
    world = dist.get_world_size()
    for name, buf in kinds.items():
        address = buf[1] if isinstance(buf, tuple) else buf.base
        alone = None
        for turn in range(world):
            _barrier(torch, dist, device)
            if turn == rank:
                alone = _rate(backend, index, dev, address)
        _barrier(torch, dist, device)
        together = _rate(backend, index, dev, address)
        where = "" if isinstance(buf, tuple) else f"; pages {_pages_per_node(address)}"
        say(rank, f"copy into {name}: d2h / h2d GiB/s alone {alone[0]:.1f} / {alone[1]:.1f}, "
                  f"every rank at once {together[0]:.1f} / {together[1]:.1f}{where}")
    for buf in kinds.values():
        if not isinstance(buf, tuple):
            buf.release()
    kept_copy(torch, dist, device, rank, backend, gpu)


def kept_copy(torch, dist, device, rank, backend, gpu) -> None:
    """Where a real round 1 puts the kept host copy (offload's own threads)."""
    import vmm_core
    from vmm_core.memory import offload, tagged

    offload.prepare_staging(backend, device.index)
    with vmm_core.region("probe-kept", backend=backend):
        data = torch.empty(SIZE, dtype=torch.uint8, device=device).fill_(3)
    _barrier(torch, dist, device)
    t0 = time.perf_counter()
    vmm_core.sleep("probe-kept", offload="probe-kept")
    first = time.perf_counter() - t0
    offload.wait_for_pinning()
    alloc = tagged.allocators("probe-kept")[0]
    host = alloc._host_copy  # the kept copy (private: a probe reads it)
    say(rank, f"kept copy after a real round 1 ({first * 1e3:.1f} ms for 1 GiB, every rank "
              f"at once): pages {_pages_per_node(host.base)}; the GPU is on node {gpu}")
    vmm_core.wake_up("probe-kept", keep_host_buffers=False)
    ok = bool((data == 3).all())
    say(rank, f"kept copy: bytes back after the wake: {ok}")


def main() -> int:
    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else "-"
    say(rank, f"torch {torch.__version__}, NCCL {nccl}, {dist.get_world_size()} ranks")
    communicator(torch, dist, device, rank)
    if on_gpu:
        copies(torch, dist, device, rank)
    else:
        say(rank, "no GPU: the copy and kept-copy sections need one; skipped")
    _barrier(torch, dist, device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
