"""Executables prepared ahead of the step (``ExecutablePolicy(ahead=True)``), run for real on
the host backend.

What is prepared ahead (the engine's hint, the forecast's bet, the keys of a wake, the
pieces of a key whose block has opened, in the step's order), what is given up (whole
keys, by frequency with aging), what a wrong guess costs, and the races: a preparation
and a replay of the same graph, a sleep, a close, a fork and a capture while one is in
flight.  The host's emulated executables raise on any use of a destroyed one; every
replay is compared with eager on fresh inputs, and no graph is ever captured again.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import random
import threading
import time

import pytest
import torch
from proc_state import join_child
from test_executables_host import Model, _execs, _pool, live_counter  # noqa: F401

import vmm_core
from vmm_backends.host import graph_ops as host_graph_ops
from vmm_core import ExecutablePolicy
from vmm_core.graphs import executables as executables_module
from vmm_core.graphs.exec_forecast import KeyForecast
from vmm_core.graphs.kept_graphs import KeptGraphMixin
from vmm_core.memory import reaper

pytestmark = pytest.mark.usefixtures("clean_tags")

PREPARER = "vmm-core-executables"


def _ahead(host, count, **kw):
    return _pool(host, ExecutablePolicy(max_count=count, ahead=True, **kw))


def _settled(pool) -> dict:
    assert pool.settle(10)
    return _execs(pool)


def _resident(pool, model, size) -> list[bool]:
    return [pool._executables.is_resident(g) for g in model.graphs[size]]


class Stall:
    """The preparer's next driver call (once ``armed``) signals ``inside`` and waits for
    ``go``; every make or update is recorded as (thread name, graph token)."""

    def __init__(self) -> None:
        self.armed = False
        self.inside, self.go = threading.Event(), threading.Event()
        self.calls: list = []


@pytest.fixture
def stall(monkeypatch):
    st = Stall()
    ex = host_graph_ops.HostExecutables

    def wrap(real):
        def call(self, *args):
            name = threading.current_thread().name
            st.calls.append((name, args[-1]._vmm_token))
            if name == PREPARER and st.armed:
                st.armed = False
                st.inside.set()
                assert st.go.wait(20)
            return real(self, *args)
        return call

    monkeypatch.setattr(ex, "instantiate", wrap(ex.instantiate))
    monkeypatch.setattr(ex, "update", wrap(ex.update))
    yield st
    st.go.set()


def _preparing(host, stall, replayed=(1,)):
    """A pool of two keys' budget whose preparer is inside the driver call that makes
    key 4's first executable (``stall.go`` lets it go on); keys ``replayed`` first."""
    pool = _ahead(host, 6)
    model = Model(pool, sizes=tuple(sorted({*replayed, 4})), layers=3)
    for size in replayed:
        model.step(size)
    _settled(pool)
    stall.armed = True
    pool.expect(4)
    assert stall.inside.wait(10)
    return pool, model


def _baseline() -> int:
    gc.collect()  # pools earlier tests dropped give their executables back first
    reaper.drain()
    return host_graph_ops.emulated_device(0).live


# ------------------------------------------------------------------ what is prepared ahead
def test_a_hinted_key_is_prepared_before_its_block_and_its_step_never_misses(host):
    pool = _ahead(host, 6, share="when_full")  # two keys of three pieces
    model = Model(pool, sizes=(1, 2, 4, 8), layers=3)
    model.step(1)
    model.step(2)
    before = _settled(pool)
    pool.expect(4)
    after = _settled(pool)
    assert after["prepared_ahead"] - before["prepared_ahead"] == 3
    assert after["updates"] - before["updates"] == 3  # the budget is full: shared
    # the key valued least (replayed longest ago) is given up whole, the other kept whole
    assert _resident(pool, model, 4) == [True] * 3
    assert _resident(pool, model, 1) == [False] * 3 and _resident(pool, model, 2) == [True] * 3
    model.step(4)
    s = _execs(pool)
    assert s["misses"] == after["misses"] and s["hits"] == after["hits"] + 3
    assert s["peak_resident"] == 6 and s["unused_ahead"] == 0
    pool.close()


def test_a_wrong_hint_costs_only_its_work_and_goes_first(host):
    pool = _ahead(host, 6)
    model = Model(pool, sizes=(1, 2, 4, 8), layers=3)
    model.step(1)
    model.step(2)
    pool.expect(4)
    _settled(pool)
    model.step(8)  # not the key hinted: exact all the same
    s = _settled(pool)
    # what was made for 4 and never launched made room for 8 before anything replayed
    assert s["unused_ahead"] == 3
    assert _resident(pool, model, 4) == [False] * 3 and _resident(pool, model, 2) == [True] * 3
    assert _resident(pool, model, 8) == [True] * 3
    pool.close()


@pytest.mark.parametrize("ahead, kept, given_up", [(True, 1, 2), (False, 2, 1)])
def test_keys_are_given_up_whole_by_aged_frequency_ahead_and_by_recency_inline(
        host, ahead, kept, given_up):
    """Key 1 replayed four times, then key 2 once: making room for key 4, the forecast
    gives up key 2 (rarer), the inline policy key 1 (replayed longer ago)."""
    pool = _pool(host, ExecutablePolicy(max_count=6, share="when_full", ahead=ahead))
    model = Model(pool, sizes=(1, 2, 4), layers=3)
    for size in (1, 1, 1, 1, 2, 4):
        model.step(size)
        assert pool.settle(10)
    # three updates made room for key 4; giving up key 1 would have taken three more to
    # make it again, ahead, for the next step the forecast expects
    assert _execs(pool)["updates"] == 3
    assert _resident(pool, model, kept) == [True] * 3
    assert _resident(pool, model, given_up) == [False] * 3
    pool.close()


def test_without_a_hint_the_forecast_bets_on_what_follows(host):
    """Two keys in turn and a budget of one: after a few steps each key's pieces are
    made while the other replays, and no step misses."""
    pool = _ahead(host, 3)
    model = Model(pool, sizes=(1, 2), layers=3)
    for size in (1, 2, 1, 2):
        model.step(size)
        assert pool.settle(10)
    before = _execs(pool)
    for size in (1, 2) * 3:
        model.step(size)
        assert pool.settle(10)
    s = _execs(pool)
    assert s["misses"] == before["misses"] and s["hits"] == before["hits"] + 18
    assert s["prepared_ahead"] - before["prepared_ahead"] == 18
    assert s["peak_resident"] == 3
    pool.close()


@pytest.mark.parametrize("trace, short", [("drift", True), ("zipf", False)])
def test_the_forecast_ranks_by_the_half_life_that_missed_least(trace, short):
    """A random walk over 51 keys is served best by recency, a Zipf load by frequency: the
    shadow that missed least picks the half-life (budget: 13 keys)."""
    for seed in range(3):
        rng = random.Random(seed)
        forecast = KeyForecast()
        forecast.capacity = 13
        if trace == "drift":
            i, keys = 25, []
            for _ in range(600):
                i = min(50, max(0, i + rng.choice((-1, 0, 0, 1))))
                keys.append(i)
        else:
            ranked = list(range(51))
            rng.shuffle(ranked)
            keys = rng.choices(ranked, weights=[1 / (r + 1) for r in range(51)], k=600)
        for key in keys:
            forecast.observe(key)
        assert (forecast.half_life <= 32) == short, (seed, forecast.half_life)


def test_a_key_whose_block_opens_unprepared_is_prepared_in_the_steps_order(host, stall,
                                                                           monkeypatch):
    """No hint: the preparer makes the key's pieces while the step launches the first
    ones, in the step's order; no piece is made twice."""
    real = host_graph_ops.HostExecutables.launch

    def slow_launch(self, handle, stream=None):
        time.sleep(0.01)  # a step long enough for the preparer to work beside it
        return real(self, handle, stream)

    monkeypatch.setattr(host_graph_ops.HostExecutables, "launch", slow_launch)
    pool = _ahead(host, 32)
    model = Model(pool, sizes=(4,), layers=8)
    model.step(4)
    tokens = [g._vmm_token for g in model.graphs[4]]
    made = [t for _, t in stall.calls]
    assert sorted(made) == sorted(tokens)  # each piece made once
    by_preparer = [t for name, t in stall.calls if name == PREPARER]
    assert by_preparer and by_preparer == sorted(by_preparer)
    assert _settled(pool)["instantiations"] == 8
    pool.close()


# ------------------------------------------------------------------ races
def test_a_replay_waits_for_the_preparation_of_its_graph_in_flight(host, stall):
    pool, model = _preparing(host, stall)
    stepper = threading.Thread(target=model.step, args=(4,), daemon=True)
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive(), "the launch must wait for the preparation in flight"
    stall.go.set()
    stepper.join(10)
    assert not stepper.is_alive()
    s = _settled(pool)
    four = {g._vmm_token for g in model.graphs[4]}
    assert sorted(t for _, t in stall.calls if t in four) == sorted(four)  # none twice
    assert s["waits"] >= 1
    model.step(4)
    pool.close()


@contextlib.contextmanager
def _held_at_the_gate(host, pool, key):
    """Inside a capture space of another pool (yielded): ``pool`` was told ``key`` comes
    next, and its preparer holds the job it took for it at the gate, not begun."""
    other = _pool(host, allocator=vmm_core.SharedVMMAllocator(host, tag="other"))
    with other.space("k"):
        pool.expect(key)
        deadline = time.monotonic() + 10
        while not pool._executables._pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pool._executables._pending, "the preparer should hold a job at the gate"
        yield other


def test_a_preparation_not_begun_is_taken_over_by_the_launch_inside_a_capture(host):
    """A capture space (of any pool) holds back the preparer before its driver call; a
    replay of the graph it was about to make takes the work over instead of waiting."""
    pool = _ahead(host, 6)
    model = Model(pool, sizes=(1, 4), layers=3)
    model.step(1)
    before = _settled(pool)
    with _held_at_the_gate(host, pool, 4) as other:
        model.step(4)  # would wait forever for a preparer the capture holds back
    s = _settled(pool)
    assert s["waits"] == before["waits"] and s["prepared_ahead"] == before["prepared_ahead"]
    assert s["misses"] == before["misses"] + 3 and s["instantiations"] == 6
    model.step(4)
    other.close()
    pool.close()


@pytest.mark.parametrize("share", ["off", "when_full"])
def test_a_close_drops_a_preparation_not_begun_and_the_executables_it_took(host, share):
    """A job held at the gate by a capture has already taken its room: evicted
    executables (share off) or the one it would update (shared when full).  Dropping it
    destroys them; nothing of the pool outlives its close."""
    base = _baseline()
    pool = _ahead(host, 6, share=share)
    model = Model(pool, sizes=(1, 2, 4), layers=3)
    for size in (1, 2):
        model.step(size)
    assert _settled(pool)["resident"] == 6
    with _held_at_the_gate(host, pool, 4) as other:
        pool.close()
    assert not pool._executables._pending
    assert host_graph_ops.emulated_device(0).live == base
    other.close()


def test_sleep_waits_for_a_preparation_in_flight_and_leaves_no_executable(host, stall):
    base = _baseline()
    pool, model = _preparing(host, stall, replayed=(1, 2))
    sleeper = threading.Thread(target=vmm_core.sleep, args=("graph",), daemon=True)
    sleeper.start()
    sleeper.join(0.3)
    assert sleeper.is_alive(), "sleep must wait for the driver call in flight"
    stall.go.set()
    sleeper.join(10)
    assert not sleeper.is_alive()
    assert _execs(pool)["resident"] == 0 and _execs(pool)["in_flight"] == 0
    assert host_graph_ops.emulated_device(0).live == base
    vmm_core.wake_up("graph")
    for size in (4, 1, 2):
        model.step(size)
    pool.close()
    assert host_graph_ops.emulated_device(0).live == base


def test_close_waits_for_a_preparation_in_flight_and_leaves_no_executable(host, stall):
    base = _baseline()
    pool, model = _preparing(host, stall)
    closer = threading.Thread(target=pool.close, daemon=True)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close must wait for the driver call in flight"
    stall.go.set()
    closer.join(10)
    assert not closer.is_alive()
    assert host_graph_ops.emulated_device(0).live == base
    with pytest.raises(vmm_core.CaptureError, match="closed"):
        model.step(4)


def test_a_child_forked_while_a_preparation_is_in_flight_replays_without_hanging(host,
                                                                                 stall):
    pool, model = _preparing(host, stall)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child():
        for size in (4, 1, 4):
            model.step(size)  # compared with eager, in the child
        queue.put(_execs(pool)["in_flight"])

    proc = ctx.Process(target=child)
    proc.start()
    join_child(proc, "a replay in a child forked during a preparation in flight")
    assert proc.exitcode == 0 and queue.get(timeout=5) == 0
    stall.go.set()
    _settled(pool)
    model.step(4)
    pool.close()


def test_a_capture_waits_for_a_driver_call_of_the_preparer(host, stall):
    pool, model = _preparing(host, stall)
    other = _pool(host, allocator=vmm_core.SharedVMMAllocator(host, tag="other"))
    entered = threading.Event()

    def capture():
        with other.space("k"):
            entered.set()

    capturer = threading.Thread(target=capture, daemon=True)
    capturer.start()
    assert not entered.wait(0.3), "a capture must not start beside a driver call"
    stall.go.set()
    assert entered.wait(10)
    capturer.join(10)
    _settled(pool)
    model.step(4)
    other.close()
    pool.close()


# ------------------------------------------------------------------ wake, budget, fast path
def test_after_a_lazy_wake_the_keys_resident_at_the_sleep_come_back_in_the_background(host):
    pool = _ahead(host, 6)
    model = Model(pool, sizes=(1, 2, 4), layers=3)
    for size in (4, 1, 2):
        model.step(size)
    before = _settled(pool)
    vmm_core.sleep("graph")
    vmm_core.wake_up("graph")
    s = _settled(pool)
    assert s["resident"] == 6 and s["eager_instantiations"] == 0
    assert s["prepared_ahead"] - before["prepared_ahead"] == 6
    assert _resident(pool, model, 1) == _resident(pool, model, 2) == [True] * 3
    model.step(2)
    model.step(1)
    assert _execs(pool)["misses"] == s["misses"]
    pool.close()


def test_the_budget_holds_on_every_thread_and_nothing_is_captured_again(host, monkeypatch,
                                                                         live_counter):  # noqa: F811
    pool = _ahead(host, 7)
    model = Model(pool, sizes=(1, 2, 3, 4, 8), layers=3)
    captures = [0]
    begin = KeptGraphMixin.capture_begin

    def counted(self, *args, **kwargs):
        captures[0] += 1
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(KeptGraphMixin, "capture_begin", counted)
    rng = random.Random(0)
    trace = [rng.choice(model.sizes) for _ in range(80)]
    for i, size in enumerate(trace):
        model.step(size)
        if i + 1 < len(trace):  # the next key, or a wrong guess a third of the time
            pool.expect(trace[i + 1] if rng.random() < 0.67 else rng.choice(model.sizes))
    s = _settled(pool)
    assert live_counter["max"] <= 7 and s["peak_resident"] <= 7 and captures[0] == 0
    assert s["prepared_ahead"] > 0 and s["update_refused"] == {}
    pool.close()


def test_a_warm_step_launches_without_the_slow_path(host, graphs_passed_to):
    calls = graphs_passed_to(executables_module.ExecutableCache, "launch")
    pool = _pool(host)  # every executable made at capture
    model = Model(pool, sizes=(2,), layers=3)
    model.step(2)
    assert calls == [] and _execs(pool)["hits"] == 3
    # a block of another pool inside the key's: that one is the innermost now, so the
    # graph's replay opens its own key's block again (the slow path)
    plain = _pool(host, False, allocator=vmm_core.SharedVMMAllocator(host, tag="plain"))
    with plain.space("p"):
        plain_graph = plain.new_graph()
        plain.capture(plain_graph, lambda: torch.zeros(1))
    x = torch.randn(2, model.weights[0].shape[0])
    with pool.replaying(2):
        model.static[2].copy_(x)
        with plain.replaying("p"):
            model.graphs[2][0].replay()
        for g in model.graphs[2][1:]:
            g.replay()
    torch.testing.assert_close(model.outputs[2], model.eager(x))
    assert calls == [model.graphs[2][0]]
    plain.close()
    pool.close()


def test_a_hint_without_preparation_ahead_changes_nothing(host):
    pool = _pool(host, ExecutablePolicy(max_count=3, ahead=False))
    model = Model(pool, sizes=(1, 2), layers=3)
    model.step(1)
    pool.expect(2)
    s = _settled(pool)
    assert s["hints"] == 1 and s["prepared_ahead"] == 0 and s["policy"]["ahead"] is False
    assert _resident(pool, model, 2) == [False] * 3
    assert vmm_core.GraphPool(backend=host, reads=(), executables=False).settle(0)
    pool.close()


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_ahead_must_be_none_or_a_bool(value):
    with pytest.raises(ValueError, match=r"ahead=...\) must be None \(ahead under a "
                                         r"budget\), True or False"):
        ExecutablePolicy(max_count=4, ahead=value)


def test_ahead_is_the_default_under_a_budget_only():
    assert ExecutablePolicy(max_count=4).prepares_ahead
    assert ExecutablePolicy(max_bytes=1 << 20).prepares_ahead
    assert not ExecutablePolicy().prepares_ahead
    assert ExecutablePolicy(ahead=True).prepares_ahead


def test_a_launch_outside_a_block_is_a_use_of_its_key_but_not_a_step(host):
    """``g.replay()`` with no block of its key open opens one for the launch: the key is
    used (its executables are not the first to go), but the forecast counts steps, and a
    launch per piece is not one."""
    pool = _ahead(host, 6)
    model = Model(pool, sizes=(1, 2), layers=3)
    model.step(1)
    before = _settled(pool)
    observed = pool._executables._forecast.step
    g, w = model.graphs[2][0], model.weights[0]
    for _ in range(4):
        x = torch.randn(2, w.shape[0])
        model.static[2].copy_(x)
        g.replay()
        torch.testing.assert_close(g.outputs, torch.tanh(x @ w))
    s = _settled(pool)
    assert s["blocks"] == before["blocks"] and s["cold_blocks"] == before["cold_blocks"]
    assert pool._executables._forecast.step == observed
    slot = g._vmm_slot
    assert slot.uses == 4 and slot.last_use > model.graphs[1][0]._vmm_slot.last_use
    pool.close()


# ------------------------------------------------------------------ beside a step
def _prepared_by_the_thread(stall) -> list:
    return [token for name, token in stall.calls if name == PREPARER]


def _two_pools(host, sizes):
    """A pool of two keys' budget (``sizes`` captured, each replayed once) and another
    pool of its own tag with one key, replayed once."""
    pool = _ahead(host, 6)
    model = Model(pool, sizes=sizes, layers=3)
    other = _pool(host, ExecutablePolicy(max_count=3, ahead=True), tag="other")
    beside = Model(other, sizes=(1,), layers=3, seed=1)
    for size in (1, 2):
        model.step(size)
    beside.step(1)
    return pool, model, other, beside


@pytest.mark.parametrize("blocked_in", ["the same pool", "another pool"])
def test_nothing_but_the_open_blocks_keys_is_prepared_while_a_block_is_open(
        host, stall, blocked_in):
    """A hint given while a step launches (any pool's replay block open) is prepared
    when the block ends, not beside the launches; then before its own block."""
    pool, model, other, beside = _two_pools(host, (1, 2, 4))
    before = _settled(pool)
    stall.calls.clear()
    step = (model if blocked_in == "the same pool" else beside)
    with step.pool.replaying(1):  # every executable of key 1 resident: a warm step
        for g in step.graphs[1]:
            g.replay()
        pool.expect(4)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and not _prepared_by_the_thread(stall):
            time.sleep(0.01)
        assert _prepared_by_the_thread(stall) == []
        assert _execs(pool)["prepared_ahead"] == before["prepared_ahead"]
    after = _settled(pool)
    assert sorted(_prepared_by_the_thread(stall)) == \
        sorted(g._vmm_token for g in model.graphs[4])
    assert after["prepared_ahead"] - before["prepared_ahead"] == 3
    model.step(4)
    assert _execs(pool)["misses"] == after["misses"]
    other.close()
    pool.close()


def test_a_cold_blocks_own_pieces_are_still_prepared_while_it_is_open(host, stall):
    """The block's own key is what the step launches next: the preparer makes its
    pieces while the block is open (the step waits at most for its first)."""
    pool = _ahead(host, 3)
    model = Model(pool, sizes=(1, 2), layers=3)
    model.step(1)
    _settled(pool)
    stall.calls.clear()
    stall.armed = True
    with pool.replaying(2):  # key 2 has no executable: the preparer starts on it
        assert stall.inside.wait(10)
        stall.go.set()
        for g in model.graphs[2]:
            g.replay()
    s = _settled(pool)
    assert _prepared_by_the_thread(stall)[0] == model.graphs[2][0]._vmm_token
    assert s["prepared_ahead"] >= 1 and _resident(pool, model, 2) == [True] * 3
    pool.close()


def test_keys_woken_beside_another_pools_step_are_made_when_it_ends(host, stall):
    """Two graph families in two pools: the family the trace does not replay comes back
    after a wake in the background, but not beside the other family's launches."""
    pool, model, other, beside = _two_pools(host, (1, 2))
    before = _settled(pool)
    vmm_core.sleep("graph")
    stall.calls.clear()
    with other.replaying(1):
        vmm_core.wake_up("graph")  # lazy: keys 1 and 2 are made again in the background
        for g in beside.graphs[1]:
            g.replay()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and not _prepared_by_the_thread(stall):
            time.sleep(0.01)
        assert _prepared_by_the_thread(stall) == []
    s = _settled(pool)
    assert len(_prepared_by_the_thread(stall)) == 6
    assert s["prepared_ahead"] - before["prepared_ahead"] == 6 and s["resident"] == 6
    model.step(2)
    model.step(1)
    assert _execs(pool)["misses"] == s["misses"]
    other.close()
    pool.close()


def test_a_key_prepared_ahead_is_uploaded_with_one_wait_and_no_launch_pays_an_upload(host):
    """The preparer makes a key's graphs, uploads them together and waits once; the
    step launching them then pays no upload.  Served inline, each miss's first launch
    pays it."""
    device = host_graph_ops.emulated_device(0)
    pool = _ahead(host, 6, share="off")
    model = Model(pool, sizes=(1, 2, 4), layers=3)
    model.step(1)
    model.step(2)
    _settled(pool)
    cold, waits, uploads = device.cold_launches, device.upload_waits, device.uploads
    pool.expect(4)
    _settled(pool)
    assert device.uploads - uploads == 3 and device.upload_waits - waits == 1
    model.step(4)
    assert device.cold_launches == cold
    pool.close()

    inline = _pool(host, ExecutablePolicy(max_count=3, ahead=False))
    model = Model(inline, sizes=(1, 2), layers=3)
    cold, uploads = device.cold_launches, device.uploads
    for size in (1, 2, 1):
        model.step(size)
    assert _execs(inline)["misses"] == 9 == device.cold_launches - cold
    assert device.uploads == uploads
    inline.close()


def test_a_block_opening_ends_the_preparers_batch_at_the_graph_in_flight(host, stall):
    """Key 4's three pieces are one batch; a step of key 1 begins while the first is
    being made: that one is finished and uploaded, the other two given back (the step
    of another key than the one named also drops the hint: they wait for their own)."""
    device = host_graph_ops.emulated_device(0)
    pool, model = _preparing(host, stall)  # key 1 resident, room for key 4 free
    first = stall.calls[-1][1]
    with pool.replaying(1):  # every executable of key 1 resident
        stall.go.set()
        for g in model.graphs[1]:
            g.replay()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _execs(pool)["in_flight"]:
            time.sleep(0.01)
        assert _execs(pool)["in_flight"] == 0
    s = _settled(pool)
    fours = {g._vmm_token for g in model.graphs[4]}
    assert [t for t in _prepared_by_the_thread(stall) if t in fours] == [first]
    assert _resident(pool, model, 4) == [True, False, False]
    cold = device.cold_launches
    model.step(4)  # its other two pieces are made now, inline or by the thread
    after = _execs(pool)
    assert after["hits"] + after["misses"] - s["hits"] - s["misses"] == 3
    assert after["misses"] - s["misses"] <= 2
    assert device.cold_launches - cold <= 2  # the piece made ahead was uploaded then
    pool.close()


# ------------------------------------------------------------------ updated, then remade
@pytest.mark.parametrize("slower", [True, False])
def test_updated_executables_are_made_again_from_their_graphs_when_the_thread_is_idle(
        host, live_counter, monkeypatch, slower):  # noqa: F811 - the fixture imported above
    """Sharing when full, ahead: the expected key's graphs take executables of the key
    given up by update (fast to make), then, with nothing else to do, the thread makes
    each again from its own graph (an updated executable runs slower on CUDA, launch
    after launch), destroying the updated one first: the budget holds, and the step
    launches no updated executable.  A backend whose updated executables run as fast
    keeps them."""
    monkeypatch.setattr(host_graph_ops.HostExecutables, "updated_runs_slower", slower)
    device = host_graph_ops.emulated_device(0)
    pool = _ahead(host, 6, share="when_full")
    model = Model(pool, sizes=(1, 2, 4), layers=3)
    model.step(1)
    model.step(2)
    before = _settled(pool)
    pool.expect(4)
    s = _settled(pool)
    assert s["updates"] - before["updates"] == 3
    assert s["remade"] - before["remade"] == (3 if slower else 0)
    assert s["resident_updated"] == (0 if slower else 3) and s["resident"] == 6
    assert live_counter["max"] <= 6
    updated = device.updated_launches
    model.step(4)
    assert device.updated_launches - updated == (0 if slower else 3)
    assert _execs(pool)["misses"] == s["misses"]
    pool.close()


@pytest.mark.parametrize("ahead", [True, False])
def test_by_default_a_budget_instantiates_on_a_miss_and_never_updates(host, ahead):
    pool = _pool(host, ExecutablePolicy(max_count=3, ahead=ahead))
    assert _execs(pool)["policy"]["share"] == "off"
    model = Model(pool, sizes=(1, 2), layers=3)
    for size in (1, 2, 1):
        model.step(size)
        pool.settle(10)
    s = _execs(pool)
    assert s["updates"] == 0 and s["remade"] == 0
    assert s["instantiations"] >= 9 and s["peak_resident"] <= 3  # ahead, bets made too
    pool.close()


def _remaking(host, monkeypatch, stall, layers=3):
    """A pool sharing when full whose key 4 was updated into the budget (keys 1 and 2
    replayed first, ``layers`` pieces each) while updated executables ran as fast; then
    they run slower, and the thread is inside the remake of key 4's last piece, the
    others not begun (``stall.go`` lets it go on)."""
    cls = host_graph_ops.HostExecutables
    monkeypatch.setattr(cls, "updated_runs_slower", False)
    pool = _ahead(host, 2 * layers, share="when_full")
    model = Model(pool, sizes=(1, 2, 4), layers=layers)
    model.step(1)
    model.step(2)
    pool.expect(4)
    before = _settled(pool)
    assert before["resident_updated"] == layers
    monkeypatch.setattr(cls, "updated_runs_slower", True)
    stall.armed = True
    with pool._executables._lock:
        pool._executables._wake_worker()
    assert stall.inside.wait(10)
    return pool, model, before


def _sleep_past(stall) -> None:
    """``vmm_core.sleep`` on another thread, begun while the thread's driver call is held,
    which is then let go; returns once the sleep has ended."""
    sleeper = threading.Thread(target=vmm_core.sleep, args=("graph",))
    sleeper.start()
    time.sleep(0.05)
    stall.go.set()
    sleeper.join(30)
    assert not sleeper.is_alive()


def test_a_remake_not_begun_gives_way_to_the_step_that_launches_its_graph(host, monkeypatch,
                                                                            stall):
    """Key 4 was updated into the budget; its remakes are one batch, the first (its last
    piece) in flight when a step of key 4 opens.  The others are not begun: the step
    launches their updated executables at once rather than waiting for a remake, and
    waits at most for the one in flight; the rest are remade once the step ends."""
    device = host_graph_ops.emulated_device(0)
    pool, model, before = _remaking(host, monkeypatch, stall)
    updated = device.updated_launches
    with pool.replaying(4):
        stall.go.set()
        for g in model.graphs[4]:
            g.replay()
        torch.testing.assert_close(model.outputs[4], model.eager(model.static[4]))
    during = _execs(pool)
    assert during["misses"] - before["misses"] <= 1  # the piece in flight, if still
    assert device.updated_launches - updated == 2  # the other two, as they were
    after = _settled(pool)
    assert after["remade"] - before["remade"] == 3 and after["resident_updated"] == 0
    model.step(4)
    assert _execs(pool)["misses"] == during["misses"]
    pool.close()


def test_a_sleep_while_updated_executables_are_remade_leaves_none_alive(host, monkeypatch,
                                                                       stall):
    device = host_graph_ops.emulated_device(0)
    base = _baseline()
    pool, model, _ = _remaking(host, monkeypatch, stall)
    _sleep_past(stall)
    assert device.live == base
    vmm_core.wake_up("graph")
    for size in (4, 1):
        model.step(size)
    pool.close()
    assert device.live == base


def test_a_graph_reset_while_its_remake_waits_leaves_no_executable_behind(host, monkeypatch,
                                                                          stall):
    """Key 4's first piece is reset while its remake waits behind the one in flight: the
    remake goes on (it was claimed), its new executable is destroyed at install, and the
    count of executables alive stays that of the graphs that have one."""
    device = host_graph_ops.emulated_device(0)
    base = _baseline()
    pool, model, _ = _remaking(host, monkeypatch, stall)
    first = model.graphs[4][0]
    first.reset()
    stall.go.set()
    s = _settled(pool)
    assert not pool._executables.is_resident(first)
    assert s["resident"] == 5 and device.live - base == 5 and s["in_flight"] == 0
    model.step(1)  # the other keys are exact still
    pool.close()
    assert device.live == base


def test_an_eager_wake_makes_again_the_graphs_whose_remake_the_sleep_cut(host, monkeypatch,
                                                                         stall):
    """Key 4's three graphs had updated executables at the sleep, their remakes under
    way: they count among those resident then, and an eager wake makes them again."""
    pool, model, _ = _remaking(host, monkeypatch, stall)
    _sleep_past(stall)
    assert _execs(pool)["last_sleep"]["executables"] == 6
    vmm_core.wake_up("graph", eager=True)
    assert _resident(pool, model, 4) == [True] * 3 and _resident(pool, model, 2) == [True] * 3
    s = _execs(pool)
    model.step(4)
    assert _execs(pool)["misses"] == s["misses"]
    pool.close()


def test_no_remake_begins_once_a_sleep_has_begun(host, monkeypatch, stall):
    """Ten updated executables, more than one batch: a sleep while the first remake runs
    waits for that call only; the thread begins none of the others."""
    pool, _, _ = _remaking(host, monkeypatch, stall, layers=10)
    calls = len(stall.calls)
    _sleep_past(stall)
    assert [c for c in stall.calls[calls:] if c[0] == PREPARER] == []
    pool.close()


def test_a_step_inside_a_capture_space_takes_room_from_remakes_held_at_its_gate(
        host, monkeypatch):
    """Every resident executable updated (keys 4 and 8), their remakes claimed in one
    batch while a capture space on this thread holds the pool's thread at the gate: a
    step of key 1 needs room that only those remakes hold.  It cancels them (they were
    not begun) and goes on, where waiting for the thread would wait for good."""
    cls = host_graph_ops.HostExecutables
    monkeypatch.setattr(cls, "updated_runs_slower", False)
    pool = _ahead(host, 6, share="when_full")
    model = Model(pool, sizes=(1, 2, 4, 8), layers=3)
    for size in (1, 2):
        model.step(size)
    pool.expect(4)
    _settled(pool)
    model.step(4)
    pool.expect(8)
    assert _settled(pool)["resident_updated"] == 6
    monkeypatch.setattr(cls, "updated_runs_slower", True)
    other = _pool(host, allocator=vmm_core.SharedVMMAllocator(host, tag="other"))
    done = threading.Event()

    def capture_then_step():
        with other.space("k"):  # preparers wait at the gate until it ends
            cache = pool._executables
            with cache._lock:
                cache._wake_worker()
            deadline = time.monotonic() + 5
            while len(cache._pending) < 6 and time.monotonic() < deadline:
                time.sleep(0.001)
            model.step(1)  # exact (Model.step compares with eager)
            done.set()

    thread = threading.Thread(target=capture_then_step, daemon=True)
    thread.start()
    thread.join(20)
    assert done.is_set(), "the step waited for a thread held at its own capture's gate"
    s = _settled(pool)
    assert s["resident"] <= 6 and s["in_flight"] == 0
    pool.close()
    other.close()


@pytest.mark.parametrize("error", [RuntimeError("can't start new thread"), MemoryError()],
                         ids=lambda e: type(e).__name__)
def test_a_preparer_that_cannot_start_leaves_every_miss_to_the_step(host, monkeypatch,
                                                                   caplog, error):
    """Where the process may start no more threads, a hint, a block's opening or an
    install that woke the preparer raised the start's error out of the engine's call
    (an install left half done), and the preparer, recorded as running, never ran
    again: now each step serves its misses itself, the preparer starts once it can, and
    every replay matches eager."""
    refuse = [True]
    real_start = threading.Thread.start

    def start(thread):
        if refuse[0] and thread.name == PREPARER:
            raise error
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    pool = _ahead(host, 6, share="when_full")
    model = Model(pool, sizes=(1, 2, 4, 8), layers=3)
    for size in (1, 2, 4, 8, 1, 4):
        pool.expect(size)
        model.step(size)
    s = _execs(pool)
    assert s["prepared_ahead"] == 0 and s["misses"] >= 18
    assert s["resident"] <= 6
    said = [r for r in caplog.records if "no thread could start" in r.getMessage()]
    assert len(said) == 1, said
    refuse[0] = False
    model.step(2)
    before = _settled(pool)
    pool.expect(8)
    after = _settled(pool)
    assert after["prepared_ahead"] - before["prepared_ahead"] == 3  # the hint's key
    model.step(8)
    assert _execs(pool)["misses"] == after["misses"]
    pool.close()
