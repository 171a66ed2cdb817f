"""The mapped kinds' setup: every rank's part is created, its handle exchanged, and mapped.

Steps, each one agreed by every rank (:meth:`Group.agree
<vmm_core.distributed.group.Group.agree>`), so a failure on one rank makes every rank
release what it made and raise the same error:

1. :func:`introduce`: every rank says who and where it is and what its backend can do
   (and opens the mailbox for descriptors, when descriptors will travel);
2. ``location="device"`` (:func:`map_device`): each rank creates and exports its own
   part; file descriptors go straight from each owner to every other rank over Unix
   sockets (:mod:`.fd_passing`), vendor integers through the group; then each rank
   imports the other parts and maps every part, side by side in one reserved range
   (``"continuous"``) or each in its own (``"chunked"``);
3. ``location="host"`` (:func:`map_host`): rank 0 creates one memfd for the whole
   array, passes it to every rank, and each maps it and registers it with its device.
"""

from __future__ import annotations

import math
import mmap
import os

from ..errors import DistributedError, OutOfMemoryError
from ..memory.host_memory import host_room
from . import fd_passing, node
from .group import Group
from .host_parts import address_of, refuse_host_overflow
from .mapped_memory import MappedMemory
from .partition import partition_rows, round_up
from .process_share import ProcessShare

__all__ = ["introduce", "map_device", "map_host"]


def introduce(group: Group, local: ProcessShare, spec: tuple):
    """Step 1: every rank says who and where it is and what it can do.

    Opens this rank's mailbox when descriptors will travel (host location, or device
    handles that are file descriptors)."""
    be, dev = local.backend, local.device
    mailbox, failure, info = None, None, {}
    try:
        caps = be.capabilities(dev)
        info = {"node": node.identity(), "backend": be.name, "device": dev, "spec": spec,
                "granularity": caps.granularity, "sharing": caps.shareable_handles,
                "peer_access": caps.peer_access,
                "mixed_handle_reservations": caps.mixed_handle_reservations}
        on_device = spec[3] == "device"
        if not on_device:  # what the node can hold: every rank decides alike from it
            info["host_room"] = host_room()
        if on_device and caps.shareable_handles == "integer":
            info["process_id"] = be.process_id(dev)
        if not on_device or caps.shareable_handles == "fd":
            mailbox = fd_passing.FdMailbox()
            info["mailbox"] = (mailbox.address, mailbox.secret)
    except Exception as exc:
        failure = exc
    try:
        infos = group.agree("mapped memory: introducing the ranks", info, failure)
        _check_consistent(infos)
    except BaseException:
        if mailbox is not None:
            mailbox.close()
        raise
    return infos, mailbox


def _check_consistent(infos: list[dict]) -> None:
    """Refuse, identically on every rank, groups that cannot share memory."""
    names = {info["backend"] for info in infos}
    if len(names) > 1:
        raise DistributedError(f"the ranks use different backends: "
                               f"{[info['backend'] for info in infos]}")
    specs = [info["spec"] for info in infos]
    if len(set(specs)) > 1:
        raise DistributedError(
            "the ranks called it with different arguments (rows, row bytes, kind, "
            "location, granularity): " + "; ".join(f"rank {r}: {s}" for r, s in
                                                   enumerate(specs)))
    node.check_same_node(infos)


def map_device(group: Group, local: ProcessShare, spec: tuple, timeout: float) -> MappedMemory:
    rows, row_bytes, kind, location, granularity = spec
    be, dev, me = local.backend, local.device, group.rank
    infos, mailbox = introduce(group, local, spec)
    try:
        if kind == "continuous" and group.size > 1 and \
                not all(info["mixed_handle_reservations"] for info in infos):
            # decided from the agreed capabilities, so every rank refuses alike, and a
            # rank whose capabilities() failed has already told every other rank why
            raise DistributedError(
                f"backend {be.name!r} cannot map other ranks' memory beside its own in one "
                f"reserved range (capability mixed_handle_reservations is False), so "
                f"kind='continuous' cannot be built on it: use kind='chunked' (one tensor "
                f"per rank's part, .chunks) or location='host'")
        sharing = infos[0]["sharing"]
        uses_fds = sharing == "fd"
        if sharing is None:
            be.require_sharing(dev, "mapped memory on the device")
        devices = sorted({info["device"] for info in infos})
        if len(devices) > 1 and not infos[0]["peer_access"]:
            raise DistributedError(
                f"backend {be.name!r} cannot map memory of another device "
                f"(capability peer_access is False) and the ranks use devices {devices}: "
                f"run the ranks on one device, or use location='host'")
        align = math.lcm(*(info["granularity"] for info in infos))
        part = partition_rows(rows, row_bytes, group.size, granularity, align)
        phys = {r: round_up(part.part_bytes(r), align) for r in part.owners}

        # step 2: create and export this rank's part
        shareable: int | None = None
        failure = None
        try:
            if me in phys:
                handle = be.create_shareable_handle(dev, phys[me])
                local.handles.append(handle)
                importers = [info.get("process_id") for r, info in enumerate(infos)
                             if r != me]
                shareable = be.export_handle(dev, handle, importers)
                if uses_fds:
                    local.fds.append(shareable)
        except Exception as exc:
            failure = exc
        values = group.agree("mapped memory: creating each rank's part",
                             None if uses_fds else shareable, failure)

        # step 3: file descriptors go straight from each owner to every other rank
        if uses_fds:
            received, failure = {}, None
            try:
                if me in phys:
                    assert shareable is not None  # exported in step 2
                    for r, info in enumerate(infos):
                        if r != me:
                            address, secret = info["mailbox"]
                            fd_passing.send_fds(address, secret, me, [shareable], timeout)
                    local.close_fd(shareable)
                received = mailbox.receive({r: 1 for r in phys if r != me}, timeout)
                for fds in received.values():
                    local.fds.extend(fds)
            except Exception as exc:
                failure = exc
            group.agree("mapped memory: passing file descriptors", None, failure)
            values = [received[r][0] if r in received else None for r in range(group.size)]
    finally:
        if mailbox is not None:
            mailbox.close()

    # step 4: import the other parts and map every part
    bases, base, failure = {}, None, None
    try:
        handles = {}
        for r in part.owners:
            if r == me:
                handles[r] = local.handles[0]
                continue
            handles[r] = be.import_handle(dev, values[r], phys[r])
            local.handles.append(handles[r])
            if uses_fds:
                local.close_fd(values[r])
        if kind == "continuous":
            span = round_up(part.slot_bytes * (part.owners[-1] + 1), align)
            base = be.reserve(dev, span, align)
            local.ranges.append((base, span))
            for r in part.owners:
                bases[r] = base + r * part.slot_bytes
        else:
            for r in part.owners:
                bases[r] = be.reserve(dev, phys[r], align)
                local.ranges.append((bases[r], phys[r]))
        for r in part.owners:
            _map_part(local, bases[r], phys[r], handles[r], own=(r == me))
    except Exception as exc:
        failure = exc
    group.agree("mapped memory: mapping every part", None, failure)
    return MappedMemory(group, local, part, kind, location, bases, base)


def _map_part(local: ProcessShare, address: int, size: int, handle, own: bool) -> None:
    be, dev = local.backend, local.device
    be.map(dev, address, size, handle, 0)
    local.maps.append((address, size))
    if not own:
        be.set_access_for(dev, address, size, [dev])  # memory of another device/process
    elif be.capabilities(dev).needs_set_access:
        be.set_access(dev, address, size)


def map_host(group: Group, local: ProcessShare, spec: tuple, timeout: float) -> MappedMemory:
    rows, row_bytes, kind, location, granularity = spec
    be, dev, me = local.backend, local.device, group.rank
    infos, mailbox = introduce(group, local, spec)
    root = 0
    part = partition_rows(rows, row_bytes, group.size, granularity, 1)
    size = round_up(part.nbytes, mmap.PAGESIZE)
    try:
        # posix_fallocate below takes every page at once: one larger than the machine
        # would take every free page, and the OOM killer would end the ranks
        refuse_host_overflow([size], [info["host_room"] for info in infos])
        failure = None
        try:
            if me == root:
                fd = os.memfd_create("vmm_core-mapped", os.MFD_CLOEXEC)
                local.fds.append(fd)
                try:
                    os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS on first touch
                except OSError as exc:
                    raise OutOfMemoryError(f"shared host memory of {size} bytes could not "
                                           f"be allocated ({exc}); ask for less") from exc
        except Exception as exc:
            failure = exc
        group.agree("mapped memory: creating the host allocation", None, failure)
        failure = None
        try:
            if me == root:
                for r, info in enumerate(infos):
                    if r != root:
                        address, secret = info["mailbox"]
                        fd_passing.send_fds(address, secret, me, [local.fds[0]], timeout)
            else:
                local.fds.extend(mailbox.receive({root: 1}, timeout)[root])
        except Exception as exc:
            failure = exc
        group.agree("mapped memory: passing the host allocation", None, failure)
    finally:
        mailbox.close()

    failure, device_base = None, None
    try:
        fd = local.fds[0]
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        local.host_maps.append(mm)
        local.close_fd(fd)
        host_base = address_of(mm)
        device_base = be.host_register(dev, host_base, size)
        local.registered.append(host_base)
    except Exception as exc:
        failure = exc
    group.agree("mapped memory: mapping the host allocation", None, failure)
    bases = {r: device_base + part.row_range(r)[0] * row_bytes for r in part.owners}
    base = device_base if kind == "continuous" else None
    return MappedMemory(group, local, part, kind, location, bases, base)


