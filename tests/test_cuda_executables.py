"""Graph executables owned by a GraphPool on a GPU, compared with eager.

Skipped without CUDA; fails instead under VMM_CORE_REQUIRE=cuda.  Small pieces (two
matmuls, a norm and an activation, as one piece of a piecewise capture) at four batch
sizes and two layers, captured the way an engine captures them
(``torch.cuda.graph(g, pool=handle, stream=pool.capture_stream)``).  Seconds in all.
"""

from __future__ import annotations

import random

import pytest

import vmm_core
from vmm_core import ExecutablePolicy
from vmm_core.errors import VMMFallbackWarning

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_tags")]

SIZES = [1, 8, 32, 64]
HIDDEN, FFN = 256, 512


def _piece(x, w1, w2):
    import torch

    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return x + torch.nn.functional.silu(h @ w1) @ w2


class Stack:
    """Two layers of one piece, captured per size in a GraphPool with the handle each
    space yields, as an engine's runner does."""

    def __init__(self, pool, layers=2, seed=0):
        import torch

        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.pool = pool
        self.weights = [(torch.randn(HIDDEN, FFN, device="cuda", generator=gen) / 16,
                         torch.randn(FFN, HIDDEN, device="cuda", generator=gen) / 32)
                        for _ in range(layers)]
        self.static = torch.zeros(max(SIZES), HIDDEN, device="cuda")
        pool.warmup(lambda: self.eager(self.static))  # cuBLAS's workspace outside the pool
        self.graphs, self.outputs = {}, {}
        for size in sorted(SIZES, reverse=True):
            with pool.space(size) as handle:
                h, graphs = self.static[:size], []
                for w1, w2 in self.weights:
                    g = pool.new_graph()
                    with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream):
                        h = _piece(h, w1, w2)
                    pool.keep(h)  # read by the next piece of this size
                    graphs.append(g)
            self.graphs[size], self.outputs[size] = graphs, h

    def eager(self, x):
        for w1, w2 in self.weights:
            x = _piece(x, w1, w2)
        return x

    def step(self, size):
        """Replay every piece of ``size`` on a fresh input; compare with eager."""
        import torch

        x = torch.randn(size, HIDDEN, device="cuda")
        with self.pool.replaying(size):
            self.static[:size].copy_(x)
            for g in self.graphs[size]:
                g.replay()
            got = self.outputs[size].clone()
        torch.testing.assert_close(got, self.eager(x), rtol=1e-4, atol=1e-4)


def _pool(cuda, executables=None):
    return vmm_core.GraphPool(0, backend=cuda, reads=(), executables=executables)


def _live_counter(pool):
    """Count executables alive at each instantiation, through the pool's driver calls."""
    calls = pool._executables._calls
    real_make, real_destroy = calls.instantiate, calls.destroy
    seen = {"live": 0, "max": 0}

    def make(graph):
        handle = real_make(graph)
        seen["live"] += 1
        seen["max"] = max(seen["max"], seen["live"])
        return handle

    def destroy(handle):
        real_destroy(handle)
        seen["live"] -= 1

    calls.instantiate, calls.destroy = make, destroy
    return seen


def test_cuda_kept_graphs_launched_by_the_pool_match_eager(cuda):
    pool = _pool(cuda)
    stack = Stack(pool)
    g = stack.graphs[64][0]
    assert type(g).__name__ == "KeptCUDAGraph" and g.raw_cuda_graph() != 0
    for size in SIZES + SIZES[::-1]:
        stack.step(size)
    s = pool.stats()["executables"]
    assert s["resident"] == s["instantiations"] == 2 * len(SIZES)
    # no budget: made at the end of each capture, as torch makes its own
    assert s["hits"] == 4 * len(SIZES) and s["misses"] == 0 and s["framework_replayed"] == 0
    pool.close()


def test_cuda_a_budget_is_never_exceeded_and_results_equal_eager(cuda):
    pool = _pool(cuda, ExecutablePolicy(max_count=3, share="off"))
    stack = Stack(pool)
    live = _live_counter(pool)
    rng = random.Random(0)
    order = [rng.choice(SIZES) for _ in range(24)]
    assert len(set(order)) == len(SIZES)  # every size: more executables than the budget
    for size in order:
        stack.step(size)
    s = pool.stats()["executables"]
    assert live["max"] <= 3 and s["peak_resident"] <= 3 and s["evictions"] > 0
    pool.close()


def test_cuda_sharing_by_update_across_sizes_and_layers_is_exact(cuda):
    pool = _pool(cuda, ExecutablePolicy(max_count=2, share="when_full"))  # a size's pieces
    stack = Stack(pool)
    calls = pool._executables._calls
    topology = {(s, i): calls.topology(g) for s in SIZES for i, g in enumerate(stack.graphs[s])}
    distinct = set(topology.values())
    # the layers of one size run the same kernels on other weights: one topology
    assert all(topology[(s, 0)] == topology[(s, 1)] for s in SIZES)
    for size in SIZES + SIZES[::-1]:
        stack.step(size)
    s = pool.stats()["executables"]
    assert s["peak_resident"] <= 2
    # across sizes (on an H100 the Llama piece had one topology at every size): updates
    assert s["updates"] > 0 or len(distinct) == len(SIZES), (len(distinct), s)
    always = _pool(cuda, ExecutablePolicy(share="always"))
    stack = Stack(always)
    for size in SIZES:
        stack.step(size)  # every piece of every layer runs through one executable
    s = always.stats()["executables"]
    assert s["resident"] == len(distinct), (len(distinct), s)
    assert s["instantiations"] + s["updates"] == 2 * len(SIZES) and \
        s["updates"] >= len(SIZES), (len(distinct), s)
    always.close()
    pool.close()


def test_cuda_random_numbers_replay_through_torch_with_a_warning(cuda):
    import torch

    pool = _pool(cuda, ExecutablePolicy(max_count=2))
    x = torch.ones(64, HIDDEN, device="cuda")
    g, out = _draws(pool, lambda x: torch.nn.functional.dropout(x, 0.5, training=True), x)
    # kernels are read at the first replay (CUDA's default reading), not in the capture
    assert pool.stats()["executables"]["kernels_unread"] == 1
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        _replays_draw_anew(pool, g, out)
    assert pool.stats()["executables"]["resident"] == 0
    del g, out
    pool.close()


def _draws(pool, fn, x):
    """Capture ``fn(x)`` as one graph of ``pool``; the graph and its output."""
    import torch

    pool.warmup(lambda: fn(x))
    g = pool.new_graph()
    with pool.space(1) as handle:
        with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream):
            out = fn(x)
        pool.keep(out)
    return g, out


def _replays_draw_anew(pool, g, out):
    """Three replays of ``g`` write three different draws into ``out``, through the
    framework's replay (counted by the pool)."""
    import torch

    draws = []
    for _ in range(3):
        g.replay()
        draws.append(out.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    s = pool.stats()["executables"]
    assert s["framework_replayed"] == 1 and s["framework_replays"] == 3


@pytest.mark.parametrize("name", ["dropout", "rand_like", "randn_like", "bernoulli",
                                  "normal_", "multinomial", "randint_like"])
def test_cuda_a_graph_that_draws_random_numbers_is_told_by_its_kernels_without_a_watch(
        cuda, name):
    """``random_numbers="kernels"`` reads the captured graph's kernels, not its
    operators: no dispatch mode runs during the capture, yet each of torch's random
    operators is seen (its kernel takes the generator's philox state), and replays draw
    new numbers."""
    import torch

    fn = {"dropout": lambda x: torch.nn.functional.dropout(x, 0.5, training=True),
          "rand_like": lambda x: x + torch.rand_like(x),
          "randn_like": lambda x: x * torch.randn_like(x),
          "bernoulli": lambda x: torch.bernoulli(x.sigmoid()),
          "normal_": lambda x: x.clone().normal_(),
          "multinomial": lambda x: torch.multinomial(x.softmax(-1), 4, replacement=True),
          "randint_like": lambda x: torch.randint_like(x, 100)}[name]
    pool = _pool(cuda, ExecutablePolicy(random_numbers="kernels"))
    x = torch.rand(64, HIDDEN, device="cuda")
    g, out = _draws(pool, fn, x)
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        assert g.vmm_seeded  # read now, at the first look
    assert g.vmm_operators == ()  # nothing watched the operators
    assert g.vmm_seeded and all("philox" in k.lower() for k in g.vmm_seeded), g.vmm_seeded
    _replays_draw_anew(pool, g, out)
    del g, out  # nothing of the pool is left when it closes
    pool.close()


@pytest.mark.parametrize("attention", ["flash", "efficient", "math"])
def test_cuda_attention_drawing_its_dropout_is_told_by_default_without_a_watch(
        cuda, attention):
    """The default reading (``"auto"``: kernels on CUDA) sees attention drawing its
    dropout mask, whose kernels carry the generator's state inside a parameter struct
    and are named after no philox state: the graph replays through torch, and each
    replay draws a new mask."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[attention]

    def fn(q):
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)

    pool = _pool(cuda)
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.float16)
    g, out = _draws(pool, fn, q)
    assert pool.stats()["executables"]["policy"]["random_numbers"] == "kernels"
    assert g.vmm_operators == ()  # nothing watched the operators
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        assert g.vmm_seeded, "the dropout was not told"
    _replays_draw_anew(pool, g, out)
    del g, out
    pool.close()


def test_cuda_a_graph_with_a_generator_of_its_own_counts_as_drawing(cuda):
    """Reading kernels looks for the default generator's state only: a graph that
    registers another generator replays through torch, which advances it."""
    import torch

    gen = torch.Generator(device="cuda")
    pool = _pool(cuda)
    x = torch.rand(64, HIDDEN, device="cuda")
    pool.warmup(lambda: x + torch.rand(x.shape, device="cuda", generator=gen))
    g = pool.new_graph()
    g.register_generator_state(gen)
    with pool.space(1) as handle:
        with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream):
            out = x + torch.rand(x.shape, device="cuda", generator=gen)
        pool.keep(out)
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        assert g.vmm_seeded
    assert any("register_generator_state" in k for k in g.vmm_seeded), g.vmm_seeded
    _replays_draw_anew(pool, g, out)
    del g, out
    pool.close()


def test_cuda_a_graph_drawing_nothing_is_owned_whichever_way_it_is_read(cuda):
    """Without random numbers the pool owns the executable and the replay matches
    eager on fresh inputs, whether the dispatcher is watched (which then names the
    operators) or the kernels are read (the default on CUDA; attention at dropout_p=0
    draws nothing either way)."""
    import torch

    def fn(x):
        q = x.view(1, 4, -1, HIDDEN // 4).transpose(1, 2).contiguous()
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
        return _piece(x, w1, w2) + a.transpose(1, 2).reshape(x.shape)

    w1 = torch.randn(HIDDEN, FFN, device="cuda") / 16
    w2 = torch.randn(FFN, HIDDEN, device="cuda") / 32
    for reading in ("auto", "kernels", "operators"):
        pool = _pool(cuda, ExecutablePolicy(random_numbers=reading))
        reading = "kernels" if reading == "auto" else reading  # what CUDA resolves it to
        x = torch.zeros(64, HIDDEN, device="cuda")
        g, out = _draws(pool, fn, x)
        assert g.vmm_seeded == ()
        assert bool(g.vmm_operators) is (reading == "operators")
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            g.replay()
            torch.testing.assert_close(out, fn(x))
        s = pool.stats()["executables"]
        assert s["framework_replayed"] == 0 and s["resident"] == 1
        assert s["policy"]["random_numbers"] == reading
        del g, out
        pool.close()


def test_cuda_sleep_releases_executables_and_wake_replays_without_recapture(cuda):
    pool = _pool(cuda)
    stack = Stack(pool)
    for size in SIZES:
        stack.step(size)
    vmm_core.sleep("graph")
    s = pool.stats()["executables"]
    assert s["resident"] == 0 and s["last_sleep"]["executables"] == 2 * len(SIZES)
    assert s["last_sleep"]["driver_free_change"] is not None  # reported, whatever it is
    vmm_core.wake_up("graph")
    for size in SIZES:
        stack.step(size)  # the same graph objects: no recapture
    s = pool.stats()["executables"]
    assert s["instantiations"] == 4 * len(SIZES) and s["resident"] == 2 * len(SIZES)
    vmm_core.sleep("graph")
    vmm_core.wake_up("graph", eager=True)
    s = pool.stats()["executables"]
    assert s["eager_instantiations"] == 2 * len(SIZES) and s["resident"] == 2 * len(SIZES)
    hits = s["hits"]
    for size in SIZES:
        stack.step(size)
    assert pool.stats()["executables"]["hits"] == hits + 2 * len(SIZES)
    pool.close()


def test_cuda_a_pool_of_eager_wake_makes_its_executables_at_a_plain_wake(cuda):
    pool = _pool(cuda, ExecutablePolicy(eager_wake=True))
    stack = Stack(pool)
    for size in SIZES:
        stack.step(size)
    vmm_core.sleep("graph")
    vmm_core.wake_up("graph")  # no eager=: the policy asks for it
    s = pool.stats()["executables"]
    assert s["eager_instantiations"] == 2 * len(SIZES) and s["resident"] == 2 * len(SIZES)
    misses = s["misses"]
    for size in SIZES:
        stack.step(size)  # every result checked against eager
    assert pool.stats()["executables"]["misses"] == misses
    pool.close()


def test_cuda_graph_executor_under_a_budget_of_one_matches_eager(cuda):
    import torch

    w = torch.randn(HIDDEN, HIDDEN, device="cuda") / 16
    ex = vmm_core.GraphExecutor(lambda x: torch.tanh(x @ w),
                                torch.zeros(64, HIDDEN, device="cuda"), backend=cuda,
                                buckets=SIZES,
                                executables=ExecutablePolicy(max_count=1, ahead=False))
    for n in (64, 3, 17, 1, 33, 3, 64):
        x = torch.randn(n, HIDDEN, device="cuda")
        torch.testing.assert_close(ex(x), torch.tanh(x @ w), rtol=1e-4, atol=1e-4)
    s = ex.stats()["executables"]
    # every call replays another bucket than the one before: each a miss, served by an
    # update where the driver takes it, else by a new executable
    assert s["peak_resident"] == 1 and s["misses"] == 7
    assert s["instantiations"] + s["updates"] == 7
    ex.close()


# ------------------------------------------------------------------ prepared ahead
def test_cuda_executables_prepared_on_the_pools_thread_launch_exact(cuda):
    """The preparer is a thread no torch call ever touched: the backend makes the
    device's context current there, and uploads on a stream of its own.

    Which key an expected one displaces depends on the device: cuBLAS may pick GEMMs
    whose graphs differ in topology between sizes (a split-K reduction node at some
    sizes), and an update takes an executable of the same topology from whichever key
    has one. So what must be prepared is counted from what is resident at each hint."""
    pool = _pool(cuda, ExecutablePolicy(max_count=4, ahead=True))  # two sizes' pieces
    stack = Stack(pool)
    stack.step(1)
    stack.step(8)
    assert pool.settle(30)
    before = pool.stats()["executables"]
    missing = 0
    for size in (32, 64, 1):
        missing += sum(not pool._executables.is_resident(g) for g in stack.graphs[size])
        pool.expect(size)
        assert pool.settle(30)
        assert all(pool._executables.is_resident(g) for g in stack.graphs[size])
        stack.step(size)
    s = pool.stats()["executables"]
    assert s["misses"] == before["misses"] and s["hits"] == before["hits"] + 6
    # 32 and 64 were never resident: at least their four pieces were made on the thread
    assert missing >= 4 and s["prepared_ahead"] - before["prepared_ahead"] == missing
    assert s["peak_resident"] <= 4
    pool.close()


def test_cuda_a_trace_with_right_and_wrong_hints_stays_exact_within_the_budget(cuda):
    pool = _pool(cuda, ExecutablePolicy(max_count=3, ahead=True))
    stack = Stack(pool)
    live = _live_counter(pool)
    rng = random.Random(1)
    order = [rng.choice(SIZES) for _ in range(40)]
    for i, size in enumerate(order):
        stack.step(size)  # compared with eager
        if i + 1 < len(order) and i % 3:  # no hint every third step; a wrong one at times
            pool.expect(order[i + 1] if rng.random() < 0.75 else rng.choice(SIZES))
    assert pool.settle(30)
    s = pool.stats()["executables"]
    assert live["max"] <= 3 and s["peak_resident"] <= 3 and s["prepared_ahead"] > 0
    pool.close()


def test_cuda_a_capture_beside_the_preparer_is_not_invalidated(cuda):
    """Capture in global mode while the preparer has keys to make: the capture space
    holds the preparer back, and both the new graph and the others replay exactly."""
    import torch

    pool = _pool(cuda, ExecutablePolicy(max_count=8, ahead=True))
    stack = Stack(pool)
    for size in SIZES:
        stack.step(size)
    vmm_core.sleep("graph")
    vmm_core.wake_up("graph")  # the preparer makes the resident executables again
    w1, w2 = stack.weights[0]
    g = pool.new_graph()
    with pool.space(16) as handle:
        with torch.cuda.graph(g, pool=handle, stream=pool.capture_stream):
            out = _piece(stack.static[:16], w1, w2)
        pool.keep(out)
    x = torch.randn(16, HIDDEN, device="cuda")
    with pool.replaying(16):
        stack.static[:16].copy_(x)
        g.replay()
        torch.testing.assert_close(out, _piece(x, w1, w2), rtol=1e-4, atol=1e-4)
    assert pool.settle(30)
    for size in SIZES:
        stack.step(size)
    pool.close()


def test_cuda_after_a_lazy_wake_the_resident_keys_come_back_in_the_background(cuda):
    pool = _pool(cuda, ExecutablePolicy(max_count=4, ahead=True))
    stack = Stack(pool)
    for size in (64, 1, 8):
        stack.step(size)
    assert pool.settle(30)
    resident = pool.stats()["executables"]["resident"]
    vmm_core.sleep("graph")
    vmm_core.wake_up("graph")
    assert pool.settle(30)
    s = pool.stats()["executables"]
    assert s["resident"] == resident and s["eager_instantiations"] == 0
    stack.step(8)
    stack.step(1)
    assert pool.stats()["executables"]["misses"] == s["misses"]
    pool.close()

