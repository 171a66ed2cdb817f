"""GPU suite for what torch_memory_saver's callers need beyond regions: the whole-process
mode (``TMS_INIT_ENABLE``), the caller's graph pool handle named mid-capture (SGLang's
symmetric-memory toggle), NCCL's graph registration, the caller's current device over
two GPUs, the free-memory margin and disk backups, with real tensors.  Skipped without
CUDA, failing under VMM_CORE_REQUIRE=cuda.  The whole-process tests run each in a fresh
process started as RL launchers start their training processes.

    VMM_CORE_REQUIRE=cuda python -m pytest tests/test_cuda_tms_process.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vmm_core.integrations import torch_memory_saver as compat

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_tags", "fresh_compat")]

MIB = 1 << 20


def _child(code: str, timeout: float = 300, **env) -> str:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("TMS_") and k not in ("PYTHONPATH", "LD_PRELOAD")}
    full.update(LD_PRELOAD=compat.preload_path(), **env)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


_HELPERS = """
import threading
import torch
from torch_memory_saver import torch_memory_saver as tms
import vmm_core
from vmm_core.memory import tagged, whole_process

def in_process_region(t):
    segments = whole_process.process_routing().segments()
    p = t.data_ptr()
    return any(a <= p < a + n for a, n in segments.items())

def in_tag(t, tag):
    p = t.data_ptr()
    for alloc in tagged.allocators(tag):
        try:
            alloc.translate(p, alloc.current_space)
            return True
        except vmm_core.VMMError:
            pass
    return False
"""


def test_cuda_every_allocation_of_the_process_is_in_the_default_region(cuda):
    out = _child(_HELPERS + textwrap.dedent("""
        first = torch.full((4 << 20,), 3, dtype=torch.uint8, device="cuda")  # before any call
        assert whole_process.process_routing() is not None, "routed at device init"
        assert in_process_region(first)
        box = []
        thread = threading.Thread(target=lambda: box.append(torch.ones(1 << 20, device="cuda")))
        thread.start(); thread.join()
        assert in_process_region(box[0]), "another thread's allocation"
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_side = torch.zeros(1 << 20, device="cuda")
        assert in_process_region(on_side), "another stream's"
        w = torch.randn(512, 512, device="cuda", requires_grad=True)
        (w @ w).sum().backward()  # the gradient is made on autograd's own thread
        assert in_process_region(w.grad)

        with tms.region(tag="grad_buffer", enable_cpu_backup=False):
            grads = torch.zeros(1 << 20, device="cuda")
            v = torch.randn(512, 512, device="cuda", requires_grad=True)
            (v @ v).sum().backward()  # autograd's thread is in no block of its own
        assert in_tag(grads, "tms:grad_buffer") and not in_process_region(grads)
        assert in_tag(v, "tms:grad_buffer") and in_process_region(v.grad)
        with tms.disable():
            plain = torch.zeros(1 << 20, device="cuda")
        assert not in_process_region(plain) and not in_tag(plain, "tms:grad_buffer")

        # a graph captured with torch's own call: its memory stays its private pool's
        static_in = torch.randn(64, 512, device="cuda")
        torch.matmul(static_in, w.detach())  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = torch.relu(static_in @ w.detach())
        assert not in_process_region(static_out), "capture memory went to the process pool"
        after = torch.full((8 << 20,), 9, dtype=torch.uint8, device="cuda")  # reuses nothing
        x = torch.randn(64, 512, device="cuda")
        static_in.copy_(x)
        graph.replay()
        torch.testing.assert_close(static_out, torch.relu(x @ w.detach()))

        address = first.data_ptr()
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        tms.pause()
        freed = torch.cuda.mem_get_info()[0] - free0
        tms.resume()
        assert first.data_ptr() == address and int(first.min()) == int(first.max()) == 3
        assert int(after.min()) == 9
        print("freed MiB", freed >> 20)
        from vmm_backends.cuda import pool_routing
        print("torch gives an allocation to the newest routing:", pool_routing._newest_first)
    """), TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    assert "newest routing: True" in out or "newest routing: False" in out, out
    freed = int(out.split("freed MiB")[1].split()[0])
    assert freed >= 12, out


def test_cuda_the_routed_process_gives_back_cached_memory_where_torch_would(cuda):
    """Leaving ``disable()`` gives back what was freed inside it, and after two large
    tensors are freed, one as large as both is served: torch_memory_saver's
    ``training_engine`` example asks both of the process (its preload mode leaves torch
    unrouted, and torch then releases its cache before reporting out of memory)."""
    out = _child("""
        import torch
        from torch_memory_saver import torch_memory_saver as tms

        def used():
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            return total - free

        torch.ones(1, device="cuda")
        with tms.disable():
            before = used()
            x = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
            assert used() >= before + (1 << 30)
            del x
        left = used() - before
        assert left <= 16 << 20, f"{left >> 20} MiB still held after disable()"
        n = int(torch.cuda.mem_get_info()[0] * 0.3)
        a = torch.full((n,), 1, dtype=torch.uint8, device="cuda")
        b = torch.full((n,), 2, dtype=torch.uint8, device="cuda")
        del a, b
        c = torch.full((2 * n,), 3, dtype=torch.uint8, device="cuda")
        assert int(c[-1]) == 3
        print("served MiB", (2 * n) >> 20)
    """, TMS_INIT_ENABLE="1")
    assert "served MiB" in out, out


def test_cuda_disable_inside_a_capture_keeps_what_the_graph_uses(cuda):
    """A ``disable()`` block opened and closed inside a capture gives nothing back at its
    end: the graph reads what was allocated in it, and emptying torch's cache there would
    end the capture.  Replays match eager on fresh inputs."""
    out = _child("""
        import torch
        from torch_memory_saver import torch_memory_saver as tms

        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                with tms.disable():
                    tmp = x * 2
                y = tmp + 1
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            with tms.disable():
                tmp = x * 2
            y = tmp + 1
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, x * 2 + 1)
        print("replays match")
    """, TMS_INIT_ENABLE="1")
    assert "replays match" in out, out


def test_cuda_a_training_step_survives_pause_and_resume_of_the_whole_process(cuda):
    out = _child("""
        import torch
        from torch_memory_saver import torch_memory_saver as tms

        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True).cuda()
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
        x = torch.randn(8, 64, 256, device="cuda")

        def step():
            opt.zero_grad(set_to_none=True)
            loss = layer(x).square().mean()
            loss.backward()
            opt.step()
            return float(loss)

        step()
        params = [p.detach().cpu().clone() for p in layer.parameters()]
        state = [v.detach().cpu().clone() for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v)]
        torch.cuda.synchronize()
        tms.pause()
        tms.resume()
        assert all(torch.equal(p.detach().cpu(), q) for p, q in zip(layer.parameters(), params))
        assert all(torch.equal(v.detach().cpu(), q) for v, q in zip(
            [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)], state))
        print("loss", step())
    """, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    assert "loss" in out


def test_cuda_a_callers_pool_named_mid_capture_reaches_the_capture_pool(cuda):
    """SGLang captures with ``pool=P`` from its own ``graph_pool_handle()`` and stops and
    restarts allocation to ``P`` in the middle of the capture (its symmetric-memory
    allocator): those calls reach the pool the capture records to."""
    import torch

    tms = compat.TorchMemorySaver(backend=cuda)
    caller_pool = torch.cuda.graph_pool_handle()
    side_pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(side_pool):  # its segment made before the capture
        torch.empty(MIB, dtype=torch.uint8, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    static_in = torch.randn(32, 256, device="cuda")
    torch.relu(static_in @ w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    device = torch.cuda.current_device()
    with tms.cuda_graph(graph, pool=caller_pool, tag="graphs"):
        hidden = torch.relu(static_in @ w)
        torch._C._cuda_endAllocateToPool(device, caller_pool)  # as SGLang's toggle
        with torch.cuda.use_mem_pool(side_pool):
            symmetric = torch.empty(MIB, dtype=torch.uint8, device="cuda")
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, caller_pool)
        static_out = hidden @ w
    side_blocks = {int(s["address"]) for s in side_pool.snapshot()}
    assert any(a <= symmetric.data_ptr() < a + (2 << 20) for a in side_blocks)
    (alloc,) = [a for a in vmm_core_allocators("tms:graphs")]
    alloc.translate(static_out.data_ptr(), alloc.current_space)  # in the capture's pool
    for _ in range(2):
        x = torch.randn(32, 256, device="cuda")
        static_in.copy_(x)
        graph.replay()
        torch.testing.assert_close(static_out, torch.relu(x @ w) @ w)
    tms.pause("graphs")
    tms.resume("graphs")
    graph.replay()
    torch.testing.assert_close(static_out, torch.relu(static_in @ w) @ w)


def vmm_core_allocators(tag):
    from vmm_core.memory import tagged

    return tagged.allocators(tag)


def test_cuda_nccl_graph_registration_is_turned_off_by_a_capture(cuda):
    out = _child("""
        import os, warnings
        import torch
        from vmm_core.integrations.torch_memory_saver import torch_memory_saver as tms

        x = torch.ones(16, device="cuda")
        with tms.cuda_graph(torch.cuda.CUDAGraph(), tag="g"):
            y = x * 2
        print("unset ->", os.environ.get("NCCL_GRAPH_REGISTER"))
    """)
    assert "unset -> 0" in out
    out = _child("""
        import warnings
        import torch
        from vmm_core.integrations.torch_memory_saver import torch_memory_saver as tms

        x = torch.ones(16, device="cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tms.cuda_graph(torch.cuda.CUDAGraph(), tag="g"):
                y = x * 2
        print("warned", any("NCCL_GRAPH_REGISTER=1" in str(w.message) for w in caught))
    """, NCCL_GRAPH_REGISTER="1")
    assert "warned True" in out


def test_cuda_resume_keeps_the_current_device_over_two_gpus(cuda):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    tms = compat.TorchMemorySaver(backend=cuda)
    tensors = []
    for device, value in ((0, 7), (1, 13)):
        torch.cuda.set_device(device)
        with tms.region(tag=f"dev{device}", enable_cpu_backup=True,
                        cpu_backup_backend="mmap"):
            tensors.append(torch.full((64 * MIB,), value, dtype=torch.uint8,
                                      device=f"cuda:{device}"))
    for device in (0, 1):
        torch.cuda.set_device(device)
        tms.pause(f"dev{device}")
    torch.cuda.set_device(0)
    tms.resume()
    assert torch.cuda.current_device() == 0
    tms.pause()
    assert torch.cuda.current_device() == 0
    tms.resume()
    for tensor, value in zip(tensors, (7, 13)):
        assert int(tensor.min()) == int(tensor.max()) == value


def test_cuda_memory_margin_refuses_an_allocation_that_leaves_too_little(cuda):
    import torch

    tms = compat.TorchMemorySaver(backend=cuda)
    free = torch.cuda.mem_get_info()[0]
    tms.memory_margin_bytes = free - 64 * MIB
    try:
        with tms.region("kv"):
            small = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
            with pytest.raises(torch.cuda.OutOfMemoryError):
                torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    finally:
        tms.memory_margin_bytes = 0
    assert small.numel() == 16 * MIB


def test_cuda_disk_backup_brings_every_byte_back(cuda, tmp_path):
    import torch

    tms = compat.TorchMemorySaver(backend=cuda)
    tms.set_disk_backup_dir(str(tmp_path))
    gen = torch.Generator(device="cuda").manual_seed(3)
    with tms.region("w", enable_disk_backup=True):
        big = torch.randn(13 * MIB // 4 + 12345, device="cuda", generator=gen)
        small = torch.full((7,), 10, dtype=torch.uint8, device="cuda")
    expected = big.clone(), small.clone()
    for _ in range(2):
        free0 = torch.cuda.mem_get_info()[0]
        tms.pause("w")
        files = os.listdir(tmp_path)
        assert torch.cuda.mem_get_info()[0] > free0 and len(files) == 2, files
        tms.resume("w")
        assert torch.equal(big, expected[0]) and torch.equal(small, expected[1])
        assert sorted(os.listdir(tmp_path)) == sorted(files), "kept, as torch_memory_saver does"
