"""What the benchmarks that run one rank per device under torchrun share.

* :func:`join`: the rank's device first (NCCL binds to the current device), the group,
  then :func:`vmm_core.distributed.prepare_group`, timed: the communicator is set up
  here, as an engine sets it up at load, never inside a measured sleep;
* :func:`barrier`: every rank at one point before a timed call, so a call's time is its
  own and not the wait for a rank still finishing the step before (that wait is
  returned, and printed apart);
* :func:`rank_limits`: each rank's pinned-copy limit measured with the other ranks idle
  (the limit the targets use) and with every rank copying at once (what the host gives
  them together: a shared PCIe switch, memory controller or socket link shows here);
* :func:`phase_line`: one rank's phases of a group sleep or wake
  (:func:`vmm_core.distributed.last_timings`) on one line.
"""

from __future__ import annotations

import contextlib
import os
import time

__all__ = ["joined", "barrier", "rank_limits", "limits_lines", "phase_line", "local_rank",
           "arrival", "group_timings", "under_torchrun", "PHASE_WORDS", "GIB"]

GIB = 2**30

#: the phases' names in a table, short
PHASE_WORDS = {"resume communicators": "resume", "suspend communicators": "suspend",
               "agree": "agree", "copy": "copy", "pin wait": "pin", "unmap+release": "unmap",
               "map": "map", "confirm": "confirm"}


@contextlib.contextmanager
def joined(device_type: str, device: int):
    """Join torchrun's group on ``device`` (a one-rank group outside torchrun) and prepare
    it, so no sleep sets its communicator up; yields what that took, for the report.  A
    group this made is left on the way out, a failed run's too (after the caller has
    logged its error: the shutdown waits for the rank's unfinished collectives)."""
    import torch
    import torch.distributed as dist

    from vmm_core.distributed import prepare_group

    from .distributed import joined_group

    getattr(torch, device_type).set_device(device)  # before the group: NCCL binds to it
    with joined_group(device_type) as note:
        prepared = prepare_group()
        yield {"note": note, "rank": dist.get_rank(), "world": dist.get_world_size(),
               "backend": str(dist.get_backend()), "prepare_group_s": prepared}


def barrier(mod, device) -> float:
    """Every rank here; returns the seconds this rank waited for the others."""
    import torch
    import torch.distributed as dist

    mod.synchronize()
    t0 = time.perf_counter()
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    mod.synchronize()
    return time.perf_counter() - t0


def rank_limits(measure, mod, device) -> dict:
    """Every rank's copy limit (``measure()``: d2h, h2d GiB/s): ``alone`` (one rank at a
    time, the others waiting) and ``together`` (all at once).  Returns rank -> both."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    alone = None
    for turn in range(world):
        barrier(mod, device)
        if turn == rank:
            alone = measure()
    barrier(mod, device)
    together = measure()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, {"alone": alone, "together": together,
                                      "device": mod.get_device_name(device),
                                      "numa": _numa_node(mod, device)})
    return dict(enumerate(everyone))


def _numa_node(mod, device) -> int | None:
    """The NUMA node of the device's PCI function, from sysfs (None where not known)."""
    try:
        props = mod.get_device_properties(device)
        address = (f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
                   f"{props.pci_device_id:02x}.0")
        with open(f"/sys/bus/pci/devices/{address}/numa_node") as fh:
            return int(fh.read().strip())
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def limits_lines(limits: dict) -> list[str]:
    out = ["pinned copy limit per rank, GiB/s device->host / host->device: alone (the "
           "others idle) | all ranks at once"]
    for rank, entry in sorted(limits.items()):
        a, t = entry["alone"], entry["together"]
        numa = "" if entry.get("numa") is None else f", NUMA node {entry['numa']}"
        out.append(f"  rank {rank} ({entry['device']}{numa}): {a[0]:.1f} / {a[1]:.1f} | "
                   f"{t[0]:.1f} / {t[1]:.1f}")
    return out


def phase_line(timings: dict | None) -> str:
    """``agree 0.3 copy 80.1 ...`` (ms), or '-' where the call recorded none."""
    if not timings:
        return "-"
    return " ".join(f"{PHASE_WORDS.get(name, name)} {seconds * 1e3:.1f}"
                    for name, seconds in timings["phases"].items())


def arrival(group, mod, device):
    """What to call before a timed sleep or wake: with a group, :func:`barrier` (every
    rank there, so the call's time is its own; returns the wait), else nothing."""
    if group is None:
        return lambda: 0.0
    return lambda: barrier(mod, device)


def group_timings(group, call: str):
    """The phases of the last group ``call`` (None without a group)."""
    if group is None:
        return None
    from vmm_core.distributed import last_timings

    return last_timings(call)


def under_torchrun() -> bool:
    """One process of several that torchrun started (one rank per device)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))
