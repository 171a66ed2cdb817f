"""Mapped memory and all-or-none sleep across real processes, on the host backend.

Every test starts 2 to 4 rank processes with a gloo group (vmm_core.testing.ranks: a hard
deadline, stragglers killed, the store directory removed) and checks, in every rank,
what the other ranks did: bytes written by one process through its mapping are read by
the others, which only holds if the pages are really shared.  The rank functions are
module-level so that they can be sent to the rank processes.
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
from proc_state import mapped as _mapped
from proc_state import memfd_maps as _memfd_maps

import vmm_core
from vmm_core.distributed import mapped_memory, mapped_tensor, partition_rows
from vmm_core.errors import DistributedError, OutOfMemoryError, VMMError
from vmm_core.memory import reaper
from vmm_core.testing import FaultInjector
from vmm_core.testing.ranks import check_ranks, run_ranks

TIMEOUT = 40  # hard deadline of one multi-process run (seconds)
SOCKET_TIMEOUT = 3.0  # how long a rank waits for another rank's file descriptors


def _data(rank: int, shape) -> torch.Tensor:
    """Random, but the same in every process for a given rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1234 + rank))






# ------------------------------------------------------------------ rank functions
def _write_neighbour_read_all(rank, world, kind, location, shape):
    """Rank r writes its random rows into rank r+1's part; every rank reads every part."""
    mt = mapped_tensor(shape, torch.float32, kind=kind, location=location, backend="host",
                       timeout=SOCKET_TIMEOUT)
    try:
        owners = mt.memory.partition.owners
        target = owners[(owners.index(rank) + 1) % len(owners)] if rank in owners else None
        if target is not None:
            dst = mt.chunks[target]
            dst.copy_(_data(rank, dst.shape))  # through this process's mapping of it
        _barrier()
        wrong = []
        for owner in owners:
            writer = owners[(owners.index(owner) - 1) % len(owners)]
            if not torch.equal(mt.chunks[owner], _data(writer, mt.chunks[owner].shape)):
                wrong.append(owner)
        whole = None
        if kind == "continuous":
            whole = torch.cat([mt.chunks[r] for r in range(world)])
            assert torch.equal(mt.tensor, whole) and mt.tensor.shape == shape
            assert mt.tensor.data_ptr() == mt.memory.address
        assert mt.local_part().data_ptr() == mt.chunks[rank].data_ptr()
        return {"wrong": wrong, "owners": owners,
                "rows": [tuple(c.shape) for c in mt.chunks]}
    finally:
        mt.close()


def _close_releases_everything(rank, world):
    _barrier()
    gc.collect()  # unrelated garbage holding descriptors must not move the baseline
    fds, maps = _fd_table(), _memfd_maps()

    def left_open():  # descriptors opened since the baseline and still open
        return {fd: t for fd, t in _fd_table().items() if fds.get(fd) != t}

    made = []
    for kind in ("continuous", "chunked"):
        for location in ("device", "host"):
            mt = mapped_tensor((96, 1024), torch.float32, kind=kind, location=location,
                               backend="host", timeout=SOCKET_TIMEOUT)
            mt.local_part().fill_(rank + 1)
            made.append(mt)
    during = (len(left_open()), _memfd_maps() - maps)
    bases = [mt.memory.part_address(r) for mt in made for r in mt.memory.partition.owners]
    for mt in made:
        mt.close()
        mt.close()  # idempotent
    after_close = (left_open(), _memfd_maps() - maps, [b for b in bases if _mapped(b)])
    # forgotten objects: the finalizer frees this process's share without collectives
    forgotten = mapped_tensor((96, 1024), torch.float32, backend="host",
                              timeout=SOCKET_TIMEOUT)
    forgotten.local_part().fill_(rank + 1.0)
    base = forgotten.memory.address
    view = forgotten.local_part()[1:].view(-1)  # a view outliving the object keeps it alive
    del forgotten
    gc.collect()
    view_alive = _mapped(base) and bool((view == rank + 1.0).all())
    del view
    gc.collect()
    reaper.drain()  # finalizers free on the reaper thread, never inside the collector
    after_gc = (left_open(), _memfd_maps() - maps, _mapped(base))
    return {"during": during, "after_close": after_close, "view_alive": view_alive,
            "after_gc": after_gc}


def _die_during(rank, world, step):
    """Rank 1 dies at ``step`` of the setup; the others must raise, not hang."""
    from vmm_core.distributed import fd_passing

    host = vmm_core.get_backend("host")
    if rank == 1:
        if step == "create":
            host.create_shareable_handle = lambda *a, **k: os._exit(7)
        else:
            fd_passing.send_fds = lambda *a, **k: os._exit(7)
    gc.collect()
    before = _fd_table()
    t0 = time.monotonic()
    try:
        mapped_tensor((64, 1024), torch.float32, backend="host", timeout=SOCKET_TIMEOUT)
    except DistributedError as exc:
        seconds = time.monotonic() - t0
        # gloo closes its socket to the dead rank; nothing may be left open by us
        new = {fd: t for fd, t in _fd_table().items() if before.get(fd) != t}
        return {"error": str(exc), "seconds": seconds, "new_fds": new,
                "memfd_maps": _memfd_maps()}
    return {"error": None}


def _other_host(rank, world):
    import socket

    if rank == 1:
        socket.gethostname = lambda: "some-other-node"
    with pytest.raises(DistributedError) as info:
        mapped_tensor((64, 1024), torch.float32, backend="host", timeout=SOCKET_TIMEOUT)
    return str(info.value)


def _different_shapes(rank, world):
    with pytest.raises(DistributedError) as info:
        mapped_tensor((64 + rank, 1024), torch.float32, backend="host", timeout=SOCKET_TIMEOUT)
    return str(info.value)


class _OffloadCopyFails(FaultInjector):
    """A backend whose device-to-host copies fail, as an offload out of host memory."""

    def copy_to_host(self, device, address, host_address, size):
        raise OutOfMemoryError("injected: no host memory for the offload copy")


def _sleep_wake_all_or_none(rank, world):
    group = torch.distributed.group.WORLD
    with vmm_core.region("w", backend="host") as alloc:
        address = alloc.allocate(1 << 20)
    mine = _data(rank, (1 << 18,))
    view = vmm_core.get_backend("host").torch_tensor(0, address, 1 << 20).view(torch.float32)
    view.copy_(mine)
    real = alloc.backend
    out = {}

    # a sleep that fails on rank 1: everyone stays awake, with its bytes
    if rank == 1:
        alloc.backend = _OffloadCopyFails(real)
    try:
        vmm_core.sleep("w", offload="w", group=group)
        out["sleep"] = None
    except VMMError as exc:
        out["sleep"] = (type(exc).__name__, str(exc))
    alloc.backend = real
    out["awake_after_failed_sleep"] = not alloc.asleep and torch.equal(view, mine)

    # a real sleep, then a wake that runs out of memory on rank 1: everyone stays asleep
    vmm_core.sleep("w", offload="w", group=group)
    if rank == 1:
        injector = FaultInjector(real)
        injector.fail_create_after = 0
        alloc.backend = injector
    try:
        vmm_core.wake_up("w", group=group)
        out["wake"] = None
    except VMMError as exc:
        out["wake"] = (type(exc).__name__, str(exc))
    alloc.backend = real
    out["asleep_after_failed_wake"] = alloc.asleep and alloc.physical_bytes == 0

    vmm_core.wake_up("w", group=group)  # and the retry wakes everyone with the bytes
    out["bytes_after_retry"] = torch.equal(view, mine)
    return out


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("location", ["device", "host"])
@pytest.mark.parametrize("kind", ["continuous", "chunked"])
def test_bytes_written_by_one_rank_are_read_by_all(kind, location, world):
    shape = (40 * world + 3, 1024)  # 4 KiB rows: every rank owns some, the last fewer
    values = check_ranks(run_ranks(_write_neighbour_read_all, world,
                                   args=(kind, location, shape), timeout=TIMEOUT))
    for v in values:
        assert v["wrong"] == [], v
        assert v["owners"] == list(range(world))
    rows = values[0]["rows"]
    assert sum(r[0] for r in rows) == shape[0] and all(v["rows"] == rows for v in values)


def test_rows_are_never_split_and_parts_are_granular():
    # 132-byte rows on 4 KiB pages: parts are multiples of 1024 rows (1024 * 132 B = 33
    # pages), so a 100-row tensor lives on rank 0 and rows stay whole
    p = partition_rows(100, 132, 2, 1, 4096)
    assert p.rows_per_rank == 1024 and p.owners == [0] and p.slot_bytes % 4096 == 0
    p = partition_rows(1000, 4096, 3, 8, 4096)
    assert p.rows_per_rank == 336 and p.row_range(2) == (672, 1000)
    assert sum(p.part_bytes(r) for r in range(3)) == 1000 * 4096
    with pytest.raises(VMMError, match="granularity"):
        partition_rows(10, 4, 2, 0, 4096)


def test_odd_row_sizes_keep_whole_rows_in_one_part():
    values = check_ranks(run_ranks(_write_neighbour_read_all, 2,
                                   args=("continuous", "device", (100, 33)), timeout=TIMEOUT))
    assert values[0]["owners"] == [0] and values[0]["wrong"] == []


def test_close_and_finalizer_release_every_fd_and_mapping():
    for v in check_ranks(run_ranks(_close_releases_everything, 2, timeout=TIMEOUT)):
        assert v["during"][0] > 0 and v["during"][1] > 0  # there was something to release
        assert v["after_close"] == ({}, 0, []), v
        assert v["view_alive"], "the finalizer freed memory a view still used"
        assert v["after_gc"] == ({}, 0, False), v


@pytest.mark.parametrize("step", ["create", "send"])
def test_a_rank_dying_mid_setup_makes_the_others_raise(step):
    results = run_ranks(_die_during, 3, args=(step,), timeout=TIMEOUT, group_timeout=10)
    assert results[1].exitcode == 7 and not results[1].finished
    for r in (results[0], results[2]):
        assert r.ok, r
        assert r.value["error"] is not None, "a rank returned although its peer died"
        assert r.value["seconds"] < 15, r.value
        assert "rank" in r.value["error"]
        assert r.value["new_fds"] == {} and r.value["memfd_maps"] == 0, r.value


def test_ranks_on_different_hosts_are_refused_with_the_remedy():
    messages = check_ranks(run_ranks(_other_host, 2, timeout=TIMEOUT))
    assert messages[0] == messages[1]
    assert "single-node" in messages[0] and "some-other-node" in messages[0]
    assert "new_group" in messages[0]


def test_ranks_with_different_arguments_are_refused():
    messages = check_ranks(run_ranks(_different_shapes, 2, timeout=TIMEOUT))
    assert messages[0] == messages[1] and "different shapes or dtypes" in messages[0]
    assert "(64, 1024)" in messages[0] and "(65, 1024)" in messages[0]


def test_sleep_and_wake_are_all_or_none_across_ranks():
    values = check_ranks(run_ranks(_sleep_wake_all_or_none, 2, timeout=TIMEOUT))
    for key in ("sleep", "wake"):
        errors = [v[key] for v in values]
        assert errors[0] is not None and errors[0] == errors[1], errors  # same type + text
        assert errors[0][0] == "OutOfMemoryError"
        assert "rank(s) [1]" in errors[0][1] and "every rank is back" in errors[0][1]
    for v in values:
        assert v["awake_after_failed_sleep"], "a rank stayed asleep after a failed sleep"
        assert v["asleep_after_failed_wake"], "a rank stayed awake after a failed wake"
        assert v["bytes_after_retry"], "bytes were lost by the rollbacks"


def test_mapped_memory_needs_an_initialized_group():
    with pytest.raises(DistributedError, match="init_process_group"):
        mapped_memory(4, 4096, backend="host")
    with pytest.raises(VMMError, match="kind"):
        mapped_memory(4, 4096, kind="striped", backend="host")


def test_bench_distributed_runs_on_two_host_ranks_under_torchrun(tmp_path):
    """The CI smoke test of `vmm-core bench --distributed`: the GPU flow, on the host."""
    import json
    import subprocess
    import sys

    out = tmp_path / "dist.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "vmm_core.cli", "bench", "--distributed", "--json", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "HOST RUN" in proc.stdout
    report = json.loads(out.read_text())
    assert report["host_run"] and report["ranks"] == 2 and report["gathers_correct"]
    assert [r["remote parts"] is not None for r in report["per_rank"]] == [True, True]
    # every kind's gather/scatter beside all_to_all_single, 4 KiB and 256 B rows
    assert sorted(report["gather_scatter"]) == ["256", "4096"]
    for ranks in report["gather_scatter"].values():
        assert len(ranks) == 2 and all(r["distributed gather"]["correct"] and
                                       r["distributed scatter"]["correct"] and
                                       r["all_to_all_single"]["gib_s"] > 0 for r in ranks)
    assert "all_to_all_single" in proc.stdout and "host memory over gloo" in proc.stdout


def test_bench_distributed_outside_torchrun_leaves_no_folder(tmp_path):
    """One rank without torchrun keeps its group's store in a folder of its own, removed
    when the run ends."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}
    proc = subprocess.run([sys.executable, "-m", "vmm_core.cli", "bench", "--distributed",
                           "--quiet"], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**env, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not under torchrun: one rank" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_failed_distributed_bench_leaves_its_group_and_its_folder(tmp_path, monkeypatch):
    import tempfile

    import vmm_bench.distributed as bench
    from vmm_bench.spec import BenchSpec, DistributedSpec

    def fails(*args, **kwargs):
        assert torch.distributed.is_initialized() and list(tmp_path.iterdir())
        raise RuntimeError("injected: a row failed")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bench, "_measure", fails)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="injected"):
        bench.run_distributed_bench(BenchSpec(backend="host", distributed=DistributedSpec()))
    assert not torch.distributed.is_initialized()
    assert list(tmp_path.iterdir()) == []


class _SyncFails(FaultInjector):
    def synchronize(self, device):
        from vmm_core.errors import BackendError

        raise BackendError("injected: device error in synchronize")


def _discard_step_fails_on_rank_1(rank, world):
    import ctypes

    with vmm_core.region("w", backend="host") as w:  # offloaded
        pw = w.allocate(1 << 20)
    with vmm_core.region("g", backend="host") as g:  # discarded
        g.allocate(1 << 20)
    ctypes.memmove(pw, b"weights!", 8)
    if rank == 1:
        g.backend = _SyncFails(g.backend)
    try:
        vmm_core.sleep(offload=("w",), group=torch.distributed.group.WORLD)
        error = None
    except VMMError as exc:
        error = str(exc)
    return {"error": error, "w_asleep": w.asleep, "g_asleep": g.asleep,
            "w_bytes": ctypes.string_at(pw, 8) if not w.asleep else None}


def test_a_failed_discard_step_undoes_the_offload_step_too():
    """A group sleep offloads first, then discards; when the discard fails on one rank,
    every rank is back awake with its offloaded bytes, and the message says so."""
    for r in check_ranks(run_ranks(_discard_step_fails_on_rank_1, 2, timeout=60)):
        assert not r["w_asleep"] and not r["g_asleep"], r
        assert r["w_bytes"] == b"weights!"
        assert "offload step before it was undone too" in r["error"]
        # rank 0 discarded g before rank 1 failed: the error says so
        assert "rank 0 had discarded ['g'] (their bytes are lost" in r["error"], r["error"]
        assert "every rank is back where it started" not in r["error"]


def _different_tags(rank, world):
    with vmm_core.region("w", backend="host") as w:
        w.allocate(1 << 20)
    if rank == 0:
        with vmm_core.region("extra", backend="host") as e:
            e.allocate(1 << 20)
    try:
        vmm_core.sleep(offload=("w",), group=torch.distributed.group.WORLD)
        error = None
    except VMMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    vmm_core.wake_up(group=torch.distributed.group.WORLD)  # still paired: one step each
    return {"error": error, "w_asleep": w.asleep}


def test_ranks_with_different_tags_refuse_a_group_sleep_together():
    results = check_ranks(run_ranks(_different_tags, 2, timeout=60))
    for r in results:
        assert r["error"].startswith("DistributedError") and "different tags" in r["error"]
        assert not r["w_asleep"]


def _imports(path) -> set[str]:
    """Every module a source file imports (absolute names; relative ones resolved)."""
    import ast

    package = "vmm_core." + path.parent.name
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_single_process_memory_never_imports_the_distributed_package():
    """memory/ is the layer under distributed/: an import back (memory/tagged.py importing
    memory/collective.py, which imports tagged) would be a circle."""
    from pathlib import Path

    root = Path(vmm_core.__file__).parent / "memory"
    back = {p.name: sorted(m for m in _imports(p) if m.startswith("vmm_core.distributed"))
            for p in root.glob("*.py")}
    assert not {k: v for k, v in back.items() if v}


# ------------------------------------------------------------------ group steps refused on one rank
def _held_awake_on_rank_1(rank, world):
    """Rank 1 holds "kv" awake, so its part of the group sleep is
    refused; no rank may discard first."""
    import ctypes

    from vmm_core.memory import tagged

    with vmm_core.region("kv", backend="host") as kv:
        p = kv.allocate(1 << 20)
    ctypes.memmove(p, b"kv-bytes", 8)
    held = tagged.hold_awake("kv") if rank == 1 else contextlib.nullcontext()
    with held:
        try:
            vmm_core.sleep(["kv"], group=torch.distributed.group.WORLD)
            error = None
        except VMMError as exc:
            error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "asleep": kv.asleep,
            "bytes": None if kv.asleep else ctypes.string_at(p, 8)}


def test_a_group_sleep_refused_on_one_rank_discards_nothing_anywhere():
    results = check_ranks(run_ranks(_held_awake_on_rank_1, 2, timeout=TIMEOUT))
    assert results[0]["error"] == results[1]["error"]
    assert "held awake" in results[0]["error"] and "rank(s) [1]" in results[0]["error"]
    for r in results:
        assert not r["asleep"] and r["bytes"] == b"kv-bytes", r


def _close_inside_a_hold_on_rank_1(rank, world):
    """Closing mapped memory on a rank that holds its part awake closed most of it there
    (its tag gone, its allocator left open and untracked) while the other ranks closed."""
    mt = mapped_tensor((64, 1024), torch.float32, kind="distributed", location="device",
                       backend="host", tag="kv-close", timeout=SOCKET_TIMEOUT)
    mt.local_part().fill_(rank + 1.0)
    hold = vmm_core.memory.tagged.hold_awake("kv-close") if rank == 1 \
        else contextlib.nullcontext()
    with hold:
        try:
            mt.close()
            error = None
        except VMMError as exc:
            error = f"{type(exc).__name__}: {exc}"
    after = {"error": error, "closed": mt.memory.closed,
             "sum": float(mt.local_part().sum()), "tags": vmm_core.memory.tagged.tags()}
    mt.close()
    after["closed_after"] = mt.memory.closed
    return after


def test_closing_mapped_memory_inside_a_hold_on_one_rank_closes_nothing_anywhere():
    results = check_ranks(run_ranks(_close_inside_a_hold_on_rank_1, 2, timeout=TIMEOUT))
    assert results[0]["error"] == results[1]["error"], results
    assert results[0]["error"].startswith("DistributedError") and \
        "rank 1: close() inside" in results[0]["error"]
    for rank, r in enumerate(results):
        assert not r["closed"] and r["sum"] == (rank + 1.0) * 32 * 1024, r
        assert "kv-close" in r["tags"] and r["closed_after"], r


def _bad_tags_on_rank_1(rank, world, call):
    """A group sleep (or wake) whose tags= is not a tag list on one rank."""
    with vmm_core.region("w", backend="host") as w:
        w.allocate(1 << 20)
    if call == "wake_up":
        vmm_core.sleep("w")
    start = time.monotonic()
    try:
        getattr(vmm_core, call)(123 if rank == 1 else "w", group=torch.distributed.group.WORLD)
        error = None
    except VMMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "asleep": w.asleep, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("call", ["sleep", "wake_up"])
def test_a_bad_tags_argument_on_one_rank_refuses_on_every_rank_at_once(call):
    # group_timeout=120 > the run's deadline: a rank left waiting would be killed
    results = check_ranks(run_ranks(_bad_tags_on_rank_1, 2, args=(call,), timeout=60,
                                    group_timeout=120))
    assert results[0]["error"] == results[1]["error"]
    assert results[0]["error"].startswith("DistributedError") and "rank(s) [1]" in \
        results[0]["error"]
    # nothing changed on any rank: awake before a sleep, asleep before a wake
    assert all(r["asleep"] == (call == "wake_up") for r in results), results


def _one_family_of_a_shared_allocator(rank, world):
    """Two GraphPools on one allocator: a group sleep naming one of their tags would lose
    what the other kept; every rank refuses before any sleeps."""
    from host_space import framework_alloc, read, write

    alloc = vmm_core.SharedVMMAllocator("host")
    full = vmm_core.GraphPool(backend="host", allocator=alloc, tag="full")
    pieces = vmm_core.GraphPool(backend="host", allocator=alloc, tag="pieces")
    with full.space(1):
        pass
    with pieces.space(1):
        out = framework_alloc(1 << 20)
        pieces.keep(out)
    write(out, b"kept")
    try:
        vmm_core.sleep(["full"], group=torch.distributed.group.WORLD)
        error = None
    except VMMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    result = {"error": error, "asleep": alloc.asleep}
    vmm_core.sleep(["full", "pieces"], offload=["pieces"], group=torch.distributed.group.WORLD)
    vmm_core.wake_up(group=torch.distributed.group.WORLD)
    pieces.before_replay(1)
    result["bytes"] = read(out, 4)
    return result


def test_a_group_sleep_of_one_tag_of_a_shared_allocator_is_refused_everywhere():
    results = check_ranks(run_ranks(_one_family_of_a_shared_allocator, 2, timeout=TIMEOUT))
    assert results[0]["error"] == results[1]["error"] and "['pieces']" in results[0]["error"]
    assert all(not r["asleep"] and r["bytes"] == b"kept" for r in results), results


def _mismatched_tensors(rank, world, case):
    """Equal row bytes are not enough to share memory: shape and dtype must match too."""
    shape, dtype = {"dtype": [((8, 4), torch.float32), ((8, 4), torch.int32)],
                    "shape": [((8, 4), torch.float32), ((8, 2, 2), torch.float32)]}[case][rank]
    try:
        mt = mapped_tensor(shape, dtype, backend="host", timeout=SOCKET_TIMEOUT)
    except DistributedError as exc:
        return str(exc)
    mt.close()
    return None


@pytest.mark.parametrize("case", ["dtype", "shape"])
def test_ranks_with_different_dtypes_or_shapes_of_equal_row_bytes_are_refused(case):
    messages = check_ranks(run_ranks(_mismatched_tensors, 2, args=(case,), timeout=TIMEOUT))
    assert messages[0] is not None and messages[0] == messages[1]
    assert "different shapes or dtypes" in messages[0]
    assert ("torch.int32" if case == "dtype" else "(8, 2, 2)") in messages[0]


def _bad_argument_on_rank_1(rank, world, which):
    """A bad argument on one rank is checked locally, but must not leave the others
    waiting in the next collective for the whole group timeout."""
    args = {"shape": (64, 1024), "dtype": torch.float32, "kind": "continuous",
            "location": "device", "backend": "host"}
    if rank == 1:
        args[which] = {"shape": (64, -1), "dtype": "float32", "kind": "striped",
                       "location": "disk", "backend": "no-such-backend"}[which]
    try:
        mt = mapped_tensor(args.pop("shape"), args.pop("dtype"), timeout=SOCKET_TIMEOUT,
                           **args)
    except VMMError as exc:
        return f"{type(exc).__name__}: {exc}"
    mt.close()
    return None


@pytest.mark.parametrize("which", ["shape", "dtype", "kind", "location", "backend"])
def test_a_bad_argument_on_one_rank_refuses_on_every_rank_at_once(which):
    # group_timeout > the run's deadline: a rank left waiting would be killed, not raise
    results = run_ranks(_bad_argument_on_rank_1, 2, args=(which,), timeout=40,
                        group_timeout=120)
    messages = check_ranks(results)
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert messages[0].startswith("DistributedError") and "rank(s) [1]" in messages[0]


def _read_view_after_close(rank, world, kind, location):
    """A view read after close() reads no unmapped memory on any rank."""
    mt = mapped_tensor((64, 1024), torch.float32, kind=kind, location=location,
                       backend="host", timeout=SOCKET_TIMEOUT)
    mt.local_part().fill_(rank + 1.0)
    _barrier()
    view = mt.local_part()[2:5]
    base = view.data_ptr()
    # the other rank's rows, through .chunks (and .tensor for continuous): its memory
    peer = None if kind == "distributed" else mt.chunks[1 - rank][0:2]
    whole = mt.tensor if kind == "continuous" else None
    mt.close()
    after = {"sum": float(view.sum()), "mapped_while_viewed": _mapped(base)}
    if peer is not None:
        after["peer_sum"] = float(peer.sum())
        after["peer_mapped_while_viewed"] = _mapped(peer.data_ptr())
        peer_base = peer.data_ptr()
    if whole is not None:
        after["whole_sum"] = float(whole.sum())
    try:
        mt.local_part()
    except VMMError as exc:
        after["local_part"] = str(exc)
    _barrier()  # both ranks read the other's rows before either drops its views
    del view, peer, whole
    gc.collect()
    reaper.drain()
    after["mapped_after_views"] = _mapped(base)
    if kind != "distributed":
        after["peer_mapped_after_views"] = _mapped(peer_base)
    return after


@pytest.mark.parametrize("kind,location", [("continuous", "device"), ("chunked", "device"),
                                           ("continuous", "host"), ("distributed", "device"),
                                           ("distributed", "host")])
def test_a_view_read_after_close_does_not_crash_and_is_freed_when_dropped(kind, location):
    values = check_ranks(run_ranks(_read_view_after_close, 2, args=(kind, location),
                                   timeout=TIMEOUT))
    for rank, v in enumerate(values):
        assert v["sum"] == (rank + 1.0) * 3 * 1024
        assert v["mapped_while_viewed"] and not v["mapped_after_views"], v
        assert "closed" in v["local_part"]
        if kind != "distributed":
            assert v["peer_sum"] == (2 - rank) * 2 * 1024, v
            assert v["peer_mapped_while_viewed"] and not v["peer_mapped_after_views"], v
        if kind == "continuous":
            assert v["whole_sum"] == (1.0 + 2.0) * 32 * 1024, v


def test_the_distributed_bench_does_not_import_the_cli():
    """The benchmark's scenarios never import the command above them: the command
    imports the runner, which imports the scenarios."""
    from pathlib import Path

    import vmm_bench.distributed

    path = Path(vmm_bench.distributed.__file__)
    assert path.parent.name == "bench"
    # _imports resolves relative names under vmm_core.<folder>: any ``cli`` is the command
    assert not [m for m in _imports(path) if m.endswith(".cli") or ".cli." in m]


def _wake_different_tags(rank, world):
    """A group wake where the ranks name different tags: each woke its own tag and the
    call returned, leaving rank 0 with "a" awake and rank 1 with "b" awake."""
    group = torch.distributed.group.WORLD
    with vmm_core.region("a", backend="host") as a:
        a.allocate(1 << 20)
    with vmm_core.region("b", backend="host") as b:
        b.allocate(1 << 20)
    vmm_core.sleep(["a", "b"], group=group)
    try:
        vmm_core.wake_up("a" if rank == 0 else "b", group=group)
        error = None
    except VMMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    asleep = (a.asleep, b.asleep)
    vmm_core.wake_up(["b", "a"] if rank else ["a", "b"], group=group)  # same set: fine
    return {"error": error, "asleep": asleep, "awake_after": not (a.asleep or b.asleep)}


def test_ranks_with_different_tags_refuse_a_group_wake_together():
    results = check_ranks(run_ranks(_wake_different_tags, 2, timeout=60, group_timeout=120))
    assert results[0]["error"] is not None and results[0]["error"] == results[1]["error"]
    assert "different tags" in results[0]["error"], results[0]["error"]
    for r in results:
        assert r["asleep"] == (True, True) and r["awake_after"], r


def _wake_tags_given_as_a_generator(rank, world):
    group = torch.distributed.group.WORLD
    with vmm_core.region("a", backend="host") as a:
        a.allocate(1 << 20)
    vmm_core.sleep("a", group=group)
    vmm_core.wake_up((t for t in ["a"]), group=group)  # read once, not once per step
    return {"asleep": a.asleep}


def test_a_group_wake_reads_its_tags_once():
    for r in check_ranks(run_ranks(_wake_tags_given_as_a_generator, 2, timeout=60)):
        assert r == {"asleep": False}, r


def _same_tags_in_another_order(rank, world):
    """The same tags listed in another order (a set's order differs between processes
    whose string hashes differ, as under torchrun) must not refuse a group sleep."""
    group = torch.distributed.group.WORLD
    with vmm_core.region("a", backend="host") as a:
        a.allocate(1 << 20)
    with vmm_core.region("b", backend="host") as b:
        b.allocate(1 << 20)
    order = ["a", "b"] if rank == 0 else ["b", "a"]
    out = []
    for offload in ((), order):
        try:
            vmm_core.sleep(order, offload=offload, group=group)
            error = None
        except VMMError as exc:
            error = str(exc)
        out.append((error, a.asleep, b.asleep))
        vmm_core.wake_up(group=group)
    return out


def test_a_group_sleep_accepts_the_same_tags_in_any_order():
    for r in check_ranks(run_ranks(_same_tags_in_another_order, 2, timeout=60)):
        assert r == [(None, True, True)] * 2, r


def _close_against_a_group_sleep(rank, world):
    """Rank 0 closes a mapped tensor while rank 1 puts a tag to sleep over the same group:
    both steps are all-gathers of one shape, so without the call header they would pair up
    (rank 1 taking rank 0's 'closing' value for its tag plan) and rank 0 would go on."""
    mt = mapped_tensor((64, 1024), torch.float32, backend="host", timeout=SOCKET_TIMEOUT)
    with vmm_core.region("w", backend="host") as w:
        w.allocate(1 << 20)
    try:
        if rank == 0:
            mt.close()
        else:
            vmm_core.sleep("w", group=torch.distributed.group.WORLD)
        error = None
    except VMMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    _barrier()  # still in step
    return {"error": error, "asleep": w.asleep}


def test_ranks_in_different_collective_calls_all_raise_naming_them():
    results = check_ranks(run_ranks(_close_against_a_group_sleep, 2, timeout=60,
                                    group_timeout=120))
    for r in results:
        # a DistributedError: the kind that says the ranks made different calls
        assert r["error"] is not None and r["error"].startswith("CallMismatchError"), r
        assert "closing mapped memory" in r["error"] and "vmm_core.sleep" in r["error"], r
        assert not r["asleep"], r


def _inside_a_capture_space_on_rank_1(rank, world):
    """Rank 1 calls the group sleep inside a graph capture space of its own thread."""
    import ctypes

    with vmm_core.region("kv", backend="host") as kv:
        p = kv.allocate(1 << 20)
    ctypes.memmove(p, b"kv-bytes", 8)
    pool = vmm_core.GraphPool(backend="host", reads=())
    space = pool.space(1) if rank == 1 else contextlib.nullcontext()
    with space:
        try:
            vmm_core.sleep(["kv"], offload=["kv"], group=torch.distributed.group.WORLD)
            error = None
        except VMMError as exc:
            error = f"{type(exc).__name__}: {exc}"
    pool.close()
    return {"error": error, "asleep": kv.asleep,
            "bytes": None if kv.asleep else ctypes.string_at(p, 8)}


def test_a_group_sleep_inside_a_capture_space_on_one_rank_refuses_everywhere():
    """A sleep inside a capture space of its own thread (which would synchronize and
    page-lock during the capture) is refused, and on every rank at once."""
    results = check_ranks(run_ranks(_inside_a_capture_space_on_rank_1, 2, timeout=TIMEOUT))
    assert results[0]["error"] == results[1]["error"]
    assert "inside the capture space of 1" in results[0]["error"], results[0]["error"]
    assert "rank(s) [1]" in results[0]["error"]
    for r in results:
        assert not r["asleep"] and r["bytes"] == b"kv-bytes", r
