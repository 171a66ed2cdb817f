"""The benchmark's plain torch pools (its baselines), on the host backend.

They hand the capture call the framework's own pools, and GraphExecutor runs over them
through ``pool=`` exactly as over a GraphPool; the decode benchmark's strategies are the
benchmark's list, not the library's.
"""

from __future__ import annotations

import gc

import pytest
import torch

import vmm_core
from vmm_bench import cli as bench_cli
from vmm_bench.spec import DEFAULT_MODES
from vmm_bench.torch_pools import (
    BASELINES,
    MODES,
    PrivateTorchPool,
    SharedTorchPool,
    make_pool,
)
from vmm_core.errors import CaptureError
from vmm_core.memory import reaper, routing, tagged


def test_the_shared_pool_hands_one_framework_handle_to_every_key(host):
    pool = SharedTorchPool(backend=host)
    with pool.space(1) as h1, pool.space(2) as h2:
        framework = routing.current_target(0)
    assert h1 is h2 is not None  # one graph_pool_handle(), as vLLM and SGLang pass it
    assert framework is None  # nothing routed to vmm_core memory
    assert pool.keys == [1, 2] and pool.allocator is None
    pool.close()


def test_the_private_pool_hands_none_so_each_graph_gets_its_own(host):
    pool = PrivateTorchPool(backend=host)
    with pool.space(1) as handle:
        assert routing.current_target(0) is None
    assert handle is None and pool.stats()["physical_bytes"] is None
    pool.close()


@pytest.mark.parametrize("mode", sorted(BASELINES))
def test_an_executor_over_a_baseline_matches_eager_and_reports_like_a_graph_pool(host, mode):
    # pools an earlier test dropped are given back by the collector and the teardown
    # thread, whenever they run: settled first, so the tag read below is this test's
    gc.collect()
    assert reaper.drain(30)
    assert "graph" not in tagged.tags(), "an earlier test's pool is still open"
    w = torch.randn(8, 8, dtype=torch.float64)
    pool = BASELINES[mode](backend=host)
    ex = vmm_core.GraphExecutor(lambda x: torch.tanh(x @ w),
                                torch.zeros(16, 8, dtype=torch.float64), pool=pool)
    for n in (16, 3, 1, 9):
        x = torch.randn(n, 8, dtype=torch.float64)
        torch.testing.assert_close(ex(x), torch.tanh(x @ w))
    stats = ex.stats()
    graph_pool = vmm_core.GraphPool(backend=host, tag="columns")
    # the benchmark's rows read the same columns whichever pool a strategy uses
    assert set(pool.stats()) == set(graph_pool.stats())
    graph_pool.close()
    assert stats["reuse"] == mode and stats["captured_buckets"] == [1, 4, 16]
    assert stats["physical_bytes"] is None and stats["executables"] is None
    assert "graph" not in tagged.tags()  # nothing of vmm_core memory was made
    ex.close()
    with pool.space("after the executor"):  # a given pool stays open
        pass
    pool.close()
    pool.close()  # idempotent


def test_a_baseline_pool_refuses_what_it_cannot_do(host):
    pool = SharedTorchPool(backend=host)
    with pytest.raises(CaptureError, match="no graph was captured in the space of 7"):
        pool.before_replay(7)
    with pytest.raises(CaptureError, match="no space of this pool is open"):
        pool.keep(torch.zeros(2))
    with pool.space(1):
        pool.keep(torch.zeros(2))  # nothing aliases a torch pool's blocks: accepted
        with pytest.raises(CaptureError, match="inside the capture space of 1"):
            pool.close()
    pool.close()
    with pytest.raises(CaptureError, match="was closed"):
        with pool.space(1):
            pass
    with pytest.raises(ValueError, match="leaves every executable to the framework"):
        PrivateTorchPool(backend=host, executables=4)
    with pytest.raises(ValueError, match="no vmm_core allocator to share"):
        make_pool("shared", backend=host, allocator=object())


def test_make_pool_gives_a_graph_pool_for_vmm_and_a_torch_pool_for_a_baseline(host):
    pool = make_pool("vmm", backend=host, reads=(), tag="made")
    assert isinstance(pool, vmm_core.GraphPool) and pool.reads == frozenset()
    other = make_pool("vmm", backend=host, allocator=pool.allocator, tag="made")
    assert other.allocator is pool.allocator
    assert isinstance(make_pool("private", backend=host, reads=()), PrivateTorchPool)
    other.close(), pool.close()


def test_the_decode_strategies_are_the_benchmark_s_own_list():
    assert MODES == DEFAULT_MODES == ("private", "shared", "vmm")
    assert set(MODES) == set(BASELINES) | {"vmm"}
    assert not hasattr(bench_cli, "REUSE_MODES")  # --modes reads the benchmark's list
