"""How the rows of one table are split between the ranks (WholeMemory's rule).

Rank ``r`` owns one contiguous run of rows; every run but the last owners' is the same
number of rows, a multiple of a caller-chosen granularity (rows are never split) whose
bytes are also a multiple of the backend's granularity, so the runs can be mapped side by
side.  Every kind of mapped tensor uses the same rule, so a row has the same owner
whatever the kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import VMMError

__all__ = ["Partition", "partition_rows", "round_up"]


@dataclass(frozen=True)
class Partition:
    """Which rows each rank owns: rank ``r`` owns ``[r * rows_per_rank, ...)``."""

    rows: int
    row_bytes: int
    world: int
    rows_per_rank: int

    def row_range(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.rows_per_rank, self.rows)
        return start, min(start + self.rows_per_rank, self.rows)

    def part_bytes(self, rank: int) -> int:
        start, end = self.row_range(rank)
        return (end - start) * self.row_bytes

    @property
    def slot_bytes(self) -> int:
        """Distance between the starts of two consecutive parts."""
        return self.rows_per_rank * self.row_bytes

    @property
    def owners(self) -> list[int]:
        """Ranks that own at least one row."""
        return [r for r in range(self.world) if self.part_bytes(r)]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def partition_rows(rows: int, row_bytes: int, world: int, granularity: int = 1,
                   alignment: int = 1) -> Partition:
    """Split ``rows`` between ``world`` ranks (WholeMemory's rule).

    Every rank but the last owners gets the same number of rows: the smallest multiple
    of ``granularity`` rows, whose bytes are also a multiple of ``alignment`` (the
    backend's granularity, so parts can be mapped side by side), that lets ``world``
    ranks hold all rows.  With large alignments small arrays live on fewer ranks.
    """
    for name, value in (("rows", rows), ("row_bytes", row_bytes), ("world", world),
                        ("granularity", granularity), ("alignment", alignment)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise VMMError(f"partition: {name} must be a positive int, got {value!r}")
    rows_for_alignment = alignment // math.gcd(alignment, row_bytes)
    unit = math.lcm(granularity, rows_for_alignment)
    per = -(-rows // world)
    per = -(-per // unit) * unit
    return Partition(rows, row_bytes, world, per)


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit

