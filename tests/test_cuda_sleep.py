"""GPU suite for offload sleep/wake: skipped without CUDA, failing under VMM_CORE_REQUIRE=cuda.

Run on the GPU machine with:  VMM_CORE_REQUIRE=cuda python -m pytest tests -k cuda
(The contract suite also runs every offload strategy and mid-copy failure on cuda.)
"""

from __future__ import annotations

import threading
import time

import pytest

import vmm_core
from vmm_core.errors import BackendError, SleepStateError
from vmm_core.memory import offload, tagged
from vmm_core.testing import FaultInjector

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture
def tags_cleanup():
    made = []
    yield made
    import torch

    torch.cuda.synchronize()
    for tag in made:
        for alloc in tagged.allocators(tag):
            if alloc.asleep:
                alloc.wake(keep_host_buffers=False)


def _region_tensor(cuda, tag, nbytes, made):
    import torch

    made.append(tag)
    with vmm_core.region(tag, backend=cuda):
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def test_cuda_default_offload_is_staged(cuda):
    assert cuda.capabilities(0).async_copies
    assert offload.choose_strategy(cuda, 0) == "staged"


def test_cuda_offload_bytes_survive_20_cycles_over_several_tags(cuda, tags_cleanup):
    import torch

    sizes = {"cuda-w": 192 * MIB + 4096, "cuda-kv": 96 * MIB, "cuda-a": 8 * MIB - 512}
    tensors = {t: _region_tensor(cuda, t, n, tags_cleanup) for t, n in sizes.items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    with offload.configured(pin_kept=False):  # every round on the ring (pinned: below)
        _twenty_cycles(tensors, sizes, gen)


def _twenty_cycles(tensors, sizes, gen):
    import torch

    for cycle in range(20):
        refs = {}
        for t, x in tensors.items():
            x.random_(0, 256, generator=gen)
            refs[t] = x.clone()
        keep = cycle % 4 == 3
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        vmm_core.sleep(tuple(sizes), offload=tuple(sizes))
        assert torch.cuda.mem_get_info()[0] - free_awake >= sum(sizes.values()) - 8 * MIB
        summary = vmm_core.memory_summary()
        for t in sizes:
            assert summary[t]["asleep"] and summary[t]["device_bytes"] == 0
            assert summary[t]["host_bytes"] >= sizes[t]
        vmm_core.wake_up(tuple(sizes), keep_host_buffers=keep)
        for t, x in tensors.items():
            assert torch.equal(x, refs[t]), (cycle, t)
            alloc = tagged.allocators(t)[0]
            assert alloc.last_transfer.strategy == "staged"
            if keep:  # the live bytes: the tensor, not the pool's free cached blocks
                assert sizes[t] <= alloc.host_bytes <= alloc.physical_bytes
            else:
                assert alloc.host_bytes == 0


def test_cuda_offload_waits_for_work_queued_on_other_streams(cuda, tags_cleanup):
    import torch

    x = _region_tensor(cuda, "cuda-ordered", 256 * MIB, tags_cleanup).view(torch.float32)
    x.fill_(1.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(20):  # still running when sleep starts
            x.add_(1.0)
    vmm_core.sleep("cuda-ordered", offload="cuda-ordered")  # no synchronize before it
    vmm_core.wake_up("cuda-ordered")
    assert torch.equal(x, torch.full_like(x, 21.0))


def test_cuda_staged_failure_mid_copy_keeps_bytes_and_state(cuda, tags_cleanup):
    import torch

    x = _region_tensor(cuda, "cuda-fail", 160 * MIB, tags_cleanup)
    x.random_(0, 256)
    ref = x.clone()
    alloc = tagged.allocators("cuda-fail")[0]
    faulty = FaultInjector(alloc.backend)
    # 20 chunks: the failure is mid-way; nothing kept: every sleep makes its host copy
    with offload.configured(chunk_bytes=8 * MIB, keep_host_buffers=False):
        alloc.backend = faulty
        faulty.fail_copy_after = 9
        with pytest.raises(BackendError, match="injected"):
            vmm_core.sleep("cuda-fail", offload="cuda-fail")
        assert not alloc.asleep and alloc.host_bytes == 0 and torch.equal(x, ref)
        faulty.fail_copy_after = None
        vmm_core.sleep("cuda-fail", offload="cuda-fail")
        faulty.fail_copy_after, faulty.live_handles = 11, 0
        with pytest.raises(BackendError, match="injected"):
            vmm_core.wake_up("cuda-fail")
        assert alloc.asleep and alloc.physical_bytes == 0 and faulty.live_handles == 0
        assert alloc.host_bytes >= 160 * MIB  # the host copy survived the failed wake
        faulty.fail_copy_after = None
        vmm_core.wake_up("cuda-fail")
    assert torch.equal(x, ref)
    offload.release_staging()


def test_cuda_kept_copies_are_pinned_and_later_rounds_copy_straight(cuda, tags_cleanup):
    """Round 1 through the ring, then a registered (page-locked) host copy
    kept and copied straight into and out of; keep_host_buffers=False gives it back."""
    import torch

    sizes = {"cuda-kw": 160 * MIB + 4096, "cuda-kkv": 64 * MIB - 512}
    tensors = {t: _region_tensor(cuda, t, n, tags_cleanup) for t, n in sizes.items()}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rnd in range(4):
        refs = {}
        for t, x in tensors.items():
            x.random_(0, 256, generator=gen)
            refs[t] = x.clone()
        vmm_core.sleep(tuple(sizes), offload=tuple(sizes))
        for t in sizes:
            alloc = tagged.allocators(t)[0]
            assert alloc.last_transfer.strategy == ("staged" if rnd == 0 else "pinned")
        vmm_core.wake_up(tuple(sizes))
        for t, x in tensors.items():
            assert torch.equal(x, refs[t]), (rnd, t)
            alloc = tagged.allocators(t)[0]
            assert alloc.last_transfer.strategy == "pinned"
            assert alloc.host_bytes == alloc.pinned_host_bytes  # live bytes, all pinned
            assert sizes[t] <= alloc.host_bytes <= alloc.physical_bytes
    vmm_core.sleep(tuple(sizes), offload=tuple(sizes))
    vmm_core.wake_up(tuple(sizes), keep_host_buffers=False)
    for t, x in tensors.items():
        assert torch.equal(x, refs[t])
        assert vmm_core.memory_summary()[t]["host_bytes"] == 0


def test_cuda_prepare_makes_the_first_sleep_copy_straight(cuda, tags_cleanup):
    import torch

    x = _region_tensor(cuda, "cuda-prep", 96 * MIB + 512, tags_cleanup)
    x.random_(0, 256)
    ref = x.clone()
    offload.prepare("cuda-prep")
    alloc = tagged.allocators("cuda-prep")[0]
    assert x.nbytes <= alloc.pinned_host_bytes <= alloc.physical_bytes  # the live bytes
    vmm_core.sleep("cuda-prep", offload="cuda-prep")
    assert alloc.last_transfer.strategy == "pinned"
    vmm_core.wake_up("cuda-prep")
    assert torch.equal(x, ref)


def test_cuda_discard_wake_with_zero_returns_zeros(cuda, tags_cleanup):
    x = _region_tensor(cuda, "cuda-zero", 64 * MIB, tags_cleanup)
    for _ in range(3):
        x.fill_(0xAB)
        vmm_core.sleep("cuda-zero")
        vmm_core.wake_up("cuda-zero", zero=True)
        assert int(x.count_nonzero()) == 0


def test_cuda_hold_awake_keeps_a_launch_safe_from_sleep(cuda, tags_cleanup):
    import torch

    x = _region_tensor(cuda, "cuda-held", 64 * MIB, tags_cleanup).view(torch.float32)
    x.fill_(2.0)
    done = []

    def sleeper():
        vmm_core.sleep("cuda-held", offload="cuda-held")
        done.append(time.perf_counter())

    with tagged.hold_awake("cuda-held", backend=cuda, device=0):
        t = threading.Thread(target=sleeper)
        t.start()
        time.sleep(0.05)
        assert not done  # the sleep waits for the block
        total = float(x.sum())  # a launch that reads the held memory
    t.join(10)
    assert done and total == 2.0 * x.numel()
    with pytest.raises(SleepStateError, match="cuda-held"):
        with tagged.hold_awake("cuda-held", backend=cuda, device=0):
            pass
    assert tagged.tags_on(cuda, 0)["cuda-held"] is True
    vmm_core.wake_up("cuda-held")
    assert float(x.sum()) == 2.0 * x.numel()


_REGISTER_DURING_CAPTURE = r"""
import ctypes, mmap, threading
import torch
import vmm_core

backend = vmm_core.get_backend("cuda")
size = 64 << 20
buf = mmap.mmap(-1, size)
buf.write(b"\x01" * size)
address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
go, done, result = threading.Event(), threading.Event(), {}

def background():  # what offload's registration thread does after a sleep
    go.wait(10)
    try:
        backend.host_register(0, address, size)
        backend.host_unregister(0, address)
        result["register"] = "ok"
    except Exception as exc:
        result["register"] = f"{type(exc).__name__}: {exc}"
    finally:
        done.set()

x = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
threading.Thread(target=background, daemon=True).start()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):  # torch's default capture_error_mode: "global"
    y = x * 2
    go.set()
    assert done.wait(10), "the registration did not finish"
    y = y + 1
g.replay()
torch.cuda.synchronize()
print("register", result.get("register"), "replay", bool((y == 3).all()))
"""


def test_cuda_host_registration_on_another_thread_leaves_a_global_capture_intact(cuda):
    """Kept copies register on a background thread after the sleep returns, while the
    caller may capture graphs vmm_core never sees (a training step's).  In the thread's
    default mode the driver refused the registration (CUDA_ERROR_STREAM_CAPTURE_
    UNSUPPORTED) and broke that capture (scripts/probe_capture_pinning.py, H100); the
    CUDA hooks register and unregister in relaxed thread mode.  In a child process: a
    broken capture would leave torch's allocator state behind."""
    from proc_state import run_python

    done = run_python(_REGISTER_DURING_CAPTURE, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("register ok replay True"), \
        (done.stdout[-2000:], done.stderr[-2000:])
