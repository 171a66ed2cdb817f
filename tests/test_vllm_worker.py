"""vLLM 0.33.0's own worker with ``--sleep-mode-backend vmm``, on this CPU.

vLLM's released modules, unchanged: its plugin loader calls vmm_core's entry point, a
real ``VllmConfig`` (a local tiny Llama's ``config.json``, no weights) builds a real
``vllm.v1.worker.gpu_worker.Worker``, and its allocator lookups
(``_maybe_get_memory_pool_context``, the LoRA mixin's, ``cudagraph_pool.capture_pool``),
``discard``, ``wake_up`` and its sleep-mode backend reach vmm_core's host backend, bytes
checked; another backend leaves every object of vLLM as it was; an untested vLLM is
refused.

What a CPU cannot run, and what stands in for it here:
* ``Worker.sleep`` synchronizes the accelerator and reads its free memory before and
  after the backend's ``suspend``, which a CPU-only torch refuses
  (``torch.accelerator``: "no accelerator"): the tests answer those two questions from
  the host backend's own accounting (:func:`_device_queries`: device bytes vmm_core
  holds), so vLLM's ``Worker.sleep`` runs as written, its freed-bytes check included.
  Level 2 also saves the model's buffers, which needs a loaded model: level 2 is driven
  through the worker's backend, the call ``Worker.sleep`` makes.
* vLLM's platform here is ``UnspecifiedPlatform``: sleep mode is not offered there, so
  ``ModelConfig`` refuses ``enable_sleep_mode=True`` at construction; the tests set the
  field afterwards.  ``_maybe_get_memory_pool_context`` asks the allocator there as on
  CUDA (its CPU and XPU early returns do not apply).  The LoRA mixin asks only on CUDA,
  and ``CudaCommunicator`` needs a device: the tests check their module's lookup and
  the property they read.
* ``vllm.device_allocator.cumem`` loads vLLM's CUDA extension at import.
On a GPU: docs/integrations.md says how a user checks the whole path.

Importing vLLM's worker takes about 30 s here (once for the module).  Skipped where
vLLM is not installed; ``VMM_CORE_REQUIRE=vllm`` (CI) fails instead."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import subprocess
import sys

import pytest
from host_space import framework_alloc

import vmm_core
from vmm_core.errors import VMMError
from vmm_core.integrations import vllm as plugin
from vmm_core.integrations.vllm import patches
from vmm_core.testing.platforms import skip_or_fail

MIB = 1 << 20
DEVICE_BYTES = 1 << 30  # what the host backend's device reports (device_queries)
pytestmark = pytest.mark.usefixtures("clean_tags")


class _Vllm:
    """vLLM's modules this file uses, and a config maker."""

    def __init__(self, model_dir: str) -> None:
        import vllm.compilation.cudagraph_pool as cudagraph_pool
        import vllm.device_allocator as device_allocator
        import vllm.plugins as plugins
        import vllm.v1.worker.gpu_worker as gpu_worker
        import vllm.v1.worker.lora_model_runner_mixin as lora
        import vllm.v1.worker.worker_base as worker_base
        from vllm.config import CUDAGraphMode, DeviceConfig, ModelConfig, VllmConfig

        self.cudagraph_pool, self.device_allocator, self.plugins = \
            cudagraph_pool, device_allocator, plugins
        self.gpu_worker, self.lora, self.worker_base = gpu_worker, lora, worker_base
        self.VllmConfig, self.ModelConfig, self.DeviceConfig = \
            VllmConfig, ModelConfig, DeviceConfig
        self.CUDAGraphMode = CUDAGraphMode
        self.model_dir = model_dir

    def config(self, backend: str, sleep: bool = True, offload_graphs: bool = False):
        model = self.ModelConfig(model=self.model_dir, skip_tokenizer_init=True,
                                 sleep_mode_backend=backend,
                                 sleep_mode_offload_cudagraph=offload_graphs)
        model.enable_sleep_mode = sleep  # refused at construction on this platform
        config = self.VllmConfig(model_config=model,
                                 device_config=self.DeviceConfig(device="cpu"))
        config.compilation_config.cudagraph_mode = self.CUDAGraphMode.PIECEWISE
        return config

    def worker(self, config):
        return self.gpu_worker.Worker(vllm_config=config, local_rank=0, rank=0,
                                      distributed_init_method="tcp://127.0.0.1:1",
                                      is_driver_worker=True)

    def originals(self) -> dict:
        """Every object the plugin may replace, as it is now."""
        found = {"WorkerBase.__init__": self.worker_base.WorkerBase.__dict__["__init__"],
                 "VllmConfig.use_cumem_cudagraph_pool":
                     self.VllmConfig.__dict__["use_cumem_cudagraph_pool"]}
        for name in patches.ALLOCATOR_LOOKUPS:
            found[name] = sys.modules[name].__dict__[patches.LOOKUP]
        return found


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V2 needs Triton
        try:
            from transformers import LlamaConfig

            patches.restore()
            loaded = _Vllm(str(tmp_path_factory.mktemp("tiny-llama")))
        except ImportError as exc:
            skip_or_fail("vllm", f"vLLM's worker cannot be imported ({exc}); .ci/run "
                                 f"installs what it needs")
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=128).save_pretrained(loaded.model_dir)
        loaded.pristine = loaded.originals()  # before any hook of ours
        yield loaded
    patches.restore()


@pytest.fixture
def hooked(vllm, host, monkeypatch):
    """vLLM as a fresh process finds it once plugins loaded: the ``vmm`` backend
    registered and the hook waiting for the first worker; the process's VmmMemAllocator
    on the host backend.  Everything put back afterwards."""
    patches.restore()
    monkeypatch.delenv(patches.NCCL_GRAPH_REGISTER, raising=False)
    monkeypatch.setattr(plugin.VmmMemAllocator, "instance",
                        plugin.VmmMemAllocator(backend=host))
    plugin.register()  # what vLLM's loader calls (load_general_plugins, once a process)
    yield vllm
    patches.restore()
    assert vllm.originals() == vllm.pristine


@pytest.fixture
def device_queries(monkeypatch):
    """``torch.accelerator.synchronize`` / ``get_memory_info`` as the host backend
    answers them: nothing to wait for (host copies are synchronous), and a device of
    ``DEVICE_BYTES`` whose used part is what vmm_core's tags hold on it.  What vLLM's
    ``Worker.sleep`` asks around the backend's suspend; it asserts that sleeping freed
    memory, which it then computes from vmm_core's real figures."""
    import torch

    def get_memory_info(device=None):
        used = sum(s["device_bytes"] for s in vmm_core.memory_summary().values())
        return DEVICE_BYTES - used, DEVICE_BYTES

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", get_memory_info)


def _fill(address: int, n: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(n)
    ctypes.memmove(address, data, n)
    return data


def test_vllms_loader_calls_the_entry_point_that_installs_the_hook(vllm, monkeypatch):
    """``load_general_plugins`` (once a process) finds vmm_core's entry point: the
    backend is registered and only the worker constructor waits for a choice."""
    patches.restore()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    try:
        assert patches.state() == {"selected": None, "trigger": True,
                                   "patched": ["WorkerBase.__init__"]}
        now = vllm.originals()
        assert {k: v for k, v in now.items() if v is not vllm.pristine[k]}.keys() == \
            {"WorkerBase.__init__"}
    finally:
        patches.restore()


def test_the_patched_lookups_are_every_one_of_vllm_0_33(vllm):
    """Every module of the installed vLLM that names ``get_mem_allocator_instance`` is
    one the plugin rebinds (read in its own files): none asks vLLM's allocator past it."""
    root = os.path.dirname(os.path.dirname(vllm.device_allocator.__file__))  # vllm/
    naming = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as fh:
                    if patches.LOOKUP in fh.read():
                        rel = os.path.relpath(path, os.path.dirname(root))[:-3]
                        naming.add(rel.replace(os.sep, ".").removesuffix(".__init__"))
    # CuMemBackend's methods import it at call time from vllm.device_allocator, patched
    assert naming == set(patches.ALLOCATOR_LOOKUPS) | \
        {"vllm.device_allocator.sleep_mode_backend"}
    assert patches.vllm_version() in patches.TESTED_VERSIONS
    # and every reader of the graph-pool property reads the patched one: its definition
    # and NCCL_GRAPH_REGISTER (config/vllm.py), IPC registration (cuda_communicator.py),
    # the capture routing (cudagraph_pool.py)
    readers = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as fh:
                    if patches.GRAPH_POOL_PROPERTY in fh.read():
                        readers.add(name)
    assert readers == {"vllm.py", "cuda_communicator.py", "cudagraph_pool.py"}


def test_a_vmm_worker_allocates_sleeps_and_wakes_through_vmm_core(hooked, device_queries):
    vllm = hooked
    worker = vllm.worker(vllm.config("vmm"))
    assert patches.state()["selected"] == "vmm"
    allocator = plugin.VmmMemAllocator.get_instance()
    addresses = {}
    for tag, size in (("weights", 2 * MIB), ("kv_cache", 3 * MIB), ("runtime", MIB),
                      ("workspace", MIB)):
        with worker._maybe_get_memory_pool_context(tag) as region:  # vLLM's own method
            addresses[tag] = region.allocate(size)
    assert allocator.get_current_usage() == 7 * MIB
    assert vllm.lora.get_mem_allocator_instance() is allocator  # the LoRA mixin's lookup
    weights = _fill(addresses["weights"], 2 * MIB, 1)
    runtime = _fill(addresses["runtime"], MIB, 2)
    backend = worker.sleep_mode_backend  # vLLM's factory, by the config's name
    assert type(backend).__name__ == "VmmSleepModeBackend"
    worker.discard(("kv_cache",))
    assert vmm_core.memory_summary()["vllm:kv_cache"]["asleep"]
    worker.sleep(1)  # vLLM's own: suspend(1) between two readings of free memory
    assert backend.state() == "SUSPENDED"
    summary = vmm_core.memory_summary()
    assert all(s["asleep"] and s["device_bytes"] == 0 for s in summary.values())
    assert summary["vllm:weights"]["host_bytes"] == 2 * MIB
    worker.wake_up(["weights"])  # kv_cache may wait; runtime and workspace always wake
    asleep = {t: s["asleep"] for t, s in vmm_core.memory_summary().items()}
    assert asleep == {"vllm:kv_cache": True, "vllm:runtime": False,
                      "vllm:weights": False, "vllm:workspace": False}
    assert ctypes.string_at(addresses["weights"], 2 * MIB) == weights
    assert ctypes.string_at(addresses["runtime"], MIB) == runtime
    worker.wake_up(None)
    assert backend.state() == "RUNNING"
    assert not any(s["asleep"] for s in vmm_core.memory_summary().values())


def test_a_users_weights_region_survives_the_workers_level_2_sleep(hooked, host):
    vllm = hooked
    with vmm_core.region("weights", backend=host) as mine:
        address = mine.allocate(MIB)
    data = _fill(address, MIB, 3)
    worker = vllm.worker(vllm.config("vmm"))
    with worker._maybe_get_memory_pool_context("weights") as region:  # usage was 0
        region.allocate(MIB)
    worker.sleep_mode_backend.suspend(2)
    assert vmm_core.memory_summary()["vllm:weights"]["asleep"]
    assert not vmm_core.memory_summary()["weights"]["asleep"]
    assert ctypes.string_at(address, MIB) == data
    worker.wake_up(None)
    assert ctypes.string_at(address, MIB) == data


def test_graph_captures_go_to_the_plugins_pool_under_offload_cudagraph(hooked, caplog):
    """``--sleep-mode-offload-cudagraph``: vLLM's ``capture_pool`` asks the allocator for
    its graph pool, as for ``cumem``; what a capture leaves alive keeps its bytes through
    a sleep; NCCL graph registration off, a value the user set kept with vLLM's
    warning."""
    vllm = hooked
    config = vllm.config("vmm", offload_graphs=True)
    vllm.worker(config)
    assert config.use_cumem_cudagraph_pool  # also what CudaCommunicator reads
    assert os.environ[patches.NCCL_GRAPH_REGISTER] == "0"
    with vllm.cudagraph_pool.capture_pool(None, config) as handle:  # vLLM's own function
        assert handle is not None
        state = framework_alloc(MIB)  # what a capture allocates (an output kept)
    kept = _fill(state, MIB, 4)
    assert vmm_core.memory_summary()["vllm:cudagraph"]["device_bytes"] >= MIB
    plugin.VmmMemAllocator.get_instance().sleep(offload_tags=("cudagraph",))
    assert vmm_core.memory_summary()["vllm:cudagraph"]["device_bytes"] == 0
    plugin.VmmMemAllocator.get_instance().wake_up()
    assert ctypes.string_at(state, MIB) == kept
    with vllm.cudagraph_pool.capture_outside_cumem_pool():  # profiling's throwaway graphs
        with vllm.cudagraph_pool.capture_pool("theirs", config) as handle:
            assert handle == "theirs"
    patches.restore()
    os.environ[patches.NCCL_GRAPH_REGISTER] = "1"
    patches.install_trigger()
    with caplog.at_level(logging.WARNING, logger="vmm_core"):
        vllm.worker(vllm.config("vmm", offload_graphs=True))
    assert os.environ[patches.NCCL_GRAPH_REGISTER] == "1"
    assert "NCCL_GRAPH_REGISTER=1 pins the CUDA graph pool during sleep" in caplog.text
    del os.environ[patches.NCCL_GRAPH_REGISTER]


def test_without_offload_cudagraph_graphs_stay_out_and_nccl_is_left_alone(hooked):
    vllm = hooked
    config = vllm.config("vmm")
    vllm.worker(config)
    assert patches.state()["selected"] == "vmm"
    assert not config.use_cumem_cudagraph_pool
    assert patches.NCCL_GRAPH_REGISTER not in os.environ


@pytest.mark.parametrize("backend,sleep", [("cumem", True), ("vmm", False)])
def test_any_other_choice_leaves_vllm_exactly_as_it_was(hooked, backend, sleep):
    """cumem, or vmm named without --enable-sleep-mode: the first worker puts vLLM's
    constructor back, and every object is vLLM's own; its allocator lookup then does
    what vLLM does on this platform (refuse), and no memory is vmm_core's."""
    vllm = hooked
    config = vllm.config(backend, sleep=sleep, offload_graphs=True)
    worker = vllm.worker(config)
    assert patches.state() == {"selected": backend if sleep else "off", "trigger": False,
                               "patched": []}
    assert vllm.originals() == vllm.pristine
    assert all(vllm.originals()[k] is v for k, v in vllm.pristine.items())
    assert not config.use_cumem_cudagraph_pool
    assert patches.NCCL_GRAPH_REGISTER not in os.environ
    if sleep:
        with pytest.raises(RuntimeError, match="Sleep mode allocator is not available on "
                                               "platform UnspecifiedPlatform"):
            worker._maybe_get_memory_pool_context("weights")
    assert vmm_core.memory_summary() == {}
    vllm.worker(vllm.config("vmm"))  # the process decided: nothing is patched later
    assert patches.state()["patched"] == []


def test_an_untested_vllm_is_refused_with_the_tested_versions(hooked, monkeypatch):
    vllm = hooked
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.34.0")
    with pytest.raises(VMMError, match=r"tested with vLLM 0\.33\.0, and this is vLLM "
                                       r"0\.34\.0.*Install vllm==0\.33\.0, or use "
                                       r"--sleep-mode-backend cumem"):
        vllm.worker(vllm.config("vmm"))
    assert patches.state()["patched"] == ["WorkerBase.__init__"]  # nothing else changed
    vllm.worker(vllm.config("cumem"))  # another backend runs on any version, untouched
    assert vllm.originals() == vllm.pristine


def test_one_process_serves_one_choice(hooked):
    vllm = hooked
    vllm.worker(vllm.config("vmm"))
    vllm.worker(vllm.config("vmm"))  # the same choice again: fine
    with pytest.raises(VMMError, match="with sleep-mode backend 'vmm' and now one with "
                                       "'cumem'"):
        vllm.worker(vllm.config("cumem"))


def test_restore_puts_back_a_lookup_imported_after_the_patch(hooked):
    """A module imported after the patch binds vmm_core's lookup from
    ``vllm.device_allocator``; restoring finds it there too."""
    vllm = hooked
    vllm.worker(vllm.config("vmm"))
    module = sys.modules.pop("vllm.v1.worker.lora_model_runner_mixin")
    try:
        import vllm.v1.worker.lora_model_runner_mixin as again

        assert again.get_mem_allocator_instance is patches.get_mem_allocator_instance
        patches.restore()
        assert again.get_mem_allocator_instance is \
            vllm.pristine["vllm.device_allocator"]
    finally:
        sys.modules["vllm.v1.worker.lora_model_runner_mixin"] = module
        sys.modules["vllm.v1.worker"].lora_model_runner_mixin = module


def test_importing_vmm_core_and_the_plugin_imports_no_vllm():
    """``import vmm_core`` and of the plugin package leave vLLM unimported, so nothing of
    it can have been patched: only vLLM's own plugin loader starts the plugin."""
    code = ("import sys, vmm_core, vmm_core.integrations.vllm; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
