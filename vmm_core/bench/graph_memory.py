"""The device benchmark: graph memory of 51 decode sizes, private vs shared vs vmm.

Each configuration runs in a fresh process (so no pool, workspace or cache of one run
leaks into the next) and prints one JSON line; the parent tabulates ratios against the
largest shape captured alone.  Every graph is checked against eager after all captures,
in a shuffled order, on fresh random inputs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

__all__ = ["run_device_bench", "run_one"]

#: relative error above which a graph counts as wrong (bf16 graphs vs eager are ~1e-3;
#: the aliasing hazard gave 0.30)
WRONG_ABOVE = 0.02


def _order(sizes, order, seed):
    sizes = sorted(sizes)
    if order == "descending":
        return sizes[::-1]
    if order == "random":
        random.Random(seed).shuffle(sizes)
    return sizes


def run_one(spec: str, args) -> dict:
    """Child process: one (mode, order) configuration on the device."""
    import torch

    import vmm_core
    from vmm_core.bench.models import DecodeMLP

    mode, order = spec.split(":")
    backend = vmm_core.get_backend(args.backend)
    ops = backend.graph_ops(0)
    mod = getattr(torch, ops.device_type)  # torch.cuda, torch.npu, torch.mlu
    from vmm_core.graphs.shapes import VLLM_DECODE_SIZES

    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else VLLM_DECODE_SIZES
    torch.manual_seed(args.seed)
    dev = ops.torch_device
    model = DecodeMLP(args.hidden, args.ffn, args.layers, device=dev, seed=args.seed)
    max_n = max(sizes)
    buckets = [max_n] if mode == "alone" else sizes
    reuse = "private" if mode == "alone" else mode
    x0 = torch.randn(max_n, args.hidden, device=dev, dtype=model.dtype)
    model(x0)  # cuBLAS handles and the default stream's workspace exist before measuring
    mod.synchronize()
    mod.empty_cache()  # measure held memory, not what the caching allocator keeps
    free_before = mod.mem_get_info(dev)[0]
    ex = vmm_core.GraphExecutor(model, x0, buckets=buckets, reuse=reuse, backend=backend)
    t0 = time.perf_counter()
    ex.capture_all(_order(buckets, order, args.seed))
    mod.synchronize()
    capture_s = time.perf_counter() - t0
    mod.empty_cache()
    free_after = mod.mem_get_info(dev)[0]
    graph_bytes = free_before - free_after

    # correctness: every graph, shuffled, fresh inputs, against eager
    check = list(buckets)
    random.Random(args.seed + 1).shuffle(check)
    worst, wrong = 0.0, []
    for b in check:
        n = b if b < 3 else random.Random(b).randint(b // 2 + 1, b)
        x = torch.randn(n, args.hidden, device=dev, dtype=model.dtype)
        got = ex(x).float()
        ref = model(x).float()
        err = ((got - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        if not err <= WRONG_ABOVE:
            wrong.append((b, err))

    # replay time: every bucket, several rounds, device time between events
    inputs = {b: torch.randn(b, args.hidden, device=dev, dtype=model.dtype) for b in buckets}
    for b in buckets:
        ex(inputs[b])
    mod.synchronize()
    start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
    rounds = 5
    start.record()
    for _ in range(rounds):
        for b in buckets:
            ex(inputs[b])
    end.record()
    mod.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / (rounds * len(buckets))
    stats = ex.stats()
    alloc = ex.allocator
    switches = sorted(alloc.switch_seconds) if alloc else []
    return {
        "mode": mode, "order": order, "graphs": len(buckets),
        "graph_bytes": graph_bytes, "capture_s": capture_s, "replay_us": replay_us,
        "wrong_graphs": wrong, "worst_rel_err": worst,
        "physical_bytes": stats["physical_bytes"], "handles": stats["handles"],
        "switch_ms_median": 1e3 * switches[len(switches) // 2] if switches else None,
        "switch_ms_max": 1e3 * switches[-1] if switches else None,
        "compact_ms_total": 1e3 * stats["compact_seconds"],
        "phase_ms": {k: 1e3 * v for k, v in stats["phase_seconds"].items()},
        "space_bytes": stats["space_bytes"],
        "reserved_bytes": mod.memory_reserved(dev),
        "torch": torch.__version__, "device": mod.get_device_name(dev),
    }


def run_device_bench(args, backend, sizes) -> dict:
    if args.one:
        result = run_one(args.one, args)
        print("VMMBENCH " + json.dumps(result))
        return {"ok": not result["wrong_graphs"], **result}
    specs = ["alone:ascending"] + [f"{m}:{o}" for m in args.modes.split(",")
                                    for o in args.orders.split(",")]
    results = []
    for spec in specs:
        cmd = [sys.executable, "-m", "vmm_core.cli", "bench", "--one", spec,
               "--backend", backend.name,
               "--layers", str(args.layers), "--hidden", str(args.hidden),
               "--ffn", str(args.ffn), "--seed", str(args.seed),
               "--sizes", ",".join(map(str, sizes))]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("VMMBENCH ")]
        if proc.returncode not in (0, 1) or not line:
            print(f"{spec}: child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            results.append({"mode": spec.split(':')[0], "order": spec.split(':')[1],
                            "error": proc.stderr[-3000:]})
            continue
        r = json.loads(line[-1][len("VMMBENCH "):])
        results.append(r)
        print(f"  done {spec}: {r['graph_bytes'] / 2**20:.0f} MiB, "
              f"{len(r['wrong_graphs'])} wrong", flush=True)
    _print_table(results)
    if args.plot:
        _plot(results, args.plot)
    ok = all("error" not in r and not r["wrong_graphs"] for r in results)
    return {"mode": "device", "backend": backend.name, "sizes": sizes, "results": results,
            "ok": ok}


def _print_table(results) -> None:
    alone = next((r for r in results if r.get("mode") == "alone" and "error" not in r), None)
    shared = {r["order"]: r for r in results if r.get("mode") == "shared" and "error" not in r}
    base = alone["graph_bytes"] if alone else None
    first = next((r for r in results if "error" not in r), {})
    print(f"\n{first.get('device', '?')}, torch {first.get('torch', '?')}; "
          f"graph memory = drop of mem_get_info free bytes over all captures")
    print(f"{'mode':8s} {'order':11s} {'graphs':>6s} {'MiB':>8s} {'x alone':>7s} "
          f"{'capture s':>9s} {'x shared':>8s} {'replay us':>9s} {'x shared':>8s} "
          f"{'switch ms':>9s} {'wrong':>5s} {'max err':>8s}")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:8s} {r['order']:11s} FAILED")
            continue
        sh = shared.get(r["order"])
        ratio = f"{r['graph_bytes'] / base:7.2f}" if base else "      -"
        cap = f"{r['capture_s'] / sh['capture_s']:8.2f}" if sh else "       -"
        rep = f"{r['replay_us'] / sh['replay_us']:8.3f}" if sh and r["mode"] != "alone" \
            else "       -"
        if r["mode"] == "alone":
            cap = "       -"
        sw = f"{r['switch_ms_median']:9.3f}" if r.get("switch_ms_median") is not None else \
            "        -"
        print(f"{r['mode']:8s} {r['order']:11s} {r['graphs']:6d} "
              f"{r['graph_bytes'] / 2**20:8.1f} {ratio} {r['capture_s']:9.2f} {cap} "
              f"{r['replay_us']:9.1f} {rep} {sw} {len(r['wrong_graphs']):5d} "
              f"{r['worst_rel_err']:8.1e}")


def _plot(results, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install 'vmm_core[plot]' for --plot")
        return
    ok = [r for r in results if "error" not in r]
    labels = [f"{r['mode']}\n{r['order'][:4]}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, len(ok) * 0.9), 4))
    ax.bar(labels, [r["graph_bytes"] / 2**20 for r in ok])
    ax.set_ylabel("graph memory (MiB)")
    ax.set_yscale("log")
    ax.set_title("vmm_core: device memory of all captured graphs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
