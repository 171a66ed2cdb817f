"""``vmm-core bench``: dispatch to the device benchmark, or the host demo without one."""

from __future__ import annotations

from ..graphs.shapes import VLLM_DECODE_SIZES
from . import scenarios
from .host_demo import run_host_bench

__all__ = ["run_bench", "check_model_on_cpu"]


def _need_extras(names: list[str]) -> None:
    """Refuse a scenario whose optional packages are missing before any child starts."""
    from ..cli import _need

    for name in names:
        extra = scenarios.SCENARIOS[name].extra
        if extra == "bench":
            _need("transformers", extra, f"--scenario {name}")


def run_bench(args) -> dict:
    import vmm_core

    if getattr(args, "distributed", False):
        from .distributed import run_distributed_bench

        return run_distributed_bench(args)
    selection = vmm_core.select_backend(args.backend)
    backend = selection.backend
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else VLLM_DECODE_SIZES
    ops = backend.graph_ops(0)
    names = scenarios.parse(args.scenario or scenarios.DEFAULT)
    if ops is not None and ops.device_type != "cpu" and names != [scenarios.DEFAULT]:
        _need_extras(names)
        if not args.one:  # flags these scenarios do not use: one line each
            chosen = [scenarios.SCENARIOS[n] for n in names]
            if (args.sleep or args.sleep_only) and not any(s.uses_sleep for s in chosen):
                print(f"note: --sleep{'-only' if args.sleep_only else ''}: scenario "
                      f"{args.scenario} does not measure sleep/wake (--scenario decode "
                      f"does); ignored")
            if args.model is not None and not any(s.uses_model for s in chosen):
                print(f"note: --model {args.model}: scenario {args.scenario} builds its own "
                      f"model (--scenario decode takes --model); ignored")
        return scenarios.runner(names)(args, backend, sizes)
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
    return run_host_bench(args, selection, sizes)


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

    from ..errors import BenchModelError

    n = max(sizes)
    workload = load_workload(spec, device="cpu", dtype=torch.float32, max_batch=n,
                             seed=args.seed, options=model_options(args))
    try:
        outputs = check_eager(workload)
    except BenchModelError:
        raise
    except Exception as exc:  # the user's function: one line, the CLI's model exit code
        raise BenchModelError(f"--model {spec!r}: the function the factory returned raised "
                              f"{type(exc).__name__} when run eagerly at batch {n}: "
                              f"{exc}") from exc
    print(f"--model {spec}: built on the CPU in float32 and run once eagerly at batch {n}: "
          f"{workload.description}, outputs {', '.join(map(str, map(list, outputs)))}. Its "
          f"graphs are captured only on a device backend (CUDA, Ascend, MLU); the scenario "
          f"below does not use it.")
    return {"name": spec, "checked": "built on the CPU and run eagerly",
            "description": workload.description, "outputs": [list(o) for o in outputs]}
