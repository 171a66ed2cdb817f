"""A key's space made during the warmup before its capture (``GraphPool.warmup(fn, key)``),
on the host backend's real memfd pages: the capture that follows enters it, allocates in
it and aliases the other keys' pages, and the preparation stays out of the way wherever
making a space now would be wrong."""

from __future__ import annotations

import pytest
import torch
from host_space import framework_alloc, read, write

import vmm_core
from vmm_core.errors import CaptureError, CaptureEscapeError, SleepStateError
from vmm_core.graphs.capture_space import open_spaces

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


def _switches(pool) -> int:
    return len(pool.allocator.switch_seconds)


def _space_range(pool, key) -> tuple[int, int]:
    space = pool.allocator._space(pool._spaces[key].index)
    return space.base, space.base + space.size


def test_the_warmup_makes_the_keys_space_and_the_capture_enters_it(host):
    pool = vmm_core.GraphPool(backend=host)
    ran = []
    addresses = {}
    for key in ("a", "b", "c"):
        before = _switches(pool)
        pool.warmup(lambda key=key: ran.append(key), key=key)
        assert key in pool.keys, "the warmup made the key's space"
        made = _switches(pool)
        assert made <= before + 1
        with pool.space(key):
            addresses[key] = framework_alloc(2 * MiB)
            pool.keep(addresses[key])
        assert _switches(pool) == made, "the capture entered the space the warmup made"
        low, high = _space_range(pool, key)
        assert low <= addresses[key] < high, "the capture allocated in its key's space"
    assert ran == ["a", "b", "c"]
    assert len(set(addresses.values())) == 3
    payload = bytes(range(256)) * 8
    write(addresses["b"], payload)
    for address in addresses.values():  # one set of pages through three ranges
        assert read(address, len(payload)) == payload
    stats = pool.stats()
    assert stats["virtual_spaces"] == 3 and stats["physical_bytes"] == 2 * MiB
    pool.close()


def test_a_warmup_of_a_key_with_a_space_makes_nothing(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        pool.keep(framework_alloc(MiB))
    with pool.space(2):
        pool.keep(framework_alloc(MiB))
    before = (_switches(pool), pool.allocator.current_space)
    pool.warmup(lambda: None, key=1)
    assert (_switches(pool), pool.allocator.current_space) == before
    pool.close()


def test_no_space_is_made_while_a_space_of_the_allocator_is_open_on_this_thread(host):
    pool = vmm_core.GraphPool(backend=host)
    other = vmm_core.GraphPool(backend=host, allocator=pool.allocator)
    with pool.space("open"):
        first = framework_alloc(MiB)
        pool.warmup(lambda: None, key="next")
        other.warmup(lambda: None, key="next")
        assert "next" not in pool.keys and "next" not in other.keys
        second = framework_alloc(MiB)  # still in the open key's space
        low, high = _space_range(pool, "open")
        assert low <= first < high and low <= second < high
        pool.keep(first, second)
        assert len(open_spaces()) == 1
    pool.close()
    other.close()


def test_no_space_is_made_while_the_pool_sleeps_and_the_capture_still_says_why(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        pool.keep(framework_alloc(MiB))
    vmm_core.sleep("graph")
    ran = []
    pool.warmup(lambda: ran.append(1), key=2)
    assert ran == [1] and 2 not in pool.keys
    with pytest.raises(SleepStateError, match=r"wake_up\('graph'\)"):
        with pool.space(2):
            pass
    vmm_core.wake_up("graph")
    pool.warmup(lambda: None, key=2)
    assert 2 in pool.keys
    pool.close()


def _escape(pool):
    with pytest.raises(CaptureEscapeError):
        with pool.space(1):
            framework_alloc(MiB)  # not kept: escapes


def _fail_leaving_a_block(pool):
    with pytest.raises(ZeroDivisionError):
        with pool.space(1):
            framework_alloc(MiB)  # a workspace made before the capture failed
            1 / 0


@pytest.mark.parametrize("poison, error, match", [
    (_escape, CaptureError, "unusable"),
    # the first refusal is the escape itself: the warm-up must not consume it
    (_fail_leaving_a_block, CaptureEscapeError, "failed capture into the space of 1")])
def test_a_pool_refusing_work_makes_no_space_and_its_capture_says_why(host, poison, error,
                                                                      match):
    pool = vmm_core.GraphPool(backend=host)
    poison(pool)
    pool.warmup(lambda: None, key=2)
    assert 2 not in pool.keys
    with pytest.raises(error, match=match):
        with pool.space(2):
            pass


def test_a_closed_pool_warms_up_without_a_space(host):
    pool = vmm_core.GraphPool(backend=host)
    pool.close()
    ran = []
    pool.warmup(lambda: ran.append(1), key="k")
    assert ran == [1] and "k" not in pool.keys


def test_an_unhashable_key_is_refused_as_space_refuses_it(host):
    pool = vmm_core.GraphPool(backend=host)
    with pytest.raises(TypeError, match="unhashable"):
        pool.warmup(lambda: None, key=[1, 2])
    pool.close()


def test_the_executor_makes_each_new_buckets_space_in_its_warmup(host, monkeypatch,
                                                                 warns_unrouted):
    w = torch.randn(8, 8, dtype=torch.float64)
    ex = vmm_core.GraphExecutor(lambda x: (x - x.sum(0, keepdim=True)) @ w,
                                torch.zeros(32, 8, dtype=torch.float64), backend=host)
    alloc, pool = ex.allocator, ex.pool
    entering, where = [], []
    real_switch, real_enter = alloc.switch_to_new_virtual_space, pool._enter

    def enter(*args):
        entering.append(1)
        try:
            return real_enter(*args)
        finally:
            entering.pop()

    monkeypatch.setattr(pool, "_enter", enter)
    monkeypatch.setattr(alloc, "switch_to_new_virtual_space",
                        lambda: where.append(len(entering)) or real_switch())
    with warns_unrouted(host):  # the CPU allocator's tensors stay outside the spaces
        for n in (3, 32, 17, 1, 3):
            x = torch.randn(n, 8, dtype=torch.float64)
            torch.testing.assert_close(ex(x), (x - x.sum(0, keepdim=True)) @ w)
    assert ex.captured_buckets == [1, 4, 32]
    assert where and all(n == 0 for n in where), \
        "every switch happened in a warmup, none on entering a capture space"
    assert ex.stats()["virtual_spaces"] == 3
    ex.close()


def test_a_prepared_space_does_not_take_the_last_keys_place_at_a_lazy_wake(host):
    """A lazy wake maps only the allocator's current space: that stays the space of the
    key captured last, whose kept tensor is read here after the wake."""
    pool = vmm_core.GraphPool(backend=host)
    with pool.space("A"):
        a = framework_alloc(MiB)
        pool.keep(a)
    write(a, b"A-data")
    current = pool.allocator.current_space
    pool.warmup(lambda: None, key="B")
    assert "B" in pool.keys and pool.allocator.current_space == current
    vmm_core.sleep("graph", offload="graph")
    vmm_core.wake_up("graph")
    assert read(a, 6) == b"A-data"
    with pool.space("B"):  # the prepared space is entered, and allocates in it
        b = framework_alloc(MiB)
        pool.keep(b)
    low, high = _space_range(pool, "B")
    assert low <= b < high
    assert read(b, 6) == b"A-data", "B's range maps the same pages"
    pool.close()


def test_a_prepared_key_never_captured_is_refused_with_why(host):
    pool = vmm_core.GraphPool(backend=host)
    pool.warmup(lambda: None, key="never")
    with pytest.raises(CaptureError, match=r"made by warmup\(fn, key\); nothing was captured"):
        pool.before_replay("never")
    pool.close()


def test_a_pool_whose_warmup_takes_no_key_still_runs_the_executor(host, warns_unrouted):
    class OwnPool:
        """A runner's pool written against the interface's warmup(fn)."""

        def __init__(self):
            self._pool = vmm_core.GraphPool(backend=host)
            self.warmed = 0

        def __getattr__(self, name):
            return getattr(self._pool, name)

        def warmup(self, fn):
            self.warmed += 1
            self._pool.warmup(fn)

    class Forwarding:
        """A proxy whose warmup forwards **kwargs to a warmup(fn)."""

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def warmup(self, fn, **kwargs):
            self._inner.warmup(fn, **kwargs)

    for pool in (OwnPool(), Forwarding(OwnPool())):
        ex = vmm_core.GraphExecutor(lambda x: x * 2, torch.zeros(8, 4), pool=pool)
        with warns_unrouted(host):
            x = torch.randn(3, 4)
            torch.testing.assert_close(ex(x), x * 2)
        assert pool.warmed == 1
        pool._pool.close()


def test_a_backend_that_overrides_warmup_keeps_it_when_a_space_is_prepared():
    """A vendor's GraphOps built on TorchStreamGraphOps with its own warmup: the pool's
    overlapping warmup runs that warmup, then the preparation."""
    import contextlib
    import types

    from vmm_core.plugin import TorchStreamGraphOps

    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    module = types.SimpleNamespace(Stream=lambda device=None: Stream(),
                                   current_stream=lambda device=None: Stream(),
                                   stream=lambda s: contextlib.nullcontext())
    calls = []

    class Plain(TorchStreamGraphOps):
        def module(self):
            return module

        def new_graph(self, keep=False):
            raise NotImplementedError

        def capture(self, graph, fn, pool_handle):
            raise NotImplementedError

    class Own(Plain):
        def warmup(self, fn):
            calls.append("own warmup")
            fn()

    for abstract in getattr(Plain, "__abstractmethods__", ()):
        setattr(Plain, abstract, lambda self, *a, **k: None)
    Plain.__abstractmethods__ = Own.__abstractmethods__ = frozenset()
    Own(0).warmup_overlapping(lambda: calls.append("fn"), lambda: calls.append("meanwhile"))
    assert calls == ["own warmup", "fn", "meanwhile"]
    calls.clear()
    replaced = Plain(0)
    replaced.warmup = lambda fn: (calls.append("instance warmup"), fn())
    replaced.warmup_overlapping(lambda: calls.append("fn"), lambda: calls.append("meanwhile"))
    assert calls == ["instance warmup", "fn", "meanwhile"]
    calls.clear()
    Plain(0).warmup_overlapping(lambda: calls.append("fn"), lambda: calls.append("meanwhile"))
    assert calls == ["fn", "meanwhile"]


def test_a_keyed_warmup_waits_for_another_threads_capture_space(host):
    """The warm-up runs on the capture stream another thread may be capturing on: with a
    key it holds the pool's locks, so it starts once that space is left."""
    import threading

    pool = vmm_core.GraphPool(backend=host)
    order = []
    entered, leave = threading.Event(), threading.Event()

    def capture():
        with pool.space("open"):
            pool.keep(framework_alloc(MiB))
            entered.set()
            leave.wait(10)
            order.append("capture ends")

    other = threading.Thread(target=capture)
    other.start()
    assert entered.wait(10)
    warm = threading.Thread(target=lambda: pool.warmup(lambda: order.append("warmup"),
                                                       key="next"))
    warm.start()
    warm.join(0.3)
    assert order == [] and warm.is_alive(), "the warm-up waited for the open space"
    leave.set()
    other.join(10)
    warm.join(10)
    assert order == ["capture ends", "warmup"] and "next" in pool.keys
    pool.close()
