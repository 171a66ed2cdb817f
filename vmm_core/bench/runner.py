"""``vmm-core bench``: dispatch to the device benchmark, or the host demo without one."""

from __future__ import annotations

from .host_demo import run_host_demo
from ..graphs.shapes import VLLM_DECODE_SIZES

__all__ = ["run_bench"]


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def run_bench(args) -> dict:
    import vmm_core

    if getattr(args, "distributed", False):
        from .distributed import run_distributed_bench

        return run_distributed_bench(args)
    selection = vmm_core.select_backend(args.backend)
    backend = selection.backend
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else VLLM_DECODE_SIZES
    ops = backend.graph_ops(0)
    if ops is not None and ops.device_type != "cpu":  # a device with graphs to capture
        from .graph_memory import run_device_bench

        result = run_device_bench(args, backend, sizes)
        if args.sleep and not args.one:
            from .sleep import run_sleep_bench

            result["sleep"] = run_sleep_bench(args, backend)
            result["ok"] = result["ok"] and result["sleep"]["ok"]
        return result
    print(f"backend {backend.name!r} ({selection.reason}).")
    why = "it has no graph API" if ops is None else "a CPU has no device graphs"
    print(f"No graphs are captured on this backend ({why}), so this runs the allocator "
          f"scenario: each shape allocates an MLP-sized working set from a new virtual "
          f"space.\n")
    rows = [run_host_demo(sizes, order, backend=backend, seed=args.seed)
            for order in args.orders.split(",")]
    print(f"{'order':11s} {'shapes':>6s} {'physical MiB':>12s} {'max set MiB':>11s} "
          f"{'sum MiB':>9s} {'phys/max':>8s} {'sum/max':>7s} {'handles':>7s} "
          f"{'switch ms':>9s} aliased")
    for r in rows:
        print(f"{r['order']:11s} {r['shapes']:6d} {_mib(r['physical_bytes']):>12s} "
              f"{_mib(r['largest_working_set_bytes']):>11s} "
              f"{_mib(r['sum_of_working_sets_bytes']):>9s} {r['ratio_to_largest']:8.3f} "
              f"{r['ratio_sum_to_largest']:7.1f} {r['handles']:7d} "
              f"{r['switch_ms_median']:9.3f} {r['aliasing_verified']}")
    ok = all(r["aliasing_verified"] for r in rows)
    if args.sleep:
        print("--sleep: sleep/wake is measured on a device backend; on the host the "
              "contract and sleep tests exercise it (pytest tests -k sleep)")
    print("\nphysical = bytes of the memfd handles (read with fstat); separate allocations "
          "would hold 'sum'.")
    return {"mode": "host-demo", "backend": backend.name, "rows": rows, "ok": ok}
