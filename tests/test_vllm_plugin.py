"""The ``vmm`` sleep-mode backend against vLLM's own released classes (vLLM 0.33).

vLLM's plugin loader finds vmm_core's ``vllm.general_plugins`` entry point, the backend
comes out of vLLM's ``SleepModeBackendFactory`` by name, and suspend / resume / discard
run at each level over real tagged memory on the host backend, bytes checked; vLLM's
memory is the plugin's own (``vllm:<tag>``), apart from a user's tags.  The worker's
own calls through the plugin's patches: tests/test_vllm_worker.py.  Skipped where vLLM
is not installed; ``VMM_CORE_REQUIRE=vllm`` (CI) fails instead."""

from __future__ import annotations

import ctypes
import inspect
import random

import pytest
from host_space import framework_alloc

import vmm_core
from vmm_core.errors import VMMError
from vmm_core.integrations import vllm as plugin
from vmm_core.memory import offload, tagged
from vmm_core.testing.platforms import skip_or_fail

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


@pytest.fixture(scope="module")
def vllm():
    try:
        import vllm.device_allocator as device_allocator
        import vllm.device_allocator.sleep_mode_backend as sleep_mode_backend
        import vllm.plugins as plugins
    except ImportError as exc:
        skip_or_fail("vllm", f"vLLM is not installed ({exc})")
    from vmm_core.integrations.vllm import patches

    plugins.load_general_plugins()  # what every vLLM process does at start
    yield device_allocator, sleep_mode_backend
    patches.restore()  # the hook it installed: no worker here, nothing else changed


@pytest.fixture
def allocator(host, monkeypatch):
    """The process's VmmMemAllocator on the host backend, fresh for the test."""
    alloc = plugin.VmmMemAllocator(backend=host)
    monkeypatch.setattr(plugin.VmmMemAllocator, "instance", alloc)
    yield alloc
    assert offload.wait_for_prepared(10)
    if alloc._graph_pool is not None:
        alloc._graph_pool.close()


def _backend(vllm):
    _, smb = vllm
    cls = smb.SleepModeBackendFactory.get_backend_class(plugin.BACKEND_NAME)
    assert cls.is_supported()  # what create_backend checks before instantiating
    return cls()


def _fill(address: int, n: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(n)
    ctypes.memmove(address, data, n)
    return data


def test_vllms_loader_registers_the_backend_by_name(vllm):
    _, smb = vllm
    cls = smb.SleepModeBackendFactory.get_backend_class("vmm")
    assert issubclass(cls, smb.SleepModeBackend) and cls.__name__ == "VmmSleepModeBackend"
    backend = cls()
    assert backend.state() == "RUNNING"
    assert (cls.preserves_communicators(), cls.preserves_compiled_artifacts(),
            cls.preserves_graphs_with_communicators(), cls.supports_durable_storage()) == \
        (True, True, False, False)
    plugin.register()  # vLLM may load plugins again: nothing changes
    assert smb.SleepModeBackendFactory.get_backend_class("vmm") is cls
    assert "cumem" in smb.SleepModeBackendFactory._registry  # vLLM's own stays
    assert cls.__module__ == "vmm_core.integrations.vllm" and \
        cls.__qualname__ == "VmmSleepModeBackend"


def test_the_allocator_serves_vllms_mem_allocator_protocol(vllm):
    device_allocator, _ = vllm
    protocol = device_allocator.MemAllocator
    names = [n for n, v in vars(protocol).items() if inspect.isfunction(v)
             and not n.startswith("_")]
    assert set(names) == {"use_memory_pool", "sleep", "discard", "wake_up",
                          "get_current_usage"}
    for name in names:
        theirs = [(p.name, p.kind, p.default)
                  for p in inspect.signature(getattr(protocol, name)).parameters.values()]
        ours = [(p.name, p.kind, p.default) for p in
                inspect.signature(getattr(plugin.VmmMemAllocator, name)).parameters.values()]
        assert ours == theirs, name
    assert plugin.deferrable_tags() == tuple(device_allocator.DEFERRABLE_TAGS) == \
        plugin.DEFERRABLE_TAGS


def _engine_memory(allocator):
    """What vLLM's worker allocates, tag by tag, nested as it nests them."""
    blocks = {}
    with allocator.use_memory_pool("weights") as w:
        blocks["weights"] = w.allocate(2 * MIB)
    with allocator.use_memory_pool("runtime") as rt:
        with allocator.use_memory_pool("kv_cache") as kv:
            blocks["kv_cache"] = kv.allocate(3 * MIB)
        blocks["runtime"] = rt.allocate(MIB)
    with allocator.use_memory_pool("workspace") as ws:
        blocks["workspace"] = ws.allocate(MIB)
    with allocator.cudagraph_pool() as handle:
        assert handle is not None
        blocks["cudagraph"] = framework_alloc(MIB)  # an output the graphs keep
    return blocks


@pytest.mark.parametrize("level", [1, 2])
def test_each_level_offloads_what_vllm_offloads_and_discards_the_rest(vllm, allocator, level):
    blocks = _engine_memory(allocator)
    sizes = {"weights": 2 * MIB, "kv_cache": 3 * MIB, "runtime": MIB, "workspace": MIB,
             "cudagraph": MIB}
    data = {t: _fill(blocks[t], sizes[t], i) for i, t in enumerate(sizes)}
    assert allocator.get_current_usage() == sum(sizes.values())
    backend = _backend(vllm)
    backend.suspend(level)
    assert backend.state() == "SUSPENDED"
    full = vmm_core.memory_summary()
    assert set(full) == {f"vllm:{t}" for t in sizes}  # every tag of it under vllm:, none other
    summary = {t[len("vllm:"):]: v for t, v in full.items()}
    assert all(summary[t]["asleep"] and summary[t]["device_bytes"] == 0 for t in sizes)
    kept = {t: summary[t]["host_bytes"] for t in sizes}
    assert kept == {"weights": 2 * MIB if level == 1 else 0, "kv_cache": 0,
                    "runtime": MIB, "workspace": 0, "cudagraph": MIB}
    assert allocator.get_current_usage() == sum(sizes.values())  # asleep still counts
    backend.resume(["weights"])  # kv_cache may wait; every other tag wakes
    asleep = {t: vmm_core.memory_summary()[f"vllm:{t}"]["asleep"] for t in sizes}
    assert asleep == {"weights": False, "kv_cache": True, "runtime": False,
                      "workspace": False, "cudagraph": False}
    backend.resume(None)
    assert backend.state() == "RUNNING"
    for tag in ("runtime", "cudagraph") + (("weights",) if level == 1 else ()):
        assert ctypes.string_at(blocks[tag], sizes[tag]) == data[tag], tag


def test_the_first_level_1_sleep_copies_weights_at_the_pinned_rate(vllm, allocator):
    blocks = _engine_memory(allocator)
    assert offload.wait_for_prepared(10)
    (weights,) = tagged.allocators("vllm:weights")
    assert weights.pinned_host_bytes == 2 * MIB  # announced when loading ended
    data = _fill(blocks["weights"], 2 * MIB, 7)
    backend = _backend(vllm)
    backend.suspend(1)
    assert weights.last_transfer.strategy == "pinned"
    backend.resume()
    assert ctypes.string_at(blocks["weights"], 2 * MIB) == data


def test_discard_releases_only_the_named_tags(vllm, allocator):
    blocks = _engine_memory(allocator)
    data = _fill(blocks["weights"], 2 * MIB, 3)
    backend = _backend(vllm)
    backend.discard(("kv_cache",))
    assert backend.state() == "SUSPENDED"
    summary = vmm_core.memory_summary()
    assert summary["vllm:kv_cache"]["asleep"] and not summary["vllm:weights"]["asleep"]
    assert summary["vllm:kv_cache"]["host_bytes"] == 0
    backend.resume(["kv_cache"])
    assert not vmm_core.memory_summary()["vllm:kv_cache"]["asleep"]
    assert ctypes.string_at(blocks["weights"], 2 * MIB) == data


def test_the_allocators_own_sleep_offloads_the_default_tag_unless_told(vllm, allocator):
    with allocator.use_memory_pool() as pool:  # no tag: "default"
        address = pool.allocate(MIB)
    data = _fill(address, MIB, 5)
    allocator.sleep()
    assert vmm_core.memory_summary()["vllm:default"]["host_bytes"] == MIB
    allocator.sleep(offload_tags="default")  # asleep already: kept as it went
    allocator.wake_up()
    assert ctypes.string_at(address, MIB) == data
    assert vmm_core.memory_summary()["vllm:default"]["host_bytes"] == MIB  # kept, running
    allocator.sleep(offload_tags=())
    assert vmm_core.memory_summary()["vllm:default"]["host_bytes"] == 0  # discarded
    allocator.wake_up(tags=["weights"])  # "default" cannot be deferred
    assert not vmm_core.memory_summary()["vllm:default"]["asleep"]


def test_bad_arguments_are_refused_before_anything_sleeps(vllm, allocator):
    _engine_memory(allocator)
    backend = _backend(vllm)
    for level in ("1", 0, True, 1.0):
        with pytest.raises(ValueError, match="sleep level"):
            backend.suspend(level)
    with pytest.raises(ValueError, match="non-empty strings"):
        backend.discard(("kv_cache", 3))
    with pytest.raises(ValueError, match="non-empty string"):
        with allocator.use_memory_pool(""):
            pass
    assert backend.state() == "RUNNING"
    assert not any(s["asleep"] for s in vmm_core.memory_summary().values())


def test_the_backend_refuses_an_engine_whose_memory_cumem_holds(vllm, allocator,
                                                                 monkeypatch):
    """vLLM 0.33 allocates through CuMemAllocator whatever backend is selected: the vmm
    backend says so instead of freeing nothing.  vLLM's cumem module loads its CUDA
    extension at import, so this runs only where vLLM and a CUDA driver are both
    present (docs/integrations.md lists it among what CI cannot run)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError as exc:  # libcuda.so.1 missing: the extension raises ImportError
        pytest.skip(f"vllm.device_allocator.cumem cannot be imported here ({exc}); it "
                    f"loads vLLM's CUDA extension")

    cumem = CuMemAllocator()  # vLLM's real class; its bookkeeping needs no device
    cumem._python_malloc_callback((0, 2 * MIB, 0x7F0000000000, 0))
    monkeypatch.setattr(CuMemAllocator, "instance", cumem)
    backend = _backend(vllm)
    with pytest.raises(VMMError, match="get_mem_allocator_instance"):
        backend.suspend(1)
    assert backend.state() == "RUNNING"
    with allocator.use_memory_pool("weights") as w:  # memory of our own: it runs
        w.allocate(MIB)
    backend.suspend(2)
    backend.resume()


def test_a_users_own_weights_region_survives_vllms_level_2_sleep_byte_exact(vllm, host,
                                                                          allocator):
    """The README's first snippet beside vLLM in one process: ``region("weights")`` is
    the user's, vLLM's weights are ``vllm:weights``.  vLLM's level 2 discards its own
    weights and never the user's; its usage counts only its own; the user's sleep of
    ``"weights"`` leaves vLLM's running."""
    with vmm_core.region("weights", backend=host) as mine:
        address = mine.allocate(2 * MIB)
    data = _fill(address, 2 * MIB, 11)
    blocks = _engine_memory(allocator)
    assert allocator.get_current_usage() == 8 * MIB  # vLLM's five tags, not the user's
    backend = _backend(vllm)
    backend.suspend(2)
    summary = vmm_core.memory_summary()
    assert summary["vllm:weights"]["asleep"] and summary["vllm:weights"]["host_bytes"] == 0
    assert not summary["weights"]["asleep"] and summary["weights"]["device_bytes"] >= 2 * MIB
    assert ctypes.string_at(address, 2 * MIB) == data  # readable all along: never unmapped
    backend.resume(None)
    assert ctypes.string_at(address, 2 * MIB) == data
    vmm_core.sleep("weights", offload="weights")  # the user's own tag, the user's call
    assert not vmm_core.memory_summary()["vllm:weights"]["asleep"]
    vmm_core.wake_up("weights")
    assert ctypes.string_at(address, 2 * MIB) == data
    _fill(blocks["weights"], 2 * MIB, 12)  # vLLM's weights, written after its reload


def test_the_plugins_tags_are_named_and_addressable(vllm, allocator):
    """``vmm_tags`` gives the vmm_core names of vLLM's tags, which vmm_core's own calls
    take; ``memory_summary`` lists them so."""
    _engine_memory(allocator)
    names = ["vllm:cudagraph", "vllm:kv_cache", "vllm:runtime", "vllm:weights",
             "vllm:workspace"]
    assert plugin.vmm_tags() == names
    assert sorted(vmm_core.memory_summary()) == names
    assert plugin.vmm_tags("kv_cache") == ["vllm:kv_cache"]
    with pytest.raises(ValueError, match="non-empty string"):
        plugin.vmm_tags("")
    vmm_core.sleep(plugin.vmm_tags("kv_cache"))  # what a user may do by hand
    assert vmm_core.memory_summary()["vllm:kv_cache"]["asleep"]
    allocator.wake_up(["kv_cache"])  # vLLM's own wake finds it asleep and wakes it
    assert not vmm_core.memory_summary()["vllm:kv_cache"]["asleep"]


def test_a_fork_while_another_thread_holds_the_patches_lock_leaves_the_child_usable(vllm):
    """The patches' lock (held while a worker's choice is applied) renews in a forked
    child (vmm_core.forksafe, stage "integrations"): the child's first question to it
    returns.  The allocator's own locks: tests/test_features_together_host.py."""
    from proc_state import fork_while_held

    from vmm_core.integrations.vllm import patches

    def child():
        assert patches.state()["selected"] is None

    fork_while_held(patches._lock, child, "on the vLLM plugin's patches lock held at the "
                                          "fork")
