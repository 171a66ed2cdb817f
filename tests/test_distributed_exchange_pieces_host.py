"""The distributed kind's gather and scatter when rows move in several pieces (host, gloo).

Rows travel in pieces so that the device reads or writes one piece while the group
moves another; rows a rank owns itself never enter a collective.  These runs make the
pieces tiny (``exchange.PIECE_BYTES``), so every call of a few hundred rows takes the
most pieces, with uneven splits, ranks that ask for nothing, for only their own rows or
only others' rows, and check every row against a reference every rank can rebuild.
They also count the collectives of one call: the header, the counts, the indices, one
flag and one exchange per piece (a scatter adds its closing flag), whatever the number
of rows.
"""

from __future__ import annotations

import pytest
import torch

from vmm_core.distributed import exchange, mapped_tensor
from vmm_core.testing.ranks import check_ranks, run_ranks

TIMEOUT = 60


def _reference(rows: int, row: tuple, version: int = 0) -> torch.Tensor:
    return torch.randn((rows,) + row, generator=torch.Generator().manual_seed(5 + version))


def _in_pieces(rank, world, row):
    exchange.PIECE_BYTES = 64  # every call takes exchange.MAX_PIECES pieces
    rows = 53 * world + 3
    ref = _reference(rows, row)
    mt = mapped_tensor((rows,) + row, torch.float32, kind="distributed", backend="host")
    part = mt.memory.row_range()
    try:
        # scatter: each rank writes a disjoint random share of the rows, in pieces
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(11))
        mine = perm[rank::world]
        mt.scatter(mine, ref[mine])
        g = torch.Generator().manual_seed(rank)
        cases = {
            "random": torch.randint(0, rows, (4 * rows,), generator=g),
            "int32": torch.randint(0, rows, (rows,), generator=g).int(),
            "own rows only": torch.arange(*part).flip(0),
            "others' rows only": torch.cat([torch.arange(0, part[0]),
                                            torch.arange(part[1], rows)]),
            "nothing": torch.empty(0, dtype=torch.int64),
            "one row": torch.tensor([rows - 1 - rank]),
        }
        if rank == 0:
            cases["random"] = torch.empty(0, dtype=torch.int64)  # one rank asks nothing
        got = {name: torch.equal(mt.gather(idx), ref[idx.long()]) for name, idx in
               cases.items()}
        # a second update in pieces, by ranks holding different numbers of rows
        new = _reference(rows, row, version=1)
        share = perm[: rows // 2][rank::world] if rank else perm[rows // 2:]
        taken = torch.zeros(rows, dtype=torch.bool)
        for r in range(world):  # every rank rebuilds every rank's share
            taken[perm[: rows // 2][r::world] if r else perm[rows // 2:]] = True
        mt.scatter(share, new[share])
        want = torch.where(taken[:, None], new.reshape(rows, -1),
                           ref.reshape(rows, -1)).reshape(ref.shape)
        got["after update"] = torch.equal(mt.gather(torch.arange(rows)), want)
        return {"got": got, "pieces": exchange.MAX_PIECES}
    finally:
        mt.close()


@pytest.mark.parametrize("world,row", [(2, (64,)), (3, (1024,)), (4, (3,))])
def test_rows_in_pieces_match_a_reference_on_every_rank(world, row):
    # 256 B, 4 KiB and 12 B rows (three 4-byte words)
    for rank, v in enumerate(check_ranks(run_ranks(_in_pieces, world, args=(row,),
                                                   timeout=TIMEOUT))):
        assert all(v["got"].values()), (rank, v["got"])


def _collectives_of_one_call(rank, world, what, n):
    import torch.distributed as dist

    exchange.PIECE_BYTES = 1024
    rows = 64 * world
    mt = mapped_tensor((rows, 256), torch.float32, kind="distributed", backend="host")
    counted = {"all_gather": 0, "all_to_all_single": 0, "all_reduce": 0}
    real = {name: getattr(dist, name) for name in counted}

    def counting(name):
        def call(*args, **kwargs):
            counted[name] += 1
            return real[name](*args, **kwargs)
        return call

    idx = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(rank))
    for name in counted:
        setattr(dist, name, counting(name))
    try:
        if what == "gather":
            mt.gather(idx)
        else:
            unique = torch.randperm(rows, generator=torch.Generator().manual_seed(3))
            mine = unique[rank::world][:n]
            mt.scatter(mine, torch.ones(mine.numel(), 256))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    # the pieces every rank takes: from every rank's number of indices (the header)
    asked = n * world if what == "gather" else min(n, rows // world) * world
    remote = asked * 1024 * (world - 1) / world ** 2
    pieces = max(1, min(exchange.MAX_PIECES, -(-int(remote) // exchange.PIECE_BYTES)))
    mt.close()
    return {"counted": counted, "pieces": pieces}


@pytest.mark.parametrize("what", ["gather", "scatter"])
@pytest.mark.parametrize("n", [8, 200])
def test_one_call_makes_the_same_few_collectives_whatever_its_size(what, n):
    for v in check_ranks(run_ranks(_collectives_of_one_call, 2, args=(what, n),
                                   timeout=TIMEOUT)):
        flags = 1 if what == "gather" else 2  # a scatter also agrees that it wrote
        assert v["counted"] == {"all_gather": 1,  # the call header
                                "all_to_all_single": 2 + v["pieces"],  # counts, indices
                                "all_reduce": flags}, v


def test_pieces_split_a_run_the_same_way_on_both_sides():
    for n in (0, 1, 7, 8, 9, 1000):
        for count in (1, 3, 8):
            cut = exchange._pieces(n, count)
            assert len(cut) == count and cut[0][0] == 0 and cut[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
            sizes = [e - s for s, e in cut]
            assert max(sizes) - min(sizes) <= 1, (n, count, sizes)
