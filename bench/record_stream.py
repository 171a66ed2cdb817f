"""``vmm-core bench --scenario record-stream``: what ``graph_capture_record_stream_reuse``
(PyTorch PR 158352, torch >= 2.9) saves, on the pattern it exists for.

Layers each make a large temporary on the main stream that a side stream reads
(``record_stream``) before the main stream joins it (:class:`.models.SideStreamStack`).
During a capture the caching allocator keeps such a block out of reuse until the capture
ends, so one graph holds a temporary per layer; with the flag the join frees it.  Four
configurations, each in its own process, one graph at the largest size: plain
``torch.cuda.graph`` (private pool) and a GraphPool space
(``pool.space(key, record_stream_reuse=...)``), flag off and on.  ``--layers`` sets the
layers (default 16); the temporaries are 64 MiB.
"""

from __future__ import annotations

from .measure import GrowthRecorder, open_device
from .models import SideStreamStack
from .spec import BenchSpec
from .workload import relative_error

__all__ = ["run_one_record_stream", "print_record_stream", "LAYERS", "TEMP_BYTES"]

LAYERS = 16
TEMP_BYTES = 64 << 20


def run_one_record_stream(config: str, spec: BenchSpec) -> dict:
    """Child process: ``record-stream:{torch,vmm}-{off,on}:-``."""
    import torch

    import vmm_core

    _, strategy, _ = config.split(":")
    where, flag = strategy.split("-")
    on = flag == "on"
    backend, ops, mod, dev, memory = open_device(spec.backend)
    size = max(spec.sizes)
    layers = spec.model.options.get("layers", LAYERS)
    model = SideStreamStack(layers=layers, temp_bytes=TEMP_BYTES, device=dev,
                            dtype=getattr(torch, spec.model.dtype), seed=spec.seed)
    x = torch.zeros(size, model.hidden, device=dev, dtype=model.dtype)
    pool = vmm_core.GraphPool(0, backend=backend, reads=()) if where == "vmm" else None
    ops.warmup(lambda: model(x))
    graph = ops.new_graph()
    recorder = GrowthRecorder(memory.used_bytes, ops.synchronize)
    holder: dict = {}

    def capture():
        if pool is None:
            with ops.record_stream_reuse(on):
                holder["out"] = ops.capture(graph, lambda: model(x), None)
        else:
            with pool.space("step", record_stream_reuse=on) as handle:
                holder["out"] = ops.capture(graph, lambda: model(x), handle)
                pool.keep(holder["out"])
    recorder.capture(capture)
    fresh = torch.randn(size, model.hidden, device=dev, dtype=model.dtype)
    x.copy_(fresh)
    if pool is not None:
        with pool.replaying("step"):
            graph.replay()
    else:
        graph.replay()
    err = relative_error(holder["out"].float(), model(fresh).float())
    return {
        "scenario": "record-stream", "strategy": strategy, "order": "-", "graphs": 1,
        "graph_bytes": recorder.total_bytes, "growth_bytes": recorder.growth_bytes,
        "largest_space_bytes": pool.stats()["largest_space_bytes"] if pool else None,
        "capture_s": recorder.capture_s, "wrong_graphs": [] if err <= 0.02 else [[size, err]],
        "worst_rel_err": err,
        "model_description": f"{layers} layers, each a {TEMP_BYTES >> 20} MiB temporary read "
                             f"by a side stream (record_stream) before the join; batch {size}",
        "torch": torch.__version__, "device": mod.get_device_name(dev),
    }


def print_record_stream(rows) -> None:
    by = {r["strategy"]: r for r in rows if "error" not in r}
    print("one graph; graph_capture_record_stream_reuse off and on, plain torch.cuda.graph "
          "(private pool) and a GraphPool space")
    for name in ("torch-off", "torch-on", "vmm-off", "vmm-on"):
        r = by.get(name)
        if r is None:
            if any(x.get("strategy") == name for x in rows):
                print(f"  {name:9s}: FAILED")
            continue
        space = r.get("largest_space_bytes")
        extra = f", GraphPool space {space / 2**20:.0f} MiB" if space else ""
        print(f"  {name:9s}: graph memory {r['graph_bytes'] / 2**20:.0f} MiB{extra}, "
              f"relative error {r['worst_rel_err']:.1e}, {len(r['wrong_graphs'])} wrong")
    for where in ("torch", "vmm"):
        off, on = by.get(f"{where}-off"), by.get(f"{where}-on")
        if off and on and off["graph_bytes"] > 0:
            print(f"  {where}: the flag takes graph memory from {off['graph_bytes'] / 2**20:.0f}"
                  f" to {on['graph_bytes'] / 2**20:.0f} MiB")
