"""``pause`` and ``resume`` of torch_memory_saver tags: which vmm_core tags to turn, how
(offloaded, written to disk, discarded), and the host copies ``get_cpu_backup`` reads.

torch_memory_saver exits the process when a pause meets a paused allocation or a resume
a running one; here the call raises SleepStateError and changes nothing.  A call that
failed midway (a copy or a file that could not be made, device memory that ran out) is
remembered: the same call again finishes it, turning what is left instead of refusing
over what it already turned.  Any call that completes forgets it.

Disk backup keeps torch_memory_saver's files: one per allocation, named ``tms_`` and a
random suffix, kept after a resume and written again by the next pause, removed when
their memory goes.
"""

from __future__ import annotations

from ...errors import SleepStateError, VMMError
from . import captures, settings, state

__all__ = ["pause", "resume", "refuse_paused", "cpu_backup"]

#: the names torch_memory_saver gives its disk backup files (``mkstemp`` ``tms_XXXXXX``)
DISK_FILE_PREFIX = "tms_"


def _allocators(vtag: str) -> list:
    from ...memory import tagged

    return tagged.allocators(vtag)


def _kind(vtag: str) -> str:
    owner = state.owners.get(vtag)
    return owner[1] if owner is not None else "none"


def _with_memory(tag) -> dict[str, list[str]]:
    """torch_memory_saver tag -> its vmm_core tags that have memory (tags with none
    left out: pausing or resuming them is a no-op)."""
    from ...memory import tagged

    if tag is not None and not isinstance(tag, str):
        raise ValueError(f"tag must be a string or None (every tag), got {tag!r}")
    alive = set(tagged.tags())
    with state.lock():
        names = list(state.tags) if not tag else [tag]  # "": every tag, as it reads it
        chosen = {name: sorted(t for t in state.tags.get(name, ()) if t in alive)
                  for name in names}
    return {name: vtags for name, vtags in chosen.items() if vtags}


def _any(vtag: str, asleep: bool) -> bool:
    return any(a.asleep == asleep for a in _allocators(vtag))


def _to_turn(verb: str, tag, asleep: bool, refusal: str) -> list[str]:
    """The vmm_core tags of ``tag`` whose memory is ``asleep`` (False: running): those a
    pause (resume) turns.  Refuses, changing nothing, when a torch_memory_saver tag has
    none in that state, unless the same call failed midway before."""
    chosen = _with_memory(tag)
    wrong = [name for name, vtags in chosen.items() if not any(_any(t, asleep) for t in vtags)]
    if wrong and (verb, tag or None) not in state.unfinished:
        raise SleepStateError(refusal.format(tag=tag, names=wrong))
    return [t for vtags in chosen.values() for t in vtags if _any(t, asleep)]


def _split(vtags: list[str]) -> tuple[list[str], list[str]]:
    """(the tags backed up to disk, the others)."""
    disk = [t for t in vtags if _kind(t) == "disk"]
    return disk, [t for t in vtags if t not in disk]


def _run(verb: str, tag, steps) -> None:
    key = (verb, tag or None)
    try:
        for step in steps:
            step()
    except BaseException:
        state.unfinished.add(key)
        raise
    state.unfinished.clear()


def pause(tag) -> None:
    import vmm_core

    from ...memory import disk_offload

    captures.close_unused_private_pools()
    with state.lock():
        awake = _to_turn("pause", tag, asleep=False, refusal=(
            "torch_memory_saver.pause({tag!r}): memory tagged {names} is paused already; "
            "resume it first (or pause only the tags that run)"))
        disk, rest = _split(awake)
        s = settings.settings()
        steps = []
        if disk:  # first: a full disk then leaves everything running
            steps.append(lambda: disk_offload.sleep(disk, settings.disk_dir(), s.chunk_bytes,
                                                    prefix=DISK_FILE_PREFIX))
        if rest:
            steps.append(lambda: vmm_core.sleep(rest, offload=[t for t in rest
                                                               if _kind(t) == "cpu"]))
        _run("pause", tag, steps)
    if _pinned_backups_asleep(tag):
        # the host copies are page-locked in the background after a sleep; the device
        # memory that takes (the device's mapping of the host pages, about 2 MiB a GiB)
        # is in place when torch_memory_saver's pause returns, its "pinned" backups being
        # page-locked already: so is it here, and a caller measuring what the pause
        # freed sees no memory come back afterwards.  Decided from what is asleep now,
        # so that a pause finished by a second call waits too.
        from ...memory import offload

        offload.wait_for_pinning()


def _pinned_backups_asleep(tag) -> bool:
    """Whether ``tag`` (None: every tag) has memory asleep with a CPU backup of the
    ``pinned`` backend (torch_memory_saver's default, and the whole-process region's
    unless ``TMS_INIT_CPU_BACKUP_BACKEND=mmap``); ``mmap`` backups it leaves pageable."""
    backends: dict[str, set] = {}
    for (_tag, cpu, _disk, backend, _device), vtag in state.region_keys.items():
        if cpu:
            backends.setdefault(vtag, set()).add(backend)
    default = state.base_config().cpu_backup_backend
    for vtags in _with_memory(tag).values():
        for vtag in vtags:
            if _kind(vtag) != "cpu" or backends.get(vtag, {default}) == {"mmap"}:
                continue
            if _any(vtag, asleep=True):
                return True
    return False


def resume(tag) -> None:
    import vmm_core

    from ...memory import disk_offload

    with state.lock():
        asleep = _to_turn("resume", tag, asleep=True, refusal=(
            "torch_memory_saver.resume({tag!r}): memory tagged {names} is not paused; "
            "pause it first (or resume only the paused tags)"))
        disk, rest = _split(asleep)
        steps = []
        if rest:
            steps.append(lambda: vmm_core.wake_up(rest, keep_host_buffers=settings.retain()))
        if disk:
            steps.append(lambda: disk_offload.wake_up(disk, keep_files=True))
        _run("resume", tag, steps)


def refuse_paused(tag: str, vtag: str, backend, device: int) -> None:
    """A region or capture of a paused tag: say so in torch_memory_saver's words."""
    paused = any(a.asleep and a.backend.name == backend.name and a.device == device
                 for a in _allocators(vtag))
    if paused:
        raise SleepStateError(f"memory tagged {tag!r} is paused; call "
                              f"torch_memory_saver.resume({tag!r}) before allocating in its "
                              f"region (or capturing into it)")


def _holds(alloc, address: int) -> bool:
    try:
        alloc.translate(address, alloc.current_space)
    except VMMError:
        return False
    return True


def cpu_backup(x, zero_copy: bool):
    """``get_cpu_backup``: see :meth:`TorchMemorySaver.get_cpu_backup`."""
    from ...memory import offload
    from ...memory.torch_views import raw_tensor

    address, nbytes = int(x.data_ptr()), int(x.numel() * x.element_size())
    for vtag in state.vmm_tags():
        for alloc in _allocators(vtag):
            if not _holds(alloc, address):
                continue
            if _kind(vtag) == "disk":
                return None  # no host copy: the resumed tensor is the only one
            host = alloc.host_copy_address(address, max(nbytes, 1))
            if host is None:
                if alloc.asleep:
                    raise SleepStateError(
                        f"get_cpu_backup: x lies in memory tagged "
                        f"{state.names([vtag])} that is paused without a CPU backup "
                        f"(its bytes are gone); make its region with "
                        f"enable_cpu_backup=True to keep them")
                return None
            if zero_copy:
                # a view of page-locked memory, as torch_memory_saver's pinned backups are
                offload.wait_for_pinning()
            view = raw_tensor(host, nbytes, "cpu").view(x.dtype).view(x.shape)
            return view if zero_copy else view.clone()
    raise VMMError(f"get_cpu_backup: x (at {address:#x}) was not allocated inside "
                   f"region() or cuda_graph() of torch_memory_saver")
