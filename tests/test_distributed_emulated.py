"""Sharing handles between processes on the emulated Ascend and MLU drivers.

The emulated libraries implement the vendors' sharing calls for real (an Ascend
shareable handle is an integer naming the exporter's memfd plus a pid allow-list; an MLU
one is a file descriptor), so two rank processes really alias through them.  Checked:
the export/import contract and the refusals the headers state (import by a process not
on the allow-list, import after the exporter freed the handle, export of a handle not
created exportable, access from a device that does not hold the memory), the CANN usage
rules the Ascend emulator enforces (no own and imported handles in one reservation, no
import in the exporting process, one export per handle, peer access before a cross-device
import; see the header of tests/emulated/ascendcl_emu.c), and vmm_core.distributed end to
end.  No Ascend or MLU hardware is involved.
"""

from __future__ import annotations

import ctypes
import os

import emulated  # tests/emulated: builds the fake vendor libraries
import pytest

import vmm_core
from vmm_core.distributed import mapped_memory, mapped_tensor
from vmm_core.distributed.group import Group
from vmm_core.errors import BackendError, DistributedError, MappingError
from vmm_core.testing import read_bytes, write_bytes
from vmm_core.testing.ranks import check_ranks, run_ranks

TIMEOUT = 40


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    try:
        ascend, mlu = emulated.build("ascend"), emulated.build("mlu")
    except emulated.NotBuildable as exc:
        pytest.skip(f"emulated drivers cannot be built: {exc}")
    share_dir = tmp_path_factory.mktemp("acl_shares")
    env = {emulated.DRIVERS["ascend"][1]: str(ascend), emulated.DRIVERS["mlu"][1]: str(mlu),
           "ASCENDCL_EMU_SHARE_DIR": str(share_dir)}
    yield env
    assert not os.listdir(share_dir), "exported Ascend handles were left behind"


def _pattern(rank: int, n: int) -> bytes:
    return bytes((rank * 37 + i * 11) & 0xFF for i in range(n))


# ------------------------------------------------------------------ rank functions
def _rows_across_processes(rank, world, platform, devices, kind="continuous"):
    """mapped_memory end to end: each rank writes its part, reads every other part."""
    be = vmm_core.get_backend(platform)
    g = be.capabilities(0).granularity
    mem = mapped_memory(world * 3, g, kind=kind, backend=be, device=devices[rank],
                        timeout=5)
    try:
        dev = devices[rank]
        write_bytes(be, dev, mem.part_address(rank), _pattern(rank, 3 * g))
        Group().gather(None, "written")
        seen = {r: read_bytes(be, dev, mem.part_address(r), 3 * g) == _pattern(r, 3 * g)
                for r in range(world)}
        whole = mem.address == mem.part_address(0) and \
            mem.part_address(1) == mem.address + 3 * g
        return {"seen": seen, "contiguous": whole, "sharing": be.capabilities(dev)
                .shareable_handles}
    finally:
        mem.close()


def _continuous_refused(rank, world):
    with pytest.raises(DistributedError) as info:
        mapped_memory(world * 3, 2 << 20, kind="continuous", backend="ascend",
                      device=rank % 2, timeout=5)
    return str(info.value)


def _rank0_exports(rank):
    """What these two-rank Ascend checks share: rank 0 makes a handle of one granule and
    exports it to rank 1's process.  Returns (backend, ACL library, granularity, group,
    handle, shareable value); the last two are None on rank 1, and the caller gathers the
    value once rank 0 has done what must come before rank 1 imports it."""
    be = vmm_core.get_backend("ascend")
    g = be.capabilities(0).granularity
    group = Group()
    pids = group.gather(be.process_id(0), "pids")
    handle = value = None
    if rank == 0:
        handle = be.create_shareable_handle(0, g)
        value = be.export_handle(0, handle, [pids[1]])
    return be, be.plugin._acl, g, group, handle, value


def _ascend_mixed_reservation(rank, world):
    """Rank 1 maps its own handle and rank 0's, imported, into one reservation."""
    be, lib, g, group, handle, value = _rank0_exports(rank)
    out = {}
    if rank == 0:
        address = be.reserve(0, g, g)
        be.map(0, address, g, handle, 0)
        write_bytes(be, 0, address, b"rank0")  # before rank 1 may read it
    value = group.gather(value, "value")[0]
    if rank == 1:
        imported = be.import_handle(0, value, g)
        own = be.create_handle(0, g)
        span = be.reserve(0, 2 * g, g)
        alone = be.reserve(0, g, g)
        be.map(0, span, g, own, 0)
        # doc rule R1 in the emulator: the raw call is refused
        out["raw"] = lib.aclrtMapMem(span + g, g, 0, imported.ptr, 0)
        with pytest.raises(MappingError) as refused:
            be.map(0, span + g, g, imported, 0)
        out["refused"] = str(refused.value)
        with pytest.raises(MappingError) as not_own:  # only own handles are exported
            be.export_handle(0, imported, [])
        out["not_own"] = str(not_own.value)
        be.map(0, alone, g, imported, 0)  # a reservation of its own is fine
        be.set_access_for(0, alone, g, [0])
        out["through_own_range"] = read_bytes(be, 0, alone, 5)
        be.unmap(0, alone, g)
        be.unmap(0, span, g)
        be.release_handle(0, imported)
        be.release_handle(0, own)
        be.release_range(0, span, 2 * g)
        be.release_range(0, alone, g)
    group.gather(None, "done")
    if rank == 0:
        be.unmap(0, address, g)
        be.release_range(0, address, g)
        be.release_handle(0, handle)
    return out


def _refused_across_devices(rank, world, platform):
    with pytest.raises(DistributedError) as info:
        mapped_memory(4, 2 << 20, backend=platform, device=rank, timeout=5)
    return str(info.value)


def _ascend_allow_list(rank, world):
    """Rank 0 exports twice: once allowing nobody, once allowing rank 1."""
    be = vmm_core.get_backend("ascend")
    g = be.capabilities(rank).granularity
    group = Group()
    pids = group.gather(be.process_id(rank), "pids")
    out = {}
    if rank == 0:
        closed = be.create_shareable_handle(0, g)
        open_ = be.create_shareable_handle(0, g)
        values = (be.export_handle(0, closed, []), be.export_handle(0, open_, [pids[1]]))
        address = be.reserve(0, g, g)
        be.map(0, address, g, open_, 0)
        write_bytes(be, 0, address, b"written by rank 0")
    values = group.gather(values if rank == 0 else None, "values")[0]
    if rank == 1:
        lib = be.plugin._acl
        lib.lib.emu_peer_enable_calls.restype = ctypes.c_size_t
        raw = ctypes.c_void_p()
        # doc rule R6: memory of NPU 0 for NPU 1 needs aclrtDeviceEnablePeerAccess first
        out["raw_no_peer"] = lib.aclrtMemImportFromShareableHandle(values[1], 1,
                                                                   ctypes.byref(raw))
        with pytest.raises(MappingError) as refused:
            be.import_handle(1, values[0], g)
        out["refused"] = str(refused.value)
        handle = be.import_handle(1, values[1], g)
        address = be.reserve(1, g, g)
        be.map(1, address, g, handle, 0)
        be.set_access_for(1, address, g, [1])
        out["read"] = read_bytes(be, 1, address, 17)
        write_bytes(be, 1, address, b"answer of rank 1!")
        be.unmap(1, address, g)
        be.release_handle(1, handle)
        be.release_range(1, address, g)
        out["peer_calls"] = lib.lib.emu_peer_enable_calls()  # two imports, one pair
    group.gather(None, "imported")
    if rank == 0:
        out["answer"] = read_bytes(be, 0, address, 17)
        be.unmap(0, address, g)
        be.release_range(0, address, g)
        be.release_handle(0, open_)  # freeing the exported handle withdraws its value
    group.gather(None, "freed")
    if rank == 1:
        with pytest.raises(MappingError) as gone:
            be.import_handle(1, values[1], g)
        out["gone"] = str(gone.value)
    group.gather(None, "checked")
    if rank == 0:
        be.release_handle(0, closed)
    return out


def _ascend_import_twice(rank, world):
    """Rank 1 imports one shareable handle twice while the first import is alive."""
    be, lib, g, group, handle, value = _rank0_exports(rank)
    out = {}
    value = group.gather(value, "value")[0]
    if rank == 1:
        first = be.import_handle(0, value, g)
        raw = ctypes.c_void_p()
        out["raw"] = lib.aclrtMemImportFromShareableHandle(value, 0, ctypes.byref(raw))
        if out["raw"] == 0:
            lib.aclrtFreePhysical(raw)
        with pytest.raises(MappingError) as refused:
            be.import_handle(0, value, g)
        out["refused"] = str(refused.value)
        be.release_handle(0, first)
        again = be.import_handle(0, value, g)  # the first import is gone: allowed again
        be.release_handle(0, again)
    group.gather(None, "done")
    if rank == 0:
        be.release_handle(0, handle)
    return out


def _continuous_with_a_bad_device(rank, world, platform):
    """Rank 1 names a device the backend does not have; every rank must hear of it now."""
    with pytest.raises(Exception) as info:
        mapped_memory(world * 3, 2 << 20, kind="continuous", backend=platform,
                      device=0 if rank == 0 else 7, timeout=5)
    return f"{type(info.value).__name__}: {info.value}"


def _ascend_import_after_a_deferred_free(rank, world):
    """Rank 0 frees its exported handle while it is still mapped (CANN defers the free to
    the last unmap); rank 1 tries to import the value afterwards."""
    be, lib, g, group, handle, value = _rank0_exports(rank)
    out = {}
    if rank == 0:
        address = be.reserve(0, g, g)
        be.map(0, address, g, handle, 0)
        out["free"] = lib.aclrtFreePhysical(handle.ptr)  # deferred: still mapped
    value = group.gather(value, "value")[0]
    if rank == 1:
        raw = ctypes.c_void_p()
        out["import"] = lib.aclrtMemImportFromShareableHandle(value, 0, ctypes.byref(raw))
        if out["import"] == 0:
            lib.aclrtFreePhysical(raw)
    group.gather(None, "done")
    if rank == 0:
        assert lib.aclrtUnmapMem(address) == 0  # the last unmap frees it
        be.release_range(0, address, g)
    return out


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", [2, 3])
def test_ascend_ranks_share_rows_through_integer_handles(libs, world):
    devices = [r % 2 for r in range(world)]  # the emulator has two NPUs
    values = check_ranks(run_ranks(_rows_across_processes, world,
                                   args=("ascend", devices, "chunked"), env=libs,
                                   timeout=TIMEOUT))
    for v in values:
        assert v["sharing"] == "integer" and not v["contiguous"]
        assert all(v["seen"].values()), v


def test_ascend_continuous_is_refused_naming_chunked(libs):
    """aclrtMapMem may not mix own and imported handles in one reservation: every rank
    gets the same refusal, which names the kind that works."""
    messages = check_ranks(run_ranks(_continuous_refused, 2, env=libs, timeout=TIMEOUT))
    assert messages[0] == messages[1]
    assert "mixed_handle_reservations is False" in messages[0]
    assert "kind='chunked'" in messages[0]


def test_ascend_emulator_refuses_own_and_imported_handles_in_one_reservation(libs):
    values = check_ranks(run_ranks(_ascend_mixed_reservation, 2, env=libs, timeout=TIMEOUT))
    rank1 = values[1]
    assert rank1["raw"] == 107000  # ACL_ERROR_RT_PARAM_INVALID
    assert "aclrtMapMem" in rank1["refused"] and "107000" in rank1["refused"]
    assert rank1["through_own_range"] == b"rank0"
    assert "107000" in rank1["not_own"] and "imported" in rank1["not_own"]


def test_ascend_import_needs_the_allow_list_and_a_live_exporter(libs):
    values = check_ranks(run_ranks(_ascend_allow_list, 2, env=libs, timeout=TIMEOUT))
    rank0, rank1 = values
    assert rank1["read"] == b"written by rank 0"
    assert rank0["answer"] == b"answer of rank 1!"
    assert "207006" in rank1["refused"] and "allow-list" in rank1["refused"]
    assert rank1["raw_no_peer"] == 207000  # ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert rank1["peer_calls"] == 1
    assert "107017" in rank1["gone"]  # ACL_ERROR_RT_INVALID_HANDLE


def test_ascend_emulator_refuses_a_second_import_of_one_value_in_a_process(libs):
    """aclrtMemImportFromShareableHandle (aclcppdevg_03_0121, "Restrictions"): handle and
    shareableHandle are one-to-one in a process, importing the same value again while its
    first import lives returns an error."""
    values = check_ranks(run_ranks(_ascend_import_twice, 2, env=libs, timeout=TIMEOUT))
    rank1 = values[1]
    assert rank1["raw"] == 107000  # ACL_ERROR_RT_PARAM_INVALID (emulator's choice of code)
    assert "107000" in rank1["refused"] and "already imported" in rank1["refused"]


def test_ascend_emulator_refuses_to_import_a_handle_freed_while_mapped(libs):
    """aclrtFreePhysical of a mapped handle succeeds and only defers the memory's release
    (R4); the handle is gone for its owner, and the import page ("Restrictions") requires
    the shared memory not to have been freed before the import."""
    values = check_ranks(run_ranks(_ascend_import_after_a_deferred_free, 2, env=libs,
                                   timeout=TIMEOUT))
    assert values[0]["free"] == 0
    assert values[1]["import"] == 107017  # ACL_ERROR_RT_INVALID_HANDLE, as after a free


@pytest.mark.parametrize("platform", ["mlu", "host"])
def test_continuous_check_does_not_strand_ranks_when_one_device_is_bad(libs, platform):
    """Asking for the mixed_handle_reservations capability must not take one rank out
    before the first collective: a rank whose device the backend refuses would leave the
    others waiting in that collective (until its peer exits, or the group's timeout, 30
    min by default in torch) and never tell them why.  Every rank gets the reason."""
    messages = check_ranks(run_ranks(_continuous_with_a_bad_device, 2, args=(platform,),
                                     env=libs, timeout=TIMEOUT))
    assert messages[0] == messages[1]
    assert "rank(s) [1]" in messages[0] and "7" in messages[0], messages[0]


def test_mlu_ranks_on_one_device_share_rows_through_descriptors(libs):
    values = check_ranks(run_ranks(_rows_across_processes, 2, args=("mlu", [0, 0]),
                                   env=libs, timeout=TIMEOUT))
    for v in values:
        assert v["sharing"] == "fd" and v["contiguous"] and all(v["seen"].values()), v


def test_mlu_ranks_on_two_devices_are_refused_with_the_remedy(libs):
    messages = check_ranks(run_ranks(_refused_across_devices, 2, args=("mlu",), env=libs,
                                     timeout=TIMEOUT))
    assert messages[0] == messages[1]
    assert "peer_access is False" in messages[0] and "location='host'" in messages[0]


# ------------------------------------------------------------------ one-process refusals
@pytest.fixture
def ascend(libs):
    backend = emulated.backend_for("ascend")
    yield backend
    emulated.release("ascend")


@pytest.fixture
def mlu(libs):
    backend = emulated.backend_for("mlu")
    yield backend
    emulated.release("mlu")


def test_vendors_without_tensor_views_say_so_before_any_collective(ascend, mlu):
    import torch

    for backend in (ascend, mlu):  # no process group exists: the refusal comes first
        with pytest.raises(BackendError, match="vmm_torch_tensor.*mapped_memory"):
            mapped_tensor((4, 1024), torch.float32, backend=backend, device=0)


def test_ascend_export_refusals_follow_the_header(ascend):
    from vmm_backends.ascend import acl_bindings as acl

    lib = ascend.plugin._acl
    g = ascend.capabilities(0).granularity
    handle = ascend.create_shareable_handle(0, g)
    out = ctypes.c_uint64()
    try:
        # handleType is "reserved param, must be MEM_HANDLE_TYPE_NONE"
        assert lib.aclrtMemExportToShareableHandle(handle.ptr, 2, 0, ctypes.byref(out)) == \
            acl.ACL_ERROR_INVALID_PARAM
        value = ascend.export_handle(0, handle, [])
        # doc rule R5: exporting one handle twice is an error; the backend exports once
        # and reuses the value
        assert lib.aclrtMemExportToShareableHandle(handle.ptr, 0, 0, ctypes.byref(out)) == \
            acl.ACL_ERROR_RT_PARAM_INVALID
        assert ascend.export_handle(0, handle, [ascend.process_id(0)]) == value
        # pidNum must be positive (memory.cpp); only the exporter may set the list
        assert lib.aclrtMemSetPidToShareableHandle(value, None, 0) == \
            acl.ACL_ERROR_INVALID_PARAM
        mine = (ctypes.c_int32 * 1)(ascend.process_id(0))
        assert lib.aclrtMemSetPidToShareableHandle(value, mine, 1) == acl.ACL_SUCCESS
        # doc rule R2: export and import are only supported across processes
        assert not ascend.capabilities(0).same_process_import
        imported = ctypes.c_void_p()
        assert lib.aclrtMemImportFromShareableHandle(value, 0, ctypes.byref(imported)) == \
            acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
        with pytest.raises(MappingError, match="207000.*another process"):
            ascend.import_handle(0, value, g)
    finally:
        ascend.release_handle(0, handle)


def test_mlu_export_import_refusals_follow_the_header(mlu):
    g = mlu.capabilities(0).granularity
    plain = mlu.create_handle(0, g)  # not created with POSIX_FD requested
    try:
        with pytest.raises(MappingError, match="CN_OPS_ERROR_NOT_SUPPORTED"):
            mlu.export_handle(0, plain, [])
    finally:
        mlu.release_handle(0, plain)
    r, w = os.pipe()
    try:
        with pytest.raises(MappingError, match="CN_ERROR_INVALID_VALUE"):
            mlu.import_handle(0, r, g)  # a descriptor that is no exported handle
    finally:
        os.close(r)
        os.close(w)


def test_mlu_memory_of_one_device_cannot_be_opened_to_another(mlu):
    g = mlu.capabilities(0).granularity
    handle = mlu.create_shareable_handle(1, g)
    fd = mlu.export_handle(1, handle, [])
    try:
        imported = mlu.import_handle(0, fd, g)
    finally:
        os.close(fd)
    address = mlu.reserve(0, g, g)
    try:
        mlu.map(0, address, g, imported, 0)
        with pytest.raises(MappingError, match="cnMemSetAccess.*CN_ERROR_INVALID_VALUE"):
            mlu.set_access_for(0, address, g, [0])  # the memory is on MLU 1
        mlu.set_access_for(0, address, g, [1])
        write_bytes(mlu, 0, address, b"through the import")
        mlu.unmap(0, address, g)
    finally:
        mlu.release_handle(0, imported)
        mlu.release_range(0, address, g)
        mlu.release_handle(1, handle)
