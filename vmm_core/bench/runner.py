"""``vmm-core bench``: dispatch to the device benchmark, or the host demo without one."""

from __future__ import annotations

from ..errors import VMMError
from ..graphs.shapes import VLLM_DECODE_SIZES
from . import report
from .host_demo import held_vs_separate, run_host_demo
from .progress import bar, bars_enabled

__all__ = ["run_bench", "check_model_on_cpu"]


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
    if "rl" in args.scenario.split(","):
        from .rl import device_only_note, run_rl_bench

        if args.scenario != "rl":
            raise VMMError(f"--scenario {args.scenario}: rl runs on its own; run "
                           f"--scenario rl separately")
        if ops is not None and ops.device_type != "cpu":
            return run_rl_bench(args, backend, sizes)
        print(device_only_note())
    if ops is not None and ops.device_type != "cpu" and args.scenario != "decode":
        from .piecewise import run_piecewise_bench

        return run_piecewise_bench(args, backend, sizes)
    sleep = args.sleep or args.sleep_only
    if ops is not None and ops.device_type != "cpu":  # a device with graphs to capture
        result = {"ok": True}
        if not args.sleep_only:
            from .graph_memory import run_device_bench

            result = run_device_bench(args, backend, sizes)
        if sleep and not args.one:
            from .sleep import run_sleep_bench

            result["sleep"] = run_sleep_bench(args, backend)
            result["ok"] = result["ok"] and result["sleep"]["ok"]
        return result
    print(f"backend {backend.name!r} ({selection.reason}).")
    if args.scenario not in ("decode", "rl"):
        print(f"--scenario {args.scenario} captures device graphs with an engine-shaped "
              f"runner; this backend has none, so the allocator scenario runs instead.")
    model = check_model_on_cpu(args, sizes) if args.model is not None else None
    why = "it has no graph API" if ops is None else "a CPU has no device graphs"
    print(f"No graphs are captured on this backend ({why}), so this runs the allocator "
          f"scenario: each shape allocates an MLP-sized working set from a new virtual "
          f"space.\n")
    draw = bars_enabled(args.quiet)
    rows = []
    for order in args.orders.split(","):
        with bar(len(sizes), f"host {order}", enabled=draw, unit="shape") as shapes:
            rows.append(run_host_demo(sizes, order, backend=backend, seed=args.seed,
                                      on_shape=shapes.update))
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
    if sleep:
        print("--sleep: sleep/wake is measured on a device backend; on the host the "
              "contract and offload tests exercise it (pytest tests -k 'sleep or offload')")
    print("\nphysical = bytes of the memfd handles (read with fstat); separate allocations "
          "would hold 'sum'.")
    sentence = held_vs_separate(rows)
    print(sentence)
    return {"schema": report.SCHEMA, "kind": "host-demo", "backend": backend.name,
            "sizes": sizes, "model": model, "rows": rows, "summary": sentence, "ok": ok}


def check_model_on_cpu(args, sizes) -> dict:
    """What a machine without device graphs can do with ``--model``: check it.

    A factory is imported, called with ``device=cpu`` and ``dtype=float32``, and its
    function run once eagerly at the largest batch, so a mistake shows before device time
    is spent.  The built-in models are only resolved: they are large for a CPU, and the
    device benchmark builds them anyway.
    """
    from .workload import (
        BUILTIN_MODELS,
        check_eager,
        check_options,
        load_workload,
        model_options,
        resolve_factory,
    )

    spec = args.model
    resolve_factory(spec)  # a bad spec fails here, before torch is imported
    if spec in BUILTIN_MODELS:
        check_options(spec, model_options(args))
        print(f"--model {spec}: a built-in model; its graphs are captured only on a device "
              f"backend (CUDA, Ascend, MLU), so it is not built here.")
        return {"name": spec, "checked": "resolved"}
    import torch

    n = max(sizes)
    workload = load_workload(spec, device="cpu", dtype=torch.float32, max_batch=n,
                             seed=args.seed, options=model_options(args))
    outputs = check_eager(workload)
    print(f"--model {spec}: built on the CPU in float32 and run once eagerly at batch {n}: "
          f"{workload.description}, outputs {', '.join(map(str, map(list, outputs)))}. Its "
          f"graphs are captured only on a device backend (CUDA, Ascend, MLU); the scenario "
          f"below does not use it.")
    return {"name": spec, "checked": "built on the CPU and run eagerly",
            "description": workload.description, "outputs": [list(o) for o in outputs]}
