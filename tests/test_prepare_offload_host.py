"""Announced offload: ``region(tag, prepare_offload=True)`` makes the pinned host copy in
the background once the block ends, so that the first sleep copies straight; a sleep
that comes first is never wrong, and closing or forking meanwhile leaks nothing.

On the host backend registration is a no-op that offload still performs, so a copy that
is "pinned" here takes the pinned path exactly as on a GPU."""

from __future__ import annotations

import ctypes
import random
import threading

import pytest
from proc_state import anonymous_mappings, run_python

import vmm_core
from vmm_core.memory import host_memory, offload

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


@pytest.fixture(autouse=True)
def _settle():
    yield
    assert offload.wait_for_prepared(10)


def _fill(address: int, n: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(n)
    ctypes.memmove(address, data, n)
    return data


def _announced(tag: str, sizes=(MIB, MIB, MIB), free=(1,)):
    with vmm_core.region(tag, backend="host", prepare_offload=True) as alloc:
        blocks = [alloc.allocate(n) for n in sizes]
        for i in free:
            alloc.deallocate(blocks[i])
    return alloc, [b for i, b in enumerate(blocks) if i not in free]


class _Gate:
    """Holds a background step (the copy's pages, or its registration) until opened."""

    def __init__(self, monkeypatch, cls, name: str) -> None:
        self.entered, self.open = threading.Event(), threading.Event()
        real = getattr(cls, name)

        def gated(copy, *args, **kwargs):
            self.entered.set()
            assert self.open.wait(20), "the test never opened the gate"
            return real(copy, *args, **kwargs)

        monkeypatch.setattr(cls, name, gated)


def test_the_first_sleep_of_an_announced_tag_copies_straight_into_a_pinned_copy():
    alloc, (a, c) = _announced("w")
    assert offload.wait_for_prepared(10)
    assert alloc.host_bytes == alloc.pinned_host_bytes == 2 * MIB, "sized to the live bytes"
    data = _fill(a, MIB, 1), _fill(c, MIB, 2)
    vmm_core.sleep("w", offload="w")
    assert alloc.last_transfer.strategy == "pinned"
    vmm_core.wake_up("w")
    assert (ctypes.string_at(a, MIB), ctypes.string_at(c, MIB)) == data


def test_without_the_announcement_the_first_sleep_takes_the_unpinned_path():
    with vmm_core.region("w", backend="host") as alloc:
        a = alloc.allocate(MIB)
    _fill(a, MIB, 1)
    assert offload.wait_for_prepared(10) and alloc.host_bytes == 0
    vmm_core.sleep("w", offload="w")
    assert alloc.last_transfer.strategy == "direct"


def test_a_sleep_during_the_page_faults_waits_for_them_and_is_right(monkeypatch):
    gate = _Gate(monkeypatch, host_memory.MappedHostCopy, "populate")
    alloc, (a, c) = _announced("w")
    data = _fill(a, MIB, 3), _fill(c, MIB, 4)
    assert gate.entered.wait(10)
    done = threading.Event()

    def sleeper():
        vmm_core.sleep("w", offload="w")
        done.set()

    t = threading.Thread(target=sleeper)
    t.start()
    assert not done.wait(0.3), "the sleep must wait for the copy's pages"
    gate.open.set()
    t.join(20)
    assert done.is_set()
    vmm_core.wake_up("w")
    assert (ctypes.string_at(a, MIB), ctypes.string_at(c, MIB)) == data
    assert alloc.host_bytes == 2 * MIB  # the prepared copy, not a second one
    assert anonymous_mappings(2 * MIB) >= 1


def test_a_sleep_never_waits_for_the_registration(monkeypatch):
    gate = _Gate(monkeypatch, host_memory.MappedHostCopy, "register")
    alloc, (a, c) = _announced("w")
    data = _fill(a, MIB, 5), _fill(c, MIB, 6)
    assert gate.entered.wait(10), "the registration starts in the background"
    vmm_core.sleep("w", offload="w")  # while registering: through the unpinned path
    assert alloc.last_transfer.strategy == "direct"
    gate.open.set()
    vmm_core.wake_up("w")  # the wake after it waits, as any kept copy's does
    assert (ctypes.string_at(a, MIB), ctypes.string_at(c, MIB)) == data
    data = _fill(a, MIB, 7), _fill(c, MIB, 8)
    vmm_core.sleep("w", offload="w")
    assert alloc.last_transfer.strategy == "pinned"
    vmm_core.wake_up("w")
    assert (ctypes.string_at(a, MIB), ctypes.string_at(c, MIB)) == data


def test_a_sleep_before_the_copy_was_started_does_not_wait_for_it(monkeypatch):
    gate = _Gate(monkeypatch, host_memory.MappedHostCopy, "populate")
    first, _ = _announced("first")  # holds the one background thread
    assert gate.entered.wait(10)
    alloc, (a, c) = _announced("w", sizes=(3 * MIB, MIB, 5 * MIB))
    data = _fill(a, 3 * MIB, 9), _fill(c, 5 * MIB, 10)
    vmm_core.sleep("w", offload="w")  # its copy is queued: cancelled, not waited for
    vmm_core.wake_up("w")
    assert (ctypes.string_at(a, 3 * MIB), ctypes.string_at(c, 5 * MIB)) == data
    gate.open.set()
    assert offload.wait_for_prepared(10)
    assert alloc.host_bytes == 8 * MIB and first.host_bytes == 2 * MIB


def test_closing_the_region_while_its_copy_is_made_frees_the_copy(monkeypatch):
    size = 7 * MIB
    before = anonymous_mappings(size)
    gate = _Gate(monkeypatch, host_memory.MappedHostCopy, "populate")
    alloc, _ = _announced("w", sizes=(size,), free=())
    assert gate.entered.wait(10)
    alloc.close()
    gate.open.set()
    assert offload.wait_for_prepared(10)
    assert anonymous_mappings(size) == before, "the abandoned copy must be freed once made"
    assert alloc.host_bytes == 0


def test_announcing_again_keeps_one_copy_of_the_current_size(warns_unrouted):
    alloc, (a, c) = _announced("w")
    assert offload.wait_for_prepared(10)
    copy = alloc._host.copy
    with warns_unrouted("host", "w"), \
            vmm_core.region("w", backend="host", prepare_offload=True):
        pass  # nothing changed: nothing made
    assert offload.wait_for_prepared(10) and alloc._host.copy is copy
    before = anonymous_mappings(2 * MIB)
    with vmm_core.region("w", backend="host", prepare_offload=True):
        alloc.allocate(MIB)  # the live set grew: a new copy, the old one freed first
    assert offload.wait_for_prepared(10)
    assert alloc.host_bytes == alloc.pinned_host_bytes == 3 * MIB
    assert anonymous_mappings(2 * MIB) == before - 1


def test_a_block_that_raised_announces_nothing():
    with pytest.raises(ZeroDivisionError):
        with vmm_core.region("w", backend="host", prepare_offload=True) as alloc:
            alloc.allocate(MIB)
            1 / 0
    assert offload.wait_for_prepared(10) and alloc.host_bytes == 0


def test_bad_prepare_offload_is_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="prepare_offload must be True or False"):
        with vmm_core.region("w", backend="host", prepare_offload="yes"):
            pass
    assert vmm_core.memory_summary() == {}


def test_a_forked_child_does_not_wait_for_the_parents_background_copy():
    """The background thread is not in a forked child: its sleep makes its own copy."""
    result = run_python("""
        import ctypes, os, threading
        import vmm_core
        from vmm_core.memory import host_memory, offload

        gate = threading.Event()
        real = host_memory.MappedHostCopy.populate
        def slow(self, *a, **k):
            gate.wait(30)
            return real(self, *a, **k)
        host_memory.MappedHostCopy.populate = slow
        with vmm_core.region("w", backend="host", prepare_offload=True) as alloc:
            p = alloc.allocate(1 << 20)
        ctypes.memset(p, 7, 1 << 20)
        pid = os.fork()
        if pid == 0:
            vmm_core.sleep("w", offload="w")
            vmm_core.wake_up("w")
            ok = ctypes.string_at(p, 1 << 20) == bytes([7]) * (1 << 20)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        gate.set()
        assert offload.wait_for_prepared(20)
        print("child", os.waitstatus_to_exitcode(status))
    """, timeout=60, hung="a forked child waiting for its parent's background copy")
    assert result.returncode == 0, result.stderr
    assert "child 0" in result.stdout
