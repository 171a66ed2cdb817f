"""``kind="distributed"``: each rank allocates only its own part; nothing is mapped
across processes, so the ranks may be on different nodes.

Device parts live in a :class:`~vmm_core.memory.allocator.SharedVMMAllocator` of their
own, so ``tag=`` puts them to sleep with every other tagged memory; host parts are one
mmap per rank registered with its device.  Other ranks' rows are reached by
``gather``/``scatter`` through the group's collectives (:mod:`.exchange`).
"""

from __future__ import annotations

import math
import mmap

from ..memory.host_memory import host_room
from . import node
from .group import Group
from .host_parts import address_of, refuse_host_overflow
from .mapped_memory import MappedMemory
from .partition import partition_rows, round_up
from .process_share import ProcessShare

__all__ = ["map_distributed"]


def map_distributed(group: Group, local: ProcessShare, spec: tuple, tag) -> MappedMemory:
    """Each rank allocates its own part only; nothing is exchanged but the granularity
    (the same :func:`partition_rows` rule as the mapped kinds, so a row has the same
    owner whatever the kind) and the outcome."""
    from ..memory import tagged
    from ..memory.allocator import SharedVMMAllocator

    rows, row_bytes, kind, location, granularity = spec
    be, dev, me = local.backend, local.device, group.rank
    failure, grain = None, 1
    try:
        if location == "device":
            grain = be.capabilities(dev).granularity
    except Exception as exc:
        failure = exc
    where = (node.identity(), host_room() if location == "host" else None)
    infos = group.agree("distributed tensor: introducing the ranks", (grain, where), failure)
    grains = [grain for grain, _ in infos]
    part = partition_rows(rows, row_bytes, group.size, granularity, math.lcm(*grains))
    if location == "host":  # the parts of the ranks on one node share its memory
        nodes: dict = {}
        for r, (_, (identity, room)) in enumerate(infos):
            sizes, rooms = nodes.setdefault((identity["host"], identity["boot"]), ([], []))
            sizes.append(round_up(part.part_bytes(r), mmap.PAGESIZE))
            rooms.append(room)
        for sizes, rooms in nodes.values():
            refuse_host_overflow(sizes, rooms)
    bases, failure = {}, None
    try:
        size = part.part_bytes(me)
        if location == "device" and (size or tag is not None):
            # a rank that owns no rows still holds an (empty) allocator under the tag, so
            # vmm_core.sleep(tag, group=...) finds the tag on every rank
            alloc = SharedVMMAllocator(be, dev, reserve_bytes=round_up(max(size, 1),
                                                                        grains[me]), tag=tag)
            local.allocators.append(alloc)
            if size:
                bases[me] = alloc.allocate(size)
            if tag is not None:
                tagged.register(tag, alloc)
        elif size:
            mm = mmap.mmap(-1, round_up(size, mmap.PAGESIZE))
            local.host_maps.append(mm)
            host_base = address_of(mm)
            bases[me] = be.host_register(dev, host_base, len(mm))
            local.registered.append(host_base)
    except Exception as exc:
        failure = exc
    group.agree("distributed tensor: allocating each rank's part", None, failure)
    return MappedMemory(group, local, part, kind, location, bases, None)


