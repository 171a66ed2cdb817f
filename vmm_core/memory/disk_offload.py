"""Sleep to disk: the bytes of sleeping memory in files instead of host memory.

For memory larger than the host can hold while it sleeps (a training process's whole
state, torch_memory_saver's ``enable_disk_backup``).  :func:`sleep` writes every byte an
offload would copy into one file per allocation (per live range of an allocator, as
torch_memory_saver writes one per allocation; all of its mapped memory where it knows
no ranges) under a directory, streaming it through one page-locked staging buffer of
``chunk_bytes``, then releases the device memory as a discarding ``vmm_core.sleep``
does; :func:`wake_up` re-creates the memory at the same addresses and reads the files
back.  The files are written through to the disk and dropped from the page cache
(``fsync``, ``POSIX_FADV_DONTNEED``), so they hold no host memory while the memory
sleeps, and removed once their bytes are back (or kept for the next sleep, as
torch_memory_saver keeps them: ``wake_up(keep_files=True)``), or when their memory is
closed.

Nothing is lost on a failure: a write that fails (a full disk, a directory that cannot
be written) removes what this sleep wrote and leaves every allocator awake and intact;
a read that fails puts that allocator back to sleep with its files kept, so the wake can
be retried.  Each raises :class:`DiskBackupError` (a ``VMMError``) naming the directory,
the file and the system's reason.

Only allocators with one virtual space (regions, whole-process segments) can sleep to
disk; a graph pool's spaces share their pages and are refused.  This module uses
allocators only through their public methods and the tagged sleep and wake.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..errors import SleepStateError, VMMError
from . import live_ranges as _live
from . import tag_state

__all__ = ["DiskBackupError", "sleep", "wake_up", "files", "DEFAULT_CHUNK_BYTES",
           "release_staging"]

logger = logging.getLogger("vmm_core")

DEFAULT_CHUNK_BYTES = 256 << 20
_PREFIX = "vmm_sleep_"
#: filesystems that live in host memory: a sleep there does not spare any
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


class DiskBackupError(VMMError, OSError):
    """A sleep to disk or a wake from it could not write or read its files."""


@dataclass
class _Saved:
    """The files of one sleeping allocator: (path, address, size) per range."""

    files: list[tuple[str, int, int]] = field(default_factory=list)
    chunk: int = DEFAULT_CHUNK_BYTES
    finalizer: weakref.finalize | None = None
    #: woken with its files kept (``wake_up(keep_files=True)``): the next sleep writes
    #: the same ranges into the same files
    awake: bool = False


_lock = threading.Lock()
_saved: dict[int, tuple[weakref.ref, _Saved]] = {}  # id(allocator) -> (allocator, files)
_staging: dict[tuple, Any] = {}  # (backend name, device) -> host buffer
_warned_dirs: set[str] = set()


def _remove(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("sleep to disk: %s could not be removed (%s)", path, exc)


def _forget(key: int) -> None:
    """Drop the record of a closed (or woken) allocator, removing its files."""
    with _lock:
        entry = _saved.pop(key, None)
    if entry is not None:
        saved = entry[1]
        if saved.finalizer is not None:
            saved.finalizer.detach()
        _remove(path for path, _, _ in saved.files)


def _closed(alloc) -> None:
    """An allocator closing takes its files with it (the state module tells)."""
    key = id(alloc)
    with _lock:
        entry = _saved.get(key)
    if entry is not None and _holds_record(entry[0], alloc):
        _forget(key)


tag_state.on_close.append(_closed)


def _gone(ref) -> bool:
    alloc = ref()
    return alloc is None or alloc.closed


def _sweep_closed() -> None:
    """Files of allocators closed while asleep are no longer needed."""
    with _lock:
        closed = [key for key, (ref, _) in _saved.items() if _gone(ref)]
    for key in closed:
        _forget(key)


def files(allocator=None) -> list[str]:
    """The files holding sleeping memory (of ``allocator``, or of every allocator)."""
    _sweep_closed()
    with _lock:
        chosen = [entry for key, entry in _saved.items()
                  if allocator is None or key == id(allocator)]
        return [path for _, saved in chosen for path, _, _ in saved.files]


# ---------------------------------------------------------------- staging
class _HostBytes:
    """A pageable buffer where the backend has no page-locked one."""

    def __init__(self, size: int) -> None:
        self._buffer = (ctypes.c_char * size)()
        self.address = ctypes.addressof(self._buffer)
        self.size = size


def _staging_buffer(backend, device: int, size: int):
    """A host buffer of at least ``size`` bytes for ``device`` (page-locked where the
    backend has such buffers), kept for the next sleep or wake: one per device."""
    key = (backend.name, device)
    with _lock:
        buf = _staging.get(key)
        if buf is not None and buf.size >= size:
            return buf
        old = _staging.pop(key, None)
    _close(old)
    buf = backend.host_buffer(device, size, pinned=True) or _HostBytes(size)
    with _lock:
        _staging[key] = buf
    return buf


def _close(buf) -> None:
    close = getattr(buf, "close", None) or getattr(buf, "release", None)
    if close is not None:
        close()


def release_staging() -> None:
    """Free the staging buffers (made again by the next sleep or wake to disk)."""
    with _lock:
        buffers = list(_staging.values())
        _staging.clear()
    for buf in buffers:
        _close(buf)


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


# ---------------------------------------------------------------- what is written
def _ranges(alloc) -> list[tuple[int, int]]:
    """The bytes an offload of ``alloc`` would copy: its live ranges, else everything
    mapped in its one space."""
    if alloc.num_virtual_spaces != 1:
        raise SleepStateError(
            f"sleep to disk: memory tagged {alloc.tag!r} has {alloc.num_virtual_spaces} "
            f"virtual spaces sharing its pages (a graph pool); only single-space memory "
            f"(regions) can sleep to disk: offload it to host memory instead")
    if alloc.live_ranges is not None:
        ranges = _live.merge(_live.checked(alloc.live_ranges(), "live_ranges"), gap=0)
        return _per_allocation(ranges, alloc.live_allocations())
    mapped = alloc.physical_bytes
    return [(alloc.space_base(), mapped)] if mapped else []


def _per_allocation(live: list[tuple[int, int]], allocations: dict[int, int]
                    ) -> list[tuple[int, int]]:
    """One range per allocation that holds live bytes, from its first live byte to its
    last (torch_memory_saver keeps a file per allocation, and a framework's allocation
    is one of its segments); live bytes outside every allocation keep their ranges."""
    import bisect

    starts = [start for start, _ in live]
    out = []
    for start, size in sorted(allocations.items()):
        end = start + size
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        first = last = -1
        while i < len(live) and live[i][0] < end:
            a, b = max(live[i][0], start), min(live[i][0] + live[i][1], end)
            if a < b:
                first, last = (a if first < 0 else first), b
            i += 1
        if first >= 0:
            out.append((first, last - first))
    outside = _live.subtract(live, allocations.items())
    return sorted(out + outside)


def _filesystem(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (the longest mount point above it)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    path = os.path.realpath(path)
    best, kind = "", None
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fstype
    return kind


def _failure(what: str, directory: str, exc: OSError, path: str | None = None) -> DiskBackupError:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    remedy = {errno.ENOSPC: "free space there or choose another directory",
              errno.EFBIG: "the file size limit (ulimit -f) or the filesystem's limit is "
                           "too small for it: raise it or choose another directory",
              errno.EDQUOT: "the disk quota is used up: free space or choose another "
                            "directory",
              errno.EACCES: "make the directory writable or choose another one",
              errno.EROFS: "the filesystem is read-only: choose another directory"}.get(
        exc.errno or 0, "check the directory, or choose another one")
    where = f" ({path})" if path else ""
    error = DiskBackupError(f"{what} in {directory!r}{where} failed: {reason}; {remedy}")
    error.errno = exc.errno
    return error


def _write_file(directory: str, backend, device: int, address: int, size: int,
                staging, chunk: int, prefix: str = _PREFIX, path: str | None = None) -> str:
    """Write the range into a new file, or over ``path`` (kept from an earlier sleep of
    the same range; it is not removed if the write fails)."""
    if path is None:
        fd, path = _make_file(directory, prefix)
        made = True
    else:
        fd, made = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)), False
    try:
        try:
            os.posix_fallocate(fd, 0, size)  # a full disk fails here, before any copy
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        offset = 0
        while offset < size:
            n = min(chunk, size - offset)
            backend.copy_to_host(device, address + offset, staging.address, n)
            view = _view(staging.address, n)
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:n], offset + done)
            offset += n
        os.fsync(fd)
        _drop_cache(fd, size)
    except BaseException:
        os.close(fd)
        if made:
            _remove([path])
        raise
    os.close(fd)
    return path


def _make_file(directory: str, prefix: str = _PREFIX) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=prefix, dir=directory)


def _drop_cache(fd: int, size: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _read_file(path: str, backend, device: int, address: int, size: int, staging,
               chunk: int) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        offset = 0
        while offset < size:
            n = min(chunk, size - offset)
            view = _view(staging.address, n)
            done = 0
            while done < n:
                got = os.preadv(fd, [view[done:n]], offset + done)
                if got == 0:
                    raise OSError(errno.EIO, f"{path} ends at {offset + done} of {size} bytes")
                done += got
            backend.copy_from_host(device, staging.address, address + offset, n)
            offset += n
        backend.synchronize(device)
        _drop_cache(fd, size)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- sleep and wake
def _named(tags, what: str) -> list[str] | None:
    """The tags named, or None for every tag (read under the state lock)."""
    if tags is None:
        return None
    return list(tag_state.tag_list(tags, what, VMMError, "None means every tag"))


def sleep(tags, directory: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
          prefix: str = _PREFIX) -> None:
    """Write the memory of ``tags`` to files under ``directory`` (named ``prefix`` and a
    random suffix), then release it as a discarding ``vmm_core.sleep(tags)`` does.
    Asleep allocators are left as they are.  A range whose file was kept by
    ``wake_up(keep_files=True)`` is written into that file again; kept files of ranges
    no longer live are removed.

    On a failure nothing sleeps and no file this call made stays (DiskBackupError)."""
    from . import tagged

    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    named = _named(tags, "disk_offload.sleep: tags")
    _sweep_closed()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise _failure("creating the sleep directory", directory, exc) from exc
    _warn_if_memory(directory)
    with tag_state.registry_frozen():  # what it writes files for is what it sleeps
        chosen = list(tagged.tags()) if named is None else named
        allocs = list({id(a): a for t in chosen for a in tagged.allocators(t)
                       if not a.asleep}.values())
        plans = [(alloc, _ranges(alloc)) for alloc in allocs]  # refusals before any write
        written: dict[int, _Saved] = {}
        made: list[str] = []
        try:
            with tagged.keep_thread_device(allocs):
                for alloc, ranges in plans:
                    saved = written[id(alloc)] = _Saved(chunk=chunk_bytes)
                    kept = _kept_files(alloc, directory)
                    if not ranges:
                        continue
                    alloc.backend.synchronize(alloc.device)
                    staging = _staging_buffer(alloc.backend, alloc.device,
                                              min(chunk_bytes, max(s for _, s in ranges)))
                    for address, size in ranges:
                        again = kept.get((address, size))
                        try:
                            path = _write_file(directory, alloc.backend, alloc.device,
                                               address, size, staging, staging.size,
                                               prefix, again)
                        except OSError as exc:
                            raise _failure("writing sleeping memory", directory, exc) from exc
                        if again is None:
                            made.append(path)
                        saved.files.append((path, address, size))
            tagged.sleep(chosen)  # discarding: the bytes are in the files
        except BaseException:
            _remove(made)
            raise
        for alloc in allocs:  # kept files of ranges no longer live
            used = {p for p, _, _ in written[id(alloc)].files}
            old = _record(alloc)
            if old is not None:
                old.files = [f for f in old.files if f[0] not in used]
                _forget(id(alloc))  # removes the files that were not written again
        with _lock:
            for alloc in allocs:
                saved = written[id(alloc)]
                saved.finalizer = weakref.finalize(alloc, _remove,
                                                   [p for p, _, _ in saved.files])
                _saved[id(alloc)] = (weakref.ref(alloc), saved)


def _record(alloc) -> _Saved | None:
    with _lock:
        entry = _saved.get(id(alloc))
    if entry is None or not _holds_record(entry[0], alloc):
        return None
    return entry[1]


def _kept_files(alloc, directory: str) -> dict[tuple[int, int], str]:
    """(address, size) -> the file kept for that range of ``alloc`` by a wake that kept
    its files, where it is in ``directory``."""
    saved = _record(alloc)
    if saved is None or not saved.awake:
        return {}
    return {(address, size): path for path, address, size in saved.files
            if os.path.normpath(os.path.dirname(path)) == os.path.normpath(directory)}


def _holds_record(ref, alloc) -> bool:
    """Whether the record's allocator is ``alloc`` (ids are reused once one is gone)."""
    return ref() is alloc


def wake_up(tags, keep_files: bool = False) -> None:
    """Re-create the memory of ``tags`` at its addresses and read back what :func:`sleep`
    wrote, removing the files (``keep_files``: keeping them, as torch_memory_saver does,
    for the next sleep to write the same ranges into; they go when their memory is
    closed, or when a later sleep finds their range no longer live).  Memory woken from
    a discarding sleep is woken as ``vmm_core.wake_up`` does.  On a read failure that
    allocator sleeps again with its files kept (DiskBackupError); call again once the
    cause is fixed."""
    from . import tagged

    named = _named(tags, "disk_offload.wake_up: tags")
    _sweep_closed()
    with tag_state.state_lock():
        chosen = list(tagged.tags()) if named is None else named
        allocs = list({id(a): a for t in chosen for a in tagged.allocators(t)}.values())
        tagged.wake_up(chosen)
        failures = []
        with tagged.keep_thread_device(allocs):
            for alloc in allocs:
                with _lock:
                    entry = _saved.get(id(alloc))
                if entry is None or not _holds_record(entry[0], alloc):
                    continue
                saved = entry[1]
                if saved.awake:
                    continue  # woken before, its files kept
                try:
                    for path, address, size in saved.files:
                        staging = _staging_buffer(alloc.backend, alloc.device,
                                                  min(saved.chunk, size))
                        try:
                            _read_file(path, alloc.backend, alloc.device, address, size,
                                       staging, staging.size)
                        except OSError as exc:
                            raise _failure("reading sleeping memory back", os.path.dirname(path),
                                           exc, path) from exc
                except DiskBackupError as exc:
                    alloc.sleep()  # the fresh pages hold nothing: sleep again, files kept
                    failures.append(exc)
                    continue
                if keep_files:
                    saved.awake = True
                else:
                    _forget(id(alloc))
        if failures:
            raise failures[0]


def _warn_if_memory(directory: str) -> None:
    kind = _filesystem(directory)
    if kind in _MEMORY_FILESYSTEMS and directory not in _warned_dirs:
        _warned_dirs.add(directory)
        logger.warning("sleep to disk: %s is on %s, which lives in host memory: the files "
                       "take as much host memory as an offload would. Point it at a disk.",
                       directory, kind)
