"""What a new user meets first on the host backend: errors that name the remedy at the
level they work at, a region that says when framework tensors are not routed, one rule
for the tags sleep and wake accept, and log lines in readable units."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import vmm_core
from vmm_core.errors import CaptureError, SleepStateError, VMMError, VMMFallbackWarning
from vmm_core.memory import routing, tagged

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


def test_a_closed_executor_names_the_executor_not_its_pool(host):
    ex = vmm_core.GraphExecutor(lambda x: x * 2, torch.zeros(4, 2), backend=host)
    ex(torch.ones(2, 2))
    ex.close()
    with pytest.raises(CaptureError, match=r"this GraphExecutor was closed \(close\(\)\); "
                                           r"create a new one") as info:
        ex(torch.ones(2, 2))
    assert "pool" not in str(info.value)


def test_a_sleeping_graph_pool_names_wake_up_of_its_tag(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        pool.keep(routing.current_target(0).allocate(MiB))
    vmm_core.sleep("graph")
    try:
        with pytest.raises(SleepStateError) as info:
            pool.allocator.switch_to_new_virtual_space()
        assert "vmm_core.wake_up('graph')" in str(info.value)
        assert "call wake()" not in str(info.value)
    finally:
        vmm_core.wake_up("graph")
        pool.close()


def test_reservation_error_names_public_remedies(host):
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=4 * MiB)
    try:
        with pytest.raises(VMMError) as info:
            alloc.allocate(8 * MiB)
        assert "SharedVMMAllocator with a larger reserve_bytes" in str(info.value)
        assert "switch_to_new_virtual_space() first" not in str(info.value)
    finally:
        alloc.close()


def test_an_empty_region_on_the_host_warns_once_that_tensors_are_not_routed(host, monkeypatch):
    monkeypatch.setattr(tagged, "_warned_unrouted", set())
    with pytest.warns(VMMFallbackWarning, match=r"region\('weights'\) on the 'host' backend: "
                                                r"nothing was allocated in it\. Framework tensors"):
        with vmm_core.region("weights", backend=host) as alloc:
            torch.randn(256, 256)
    assert alloc.physical_bytes == 0  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second region of the tag stays quiet
        with vmm_core.region("weights", backend=host) as alloc:
            alloc.allocate(MiB)  # the remedy the warning names
    assert alloc.physical_bytes >= MiB


def test_an_executor_on_the_host_says_once_that_its_tensors_are_not_routed(host, monkeypatch):
    """It reported reuse 'vmm', no fallback and 0 physical bytes, and warned nothing,
    where region() in the same situation warns."""
    from vmm_core.graphs import capture_space as graph_pool

    monkeypatch.setattr(graph_pool, "_warned_unrouted", set())
    w = torch.randn(64, 64)
    with pytest.warns(VMMFallbackWarning, match=r"GraphPool on the 'host' backend: the "
                                                r"capture of key 512 allocated nothing in "
                                                r"its space\. Framework tensors"):
        ex = vmm_core.GraphExecutor(lambda x: x @ w, torch.empty(512, 64), backend=host)
        x = torch.randn(512, 64)
        torch.testing.assert_close(ex(x), x @ w)  # it still runs, unshared
    stats = ex.stats()
    assert stats["physical_bytes"] == 0  # what the warning is about
    assert "cannot place framework tensors in the pool's spaces" in stats["fallback"]
    assert ex.fallback_reason == stats["fallback"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per backend; stats still say it
        other = vmm_core.GraphExecutor(lambda x: x * 2, torch.empty(4, 2), backend=host)
        other(torch.ones(4, 2))
        assert other.stats()["fallback"] == stats["fallback"]
        # captures that allocate from the pool's allocator (the remedy) are not flagged
        monkeypatch.setattr(graph_pool, "_warned_unrouted", set())
        pool = vmm_core.GraphPool(backend=host)
        with pool.space(1):
            pool.keep(routing.current_target(0).allocate(MiB))
        assert pool.stats()["fallback"] is None and pool.stats()["physical_bytes"] >= MiB
    for closing in (ex, other, pool):
        closing.close()


def test_a_closed_tag_and_an_unknown_tag_are_refused_alike(host):
    alloc = vmm_core.SharedVMMAllocator(host, tag="kv")
    tagged.register("kv", alloc)
    alloc.allocate(MiB)
    alloc.close()
    for name in ("kv", "nonexistent"):
        with pytest.raises(VMMError, match=rf"no memory is tagged \['{name}'\] \(never tagged, "
                                           r"or its memory was closed\)"):
            vmm_core.sleep(name)
        with pytest.raises(VMMError, match="memory_summary"):
            vmm_core.wake_up(name)


def test_logs_use_readable_units_and_a_no_op_logs_nothing(host, caplog):
    alloc = vmm_core.SharedVMMAllocator(host, tag="kv")
    tagged.register("kv", alloc)
    alloc.allocate(4 * MiB)
    with caplog.at_level(logging.INFO, logger="vmm_core"):
        vmm_core.sleep([])          # names nothing: does nothing, says nothing
        vmm_core.wake_up("kv")      # already awake: nothing to report
        vmm_core.sleep("kv", offload=["kv"])
        vmm_core.sleep("kv")        # already asleep
        vmm_core.wake_up("kv")
    lines = [r.getMessage() for r in caplog.records if r.name == "vmm_core"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("sleep: freed 4.00 MiB (tags kv), 0 B of tagged memory in use; "
                               "offloaded 4.00 MiB in "), lines[0]
    assert lines[1].startswith("wake_up: restored 4.00 MiB (tags kv)"), lines[1]
    assert "(tags )" not in "".join(lines)
