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
mid-call, and a tagged distributed part that sleeps and wakes with its bytes.

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

    # close gives the device memory back (512 MiB per rank)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info(dev)[0]
    mt = mapped_tensor((1 << 18, 1024), torch.float32, backend="cuda", device=rank, timeout=20)
    mt.local_part().fill_(1.0)
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info(dev)[0]
    mt.close()
    torch.cuda.synchronize()
    free2 = torch.cuda.mem_get_info(dev)[0]
    report["memory"] = {"held_mib": (free0 - free1) / 2**20, "left_mib": (free0 - free2) / 2**20}
    return report


def _need_two_gpus() -> None:
    """A one-GPU run under VMM_CORE_REQUIRE=cuda is complete without these tests; the
    two-GPU run requires them too: VMM_CORE_REQUIRE=cuda,cuda-2gpu."""
    require_backend("cuda")
    import torch

    if torch.cuda.device_count() < 2:
        skip_or_fail("cuda-2gpu", f"needs 2 GPUs, found {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def report():
    _need_two_gpus()
    # the two runs' deadlines (100 + 120 s) fit the 240 s scripts/device_distributed.sh
    # gives pytest; a rank stuck in an NCCL collective is torn down by NCCL's watchdog
    # after group_timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING's default), well before either
    results = run_ranks(_cuda_ranks, 2, backend="nccl", before_init=_use_gpu, timeout=100,
                        group_timeout=60)
    return check_ranks(results)


@pytest.mark.parametrize("combo", [f"{k}/{loc}" for k, loc in COMBOS])
def test_cuda_kernels_write_and_read_peer_parts(report, combo):
    for rank, r in enumerate(report):
        assert r[combo] == {"own_part_written_by_peer": True, "gather_reads_every_part": True,
                            "views_on_own_gpu": True, "in_place": True}, (rank, r[combo])


def test_cuda_close_returns_device_memory(report):
    for rank, r in enumerate(report):
        mem = r["memory"]
        assert 500 <= mem["held_mib"] <= 530, (rank, mem)  # its own part only
        assert abs(mem["left_mib"]) <= 4, (rank, mem)


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
    _need_two_gpus()
    results = run_ranks(_cuda_gather_ranks, 2, backend="nccl", before_init=_use_gpu,
                        timeout=120, group_timeout=60)
    return check_ranks(results)


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
    assert r0["mid_call"] == r1["mid_call"] and "injected" in r0["mid_call"]
    assert r0["after_mid_call"] and r1["after_mid_call"]
    assert r0["sleep"] and r1["sleep"]
    assert r0["nodes_distributed"] and r1["nodes_distributed"]
    assert r0["nodes_continuous"] == r1["nodes_continuous"]
    assert "single-node" in r0["nodes_continuous"]
