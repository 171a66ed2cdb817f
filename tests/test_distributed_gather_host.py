"""gather/scatter for every kind, and the distributed kind, across real processes (host).

Every run starts 2 or 4 rank processes with a gloo group (vmm_core.testing.ranks: a hard
deadline, stragglers killed, the store removed).  Each rank checks the rows it gathers
against a reference tensor that every rank can rebuild from seeds, so a row that came
from the wrong owner, the wrong offset or the wrong rank's request is caught.  Rank
functions are module-level so they can be sent to the rank processes.
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
from proc_state import barrier as _barrier
from proc_state import fd_table as _fd_table
from proc_state import mapped as _mapped
from proc_state import memfd_maps as _memfd_maps

import vmm_core
from vmm_core.distributed import mapped_tensor
from vmm_core.errors import DistributedError, VMMError
from vmm_core.memory import reaper
from vmm_core.testing.ranks import check_ranks, run_ranks

TIMEOUT = 60  # hard deadline of one multi-process run (seconds)
SOCKET_TIMEOUT = 3.0
KINDS = [("continuous", "device"), ("chunked", "device"), ("continuous", "host"),
         ("distributed", "device"), ("distributed", "host")]


def _reference(rows: int, row: tuple, version: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(99 + version)
    return torch.randn((rows,) + row, generator=g)






def _make(kind, location, shape, **kw):
    return mapped_tensor(shape, torch.float32, kind=kind, location=location, backend="host",
                         timeout=SOCKET_TIMEOUT, **kw)


def _fill(mt, ref, rank, world):
    """Every rank writes the rows i with i % world == rank (disjoint): a scatter."""
    mine = torch.arange(rank, ref.shape[0], world)
    mt.scatter(mine, ref[mine])
    if mt.kind != "distributed":
        _barrier()  # mapped writes are local: the others see them after a barrier


# ------------------------------------------------------------------ rank functions
def _gather_scatter_reference(rank, world, kind, location, row):
    gc.collect()
    fds, maps = _fd_table(), _memfd_maps()
    rows = 37 * world + 5  # the last owner holds fewer rows
    ref = _reference(rows, row)
    mt = _make(kind, location, (rows,) + row)
    out = {}
    own = mt.memory.part_address(rank)
    try:
        _fill(mt, ref, rank, world)
        g = torch.Generator().manual_seed(rank)
        random = torch.randint(0, rows, (3 * rows,), generator=g)  # duplicates certain
        cases = {"random": random, "duplicates": torch.tensor([1, 1, rows - 1, 1]),
                 "empty": torch.empty(0, dtype=torch.int64),
                 "int32": random[:50].int(), "all": torch.arange(rows)}
        if rank == 0:
            cases["random"] = torch.empty(0, dtype=torch.int64)  # one rank asks nothing
        for name, idx in cases.items():
            got = mt.gather(idx)
            out[name] = (tuple(got.shape), torch.equal(got, ref[idx.long()]))
        if kind != "distributed":
            _barrier()  # every rank has read before anyone updates
        # an update: each rank writes a random disjoint set of rows with new values
        new = _reference(rows, row, version=1)
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(7))
        mine = perm[rank::world]
        mt.scatter(mine, new[mine])
        if kind != "distributed":
            _barrier()
        out["after_update"] = torch.equal(mt.gather(torch.arange(rows)), new)
        mt.scatter(torch.empty(0, dtype=torch.int64), torch.empty((0,) + row))
        out["local_is_own_rows"] = torch.equal(
            mt.local_part(), new[slice(*mt.memory.row_range())])
    finally:
        mt.close()
    gc.collect()
    reaper.drain()
    out["left"] = ({fd: t for fd, t in _fd_table().items() if fds.get(fd) != t},
                   _memfd_maps() - maps, own is not None and _mapped(own))
    return out


def _errors(rank, world, kind):
    """Bad arguments on one rank; rows named twice; the tensor/chunks of the kind."""
    rows = 16 * world
    ref = _reference(rows, (8,))
    mt = _make(kind, "device", (rows, 8))
    out = {}
    _fill(mt, ref, rank, world)

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except VMMError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    bad = {"range": torch.tensor([0, rows]), "negative": torch.tensor([-1]),
           "dtype": torch.tensor([0.0]), "device": torch.tensor([0], device="meta"),
           "list": [0, 1], "2d": torch.zeros(2, 2, dtype=torch.int64)}
    for name, idx in bad.items():  # only rank 1 is wrong; the others ask for row 0
        attempt(f"gather_{name}", lambda i=idx: mt.gather(i if rank == 1 else
                                                          torch.tensor([0])))
    same = ref[rank:rank + 1]  # the good ranks write what is there already
    attempt("scatter_dtype", lambda: mt.scatter(torch.tensor([rank]),
                                                same.int() if rank == 1 else same))
    attempt("scatter_shape", lambda: mt.scatter(torch.tensor([rank]),
                                                same[:, :7] if rank == 1 else same))
    # rows named twice by one rank, then the same row named by two ranks
    attempt("scatter_twice", lambda: mt.scatter(torch.tensor([3, 3]), torch.ones(2, 8)))
    _barrier()
    out["untouched"] = torch.equal(mt.gather(torch.arange(rows)), ref)
    _barrier()  # mapped kinds: every rank has read before row 5 is written
    attempt("scatter_two_ranks", lambda: mt.scatter(torch.tensor([5]), torch.ones(1, 8)))
    attempt("tensor", lambda: mt.tensor)
    attempt("chunks", lambda: mt.chunks)
    mt.close()
    attempt("closed", lambda: mt.gather(torch.tensor([0])))
    return out


def _raises_mid_call(rank, world, what):
    """Rank 1 fails between two exchanges (reading or writing its own rows)."""
    rows = 16 * world
    ref = _reference(rows, (8,))
    mt = _make("distributed", "device", (rows, 8))
    _fill(mt, ref, rank, world)
    every = torch.arange(rows)
    if rank == 1:
        def broken():
            raise RuntimeError("injected: the owner's local read failed")
        mt.local_part = broken
    try:
        if what == "gather":
            mt.gather(every)
        else:
            mine = torch.arange(rank, rows, world)
            mt.scatter(mine, ref[mine])
        error = None
    except VMMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        del mt.local_part
    again = mt.gather(every)  # the group is still usable, in step, on every rank
    mt.close()
    return {"error": error, "again": torch.equal(again, ref)}


def _different_nodes(rank, world, kind):
    """A node identity override (tests only): rank 1 claims another host."""
    from vmm_core.distributed import node

    if rank == 1:
        real = node.identity
        node.identity = lambda: dict(real(), host="another-node")
    rows = 12 * world
    ref = _reference(rows, (16,))
    try:
        mt = _make(kind, "device", (rows, 16))
    except DistributedError as exc:
        return {"error": str(exc)}
    _fill(mt, ref, rank, world)
    idx = torch.randint(0, rows, (50,), generator=torch.Generator().manual_seed(rank))
    ok = torch.equal(mt.gather(idx), ref[idx])
    mt.close()
    return {"error": None, "ok": ok}


def _sleeps_with_its_tag(rank, world):
    rows = 16 * world
    ref = _reference(rows, (256,))
    mt = _make("distributed", "device", (rows, 256), tag="emb")
    _fill(mt, ref, rank, world)
    group = torch.distributed.group.WORLD
    held = vmm_core.memory_summary()["emb"]["device_bytes"]
    vmm_core.sleep("emb", offload="emb", group=group)
    asleep = vmm_core.memory_summary()["emb"]
    try:
        mt.gather(torch.tensor([0, rows - 1]))
        error = None
    except VMMError as exc:
        error = str(exc)
    vmm_core.wake_up("emb", group=group)
    ok = torch.equal(mt.gather(torch.arange(rows)), ref)
    mt.close()
    return {"held": held, "asleep": asleep["asleep"], "asleep_bytes": asleep["device_bytes"],
            "error": error, "ok": ok, "tags_after_close": "emb" in vmm_core.memory_summary()}


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind,location", KINDS)
def test_gather_and_scatter_match_a_reference_and_leave_nothing(kind, location, world):
    row = (64,) if world == 2 else (1024,)  # 256 B and 4 KiB rows
    values = check_ranks(run_ranks(_gather_scatter_reference, world,
                                   args=(kind, location, row), timeout=TIMEOUT))
    for rank, v in enumerate(values):
        for name in ("random", "duplicates", "empty", "int32", "all"):
            assert v[name][1], (rank, name, v[name])
        assert v["empty"][0] == (0,) + row
        assert v["after_update"] and v["local_is_own_rows"], v
        assert v["left"] == ({}, 0, False), v["left"]


@pytest.mark.parametrize("kind", ["continuous", "chunked", "distributed"])
def test_bad_arguments_duplicates_and_unmapped_views_are_refused(kind):
    values = check_ranks(run_ranks(_errors, 2, args=(kind,), timeout=TIMEOUT))
    r0, r1 = values
    expect = {"range": "[0, 32)", "negative": "[-1]", "dtype": "int64 or int32",
              "device": "meta", "list": "torch.as_tensor", "2d": "1-D"}
    for name, text in expect.items():
        assert text in r1[f"gather_{name}"], (name, r1[f"gather_{name}"])
    assert "torch.int32" in r1["scatter_dtype"] and "(1, 8)" in r1["scatter_shape"]
    for r in values:
        assert "more than once" in r["scatter_twice"] and "[3]" in r["scatter_twice"]
        assert r["untouched"], "a refused scatter wrote rows"
        assert "closed" in r["closed"]
    if kind == "distributed":
        # collective: every rank raises the same error, naming the rank at fault
        for key in [k for k in r0 if k.startswith(("gather_", "scatter_"))]:
            assert r0[key] is not None and r0[key] == r1[key], key
        assert r0["gather_range"].startswith("DistributedError") and "rank(s) [1]" in \
            r0["gather_range"]
        assert "more than once" in r0["scatter_two_ranks"] and "[5]" in \
            r0["scatter_two_ranks"]
        for r in values:
            assert "mt.gather(indices)" in r["tensor"] and "mt.gather" in r["chunks"]
    else:  # local: only the rank at fault raises; two ranks writing one row is a race
        assert r0["gather_range"] is None and r0["scatter_dtype"] is None
        assert r0["scatter_two_ranks"] is None and r0["chunks"] is None


@pytest.mark.parametrize("what", ["gather", "scatter"])
def test_a_rank_raising_mid_call_makes_every_rank_raise_the_same_error(what):
    values = check_ranks(run_ranks(_raises_mid_call, 2, args=(what,), timeout=TIMEOUT,
                                   group_timeout=120))
    assert values[0]["error"] == values[1]["error"]
    assert values[0]["error"].startswith("DistributedError")
    assert "rank(s) [1]" in values[0]["error"] and "injected" in values[0]["error"]
    assert all(v["again"] for v in values)


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_kind_works_across_nodes_and_mapped_kinds_refuse(world):
    for v in check_ranks(run_ranks(_different_nodes, world, args=("distributed",),
                                   timeout=TIMEOUT)):
        assert v["error"] is None and v["ok"], v
    messages = check_ranks(run_ranks(_different_nodes, world, args=("continuous",),
                                     timeout=TIMEOUT))
    assert all(m["error"] == messages[0]["error"] for m in messages)
    assert "single-node" in messages[0]["error"] and "another-node" in messages[0]["error"]


def test_a_tagged_distributed_part_sleeps_and_wakes_with_its_bytes():
    for v in check_ranks(run_ranks(_sleeps_with_its_tag, 2, timeout=TIMEOUT)):
        assert v["held"] > 0 and v["asleep"] and v["asleep_bytes"] == 0, v
        assert v["error"] is not None and "asleep" in v["error"]
        assert "vmm_core.wake_up('emb', group=...)" in v["error"]
        assert v["ok"] and not v["tags_after_close"], v


def _tag_on_a_rank_without_rows(rank, world):
    """Rows all on rank 0 (a 4 KiB part holds them): rank 1 owns none, yet the tag must
    exist there too, or a group sleep of it is refused for unknown tags."""
    mt = _make("distributed", "device", (4, 16), tag="small")
    owners = mt.memory.partition.owners
    vmm_core.sleep("small", group=torch.distributed.group.WORLD)
    asleep = vmm_core.memory_summary()["small"]["asleep"]
    vmm_core.wake_up("small", group=torch.distributed.group.WORLD)
    mt.close()
    return {"owners": owners, "asleep": asleep}


def test_a_rank_without_rows_still_carries_the_tag():
    for v in check_ranks(run_ranks(_tag_on_a_rank_without_rows, 2, timeout=TIMEOUT)):
        assert v == {"owners": [0], "asleep": True}, v


def _dies_mid_gather(rank, world):
    import time

    mt = _make("distributed", "device", (16 * world, 8))
    if rank == 1:
        mt.local_part = lambda: os._exit(7)  # the process dies between two exchanges
    start = time.monotonic()
    try:
        mt.gather(torch.arange(16 * world))
        error = None
    except DistributedError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - start}


def test_a_rank_dying_mid_gather_makes_the_others_raise():
    results = run_ranks(_dies_mid_gather, 3, timeout=TIMEOUT, group_timeout=10)
    assert results[1].exitcode == 7 and not results[1].finished
    for r in (results[0], results[2]):
        assert r.ok, r
        assert r.value["error"] is not None and "mt.gather" in r.value["error"], r.value
        assert r.value["seconds"] < 15, r.value


def _mismatched_calls(rank, world, case):
    """Ranks that do not make the same call: rows all live on rank 0 (1 KiB fits one
    part), so without a check rank 1's gather of ``b`` is served from ``a``."""
    a, b = _make("distributed", "device", (32, 8)), _make("distributed", "device", (32, 8))
    a.scatter(torch.arange(rank, 32, world), torch.full((32 // world, 8), 1.0))
    b.scatter(torch.arange(rank, 32, world), torch.full((32 // world, 8), 2.0))
    try:
        if case == "tensor":
            got = (a if rank == 0 else b).gather(torch.arange(32))
        elif rank == 0:
            got = a.gather(torch.arange(32))
        else:
            got = a.scatter(torch.tensor([rank]), torch.ones(1, 8))
        error = None
    except DistributedError as exc:
        error = str(exc)
        got = None
    again = b.gather(torch.arange(32))  # the group is still in step afterwards
    a.close()
    b.close()
    return {"error": error, "got": None if got is None else got[:, 0].tolist(),
            "again": torch.equal(again, torch.full((32, 8), 2.0))}


@pytest.mark.parametrize("case", ["tensor", "method"])
def test_ranks_making_different_calls_all_raise_the_same_error_at_once(case):
    # group_timeout=120 > the run's deadline: a rank left waiting would be killed
    values = check_ranks(run_ranks(_mismatched_calls, 2, args=(case,), timeout=TIMEOUT,
                                   group_timeout=120))
    assert values[0]["error"] is not None, values  # not rows of another tensor, silently
    assert values[0]["error"] == values[1]["error"], values
    assert "the same call" in values[0]["error"], values[0]["error"]
    assert all(v["again"] for v in values), values


def _view_kept_past_close_then_sleep(rank, world):
    """A view of a tagged part kept past close(), then every tag put to sleep: the closed
    tensor's memory is no longer the tag's, so the sleep does not unmap it and the view
    stays readable."""
    rows = 64 * world
    mt = _make("distributed", "device", (rows, 256), tag="emb")
    mine = torch.arange(rank, rows, world)
    mt.scatter(mine, torch.ones(mine.numel(), 256))
    view = mt.local_part()
    mt.close()
    tags = vmm_core.memory_summary()
    vmm_core.sleep()  # every tag this process still has
    total = float(view.sum())
    del view
    gc.collect()
    reaper.drain()
    return {"tag_after_close": "emb" in tags, "sum": total}


def test_a_view_kept_past_close_survives_a_sleep_of_every_tag():
    results = run_ranks(_view_kept_past_close_then_sleep, 2, timeout=TIMEOUT)
    values = check_ranks(results)  # a crashed rank reports RankDied here
    for rank, v in enumerate(values):
        assert not v["tag_after_close"], v
    assert sum(v["sum"] for v in values) == 128 * 256, values


def _timeouts_that_are_no_bound(rank, world):
    out = {}
    for value in (float("nan"), float("inf")):
        try:
            _make_with_timeout = mapped_tensor((64, 1024), torch.float32, kind="continuous",
                                               location="host", backend="host",
                                               timeout=value)
            _make_with_timeout.close()
            out[str(value)] = None
        except VMMError as exc:
            out[str(value)] = str(exc)
    return out


def test_a_timeout_that_bounds_nothing_is_refused_with_the_remedy():
    for v in check_ranks(run_ranks(_timeouts_that_are_no_bound, 2, timeout=TIMEOUT)):
        for value, error in v.items():
            assert error is not None and "timeout must be a positive" in error, (value, error)


def _scatter_rows_that_require_grad(rank, world, kind, location):
    rows = 64 * world
    mt = _make(kind, location, (rows, 256))
    mine = torch.arange(rank, rows, world)
    for _ in range(3):
        mt.scatter(mine, torch.ones(mine.numel(), 256, requires_grad=True))
    if kind != "distributed":
        _barrier()
    got = mt.gather(torch.arange(rows))
    out = {"gather": got.requires_grad, "local": mt.local_part().requires_grad,
           "values": torch.equal(got, torch.ones(rows, 256))}
    mt.close()
    return out


@pytest.mark.parametrize("kind,location", KINDS)
def test_scatter_stores_values_never_autograd_history(kind, location):
    # every kind returns plain rows; a mapped view must not grow an autograd graph that
    # keeps every scattered tensor alive
    for v in check_ranks(run_ranks(_scatter_rows_that_require_grad, 2,
                                   args=(kind, location), timeout=TIMEOUT)):
        assert v == {"gather": False, "local": False, "values": True}, v



def _out_of_memory_mid_call(rank, world, what):
    """gather: rank 0 asks for more rows than any host can hold (4 TiB: refused at once)
    while rank 1 asks for nothing. scatter: rank 1 sends a row to rank 0, whose allocator
    refuses the room for it. The failing rank's error reaches the exchange, so no rank waits
    in the next collective until the group's timeout."""
    import time

    mt = _make("distributed", "device", (64, 1 << 18))  # rows of 1 MiB; rank 0 owns row 0
    none = torch.empty(0, dtype=torch.int64)
    real_empty = torch.empty

    def refusing_empty(*size, **kw):  # an allocator with no room for 1 MiB of rows
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        itemsize = real_empty((), dtype=kw.get("dtype")).element_size()
        if math.prod(shape) * itemsize >= 1 << 20:
            raise RuntimeError("injected: out of memory")
        return real_empty(*size, **kw)

    start = time.monotonic()
    try:
        if what == "gather":
            mt.gather(torch.zeros(1 << 22, dtype=torch.int64) if rank == 0 else none)
        else:
            if rank == 0:
                torch.empty = refusing_empty
            mt.scatter(torch.zeros(1, dtype=torch.int64) if rank == 1 else none,
                       torch.ones(1 if rank == 1 else 0, 1 << 18))
        error = None
    except VMMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        torch.empty = real_empty
    seconds = time.monotonic() - start
    again = mt.gather(torch.tensor([0, 63]))  # the group is still in step
    mt.close()
    return {"error": error, "seconds": seconds, "again": tuple(again.shape)}


@pytest.mark.parametrize("what", ["gather", "scatter"])
def test_a_rank_out_of_memory_mid_call_makes_every_rank_raise_the_same_error(what):
    # group_timeout=120 > the run's deadline: a rank left waiting would be killed
    values = check_ranks(run_ranks(_out_of_memory_mid_call, 2, args=(what,),
                                   timeout=TIMEOUT, group_timeout=120))
    assert values[0]["error"] is not None and values[0]["error"] == values[1]["error"], \
        values
    assert values[0]["error"].startswith("DistributedError") and "rank(s) [0]" in \
        values[0]["error"], values[0]["error"]
    assert all(v["again"] == (2, 1 << 18) for v in values), values


def _same_row_from_two_ranks_on_rank_1(rank, world):
    mt = _make("distributed", "device", (4096, 256))  # 1 KiB rows: rank 1 owns 2048..4095
    try:
        mt.scatter(torch.tensor([3000]), torch.ones(1, 256))
        error = None
    except DistributedError as exc:
        error = str(exc)
    owners = mt.memory.partition.owners
    mt.close()
    return {"error": error, "owners": owners}


def test_a_row_named_by_two_ranks_is_named_by_its_global_index():
    for v in check_ranks(run_ranks(_same_row_from_two_ranks_on_rank_1, 2, timeout=TIMEOUT)):
        assert v["owners"] == [0, 1], v
        assert v["error"] is not None and "rows [3000]" in v["error"], v["error"]


def _mask_as_indices(rank, world, kind):
    mt = _make(kind, "device", (64, 8))
    out = {}
    for name, idx in (("bool", torch.ones(64, dtype=torch.bool)),
                      ("uint8", torch.tensor([0, 1], dtype=torch.uint8)),
                      ("float", torch.tensor([0.0, 1.0]))):
        try:
            mt.gather(idx)
            out[name] = None
        except VMMError as exc:
            out[name] = str(exc)
    mt.close()
    return out


@pytest.mark.parametrize("kind", ["continuous", "distributed"])
def test_indices_of_another_dtype_get_a_remedy_that_keeps_their_meaning(kind):
    # a boolean mask turned into indices with .long() would name rows 0 and 1 only
    for v in check_ranks(run_ranks(_mask_as_indices, 2, args=(kind,), timeout=TIMEOUT)):
        assert "nonzero" in v["bool"] and ".long()" not in v["bool"], v["bool"]
        for name in ("uint8", "float"):
            assert "int64 or int32" in v[name] and ".long()" in v[name], v[name]
