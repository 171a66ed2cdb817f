"""The executor's policy, run for real on the host backend (replay = eager call)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import vmm_core
from vmm_backends.host.graph_ops import current_stream
from vmm_core.errors import CaptureError, CaptureEscapeError
from vmm_core.graphs.shapes import VLLM_DECODE_SIZES, default_buckets, pick_bucket
from vmm_core.memory import routing


def centered(x, w):
    # every output row depends on all rows: a stale (non-zero) padding row changes it
    return (x - x.sum(0, keepdim=True)) @ w


def test_default_buckets_follow_xllm():
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(3) == [1, 2, 3]
    assert pick_bucket([1, 2, 4, 8], 3) == 4
    with pytest.raises(ValueError, match="larger max_inputs"):
        pick_bucket([1, 2, 4], 5)
    assert len(VLLM_DECODE_SIZES) == 51 and VLLM_DECODE_SIZES[-1] == 512


def _pool_of(host, strategy):
    """The pool a decode strategy of the benchmark captures into (None: the executor's
    own GraphPool)."""
    from vmm_bench.torch_pools import BASELINES

    return BASELINES[strategy](backend=host) if strategy in BASELINES else None


@pytest.mark.parametrize("strategy", ["vmm", "shared", "private"])
def test_matches_eager_on_fresh_inputs_and_zeroes_padding(host, strategy):
    w = torch.randn(8, 8, dtype=torch.float64)
    pool = _pool_of(host, strategy)
    ex = vmm_core.GraphExecutor(lambda x: centered(x, w), torch.zeros(48, 8, dtype=torch.float64),
                                backend=None if pool else host, pool=pool)
    assert ex.reuse == strategy and ex.stats()["reuse"] == strategy
    for n in (48, 3, 17, 1, 33, 3):  # large first leaves stale rows behind if not zeroed
        x = torch.randn(n, 8, dtype=torch.float64)
        out = ex(x)
        assert out.shape == (n, 8)
        torch.testing.assert_close(out, centered(x, w))
    assert ex.captured_buckets == [1, 4, 32, 48]
    ex.close()


def test_each_bucket_captured_once_in_its_own_space(host, monkeypatch):
    ex = vmm_core.GraphExecutor(lambda x: x * 2, torch.zeros(16, 4), backend=host)
    captures = []
    real = ex.ops.capture
    monkeypatch.setattr(ex.ops, "capture",
                        lambda g, fn, pool: captures.append(pool) or real(g, fn, pool))
    for n in (3, 4, 16, 2, 3, 16, 9):
        ex(torch.randn(n, 4))
    assert len(captures) == 3 == len(ex.captured_buckets)
    stats = ex.stats()
    assert stats["virtual_spaces"] == 3 and stats["reuse"] == "vmm"
    assert len({p.space for p in captures}) == 3
    ex.close()


def test_outputs_stay_valid_while_other_graphs_of_the_group_replay(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    a = vmm_core.GraphExecutor(lambda x: x + 1, torch.zeros(8, 4), backend=host, allocator=alloc)
    b = vmm_core.GraphExecutor(lambda x: x * 3, torch.zeros(8, 4), backend=host, allocator=alloc)
    xa = torch.randn(5, 4)
    out_a = a(xa)
    for _ in range(3):
        b(torch.randn(7, 4))
    torch.testing.assert_close(out_a, xa + 1)
    again = a(torch.zeros(5, 4))  # the same executor running again overwrites it
    torch.testing.assert_close(out_a, again)
    a.close(), b.close()
    alloc.close()


def test_multiple_inputs_and_outputs(host):
    def fn(x, y):
        return x + y, (x * y).sum(-1, keepdim=True)

    ex = vmm_core.GraphExecutor(fn, (torch.zeros(8, 3), torch.zeros(8, 3)), backend=host)
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    s, p = ex(x, y)
    torch.testing.assert_close(s, x + y)
    torch.testing.assert_close(p, (x * y).sum(-1, keepdim=True))


class LazyWorkspace:
    """Like cuBLAS: on first use per stream, a workspace from whatever pool is active."""

    def __init__(self):
        self.workspaces = {}

    def __call__(self, x):
        stream = current_stream()
        if stream not in self.workspaces:
            target = routing.current_target(0)
            self.workspaces[stream] = target.allocate(1 << 20) if target is not None else -1
        return x * 2


def test_escape_guard_catches_a_workspace_created_during_capture(host):
    ex = vmm_core.GraphExecutor(LazyWorkspace(), torch.zeros(8, 4), backend=host, warmup=False)
    with pytest.raises(CaptureEscapeError) as err:
        ex(torch.randn(3, 4))
    msg = str(err.value)
    assert "1.00 MiB" in msg and "warm" in msg and "capture space 4" in msg
    with pytest.raises(CaptureError, match="unusable"):
        ex(torch.randn(3, 4))


def test_an_escape_poisons_every_executor_of_the_group(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    a = vmm_core.GraphExecutor(LazyWorkspace(), torch.zeros(8, 4), backend=host,
                               allocator=alloc, warmup=False)
    b = vmm_core.GraphExecutor(lambda x: x + 1, torch.zeros(8, 4), backend=host,
                               allocator=alloc)
    with pytest.raises(CaptureEscapeError):
        a(torch.randn(3, 4))
    # b's graphs would put their intermediates on the pages a's escaped block lives on
    with pytest.raises(CaptureError, match="unusable"):
        b(torch.randn(3, 4))
    alloc.close()


def test_a_dropped_executor_gives_its_memory_back(host):
    import gc

    from vmm_core.memory import reaper, tagged

    ex = vmm_core.GraphExecutor(lambda x: x * 2, torch.zeros(8, 4), backend=host,
                                tag="dropped-executor")
    ex(torch.randn(3, 4))
    alloc = ex.allocator
    alloc.extend_mapping(1 << 20)  # something to give back
    del ex
    gc.collect()
    assert reaper.drain()
    assert alloc.closed and alloc.physical_bytes == 0
    assert "dropped-executor" not in tagged.tags()


def test_warmup_keeps_the_workspace_out_of_the_pool(host):
    fn = LazyWorkspace()
    ex = vmm_core.GraphExecutor(fn, torch.zeros(8, 4), backend=host)
    x = torch.randn(3, 4)
    torch.testing.assert_close(ex(x), x * 2)
    # created during the warm-up on the capture stream, outside every pool
    assert set(fn.workspaces.values()) == {-1}


def test_bad_inputs_are_explained(host):
    ex = vmm_core.GraphExecutor(lambda x: x, torch.zeros(8, 4), backend=host)
    with pytest.raises(ValueError, match="larger max_inputs"):
        ex(torch.zeros(9, 4))
    with pytest.raises(ValueError, match=r"takes \[batch, 4\] torch.float32"):
        ex(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="float32"):
        ex(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="expected 1 input"):
        ex(torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="reuse must be one of"):
        vmm_core.GraphExecutor(lambda x: x, torch.zeros(8, 4), reuse="magic", backend=host)
    for mode, pool in (("shared", "SharedTorchPool"), ("private", "PrivateTorchPool")):
        with pytest.raises(ValueError, match=rf"GraphExecutor\(reuse='{mode}'\).*pass "
                                             rf"pool=vmm_bench\.torch_pools\.{pool}"):
            vmm_core.GraphExecutor(lambda x: x, torch.zeros(8, 4), reuse=mode, backend=host)
    with pytest.raises(ValueError, match="buckets must lie"):
        vmm_core.GraphExecutor(lambda x: x, torch.zeros(8, 4), buckets=[4, 16], backend=host)
    with pytest.raises(ValueError, match="share dim 0"):
        vmm_core.GraphExecutor(lambda x, y: x, (torch.zeros(8, 4), torch.zeros(6, 4)),
                               backend=host)
    bad = vmm_core.GraphExecutor(lambda x: x.sum(), torch.zeros(8, 4), backend=host)
    with pytest.raises(CaptureError, match="batch dimension first"):
        bad(torch.zeros(2, 4))


def test_two_threads_never_replay_one_group_concurrently(host):
    inside = []
    overlaps = []

    def fn(x):
        if inside:
            overlaps.append(1)
        inside.append(1)
        time.sleep(0.002)
        inside.pop()
        return x + 1

    alloc = vmm_core.SharedVMMAllocator(host)
    a = vmm_core.GraphExecutor(fn, torch.zeros(8, 2), backend=host, allocator=alloc)
    b = vmm_core.GraphExecutor(fn, torch.zeros(8, 2), backend=host, allocator=alloc)
    errors = []

    def worker(ex):
        try:
            for n in (1, 2, 5, 8, 3):
                x = torch.randn(n, 2)
                out = ex(x).clone()
                if not torch.allclose(out, x + 1):
                    errors.append(n)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(ex,)) for ex in (a, b, a, b)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not overlaps and not errors


def test_backend_without_graph_pools_falls_back_to_shared(no_pools_backend):
    with pytest.warns(vmm_core.VMMFallbackWarning, match="shared pool"):
        ex = vmm_core.GraphExecutor(lambda x: x * 5, torch.zeros(4, 2),
                                    backend=no_pools_backend)
    assert ex.reuse == "shared"
    assert "framework has no MemPool" in ex.stats()["fallback"]
    x = torch.randn(3, 2)
    torch.testing.assert_close(ex(x), x * 5)


def test_an_executor_over_a_given_pool_shares_it_and_leaves_it_open(host):
    """pool=: the executor's buckets are keys of the engine's own GraphPool, which the
    engine keeps using (and closes) after the executor is gone."""
    pool = vmm_core.GraphPool(backend=host, tag="given-pool")
    w = torch.randn(8, 8, dtype=torch.float64)
    ex = vmm_core.GraphExecutor(lambda x: centered(x, w), torch.zeros(16, 8, dtype=torch.float64),
                                buckets=[4, 16], pool=pool)
    assert ex.pool is pool and ex.allocator is pool.allocator and ex.tag == "given-pool"
    for n in (3, 16, 4):
        x = torch.randn(n, 8, dtype=torch.float64)
        torch.testing.assert_close(ex(x), centered(x, w))
    assert set(pool.keys) == {4, 16}
    ex.close()
    with pytest.raises(CaptureError, match="closed"):
        ex(torch.randn(2, 8, dtype=torch.float64))
    with pool.space("engine's own key"):  # the pool is still the engine's
        pool.keep(routing.current_target(0).allocate(4096))
    pool.close()


def test_a_given_pool_brings_what_the_pool_arguments_would_make(host):
    pool = vmm_core.GraphPool(backend=host)
    for clash in ({"tag": "other"}, {"backend": host}, {"reads": ()},
                  {"executables": False}, {"allocator": pool.allocator}):
        name = next(iter(clash))
        with pytest.raises(ValueError, match=rf"the pool brings its own {name}; drop {name}="):
            vmm_core.GraphExecutor(lambda x: x, torch.zeros(4, 2), pool=pool, **clash)

    class HalfAPool:
        backend, device, ops = pool.backend, 0, pool.ops

        def space(self, key):
            return pool.space(key)

    with pytest.raises(TypeError, match=r"CapturePool.*HalfAPool lacks reuse, allocator, "
                                        r"fallback_reason, serialized, warmup, new_graph, "
                                        r"replaying, compact, stats, check_can_close, close"):
        vmm_core.GraphExecutor(lambda x: x, torch.zeros(4, 2), pool=HalfAPool())
    pool.close()
