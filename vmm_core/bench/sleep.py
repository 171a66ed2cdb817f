"""``vmm-core bench --sleep``: sleep/wake time and bandwidth against the pinned limit."""

from __future__ import annotations

import time

__all__ = ["run_sleep_bench"]


def _gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / 2**30 / seconds if seconds > 0 else float("inf")


def _pinned_limit(mod, device, size: int) -> tuple[float, float]:
    """Pinned host<->device copy bandwidth (GiB/s) measured now, on this machine."""
    import torch

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        mod.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        mod.synchronize()
        out.append(_gib_s(3 * size, time.perf_counter() - t0))
    del host, dev
    return out[0], out[1]


def run_sleep_bench(args, backend) -> dict:
    import torch

    import vmm_core

    size = int(args.sleep_gib * 2**30)
    ops = backend.graph_ops(0)
    mod = getattr(torch, ops.device_type)  # torch.cuda, torch.npu, torch.mlu
    device = ops.torch_device
    d2h, h2d = _pinned_limit(mod, device, size)
    tag = "bench-offload"
    with vmm_core.region(tag, backend=backend):
        t = torch.empty(size // 4, dtype=torch.float32, device=device)
    t.normal_()
    ref = t.clone()
    rows = []
    for label in ("first (pins host buffers)", "again (kept host buffers)"):
        mod.synchronize()
        free0 = mod.mem_get_info()[0]
        t0 = time.perf_counter()
        vmm_core.sleep(tag, offload=tag)
        t1 = time.perf_counter()
        freed = mod.mem_get_info()[0] - free0
        vmm_core.wake_up(tag, keep_host_buffers=True)
        mod.synchronize()
        t2 = time.perf_counter()
        ok = bool(torch.equal(t, ref))
        rows.append({"round": label, "sleep_s": t1 - t0, "wake_s": t2 - t1,
                     "sleep_gib_s": _gib_s(size, t1 - t0), "wake_gib_s": _gib_s(size, t2 - t1),
                     "freed_bytes": freed, "bytes_restored": ok})
    vmm_core.sleep(tag)  # discard and drop host buffers
    vmm_core.wake_up(tag)
    del t, ref

    # discard sleep + wake of a 1 GiB graph pool mapped into 51 spaces, as executors
    # configure it: wake maps the current space, each graph maps its own on first replay
    pool = vmm_core.SharedVMMAllocator(backend, scratch=True)
    pool.lazy_wake = True
    pool.extend_mapping(1 << 30)
    for _ in range(50):
        pool.switch_to_new_virtual_space()
    mod.synchronize()
    t0 = time.perf_counter()
    pool.sleep()
    t1 = time.perf_counter()
    pool.wake()
    t2 = time.perf_counter()
    for index in pool.space_indices():
        pool.ensure_mapped(index)
    t3 = time.perf_counter()
    graph_pool = {"bytes": 1 << 30, "spaces": pool.num_virtual_spaces,
                  "handles": pool.num_handles, "sleep_ms": 1e3 * (t1 - t0),
                  "wake_ms": 1e3 * (t2 - t1),
                  "first_replay_map_ms_per_space": 1e3 * (t3 - t2) / (pool.num_virtual_spaces - 1)}
    pool.close()

    tms = _torch_memory_saver(size) if ops.device_type == "cuda" else \
        {"note": "torch_memory_saver supports CUDA only"}
    print(f"\nsleep/wake of {args.sleep_gib:g} GiB tagged memory, offloaded to pinned host "
          f"memory ({mod.get_device_name(0)}, torch {torch.__version__})")
    print(f"pinned copy limit measured now: device->host {d2h:.1f} GiB/s, host->device "
          f"{h2d:.1f} GiB/s")
    for r in rows:
        print(f"  {r['round']:27s} sleep {r['sleep_s'] * 1e3:8.1f} ms ({r['sleep_gib_s']:5.1f} "
              f"GiB/s, {r['sleep_gib_s'] / d2h:4.0%} of limit)  wake {r['wake_s'] * 1e3:8.1f} ms "
              f"({r['wake_gib_s']:5.1f} GiB/s, {r['wake_gib_s'] / h2d:4.0%})  freed "
              f"{r['freed_bytes'] / 2**30:.2f} GiB  bytes restored: {r['bytes_restored']}")
    print(f"discard sleep + wake of a 1 GiB graph pool in {graph_pool['spaces']} spaces "
          f"({graph_pool['handles']} handle): sleep {graph_pool['sleep_ms']:.2f} ms, wake "
          f"{graph_pool['wake_ms']:.2f} ms (+{graph_pool['first_replay_map_ms_per_space']:.3f}"
          f" ms per other space, paid by its graph's first replay)")
    if "rounds" in tms:
        for i, r in enumerate(tms["rounds"]):
            print(f"torch_memory_saver 0.0.10 (torch mode), round {i + 1}: pause "
                  f"{r['pause_s'] * 1e3:8.1f} ms ({r['pause_gib_s']:5.1f} GiB/s)  resume "
                  f"{r['resume_s'] * 1e3:8.1f} ms ({r['resume_gib_s']:5.1f} GiB/s)  bytes "
                  f"restored: {r['bytes_restored']}")
    else:
        print(f"torch_memory_saver: {tms['note']}")
    return {"pinned_d2h_gib_s": d2h, "pinned_h2d_gib_s": h2d, "offload": rows,
            "graph_pool_discard": graph_pool, "torch_memory_saver": tms,
            "ok": all(r["bytes_restored"] for r in rows)}


def _torch_memory_saver(size: int) -> dict:
    """The same offload round trip through torch_memory_saver (torch hook mode), if present."""
    try:
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError:
        return {"note": "not installed here; no comparison made"}
    import torch

    try:
        tms.hook_mode = "torch"
        with tms.region(tag="bench", enable_cpu_backup=True):
            t = torch.empty(size // 4, dtype=torch.float32, device="cuda")
        t.normal_()
        ref = t.clone()
        rounds = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tms.pause("bench")
            t1 = time.perf_counter()
            tms.resume("bench")
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            rounds.append({"pause_s": t1 - t0, "resume_s": t2 - t1,
                           "pause_gib_s": _gib_s(size, t1 - t0),
                           "resume_gib_s": _gib_s(size, t2 - t1),
                           "bytes_restored": bool(torch.equal(t, ref))})
        return {"rounds": rounds}
    except Exception as exc:  # a third-party tool failing must not fail our bench
        return {"note": f"failed: {type(exc).__name__}: {exc}"}
