"""Group calls of vmm_core.distributed across real processes on the host backend: a
host table larger than the machine is refused on every rank, a refused group call leaves
no reference cycle holding the process group, and ranks in different calls (a
distributed gather against a group sleep, a close or a new mapped tensor) raise at once
instead of waiting the whole group timeout.

Every run starts rank processes with a gloo group (vmm_core.testing.ranks: a hard
deadline, stragglers killed, the store removed).  Where the failure would be a hang the
group's timeout is longer than the run's deadline, so a rank left waiting is killed and
the test fails in seconds, not minutes.  Rank functions are module-level so they can be
sent to the rank processes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

import pytest
import torch
from proc_state import barrier as _barrier
from proc_state import fd_table as _fd_table
from proc_state import mem_available

import vmm_core
from vmm_core.distributed import mapped_tensor
from vmm_core.distributed.group import Group
from vmm_core.errors import CallMismatchError, VMMError
from vmm_core.memory import tagged
from vmm_core.testing.ranks import check_ranks, run_ranks

TIMEOUT = 40  # hard deadline of one multi-process run (seconds)
SOCKET_TIMEOUT = 3.0
ROW = 1024  # float32 columns: 4 KiB rows


def _make(shape, kind="distributed", location="device", **kw):
    return mapped_tensor(shape, torch.float32, kind=kind, location=location, backend="host",
                         timeout=SOCKET_TIMEOUT, **kw)


# ------------------------------------------------------------------ host tables
def _host_table_larger_than_the_machine(rank, world, kind):
    """Asks for 1 GiB more than the machine has available.  posix_fallocate is replaced
    by one that only records its calls (and fails as a full machine would), so the test
    never takes the memory even where the refusal is missing."""
    calls = []

    def fallocate(fd, offset, size):
        calls.append(size)
        raise OSError(28, "No space left on device (recorded, not allocated)")

    real, os.posix_fallocate = os.posix_fallocate, fallocate
    gc.collect()
    fds = _fd_table()
    rows = (mem_available() + (1 << 30)) // (ROW * 4)
    rows = Group().gather(rows, "rank 0's row count")[0]  # the same shape on every rank
    error = None
    try:
        mt = _make((rows, ROW), kind=kind, location="host")
        mt.close()  # no memory is touched: the distributed kind's parts map lazily
    except VMMError as exc:
        error = (type(exc).__name__, str(exc))
    finally:
        os.posix_fallocate = real
    _barrier()  # the group is still in step
    small = _make((64, ROW), kind=kind, location="host")
    small.local_part().fill_(rank + 1.0)
    small.close()
    gc.collect()
    leaked = {fd: t for fd, t in _fd_table().items() if fds.get(fd) != t}
    return {"error": error, "fallocate": calls, "rows": rows, "leaked": leaked}


@pytest.mark.parametrize("kind", ["continuous", "chunked", "distributed"])
def test_a_host_table_larger_than_the_machine_is_refused_on_every_rank(kind):
    """A host table larger than the machine is refused with OutOfMemoryError on every rank
    before posix_fallocate on the shared memfd could take every free page and the OOM killer
    end the ranks, as the same shape on the device raises at once."""
    values = check_ranks(run_ranks(_host_table_larger_than_the_machine, 2, args=(kind,),
                                   timeout=TIMEOUT))
    for v in values:
        assert v["error"] is not None, v
        kind_, text = v["error"]
        assert kind_ == "OutOfMemoryError", v
        assert "MemAvailable" in text and "available" in text, text
        assert v["fallocate"] == [], "refused before any page was asked for"
        assert not v["leaked"], v
    assert values[0]["error"] == values[1]["error"], "the same error on every rank"


# ------------------------------------------------------------------ reference cycles
def _refused_calls_leave_no_cycle(rank, world, call):
    """A refused call on rank 0 (a tag it does not have, a bad dtype); then no object of
    the refused call may be left in a reference cycle, the group least of all."""
    group = torch.distributed.group.WORLD
    with vmm_core.region("w", backend="host", reserve_bytes=1 << 20) as w:
        w.allocate(4096)
    gc.collect()
    gc.disable()  # nothing but this call's own garbage in the collection below
    try:
        try:
            if call == "sleep":
                vmm_core.sleep("nope" if rank == 0 else "w", group=group)
            elif call == "wake_up":
                vmm_core.wake_up("nope" if rank == 0 else "w", group=group)
            elif call == "mapped_tensor":
                mapped_tensor((4, 4), "float32" if rank == 0 else torch.float32,
                              group=group, backend="host")
            else:  # a refused close: rank 0 holds its part awake
                mt = _make((8, 4), tag="emb")
                with tagged.hold_awake("emb") if rank == 0 else contextlib.nullcontext():
                    mt.close()
        except VMMError as exc:
            refused = type(exc).__name__
        else:
            refused = None
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        groups = sum(isinstance(o, Group) for o in gc.garbage)
        frames = sorted({o.f_code.co_name for o in gc.garbage
                         if type(o).__name__ == "frame"
                         and "vmm_core" in o.f_code.co_filename})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    if call == "close":
        mt.close()
    return {"refused": refused, "groups": groups, "frames": frames}


@pytest.mark.parametrize("call", ["sleep", "wake_up", "mapped_tensor", "close"])
def test_a_refused_group_call_leaves_no_reference_cycle(call):
    """After a refused group sleep (or wake_up, or a failed mapped_tensor with an
    explicit group), a cycle through the exception's frames kept the process group alive
    past destroy_process_group; the rank then sometimes aborted at exit ("terminate
    called without an active exception", 2 in 40 runs)."""
    values = check_ranks(run_ranks(_refused_calls_leave_no_cycle, 2, args=(call,),
                                   timeout=TIMEOUT))
    for v in values:
        assert v["refused"] is not None, v
        assert v["groups"] == 0 and not v["frames"], v


# ------------------------------------------------------------------ mismatched calls
def _gather_against_another_call(rank, world, other):
    """Rank 0 gathers rows of a distributed tensor while rank 1 makes ``other``."""
    mt = _make((16 * world, 8), tag="emb")
    spare = _make((8, 8))  # closed by rank 1 in the "close" case
    mine = torch.arange(rank, 16 * world, world)
    mt.scatter(mine, torch.full((mine.numel(), 8), float(rank + 1)))
    group = torch.distributed.group.WORLD
    start = time.monotonic()
    try:
        if rank == 0:
            mt.gather(torch.arange(16 * world))
        elif other == "sleep":
            vmm_core.sleep("emb", group=group)
        elif other == "wake_up":
            vmm_core.wake_up(group=group)
        elif other == "close":
            spare.close()
        elif other == "close-same":
            mt.close()
        elif other == "mapped_tensor":
            _make((8, 8)).close()
        error = None
    except CallMismatchError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    state = {"asleep": mt.memory._local.allocators[0].asleep, "closed": mt.memory.closed,
             "spare_closed": spare.memory.closed}
    _barrier()  # still in step
    again = mt.gather(torch.arange(16 * world))  # and the tensor still works
    ok = bool((again[:, 0] == torch.arange(16 * world) % world + 1).all())
    mt.close()
    spare.close()
    return {"error": error, "seconds": seconds, "again": ok, **state}


@pytest.mark.parametrize("other", ["sleep", "wake_up", "close", "mapped_tensor",
                                   "close-same"])
def test_a_distributed_gather_against_another_call_raises_at_once_on_every_rank(other):
    """A distributed gather on one rank against a group sleep (or close(), or a new
    mapped_tensor) on another is detected by the call header: every rank raises the same
    CallMismatchError at once, instead of waiting the whole group timeout in mismatched
    collectives, and the group stays usable."""
    # group_timeout=120 > the run's deadline: a rank left waiting is killed
    values = check_ranks(run_ranks(_gather_against_another_call, 2, args=(other,),
                                   timeout=TIMEOUT, group_timeout=120))
    for v in values:
        assert v["error"] is not None, v
        assert v["seconds"] < 10, v
        assert v["again"], v
        assert not v["asleep"] and not v["closed"] and not v["spare_closed"], v
    assert values[0]["error"] == values[1]["error"], values
    assert "mt.gather" in values[0]["error"], values[0]["error"]
    assert "still usable" in values[0]["error"], values[0]["error"]


def _close_two_different_tensors(rank, world):
    """Rank 0 closes ``a`` while rank 1 closes ``b``: both closes are the same step, so
    without the tensors' agreed ids they would pair up, and each rank would go on with a
    tensor the other had closed."""
    a, b = _make((8, 8), kind="continuous"), _make((8, 8), kind="continuous")
    try:
        (a if rank == 0 else b).close()
        error = None
    except CallMismatchError as exc:
        error = str(exc)
    state = (a.memory.closed, b.memory.closed)
    a.close()  # in the same order on every rank: both go
    b.close()
    return {"error": error, "open_after": state, "closed": (a.memory.closed, b.memory.closed)}


def test_closes_of_two_different_tensors_refuse_together():
    values = check_ranks(run_ranks(_close_two_different_tensors, 2, timeout=TIMEOUT,
                                   group_timeout=120))
    for v in values:
        assert v["error"] is not None and "closing mapped memory" in v["error"], v
        assert v["open_after"] == (False, False) and v["closed"] == (True, True), v
    assert values[0]["error"] == values[1]["error"], values
