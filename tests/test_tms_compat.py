"""torch_memory_saver's API on vmm_core (vmm_core.integrations.torch_memory_saver).

The core calls run on every platform the suite has (host, emulated Ascend and MLU, CUDA
when present), allocating from the allocator the region yields, since the host's CPU
allocator cannot be routed and the emulated drivers have no framework.  Graph captures
run on the host (and on CUDA in tests/test_cuda_integrations.py).  The API surface is
compared with the released torch_memory_saver 0.0.10 when it is installed (CI installs
it; ``VMM_CORE_REQUIRE=torch_memory_saver`` fails instead of skipping)."""

from __future__ import annotations

import ctypes
import gc
import inspect
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from host_space import LazyCounter, framework_alloc, read, write

import vmm_core
from vmm_core.errors import BackendError, SleepStateError, VMMError
from vmm_core.integrations import torch_memory_saver as compat
from vmm_core.integrations.torch_memory_saver import settings
from vmm_core.memory import offload, routing, tagged
from vmm_core.memory.offload import pipeline
from vmm_core.memory.torch_views import raw_tensor
from vmm_core.testing import read_bytes, write_bytes
from vmm_core.testing.platforms import skip_or_fail

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags", "fresh_compat")


def _random(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------ every platform
def test_pause_and_resume_keep_backed_up_bytes_and_every_address(vmm_backend, warns_unrouted):
    tms = compat.TorchMemorySaver(backend=vmm_backend)
    dev = tagged.current_device(vmm_backend)
    with tms.region("weights", enable_cpu_backup=True) as w:
        weights = w.allocate(2 * MIB)
    with tms.region("kv_cache") as kv:
        cache = kv.allocate(2 * MIB)
    data = _random(2 * MIB, 1)
    write_bytes(vmm_backend, dev, weights, data)
    write_bytes(vmm_backend, dev, cache, _random(2 * MIB, 2))
    summary = vmm_core.memory_summary()
    assert {"tms:weights:cpu_backup", "tms:kv_cache"} <= set(summary)
    tms.pause()
    assert w.asleep and kv.asleep and w.physical_bytes == kv.physical_bytes == 0
    assert w.host_bytes == 2 * MIB and kv.host_bytes == 0  # only the backed-up region
    tms.resume()
    assert read_bytes(vmm_backend, dev, weights, 2 * MIB) == data
    with warns_unrouted(vmm_backend, "tms:kv_cache"), tms.region("kv_cache") as again:
        assert again is kv and kv.physical_bytes >= 2 * MIB  # the same memory, addresses
    write_bytes(vmm_backend, dev, cache, b"usable")


def test_pause_states_are_checked_as_torch_memory_saver_does(vmm_backend):
    tms = compat.TorchMemorySaver(backend=vmm_backend)
    with tms.region("a") as a:
        a.allocate(MIB)
    with tms.region("b", enable_cpu_backup=True) as b:
        b.allocate(MIB)
    tms.pause("nothing here")  # a tag without memory: nothing to do
    tms.resume("nothing here")
    tms.pause("a")
    assert a.asleep and not b.asleep
    with pytest.raises(SleepStateError, match=r"\['a'\] is paused already"):
        tms.pause("a")
    with pytest.raises(SleepStateError, match="paused already"):
        tms.pause()  # every tag, one of which is paused: nothing changes
    assert not b.asleep
    with pytest.raises(SleepStateError, match=r"\['b'\] is not paused"):
        tms.resume("b")
    with pytest.raises(SleepStateError, match="not paused"):
        tms.resume()
    assert a.asleep
    tms.resume("a")
    tms.pause("")  # "" means every tag, as torch_memory_saver reads it
    assert a.asleep and b.asleep
    tms.resume(None)
    with pytest.raises(ValueError, match="tag must be a string"):
        tms.pause(3)



def test_nested_regions_route_to_the_innermost_tag(vmm_backend):
    tms = compat.TorchMemorySaver(backend=vmm_backend)
    dev = tagged.current_device(vmm_backend)
    with tms.region("model", enable_cpu_backup=True) as outer:
        weight = routing.current_target(dev).allocate(MIB)
        with tms.region("grad", enable_cpu_backup=False) as inner:
            grad = routing.current_target(dev).allocate(MIB)
        extra = routing.current_target(dev).allocate(MIB)
    # on a device the framework may also cache a segment of its own in a region (entering
    # one primes the library workspaces with a tiny multiply): only where ours went matters
    outer_live, inner_live = set(outer.live_allocations()), set(inner.live_allocations())
    assert {weight, extra} <= outer_live and grad not in outer_live
    assert grad in inner_live and not {weight, extra} & inner_live
    data = _random(MIB, 3), _random(MIB, 4)
    write_bytes(vmm_backend, dev, weight, data[0])
    write_bytes(vmm_backend, dev, extra, data[1])
    tms.pause()
    tms.resume()
    assert (read_bytes(vmm_backend, dev, weight, MIB),
            read_bytes(vmm_backend, dev, extra, MIB)) == data


def test_a_retained_backup_is_made_ahead_and_filled_by_the_first_pause(vmm_backend):
    tms = compat.TorchMemorySaver(backend=vmm_backend)
    tms.retain_cpu_backup = True  # the opt-in fast path; off, nothing is held running
    with tms.region("weights", enable_cpu_backup=True) as w:
        w.allocate(4 * MIB)
    assert offload.wait_for_prepared(10)
    assert w.host_bytes == 4 * MIB, "made when the region ended"
    copy = w._host.pending.future.result()
    pins = vmm_backend.implements("vmm_host_register")
    assert w.pinned_host_bytes == (4 * MIB if pins else 0)
    tms.pause("weights")
    assert w._host.copy is copy, "the first pause fills it"
    if pins:
        assert w.last_transfer.strategy == "pinned"
    tms.resume("weights")


# ------------------------------------------------------------------ host: tensors
def _tensor(address: int, n: int, dtype=torch.float32, shape=None):
    t = raw_tensor(address, n, "cpu").view(dtype)
    return t.view(shape) if shape is not None else t


def test_get_cpu_backup_while_paused_and_after_resume(host):
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("w", enable_cpu_backup=True) as w:
        x = _tensor(w.allocate(MIB), MIB, shape=(256, 1024))
    with tms.region("kv") as kv:
        y = _tensor(kv.allocate(MIB), MIB)
    x.copy_(torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)))
    expected = x.clone()
    assert tms.get_cpu_backup(x) is None  # running, no copy made yet
    tms.pause()
    backup = tms.get_cpu_backup(x)
    assert torch.equal(backup, expected) and backup.shape == x.shape
    view = tms.get_cpu_backup(x[8:16], zero_copy=True)
    assert torch.equal(view, expected[8:16])
    with pytest.raises(SleepStateError, match="without a CPU backup"):
        tms.get_cpu_backup(y)
    with pytest.raises(VMMError, match="not contiguous"):
        tms.get_cpu_backup(x.t())
    with pytest.raises(VMMError, match="not allocated inside"):
        tms.get_cpu_backup(torch.zeros(4))
    tms.resume()
    assert torch.equal(x, expected)
    assert tms.retain_cpu_backup is False  # torch_memory_saver's default: given back
    assert tms.get_cpu_backup(x) is None and w.host_bytes == 0
    assert tms.get_cpu_backup(y) is None
    tms.retain_cpu_backup = True
    tms.pause()
    first = tms.get_cpu_backup(x, zero_copy=True).data_ptr()
    tms.resume()
    kept = tms.get_cpu_backup(x, zero_copy=True)  # retained: the same host memory
    assert kept.data_ptr() == first and torch.equal(kept, expected)
    assert w.host_bytes == MIB
    tms.retain_cpu_backup = False
    x.add_(1)
    tms.pause()  # the retained copy is filled again, at the same place
    assert tms.get_cpu_backup(x, zero_copy=True).data_ptr() == first
    tms.resume()
    assert tms.get_cpu_backup(x) is None and w.host_bytes == 0  # given back
    assert torch.equal(x, expected + 1)


def test_retain_cpu_backup_is_off_unless_set_as_torch_memory_saver_has_it(host, monkeypatch):
    tms = compat.TorchMemorySaver(backend=host)
    assert tms.retain_cpu_backup is False
    with tms.region("w", enable_cpu_backup=True) as w:
        w.allocate(MIB)
    assert offload.wait_for_prepared(10) and w.host_bytes == 0, "nothing held running"
    tms.pause()
    assert w.host_bytes == MIB
    tms.resume()
    assert w.host_bytes == 0, "the host copy is given back on resume"
    with pytest.raises(ValueError, match="True or False"):
        tms.retain_cpu_backup = 1
    settings.reset()  # a new process, with the variable set
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    tms = compat.TorchMemorySaver(backend=host)
    assert tms.retain_cpu_backup is True
    assert compat.torch_memory_saver.retain_cpu_backup is True, "the process's setting"
    tms.pause()
    tms.resume()
    assert w.host_bytes == MIB, "kept for the next pause"
    settings.reset()
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "maybe")
    with pytest.raises(VMMError, match="not a boolean"):
        compat.TorchMemorySaver(backend=host).pause()


def test_disable_routes_allocations_out_of_the_region(host, warns_unrouted):
    tms = compat.TorchMemorySaver(backend=host)
    with pytest.raises(VMMError, match="only meaningful inside region"):
        with tms.disable():
            pass
    with warns_unrouted(host, "tms:w", "tms:inner"), tms.region("w") as w:
        assert routing.current_target(0) is w
        with tms.disable():
            assert routing.current_target(0) is None  # nothing of vmm_core serves here
            with tms.region("inner") as inner:  # a region inside disable() routes again
                assert routing.current_target(0) is inner
        assert routing.current_target(0) is w


# ------------------------------------------------------------------ host: graphs


def _graph(host):
    return host.graph_ops(0).new_graph()


def test_a_lazily_made_counter_survives_a_pause_without_cpu_backup(host):
    """Where torch_memory_saver discards graph memory without a backup (and a replay
    then reads garbage), the live counter is kept: only free blocks are given back."""
    tms = compat.TorchMemorySaver(backend=host)
    counter = LazyCounter()
    with tms.cuda_graph(_graph(host), tag="graph", enable_cpu_backup=False):
        counter.step()
        scratch = framework_alloc(4 * MIB)  # an intermediate the capture freed
        routing.current_target(0).deallocate(scratch)
    for _ in range(2):
        counter.step()
    (alloc,) = tagged.allocators("tms:graph")
    tms.pause("graph")
    assert alloc.asleep and alloc.host_bytes == alloc.granularity  # the counter's block
    tms.resume("graph")
    assert counter.step() == 4


def test_captures_sharing_a_pool_share_one_space_and_private_ones_do_not(host):
    tms = compat.TorchMemorySaver(backend=host)
    shared = object()  # what torch.cuda.graph_pool_handle() gives
    outs = []
    for _ in range(2):
        with tms.cuda_graph(_graph(host), pool=shared, tag="g"):
            outs.append(framework_alloc(MIB))  # kept outputs, as SGLang's output_buffers
    assert outs[1] == outs[0] + MIB
    write(outs[0], b"first size")
    write(outs[1], b"second size")
    graph = _graph(host)
    with tms.cuda_graph(graph, tag="g"):
        private = framework_alloc(MIB)
    assert len(tagged.allocators("tms:g")) == 2
    tms.pause("g")
    tms.resume("g")
    assert read(outs[0], 10) == b"first size" and read(outs[1], 11) == b"second size"
    # a private capture's pool goes once its graph is dropped and nothing in it is alive
    routing_alloc = [a for a in tagged.allocators("tms:g") if private in a.live_allocations()]
    routing_alloc[0].deallocate(private)
    del graph
    gc.collect()
    tms.pause("g")
    assert len(tagged.allocators("tms:g")) == 1
    tms.resume("g")


def test_a_private_pool_whose_outputs_live_on_stays(host):
    tms = compat.TorchMemorySaver(backend=host)
    graph = _graph(host)
    with tms.cuda_graph(graph, tag="g"):
        out = framework_alloc(MIB)
    write(out, b"kept")
    del graph
    gc.collect()
    tms.pause("g")
    tms.resume("g")
    assert read(out, 4) == b"kept" and len(tagged.allocators("tms:g")) == 1


# ------------------------------------------------------------------ settings and errors
def test_settings_and_refusals_are_explained(host, monkeypatch):
    tms = compat.TorchMemorySaver(backend=host)
    assert tms.enabled is True
    tms.hook_mode = "torch"
    assert tms.hook_mode == "torch"
    with pytest.raises(ValueError, match="'preload' or 'torch'"):
        tms.hook_mode = "ld_preload"
    tms.memory_margin_bytes = 0
    with pytest.raises(ValueError, match="int >= 0"):
        tms.memory_margin_bytes = -1
    with pytest.raises(NotImplementedError, match="Only setter"):
        tms.memory_margin_bytes
    with pytest.raises(ValueError, match="mutually exclusive"):
        with tms.region("w", enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with tms.region("w", cpu_backup_backend="mmap"):
            pass
    with pytest.raises(ValueError, match="'mmap' or 'pinned'"):
        with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with pytest.raises(ValueError, match="non-empty string"):
        with tms.region(""):
            pass
    assert vmm_core.memory_summary() == {}, "a refused call makes nothing"
    settings.reset()
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "disk")
    with pytest.raises(VMMError, match="'pinned' or 'mmap'"):
        compat.TorchMemorySaver(backend=host).pause()
    monkeypatch.delenv("TMS_INIT_CPU_BACKUP_BACKEND")
    settings.reset()
    with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="pinned") as w:
        w.allocate(MIB)  # either backup backend: vmm_core's host copies
    assert compat.vmm_tags("w") == ["tms:w:cpu_backup"]


def _require_real_tms():
    try:
        import torch_memory_saver as real
    except ImportError as exc:
        skip_or_fail("torch_memory_saver", f"the released package is not installed ({exc})")
    if getattr(real, "__vmm_core_alias__", False):
        pytest.skip("torch_memory_saver resolves to the alias in this process")
    return real


def _parameters(fn) -> list:
    """Names, kinds and defaults (annotations are strings on one side)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


#: parameters that torch_memory_saver's builds for other devices add, accepted at the end
_ADDED = {"cuda_graph": [("auto_dispatch_capture", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          False)]}


def test_the_api_matches_the_released_torch_memory_saver():
    real = _require_real_tms()
    ours, theirs = compat.TorchMemorySaver, real.TorchMemorySaver
    for name in ("region", "cuda_graph", "disable", "pause", "resume", "get_cpu_backup",
                 "set_disk_backup_dir"):
        assert _parameters(getattr(ours, name)) == \
            _parameters(getattr(theirs, name)) + _ADDED.get(name, []), name
    for name in ("enabled", "hook_mode", "memory_margin_bytes", "retain_cpu_backup"):
        assert isinstance(getattr(theirs, name), property), name
        assert isinstance(getattr(ours, name), property), name
        assert (getattr(theirs, name).fset is None) == (getattr(ours, name).fset is None), name
    assert isinstance(real.torch_memory_saver, theirs)
    assert isinstance(compat.torch_memory_saver, ours)
    assert callable(real.configure_subprocess) and callable(compat.configure_subprocess)


# ------------------------------------------------------------------ the alias
def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_alias_on_pythonpath_resolves_the_import_and_its_testing_utils():
    path = os.pathsep.join([compat.alias_path(), os.environ.get("PYTHONPATH", "")])
    result = _run("""
        import torch_memory_saver
        from torch_memory_saver import torch_memory_saver as tms, TorchMemorySaver
        from torch_memory_saver.testing_utils import get_and_print_gpu_memory, get_device
        import vmm_core.integrations.torch_memory_saver as compat
        assert tms is compat.torch_memory_saver and TorchMemorySaver is compat.TorchMemorySaver
        assert torch_memory_saver.configure_subprocess is compat.configure_subprocess
        print("alias ok", get_device())
    """, {"PYTHONPATH": path})
    assert result.returncode == 0, result.stderr
    assert "alias ok cuda" in result.stdout


def test_install_reaches_the_processes_started_after_it():
    result = _run("""
        import subprocess, sys
        from vmm_core.integrations import torch_memory_saver as compat
        compat.install()
        import torch_memory_saver
        assert torch_memory_saver.torch_memory_saver is compat.torch_memory_saver
        child = subprocess.run([sys.executable, "-c",
            "import torch_memory_saver as t; print(getattr(t, '__vmm_core_alias__', False))"],
            capture_output=True, text=True)
        print("child", child.stdout.strip(), child.stderr[-300:])
    """)
    assert result.returncode == 0, result.stderr
    assert "child True" in result.stdout


def test_install_refuses_after_the_real_package_was_imported():
    result = _run("""
        import sys, types
        sys.modules["torch_memory_saver"] = types.ModuleType("torch_memory_saver")
        from vmm_core.integrations import torch_memory_saver as compat
        try:
            compat.install()
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "VMMError" in result.stdout and "before anything imports it" in result.stdout


def test_configure_subprocess_passes_the_alias_on(monkeypatch):
    with compat.configure_subprocess():  # not aliased here: nothing to pass on
        assert compat.alias_path() not in os.environ.get("PYTHONPATH", "")
    monkeypatch.setitem(sys.modules, "torch_memory_saver",
                        sys.modules["vmm_core.integrations.torch_memory_saver"])
    monkeypatch.setattr(compat, "__vmm_core_alias__", True, raising=False)
    before = os.environ.get("PYTHONPATH")
    with compat.configure_subprocess():
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == compat.alias_path()
    assert os.environ.get("PYTHONPATH") == before


# ------------------------------------------------------------------ what a pause must not do
@pytest.mark.parametrize("tag", ["w", None], ids=["one-tag", "every-tag"])
def test_a_pause_that_failed_midway_is_finished_by_pausing_again(host, monkeypatch, tag):
    """One tag whose plain part paused and backed-up part did not, or a pause of every
    tag where one went and the other did not: the same call again finishes it."""
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region(tag or "a") as plain:
        plain.allocate(MIB)
    with tms.region(tag or "b", enable_cpu_backup=True) as backed:
        address = backed.allocate(MIB)
    data = _random(MIB, 11)
    ctypes.memmove(address, data, MIB)
    real = pipeline.save

    def failing(*args, **kwargs):
        raise BackendError("injected: the host copy could not be made")

    monkeypatch.setattr(pipeline, "save", failing)
    with pytest.raises(BackendError, match="injected"):
        tms.pause(tag)
    assert plain.asleep and not backed.asleep  # half paused: the copy failed
    monkeypatch.setattr(pipeline, "save", real)
    tms.pause(tag)  # finishes what failed, without "paused already"
    assert plain.asleep and backed.asleep
    with pytest.raises(SleepStateError, match="is paused already"):
        tms.pause(tag)  # finished: a new pause of paused memory is refused again
    tms.resume(tag)
    assert ctypes.string_at(address, MIB) == data


def test_a_resume_that_failed_midway_is_finished_by_resuming_again(host, monkeypatch):
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("a") as a:
        a.allocate(MIB)
    with tms.region("b", enable_cpu_backup=True) as b:
        address = b.allocate(MIB)
    ctypes.memset(address, 3, MIB)
    tms.pause()
    real = pipeline.restore

    def failing(*args, **kwargs):
        raise BackendError("injected: the copy back failed")

    monkeypatch.setattr(pipeline, "restore", failing)
    with pytest.raises(BackendError, match="injected"):
        tms.resume()
    assert not a.asleep and b.asleep
    monkeypatch.setattr(pipeline, "restore", real)
    tms.resume()
    assert not b.asleep and ctypes.string_at(address, 4) == b"\x03" * 4


def test_a_tag_ending_in_cpu_backup_never_names_another_tags_memory(host):
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("w", enable_cpu_backup=True) as w:
        address = w.allocate(MIB)
    with tms.region("w:cpu_backup") as lookalike:  # a user's tag, no backup
        lookalike.allocate(MIB)
    ctypes.memset(address, 5, MIB)
    assert lookalike is not w
    assert compat.vmm_tags("w") == ["tms:w:cpu_backup"]
    assert compat.vmm_tags("w:cpu_backup") == ["tms:w%3Acpu_backup"]
    tms.pause("w:cpu_backup")
    assert lookalike.asleep and not w.asleep, "pausing the look-alike paused 'w'"
    tms.pause("w")
    tms.resume()
    assert ctypes.string_at(address, 4) == b"\x05" * 4


def test_a_region_of_a_paused_tag_says_how_to_resume_it_in_its_own_words(host):
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("kv") as kv:
        kv.allocate(MIB)
    tms.pause("kv")
    with pytest.raises(SleepStateError) as caught:
        with tms.region("kv"):
            pass
    assert "torch_memory_saver.resume('kv')" in str(caught.value)
    assert "vmm_core" not in str(caught.value) and "tms:" not in str(caught.value)
    tms.resume("kv")


def test_the_fallback_warning_points_at_the_callers_line(host):
    tms = compat.TorchMemorySaver(backend=host)
    with pytest.warns(vmm_core.VMMFallbackWarning) as caught:
        with tms.region("nothing-allocated"):
            pass
    assert caught[0].filename == __file__, caught[0].filename


def test_sleep_and_wake_leave_the_callers_current_device(vmm_backend):
    """The hooks make each allocator's device current in turn; the caller's device (the
    driver's current device or context of its thread) is the one it had before."""
    if not vmm_backend.implements("vmm_thread_device"):
        pytest.skip(f"the {vmm_backend.name} backend has no current device to keep")
    if vmm_backend.probe().device_count < 2:
        pytest.skip("needs two devices")
    from vmm_core.memory import disk_offload

    allocs = []
    for device in (1, 0):
        with vmm_core.region(f"dev{device}", backend=vmm_backend, device=device) as alloc:
            allocs.append(alloc)
            address = alloc.allocate(MIB)
        write_bytes(vmm_backend, device, address, bytes([device + 1]) * 16)
    mine = vmm_backend.thread_device()  # device 0: the last one a hook used
    for tag in ("dev1", "dev0"):
        vmm_core.sleep([tag, "dev0" if tag == "dev1" else "dev1"],
                       offload=["dev0", "dev1"])
        assert vmm_backend.thread_device() == mine
        vmm_core.wake_up(["dev0", "dev1"])
        assert vmm_backend.thread_device() == mine
    disk_offload.sleep(["dev0", "dev1"], os.path.join(os.environ.get("TMPDIR", "/tmp")),
                       chunk_bytes=MIB)
    assert vmm_backend.thread_device() == mine
    disk_offload.wake_up(["dev0", "dev1"])
    assert vmm_backend.thread_device() == mine
    assert [read_bytes(vmm_backend, a.device, a.space_base(), 16) for a in allocs] == \
        [b"\x02" * 16, b"\x01" * 16]


def _slow_registration(monkeypatch, seconds: float) -> None:
    """Page-locking a host copy takes ``seconds`` (a large backup's registration)."""
    import time

    from vmm_core.memory.host_memory import MappedHostCopy

    real = MappedHostCopy.register

    def slow(self, backend, device):
        time.sleep(seconds)
        return real(self, backend, device)

    monkeypatch.setattr(MappedHostCopy, "register", slow)


def test_pause_returns_with_its_pinned_backup_page_locked_and_leaves_mmap_ones_alone(
        host, monkeypatch):
    """torch_memory_saver's "pinned" backups are page-locked when its pause returns (so
    is the device memory that takes); "mmap" ones stay pageable and are not waited for;
    a pause finished by a second call waits as the first would have."""
    _slow_registration(monkeypatch, 0.5)
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("w", enable_cpu_backup=True) as w:
        w.allocate(MIB)
    tms.pause("w")
    assert w.pinned_host_bytes == MIB, "returned before its backup was page-locked"
    tms.resume("w")

    with tms.region("m", enable_cpu_backup=True, cpu_backup_backend="mmap") as m:
        m.allocate(MIB)
    tms.pause("m")
    assert m.pinned_host_bytes == 0, "an mmap backup was waited for"
    tms.resume("m")

    with tms.region("a", enable_cpu_backup=True) as a:
        a.allocate(MIB)
    with tms.region("b") as b:
        b.allocate(MIB)
    real_sleep = vmm_core.sleep

    def second_fails(tags, offload=()):
        real_sleep([t for t in tags if t.startswith("tms:a")],
                   offload=[t for t in offload if t.startswith("tms:a")])
        raise BackendError("injected: the second tag could not sleep")

    monkeypatch.setattr(vmm_core, "sleep", second_fails)
    with pytest.raises(BackendError, match="injected"):
        tms.pause()
    monkeypatch.setattr(vmm_core, "sleep", real_sleep)
    tms.pause()  # finishes it: only b is left to sleep, a's backup is still registering
    assert a.asleep and b.asleep
    assert a.pinned_host_bytes == MIB, "a finished pause returned before the backup was"
