"""Group sleep and wake over gloo on the host backend: where their time goes, the group
prepared ahead of the first sleep, communicators asleep (refused where the group's
backend cannot), and the messages of ranks that disagree.

Every test starts real rank processes (vmm_core.testing.ranks: a hard deadline,
stragglers killed, the store directory removed).  The rank functions are module-level so
that they can be sent to the rank processes.
"""

from __future__ import annotations

import pytest
import torch

import vmm_core
from vmm_core.distributed import last_timings, prepare_group
from vmm_core.errors import DistributedError, VMMError
from vmm_core.testing.ranks import check_ranks, run_ranks

MIB = 1 << 20


def _world():
    return torch.distributed.group.WORLD


def _region(tag: str, nbytes: int = MIB, fill: int | None = None):
    with vmm_core.region(tag, backend="host") as alloc:
        address = alloc.allocate(nbytes)
    if fill is not None:
        view = vmm_core.get_backend("host").torch_tensor(0, address, nbytes)
        view.fill_(fill)
        return alloc, view
    return alloc, None


def _error(fn) -> str | None:
    try:
        fn()
    except VMMError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------ offload= mismatch
def _different_offload(rank, world):
    w, _ = _region("w")
    k, _ = _region("kv")
    offload = ("w",) if rank == 0 else ("w", "kv")
    error = _error(lambda: vmm_core.sleep(["w", "kv"], offload=offload, group=_world()))
    return {"error": error, "asleep": [w.asleep, k.asleep]}


def test_ranks_with_the_same_tags_but_different_offload_are_told_to_pass_the_same_offload():
    results = check_ranks(run_ranks(_different_offload, 2, timeout=60))
    assert results[0]["error"] == results[1]["error"]
    error = results[0]["error"]
    assert error.startswith("DistributedError") and "different tags to offload" in error
    assert "rank 0: ['w'], rank 1: ['kv', 'w']" in error, error
    assert "Pass the same offload= on every rank" in error, error
    assert "tags=" not in error, error  # the tags were the same
    for r in results:
        assert r["asleep"] == [False, False], r


def _different_tags_and_offload(rank, world):
    _region("w")
    _region("kv")
    if rank == 0:
        call = lambda: vmm_core.sleep(["w"], offload="w", group=_world())  # noqa: E731
    else:
        call = lambda: vmm_core.sleep(["w", "kv"], offload="kv", group=_world())  # noqa: E731
    return _error(call)


def test_ranks_that_differ_in_both_are_told_both():
    results = check_ranks(run_ranks(_different_tags_and_offload, 2, timeout=60))
    assert results[0] == results[1]
    assert "different tags to sleep and tags to offload" in results[0], results[0]
    assert "Pass the same tags= and offload= on every rank" in results[0], results[0]


def test_the_plan_message_names_communicators_when_only_they_differ():
    from vmm_core.distributed.collective import _refuse_different_plans

    class _Ranks:
        rank, size = 0, 2

    steps = [(["w"], ["w"])]
    _refuse_different_plans(_Ranks(), [(steps, 1), (steps, 1)])  # the same: no error
    with pytest.raises(DistributedError) as info:
        _refuse_different_plans(_Ranks(), [(steps, 1), (steps, 0)])
    message = str(info.value)
    assert "different communicators to suspend" in message
    assert "rank 0: 1, rank 1: 0" in message
    assert "Pass the same communicators= on every rank" in message


# ------------------------------------------------------------------ phases
def _timed_rounds(rank, world):
    w, view = _region("w", 4 * MIB, fill=rank + 1)
    _region("kv", 2 * MIB)
    out = []
    for _ in range(2):
        vmm_core.sleep(["w", "kv"], offload="w", group=_world())
        slept = last_timings("sleep")
        vmm_core.wake_up(group=_world())
        woke = last_timings("wake_up")
        out.append({"sleep": slept, "wake": woke,
                    "bytes_back": bool((view == rank + 1).all())})
    return out


def test_a_group_sleep_and_wake_record_their_phases_on_every_rank():
    for rank, rounds in enumerate(check_ranks(run_ranks(_timed_rounds, 2, timeout=60))):
        for r in rounds:
            sleep, wake = r["sleep"], r["wake"]
            assert r["bytes_back"]
            assert sleep["ok"] and sleep["rank"] == rank and sleep["call"] == "sleep"
            # the agreement, then per step (offload w, discard kv) the local work and
            # the confirmation, in the order they first happened
            assert list(sleep["phases"]) == ["agree", "copy", "pin wait", "unmap+release",
                                             "confirm"], sleep
            assert list(wake["phases"]) == ["agree", "copy", "pin wait", "map", "confirm"]
            assert sleep["copied_bytes"] == 4 * MIB and wake["copied_bytes"] == 4 * MIB
            for record in (sleep, wake):
                assert all(s >= 0 for s in record["phases"].values()), record
                assert sum(record["phases"].values()) <= record["total_s"] * 1.001, record
                assert record["phases"]["copy"] > 0, record


def _timings_of_a_refused_sleep(rank, world):
    _region("w")
    if rank == 1:
        _region("only-here")
    error = _error(lambda: vmm_core.sleep(group=_world()))
    return {"error": error, "timings": last_timings("sleep")}


def test_a_refused_group_sleep_records_that_it_failed_after_the_agreement():
    for r in check_ranks(run_ranks(_timings_of_a_refused_sleep, 2, timeout=60)):
        assert r["error"] and "different tags to sleep" in r["error"]
        assert r["timings"]["ok"] is False
        assert list(r["timings"]["phases"]) == ["agree"], r["timings"]


def test_last_timings_names_the_calls_it_knows():
    with pytest.raises(ValueError, match="'sleep' or 'wake_up'"):
        last_timings("wake")


# ------------------------------------------------------------------ prepare_group
def _prepared_then_sleep(rank, world):
    seconds = prepare_group()
    again = prepare_group(_world())
    w, view = _region("w", MIB, fill=7)
    vmm_core.sleep("w", offload="w", group=_world())
    vmm_core.wake_up("w", group=_world())
    return {"seconds": [seconds, again], "bytes": bool((view == 7).all()),
            "asleep": w.asleep}


def test_prepare_group_is_a_collective_every_rank_calls_before_the_first_sleep():
    for r in check_ranks(run_ranks(_prepared_then_sleep, 3, timeout=60)):
        assert all(isinstance(s, float) and s > 0 for s in r["seconds"]), r
        assert r["bytes"] and not r["asleep"]


def _prepare_against_a_sleep(rank, world):
    _region("w")
    if rank == 0:
        error = _error(prepare_group)
    else:
        error = _error(lambda: vmm_core.sleep("w", group=_world()))
    prepare_group()  # the group is still in step: one more collective pairs up
    return error


def test_prepare_group_against_a_group_sleep_refuses_on_both_naming_the_calls():
    results = check_ranks(run_ranks(_prepare_against_a_sleep, 2, timeout=60))
    assert results[0] == results[1]
    assert results[0].startswith("CallMismatchError"), results[0]
    assert "vmm_core.distributed.prepare_group" in results[0]


# ------------------------------------------------------------------ communicators=
def _communicators_on_gloo(rank, world, which):
    w, _ = _region("w")
    groups = True if which == "own" else [_world()]
    error = _error(lambda: vmm_core.sleep("w", offload="w", group=_world(),
                                          communicators=groups))
    return {"error": error, "asleep": w.asleep}


@pytest.mark.parametrize("which", ["own", "listed"])
def test_communicators_on_a_backend_that_cannot_release_them_refuse_on_every_rank(which):
    results = check_ranks(run_ranks(_communicators_on_gloo, 2, args=(which,), timeout=60))
    for r in results:
        assert not r["asleep"], r  # refused before anything slept
        error = r["error"]
        assert error.startswith("DistributedError") and "failed on rank(s) [0, 1]" in error
        # gloo's backend says it cannot; torch releases without suspend() say that
        assert ("'gloo' backend cannot release its communicator's memory" in error
                or "has no suspend()" in error), error
        assert "leave communicators=False" in error


def test_communicators_without_a_group_are_refused_with_the_remedy():
    with pytest.raises(VMMError, match="only a group sleep can do: pass group="):
        vmm_core.sleep("anything", communicators=True)


def _bad_communicators(rank, world):
    _region("w")
    return _error(lambda: vmm_core.sleep("w", group=_world(), communicators="yes"))


def test_a_bad_communicators_argument_refuses_on_every_rank():
    results = check_ranks(run_ranks(_bad_communicators, 2, timeout=60))
    assert results[0] == results[1]
    assert "communicators must be False, True" in results[0], results[0]


# ------------------------------------------------------------------ Ctrl-C
def _interrupting(real, at: str):
    """The rank's backend, raising KeyboardInterrupt at its first ``at`` call (as a second
    Ctrl-C does: the first waits for the call)."""
    from vmm_core.testing import FaultInjector

    class Interrupting(FaultInjector):
        def map(self, *args, **kwargs):
            if at == "map":
                raise KeyboardInterrupt
            return self._real.map(*args, **kwargs)

        def copy_to_host(self, *args, **kwargs):
            if at == "copy":
                raise KeyboardInterrupt
            return self._real.copy_to_host(*args, **kwargs)

        def unmap(self, *args, **kwargs):
            if at == "unmap":
                raise KeyboardInterrupt
            return self._real.unmap(*args, **kwargs)

    return Interrupting(real)


def _interrupted(rank, world, call):
    """Rank 1 is interrupted inside its part of a group sleep or wake, after another
    tag's memory changed: every rank must end where it started (for the two-step sleep,
    the offloaded tags awake with their bytes), rank 1 with the interrupt and a note
    saying so, the others with an error naming it."""
    a, view_a = _region("a", fill=10 + rank)
    b, view_b = _region("b", fill=20 + rank)
    c, _ = _region("c", fill=30 + rank)
    if call == "wake":
        vmm_core.sleep(["a", "b"], offload=["a", "b"], group=_world())
    real = {alloc: alloc.backend for alloc in (a, b, c)}
    if rank == 1:
        if call == "wake":
            b.backend = _interrupting(real[b], "map")
        elif call == "sleep":
            b.backend = _interrupting(real[b], "copy")
        else:  # the discard step of a sleep whose offload step is done
            c.backend = _interrupting(real[c], "unmap")
    outcome, notes = None, []
    try:
        if call == "wake":
            vmm_core.wake_up(["a", "b"], group=_world())
        elif call == "sleep":
            vmm_core.sleep(["a", "b"], offload=["a", "b"], group=_world())
        else:
            vmm_core.sleep(["a", "b", "c"], offload=["a", "b"], group=_world())
    except KeyboardInterrupt as exc:
        outcome, notes = "KeyboardInterrupt", list(getattr(exc, "__notes__", []))
    except VMMError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    for alloc, backend in real.items():
        alloc.backend = backend
    state = [a.asleep, b.asleep, c.asleep]
    if call == "wake":
        vmm_core.wake_up(["a", "b"], group=_world())
    return {"outcome": outcome, "notes": notes, "state": state,
            "bytes": [bool((view_a == 10 + rank).all()), bool((view_b == 20 + rank).all())]}


@pytest.mark.parametrize("call", ["sleep", "wake", "two-step sleep"])
def test_an_interrupt_on_one_rank_leaves_every_rank_where_it_started(call):
    results = run_ranks(_interrupted, 2, args=(call,), timeout=60)
    values = check_ranks(results)
    assert [r.exitcode for r in results] == [0, 0], results  # no crash at exit either
    start = [True, True, False] if call == "wake" else [False, False, False]
    assert values[1]["outcome"] == "KeyboardInterrupt", values[1]
    other = values[0]["outcome"]
    assert other.startswith("DistributedError") and "(rank 1: KeyboardInterrupt)" in other, other
    if call == "two-step sleep":
        assert "the offload step before it was undone too" in other, other
        assert any("the offload step before it was undone too" in n
                   for n in values[1]["notes"]), values[1]
    else:
        assert "every rank is back where it started" in other, other
    assert any(n.startswith("vmm_core: vmm_core.") for n in values[1]["notes"]), values[1]
    for v in values:
        assert v["state"] == start, v
        assert v["bytes"] == [True, True], v


def _ctrl_c_on_every_rank(rank, world, call):
    """A real SIGINT on every rank (a terminal's Ctrl-C, or torchrun passing it on) in the
    middle of each rank's part: the call finishes on every rank, then each raises it."""
    import os
    import signal

    from vmm_core.testing import FaultInjector

    signal.signal(signal.SIGINT, signal.default_int_handler)

    class CtrlC(FaultInjector):
        armed = True

        def _signal(self):
            if self.armed:
                self.armed = False
                os.kill(os.getpid(), signal.SIGINT)

        def copy_to_host(self, *args, **kwargs):
            self._signal()
            return self._real.copy_to_host(*args, **kwargs)

        def map(self, *args, **kwargs):
            self._signal()
            return self._real.map(*args, **kwargs)

    a, view_a = _region("a", fill=10 + rank)
    b, view_b = _region("b", fill=20 + rank)
    if call == "wake":
        vmm_core.sleep(["a", "b"], offload=["a", "b"], group=_world())
    real = b.backend
    b.backend = CtrlC(real)
    outcome = None
    try:
        if call == "wake":
            vmm_core.wake_up(["a", "b"], group=_world())
        else:
            vmm_core.sleep(["a", "b"], offload=["a", "b"], group=_world())
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    b.backend = real
    state = [a.asleep, b.asleep]
    if call == "sleep":
        vmm_core.wake_up(["a", "b"], group=_world())
    return {"outcome": outcome, "state": state,
            "bytes": [bool((view_a == 10 + rank).all()), bool((view_b == 20 + rank).all())]}


@pytest.mark.parametrize("call", ["sleep", "wake"])
def test_ctrl_c_on_every_rank_waits_for_the_group_and_leaves_it_whole(call):
    results = run_ranks(_ctrl_c_on_every_rank, 2, args=(call,), timeout=60)
    values = check_ranks(results)
    done = [True, True] if call == "sleep" else [False, False]
    for v in values:
        assert v["outcome"] == "KeyboardInterrupt", v
        assert v["state"] == done, v
        assert v["bytes"] == [True, True], v
