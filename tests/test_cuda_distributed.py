"""Mapped memory on two GPUs: two processes, an NCCL group, kernels on each GPU.

Skipped without two GPUs; fails instead under VMM_CORE_REQUIRE=cuda.  One run of two
rank processes (GPU 0 and GPU 1) does every check and reports; the tests below assert
on its report.  What must hold: a kernel on one GPU writes into the other GPU's part
through the mapping and the other GPU's kernel reads it (both ways, every kind and
location), a gather kernel reads rows of both parts, views are on the rank's own
device and in place, and close() gives the device memory back.

A second run checks ``mt.gather`` / ``mt.scatter`` of every kind over NCCL (the
distributed kind's rows travel with ``all_to_all_single``) against a reference, with
ranks that claim different nodes (distributed works, mapped refuses), a rank failing
mid-call, rows moved in many pieces, and a tagged distributed part that sleeps and wakes
with its bytes.  A third run puts tags to sleep over the NCCL group (its phases recorded,
every byte back) and asks for the communicators' memory too: released where torch and
NCCL can (torch >= 2.12, NCCL >= 2.29.7), refused by every rank alike where they cannot.
close() giving the memory back is measured on what the rank owns (its handles, mappings
and the driver's answer for each part's address), never on the device's free memory,
which other processes move.

Run on the GPU machine:  VMM_CORE_REQUIRE=cuda python -m pytest tests -k cuda
(the one-process contract for the sharing hooks, export/import/alias on one GPU, is
``test_contract_exported_handle_aliases_after_import[cuda]`` in test_contract.py).
"""

from __future__ import annotations

import pytest

from vmm_core.testing.platforms import require_backend, skip_or_fail
from vmm_core.testing.ranks import check_ranks, run_ranks

pytestmark = pytest.mark.gpu

COMBOS = [(kind, location) for kind in ("continuous", "chunked")
          for location in ("device", "host")]
ROWS, COLS = 4096 + 17, 1024  # 4 KiB rows: 2 MiB parts hold 512 rows; uneven last part


def _use_gpu(rank: int) -> None:
    import torch

    torch.cuda.set_device(rank)


def _expected(writer: int, shape, device):
    import torch

    gen = torch.Generator().manual_seed(99 + writer)
    return (torch.randn(shape, generator=gen) * 2).to(device)


def _cuda_ranks(rank, world):
    import torch

    from vmm_core.distributed import mapped_tensor
    from vmm_core.distributed.group import Group

    dev = torch.device("cuda", rank)
    barrier = Group()
    report = {}
    for kind, location in COMBOS:
        mt = mapped_tensor((ROWS, COLS), torch.float32, kind=kind, location=location,
                           backend="cuda", device=rank, timeout=20)
        owners = mt.memory.partition.owners
        target = owners[(owners.index(rank) + 1) % len(owners)]
        dst = mt.chunks[target]
        src = torch.randn(dst.shape, generator=torch.Generator().manual_seed(99 + rank))
        # a kernel on this GPU writes into the next rank's part (its memory)
        torch.mul(src.to(dev), 2.0, out=dst)
        torch.cuda.synchronize()
        barrier.gather(None, "written")
        writer = owners[(owners.index(rank) - 1) % len(owners)]
        mine = mt.local_part()
        own_ok = bool(torch.equal(mine, _expected(writer, mine.shape, dev)))
        # a gather kernel reads rows of every part
        idx = torch.randint(0, ROWS, (2048,), device=dev)
        want = torch.cat([_expected(owners[(owners.index(r) - 1) % len(owners)],
                                    mt.chunks[r].shape, dev) for r in range(world)])
        if kind == "continuous":
            got = torch.index_select(mt.tensor, 0, idx)
        else:
            got = torch.index_select(torch.cat(mt.chunks), 0, idx)
        gather_ok = bool(torch.equal(got, want[idx]))
        views = mt.chunks + ([mt.tensor] if kind == "continuous" else [])
        report[f"{kind}/{location}"] = {
            "own_part_written_by_peer": own_ok,
            "gather_reads_every_part": gather_ok,
            "views_on_own_gpu": all(v.device == dev for v in views),
            "in_place": mt.local_part().data_ptr() == mt.memory.part_address(rank),
        }
        barrier.gather(None, "read")
        mt.close()

    # close gives the memory back (a 1 GiB table: 512 MiB a rank).  Measured on what this
    # rank owns, never on the device's free memory (other processes' teardown moves it):
    # the share's own handles and mappings, and the driver's answer for every part's
    # address, mapped before close and not after, in this process
    mt = mapped_tensor((1 << 18, 1024), torch.float32, backend="cuda", device=rank, timeout=20)
    mt.local_part().fill_(1.0)
    torch.cuda.synchronize()
    share = mt.memory._local
    parts = {r: mt.memory.part_address(r) for r in mt.memory.partition.owners}
    own_mib = sum(size for address, size in share.maps if address == parts[rank]) / 2**20
    before = {r: _mapped_here(address) for r, address in parts.items()}
    held = (len(share.handles), len(share.maps), len(share.ranges))
    mt.close()
    torch.cuda.synchronize()
    report["memory"] = {"own_mib": own_mib, "held": held, "mapped_before": before,
                        "mapped_after": {r: _mapped_here(a) for r, a in parts.items()},
                        "left": (len(share.handles), len(share.maps), len(share.ranges),
                                 len(share.fds))}
    return report


def _mapped_here(address: int) -> bool:
    """Whether the driver maps physical memory at ``address`` in this process: asked of
    cuMemRetainAllocationHandle, which fails for an address nothing is mapped at."""
    from cuda.bindings import driver

    err, handle = driver.cuMemRetainAllocationHandle(address)
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    driver.cuMemRelease(handle)  # the retain took a reference of its own
    return True


def _need_two_gpus() -> None:
    """A one-GPU run under VMM_CORE_REQUIRE=cuda is complete without these tests; the
    two-GPU run requires them too: VMM_CORE_REQUIRE=cuda,cuda-2gpu."""
    require_backend("cuda")
    import torch

    if torch.cuda.device_count() < 2:
        skip_or_fail("cuda-2gpu", f"needs 2 GPUs, found {torch.cuda.device_count()}")


def _two_gpu_run(fn, timeout: float) -> list:
    """``fn`` on two ranks over NCCL, GPU 0 and GPU 1; every rank's report.  A rank stuck
    in an NCCL collective is torn down by NCCL's watchdog after the group's 60 s
    (TORCH_NCCL_ASYNC_ERROR_HANDLING's default), before ``timeout``."""
    _need_two_gpus()
    return check_ranks(run_ranks(fn, 2, backend="nccl", before_init=_use_gpu,
                                 timeout=timeout, group_timeout=60))


@pytest.fixture(scope="module")
def report():
    # the three runs' deadlines (100 + 120 + 90 s) fit the 220 s scripts/device_distributed.sh
    # gives these tests only when none runs into its deadline: each takes far less
    return _two_gpu_run(_cuda_ranks, timeout=100)


@pytest.mark.parametrize("combo", [f"{k}/{loc}" for k, loc in COMBOS])
def test_cuda_kernels_write_and_read_peer_parts(report, combo):
    for rank, r in enumerate(report):
        assert r[combo] == {"own_part_written_by_peer": True, "gather_reads_every_part": True,
                            "views_on_own_gpu": True, "in_place": True}, (rank, r[combo])


def test_cuda_close_returns_device_memory(report):
    for rank, r in enumerate(report):
        mem = r["memory"]
        assert mem["own_mib"] == 512, (rank, mem)  # its own part: half of 1 GiB
        # its own handle and the other rank's, imported; each mapped once; one range
        assert mem["held"] == (2, 2, 1), (rank, mem)
        assert all(mem["mapped_before"].values()) and len(mem["mapped_before"]) == 2
        assert not any(mem["mapped_after"].values()), (rank, mem)
        assert mem["left"] == (0, 0, 0, 0), (rank, mem)


# ------------------------------------------------------------------ gather / scatter
GATHER_COMBOS = COMBOS + [("distributed", "device"), ("distributed", "host")]


def _cuda_gather_ranks(rank, world):
    import torch

    import vmm_core
    from vmm_core.distributed import mapped_tensor, node
    from vmm_core.distributed.group import Group
    from vmm_core.errors import DistributedError, VMMError

    dev = torch.device("cuda", rank)
    barrier = Group()
    ref = _expected(7, (ROWS, 256), dev)  # 1 KiB rows, the same table on every rank
    report = {}

    def sync_all():
        torch.cuda.synchronize()
        barrier.gather(None, "sync")

    for kind, location in GATHER_COMBOS:
        mt = mapped_tensor((ROWS, 256), torch.float32, kind=kind, location=location,
                           backend="cuda", device=rank, timeout=20)
        mine = torch.arange(rank, ROWS, world, device=dev)
        mt.scatter(mine, ref[mine])
        sync_all()
        idx = torch.randint(0, ROWS, (3 * ROWS,), device=dev)
        cases = {"random": idx, "duplicates": torch.tensor([1, 1, ROWS - 1], device=dev),
                 "empty": torch.empty(0, dtype=torch.int64, device=dev)}
        ok = {name: bool(torch.equal(mt.gather(i), ref[i])) for name, i in cases.items()}
        sync_all()
        errors = {}
        for name, bad in (("range", torch.tensor([ROWS], device=dev)),
                          ("device", torch.tensor([0]))):  # CPU indices, GPU rows
            try:
                mt.gather(bad if rank == 1 else torch.tensor([0], device=dev))
                errors[name] = None
            except VMMError as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
        sync_all()
        report[f"{kind}/{location}"] = {"ok": ok, "errors": errors,
                                        "device": str(mt.gather(cases["empty"]).device)}
        mt.close()

    # rows moved in many pieces (each piece's rows read while the group moves the one
    # before): a scatter of every row and a gather of 4 x ROWS random rows, 4 KiB each
    from vmm_core.distributed import exchange

    default_piece = exchange.PIECE_BYTES
    exchange.PIECE_BYTES = 1 << 16
    ref4 = _expected(8, (ROWS, 1024), dev)
    mt = mapped_tensor((ROWS, 1024), torch.float32, kind="distributed", backend="cuda",
                       device=rank, timeout=20)
    perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(5)).to(dev)
    mt.scatter(perm[rank::world], ref4[perm[rank::world]])
    many = torch.randint(0, ROWS, (4 * ROWS,), device=dev,
                         generator=torch.Generator(device=dev).manual_seed(rank))
    report["pieces"] = bool(torch.equal(mt.gather(many), ref4[many]))
    exchange.PIECE_BYTES = default_piece
    mt.close()

    # a rank failing between two exchanges: every rank raises the same error, in step
    mt = mapped_tensor((ROWS, 256), torch.float32, kind="distributed", backend="cuda",
                       device=rank, timeout=20)
    mt.scatter(torch.arange(rank, ROWS, world, device=dev),
               ref[torch.arange(rank, ROWS, world, device=dev)])
    if rank == 1:
        def broken():
            raise RuntimeError("injected: the owner's local read failed")
        mt.local_part = broken
    try:
        mt.gather(torch.arange(ROWS, device=dev))
        report["mid_call"] = None
    except VMMError as exc:
        report["mid_call"] = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        del mt.local_part
    report["after_mid_call"] = bool(torch.equal(mt.gather(torch.arange(ROWS, device=dev)),
                                                ref))
    mt.close()

    # a tagged distributed part sleeps and wakes with its bytes
    mt = mapped_tensor((ROWS, 256), torch.float32, kind="distributed", backend="cuda",
                       device=rank, timeout=20, tag="emb")
    mt.scatter(torch.arange(rank, ROWS, world, device=dev),
               ref[torch.arange(rank, ROWS, world, device=dev)])
    world_group = torch.distributed.group.WORLD
    vmm_core.sleep("emb", offload="emb", group=world_group)
    asleep = vmm_core.memory_summary()["emb"]["device_bytes"] == 0
    vmm_core.wake_up("emb", group=world_group)
    report["sleep"] = asleep and bool(torch.equal(mt.gather(torch.arange(ROWS, device=dev)),
                                                  ref))
    mt.close()

    # ranks that claim different nodes: distributed works, mapped refuses
    if rank == 1:
        real = node.identity
        node.identity = lambda: dict(real(), host="another-node")
    mt = mapped_tensor((ROWS, 256), torch.float32, kind="distributed", backend="cuda",
                       device=rank, timeout=20)
    mt.scatter(torch.arange(rank, ROWS, world, device=dev),
               ref[torch.arange(rank, ROWS, world, device=dev)])
    report["nodes_distributed"] = bool(torch.equal(mt.gather(idx), ref[idx]))
    mt.close()
    try:
        mapped_tensor((ROWS, 256), torch.float32, backend="cuda", device=rank, timeout=20)
        report["nodes_continuous"] = None
    except DistributedError as exc:
        report["nodes_continuous"] = str(exc)
    return report


@pytest.fixture(scope="module")
def gather_report():
    return _two_gpu_run(_cuda_gather_ranks, timeout=120)


@pytest.mark.parametrize("combo", [f"{k}/{loc}" for k, loc in GATHER_COMBOS])
def test_cuda_gather_and_scatter_match_a_reference_over_nccl(gather_report, combo):
    for rank, r in enumerate(gather_report):
        entry = r[combo]
        assert entry["ok"] == {"random": True, "duplicates": True, "empty": True}, (rank, entry)
        assert entry["device"] == f"cuda:{rank}"
    errors = gather_report[1][combo]["errors"]  # rank 1 passed the bad indices
    assert "[0, 4113)" in errors["range"] and "cpu" in errors["device"]
    if combo.startswith("distributed"):  # collective: the same error on both ranks
        assert gather_report[0][combo]["errors"] == errors


def test_cuda_distributed_gather_fails_together_sleeps_and_crosses_nodes(gather_report):
    r0, r1 = gather_report
    assert r0["pieces"] and r1["pieces"]
    assert r0["mid_call"] == r1["mid_call"] and "injected" in r0["mid_call"]
    assert r0["after_mid_call"] and r1["after_mid_call"]
    assert r0["sleep"] and r1["sleep"]
    assert r0["nodes_distributed"] and r1["nodes_distributed"]
    assert r0["nodes_continuous"] == r1["nodes_continuous"]
    assert "single-node" in r0["nodes_continuous"]


# ------------------------------------------------------------------ group sleep on NCCL
def _cuda_group_sleep_ranks(rank, world):
    import torch

    import vmm_core
    from vmm_core.distributed import last_timings, prepare_group
    from vmm_core.errors import VMMError

    dev = torch.device("cuda", rank)
    group = torch.distributed.group.WORLD
    report = {"prepare_s": prepare_group()}
    with vmm_core.region("w"):
        w = torch.randn(64 << 20, device=dev)  # 256 MiB offloaded
    with vmm_core.region("kv"):
        torch.empty(64 << 20, device=dev)  # 256 MiB discarded
    want = w.clone()
    rounds = []
    for _ in range(2):
        vmm_core.sleep(["w", "kv"], offload="w", group=group)
        slept = last_timings("sleep")
        vmm_core.wake_up(group=group)
        torch.cuda.synchronize()
        rounds.append({"sleep": list(slept["phases"]), "copied": slept["copied_bytes"],
                       "wake": list(last_timings("wake_up")["phases"]),
                       "bytes": bool(torch.equal(w, want))})
    report["rounds"] = rounds

    # communicators asleep too, where torch and the library under it can release them
    backend = group._get_backend(dev)
    try:
        backend.memory_stats()
        report["can_suspend"] = hasattr(backend, "suspend")
    except Exception:  # torch without suspend(), or a library too old for it
        report["can_suspend"] = False
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info(dev)[0]
    try:
        vmm_core.sleep(["w", "kv"], offload="w", group=group, communicators=True)
        report["comm_error"] = None
        report["comm_freed_mib"] = (torch.cuda.mem_get_info(dev)[0] - free0) / 2**20
        vmm_core.wake_up(group=group)
    except VMMError as exc:
        report["comm_error"] = f"{type(exc).__name__}: {exc}"
    check = torch.full((1,), 1.0, device=dev)
    torch.distributed.all_reduce(check)  # the group works after either outcome
    report["after"] = check.item() == world and bool(torch.equal(w, want))
    report["awake"] = not any(vmm_core.memory_summary()[t]["asleep"] for t in ("w", "kv"))
    return report


@pytest.fixture(scope="module")
def group_sleep_report():
    return _two_gpu_run(_cuda_group_sleep_ranks, timeout=90)


def test_cuda_group_sleep_records_its_phases_and_keeps_the_bytes(group_sleep_report):
    for rank, r in enumerate(group_sleep_report):
        assert r["prepare_s"] > 0
        for rnd in r["rounds"]:
            assert rnd["bytes"], (rank, rnd)
            assert rnd["copied"] == 256 << 20, (rank, rnd)
            assert rnd["sleep"] == ["agree", "copy", "pin wait", "unmap+release", "confirm"]
            assert rnd["wake"] == ["agree", "copy", "pin wait", "map", "confirm"]


def test_cuda_communicators_sleep_where_they_can_and_refuse_together_where_not(
        group_sleep_report):
    r0, r1 = group_sleep_report
    for r in (r0, r1):
        assert r["after"] and r["awake"], r
        if r["can_suspend"]:
            # the tags (512 MiB) and the communicator's own buffers
            assert r["comm_error"] is None and r["comm_freed_mib"] > 512 + 16, r
        else:  # torch < 2.12 or NCCL < 2.29.7: every rank refused, nothing slept
            assert "cannot release" in r["comm_error"] or "no suspend()" in \
                r["comm_error"], r
    assert r0["comm_error"] == r1["comm_error"]
