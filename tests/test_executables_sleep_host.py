"""What a sleep and a wake do to a GraphPool's executables when something goes wrong in
between: a failure while the eager wake makes them, an interrupt, a sleep or a hint that
comes while they are made or while the memory sleeps.  Host backend; every replay is
compared with eager on fresh inputs (``Model.step``)."""

from __future__ import annotations

import threading
import warnings

import pytest
from test_executables_host import Model, _execs, _pool

import vmm_core
from vmm_backends.host import graph_ops as host_graph_ops
from vmm_core import ExecutablePolicy
from vmm_core.errors import VMMFallbackWarning

pytestmark = pytest.mark.usefixtures("clean_tags")


def _slept_with_six(host, **kw):
    """A pool whose budget of six held sizes 8 and 2 (three graphs each) at the sleep."""
    pool = _pool(host, ExecutablePolicy(max_count=6, **kw))
    model = Model(pool)
    for size in (1, 2, 8):
        model.step(size)
    pool.settle(10)
    vmm_core.sleep("graph")
    return pool, model


_real_instantiate = host_graph_ops.HostExecutables.instantiate


def _failing_instantiate(monkeypatch, which, raised):
    real = host_graph_ops.HostExecutables.instantiate
    calls = {"n": 0}

    def instantiate(self, graph):
        calls["n"] += 1
        if calls["n"] == which:
            raise raised
        return real(self, graph)

    monkeypatch.setattr(host_graph_ops.HostExecutables, "instantiate", instantiate)


@pytest.mark.parametrize("ahead", [False, True])
def test_an_executable_the_eager_wake_cannot_make_is_said_and_made_at_first_replay(
        host, monkeypatch, ahead):
    pool, model = _slept_with_six(host, ahead=ahead, eager_wake=True)
    _failing_instantiate(monkeypatch, 2, RuntimeError("emulated driver: out of memory"))
    with pytest.warns(VMMFallbackWarning, match=r"made 5 of the executables resident at "
                      r"the sleep; 1 could not be made \(.*out of memory\)"):
        vmm_core.wake_up("graph")
    assert _execs(pool)["eager_instantiations"] == 5
    monkeypatch.undo()
    model.step(8)  # the one left is made now, and every result is right
    model.step(2)
    pool.settle(10)
    assert _execs(pool)["resident"] == 6
    pool.close()


def test_an_interrupt_during_the_eager_wake_is_raised_and_the_rest_waits(host, monkeypatch):
    pool, model = _slept_with_six(host, ahead=False)
    _failing_instantiate(monkeypatch, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        vmm_core.wake_up("graph", eager=True)
    assert _execs(pool)["eager_instantiations"] == 2
    monkeypatch.undo()
    # the four not made (the one interrupted too) were resident at the sleep: the next
    # eager wake makes them, after a sleep
    vmm_core.sleep("graph")
    vmm_core.wake_up("graph", eager=True)
    s = _execs(pool)
    assert s["eager_instantiations"] == 8 and s["resident"] == 6
    model.step(8)
    model.step(2)
    pool.close()


def test_a_sleep_while_the_eager_wake_makes_them_leaves_none_while_asleep(host, monkeypatch):
    """The allocator's own sleep takes only its lock, so it can come between two graphs
    of the wake's making: what is made after it would hold device memory in a sleeping
    pool.  The wake stops; the next eager wake makes what the sleep found and the rest."""
    pool, model = _slept_with_six(host, ahead=False)
    alloc, cache = pool.allocator, pool._executables
    real = type(cache)._install
    calls = {"n": 0}

    def install(self, job, run=False):
        real(self, job, run)
        calls["n"] += 1
        if calls["n"] == 2:
            alloc.sleep()  # a sleep between two of the wake's graphs

    monkeypatch.setattr(type(cache), "_install", install)
    vmm_core.wake_up("graph", eager=True)
    assert alloc.asleep and _execs(pool)["resident"] == 0
    monkeypatch.undo()
    vmm_core.wake_up("graph", eager=True)
    s = _execs(pool)
    assert s["resident"] == 6
    misses = s["misses"]
    model.step(8)
    model.step(2)
    assert _execs(pool)["misses"] == misses
    pool.close()


def test_a_wake_heard_after_the_memory_slept_again_makes_nothing(host):
    pool, _ = _slept_with_six(host, ahead=False, eager_wake=True)
    alloc = pool.allocator
    cache = pool._executables
    # the wake's listener runs once the allocator's lock is let go; another thread's
    # sleep can come first: the listener then finds the allocator asleep
    vmm_core.wake_up("graph")
    alloc.sleep()
    assert _execs(pool)["resident"] == 0
    cache.on_memory_event("wake", eager=True, allocator=alloc)  # heard late
    assert _execs(pool)["resident"] == 0 and alloc.asleep
    vmm_core.wake_up("graph")
    assert _execs(pool)["resident"] == 6
    pool.close()


def test_a_hint_given_while_asleep_is_prepared_after_the_wake_not_before(host):
    pool, model = _slept_with_six(host, ahead=True)
    pool.expect(1)
    pool.settle(10)
    assert _execs(pool)["resident"] == 0  # nothing made into a sleeping pool
    vmm_core.wake_up("graph")
    pool.settle(10)
    s = _execs(pool)
    assert s["resident"] == 6 and s["prepared_ahead"] > 0
    for size in (1, 8):
        model.step(size)
    pool.close()


def test_a_wake_on_another_thread_while_a_sleep_waits_keeps_the_books(host):
    """Sleeps and wakes of the tag from two threads, each eager: at the end the pool is
    awake or asleep, and holds executables only awake."""
    pool, model = _slept_with_six(host, ahead=False, eager_wake=True)
    errors = []

    def flip(n):
        try:
            for _ in range(n):
                vmm_core.wake_up("graph")
                vmm_core.sleep("graph")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads = [threading.Thread(target=flip, args=(20,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors
    assert pool.allocator.asleep and _execs(pool)["resident"] == 0
    vmm_core.wake_up("graph")
    assert _execs(pool)["resident"] == 6
    model.step(8)
    pool.close()


def test_a_sleep_on_another_thread_while_the_wake_makes_one_keeps_all_for_the_next(
        host, monkeypatch):
    """Another thread's sleep waits for the executable being made (its driver call), which
    is then destroyed: it is kept, with those not made yet, for the next eager wake."""
    pool, model = _slept_with_six(host, ahead=False)
    alloc, cache = pool.allocator, pool._executables
    real = host_graph_ops.HostExecutables.instantiate
    calls, sleeper = {"n": 0}, []

    def instantiate(self, graph):
        calls["n"] += 1
        if calls["n"] == 2:  # a sleep starts on another thread and waits for this call
            sleeper.append(threading.Thread(target=alloc.sleep, daemon=True))
            sleeper[0].start()
            for _ in range(1000):
                if cache._stopping:
                    break
                threading.Event().wait(0.005)
            assert cache._stopping
        return real(self, graph)

    monkeypatch.setattr(host_graph_ops.HostExecutables, "instantiate", instantiate)
    vmm_core.wake_up("graph", eager=True)
    sleeper[0].join(10)
    assert alloc.asleep and _execs(pool)["resident"] == 0
    monkeypatch.undo()
    vmm_core.wake_up("graph", eager=True)
    assert _execs(pool)["resident"] == 6
    misses = _execs(pool)["misses"]
    model.step(8)
    model.step(2)
    assert _execs(pool)["misses"] == misses
    pool.close()


def test_a_hint_given_while_asleep_is_prepared_even_when_the_wakes_warning_is_an_error(
        host, monkeypatch):
    """A failed make during the eager wake is a warning, which a filter may turn into an
    error inside the wake's listener: the hints given while asleep still reach the
    preparer, whose thread had retired during the sleep."""
    from vmm_core.graphs import exec_ahead

    monkeypatch.setattr(exec_ahead, "IDLE_SECONDS", 0.05)
    pool, model = _slept_with_six(host, ahead=True, eager_wake=True)
    pool.expect(4)
    threading.Event().wait(0.3)  # the preparer, given nothing to do, retires
    _failing_instantiate(monkeypatch, 1, RuntimeError("emulated driver: out of memory"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vmm_core.wake_up("graph")  # the listener's error is logged, the wake is done
    monkeypatch.setattr(host_graph_ops.HostExecutables, "instantiate",
                        _real_instantiate)
    pool.settle(10)
    assert {g for g in model.graphs[4] if pool._executables.is_resident(g)} == \
        set(model.graphs[4])
    pool.close()


def test_an_interrupt_in_one_pools_wake_lets_the_other_pools_hear_it(host, monkeypatch):
    """Two pools on one allocator: an interrupt raised by the first pool's eager wake is
    raised once every listener heard the wake, so the second is awake too."""
    first = _pool(host, ExecutablePolicy(max_count=6, ahead=True, eager_wake=True))
    second = vmm_core.GraphPool(backend=host, allocator=first.allocator, reads=(),
                                executables=ExecutablePolicy(max_count=6, ahead=True))
    models = [Model(first), Model(second, seed=1)]
    for model in models:
        model.step(2)
    vmm_core.sleep("graph")
    _failing_instantiate(monkeypatch, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        vmm_core.wake_up("graph")
    monkeypatch.setattr(host_graph_ops.HostExecutables, "instantiate",
                        _real_instantiate)
    assert not second._executables._asleep  # it heard the wake
    second.expect(8)
    second.settle(10)
    assert all(second._executables.is_resident(g) for g in models[1].graphs[8])
    for model in models:
        model.step(8)
    first.close()
    second.close()
