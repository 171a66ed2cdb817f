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
against vllm in both (:func:`_targets`).  ``--strategies`` picks some.  Needs a device backend.

Under ``torchrun --nproc-per-node N`` every rank runs the vmm loop on its own device, with
``vmm_core.sleep(..., group=pg)`` and ``vmm_core.wake_up(group=pg)`` (every rank sleeps or
none does): :mod:`.rl_group`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import time
from typing import Any

from . import report
from .children import run_configurations
from .group_run import arrival, group_timings
from .measure import current_device, open_device, ordered
from .piecewise import WRONG_ABOVE
from .piecewise_runners import PiecewiseRunner
from .progress import bars_enabled, say
from .spec import BenchSpec, ModelSpec, RLSpec
from .workload import EXIT_BAD_MODEL, check_options, llama_model, relative_error

__all__ = ["Strategy", "STRATEGIES", "DEFAULT_STEPS", "run_rl_bench", "run_one_rl",
           "run_child", "small_spec", "check_strategies"]  # the torchrun variant: .rl_group

DEFAULT_STEPS = RLSpec.steps
#: the training-like allocation takes this share of what the sleep freed
TRAIN_SHARE = 0.9
#: the KV cache region holds at least this much (engines give it most of the device)
KV_MIN_BYTES = 2 << 30
GIB = 2**30


# ---------------------------------------------------------------------- strategies
class _Engine:
    """What differs per strategy: where weights, kv and graphs live, and sleep / wake."""

    name = ""
    weights_tag, kv_tag, graph_tag = "weights", "kv", "graph"
    group = None  # vmm: a torch.distributed group; every rank sleeps and wakes, or none

    discipline = "vllm"  # the pieces' reference discipline (bench/peers.py)

    def __init__(self, torch, backend, dev) -> None:
        self.torch, self.backend, self.dev = torch, backend, dev
        self.recaptures = 0

    def weights_region(self):
        import vmm_core

        return vmm_core.region(self.weights_tag, backend=self.backend)

    def kv_region(self):
        import vmm_core

        return vmm_core.region(self.kv_tag, backend=self.backend)

    def new_pool(self):
        from .torch_pools import SharedTorchPool

        # vLLM's one graph_pool_handle(); its runner replays torch's own executables
        return SharedTorchPool(backend=self.backend)

    def sleep(self, model) -> None:
        raise NotImplementedError

    def wake(self, model) -> None:
        raise NotImplementedError

    def release_graphs(self, loop) -> None:
        """At sleep, after the memory calls: what happens to the graphs."""

    def after_wake(self, loop) -> None:
        """Whatever must happen before the first replay (a recapture)."""

    def host_bytes_awake(self, mod):
        from .sleep import _torch_pinned_cache_bytes

        return _torch_pinned_cache_bytes(mod)

    def offloaded_bytes(self, model) -> int:
        """What a sleep copies to the host (the rate against the pinned limit uses it)."""
        return model.weight_bytes

    def tag_summary(self) -> dict:
        """Per tag, what memory_summary() says while the engine's graphs are alive (a
        GraphPool's tag leaves the summary once the pool is gone)."""
        return {}

    def graph_memory(self) -> dict | None:
        """The graph pool's ``device_bytes`` and ``host_bytes`` now, where the engine puts
        graph memory to sleep with a copy (vLLM's ``--sleep-mode-offload-cudagraph``);
        None elsewhere."""
        return None

    #: it sleeps through vmm_core's offload: the staging ring is set up before the
    #: first step, once per process, as vmm_core's engine does
    uses_offload = False


class _Tagged(_Engine):
    """An engine whose memory is vmm_core tags: host memory awake is what its tags hold
    plus the offload's staging ring, and what a sleep copies is read from the
    allocators' transfers (live blocks only, whatever the tags' physical memory)."""

    uses_offload = True
    copied = 0  # bytes the last sleep copied to the host

    @property
    def tags(self) -> list[str]:
        """The engine's own vmm_core tags: an engine sleeps and wakes what it owns, never
        every tag of the process (other memory there, say a test's, is not its to
        discard)."""
        raise NotImplementedError

    def suspend(self) -> None:
        """The engine's own sleep calls."""
        raise NotImplementedError

    def sleep(self, model) -> None:
        import vmm_core

        allocators = [a for t in self.tags for a in vmm_core.allocators(t)]
        before = {id(a): a.last_transfer for a in allocators}
        self.suspend()
        self.copied = sum(a.last_transfer.nbytes for a in allocators
                          if a.last_transfer is not None
                          and a.last_transfer is not before[id(a)])

    def host_bytes_awake(self, mod):
        from vmm_core import offload

        return sum(t["host_bytes"] for t in self.tag_summary().values()) \
            + offload.staging_bytes()

    def offloaded_bytes(self, model) -> int:
        """What the last sleep copied: the live blocks of the offloaded tags (and of
        graph memory kept through a sleep), not the free blocks the caching allocator
        keeps in them."""
        return self.copied

    def tag_summary(self) -> dict:
        import vmm_core

        summary = vmm_core.memory_summary()
        return {t: {k: summary[t][k] for k in ("device_bytes", "host_bytes",
                                                "pinned_host_bytes")}
                for t in self.tags if t in summary}


class _Vmm(_Tagged):
    name = "vmm"
    discipline = "vmm"

    @property
    def tags(self) -> list[str]:
        return [self.weights_tag, self.kv_tag, self.graph_tag]

    def new_pool(self):
        import vmm_core

        # what the graphs read, named: not every region of the process (current device)
        return vmm_core.GraphPool(backend=self.backend, tag=self.graph_tag,
                                  reads=(self.weights_tag, self.kv_tag))

    def suspend(self) -> None:
        import vmm_core

        # kv and graph memory discarded
        vmm_core.sleep(self.tags, offload=[self.weights_tag], group=self.group)

    def wake(self, model) -> None:
        import vmm_core

        vmm_core.wake_up(self.tags, group=self.group)


class _Vllm(_Engine):
    """CuMemAllocator.sleep / wake_up, as vllm/device_allocator/cumem.py does them."""

    name = "vllm"

    def sleep(self, model) -> None:
        import vmm_core

        torch = self.torch
        self._backups = []
        for p in model.weight_tensors():
            cpu = torch.empty(p.numel() * p.element_size(), dtype=torch.uint8, device="cpu",
                              pin_memory=True)
            cpu.copy_(p.view(-1).view(torch.uint8))  # synchronous, like cudaMemcpy
            self._backups.append(cpu)
        vmm_core.sleep([self.weights_tag, self.kv_tag])  # unmap_and_release
        gc.collect()
        mod = getattr(torch, torch.device(self.dev).type)
        getattr(mod, "empty_cache", lambda: None)()  # torch.cpu has none (host tests)

    def wake(self, model) -> None:
        import vmm_core

        vmm_core.wake_up([self.weights_tag, self.kv_tag], keep_host_buffers=False)
        with self.torch.no_grad():
            for p, cpu in zip(model.weight_tensors(), self._backups):
                p.view(-1).view(self.torch.uint8).copy_(cpu)
        self._backups = []  # data.cpu_backup_tensor = None


class _Recapture(_Vllm):
    name = "recapture"

    def release_graphs(self, loop) -> None:
        loop.drop_graphs()

    def after_wake(self, loop) -> None:
        self.recaptures += loop.capture_all()


class _Tms(_Engine):
    name = "tms"

    def __init__(self, torch, backend, dev) -> None:
        super().__init__(torch, backend, dev)
        from torch_memory_saver import torch_memory_saver as tms

        from .sleep_rounds import torch_mode

        torch_mode(tms)  # the pluggable-allocator mode: no LD_PRELOAD
        self.tms = tms

    def weights_region(self):
        return self.tms.region(tag=self.weights_tag, enable_cpu_backup=True)

    def kv_region(self):
        return self.tms.region(tag=self.kv_tag)

    def sleep(self, model) -> None:
        self.tms.pause(self.weights_tag)
        self.tms.pause(self.kv_tag)

    def wake(self, model) -> None:
        self.tms.resume(self.weights_tag)
        self.tms.resume(self.kv_tag)

    def host_bytes_awake(self, mod):
        return None  # the tool does not say


class _TmsCompat(_Tagged):
    """vmm_core's torch_memory_saver API called as SGLang calls it: its tags
    (``srt/constants.py``), the weights in ``region("weights", enable_cpu_backup=True)``
    and the KV cache in ``region("kv_cache")`` (``model_runner``), graphs captured
    through ``cuda_graph(cuda_graph=, pool=, stream=, tag="cuda_graph",
    enable_cpu_backup=True)`` into one global pool (:class:`_SaverGraphPool`), and the
    scheduler's ``release_memory_occupation`` / ``resume_memory_occupation`` order:
    pause kv_cache, weights, cuda_graph; resume cuda_graph, weights, kv_cache
    (``scheduler_update_weights_mixin.py``).  SGLang's stash of the model's buffers
    around the weights' pause is not a memory-saver call and is left out."""

    name = "tms-compat"
    weights_tag, kv_tag, graph_tag = "weights", "kv_cache", "cuda_graph"

    def __init__(self, torch, backend, dev) -> None:
        super().__init__(torch, backend, dev)
        from vmm_core.integrations.torch_memory_saver import TorchMemorySaver

        self.tms = TorchMemorySaver(backend=backend)

    @property
    def tags(self) -> list[str]:
        from vmm_core.integrations.torch_memory_saver import vmm_tags

        return [t for name in (self.weights_tag, self.kv_tag, self.graph_tag)
                for t in vmm_tags(name)]

    def weights_region(self):
        return self.tms.region(self.weights_tag, enable_cpu_backup=True)

    def kv_region(self):
        return self.tms.region(self.kv_tag)

    def new_pool(self):

        ops = self.backend.graph_ops(current_device(self.backend))
        return _SaverGraphPool(self.tms, ops, self.graph_tag)

    def suspend(self) -> None:
        for tag in (self.kv_tag, self.weights_tag, self.graph_tag):
            self.tms.pause(tag)

    def wake(self, model) -> None:
        for tag in (self.graph_tag, self.weights_tag, self.kv_tag):
            self.tms.resume(tag)


class _SaverGraphPool:
    """What the RL loop's runner asks of a pool, for SGLang's graph runner: one global
    graph memory pool (``graph_pool_handle()``) that every capture passes to the memory
    saver's ``cuda_graph`` (``cuda_graph_runner.py``, ``_capture_graph``); replays are
    plain ``graph.replay()``."""

    allocator = None  # nothing for the loop to merge after capture

    def __init__(self, tms, ops, tag: str) -> None:
        self.handle = ops.shared_pool_handle()
        self.ops = _SaverCapture(ops, tms, tag)

    @contextlib.contextmanager
    def space(self, key):
        yield self.handle

    def new_graph(self):
        """SGLang's runner makes a plain ``torch.cuda.CUDAGraph()``: torch keeps its
        executable, as it does under torch_memory_saver."""
        return self.ops.new_graph()

    def replaying(self, key):
        return contextlib.nullcontext()

    def warmup(self, fn) -> None:
        self.ops.warmup(fn)


class _SaverCapture:
    """The backend's graph ops, with captures made through the memory saver's
    ``cuda_graph`` on the capture stream, with CPU backup (SGLang's since its graph
    pool holds capture-time state that replays read)."""

    def __init__(self, ops, tms, tag: str) -> None:
        self._ops, self._tms, self._tag = ops, tms, tag

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def capture(self, graph, fn, handle):
        with self._tms.cuda_graph(cuda_graph=graph, pool=handle,
                                  stream=self._ops.capture_stream, tag=self._tag,
                                  enable_cpu_backup=True):
            return fn()


class _VllmPlugin(_Tagged):
    """vmm_core's ``MemAllocator`` called as vLLM 0.33's GPU worker calls its allocator
    (``vllm/v1/worker/gpu_worker.py``): weights under ``use_memory_pool(tag="weights")``
    (``load_model``), the KV cache under ``use_memory_pool(tag="kv_cache")``
    (``initialize_from_config``); ``Worker.sleep(level=1)`` is the backend's
    ``suspend(1)`` (``VmmSleepMode``: the allocator sleeps with ``offload_tags=("weights",
    "runtime", "cudagraph")``); the wake is an RL framework's two-stage one,
    ``wake_up(["weights"])`` then ``wake_up(["kv_cache"])`` (the backend's ``resume``).
    Graphs are captured into one shared pool and stay resident: vLLM 0.33 routes
    captures to an allocator's ``cudagraph_pool()`` only with the backend named
    ``cumem`` and ``sleep_mode_offload_cudagraph`` on (off by default), as the ``vllm``
    row does."""

    name = "vllm-plugin"
    weights_tag, kv_tag = "weights", "kv_cache"

    def __init__(self, torch, backend, dev) -> None:
        super().__init__(torch, backend, dev)
        from vmm_core.integrations.vllm import VmmMemAllocator, VmmSleepMode, deferrable_tags

        deferrable_tags()  # vLLM's own constant, imported now as in vLLM's worker, not timed
        self.allocator = VmmMemAllocator(backend=backend)
        self.backend_calls = VmmSleepMode(self.allocator)

    @property
    def tags(self) -> list[str]:
        from vmm_core.integrations.vllm import vmm_tags

        # the plugin files vLLM's tags under its own namespace ("vllm:weights")
        return vmm_tags(self.weights_tag) + vmm_tags(self.kv_tag)

    def weights_region(self):
        return self.allocator.use_memory_pool(tag=self.weights_tag)

    def kv_region(self):
        return self.allocator.use_memory_pool(tag=self.kv_tag)

    def suspend(self) -> None:
        self.backend_calls.suspend(level=1)

    def wake(self, model) -> None:
        self.backend_calls.resume([self.weights_tag])
        self.backend_calls.resume([self.kv_tag])


class _AllocatorGraphPool:
    """What the RL loop's runner asks of a pool, for vLLM's captures under
    ``--sleep-mode-offload-cudagraph``: every capture inside the allocator's
    ``cudagraph_pool()``, which yields the pool to capture into (``capture_pool``,
    ``vllm/compilation/cudagraph_pool.py``); replays are plain ``graph.replay()``, torch
    keeps the executables."""

    allocator = None  # nothing for the loop to merge after capture

    def __init__(self, memory, ops) -> None:
        self.memory, self.ops = memory, ops

    @contextlib.contextmanager
    def space(self, key):
        with self.memory.cudagraph_pool() as handle:
            yield handle

    def new_graph(self):
        return self.ops.new_graph()

    def replaying(self, key):
        return contextlib.nullcontext()

    def warmup(self, fn) -> None:
        self.ops.warmup(fn)


def _graph_pool_of(engine, memory) -> _AllocatorGraphPool:
    return _AllocatorGraphPool(memory, engine.backend.graph_ops(
        current_device(engine.backend)))


def _graph_memory(tag: str) -> dict:
    import vmm_core

    summary = vmm_core.memory_summary().get(tag, {})
    return {"device_bytes": summary.get("device_bytes", 0),
            "host_bytes": summary.get("host_bytes", 0)}


class _VllmPluginGraphs(_VllmPlugin):
    """The ``vllm-plugin`` row with ``--sleep-mode-offload-cudagraph``: the plugin's
    patches route vLLM's captures to ``VmmMemAllocator.cudagraph_pool()``, and the
    ``vmm`` backend's ``suspend(1)`` offloads that pool with the weights (vLLM offloads
    ``cudagraph`` at every level): its live blocks are copied, its pages released."""

    name = "vllm-plugin-graphs"

    @property
    def tags(self) -> list[str]:
        from vmm_core.integrations.vllm import vmm_tags

        return super().tags + vmm_tags("cudagraph")

    def new_pool(self):
        return _graph_pool_of(self, self.allocator)

    def graph_memory(self) -> dict | None:
        return _graph_memory(self.tags[-1])


class _VllmGraphs(_Vllm):
    """vLLM's own ``cumem`` with ``--sleep-mode-offload-cudagraph``, on the same graphs:
    captured into the same one pool as ``vllm-plugin-graphs`` (cuMem-mapped pages, as
    ``CuMemAllocator.cudagraph_pool()``'s), put to sleep as ``CuMemAllocator.sleep``
    (``vllm/device_allocator/cumem.py``) does with ``cudagraph`` among the offload tags:
    each allocation of the pool copied whole into a fresh pinned tensor (a synchronous
    copy, as its ``cudaMemcpy``), then its pages unmapped and released; ``wake_up`` maps
    them again, copies back and drops the tensors."""

    name = "vllm-graphs"

    def __init__(self, torch, backend, dev) -> None:
        super().__init__(torch, backend, dev)
        from vmm_core.integrations.vllm import VmmMemAllocator, vmm_tags

        self.graphs = VmmMemAllocator(backend=backend)
        self.graph_memory_tag = vmm_tags("cudagraph")[0]
        self._graph_backups: list = []

    def new_pool(self):
        return _graph_pool_of(self, self.graphs)

    def sleep(self, model) -> None:
        import vmm_core

        allocators = vmm_core.allocators(self.graph_memory_tag)
        for alloc in allocators:
            for index in alloc.space_indices():
                for address, size in sorted(alloc.live_allocations(index).items()):
                    cpu = self.torch.empty(size, dtype=self.torch.uint8, device="cpu",
                                           pin_memory=self.dev != "cpu")
                    self.backend.copy_to_host(alloc.device, address, cpu.data_ptr(), size)
                    self._graph_backups.append((alloc.device, address, cpu))
        self.graph_copied = sum(cpu.numel() for _, _, cpu in self._graph_backups)
        # a graph pool keeps its live blocks through a discard; vLLM's pool keeps
        # nothing of its own beyond the copies just made
        kept = [(alloc, alloc.preserve_live) for alloc in allocators]
        for alloc, _ in kept:
            alloc.preserve_live = False
        try:
            vmm_core.sleep([self.graph_memory_tag])
        finally:
            for alloc, before in kept:
                alloc.preserve_live = before
        super().sleep(model)

    def wake(self, model) -> None:
        import vmm_core

        vmm_core.wake_up([self.graph_memory_tag], keep_host_buffers=False)
        for device, address, cpu in self._graph_backups:
            self.backend.copy_from_host(device, cpu.data_ptr(), address, cpu.numel())
        self._graph_backups = []
        super().wake(model)

    graph_copied = 0  # bytes the last sleep copied of the graph pool

    def offloaded_bytes(self, model) -> int:
        return model.weight_bytes + self.graph_copied

    def graph_memory(self) -> dict | None:
        memory = _graph_memory(self.graph_memory_tag)
        memory["host_bytes"] += sum(cpu.numel() for _, _, cpu in self._graph_backups)
        return memory


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One row of the RL comparison: the engine class that sleeps and wakes its way."""

    engine: type[_Engine]
    what: str  # one line for the legend
    #: a module that must be importable for it to run (a peer's package); None: always
    needs: str | None = None
    #: run after the others (the slowest: a run cut by a time limit keeps the rest)
    last: bool = False

    def available(self) -> bool:
        return self.needs is None or importlib.util.find_spec(self.needs) is not None


#: every strategy, in the order they run; adding one is an _Engine subclass and a line here
STRATEGIES: dict[str, Strategy] = {
    "vmm": Strategy(_Vmm, "vmm_core: weights offloaded (kept pinned), kv and graph memory "
                          "discarded, graphs replay without recapture"),
    "vllm": Strategy(_Vllm, "vLLM sleep(level=1): a pinned CPU tensor per allocation at "
                            "every sleep, kv discarded, graph memory resident"),
    "tms-compat": Strategy(_TmsCompat, "vmm_core's torch_memory_saver API as SGLang "
                                       "calls it: weights backed up, kv_cache and "
                                       "cuda_graph paused (graphs keep their live blocks)"),
    "vllm-plugin": Strategy(_VllmPlugin, "vmm_core's MemAllocator as vLLM's worker calls "
                                         "it: sleep level 1, wake weights then kv_cache, "
                                         "graph memory resident"),
    "vllm-graphs": Strategy(_VllmGraphs, "vLLM sleep(level=1) with "
                                         "--sleep-mode-offload-cudagraph: the graph pool's "
                                         "allocations copied whole to fresh pinned tensors"),
    "vllm-plugin-graphs": Strategy(_VllmPluginGraphs, "the vllm-plugin row with "
                                                      "--sleep-mode-offload-cudagraph: the "
                                                      "graph pool offloaded, live blocks "
                                                      "only"),
    "tms": Strategy(_Tms, "torch_memory_saver: weights with CPU backup, kv paused, graph "
                          "memory resident", needs="torch_memory_saver"),
    "recapture": Strategy(_Recapture, "vLLM's way, graphs released at sleep and captured "
                                      "again at wake", last=True),
}


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
def check_strategies(names) -> None:
    """Refuse a name that is no strategy (``--strategies``), with the choices."""
    bad = [n for n in names or () if n not in STRATEGIES]
    if bad:
        raise ValueError(f"unknown strategies {bad} of --scenario rl; choose from "
                         f"{', '.join(STRATEGIES)}")


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


def _ok(record) -> bool:
    return "error" not in record and not record["wrong_before_sleep"] and all(
        r["first_replay_ok"] and not r["wrong_sizes"] and r["train_ok"]
        for r in record["steps"])


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


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summarize(records, limit) -> dict:
    """Per strategy: round 1 and the mean of rounds 2..N, with the weights' copy rate
    against the pinned limit (vmm: rounds 2..N are the target of >= 90%)."""
    out = {}
    for r in records:
        if "error" in r:
            out[r["strategy"]] = {"error": r["error"][-300:]}
            continue
        steps = r["steps"]
        parts = {"round 1": steps[:1], "rounds 2..N": steps[1:]}
        entry: dict[str, Any] = {}
        for label, chosen in parts.items():
            if not chosen:
                continue
            e = {key: _mean([s[key] for s in chosen])
                 for key in ("freed_bytes", "sleep_s", "wake_s", "first_replay_s",
                             "host_bytes_awake", "recaptured_graphs", "step_s")}
            own = r.get("pinned_limit_gib_s") or limit  # measured in its own process
            if own and e["sleep_s"] and e["wake_s"]:
                # the bytes this strategy copies (vmm_core's engines: what a sleep copied)
                gib = (r.get("offloaded_bytes") or r["weight_bytes"]) / GIB
                e["sleep_pct_of_limit"] = gib / e["sleep_s"] / own[0]
                e["wake_pct_of_limit"] = gib / e["wake_s"] / own[1]
            entry[label] = e
        entry["correct"] = _ok(r)
        out[r["strategy"]] = entry
    return out


#: the vLLM plugin's target against vLLM's own allocator in the RL step: every round's
#: sleep (round 1, where vLLM pins fresh host memory, and rounds 2..N) this many times
#: faster, every wake at most TARGET_PLUGIN_WAKE of vLLM's (both wake at the pinned copy
#: limit, where a few milliseconds are noise)
TARGET_PLUGIN_SPEEDUP = 2.5
TARGET_PLUGIN_WAKE = 1.10
ROUNDS = ("round 1", "rounds 2..N")


def _targets(summary) -> dict:
    """The vllm-plugin strategy against vllm (vLLM's own allocator), when both ran and
    replayed correctly: the sleep TARGET_PLUGIN_SPEEDUP times faster in round 1 and in
    rounds 2..N (means of the steps), the wake within TARGET_PLUGIN_WAKE in both."""
    plugin, vllm = summary.get("vllm-plugin", {}), summary.get("vllm", {})
    if any(r not in plugin or r not in vllm for r in ROUNDS):
        return {}
    speedups = {r: vllm[r]["sleep_s"] / plugin[r]["sleep_s"] for r in ROUNDS}
    wake_ratio = max(plugin[r]["wake_s"] / vllm[r]["wake_s"] for r in ROUNDS)
    return {"vllm-plugin vs vllm": {
        "sleep_speedup_round_1": speedups["round 1"],
        "sleep_speedup": speedups["rounds 2..N"], "wake_ratio": wake_ratio,
        "target": TARGET_PLUGIN_SPEEDUP, "wake_target": TARGET_PLUGIN_WAKE,
        "met": min(speedups.values()) >= TARGET_PLUGIN_SPEEDUP
        and wake_ratio <= TARGET_PLUGIN_WAKE and plugin["correct"] and vllm["correct"]}}


_HEADER = (f"  {'strategy':11s} {'step':>4s} {'freed GiB':>9s} {'sleep ms':>9s} "
           f"{'wake ms':>9s} {'1st replay ms':>13s} {'host GiB awake':>14s} "
           f"{'recaptures':>10s} wrong")


def _fmt(value, scale=1.0, spec=".1f") -> str:
    return "?" if value is None else format(value * scale, spec)


def _print(records, summary, first, limit, targets=None) -> None:
    print(f"\nrl: {first.get('model_description')}; {first.get('device')}, torch "
          f"{first.get('torch')}")
    if first:
        print(f"weights {first['weight_bytes'] / GIB:.2f} GiB of tensors (offloaded), KV "
              f"cache {first['kv_bytes'] / GIB:.2f} GiB and graph memory discarded (vmm)")
    for r in records:
        if "error" not in r and r.get("offloaded_bytes"):
            print(f"  {r['strategy']}: a sleep copies {r['offloaded_bytes'] / GIB:.2f} GiB "
                  f"to the host")
    if limit:
        print(f"pinned copy limit measured in this run: {limit[0]:.1f} / {limit[1]:.1f} GiB/s")
    print(_HEADER)
    for r in records:
        for line in _rows(r):
            print(line)
    print("\nround 1 / mean of rounds 2..N:")
    for strategy, entry in summary.items():
        if "error" in entry:
            continue
        for label in ("round 1", "rounds 2..N"):
            e = entry.get(label)
            if e is None:
                continue
            pct = ""
            if "sleep_pct_of_limit" in e:
                pct = (f" (copies at {e['sleep_pct_of_limit']:.0%} / "
                       f"{e['wake_pct_of_limit']:.0%} of the limit)")
            print(f"  {strategy:11s} {label:12s}: freed {_fmt(e['freed_bytes'], 1 / GIB, '.2f')}"
                  f" GiB, sleep {_fmt(e['sleep_s'], 1e3)} ms, wake {_fmt(e['wake_s'], 1e3)} "
                  f"ms, first replay {_fmt(e['first_replay_s'], 1e3)} ms, recaptures "
                  f"{_fmt(e['recaptured_graphs'], 1, '.0f')}{pct}")
        print(f"  {strategy:11s} every replay correct: {entry['correct']}")
    for r in records:
        graphs = [st for st in r.get("steps", ()) if "graph_memory_asleep" in st]
        if graphs and "error" not in r:
            awake, asleep = graphs[-1]["graph_memory_awake"], graphs[-1]["graph_memory_asleep"]
            print(f"  {r['strategy']}: graph memory {awake['device_bytes'] / 2**20:.1f} MiB "
                  f"on the device awake; asleep {asleep['device_bytes'] / 2**20:.1f} MiB on "
                  f"the device, {asleep['host_bytes'] / 2**20:.1f} MiB on the host (step "
                  f"{graphs[-1]['step']})")
    for name, t in (targets or {}).items():
        print(f"target {name} (every round's sleep >= {t['target']:g}x faster, every wake "
              f"<= {t['wake_target']:g}x the time): sleep {t['sleep_speedup_round_1']:.2f}x "
              f"faster in round 1, {t['sleep_speedup']:.2f}x in rounds 2..N, wake at most "
              f"{t['wake_ratio']:.2f}x the time: {'met' if t['met'] else 'NOT met'}")


def _rows(r, prefix: str = "") -> list[str]:
    """One strategy's steps as rows of the table (freed GiB, sleep, wake, first replay
    ms, host GiB held awake, recaptures, wrong sizes)."""
    if "error" in r:
        return [f"{prefix}  {r['strategy']:11s} FAILED: {r['error'][-200:]}"]
    return [f"{prefix}  {r['strategy']:11s} {s['step']:4d} {s['freed_bytes'] / GIB:9.2f} "
            f"{s['sleep_s'] * 1e3:9.1f} {s['wake_s'] * 1e3:9.1f} "
            f"{s['first_replay_s'] * 1e3:13.1f} "
            f"{_fmt(s['host_bytes_awake'], 1 / GIB, '.2f'):>14s} "
            f"{s['recaptured_graphs']:10d} {len(s['wrong_sizes'])}" for s in r["steps"]]


def _plot(records, path: str, title: str) -> bool:
    """Two panels: device memory freed by each sleep, and step time (sleep + wake +
    first replay), per step and strategy.  False without matplotlib."""
    plt = report.pyplot()
    if plt is None:
        return False
    ok = [r for r in records if "error" not in r]
    fig, (freed, step) = plt.subplots(1, 2, figsize=(13, 5))
    for r in ok:
        xs = [s["step"] for s in r["steps"]]
        freed.plot(xs, [s["freed_bytes"] / GIB for s in r["steps"]], marker="o",
                   label=r["strategy"])
        step.plot(xs, [s["step_s"] * 1e3 for s in r["steps"]], marker="o",
                  label=r["strategy"])
    freed.set_xlabel("step")
    freed.set_ylabel("device memory freed by sleep (GiB)")
    step.set_xlabel("step")
    step.set_ylabel("sleep + wake + first replay (ms)")
    step.set_yscale("log")
    for ax in (freed, step):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    report.save_figure(fig, path, dpi=120)
    return True
