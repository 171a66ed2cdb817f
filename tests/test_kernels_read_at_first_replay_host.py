"""Kernels read at a graph's first replay, not in its capture (the host backend), and
the books of the pool's executables around that read.

Where a pool tells the graphs that draw random numbers by reading their kernels
(``ExecutablePolicy(random_numbers="kernels")``, CUDA's default), the reading costs driver
calls per node that an engine's start-up would wait for; the pool reads each graph at its
first replay instead.  The host's kept graphs record the operators their capture ran and
its executables read those (``HostExecutables.random_kernels``), so the whole path runs
here: what is read when, what a graph that turns out to draw becomes, and that no graph
ever launches through the pool's executable before it is read.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import warnings

import pytest
import torch

import vmm_core
from vmm_backends.host import graph_ops as host_graph_ops
from vmm_core import ExecutablePolicy
from vmm_core.errors import CaptureError, VMMFallbackWarning

pytestmark = pytest.mark.usefixtures("clean_tags")

HIDDEN = 8


@pytest.fixture
def reads(graphs_passed_to):
    """The graphs whose kernels the host's executables read, in order."""
    return graphs_passed_to(host_graph_ops.HostExecutables, "random_kernels")


def _pool(host, **policy):
    return vmm_core.GraphPool(backend=host, reads=(), executables=ExecutablePolicy(
        random_numbers="kernels", **policy))


def _execs(pool) -> dict:
    return pool.stats()["executables"]


def _plain(inp, w):
    return lambda: torch.tanh(inp @ w)


def _noisy(inp, w):
    return lambda: torch.rand_like(inp) + inp @ w


def _capture(pool, size, makes, weights):
    static = torch.zeros(size, HIDDEN)
    graphs, h = [], static
    with pool.space(size):
        for make, w in zip(makes, weights):
            g = pool.new_graph()
            h = pool.capture(g, make(h, w))
            graphs.append(g)
    return static, graphs, h


def _weights(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(HIDDEN, HIDDEN, generator=gen) / 3 for _ in range(n)]


def test_a_capture_reads_no_kernels_and_the_first_replay_reads_each_graph_once(host, reads):
    pool = _pool(host)
    ws = _weights(3)
    static, graphs, out = _capture(pool, 4, [_plain] * 3, ws)
    assert reads == []
    s = _execs(pool)
    assert s["kernels_unread"] == 3 and s["graphs"] == 3
    # made at capture all the same (no budget): the first replay misses nothing
    assert s["resident"] == 3 and s["instantiations"] == 3
    for _ in range(3):
        x = torch.randn(4, HIDDEN)
        with pool.replaying(4):
            static.copy_(x)
            for g in graphs:
                g.replay()
            want = x
            for w in ws:
                want = torch.tanh(want @ w)
            torch.testing.assert_close(out, want)
    assert reads == graphs  # each once, in replay order
    s = _execs(pool)
    assert s["kernels_unread"] == 0 and s["misses"] == 0
    # read, a graph takes the fast path: its later launches count as the key's hits
    assert s["hits"] == 9 and sum(sl.hits for sl in pool._executables._slots.values()) == 6
    pool.close()


def test_a_graph_found_drawing_at_its_first_replay_leaves_the_key_and_draws_anew(host):
    """No warning at capture; at the first replay the read finds the random operator: the
    graph's executable (made at capture) is destroyed once the key's block ends, it
    leaves the key's count, and every replay draws new numbers through the framework."""
    device = host_graph_ops.emulated_device(0)
    pool = _pool(host)
    ws = _weights(2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*draws random numbers")
        static, graphs, out = _capture(pool, 4, [_plain, _noisy], ws)
    live = device.live
    assert _execs(pool)["resident"] == 2
    draws = []
    with pytest.warns(VMMFallbackWarning, match=r"draws random numbers \(aten.rand_like"):
        with pool.replaying(4):
            static.fill_(1.0)
            for g in graphs:
                g.replay()
            assert device.live == live  # still inside the block: the destroy waits
            draws.append(out.clone())
    assert device.live == live - 1
    for _ in range(2):
        with pool.replaying(4):
            static.fill_(1.0)
            for g in graphs:
                g.replay()
            draws.append(out.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    base = torch.tanh(torch.ones(4, HIDDEN) @ ws[0]) @ ws[1]
    for d in draws:
        assert ((d - base >= 0) & (d - base < 1)).all()
    s = _execs(pool)
    assert s["graphs"] == 1 and s["framework_replayed"] == 1 and s["framework_replays"] == 3
    assert s["resident"] == 1 and not pool._executables.is_resident(graphs[1])
    assert graphs[1].vmm_seeded == ("aten.rand_like.default",)
    pool.close()


def test_a_drawing_graph_under_a_budget_gives_its_room_back(host):
    pool = _pool(host, max_count=2, ahead=False)
    ws = _weights(2)
    static, graphs, out = _capture(pool, 4, [_noisy, _plain], ws)
    static2, graphs2, out2 = _capture(pool, 2, [_plain, _plain], ws)
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        with pool.replaying(4):
            for g in graphs:
                g.replay()
    s = _execs(pool)
    assert s["graphs"] == 3 and s["resident"] == 1 and s["framework_replayed"] == 1
    x = torch.randn(2, HIDDEN)
    with pool.replaying(2):  # the budget of 2 holds both graphs of key 2 with key 4's
        static2.copy_(x)
        for g in graphs2:
            g.replay()
        torch.testing.assert_close(out2, torch.tanh(torch.tanh(x @ ws[0]) @ ws[1]))
    s = _execs(pool)
    assert s["resident"] == 2 and s["peak_resident"] <= 2
    pool.close()


def test_asking_for_vmm_seeded_reads_at_once_and_only_once(host, reads):
    pool = _pool(host)
    _, graphs, _ = _capture(pool, 4, [_noisy], _weights(1))
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        assert graphs[0].vmm_seeded == ("aten.rand_like.default",)
    assert graphs[0].vmm_seeded == ("aten.rand_like.default",)
    assert reads == graphs
    assert _execs(pool)["framework_replayed"] == 1 and _execs(pool)["resident"] == 0
    pool.close()


def test_a_graph_reset_before_its_first_replay_is_never_read(host, reads):
    pool = _pool(host)
    _, graphs, _ = _capture(pool, 4, [_plain, _plain], _weights(2))
    graphs[0].reset()
    assert graphs[0].vmm_seeded == () and reads == []
    with pytest.raises(CaptureError, match="never captured or was reset"):
        with pool.replaying(4):
            graphs[0].replay()
    assert reads == [] and _execs(pool)["kernels_unread"] == 1
    pool.close()


def test_a_graph_captured_again_is_read_again_at_its_next_replay(host, reads):
    pool = _pool(host)
    ws = _weights(1)
    static, graphs, _ = _capture(pool, 4, [_plain], ws)
    g = graphs[0]
    with pool.replaying(4):
        g.replay()
    assert reads == [g]
    with pool.space(4):
        out = pool.capture(g, _noisy(static, ws[0]))  # the same graph, captured again
    assert g._vmm_unread and g._vmm_slot is None  # no fast path before its next read
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        with pool.replaying(4):
            static.fill_(1.0)
            g.replay()
    first = out.clone()
    with pool.replaying(4):
        g.replay()
    assert reads == [g, g] and not torch.equal(first, out)
    pool.close()


def test_launching_a_drawing_graph_directly_is_refused(host):
    pool = _pool(host)
    _, graphs, _ = _capture(pool, 4, [_noisy], _weights(1))
    cache = pool._executables
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        with pool.replaying(4), pytest.raises(CaptureError, match=r"draws random numbers "
                                                                  r"\(aten.rand_like.default\)"
                                                                  r": .* call graph.replay"):
            cache.launch(graphs[0])
    pool.close()


def test_a_graph_whose_kernels_cannot_be_read_replays_through_the_framework(host,
                                                                            monkeypatch):
    def unreadable(self, graph):
        raise RuntimeError("a node type the reading does not know")

    monkeypatch.setattr(host_graph_ops.HostExecutables, "random_kernels", unreadable)
    pool = _pool(host)
    ws = _weights(1)
    static, graphs, out = _capture(pool, 4, [_plain], ws)
    x = torch.randn(4, HIDDEN)
    with pytest.warns(VMMFallbackWarning, match="kernels not read: a node type"):
        with pool.replaying(4):
            static.copy_(x)
            graphs[0].replay()
    torch.testing.assert_close(out, torch.tanh(x @ ws[0]))
    s = _execs(pool)
    assert s["framework_replayed"] == 1 and s["framework_replays"] == 1
    pool.close()


def test_watching_operators_still_tells_drawing_graphs_at_capture(host, reads):
    pool = vmm_core.GraphPool(backend=host, reads=(), executables=ExecutablePolicy(
        random_numbers="operators"))
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        _, graphs, _ = _capture(pool, 4, [_noisy], _weights(1))
    s = _execs(pool)
    assert s["framework_replayed"] == 1 and s["kernels_unread"] == 0 and reads == []
    pool.close()


# ------------------------------------------------------------------ a read and the rest
@pytest.fixture
def held_read(monkeypatch):
    """The host's reading waits until released (a device's takes driver calls): another
    thread can act while a read is under way."""
    inside, release = threading.Event(), threading.Event()
    real = host_graph_ops.HostExecutables.random_kernels

    def held(self, graph):
        inside.set()
        assert release.wait(10)
        return real(self, graph)

    monkeypatch.setattr(host_graph_ops.HostExecutables, "random_kernels", held)
    return inside, release


def _ask_on_a_thread(graph) -> threading.Thread:
    def ask():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph.vmm_seeded
    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def test_another_thread_asking_during_a_read_gets_the_verdict(host, held_read):
    inside, release = held_read
    pool = _pool(host)
    _, graphs, _ = _capture(pool, 4, [_noisy], _weights(1))
    reader = _ask_on_a_thread(graphs[0])
    assert inside.wait(10)
    threading.Timer(0.3, release.set).start()
    seen = graphs[0].vmm_seeded  # asked while the other thread reads
    reader.join(10)
    assert seen == ("aten.rand_like.default",)
    pool.close()


def test_a_replay_racing_a_read_that_finds_drawing_replays_through_the_framework(
        host, held_read):
    """A replay in an open block of the key passes its checks while another thread reads
    the graph: it waits for the read, then goes to the framework's replay; nothing is
    made for it, and nothing leaks."""
    inside, release = held_read
    device = host_graph_ops.emulated_device(0)
    pool = _pool(host, max_count=4, ahead=False)
    static, graphs, out = _capture(pool, 4, [_noisy], _weights(1))
    cache = pool._executables
    opened, go, errors = threading.Event(), threading.Event(), []

    def replay():
        try:
            with pool.replaying(4):
                opened.set()
                assert go.wait(10)
                graphs[0].replay()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    replayer = threading.Thread(target=replay)
    replayer.start()
    assert opened.wait(10)
    live = device.live
    reader = _ask_on_a_thread(graphs[0])
    assert inside.wait(10)
    go.set()
    time.sleep(0.3)  # the replay is past its checks, waiting for the cache's lock
    release.set()
    reader.join(10)
    replayer.join(10)
    assert (cache._res.count, len(cache._res.resident), device.live - live, errors) == \
        (0, 0, 0, [])
    assert _execs(pool)["framework_replays"] == 1
    pool.close()


def test_a_graph_found_drawing_while_asleep_is_not_made_again_by_an_eager_wake(host,
                                                                               caplog):
    device = host_graph_ops.emulated_device(0)
    pool = _pool(host)
    _, graphs, _ = _capture(pool, 4, [_noisy], _weights(1))
    assert pool._executables.is_resident(graphs[0])  # made at capture (no budget), unread
    vmm_core.sleep("graph")
    with pytest.warns(VMMFallbackWarning, match="draws random numbers"):
        assert graphs[0].vmm_seeded  # read while asleep: it leaves its key
    live = device.live
    with caplog.at_level(logging.ERROR, logger="vmm_core"):
        vmm_core.wake_up("graph", eager=True)
    cache = pool._executables
    assert (cache._res.count, len(cache._res.resident), device.live - live) == (0, 0, 0)
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert _execs(pool)["eager_instantiations"] == 0
    pool.close()


def test_a_key_fits_its_budget_once_its_drawing_graph_has_left_it(host):
    """Three graphs under max_count=2, one of them drawing: at capture the key is listed
    as over the budget but not said to be (its graphs are unread); once the drawing one
    leaves at its first replay the key fits, leaves the list, and the preparer makes its
    executables ahead."""
    pool = _pool(host, max_count=2, ahead=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        static, graphs, out = _capture(pool, 4, [_noisy, _plain, _plain], _weights(3))
        assert _execs(pool)["keys_over_budget"] == [4]
        for _ in range(3):
            with pool.replaying(4):
                for g in graphs:
                    g.replay()
            pool._executables.settle(5)
    said = [str(w.message) for w in caught if issubclass(w.category, VMMFallbackWarning)]
    s = _execs(pool)
    assert s["graphs"] == 2 and s["framework_replayed"] == 1 and s["keys_over_budget"] == []
    assert not any("do not fit the budget" in m for m in said), said
    assert any("draws random numbers" in m for m in said), said
    pool.close()


def test_a_key_over_its_budget_is_said_to_be_once_its_graphs_are_read(host):
    pool = _pool(host, max_count=2, ahead=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*do not fit the budget")
        _, graphs, _ = _capture(pool, 4, [_plain] * 3, _weights(3))  # unread: not said
    with pytest.warns(VMMFallbackWarning, match=r"the 3 graphs of key 4 .* do not fit"):
        with pool.replaying(4):
            for g in graphs:
                g.replay()
    assert _execs(pool)["keys_over_budget"] == [4]
    pool.close()


# ------------------------------------------------------------------ the books
def _said(caught):
    return [str(w.message) for w in caught if issubclass(w.category, VMMFallbackWarning)]


def test_one_read_that_finds_drawing_and_a_key_over_budget_says_both(host):
    """4 graphs under max_count=2, the last one drawing: its read both converts it and
    leaves the key (3 graphs, all read) over budget. Each warning is said once per pool,
    and one read says both."""
    pool = _pool(host, max_count=2, ahead=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, graphs, _ = _capture(pool, 4, [_plain, _plain, _plain, _noisy], _weights(4))
        with pool.replaying(4):
            for g in graphs:
                g.replay()
    said = _said(caught)
    assert _execs(pool)["framework_replayed"] == 1
    assert any("do not fit the budget" in m for m in said), said
    assert any("draws random numbers" in m for m in said), said
    pool.close()


@pytest.mark.parametrize("how", ["reset", "collected"])
def test_a_key_that_fits_after_a_graph_leaves_it_leaves_the_list(host, how):
    """3 plain graphs under max_count=2 (listed); one is reset / collected: the key fits
    and leaves keys_over_budget (the preparer leaves listed keys alone)."""
    pool = _pool(host, max_count=2, ahead=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, graphs, _ = _capture(pool, 4, [_plain] * 3, _weights(3))
        with pool.replaying(4):
            for g in graphs:
                g.replay()
    assert _execs(pool)["keys_over_budget"] == [4]
    if how == "reset":
        graphs[2].reset()
    else:
        del graphs[2]
        gc.collect()
    for _ in range(3):
        with pool.replaying(4):
            for g in graphs[:2]:
                g.replay()
        pool._executables.settle(5)
    assert _execs(pool)["keys_over_budget"] == []
    pool.close()


def test_the_budget_warning_comes_when_the_last_unread_graph_leaves_unread(host):
    """4 plain graphs under max_count=2: 3 replayed (read), the 4th reset unread. The key
    (3 graphs) is over budget with every graph read: the reset says so, as no later read
    will."""
    pool = _pool(host, max_count=2, ahead=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, graphs, _ = _capture(pool, 4, [_plain] * 4, _weights(4))
        with pool.replaying(4):
            for g in graphs[:3]:
                g.replay()
        graphs[3].reset()
        for _ in range(2):
            with pool.replaying(4):
                for g in graphs[:3]:
                    g.replay()
    assert _execs(pool)["keys_over_budget"] == [4]
    assert any("do not fit the budget" in m for m in _said(caught)), _said(caught)
    pool.close()


class _Interrupted(BaseException):
    pass


def test_a_read_interrupted_leaves_the_graph_unread(host, monkeypatch):
    """A read interrupted (KeyboardInterrupt and the like) gives no verdict: the graph
    stays unread, and the next replay reads it again and goes to the framework's replay,
    never to the pool's own launch."""
    pool = _pool(host, ahead=False)
    _, graphs, _ = _capture(pool, 4, [_noisy], _weights(1))
    real = host_graph_ops.HostExecutables.random_kernels
    calls = []

    def interrupted(self, graph):
        calls.append(graph)
        if len(calls) == 1:
            raise _Interrupted()
        return real(self, graph)

    monkeypatch.setattr(host_graph_ops.HostExecutables, "random_kernels", interrupted)
    with pytest.raises(_Interrupted):
        with pool.replaying(4):
            graphs[0].replay()
    launched = []  # graphs sent to the pool's own launch (never one drawing)
    monkeypatch.setattr(pool._executables, "launch",
                        lambda g, stream=None: launched.append(g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pool.replaying(4):
            graphs[0].replay()
    s = _execs(pool)
    assert launched == [] and len(calls) == 2, (launched, calls)
    assert s["kernels_unread"] == 0 and s["framework_replays"] == 1
    pool.close()


def test_a_destroy_that_raises_at_a_conversion_keeps_the_books(host, monkeypatch):
    """A graph found drawing outside a block of its key (vmm_seeded) has its executable
    destroyed at once; a destroy that raises still leaves the books whole (the graph
    counted as framework-replayed, its key's fit checked again), then raises."""
    pool = _pool(host, max_count=2, ahead=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, graphs, _ = _capture(pool, 4, [_plain, _plain, _noisy], _weights(3))
        with pool.replaying(4):
            graphs[0].replay()  # read, and made
            graphs[1].replay()
    cache = pool._executables
    # give the noisy graph an executable outside any block (made at a miss elsewhere)
    with cache._lock:
        job = cache._claim_inline(graphs[2], graphs[2]._vmm_token)
    cache._execute(job)
    with cache._lock:
        cache._install(job)
    assert cache.is_resident(graphs[2])

    def failing(self, handle):
        raise RuntimeError("destroy failed")

    monkeypatch.setattr(host_graph_ops.HostExecutables, "destroy", failing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="destroy failed"):
            graphs[2].vmm_seeded
    monkeypatch.undo()
    s = _execs(pool)
    assert (s["framework_replayed"], s["graphs"], s["keys_over_budget"]) == (1, 2, []), s
    pool.close()
