"""``vmm-core bench --scenario rl``: the RL colocation step, round after round.

RL frameworks (verl, slime, OpenRLHF) put the inference engine to sleep every training
step and wake it for the next rollout: weights offloaded to host, KV cache and graph
memory discarded, training runs in the freed memory, new weights are written in place,
and the captured graphs must work again.  This runs ``--steps`` such steps (default 5) of
an engine-shaped loop on the Llama stack, each strategy in a fresh child process on the
same model, sizes and seed:

``vmm``
    vmm_core: weights in ``region("weights")``, the KV cache in ``region("kv")``, the
    piecewise graphs in a :class:`vmm_core.GraphPool` (tag "graph") captured once.  Sleep
    offloads the weights (the host copy is kept and pinned after round 1:
    :mod:`vmm_core.offload`) and discards kv and graph memory; graphs replay after
    wake without recapture.
``vllm``
    vLLM's sleep(level=1): ``Worker.sleep`` (``vllm/v1/worker/gpu_worker.py``) calls
    ``CuMemAllocator.sleep(offload_tags=("weights",))`` (``vllm/device_allocator/
    cumem.py``), which at every sleep makes a pinned CPU tensor per allocation of the
    tagged pools (``torch.empty(..., pin_memory=True)``), copies into it synchronously
    (``cudaMemcpy``) and unmaps and releases the pages; ``wake_up`` re-creates them,
    copies back and drops the CPU tensors.  Graphs are captured outside those pools, into
    one shared graph pool, so graph memory stays resident.  Here the pages are vmm_core
    regions (the same unmap/release mechanism) and the copies are made as vLLM makes
    them (a pinned tensor from torch's caching host allocator, a synchronous copy, then
    ``gc.collect()`` and ``empty_cache()``), with one difference: vLLM backs up each
    *allocation* of its pool (a whole caching-allocator segment, ``pointer_to_data``),
    this one each live weight tensor.  For these models each large weight tensor is a
    segment of its own; the small ones (norms, rotary tables) share one, and vLLM frees
    segments left empty at the end of ``use_memory_pool``: bytes copied and copies made
    differ by little.
``recapture``
    vLLM's way, but the graphs and their pool are released at sleep and captured again
    at wake: graph memory is freed, at the price of the recapture.
``tms-compat``
    vmm_core's torch_memory_saver API (:mod:`vmm_core.integrations.torch_memory_saver`)
    called as SGLang calls it: weights in ``region("weights", enable_cpu_backup=True)``,
    the KV cache in ``region("kv_cache")``, every graph captured through
    ``cuda_graph(..., tag="cuda_graph", enable_cpu_backup=True)`` into one global pool;
    sleep pauses kv_cache, weights, cuda_graph and wake resumes cuda_graph, weights,
    kv_cache, one call per tag as SGLang's scheduler makes them.
``vllm-plugin``
    vmm_core's ``MemAllocator`` (:mod:`vmm_core.integrations.vllm`) called as vLLM's GPU
    worker calls its allocator: weights under ``use_memory_pool(tag="weights")``, the KV
    cache under ``"kv_cache"``, sleep through the ``vmm`` backend's ``suspend(level=1)``,
    wake ``resume(["weights"])`` then ``resume(["kv_cache"])``; graph memory resident, as
    vLLM keeps it with this backend.
``tms``
    torch_memory_saver when importable (torch hook mode): weights in a region with CPU
    backup, the KV cache in a paused region; graphs in a shared pool, resident (this
    runner does not route captures through its ``cuda_graph`` wrapper).

Per step and strategy: device memory freed by sleep, sleep and wake time, the time from
wake to the first correct replay (recapture included), host memory held while awake,
recaptures, and every size checked against eager after the in-place weight update.
Round 1 and rounds 2..N are reported apart, and the vllm-plugin strategy is judged
against vllm in both (:func:`.rl_report._targets`).  ``--strategies`` picks some
(:data:`.rl_strategies.STRATEGIES`).  Needs a device backend.

Under ``torchrun --nproc-per-node N`` every rank runs the vmm loop on its own device, with
``vmm_core.sleep(..., group=pg)`` and ``vmm_core.wake_up(group=pg)`` (every rank sleeps or
none does): :mod:`.rl_group`.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from . import report
from .children import run_configurations
from .group_run import arrival, group_timings
from .measure import open_device, ordered
from .piecewise import WRONG_ABOVE
from .piecewise_runners import PiecewiseRunner
from .progress import bars_enabled, say
from .rl_report import _HEADER, _ok, _plot, _print, _rows, _summarize, _targets
from .rl_strategies import STRATEGIES, check_strategies
from .spec import BenchSpec, ModelSpec, RLSpec
from .workload import EXIT_BAD_MODEL, check_options, llama_model, relative_error

__all__ = ["DEFAULT_STEPS", "run_rl_bench", "run_one_rl", "run_child",
           "small_spec"]  # the strategies: .rl_strategies; the torchrun variant: .rl_group

DEFAULT_STEPS = RLSpec.steps
#: the training-like allocation takes this share of what the sleep freed
TRAIN_SHARE = 0.9
#: the KV cache region holds at least this much (engines give it most of the device)
KV_MIN_BYTES = 2 << 30
GIB = 2**30


class _Model:
    """The Llama stack with its weights in the engine's weights region and a KV cache
    (the attention's cache plus the rest of a KV block pool) in its kv region."""

    def __init__(self, torch, engine, options, dtype, sizes, seed) -> None:
        from .models import LlamaStack

        dev = engine.dev
        with engine.weights_region():
            # max_batch=1: the stack's own cache is tiny here; the real one is made below
            self.stack = LlamaStack(**options, device=dev, dtype=dtype, seed=seed,
                                    max_batch=1)
        stack = self.stack
        mod = getattr(torch, torch.device(dev).type)
        free = mod.mem_get_info()[0]
        gen = torch.Generator(device=dev).manual_seed(seed + 7)
        with engine.kv_region():
            shape = (max(sizes), stack.kv_heads, options["ctx"], stack.head_dim)
            stack.cache = [(torch.randn(shape, generator=gen, device=dev, dtype=dtype),
                            torch.randn(shape, generator=gen, device=dev, dtype=dtype))
                           for _ in stack.layers]
            used = sum(2 * k.numel() * k.element_size() for k, _ in stack.cache)
            rest = max(0, min(KV_MIN_BYTES, int(0.25 * free)) - used)
            self.kv_pool = torch.empty(rest, dtype=torch.uint8, device=dev)
        stack.max_batch = max(sizes)
        self.kv_bytes = used + rest
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.weight_tensors())
        if not all(t.is_contiguous() for t in self.weight_tensors()):
            raise ValueError("rl: every weight tensor must be contiguous to be backed up "
                             "the way vLLM backs up an allocation")
        self.gen, self.torch = gen, torch

    def weight_tensors(self):
        """Every live tensor of the weights region (what vLLM's per-allocation backup
        covers): the parameters and buffers, and the rotary tables."""
        for layer in self.stack.layers:
            yield from layer.parameters()
            yield from layer.buffers()
        yield self.stack.cos
        yield self.stack.sin

    def refill_kv(self) -> None:
        """After a wake the cache holds whatever the pages held: the engine rebuilds it."""
        for k, v in self.stack.cache:
            k.normal_(generator=self.gen)
            v.normal_(generator=self.gen)

    def update_weights(self) -> None:
        """The trainer's new weights, written in place (same addresses)."""
        torch = self.torch
        with torch.no_grad():
            for layer in self.stack.layers:
                for p in layer.parameters():
                    noise = torch.randn(p.shape, generator=self.gen, device=p.device,
                                        dtype=p.dtype)
                    p.add_(noise, alpha=0.01)


class _CountingRunner(PiecewiseRunner):
    captured = 0

    def capture(self, size: int) -> None:
        super().capture(size)
        self.captured += self.model.num_pieces


class _Loop:
    """The engine's graphs: a pool and a piecewise runner, captured once (or again)."""

    def __init__(self, torch, engine, model, sizes, discipline: str | None = None) -> None:
        self.torch, self.engine, self.model, self.sizes = torch, engine, model, sizes
        # vLLM's reference discipline (bench/peers.py): non-owning entries; on GraphPool
        # the same discipline without keep()
        self.discipline = discipline or engine.discipline
        self.pool: Any = None
        self.runner: Any = None
        self.capture_all()

    def capture_all(self) -> int:
        torch, stack = self.torch, self.model.stack
        self.pool = self.engine.new_pool()
        self.runner = _CountingRunner(stack, self.pool, self.sizes, self.discipline)
        x_max = torch.randn(max(self.sizes), stack.hidden, device=stack.device,
                            dtype=stack.dtype)
        stack(x_max)
        self.pool.warmup(lambda: stack(x_max))
        for size in ordered(self.sizes, "descending"):  # largest first, as engines do
            self.runner.capture(size)
        if self.pool.allocator is not None:
            self.pool.compact()
        return self.runner.captured

    def drop_graphs(self) -> None:
        """Release every graph and the pool's memory (what a recapturing engine does)."""
        self.runner.entries.clear()
        self.pool.close()
        self.runner = self.pool = None
        gc.collect()
        mod = getattr(self.torch, self.torch.device(self.model.stack.device).type)
        mod.synchronize()
        getattr(mod, "empty_cache", lambda: None)()  # torch.cpu has none (host tests)

    def check(self, seed: int) -> tuple[float, list]:
        """Every size against eager on fresh inputs (the worst error, the wrong sizes)."""
        torch, stack = self.torch, self.model.stack
        gen = torch.Generator(device=stack.device).manual_seed(seed)
        worst, wrong = 0.0, []
        for size in self.sizes:
            x = torch.randn(size, stack.hidden, generator=gen, device=stack.device,
                            dtype=stack.dtype)
            err = relative_error(self.runner(x), stack(x))
            worst = max(worst, err)
            if not err <= WRONG_ABOVE:
                wrong.append([size, err])
        return worst, wrong


# ---------------------------------------------------------------------- one strategy
def run_one_rl(config: str, spec: BenchSpec, device: int = 0, group=None) -> dict:
    """Child process (or one torchrun rank): ``rl:<strategy>`` for ``spec.rl.steps``."""
    import torch

    strategy = config.split(":")[1]
    backend, _, mod, dev, _ = open_device(spec.backend, device)
    mod.set_device(device)  # regions and pools follow the current device
    sizes = sorted(set(spec.sizes))
    name = llama_model(spec.model.name, "rl")
    options = check_options(name, spec.model.options)
    steps = spec.rl.steps
    engine = STRATEGIES[strategy].engine(torch, backend, dev)
    engine.group = group
    limits, rank_limits = None, None
    if engine.uses_offload:  # the pinned copy limit, measured in this run
        from .sleep import _pinned_limit

        if group is None:
            limits = _pinned_limit(backend, mod, dev, GIB)
        else:  # every rank's own: alone, and with every rank copying at once
            from .group_run import rank_limits as measure_ranks

            rank_limits = measure_ranks(lambda: _pinned_limit(backend, mod, dev, GIB), mod,
                                        dev)
            limits = rank_limits[torch.distributed.get_rank()]["alone"]
    if engine.uses_offload:
        from vmm_core import offload

        offload.prepare_staging(backend, device)
    model = _Model(torch, engine, options, getattr(torch, spec.model.dtype), sizes, spec.seed)
    t0 = time.perf_counter()
    loop = _Loop(torch, engine, model, sizes)
    capture_s = time.perf_counter() - t0
    worst0, wrong0 = loop.check(spec.seed)
    rows = []
    arrive = arrival(group, mod, dev)
    for step in range(1, steps + 1):
        mod.synchronize()
        free0 = mod.mem_get_info()[0]
        waited = arrive()  # a group: every rank here before the timed sleep (apart)
        graphs_awake = engine.graph_memory()
        t0 = time.perf_counter()
        engine.sleep(model)
        engine.release_graphs(loop)
        mod.synchronize()
        t1 = time.perf_counter()
        graphs_asleep = engine.graph_memory()
        sleep_phases = group_timings(group, "sleep")
        freed = mod.mem_get_info()[0] - free0
        train_ok = _train(torch, mod, dev, int(TRAIN_SHARE * max(0, freed)))
        waited += arrive()
        t2 = time.perf_counter()
        engine.wake(model)
        mod.synchronize()
        t3 = time.perf_counter()
        wake_phases = group_timings(group, "wake_up")
        host_awake = engine.host_bytes_awake(mod)
        tags_awake = engine.tag_summary()
        model.update_weights()
        model.refill_kv()
        x = torch.randn(max(sizes), model.stack.hidden, device=dev, dtype=model.stack.dtype)
        mod.synchronize()
        captured = loop.runner.captured if loop.runner is not None else 0
        t4 = time.perf_counter()
        engine.after_wake(loop)
        out = loop.runner(x)
        mod.synchronize()
        t5 = time.perf_counter()
        recaptured = loop.runner.captured - captured  # a new runner after a recapture
        first_err = relative_error(out, model.stack(x))
        worst, wrong = loop.check(spec.seed + step)
        row = {"step": step, "freed_bytes": freed, "sleep_s": t1 - t0, "wake_s": t3 - t2,
               "first_replay_s": t5 - t4, "first_replay_ok": first_err <= WRONG_ABOVE,
               "host_bytes_awake": host_awake, "tags_awake": tags_awake,
               "recaptured_graphs": recaptured,
               "train_bytes": int(TRAIN_SHARE * max(0, freed)), "train_ok": train_ok,
               "worst_rel_err": worst, "wrong_sizes": wrong,
               "step_s": (t1 - t0) + (t3 - t2) + (t5 - t4)}
        if graphs_asleep is not None:
            row.update(graph_memory_awake=graphs_awake, graph_memory_asleep=graphs_asleep)
        if group is not None:
            row.update(arrival_wait_s=waited, sleep_phases=sleep_phases,
                       wake_phases=wake_phases)
        rows.append(row)
        print(f"  {strategy} step {step}: freed {freed / GIB:.2f} GiB, sleep "
              f"{row['sleep_s'] * 1e3:.1f} ms, wake {row['wake_s'] * 1e3:.1f} ms, first "
              f"replay {row['first_replay_s'] * 1e3:.1f} ms, {len(wrong)} wrong",
              flush=True)
    staging = None
    if engine.uses_offload:
        from vmm_core import offload

        staging = offload.staging_bytes()
    return {"scenario": "rl", "strategy": strategy, "steps": rows, "sizes": len(sizes),
            "staging_bytes": staging,
            "graphs": loop.runner.num_graphs, "capture_s": capture_s,
            "weight_bytes": model.weight_bytes, "kv_bytes": model.kv_bytes,
            "offloaded_bytes": engine.offloaded_bytes(model),
            "pinned_limit_gib_s": limits, "rank_limits": rank_limits,
            "wrong_before_sleep": wrong0,
            "worst_rel_err_before_sleep": worst0,
            "model_description": f"{len(model.stack.layers)} transformers "
                                 f"LlamaDecoderLayers, hidden {model.stack.hidden}, "
                                 f"{model.stack.num_pieces} pieces per size ({name})",
            "torch": torch.__version__, "device": mod.get_device_name(dev)}


def _train(torch, mod, dev, nbytes: int) -> bool:
    """A training step's working set in the freed memory: allocate, touch, free."""
    if nbytes <= 0:
        return True
    try:
        work = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    except torch.OutOfMemoryError:
        return False
    work.fill_(1)
    mod.synchronize()
    del work
    mod.empty_cache()
    return True


# ---------------------------------------------------------------------- the parent
def _strategies(selected=None) -> tuple[list[str], list[str]]:
    """The strategies to run (``selected``, None: all) that can run here, in the order
    they run: the slowest (the recapture variant captures every graph again at every
    wake) last, so that a run stopped by a time limit has the others; and one line for
    each selected strategy that cannot run here."""
    check_strategies(selected)
    wanted = [n for n in STRATEGIES if selected is None or n in selected]
    chosen = [n for n in wanted if STRATEGIES[n].available()]
    skipped = [f"{n}: needs {STRATEGIES[n].needs}, which is not installed here; skipped"
               for n in wanted if n not in chosen and selected is not None]
    return [n for n in chosen if not STRATEGIES[n].last] + \
        [n for n in chosen if STRATEGIES[n].last], skipped


def _child_argv(spec: BenchSpec, backend_name: str, strategy: str) -> list[str]:
    chosen = spec.rl.strategies
    return spec.child_argv(f"rl:{strategy}", backend_name,
                           model=llama_model(spec.model.name, "rl"), scenario="rl",
                           extra=("--steps", str(spec.rl.steps))
                           + (("--strategies", ",".join(chosen)) if chosen else ()))


def small_spec(steps: int = 3, backend: str = "cuda") -> BenchSpec:
    """The RL loop on a 2-layer Llama (hidden 1024) at six sizes: what the GPU tests and
    the probes in scripts/ run through :func:`run_one_rl`."""
    return BenchSpec(backend=backend, sizes=(1, 2, 4, 8, 16, 32), rl=RLSpec(steps=steps),
                     model=ModelSpec("llama", options={"layers": 2, "hidden": 1024,
                                                       "ffn": 2816, "heads": 16,
                                                       "kv_heads": 4, "ctx": 64}))



def run_child(spec: BenchSpec) -> tuple[dict, bool]:
    """Child process: the record of ``spec.child``'s strategy, and whether every replay
    was correct."""
    assert spec.child is not None
    record = run_one_rl(spec.child.config, spec)
    return record, _ok(record)


def run_rl_bench(spec: BenchSpec, backend) -> dict:
    name = llama_model(spec.model.name, "rl")
    check_options(name, spec.model.options)
    sizes = list(spec.sizes)
    strategies, skipped = _strategies(spec.rl.strategies)
    for line in skipped:
        print(f"note: --strategies {line}")
    print(f"rl: {', '.join(strategies)}, each in its own process, steps as each ends:\n"
          f"{'':10s}{_HEADER}", flush=True)
    draw, done = bars_enabled(spec.output.quiet), []

    def ended(record: dict) -> None:
        # a child's own lines do not reach the parent's output: print its steps now,
        # so that a run cut short by a time limit still shows the strategies done
        done.append(record)
        for line in _rows(record, prefix="  measured"):
            say(line, enabled=draw)
        if spec.output.json:  # rewritten whole at the end; kept if cut short
            report.write_json({"schema": report.SCHEMA, "kind": "rl", "partial": True,
                               "records": done, "sizes": sizes}, spec.output.json)

    records = run_configurations(
        [({"scenario": "rl", "strategy": s}, _child_argv(spec, backend.name, s))
         for s in strategies], quiet=spec.output.quiet, bad_config_exit=EXIT_BAD_MODEL,
        describe=lambda r: f"  done rl {r['strategy']}: {len(r['steps'])} steps",
        on_record=ended)
    first: dict = next((r for r in records if "error" not in r), {})
    limit = next((r["pinned_limit_gib_s"] for r in records
                  if r.get("pinned_limit_gib_s")), None)
    summary = _summarize(records, limit)
    targets = _targets(summary)
    _print(records, summary, first, limit, targets)
    if spec.output.plot and first:
        path = report.plot_path(spec.output.plot, "rl")
        title = (f"RL steps: {first.get('model_description')}, {len(sizes)} sizes\n"
                 f"{first.get('device')}, torch {first.get('torch')}")
        if _plot(records, path, title):
            print(f"wrote {path}")
    ok = bool(first) and all(_ok(r) for r in records)
    return {"schema": report.SCHEMA, "kind": "rl", "records": records, "summary": summary,
            "targets": targets, "pinned_limit_gib_s": limit, "sizes": sizes, "ok": ok}
