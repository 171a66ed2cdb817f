"""The executable-cache experiment's bookkeeping on the CPU (its runs need a GPU).

A fake stands in for the CUDA graph ops' executables(), so what is checked here
is the policy: at most ``budget / per_graph`` executables alive, the least recently
launched dropped first, a launch always preceded by an instantiate of that graph.
"""

from __future__ import annotations

import collections

import pytest

from vmm_core.bench import exec_cache, report


class _Graph:
    def __init__(self, name) -> None:
        self.name = name


class _FakeExecutables:
    """The interface of the graph ops' ``executables()``, on names instead of graphs."""

    def __init__(self) -> None:
        self.alive: dict = {}
        self.launched: list = []
        self.next = 1
        self.refuse: dict = {}

    def instantiate(self, graph):
        handle = self.next
        self.alive[handle] = graph.name
        self.next += 1
        return handle

    def launch(self, handle, stream):
        self.launched.append(self.alive[handle])

    def destroy(self, handle):
        del self.alive[handle]

    def update(self, handle, graph):
        """Refuse graphs named in ``refuse`` (with that reason), else retarget."""
        reason = self.refuse.get(graph.name)
        if reason is None:
            self.alive[handle] = graph.name
        return reason


def test_the_cache_keeps_at_most_the_budget_and_drops_the_least_recently_launched():
    driver = _FakeExecutables()
    cache = exec_cache._ExecCache(driver, budget=300, per_graph=100)
    graphs = {k: _Graph(k) for k in "abcde"}
    for key in "abcab":
        cache.launch(key, graphs[key], stream=0)
    assert (cache.misses, cache.hits, cache.evictions) == (3, 2, 0)
    cache.launch("d", graphs["d"], stream=0)  # over budget: c is the least recent
    assert sorted(driver.alive.values()) == ["a", "b", "d"] and cache.evictions == 1
    cache.launch("c", graphs["c"], stream=0)  # a miss again, a goes
    assert sorted(driver.alive.values()) == ["b", "c", "d"]
    assert driver.launched == list("abcabdc")  # every request launched its own graph
    cache.close()
    assert driver.alive == {}


def test_the_request_trace_is_skewed_reproducible_and_covers_only_the_sizes():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    trace = exec_cache.request_trace(sizes, 4000, seed=1)
    assert trace == exec_cache.request_trace(sizes, 4000, seed=1)
    counts = collections.Counter(trace)
    assert set(counts) <= set(sizes)
    hot, cold = counts.most_common()[0][1], counts.most_common()[-1][1]
    assert hot > 4 * cold  # weight 1 against 1/8


def test_the_headline_reports_executables_measured_by_instantiation():
    MiB = 1 << 20
    rows = [{"strategy": s, "order": "ascending", "graphs": 10, "graph_bytes": g * MiB,
             "wrong_graphs": [], "exec_bytes_per_graph": e}
            for s, g, e in (("alone", 10, 200 * 1024), ("vmm", 20, 260 * 1024),
                            ("vllm", 30, None))]
    text = " ".join(report.headline(rows, model="m", shared=("vllm",)))
    assert "measured 200 KiB to 260 KiB per graph executable over 2 configuration(s)" in text
    assert "executable_measured" not in report.summary(rows[2:], shared=("vllm",))


@pytest.mark.parametrize("budget, kept", [(100, 1), (250, 2)])
def test_the_cache_always_keeps_the_graph_it_just_launched(budget, kept):
    driver = _FakeExecutables()
    cache = exec_cache._ExecCache(driver, budget=budget, per_graph=100)
    for key in "abcd":
        cache.launch(key, _Graph(key), stream=0)
    assert len(driver.alive) == kept and "d" in driver.alive.values()


@pytest.mark.parametrize("budget", [100, 250])
def test_the_timed_replays_launch_only_executables_the_budget_keeps(budget):
    """The budget run's replay time is the hot path a miss delays: the timed requests are
    of the most requested size only, so the second pass over them never misses, even in
    a cache that holds one executable."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    trace = exec_cache.request_trace(sizes, 2000, seed=3)
    driver = _FakeExecutables()
    cache = exec_cache._ExecCache(driver, budget=budget, per_graph=100)
    hot = exec_cache.hot_requests(trace)
    top = collections.Counter(trace).most_common(1)[0][0]
    assert len(hot) == 50 and set(hot) == {top}
    for s in hot:
        cache.launch(s, _Graph(s), stream=0)
    misses = cache.misses
    for s in hot:
        cache.launch(s, _Graph(s), stream=0)
    assert cache.misses == misses
    assert exec_cache.hot_requests([3, 5, 5], n=50) == [5, 5]  # at most what the trace has


def test_one_updated_executable_runs_the_requested_graph_and_replaces_a_refused_one():
    fake = _FakeExecutables()
    fake.refuse = {"c": "topology changed"}
    one = exec_cache._OneExecutable(fake)
    for key in "aabacb":
        one.launch(key, _Graph(key), stream=0)
        assert len(fake.alive) == 1  # one executable at any time
    assert fake.launched == list("aabacb")  # every launch ran the graph asked for
    # a: instantiated; b, a: updated; c: refused, so made anew; b: updated from c's
    assert (one.updates, len(one.instantiate_s)) == (3, 2)
    assert one.refused == {"topology changed": 1}
    one.close()
    assert fake.alive == {}


def test_the_exec_cache_table_prints_the_updated_executable(capsys):
    rows = [dict(strategy=s, exec_bytes_per_graph=200 * 1024, used_bytes_after_trace=u,
                 trace_s=t, replay_us=30.0, wrong_graphs=[], instantiate_us_median=900,
                 instantiate_us_max=1500)
            for s, u, t in (("all", 300 << 20, 1.0), ("update", 200 << 20, 1.5))]
    rows[1].update(updates=40, refused={"function changed": 2}, instantiations=3,
                   update_us_median=120.0, update_us_max=400.0, replay_size=8)
    exec_cache.print_exec_cache(rows)
    text = capsys.readouterr().out
    assert "replay 30.0 us (size ?)" in text and "replay 30.0 us (size 8)" in text
    assert "40 updates (median 120 us, max 400 us), refused: 2 function changed, " \
           "3 instantiations" in text
    assert "one updated executable saves 100 MiB; the trace takes 1.50x as long" in text


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [1, 2], [8]])
def test_every_size_checked_against_eager_runs_an_updated_executable(sizes):
    """The update configuration's check against eager must exercise updates: served in
    check_order, each checked size (the smallest too) is a size change of an executable
    that already exists, so its launch follows a driver update, not an instantiation."""
    fake = _FakeExecutables()
    one = exec_cache._OneExecutable(fake)
    unchecked, checked = exec_cache.check_order(sizes, "update")
    assert sorted(checked) == sorted(sizes)  # every size checked once
    for s in unchecked:
        one.launch(s, _Graph(s), stream=0)
    made = len(one.instantiate_s)
    for s in checked:
        updates = one.updates
        one.launch(s, _Graph(s), stream=0)
        if len(sizes) > 1:
            assert one.updates == updates + 1, f"size {s} was not served by an update"
    if len(sizes) > 1:
        assert len(one.instantiate_s) == made
    assert fake.launched[-len(checked):] == checked  # each check ran its own graph
    assert exec_cache.check_order(sizes, "all") == ([], list(sizes))
