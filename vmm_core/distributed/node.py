"""Which node a rank runs on: mapped memory is shared only by the processes of one node.

Two processes can map each other's memory only on one host, in one boot, and (for the
abstract Unix sockets that carry file descriptors) in one network namespace.  Every rank
reports :func:`identity` in the first agreement of a setup, and :func:`check_same_node`
refuses, identically on every rank, a group that spans several.
"""

from __future__ import annotations

import os
import socket

from ..errors import DistributedError

__all__ = ["identity", "check_same_node"]


def identity() -> dict:
    """What must be equal for two processes to share memory: host and boot, plus the
    network namespace (abstract Unix sockets do not cross it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "unknown"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return {"host": socket.gethostname(), "boot": boot, "netns": netns}


def check_same_node(infos: list[dict]) -> None:
    hosts: dict[tuple, list[int]] = {}
    for rank, info in enumerate(infos):
        node = info["node"]
        hosts.setdefault((node["host"], node["boot"]), []).append(rank)
    if len(hosts) > 1:
        where = "; ".join(f"ranks {ranks} on host {h!r}" for (h, _), ranks in hosts.items())
        raise DistributedError(
            f"mapped memory is single-node, but this group spans {len(hosts)} hosts "
            f"({where}). Create it over a group of the ranks of one node, e.g. "
            f"torch.distributed.new_group(<ranks on this node>), and move data between "
            f"nodes with collectives")
    spaces: dict[int, list[int]] = {}
    for rank, info in enumerate(infos):
        spaces.setdefault(info["node"]["netns"], []).append(rank)
    if len(spaces) > 1:
        raise DistributedError(
            f"the ranks run on one host but in {len(spaces)} network namespaces "
            f"(containers: {sorted(spaces.values())}); file descriptors cannot be passed "
            f"between them over abstract Unix sockets. Run the ranks in one container, or "
            f"with the host network namespace")

