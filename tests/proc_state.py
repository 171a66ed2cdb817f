"""What a process holds, read from /proc: the multi-process tests compare it before and
after, so a leaked descriptor or mapping fails them.  Also the group barrier they share."""

from __future__ import annotations

import os

from vmm_core.distributed.group import Group


def barrier() -> None:
    Group().gather(None, "test barrier")


def fd_table() -> dict:
    table = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            table[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return table


def memfd_maps() -> int:
    with open("/proc/self/maps") as fh:
        return sum("memfd:" in line for line in fh)


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def join_child(proc, hung: str, timeout: float = 30) -> None:
    """Wait for a forked child; one still alive after ``timeout`` is killed and the test
    fails saying ``hung`` (what it hung on), so a hang costs seconds, not the suite."""
    import pytest

    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"the forked child hung {hung}")
