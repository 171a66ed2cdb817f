"""The allocator settings vmm_core holds on CUDA, which need no GPU: they build strings.

``graph_capture_record_stream_reuse`` is switched on for one capture, and
``max_split_size_mb`` for as long as the whole process is routed, through torch's
allocator-settings setter.  That setter re-parses a whole configuration and resets the
options it does not name (torch 2.9-2.11), so the string it gets must carry the user's
own configuration too; the setter itself is recorded here, not called.
"""

from __future__ import annotations

import textwrap

import pytest
from proc_state import run_python

from vmm_backends.cuda import alloc_settings, graph_ops

KEY = "graph_capture_record_stream_reuse"


@pytest.fixture
def setter(monkeypatch):
    import torch

    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append,
                        raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return calls


def test_the_users_other_allocator_options_survive_the_capture_block(setter, monkeypatch):
    user = "max_split_size_mb:128,garbage_collection_threshold:0.6"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    with graph_ops.CudaGraphOps(0).record_stream_reuse(True):
        assert setter == [f"{user},{KEY}:True"]
    assert setter == [f"{user},{KEY}:True", f"{user},{KEY}:False"]


def test_a_user_who_turned_the_flag_on_gets_it_back(setter, monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", f"{KEY}:True")
    with graph_ops.CudaGraphOps(0).record_stream_reuse(True):
        pass
    assert setter[-1] == f"{KEY}:True,{KEY}:True"


def test_without_a_user_configuration_only_the_key_is_set(setter):
    with graph_ops.CudaGraphOps(0).record_stream_reuse(True):
        pass
    assert setter == [f"{KEY}:True", f"{KEY}:False"]
    with graph_ops.CudaGraphOps(0).record_stream_reuse(False):
        pass
    assert len(setter) == 2  # off: the allocator's settings are left alone


def test_torch_reads_the_cuda_variable_first(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:32")
    assert alloc_settings.user_alloc_conf() == "max_split_size_mb:64"
    assert alloc_settings.user_sets("MAX_SPLIT_SIZE_MB") == "64"


def test_two_holders_never_undo_each_other(setter, monkeypatch):
    """The routing's split size outlives a capture's flag, and the flag survives the
    split size being given back; a key held with no value to restore is left out."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4")
    release_split = alloc_settings.hold("max_split_size_mb", "512")
    with graph_ops.CudaGraphOps(0).record_stream_reuse(True):
        assert setter[-1].startswith("roundup_power2_divisions:4,")
        assert "max_split_size_mb:512" in setter[-1] and f"{KEY}:True" in setter[-1]
    assert "max_split_size_mb:512" in setter[-1] and f"{KEY}:False" in setter[-1]
    release_split()
    assert "max_split_size_mb" not in setter[-1]
    assert setter[-1].startswith("roundup_power2_divisions:4")
    calls = len(setter)
    release_split()  # a second release changes nothing
    assert len(setter) == calls


def test_a_hold_torch_refused_is_not_sent_again(setter, monkeypatch):
    import torch

    def refuse(conf):
        raise RuntimeError("torch refused the configuration")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse,
                        raising=False)
    with pytest.raises(RuntimeError, match="refused"):
        alloc_settings.hold("max_split_size_mb", "512")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter.append,
                        raising=False)
    alloc_settings.hold("garbage_collection_threshold", "0.6")()
    assert not any("max_split_size_mb" in conf for conf in setter)


def test_a_forked_child_can_hold_a_setting_another_thread_held_at_the_fork():
    """The child has no copy of the thread that held the lock: it must not wait for it."""
    proc = run_python(textwrap.dedent("""
        import os, threading, torch
        from vmm_backends.cuda import alloc_settings

        calls = []
        torch._C._accelerator_setAllocatorSettings = calls.append
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        os.environ.pop("PYTORCH_ALLOC_CONF", None)
        inside, leave = threading.Event(), threading.Event()

        def holder():
            with alloc_settings._lock:
                inside.set()
                leave.wait()

        thread = threading.Thread(target=holder)
        thread.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            done = threading.Event()
            threading.Thread(target=lambda: (alloc_settings.hold("max_split_size_mb",
                                                                 "512")(), done.set()),
                             daemon=True).start()
            os._exit(0 if done.wait(10) and calls[-1] == "" else 3)
        leave.set()
        thread.join()
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
    """))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "child exit 0"


def test_leaving_a_disable_block_never_raises_when_torch_refuses_the_pool(monkeypatch,
                                                                         caplog):
    """A ``disable()`` block gives its pool back as it ends, maybe with its own error in
    flight: a refusal from torch is logged, never raised over that error."""
    import types

    import torch

    from vmm_backends.cuda import allocator_adapter, pool_routing

    def refuse(device, pool_id):
        raise RuntimeError("torch refused to release the pool")

    emptied = []
    monkeypatch.setattr(torch._C, "_cuda_releasePool", refuse, raising=False)
    # torch's own call, where the routing wrappers are installed (an earlier test)
    monkeypatch.setattr(pool_routing, "_original",
                        {**pool_routing._original, "_cuda_releasePool": refuse})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    with caplog.at_level("WARNING", logger="vmm_core"):
        allocator_adapter._give_back(0, types.SimpleNamespace(id=(0, 1)))
    assert "refused to release" in caplog.text
    assert emptied == [True]  # the cache is still emptied: what else was freed goes back
