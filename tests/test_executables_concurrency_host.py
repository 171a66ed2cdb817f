"""Executables owned by a GraphPool under concurrent use: sleeps, resets and closes on
other threads while replays run, a fork with a launch in flight, a dropped pool.

The emulated executables raise on any use of a destroyed one, so a launch that slipped
past a sleep, a reset or a close shows as an error here instead of as garbage.
"""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch
from proc_state import fork_while_held
from test_executables_host import HIDDEN, Model, _execs, _pool, piece

import vmm_core
from vmm_backends.host import graph_ops as host_graph_ops
from vmm_core import ExecutablePolicy
from vmm_core.errors import CaptureError, SleepStateError

pytestmark = pytest.mark.usefixtures("clean_tags")


def _hammer(work, seconds: float = 1.0):
    """Run ``work()`` in a loop on another thread; returns (stop, thread, errors, count)."""
    stop, errors, done = threading.Event(), [], [0]

    def loop():
        while not stop.is_set():
            try:
                if work():
                    done[0] += 1
            except Exception as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return stop, thread, errors, done


def test_replays_racing_sleep_and_wake_never_launch_a_destroyed_executable(host):
    pool = _pool(host, ExecutablePolicy(max_count=4))
    model = Model(pool, sizes=(1, 2, 4), layers=2)
    rng = random.Random(0)

    def replay():
        try:
            model.step(rng.choice(model.sizes))  # compared with eager
            return True
        except SleepStateError:
            return False

    stop, thread, errors, done = _hammer(replay)
    deadline, rounds = time.monotonic() + 20, 0
    while time.monotonic() < deadline and not errors and \
            (rounds < 40 or done[0] < 20 or not _execs(pool)["released_on_sleep"]):
        vmm_core.sleep("graph")
        vmm_core.wake_up("graph", eager=bool(rounds % 2))
        rounds += 1
        time.sleep(0.002)  # let replays in between
    stop.set()
    thread.join(10)
    assert not errors, errors
    s = _execs(pool)
    assert done[0] >= 20 and s["released_on_sleep"] > 0 and s["peak_resident"] <= 4
    pool.close()


def test_a_reset_racing_replays_never_launches_a_destroyed_executable(host):
    pool = _pool(host)
    model = Model(pool, sizes=(2,), layers=1)
    g, w = model.graphs[2][0], model.weights[0]

    def replay():
        try:
            g.replay()
            return True
        except CaptureError as exc:
            if "never captured or was reset" not in str(exc):
                raise
            return False

    stop, thread, errors, done = _hammer(replay)
    for _ in range(200):
        g.reset()
        with pool.space(2):
            pool.capture(g, piece(model.static[2], w))
    stop.set()
    thread.join(10)
    assert not errors, errors
    x = torch.randn(2, HIDDEN)
    model.static[2].copy_(x)
    g.replay()
    assert host_graph_ops.emulated_device(0).live >= 1
    pool.close()


def test_closing_a_pool_waits_for_a_replay_on_another_thread(host):
    before = host_graph_ops.emulated_device(0).live
    pool = _pool(host)
    inside, go = threading.Event(), threading.Event()
    static = torch.zeros(2, HIDDEN)
    w = torch.randn(HIDDEN, HIDDEN)

    def slow():
        if inside_armed[0]:
            inside.set()
            go.wait(5)
        return torch.tanh(static @ w)

    inside_armed = [False]
    g = pool.new_graph()
    with pool.space(2):
        out = pool.capture(g, slow)
    x = torch.randn(2, HIDDEN)
    static.copy_(x)
    inside_armed[0] = True
    replayer = threading.Thread(target=g.replay, daemon=True)
    replayer.start()
    assert inside.wait(5)
    closer = threading.Thread(target=pool.close, daemon=True)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() must wait for the launch in flight"
    go.set()
    replayer.join(5)
    closer.join(5)
    assert not closer.is_alive() and not replayer.is_alive()
    torch.testing.assert_close(out, torch.tanh(x @ w))
    with pytest.raises(CaptureError, match="closed"):
        g.replay()
    assert host_graph_ops.emulated_device(0).live == before


def test_a_child_forked_during_a_launch_replays_without_hanging(host):
    pool = _pool(host)
    model = Model(pool, sizes=(2,), layers=2)
    model.step(2)

    def child():
        model.step(2)  # compared with eager, in the child
        assert _execs(pool)["hits"] >= 2

    # a launch holds the cache's lock: a child forked then inherits it held by a thread
    # it does not have
    fork_while_held(pool._executables._lock, child, "on an executable cache's lock held "
                                                    "at the fork")
    pool.close()


def test_a_graph_of_a_dropped_pool_refuses_to_replay_naming_why(host):
    before = host_graph_ops.emulated_device(0).live
    pool = _pool(host)
    model = Model(pool, sizes=(2,), layers=1)
    model.step(2)
    g = model.graphs[2][0]
    model.pool = None
    del pool
    gc.collect()
    from vmm_core.memory import reaper

    assert reaper.drain()
    with pytest.raises(CaptureError, match="GraphPool this graph was made by was closed or "
                                           "dropped"):
        g.replay()
    assert host_graph_ops.emulated_device(0).live == before  # given back with the pool


def test_eviction_never_exceeds_the_budget_across_threads(host):
    live = host_graph_ops.emulated_device(0)
    pool = _pool(host, ExecutablePolicy(max_count=3, share="off"))
    model = Model(pool, sizes=(1, 2, 4, 8), layers=2)
    base = live.live
    most = [0]
    real = host_graph_ops.HostExecutables.instantiate

    def counting(self, graph):
        handle = real(self, graph)
        most[0] = max(most[0], live.live - base)
        return handle

    host_graph_ops.HostExecutables.instantiate = counting
    try:
        threads = []
        failures: list = []
        for seed in range(3):
            rng = random.Random(seed)

            def run(rng=rng):
                try:
                    for _ in range(30):
                        model.step(rng.choice(model.sizes))
                except Exception as exc:  # noqa: BLE001
                    failures.append(exc)

            threads.append(threading.Thread(target=run))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        host_graph_ops.HostExecutables.instantiate = real
    assert not failures, failures
    assert most[0] <= 3
    pool.close()


def test_a_failing_destroy_at_close_still_gives_the_spaces_back(host, monkeypatch):
    alloc = vmm_core.SharedVMMAllocator(host, tag="shared-pages")
    pool = vmm_core.GraphPool(backend=host, allocator=alloc, reads=())
    model = Model(pool, sizes=(1, 2), layers=1)
    model.step(1)
    model.step(2)
    assert alloc.num_virtual_spaces == 2

    def failing(self, handle):
        raise CaptureError("destroy failed")

    monkeypatch.setattr(host_graph_ops.HostExecutables, "destroy", failing)
    with pytest.raises(CaptureError, match="destroy failed"):
        pool.close()
    assert alloc.num_virtual_spaces == 1  # the other key's space went back all the same
    assert "graph" not in vmm_core.memory_summary()
    monkeypatch.undo()
    alloc.close()
