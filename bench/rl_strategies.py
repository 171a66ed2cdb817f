"""How an engine puts its memory to sleep and wakes it is what the RL scenario compares,
and it changes as the peers (vLLM, SGLang, torch_memory_saver) do: kept apart from the
loop that measures them, a new peer is one class and one line in :data:`STRATEGIES`, and
the CLI checks ``--strategies`` without loading the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util

from .measure import current_device

__all__ = ["Strategy", "STRATEGIES", "check_strategies"]


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



def check_strategies(names) -> None:
    """Refuse a name that is no strategy (``--strategies``), with the choices."""
    bad = [n for n in names or () if n not in STRATEGIES]
    if bad:
        raise ValueError(f"unknown strategies {bad} of --scenario rl; choose from "
                         f"{', '.join(STRATEGIES)}")
