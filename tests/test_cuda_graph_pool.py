"""GraphPool on a GPU with an engine-shaped runner: piecewise Llama graphs vs eager.

Skipped without CUDA; fails instead under VMM_CORE_REQUIRE=cuda.  Needs transformers
(the 'bench' extra) for the Llama decoder layers.
"""

from __future__ import annotations

import random

import pytest

import vmm_core
from vmm_core.errors import CaptureError, CaptureEscapeError, SleepStateError
from vmm_core.testing.platforms import skip_or_fail

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16, 24, 40, 64]


@pytest.fixture
def llama_ready(cuda):
    try:
        import transformers  # noqa: F401
    except ImportError:
        skip_or_fail("cuda", "transformers is not installed (pip install 'vmm_core[bench]')")
    return cuda


@pytest.fixture
def model(llama_ready):
    import torch

    from vmm_bench.models import LlamaStack

    return LlamaStack(layers=2, hidden=512, ffn=1408, heads=8, kv_heads=2, ctx=16,
                      max_batch=max(SIZES), device="cuda", seed=3, dtype=torch.bfloat16)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _check_all(runners, model, seed):
    import torch

    checks = [(r, s) for r in runners for s in SIZES] * 2
    random.Random(seed).shuffle(checks)
    for runner, size in checks:
        n = max(1, size - random.Random(size + seed).randint(0, size // 2))
        x = torch.randn(n, model.hidden, device="cuda", dtype=model.dtype)
        got = runner(x)
        assert _rel(got, model(x)) < 0.02, (runner.family, size)


def _x(model, n):
    import torch

    return torch.randn(n, model.hidden, device="cuda", dtype=model.dtype)


def _pool(cuda, **kw):
    return vmm_core.GraphPool(0, backend=cuda, reads=(), **kw)


@pytest.mark.parametrize("order", ["ascending", "descending", "random"])
def test_cuda_piecewise_runner_matches_eager_in_every_order(cuda, model, order):
    from vmm_bench.piecewise_runners import PiecewiseRunner

    pool = _pool(cuda)
    model(_x(model, 4))  # eager warm-up on the default stream
    pool.warmup(lambda: model(_x(model, max(SIZES))))
    runner = PiecewiseRunner(model, pool, SIZES)
    capture = sorted(SIZES, reverse=order == "descending")
    if order == "random":
        random.Random(5).shuffle(capture)
    for size in capture:
        runner.capture(size)
    assert runner.num_graphs == len(SIZES) * model.num_pieces
    _check_all([runner], model, seed=11)
    stats = pool.stats()
    assert stats["virtual_spaces"] == len(SIZES)
    assert stats["handles"] <= len(SIZES).bit_length() + 1  # merged as a binary counter
    assert stats["physical_bytes"] == stats["largest_space_bytes"], stats
    runner.entries.clear()
    pool.close()


def test_cuda_an_escaping_piece_raises_and_poisons(cuda, model):
    import torch

    pool = _pool(cuda)
    pool.warmup(lambda: model(torch.randn(8, model.hidden, device="cuda", dtype=model.dtype)))
    stash = []

    def leaky_piece():
        out = model.piece(0, torch.zeros(8, model.hidden, device="cuda", dtype=model.dtype))
        stash.append(torch.empty(1 << 20, device="cuda"))  # outlives the capture, undeclared
        return out

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureEscapeError, match="4.00 MiB"):
        with pool.space(8) as handle:
            with torch.cuda.graph(graph, pool=handle, stream=pool.capture_stream):
                out = leaky_piece()
            pool.keep(*out)
    with pytest.raises(CaptureError, match="unusable"):
        pool.before_replay(8)


def test_cuda_two_families_share_physical_pages(cuda, model):
    from vmm_bench.piecewise_runners import FullRunner, PiecewiseRunner

    full_pool = _pool(cuda)
    piece_pool = _pool(cuda, allocator=full_pool.allocator)
    full_pool.warmup(lambda: model(_x(model, max(SIZES))))
    full = FullRunner(model, full_pool, SIZES)
    pieces = PiecewiseRunner(model, piece_pool, SIZES)
    for size in SIZES:
        full.capture(size)
        pieces.capture(size)
    _check_all([full, pieces], model, seed=12)
    alloc = full_pool.allocator
    largest = max(full_pool.stats()["largest_space_bytes"],
                  piece_pool.stats()["largest_space_bytes"])
    assert alloc.num_virtual_spaces == 2 * len(SIZES)
    assert alloc.physical_bytes == largest, (alloc.physical_bytes, largest)
    full.entries.clear(), pieces.entries.clear()
    piece_pool.close(), full_pool.close()


def test_cuda_graph_pool_sleep_and_wake_keep_every_piece_correct(cuda, model):
    from vmm_bench.piecewise_runners import PiecewiseRunner

    pool = _pool(cuda, tag="graph-sleep-test")
    pool.warmup(lambda: model(_x(model, max(SIZES))))
    runner = PiecewiseRunner(model, pool, SIZES)
    for size in SIZES:
        runner.capture(size)
    graphs = runner.num_graphs
    _check_all([runner], model, seed=13)
    vmm_core.sleep("graph-sleep-test")
    assert pool.allocator.physical_bytes == 0
    with pytest.raises(SleepStateError, match="graph-sleep-test"):
        pool.before_replay(runner.key(SIZES[0]))
    vmm_core.wake_up("graph-sleep-test")
    _check_all([runner], model, seed=14)  # every space mapped again on first replay
    assert runner.num_graphs == graphs, "nothing was re-captured"
    runner.entries.clear()
    pool.close()


def test_cuda_replay_refuses_while_the_weights_sleep(cuda, llama_ready):
    import torch

    from vmm_bench.models import LlamaStack
    from vmm_bench.piecewise_runners import PiecewiseRunner

    with vmm_core.region("weights-under-test", backend=cuda):
        model = LlamaStack(layers=1, hidden=256, ffn=512, heads=4, kv_heads=2, ctx=8,
                           max_batch=16, device="cuda", seed=4, dtype=torch.bfloat16)
    pool = vmm_core.GraphPool(0, backend=cuda, tag="graph-reads-test")  # default reads
    pool.warmup(lambda: model(_x(model, 16)))
    runner = PiecewiseRunner(model, pool, [16])
    runner.capture(16)
    assert "weights-under-test" in pool.stats()["reads"][runner.key(16)]
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    before = runner(x).clone()
    vmm_core.sleep("weights-under-test", offload="weights-under-test")
    with pytest.raises(SleepStateError, match="weights-under-test"):
        runner(x)
    vmm_core.wake_up("weights-under-test")
    torch.testing.assert_close(runner(x), before)
    runner.entries.clear()
    pool.close()


def test_cuda_weak_views_share_the_address_and_hold_no_block(cuda):
    """vLLM's entries hold ``weak_ref_tensors(output)``; the vllm and vmm rows rely on ours
    doing the same on CUDA: the same memory, and the block free once the tensor goes."""
    import torch

    from vmm_bench.peers import weak_ref_tensors

    t = torch.arange(1 << 20, device="cuda", dtype=torch.bfloat16).view(1024, 1024)
    pair = weak_ref_tensors((t, t[:4]))
    assert isinstance(pair, tuple) and pair[0].shape == t.shape and pair[0].dtype == t.dtype
    assert pair[0].data_ptr() == t.data_ptr() and torch.equal(pair[0], t)
    held = torch.cuda.memory_allocated()
    del t
    assert torch.cuda.memory_allocated() == held - (2 << 20)  # the view kept nothing
    # made inside a capture, as vLLM's last piece is: a replay writes through it
    graph, x = torch.cuda.CUDAGraph(), torch.ones(1024, device="cuda")
    with torch.cuda.graph(graph):
        out = weak_ref_tensors(x * 2)
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((out == 6).all())


def test_cuda_each_space_holds_what_torchs_own_fresh_pool_holds_for_its_key(llama_ready):
    """A GraphPool space is a fresh framework pool over a bump allocator: it must hold
    exactly the segments torch's own fresh pool reserves for the same key captured alone
    (no segment given back and asked again, no rounding of ours).  Which key's pool is
    largest is torch's packing, not ours: on the H100 the llama8b whole-graph pool grew
    by about 28 MiB, to 208 MiB, when 464 was captured (descending and random order
    alike), against 180 MiB for 512 alone.  Sizes here put the FFN activations between 1
    and 10 MiB, the caching allocator's 20 MiB-segment range."""
    import torch

    from vmm_bench.measure import DeviceMemory
    from vmm_bench.models import LlamaStack
    from vmm_bench.piecewise import fresh_pools, space_accounting
    from vmm_bench.piecewise_runners import FullRunner

    sizes = [256, 384, 464, 512]
    big = LlamaStack(layers=2, hidden=2048, ffn=5632, heads=16, kv_heads=4, ctx=16,
                     max_batch=max(sizes), device="cuda", seed=5, dtype=torch.bfloat16)
    pool = _pool(llama_ready)
    big(_x(big, max(sizes)))
    pool.warmup(lambda: big(_x(big, max(sizes))))
    runner = FullRunner(big, pool, sizes, "vmm-keep")
    for size in sorted(sizes, reverse=True):
        runner.capture(size)
    memory = DeviceMemory(pool.ops)
    spaces = space_accounting([pool], memory)
    # SGLang's discipline in a shared pool holds what vmm-keep holds in a space: the output
    fresh = fresh_pools(big, FullRunner, sizes, "sglang", pool.ops, memory, llama_ready)
    assert fresh is not None and set(fresh) == {str(s) for s in sizes}
    for size in sizes:
        space = spaces[f"full:{size}"]
        assert space["bytes"] == space["torch_segment_bytes"], (size, space)
        # the same segments, not only the same total: torch packed the key the same way
        assert space["torch_segments"] == fresh[str(size)], (size, space, fresh)
    pool.compact()  # the growth step's slack goes: the pages are the largest space
    assert pool.stats()["physical_bytes"] == max(s["bytes"] for s in spaces.values())
    runner.entries.clear()
    pool.close()


def test_cuda_a_seeded_space_carves_its_key_out_of_the_largest_spaces_segments(llama_ready):
    """The ``vmm-keep-seed`` experiment of the bench: each new space's pool is first
    filled with free segments shaped like the largest space's; the graphs still match
    eager, nothing escapes, and the seeded segments are in the space's pool."""
    import collections

    import torch

    from vmm_bench.measure import DeviceMemory
    from vmm_bench.models import LlamaStack
    from vmm_bench.piecewise import space_accounting
    from vmm_bench.piecewise_runners import FullRunner

    sizes = [256, 384, 464, 512]
    big = LlamaStack(layers=2, hidden=2048, ffn=5632, heads=16, kv_heads=4, ctx=16,
                     max_batch=max(sizes), device="cuda", seed=5, dtype=torch.bfloat16)
    pool = _pool(llama_ready)
    pool.warmup(lambda: big(_x(big, max(sizes))))
    memory = DeviceMemory(pool.ops)
    runner = FullRunner(big, pool, sizes, "vmm-keep-seed", memory=memory)
    for size in sorted(sizes, reverse=True):
        runner.capture(size)
    assert runner.seeded[512] == [] and all(runner.seeded[s] for s in sizes[:-1])
    spaces = space_accounting([pool], memory)
    for size in sizes[:-1]:
        have = collections.Counter(spaces[f"full:{size}"]["torch_segments"])
        assert not collections.Counter(runner.seeded[size]) - have, (size, spaces)
        assert spaces[f"full:{size}"]["bytes"] == spaces[f"full:{size}"]["torch_segment_bytes"]
    for size in sizes:
        n = size - 3
        x = torch.randn(n, big.hidden, device="cuda", dtype=big.dtype)
        assert _rel(runner(x), big(x)) < 0.02, size
    runner.entries.clear()
    pool.close()


def test_cuda_a_keys_space_is_made_while_its_warmup_runs_on_the_device(cuda):
    """``GraphPool.warmup(fn, key)``: the space is made after ``fn``'s kernels are queued
    and before the host waits for them (the driver calls overlap the device's work); the
    wait happens even when making it fails; the capture then enters the space made."""
    import torch

    pool = _pool(cuda)
    side = pool.capture_stream
    x = torch.randn(64, 64, device="cuda")
    pool.warmup(lambda: x @ x)  # cuBLAS's workspace of the capture stream
    seen = []
    real = pool._prepare_space

    def prepare(key):
        seen.append(side.query())  # False: the warmup's kernel still runs
        real(key)

    pool._prepare_space = prepare
    cycles = 50_000_000  # tens of milliseconds on any current GPU
    pool.warmup(lambda: torch.cuda._sleep(cycles), key="k")
    assert seen == [False] and "k" in pool.keys
    switches = len(pool.allocator.switch_seconds)
    g = pool.new_graph()
    with pool.space("k") as handle:
        with torch.cuda.graph(g, pool=handle, stream=side):
            y = x @ x
        pool.keep(y)
    assert len(pool.allocator.switch_seconds) == switches
    with pool.replaying("k"):
        g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x @ x)

    def fails(key):
        raise RuntimeError("made to fail")

    pool._prepare_space = fails
    with pytest.raises(RuntimeError, match="made to fail"):
        pool.warmup(lambda: torch.cuda._sleep(cycles), key="other")
    assert side.query(), "the warmup waited for its kernels although the preparation failed"
    del g, y
    pool.close()


def test_cuda_a_pool_let_go_while_another_thread_captures_neither_aborts_nor_breaks_it(cuda):
    """A dropped pool's teardown runs on a helper thread, whenever the collector takes
    the pool.  torch's MemPool destructor asserts that no capture is underway on the
    device, from a destructor (the process aborts); the backend lets a pool go without
    destroying it.  In a child process: a pool with a cached 64 MiB segment is let go of
    while the main thread captures, the capture replays as eager computes, and the next
    flush gives the segment back."""
    from proc_state import run_python

    done = run_python("""
        import gc, threading, torch
        from vmm_backends.cuda.allocator_adapter import CudaAllocatorAdapter

        adapter = CudaAllocatorAdapter(0)
        x, w = (torch.randn(512, 512, device="cuda") for _ in range(2))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x @ w  # the side stream's library workspace, before the capture
        box = [torch.cuda.MemPool()]
        with torch.cuda.use_mem_pool(box[0]):
            cached = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del cached  # a free block the pool keeps cached
        torch.cuda.synchronize()
        errors = []

        def let_go():
            try:
                adapter.release_pool(box.pop())
                gc.collect()
            except Exception as exc:
                errors.append(exc)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            y = x @ w
            other = threading.Thread(target=let_go)
            other.start()
            other.join()
            out = y * 2 + 1
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, (x @ w) * 2 + 1, rtol=1e-3, atol=1e-3)
        assert errors == [], errors
        reserved = torch.cuda.memory_reserved()  # the capture's own segments included
        adapter.flush()
        assert torch.cuda.memory_reserved() <= reserved - (64 << 20), "segment kept"
        print("ok")
    """, timeout=120, hung="a hang while letting a pool go during a capture")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), \
        (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
