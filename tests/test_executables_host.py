"""Graph executables owned by a GraphPool, run for real on the host backend.

The host's emulated executables follow the driver's rules where the policy can tell
(``vmm_backends.host.graph_ops.HostExecutables``): an executable runs the graph it was made
from or last updated to, a destroyed one cannot be launched, an update to another topology
is refused, and their bytes come from an emulated device that does not show them free
after a destroy.  Every replay here is compared with eager on fresh random inputs.
"""

from __future__ import annotations

import gc
import logging
import warnings

import pytest
import torch

import vmm_core
from vmm_backends.host import graph_ops as host_graph_ops
from vmm_core import ExecutablePolicy
from vmm_core.errors import CaptureError, VMMFallbackWarning
from vmm_core.memory import reaper

pytestmark = pytest.mark.usefixtures("clean_tags")

HIDDEN = 8


def piece(inp, w):
    """One piece of a layer: every piece of every size and layer has this code (one
    topology), as the pieces of a piecewise capture do."""
    return lambda: torch.tanh(inp @ w)


class Model:
    """A stack of pieces captured per size into one GraphPool, and its eager twin."""

    def __init__(self, pool, sizes=(1, 2, 4, 8), layers=3, seed=0, make=piece):
        gen = torch.Generator().manual_seed(seed)
        self.pool, self.sizes = pool, list(sizes)
        self.weights = [torch.randn(HIDDEN, HIDDEN, generator=gen) / 3 for _ in range(layers)]
        self.static = {s: torch.zeros(s, HIDDEN) for s in sizes}
        self.graphs: dict = {}
        self.outputs: dict = {}
        for size in sizes:
            with pool.space(size):
                h, graphs = self.static[size], []
                for w in self.weights:
                    g = pool.new_graph()
                    h = pool.capture(g, make(h, w))
                    graphs.append(g)
            self.graphs[size], self.outputs[size] = graphs, h

    def eager(self, x):
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x

    def step(self, size, check=True):
        """Replay every piece of ``size`` on a fresh input; compare with eager."""
        x = torch.randn(size, HIDDEN)
        with self.pool.replaying(size):  # outputs are valid until another replay
            self.static[size].copy_(x)
            for g in self.graphs[size]:
                g.replay()
            if check:
                torch.testing.assert_close(self.outputs[size], self.eager(x))


def _pool(host, executables=None, **kw):
    return vmm_core.GraphPool(backend=host, reads=(), executables=executables, **kw)


def _execs(pool) -> dict:
    return pool.stats()["executables"]


@pytest.fixture
def live_counter(monkeypatch):
    """The most executables alive at once on the emulated device, counted at every
    instantiation (the budget must hold then, not only between replays)."""
    device = host_graph_ops.emulated_device(0)
    base = device.live
    seen = {"max": 0}
    real = host_graph_ops.HostExecutables.instantiate

    def counting(self, graph):
        handle = real(self, graph)
        seen["max"] = max(seen["max"], device.live - base)
        return handle

    monkeypatch.setattr(host_graph_ops.HostExecutables, "instantiate", counting)
    return seen


# ------------------------------------------------------------------ ownership and budget
def test_by_default_the_pool_owns_every_executable_and_replays_match_eager(host):
    pool = _pool(host)
    model = Model(pool)
    assert type(model.graphs[1][0]).__name__ == "KeptHostGraph"
    for size in [8, 1, 4, 2, 8, 1]:
        model.step(size)
    s = _execs(pool)
    assert s["policy"] == {"max_count": None, "max_bytes": None, "share": "off",
                           "ahead": False, "random_numbers": "operators",
                           "eager_wake": False}
    assert s["graphs"] == 12 and s["resident"] == 12 and s["instantiations"] == 12
    # made at the end of each capture, as the framework makes its own: no replay misses
    assert s["misses"] == 0 and s["hits"] == 18 and s["evictions"] == 0
    pool.close()


@pytest.mark.parametrize("share", ["off", "when_full"])
def test_a_count_budget_is_never_exceeded_and_results_stay_exact(host, live_counter, share):
    pool = _pool(host, ExecutablePolicy(max_count=4, share=share, ahead=False))
    model = Model(pool, sizes=(1, 2, 3, 5, 8), layers=3)
    order = [8, 1, 8, 3, 2, 5, 5, 1, 8, 2, 3, 3, 1]
    for size in order:
        model.step(size)
    s = _execs(pool)
    assert live_counter["max"] <= 4 and s["peak_resident"] == 4 and s["resident"] <= 4
    assert s["misses"] > s["hits"]  # the trace does not fit: the budget had work to do
    if share == "off":
        assert s["updates"] == 0 and s["evictions"] == s["instantiations"] - s["resident"]
    else:  # a miss with the budget full takes an executable of its topology instead
        assert s["updates"] > 0 and s["instantiations"] == 4
    pool.close()


def test_a_budget_holds_in_pools_without_spaces_of_their_own(no_pools_backend, live_counter):
    """A backend whose framework cannot capture into a custom-allocator pool gets one
    shared framework pool and no allocator: the executables are the pool's all the same."""
    with pytest.warns(VMMFallbackWarning, match="one shared pool"):
        pool = _pool(no_pools_backend, ExecutablePolicy(max_count=2, share="when_full"))
    assert pool.allocator is None and pool.reuse == "shared"
    model = Model(pool, sizes=(1, 2, 4), layers=2)
    for size in (4, 1, 2, 4, 2):
        model.step(size)
    assert live_counter["max"] <= 2 and _execs(pool)["updates"] > 0
    pool.close()
    assert _execs(pool)["resident"] == 0


def test_the_least_recently_replayed_executable_goes_first(host):
    pool = _pool(host, ExecutablePolicy(max_count=2, share="off", ahead=False))
    model = Model(pool, sizes=(1, 2, 4), layers=1)
    a, b, c = (model.graphs[s][0] for s in (1, 2, 4))
    cache = pool._executables
    for size in (1, 2, 1, 4):  # b is the least recently replayed when c needs room
        model.step(size)
    assert [cache.is_resident(g) for g in (a, b, c)] == [True, False, True]
    model.step(2)  # b made again; now a is the least recent
    assert [cache.is_resident(g) for g in (a, b, c)] == [False, True, True]
    s = _execs(pool)
    assert (s["instantiations"], s["evictions"], s["hits"]) == (4, 2, 1)
    pool.close()


def test_a_byte_budget_counts_the_backends_estimate(host, live_counter):
    per = (100 << 10) + 2 * 2560  # the H100 fit: 100 KiB + 2.5 KiB per operator (mm, tanh)
    pool = _pool(host, ExecutablePolicy(max_bytes=3 * per + per // 2, share="off",
                                        ahead=False))
    model = Model(pool, sizes=(1, 2, 4), layers=2)
    assert host_graph_ops.HostExecutables().nbytes(model.graphs[1][0]) == per
    for size in (4, 1, 2, 4, 1):
        model.step(size)
        assert pool.stats()["executables"]["resident_bytes"] <= 3 * per + per // 2
    assert live_counter["max"] == 3
    pool.close()


def test_a_byte_budget_below_one_executable_is_refused_naming_it(host):
    pool = _pool(host, ExecutablePolicy(max_bytes=1000))
    with pytest.warns(VMMFallbackWarning, match="do not fit the budget"):
        model = Model(pool, sizes=(2,), layers=1)
    with pytest.raises(CaptureError, match=r"more than the whole budget "
                                           r"ExecutablePolicy\(max_bytes=1000\); raise"):
        model.step(2)
    pool.close()


def test_a_key_whose_graphs_exceed_the_budget_warns_once_and_stats_say_so(host):
    with pytest.warns(VMMFallbackWarning, match=r"the 3 graphs of key 4 .* do not fit the "
                                                r"budget") as caught:
        pool = _pool(host, ExecutablePolicy(max_count=2))
        model = Model(pool, sizes=(4, 8), layers=3)
    assert sum("do not fit" in str(w.message) for w in caught) == 1  # once per pool
    assert _execs(pool)["keys_over_budget"] == [4, 8]
    for size in (4, 8, 4):
        model.step(size)  # still exact, only slower
    pool.close()


# ------------------------------------------------------------------ sharing by update
def test_sharing_updates_an_executable_of_the_same_topology_when_the_budget_is_full(host):
    pool = _pool(host, ExecutablePolicy(max_count=3, share="when_full", ahead=False))
    model = Model(pool, sizes=(1, 2, 4, 8), layers=3)
    device = host_graph_ops.emulated_device(0)
    model.step(8)
    reserved = device.reserved
    for size in (1, 2, 4, 8, 2):
        model.step(size)
    s = _execs(pool)
    assert s["instantiations"] == 3 and s["updates"] == 15 and s["evictions"] == 0
    assert s["update_refused"] == {} and device.reserved == reserved
    pool.close()


def test_share_always_keeps_one_executable_per_topology(host):
    pool = _pool(host, ExecutablePolicy(share="always"))
    model = Model(pool, sizes=(1, 2, 4), layers=3)
    for size in (1, 2, 4, 1):
        model.step(size)
    s = _execs(pool)
    assert s["resident"] == 1 and s["instantiations"] == 1 and s["updates"] == 11
    pool.close()


def test_a_refused_update_falls_back_to_instantiate_and_counts_the_reason(host):
    def branchy(inp, w):  # one function (one topology key) whose operators depend on size
        def fn():
            y = inp @ w
            if inp.shape[0] > 2:
                y = y * 1.0
            return torch.tanh(y)
        return fn

    pool = _pool(host, ExecutablePolicy(max_count=1, share="when_full", ahead=False))
    model = Model(pool, sizes=(1, 2, 4, 8), layers=1, make=branchy)
    for size in (1, 4, 2, 8, 1, 4):
        model.step(size)
    s = _execs(pool)
    # 1 -> 4 refused, 4 -> 2 refused, 2 -> 8 refused: three in a row, then not tried
    assert s["update_refused"] == {"topology changed": 3}
    assert s["unshareable_topologies"] == 1 and s["updates"] == 0
    assert s["instantiations"] == 6 and s["resident"] == 1 and s["evictions"] == 2
    pool.close()


def test_graphs_of_another_function_are_never_updated_into_each_other(host):
    def other(inp, w):
        return lambda: torch.sigmoid(inp @ w)

    pool = _pool(host, ExecutablePolicy(max_count=1, share="when_full", ahead=False))
    a = Model(pool, sizes=(1,), layers=1)
    b = Model(pool, sizes=(2,), layers=1, make=other)
    b.eager = lambda x: torch.sigmoid(x @ b.weights[0])
    for model, size in ((a, 1), (b, 2), (a, 1)):
        model.step(size)
    s = _execs(pool)
    assert s["updates"] == 0 and s["update_refused"] == {} and s["evictions"] == 2
    pool.close()


def test_the_emulation_refuses_what_the_driver_refuses(host):
    ex = host_graph_ops.HostExecutables()
    pool = _pool(host)
    model = Model(pool, sizes=(1, 2), layers=1)
    g1, g2 = model.graphs[1][0], model.graphs[2][0]
    h = ex.instantiate(g1)
    assert ex.update(h, g2) is None
    ex.destroy(h)
    for call in (lambda: ex.launch(h, None), lambda: ex.destroy(h),
                 lambda: ex.update(h, g1)):
        with pytest.raises(CaptureError, match="of a destroyed executable"):
            call()
    pool.close()


# ------------------------------------------------------------------ sleep and wake
def test_sleep_destroys_the_executables_and_the_next_replay_makes_them_again(host):
    pool = _pool(host)
    model = Model(pool)
    for size in model.sizes:
        model.step(size)
    device = host_graph_ops.emulated_device(0)
    free_awake = device.free_bytes()
    held = _execs(pool)["resident_bytes"]
    vmm_core.sleep("graph")
    s = _execs(pool)
    assert s["resident"] == 0 and s["released_on_sleep"] == 12
    # the driver does not show destroyed executables' memory as free: neither does this
    assert s["last_sleep"] == {"executables": 12, "bytes": held, "driver_free_change": 0}
    summary = vmm_core.memory_summary()["graph"]
    assert summary["executables"] == 0 and summary["executable_bytes_released"] == held
    vmm_core.wake_up("graph")
    assert _execs(pool)["resident"] == 0  # lazily: made by each graph's first replay
    for size in model.sizes:
        model.step(size)
    s = _execs(pool)
    assert s["resident"] == 12 and s["instantiations"] == 24 and s["eager_instantiations"] == 0
    assert device.free_bytes() == free_awake  # the destroyed executables' memory reused
    assert vmm_core.memory_summary()["graph"]["executables"] == 12
    pool.close()


def test_eager_wake_makes_again_what_was_resident(host):
    pool = _pool(host, ExecutablePolicy(max_count=6, share="off", ahead=False))
    model = Model(pool)
    for size in (1, 2, 8):  # 8 and 2 resident, 1 evicted
        model.step(size)
    resident = {id(g) for s in model.sizes for g in model.graphs[s]
                if pool._executables.is_resident(g)}
    vmm_core.sleep("graph")
    vmm_core.wake_up("graph", eager=True)
    s = _execs(pool)
    assert s["eager_instantiations"] == 6 and s["resident"] == 6
    assert resident == {id(g) for s in model.sizes for g in model.graphs[s]
                        if pool._executables.is_resident(g)}
    hits = s["hits"]
    model.step(8)
    model.step(2)
    assert _execs(pool)["hits"] == hits + 6  # no miss after an eager wake
    pool.close()


@pytest.mark.parametrize("ahead", [False, True])
def test_a_pool_of_eager_wake_makes_its_executables_at_every_wake(host, ahead):
    """A wake whose caller does not ask for it (vmm_core.wake_up without eager, as
    torch_memory_saver's resume() calls it) still makes what was resident at the sleep
    before it returns, at every wake, and the steps after it miss nothing."""
    pool = _pool(host, ExecutablePolicy(max_count=6, ahead=ahead, eager_wake=True))
    model = Model(pool)
    for size in (1, 2, 8):  # 8 and 2 resident, 1 evicted
        model.step(size)
    pool.settle(10)
    resident = {id(g) for s in model.sizes for g in model.graphs[s]
                if pool._executables.is_resident(g)}
    assert len(resident) == 6
    for _ in range(2):
        vmm_core.sleep("graph")
        assert _execs(pool)["resident"] == 0
        vmm_core.wake_up("graph")
        s = _execs(pool)
        assert s["resident"] == 6 and resident == {
            id(g) for s in model.sizes for g in model.graphs[s]
            if pool._executables.is_resident(g)}
    assert s["eager_instantiations"] == 12
    misses = s["misses"]
    model.step(8)
    model.step(2)
    assert _execs(pool)["misses"] == misses  # nothing made inline after the wake
    pool.close()


def test_an_eager_wake_of_an_awake_tag_changes_nothing(host):
    pool = _pool(host)
    model = Model(pool, sizes=(2,))
    model.step(2)
    vmm_core.wake_up("graph", eager=True)
    assert _execs(pool)["instantiations"] == 3
    with pytest.raises(ValueError, match="eager must be True or False"):
        vmm_core.wake_up("graph", eager="yes")
    pool.close()


# ------------------------------------------------------------------ random numbers
def test_graphs_drawing_random_numbers_replay_through_the_framework(host):
    def noisy(inp, w):
        return lambda: torch.rand_like(inp) + inp

    with pytest.warns(VMMFallbackWarning, match=r"draws random numbers \(aten.rand_like"):
        pool = _pool(host, ExecutablePolicy(max_count=1))
        model = Model(pool, sizes=(4,), layers=1, make=noisy)
        plain = Model(pool, sizes=(2,), layers=1)
    g, out = model.graphs[4][0], model.outputs[4]
    draws = []
    for _ in range(3):
        with pool.replaying(4):
            model.static[4].fill_(1.0)
            g.replay()
        draws.append(out.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert ((draws[0] >= 1) & (draws[0] < 2)).all()
    s = _execs(pool)
    assert s["framework_replayed"] == 1 and s["framework_replays"] == 3
    assert s["graphs"] == 1 and not pool._executables.is_resident(g)
    plain.step(2)
    # why: our own executable of it repeats its numbers (the generator is not advanced)
    ex = host_graph_ops.HostExecutables()
    h = ex.instantiate(g)
    ours = []
    for _ in range(2):
        ex.launch(h, None)
        ours.append(out.clone())
    ex.destroy(h)
    assert torch.equal(ours[0], ours[1])
    pool.close()


def test_attention_without_dropout_draws_no_random_numbers_and_keeps_its_executable(host):
    """Attention operators carry the seeded tag for their dropout; at dropout_p=0 (every
    inference engine) their graphs must stay ours, at dropout_p>0 they must not."""
    def attention(p):
        def make(inp, w):
            q = inp.view(1, 1, inp.shape[0], inp.shape[1])
            return lambda: torch.nn.functional.scaled_dot_product_attention(
                q, q, q, dropout_p=p).view_as(inp) + inp
        return make

    pool = _pool(host, ExecutablePolicy(max_count=2))
    model = Model(pool, sizes=(4,), layers=1, make=attention(0.0))
    for _ in range(2):
        x = torch.randn(4, HIDDEN)
        model.step(4, check=False)
        with pool.replaying(4):
            model.static[4].copy_(x)
            model.graphs[4][0].replay()
            q = x.view(1, 1, 4, HIDDEN)
            want = torch.nn.functional.scaled_dot_product_attention(q, q, q).view_as(x) + x
            torch.testing.assert_close(model.outputs[4], want)
    s = _execs(pool)
    assert s["framework_replayed"] == 0 and s["hits"] >= 1
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        noisy = Model(pool, sizes=(2,), layers=1, make=attention(0.5))
    assert _execs(pool)["framework_replayed"] == 1 and noisy.graphs[2]
    pool.close()


# ------------------------------------------------------------------ graphs' lifecycle
def test_reset_destroys_a_resident_executable_and_replay_then_refuses(host):
    pool = _pool(host)
    model = Model(pool, sizes=(2,), layers=2)
    model.step(2)
    device = host_graph_ops.emulated_device(0)
    live = device.live
    g = model.graphs[2][0]
    g.reset()
    assert device.live == live - 1 and _execs(pool)["resident"] == 1
    with pytest.raises(CaptureError, match="never captured or was reset"):
        g.replay()
    with pool.space(2):  # captured again: replays under its key as before
        out = pool.capture(g, piece(model.static[2], model.weights[0]))
    x = torch.randn(2, HIDDEN)
    model.static[2].copy_(x)
    g.replay()
    torch.testing.assert_close(out, torch.tanh(x @ model.weights[0]))
    assert _execs(pool)["graphs"] == 2 and _execs(pool)["resident"] == 2
    pool.close()


def test_a_dropped_graph_gives_its_executable_back(host):
    pool = _pool(host)
    model = Model(pool, sizes=(2,), layers=2)
    model.step(2)
    device = host_graph_ops.emulated_device(0)
    gc.collect()  # pools earlier tests dropped give their executables back first
    reaper.drain()
    live = device.live
    del model.graphs[2][0]
    gc.collect()
    with pool.replaying(2):
        model.graphs[2][0].replay()  # the other piece; any launch reaps the dropped one
    assert device.live == live - 1 and _execs(pool)["graphs"] == 1
    pool.close()


def test_a_closed_pool_destroys_its_executables_and_refuses_replays(host):
    pool = _pool(host)
    model = Model(pool, sizes=(2,), layers=2)
    model.step(2)
    device = host_graph_ops.emulated_device(0)
    live = device.live
    pool.close()
    assert device.live == live - 2
    with pytest.raises(CaptureError, match="closed"):
        model.graphs[2][0].replay()


def test_replay_outside_a_replay_block_holds_one_and_inside_only_launches(host):
    pool = _pool(host)
    model = Model(pool, sizes=(1, 2), layers=1)
    g1, g2 = model.graphs[1][0], model.graphs[2][0]
    calls = []
    real = pool._replay_block

    def counting(key, step):
        calls.append((key, step))
        return real(key, step)

    pool._replay_block = counting
    g1.replay()  # outside: one block of its key, not a step
    with pool.replaying(1):
        g1.replay()  # inside its key's block: no other block
        g2.replay()  # another key's graph: a block of its own key
    assert calls == [(1, False), (1, True), (2, False)]
    pool.close()


def test_graphs_of_an_engine_that_are_not_the_pools_keep_working(host):
    pool = _pool(host, ExecutablePolicy(max_count=1))
    plain = pool.ops.new_graph()
    with pool.space(3):
        out = pool.capture(plain, lambda: torch.ones(2) * 3)
    plain.replay()
    assert torch.equal(out, torch.full((2,), 3.0)) and _execs(pool)["graphs"] == 0
    pool.close()


def test_the_framework_keeps_executables_with_executables_false(host):
    pool = _pool(host, False)
    assert type(pool.new_graph()).__name__ == "HostGraph"
    assert pool.stats()["executables"] is None
    pool.close()


# ------------------------------------------------------------------ the executor
def test_graph_executor_under_a_budget_of_one_matches_eager(host, live_counter):
    before = host_graph_ops.emulated_device(0).live
    w = torch.randn(8, 8)
    ex = vmm_core.GraphExecutor(lambda x: torch.tanh(x @ w), torch.zeros(32, 8),
                                backend=host,
                                executables=ExecutablePolicy(max_count=1, share="when_full",
                                                             ahead=False))
    for n in (32, 3, 17, 1, 9, 3, 32):
        x = torch.randn(n, 8)
        torch.testing.assert_close(ex(x), torch.tanh(x @ w))
    s = ex.stats()["executables"]
    assert live_counter["max"] == 1 and s["resident"] == 1
    assert s["instantiations"] == 1 and s["updates"] == 6  # one executable for all buckets
    ex.close()
    assert host_graph_ops.emulated_device(0).live == before


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kw, message", [
    ({"max_count": 0}, r"max_count=...\) must be None \(no limit\) or an int >= 1, got 0"),
    ({"max_count": 1.5}, r"max_count=...\) must be None .* got 1.5"),
    ({"max_count": True}, r"max_count=...\) must be None .* got True"),
    ({"max_bytes": -1}, r"max_bytes=...\) must be None .* got -1"),
    ({"share": "sometimes"}, r"share=...\) must be one of \('off', 'when_full', 'always'\), "
                             r"got 'sometimes'"),
    ({"share": True}, r"share=...\) must be one of"),
    ({"random_numbers": "names"}, r"random_numbers=...\) must be one of \('auto', 'operators', "
                                  r"'kernels'\), got 'names'"),
    ({"eager_wake": 1}, r"eager_wake=...\) must be True or False, got 1"),
])
def test_a_bad_policy_is_refused_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        ExecutablePolicy(**kw)


def test_reading_random_kernels_is_refused_where_the_backend_cannot(host, monkeypatch):
    """A backend whose executables cannot read kernels (the host's, with the capability
    taken away): asking for it fails when the pool is made, naming the default that
    works."""
    monkeypatch.setattr(host_graph_ops.HostExecutables, "reads_random_kernels", False)
    with pytest.raises(CaptureError, match=r"cannot read which kernels .* "
                                           r"random_numbers='operators' or 'auto' \(the "
                                           r"default, which watches operators here\)"):
        vmm_core.GraphPool(backend=host,
                           executables=ExecutablePolicy(random_numbers="kernels"))
    assert vmm_core.memory_summary() == {}


def test_the_default_reading_watches_operators_where_kernels_show_no_generator_state(host):
    """``random_numbers="auto"`` (the default) resolves when the pool is made: the host's
    reading does not see the generator's state in any parameter, so the pool watches
    operators, and its stats say so."""
    pool = vmm_core.GraphPool(backend=host, executables=ExecutablePolicy())
    try:
        assert ExecutablePolicy().random_numbers == "auto"
        assert pool.stats()["executables"]["policy"]["random_numbers"] == "operators"
    finally:
        pool.close()


@pytest.mark.parametrize("value", ["3", 2.0, True, object()])
def test_graph_pool_refuses_executables_of_another_type_and_leaves_nothing(host, value):
    with pytest.raises(TypeError, match=r"takes None .* False .* an int .* "
                                        r"vmm_core.ExecutablePolicy"):
        _pool(host, value)
    assert vmm_core.memory_summary() == {}


def test_a_budget_of_no_executable_is_refused_before_anything_is_made(host):
    with pytest.raises(ValueError, match=r"max_count=...\) must be None \(no limit\) or an "
                                         r"int >= 1, got 0"):
        _pool(host, 0)
    assert vmm_core.memory_summary() == {}


def test_capturing_a_pools_graph_outside_its_spaces_is_refused(host):
    pool = _pool(host)
    g = pool.new_graph()
    with pytest.raises(CaptureError, match=r"GraphPool.capture\(\): no space of this pool"):
        pool.capture(g, lambda: torch.ones(1))
    with pytest.raises(CaptureError, match="captured outside every space of its pool"):
        pool.ops.capture(g, lambda: torch.ones(1), None)
    with pytest.raises(CaptureError, match="never captured"):
        g.replay()
    pool.close()


# ------------------------------------------------------------------ the allocator's listeners
def test_sleep_listeners_are_held_weakly_told_after_the_change_and_may_fail(host, caplog):
    alloc = vmm_core.SharedVMMAllocator(host, tag="listened")
    seen = []

    class Listener:
        def __call__(self, event, **kw):
            seen.append((event, kw, alloc.asleep))

        def on(self, event, **kw):
            seen.append(("method", event))

        def boom(self, event, **kw):
            raise RuntimeError("listener failed")

    keep = Listener()
    alloc.add_sleep_listener(keep)
    alloc.add_sleep_listener(keep.boom)
    dropped = Listener()
    alloc.add_sleep_listener(dropped.on)
    del dropped
    gc.collect()
    alloc.extend_mapping(1 << 20)
    with caplog.at_level(logging.ERROR, logger="vmm_core"):
        alloc.sleep()
        alloc.sleep()  # a no-op tells nobody
        alloc.wake(eager=True)
        alloc.wake()
    assert seen == [("sleep", {"allocator": alloc}, True),
                    ("wake", {"eager": True, "allocator": alloc}, False)]
    failed = [r.getMessage() for r in caplog.records if r.exc_info]
    assert len(failed) == 2 and "failed (the sleep itself is done)" in failed[0]
    assert not alloc.asleep
    alloc.remove_sleep_listener(keep)
    alloc.sleep()
    assert len(seen) == 2
    alloc.close()


def test_memory_summary_adds_what_stats_providers_report(host):
    alloc = vmm_core.SharedVMMAllocator(host, tag="provided")
    from vmm_core.memory import tagged

    tagged.register("provided", alloc)

    class Provider:
        def numbers(self):
            return {"widgets": 3}

    p = Provider()
    alloc.add_stats_provider(p.numbers)
    assert vmm_core.memory_summary()["provided"]["widgets"] == 3
    del p
    gc.collect()
    assert "widgets" not in vmm_core.memory_summary()["provided"]
    alloc.close()


def test_no_warning_for_plain_pieces(host, warns_unrouted):
    """Pieces that draw no random numbers keep the pool's executables: nothing is said
    but the host's notice that framework tensors stay outside the pool's spaces."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = _pool(host)
        with warns_unrouted(host):
            Model(pool).step(4)
        pool.close()


def _group_sleep_then_eager_wake(rank, world):
    group = torch.distributed.group.WORLD
    pool = vmm_core.GraphPool(backend="host", reads=())
    model = Model(pool, sizes=(2, 4), layers=2, seed=rank)
    for size in model.sizes:
        model.step(size)
    vmm_core.sleep("graph", group=group)
    released = _execs(pool)["resident"]
    vmm_core.wake_up("graph", group=group, eager=True)
    s = _execs(pool)
    model.step(4)
    return released, s["eager_instantiations"], s["resident"]


def test_a_group_wake_passes_eager_to_every_rank():
    from vmm_core.testing.ranks import check_ranks, run_ranks

    for value in check_ranks(run_ranks(_group_sleep_then_eager_wake, 2, timeout=120)):
        assert tuple(value) == (0, 4, 4)


def test_sharing_when_full_never_takes_an_executable_of_the_keys_own_step(host):
    def small(inp, w):  # sizes up to 2 are captured from another function: two topologies
        return lambda: torch.tanh(inp @ w)

    def large(inp, w):
        return lambda: torch.tanh(torch.matmul(inp, w))

    def make(inp, w):
        return (small if inp.shape[0] <= 2 else large)(inp, w)

    pool = _pool(host, ExecutablePolicy(max_count=2, ahead=False))
    model = Model(pool, sizes=(1, 4), layers=2, make=make)
    model.step(4)
    model.step(1)  # its second piece must not take the executable its first piece just made
    hits = _execs(pool)["hits"]
    model.step(1)
    s = _execs(pool)
    assert s["hits"] == hits + 2 and s["updates"] == 0 and s["evictions"] == 2
    pool.close()


@pytest.mark.parametrize("executables, lists", [
    (None, False),                                            # every executable resident
    (ExecutablePolicy(max_count=4), False),                   # a budget shares nothing
    (ExecutablePolicy(max_count=4, share="when_full"), True),  # sharing when it is full
    (ExecutablePolicy(share="always"), True),                 # sharing always
])
def test_a_graphs_topology_is_read_only_where_the_policy_can_share(host, graphs_passed_to,
                                                                   executables, lists):
    """Reading a graph's nodes and edges costs a capture time; a pool that can never share
    an executable by update (no budget, or sharing off) must not pay it."""
    calls = graphs_passed_to(host_graph_ops.HostExecutables, "topology")
    pool = _pool(host, executables)
    model = Model(pool, sizes=(1, 2, 4), layers=3)
    for size in (1, 2, 4, 1):
        model.step(size)
    assert bool(calls) == lists, len(calls)
    pool.close()


def test_the_capture_watch_does_not_wait_for_dynamo():
    """torch wraps a dispatch mode's ``__torch_dispatch__`` in a lazy Dynamo switch whose
    first call imports torch._dynamo (seconds at every process's first capture) unless the
    mode opts out; the operator watch of kept graphs opts out."""
    import inspect

    from vmm_core.graphs import kept_graphs

    watch = kept_graphs.watch_operators()
    method = type(watch).__dict__["__torch_dispatch__"]
    assert "__torch_dispatch__" in method.__qualname__, method.__qualname__
    assert inspect.getsourcefile(method) == inspect.getsourcefile(kept_graphs)
