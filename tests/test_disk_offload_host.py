"""Sleep to disk (vmm_core.memory.disk_offload) and torch_memory_saver's disk backup on
it, on the host backend: bytes come back exactly, files exist only while needed, and a
full disk, a directory that cannot be written or a file that cannot be read leaves
nothing lost and says why."""

from __future__ import annotations

import ctypes
import os
import random
import shutil

import pytest
from proc_state import run_python

import vmm_core
from vmm_core.integrations import torch_memory_saver as compat
from vmm_core.memory import disk_offload, tagged

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags", "fresh_compat")


def _random(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _filled(host, tag: str, sizes: list[int], seed: int):
    """Allocations of ``sizes`` under ``tag`` with random bytes; (allocator, [(address,
    bytes)])."""
    with vmm_core.region(tag, backend=host) as alloc:
        addresses = [alloc.allocate(n) for n in sizes]
    data = []
    for i, (address, n) in enumerate(zip(addresses, sizes)):
        payload = _random(n, seed + i)
        ctypes.memmove(address, payload, n)
        data.append((address, payload))
    return alloc, data


def _intact(data) -> bool:
    return all(ctypes.string_at(a, len(b)) == b for a, b in data)


def test_bytes_go_to_files_and_come_back_exactly(host, tmp_path):
    alloc, data = _filled(host, "d", [3 * MIB, MIB, MIB], seed=1)
    del data[1]  # between the two live ranges: free, never written
    alloc.live_ranges = lambda: [(data[0][0], 3 * MIB), (data[1][0] + 4096, 8192)]
    disk_offload.sleep(["d"], str(tmp_path), chunk_bytes=MIB)
    files = disk_offload.files(alloc)
    assert alloc.asleep and alloc.physical_bytes == 0 and alloc.host_bytes == 0
    assert len(files) == 2 and sorted(os.path.getsize(f) for f in files) == [8192, 3 * MIB]
    assert set(os.listdir(tmp_path)) == {os.path.basename(f) for f in files}
    disk_offload.wake_up(["d"])
    assert ctypes.string_at(data[0][0], 3 * MIB) == data[0][1]
    assert ctypes.string_at(data[1][0] + 4096, 8192) == data[1][1][4096:4096 + 8192]
    assert os.listdir(tmp_path) == [], "removed once their bytes are back"


def test_files_of_memory_closed_while_asleep_are_removed(host, tmp_path):
    alloc, _ = _filled(host, "gone", [MIB], seed=2)
    disk_offload.sleep("gone", str(tmp_path))
    assert len(os.listdir(tmp_path)) == 1
    alloc.close()
    assert disk_offload.files() == [] and os.listdir(tmp_path) == []


def test_a_directory_that_cannot_be_written_loses_nothing(host, tmp_path):
    alloc, data = _filled(host, "w", [2 * MIB], seed=3)
    target = tmp_path / "backups"
    target.mkdir()
    shutil.rmtree(target)
    target.write_bytes(b"a file where the directory was")
    with pytest.raises(disk_offload.DiskBackupError, match="backups"):
        disk_offload.sleep("w", str(target))
    assert not alloc.asleep and _intact(data)
    with pytest.raises(disk_offload.DiskBackupError, match="No such file|Not a directory"):
        disk_offload.sleep("w", str(target / "below-a-file"))
    assert not alloc.asleep and _intact(data)


def test_a_file_that_cannot_be_read_back_keeps_the_memory_asleep_until_it_can(host, tmp_path):
    alloc, data = _filled(host, "r", [2 * MIB], seed=4)
    disk_offload.sleep("r", str(tmp_path))
    (path,) = disk_offload.files(alloc)
    os.rename(path, path + ".away")
    with pytest.raises(disk_offload.DiskBackupError, match="No such file"):
        disk_offload.wake_up("r")
    assert alloc.asleep and disk_offload.files(alloc) == [path], "asleep, its file kept"
    os.rename(path + ".away", path)
    disk_offload.wake_up("r")
    assert _intact(data) and os.listdir(tmp_path) == []


def test_memory_shared_by_several_spaces_cannot_sleep_to_disk(host, tmp_path):
    pool = vmm_core.GraphPool(backend=host, tag="graphs")
    for key in (1, 2):
        with pool.space(key):
            pool.allocator.deallocate(pool.allocator.allocate(MIB))
    with pytest.raises(vmm_core.SleepStateError, match="virtual spaces"):
        disk_offload.sleep("graphs", str(tmp_path))
    assert not pool.allocator.asleep and os.listdir(tmp_path) == []
    pool.close()


def test_a_full_disk_loses_nothing_and_says_so():
    """The file size limit (``ulimit -f``) fails the write as a full disk does: the
    process ignores SIGXFSZ, so the write returns EFBIG.  In a child, whose limit is its
    own."""
    result = run_python("""
        import ctypes, os, resource, signal, tempfile
        import vmm_core
        from vmm_core.memory import disk_offload

        host = vmm_core.get_backend("host")
        with vmm_core.region("big", backend=host) as alloc:
            address = alloc.allocate(16 << 20)
        ctypes.memset(address, 0x5A, 16 << 20)
        directory = tempfile.mkdtemp()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, hard))
        try:
            disk_offload.sleep("big", directory, chunk_bytes=1 << 20)
        except disk_offload.DiskBackupError as exc:
            print("refused:", exc)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        print("awake", not alloc.asleep, ctypes.string_at(address + (15 << 20), 2) == b"ZZ")
        print("files left", os.listdir(directory))
        disk_offload.sleep("big", directory, chunk_bytes=1 << 20)  # room again: it works
        disk_offload.wake_up("big")
        print("after room", ctypes.string_at(address, 16 << 20) == b"Z" * (16 << 20))
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "refused:" in out and "File too large" in out and "ulimit -f" in out, out
    assert "awake True True" in out and "files left []" in out and "after room True" in out


# ------------------------------------------------------------------ torch_memory_saver
def test_tms_disk_backup_as_its_example_runs_it(host, tmp_path, monkeypatch):
    """torch_memory_saver's ``test/examples/disk_backup.py`` on the host: 1 MiB chunks, a
    tensor of ~13.4 chunks and a 7-byte one backed up to disk, one region without a
    backup; three rounds, a file per backed-up allocation, the same disk use each round,
    every byte back."""
    monkeypatch.setenv("TMS_DISK_BACKUP_CHUNK_MB", "1")
    tms = compat.TorchMemorySaver(backend=host)
    tms.set_disk_backup_dir(str(tmp_path))
    big_n = (MIB * 13 // 4 + 12345) * 4
    with tms.region(enable_disk_backup=True) as disk:
        # as torch's pool lays them out on a GPU: each in a segment of its own, the
        # second right after the first (one file for both failed the example there)
        big = disk.allocate(big_n)
        small = disk.allocate(7)
    big_bytes, small_bytes = _random(big_n, 5), bytes([10]) * 7
    ctypes.memmove(big, big_bytes, big_n)
    ctypes.memmove(small, small_bytes, 7)
    with tms.region(enable_disk_backup=False) as plain:
        no_backup = plain.allocate(20_000_000)
    ctypes.memset(no_backup, 20, 3)
    sizes, names = set(), set()
    for _ in range(3):
        tms.pause()
        files = os.listdir(tmp_path)
        total = sum(os.path.getsize(tmp_path / f) for f in files)
        assert len(files) == 2 and total >= big_n, files
        assert all(f.startswith("tms_") for f in files), files
        sizes.add(total)
        names.add(frozenset(files))
        tms.resume()
        assert ctypes.string_at(big, big_n) == big_bytes
        assert ctypes.string_at(small, 7) == small_bytes
        assert ctypes.string_at(no_backup, 3) != bytes([20]) * 3
        assert set(os.listdir(tmp_path)) == set(files), "kept after resume, as there"
    assert len(sizes) == 1 and len(names) == 1, "the same files written again each round"
    disk.deallocate(small)  # its file goes with the next pause, as with a freed tensor
    tms.pause()
    assert len(os.listdir(tmp_path)) == 1 and os.listdir(tmp_path)[0] in files
    tms.resume()
    assert ctypes.string_at(big, big_n) == big_bytes
    disk.close()
    assert os.listdir(tmp_path) == [] and disk_offload.files() == [], "gone with the memory"
    assert compat.vmm_tags("default") == ["tms:default", "tms:default:disk_backup"]


def test_tms_disk_backup_settings_and_get_cpu_backup(host, tmp_path, monkeypatch):
    import torch

    from vmm_core.memory.torch_views import raw_tensor

    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(tmp_path / "from-env"))
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("w", enable_disk_backup=True) as w:
        x = raw_tensor(w.allocate(MIB), MIB, "cpu")
    x.fill_(3)
    tms.pause("w")
    assert len(os.listdir(tmp_path / "from-env")) == 1
    assert tms.get_cpu_backup(x) is None, "a disk backup has no host copy"
    tms.resume("w")
    assert torch.all(x == 3)
    tms.set_disk_backup_dir(str(tmp_path / "made"))  # created, as there
    assert os.path.isdir(tmp_path / "made")
    tms.pause("w")
    assert len(os.listdir(tmp_path / "made")) == 1
    tms.resume("w")


def test_a_tms_pause_that_cannot_write_its_files_pauses_nothing(host, tmp_path):
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("kv") as kv:
        kv.allocate(MIB)
    with tms.region("w", enable_disk_backup=True) as w:
        address = w.allocate(MIB)
    ctypes.memset(address, 9, MIB)
    blocked = tmp_path / "blocked"
    tms.set_disk_backup_dir(str(blocked))
    shutil.rmtree(blocked)
    blocked.write_bytes(b"")  # the directory became a file
    with pytest.raises(disk_offload.DiskBackupError):
        tms.pause()
    assert not kv.asleep and not w.asleep, "a failed disk write pauses nothing"
    tms.set_disk_backup_dir(str(tmp_path / "ok"))
    tms.pause()  # finishes the failed call
    assert kv.asleep and w.asleep
    tms.resume()
    assert ctypes.string_at(address, 4) == b"\x09" * 4
    assert tagged.allocators("tms:w:disk_backup") == [w]
