"""The MLU backend against the emulated libcndrv (tests/emulated/cndrv_emu.c).

Every documented cnMem* constraint the emulator enforces must come back through the backend
as the right vmm_core exception, with a message naming the driver call and the CNresult.
No MLU hardware is involved.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import threading

import emulated
import pytest

from vmm_backends.mlu import cndrv_bindings, vmm_api
from vmm_backends.mlu.cndrv_bindings import (
    CNmemAccessDesc,
    CNmemAllocationProp,
    CNmemLocation,
    Driver,
)
from vmm_backends.mlu.vmm_api import MLUBackend
from vmm_core.errors import BackendError, MappingError, OutOfMemoryError, VMMError
from vmm_core.testing.tools import read_bytes, write_bytes

G = 2 << 20  # the emulator's granularity


@pytest.fixture(scope="module")
def emu_path():
    try:
        return str(emulated.build("mlu"))
    except emulated.NotBuildable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def be(emu_path):
    yield emulated.backend_for("mlu")
    emulated.release("mlu")


@pytest.fixture
def emu(emu_path):
    lib = ctypes.CDLL(emu_path)  # same path: the very library the backend uses
    lib.emu_count.restype = ctypes.c_ulonglong
    lib.emu_count.argtypes = [ctypes.c_int]
    lib.emu_set_capacity.restype = ctypes.c_ulonglong
    lib.emu_set_capacity.argtypes = [ctypes.c_ulonglong]
    lib.emu_layout.restype = ctypes.c_long
    lib.emu_layout.argtypes = [ctypes.c_int]
    return lib


@pytest.fixture
def drv(be):
    return be.plugin.driver()


@pytest.fixture
def space(be):
    """A reservation of 8 granules and a handle of 2, released afterwards."""
    a = be.reserve(0, 8 * G, G)
    h = be.create_handle(0, 2 * G)
    yield a, h
    if h.mapped:
        for (dev, addr), (size, handle) in list(be.plugin._maps.items()):
            if handle is h:
                be.unmap(dev, addr, size)
    if not h.released:
        be.release_handle(0, h)
    be.release_range(0, a, 8 * G)


# ------------------------------------------------------------------ import and probe
def test_import_needs_no_library_and_loads_nothing():
    env = dict(os.environ, VMM_CORE_MLU_LIB="/nonexistent/libcndrv.so")
    code = ("import sys, vmm_backends.mlu, vmm_backends.mlu.vmm_api as m, "
            "vmm_backends.mlu.graph_ops, vmm_backends.mlu.allocator_adapter\n"
            "assert m.backend._drv is None, 'library loaded at import'\n"
            "from vmm_core.registry import BackendRegistry\n"
            "assert BackendRegistry(entry_points=[]).register(m.backend, name='mlu')\n"
            "assert m.backend._drv is None, 'library loaded by plugin registration'\n"
            "assert 'torch_mlu' not in sys.modules\n"
            "p = m.backend.vmm_probe()\n"
            "assert not p.available and 'VMM_CORE_MLU_LIB' in p.reason, p\n"
            "assert 'torch_mlu' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_probe_reason_names_env_var_when_library_missing(monkeypatch):
    plugin = MLUBackend()
    monkeypatch.setenv(vmm_api.ENV_LIBRARY, "/nonexistent/libcndrv.so")
    probe = plugin.vmm_probe()
    assert not probe.available
    assert "VMM_CORE_MLU_LIB" in probe.reason and "/nonexistent/libcndrv.so" in probe.reason
    monkeypatch.delenv(vmm_api.ENV_LIBRARY)
    try:
        ctypes.CDLL("libcndrv.so")
        pytest.skip("a real libcndrv.so is installed here")
    except OSError:
        pass
    probe = plugin.vmm_probe()
    assert not probe.available
    assert probe.reason.startswith("libcndrv.so not found")
    assert "Neuware" in probe.reason and "VMM_CORE_MLU_LIB" in probe.reason


def test_probe_never_raises_on_a_library_without_cnmem(monkeypatch):
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no libc to point at")
    monkeypatch.setenv(vmm_api.ENV_LIBRARY, libc)
    probe = MLUBackend().vmm_probe()
    assert not probe.available and "lacks" in probe.reason and "cnMemCreate" in probe.reason


def test_probe_says_emulated(be):
    probe = be.probe()
    assert probe.available and probe.priority == 100 and probe.device_count == 2
    assert "EMULATED" in probe.reason
    # the library in Probe.library, as every backend names it; versions hold versions
    assert probe.library == os.environ[vmm_api.ENV_LIBRARY] == str(emulated.build("mlu"))
    assert set(probe.versions) == {"cndrv"}


def test_capabilities_come_from_the_driver_and_say_why_no_graph_pool(be):
    caps = be.capabilities(0)
    assert caps.granularity == G
    assert caps.partial_map is False and caps.needs_set_access is True
    assert caps.set_access_spans_mappings is True  # as torch_mlu is reported to call it
    assert caps.graph_pool is False
    assert "MemPool" in caps.notes and "shared pool" in caps.notes
    assert "emulated" in caps.notes


def test_struct_layout_matches_the_c_compiler(emu):
    assert ctypes.sizeof(CNmemAllocationProp) == emu.emu_layout(0)
    assert ctypes.sizeof(CNmemAccessDesc) == emu.emu_layout(1)
    assert ctypes.sizeof(CNmemLocation) == emu.emu_layout(2)
    assert CNmemAllocationProp.location.offset == emu.emu_layout(3)
    assert CNmemAllocationProp.allocFlags.offset == emu.emu_layout(4)
    assert CNmemAccessDesc.accessFlags.offset == emu.emu_layout(5)
    assert CNmemAccessDesc.pinnedType.offset == emu.emu_layout(6)


# ------------------------------------------------------------------ mapping constraints
def test_partial_map_is_refused(be, space):
    a, h = space
    with pytest.raises(MappingError, match=r"cnMemMap\(.*CN_ERROR_INVALID_VALUE \(100006\)"):
        be.map(0, a, G, h, 0)


def test_non_zero_offset_is_refused(be, space):
    a, h = space
    with pytest.raises(MappingError, match=r"cnMemMap\(.*offset=2097152.*CN_ERROR_INVALID_VALUE"):
        be.map(0, a, 2 * G, h, G)


def test_unaligned_address_is_refused(be, space):
    a, h = space
    with pytest.raises(MappingError, match=r"cnMemMap.*CN_ERROR_INVALID_VALUE"):
        be.map(0, a + 4096, 2 * G, h, 0)


def test_map_outside_a_reservation_or_over_a_mapping(be, space):
    a, h = space
    h2 = be.create_handle(0, 2 * G)
    try:
        with pytest.raises(MappingError, match="cnMemMap.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
            be.map(0, a + 7 * G, 2 * G, h, 0)  # runs past the reservation
        be.map(0, a, 2 * G, h, 0)
        with pytest.raises(MappingError, match="cnMemMap.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
            be.map(0, a + G, 2 * G, h2, 0)  # overlaps
    finally:
        be.release_handle(0, h2)


def test_unaligned_sizes_are_refused(be):
    with pytest.raises(MappingError, match="cnMemAddressReserve.*CN_ERROR_INVALID_VALUE"):
        be.reserve(0, G + 4096, G)
    with pytest.raises(MappingError, match="cnMemAddressReserve.*CN_ERROR_INVALID_VALUE"):
        be.reserve(0, 4 * G, 3 * G)  # alignment must be a power-of-two multiple
    with pytest.raises(BackendError, match="cnMemCreate.*CN_ERROR_INVALID_VALUE"):
        be.create_handle(0, G + 4096)


@pytest.mark.parametrize("bad", [0, -G, 1.5])
def test_non_positive_sizes_never_reach_ctypes(be, bad):
    # the plugin's own check (ctypes would wrap -G into a huge size_t) ...
    with pytest.raises(MappingError, match="cnMemCreate: size"):
        be.plugin.vmm_create_handle(device=0, size=bad)
    # ... and through the Backend, whose check of every byte count comes first (0 is the
    # backend's to refuse)
    with pytest.raises(MappingError, match="cnMemCreate: size" if bad == 0 else
                       "vmm_create_handle: size"):
        be.create_handle(0, bad)


def test_set_access_covers_a_run_of_whole_mappings_in_one_call(be, space):
    """One cnMemSetAccess over several adjacent mappings is accepted (what torch_mlu is
    reported to do); part of a mapping, or a hole, is refused."""
    a, h = space
    h2 = be.create_handle(0, 2 * G)
    lib = be.plugin.driver().lib
    lib.emu_count.restype = ctypes.c_ulonglong
    try:
        be.map(0, a, 2 * G, h, 0)
        be.map(0, a + 2 * G, 2 * G, h2, 0)
        with pytest.raises(MappingError,
                           match="cnMemSetAccess.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
            be.set_access(0, a + 4 * G, 2 * G)  # nothing mapped there
        with pytest.raises(MappingError,
                           match="cnMemSetAccess.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
            be.set_access(0, a, 6 * G)  # the run ends in a hole
        with pytest.raises(MappingError, match="cnMemSetAccess.*CN_OPS_ERROR_NOT_SUPPORTED"):
            be.set_access(0, a, G)  # part of a mapping
        with pytest.raises(MappingError, match="cnMemSetAccess.*CN_OPS_ERROR_NOT_SUPPORTED"):
            be.set_access(0, a + G, 3 * G)  # starts inside a mapping
        calls = lib.emu_count(4)
        be.set_access(0, a, 4 * G)  # two mappings, one call
        assert lib.emu_count(4) == calls + 1
        write_bytes(be, 0, a + 2 * G - 2, b"span")  # one copy may cross mappings
        assert read_bytes(be, 0, a + 2 * G - 2, 4) == b"span"
    finally:
        be.unmap(0, a + 2 * G, 2 * G)
        be.release_handle(0, h2)


def test_allocator_grants_access_to_a_run_with_one_call(be):
    """set_access_spans_mappings=True reaches the driver: a new virtual space that maps
    several handles grants access to the run with fewer calls than mappings."""
    from vmm_core import SharedVMMAllocator

    lib = be.plugin.driver().lib
    lib.emu_count.restype = ctypes.c_ulonglong
    alloc = SharedVMMAllocator(be, device=0, reserve_bytes=16 * G)
    alloc.merge_on_switch = False  # keep three handles, so the new space maps three
    try:
        for _ in range(3):
            write_bytes(be, 0, alloc.allocate(G), b"x")
        maps, calls = lib.emu_count(1), lib.emu_count(4)
        alloc.switch_to_new_virtual_space()
        new_maps, new_calls = lib.emu_count(1) - maps, lib.emu_count(4) - calls
        assert new_maps >= 2 and 1 <= new_calls < new_maps, (new_maps, new_calls)
        write_bytes(be, 0, alloc.allocate(G), b"y")  # the new space is accessible
    finally:
        alloc.close()


def _desc(location_type=1, location_id=0, access=0):
    d = CNmemAccessDesc()
    d.location.type, d.location.id, d.accessFlags = location_type, location_id, access
    return d


@pytest.mark.parametrize("count, desc", [
    (2, _desc()),                      # count must be 1
    (0, _desc()),
    (1, _desc(location_type=0)),       # CN_MEM_LOCATION_TYPE_INVALID
    (1, _desc(location_id=1)),         # not the device the handle lives on
    (1, _desc(access=7)),              # unknown access flag
])
def test_set_access_bad_descriptor(be, drv, space, count, desc):
    a, h = space
    be.map(0, a, 2 * G, h, 0)
    with pytest.raises(MappingError, match=r"cnMemSetAccess.*CN_ERROR_INVALID_VALUE"):
        drv.call("cnMemSetAccess", a, 2 * G, ctypes.byref(desc), count)


def test_readonly_access_refuses_writes(be, drv, space):
    a, h = space
    be.map(0, a, 2 * G, h, 0)
    desc = _desc(access=cndrv_bindings.CN_MEM_ACCESS_FLAGS_PROT_READONLY)
    drv.call("cnMemSetAccess", a, 2 * G, ctypes.byref(desc), 1)
    assert read_bytes(be, 0, a, 4) == b"\0\0\0\0"
    with pytest.raises(BackendError, match="cnMemcpyHtoD.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
        write_bytes(be, 0, a, b"nope")


def test_unmap_must_match_one_whole_mapping(be, space):
    a, h = space
    be.map(0, a, 2 * G, h, 0)
    with pytest.raises(MappingError, match="cnMemUnmap.*CN_ERROR_INVALID_VALUE"):
        be.unmap(0, a, G)  # sub-range
    with pytest.raises(MappingError, match="cnMemUnmap.*CN_ERROR_INVALID_VALUE"):
        be.unmap(0, a + G, G)  # inside, not at the start
    with pytest.raises(MappingError, match="cnMemUnmap.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
        be.unmap(0, a + 4 * G, 2 * G)  # nothing mapped
    be.unmap(0, a, 2 * G)
    assert h.mapped == 0


def test_release_of_a_mapped_handle_is_refused(be, space):
    a, h = space
    be.map(0, a, 2 * G, h, 0)
    with pytest.raises(MappingError, match="cnMemRelease.*still has 1 mapping"):
        be.release_handle(0, h)
    be.unmap(0, a, 2 * G)
    be.release_handle(0, h)
    with pytest.raises(MappingError, match="cnMemRelease.*not a live MLU handle"):
        be.release_handle(0, h)


def test_driver_defers_release_of_a_mapped_handle_as_documented(be, drv, emu):
    """cn_api.h / guide 6.5.8.2: the free waits for the last unmap (no error code)."""
    a = be.reserve(0, 2 * G, G)
    handle = ctypes.c_uint64()
    prop = MLUBackend._prop(0)
    drv.call("cnMemCreate", ctypes.byref(handle), 2 * G, ctypes.byref(prop), 0)
    before = emu.emu_count(0)
    drv.call("cnMemMap", a, 2 * G, 0, handle.value, 0)
    drv.call("cnMemRelease", handle.value)
    assert emu.emu_count(3) == 1 and emu.emu_count(0) == before
    with pytest.raises(MappingError, match="cnMemMap.*CN_ERROR_INVALID_VALUE"):
        drv.call("cnMemMap", a, 2 * G, 0, handle.value, 0)  # released: unusable
    drv.call("cnMemUnmap", a, 2 * G)
    assert emu.emu_count(3) == 0 and emu.emu_count(0) == before - 1
    be.release_range(0, a, 2 * G)


def test_release_range_rules(be, space):
    a, h = space
    be.map(0, a, 2 * G, h, 0)
    with pytest.raises(MappingError, match="cnMemAddressFree.*CN_ERROR_INVALID_VALUE"):
        be.release_range(0, a, 8 * G)  # a mapping is still inside
    be.unmap(0, a, 2 * G)
    with pytest.raises(MappingError, match="cnMemAddressFree.*CN_ERROR_INVALID_VALUE"):
        be.release_range(0, a, 4 * G)  # not the reserved size
    with pytest.raises(MappingError,
                       match="cnMemAddressFree.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
        be.release_range(0, a + G, 2 * G)  # not a reservation start


@pytest.mark.parametrize("field, value, code", [
    ("type", 0, "CN_ERROR_INVALID_VALUE"),               # CN_MEM_ALLOCATION_TYPE_INVALID
    ("location.type", 0, "CN_ERROR_INVALID_VALUE"),      # CN_MEM_LOCATION_TYPE_INVALID
    ("location.id", 9, "CN_ERROR_INVALID_DEVICE"),
    ("requestedHandleTypes", 2, "CN_ERROR_INVALID_VALUE"),   # not in the enum
])
def test_create_with_wrong_struct_fields(be, drv, field, value, code):
    prop = MLUBackend._prop(0)
    target, _, name = field.rpartition(".")
    setattr(getattr(prop, target) if target else prop, name, value)
    handle = ctypes.c_uint64()
    with pytest.raises(BackendError, match=f"cnMemCreate.*{code}"):
        drv.call("cnMemCreate", ctypes.byref(handle), 2 * G, ctypes.byref(prop), 0)


def test_granularity_with_wrong_struct_fields(drv):
    prop = MLUBackend._prop(0)
    prop.location.type = 0
    out = ctypes.c_uint64()
    with pytest.raises(BackendError,
                       match="cnMemGetAllocationGranularity.*CN_ERROR_INVALID_VALUE"):
        drv.call("cnMemGetAllocationGranularity", ctypes.byref(out), ctypes.byref(prop), 0)


def test_unknown_device_is_refused(be):
    with pytest.raises(BackendError, match="mlu device 5 does not exist"):
        be.create_handle(5, 2 * G)


def test_out_of_memory(be, emu):
    old = emu.emu_set_capacity(4 * G)
    try:
        with pytest.raises(OutOfMemoryError,
                           match=r"cnMemCreate.*CN_MEMORY_ERROR_OUT_OF_MEMORY \(100100\)"):
            be.create_handle(1, 6 * G)
    finally:
        emu.emu_set_capacity(old)


@pytest.mark.parametrize("call, args, exc", [
    ("cnDeviceGetCount", lambda: (ctypes.byref(ctypes.c_int()),), BackendError),
    ("cnMemCreate", lambda: (ctypes.byref(ctypes.c_uint64()), G,
                             ctypes.byref(MLUBackend._prop(0)), 0), BackendError),
    ("cnMemAddressReserve", lambda: (ctypes.byref(ctypes.c_uint64()), G, 0, 0, 0),
     BackendError),
    ("cnMemMap", lambda: (0, G, 0, 1, 0), BackendError),
    ("cnCtxSync", lambda: (), BackendError),
])
def test_calls_before_cninit(emu_path, tmp_path, call, args, exc):
    copy = tmp_path / "libcndrv_fresh.so"  # a second copy has its own, uninitialized state
    shutil.copy(emu_path, copy)
    fresh = Driver(str(copy))
    with pytest.raises(exc, match=f"{call}.*CN_ERROR_NOT_INITIALIZED") as err:
        fresh.call(call, *args())
    assert not isinstance(err.value, MappingError)  # not a misuse of the mapping rules


def test_copies_of_unmapped_or_inaccessible_memory_fail_cleanly(be, space):
    a, h = space
    with pytest.raises(BackendError, match="cnMemcpyDtoH.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
        read_bytes(be, 0, a, 16)
    be.map(0, a, 2 * G, h, 0)  # mapped, access not yet set
    with pytest.raises(BackendError, match="cnMemcpyHtoD.*CN_MEMORY_ERROR_INVALID_ADDRESS"):
        write_bytes(be, 0, a, b"x")


def test_device_copy_and_contexts_per_thread(be, emu, space):
    a, h = space
    be.map(0, a, 2 * G, h, 0)
    be.set_access(0, a, 2 * G)
    write_bytes(be, 0, a, b"hello")
    be.copy_device(0, a, a + G, 5)
    assert read_bytes(be, 0, a + G, 5) == b"hello"

    results = {}

    def raw():  # a thread with no context bound: the driver refuses the copy
        buf = ctypes.create_string_buffer(4)
        emu.cnMemcpyDtoH.restype = ctypes.c_int
        emu.cnMemcpyDtoH.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
        results["raw"] = emu.cnMemcpyDtoH(ctypes.addressof(buf), a, 4)

    def through_backend():  # the backend binds the context on every thread
        results["backend"] = read_bytes(be, 0, a, 5)
        be.synchronize(0)

    for fn in (raw, through_backend):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    assert results["raw"] == cndrv_bindings._CODE["CN_CONTEXT_ERROR_INVALID"]
    assert results["backend"] == b"hello"


@pytest.mark.parametrize("code, exc", [
    (100100, OutOfMemoryError), (100101, OutOfMemoryError), (100010, OutOfMemoryError),
    (100053, OutOfMemoryError), (100006, MappingError), (100102, MappingError),
    (100201, BackendError), (424242, BackendError),
])
def test_error_mapping(code, exc):
    with pytest.raises(exc) as err:
        cndrv_bindings.raise_for("cnMemMap", code)
    assert "cnMemMap" in str(err.value) and str(code) in str(err.value)
    assert isinstance(err.value, VMMError)
    if exc is BackendError:
        assert not isinstance(err.value, (MappingError, OutOfMemoryError))


def test_export_reads_the_descriptor_from_an_eight_byte_buffer(be, monkeypatch):
    """cn_api.h does not say how wide the descriptor behind ``void *shareableHandle`` is:
    a driver that writes 8 bytes overruns a 4-byte int (shown raw), the backend's 8-byte
    buffer takes it and the descriptor comes from the low 32 bits."""
    class IntThenCanary(ctypes.Structure):
        _fields_ = [("fd", ctypes.c_int), ("canary", ctypes.c_uint32)]

    lib = be.plugin.driver().lib
    lib.emu_set_export_fd_width.argtypes = [ctypes.c_int]
    lib.emu_set_export_fd_width.restype = None
    handle = be.create_shareable_handle(0, G)
    lib.emu_set_export_fd_width(8)
    try:
        raw = IntThenCanary(-1, 0xA5A5A5A5)
        assert lib.cnMemExportToShareableHandle(ctypes.addressof(raw), handle.value, 1, 0) == 0
        os.close(raw.fd)
        assert raw.canary == 0, "an 8-byte write must reach past a 4-byte int"
        drv = be.plugin.driver()
        call, widths = drv.call, []

        def spy(name, *args, **kw):
            if name == "cnMemExportToShareableHandle":
                widths.append(ctypes.sizeof(args[0]._obj))  # the buffer behind byref()
            return call(name, *args, **kw)

        monkeypatch.setattr(drv, "call", spy)
        for width in (8, 4):
            lib.emu_set_export_fd_width(width)
            fd = be.export_handle(0, handle, [])
            try:
                imported = be.import_handle(0, fd, G)  # a real descriptor of the memory
            finally:
                os.close(fd)
            be.release_handle(0, imported)
        assert widths == [8, 8]
    finally:
        lib.emu_set_export_fd_width(4)
        be.release_handle(0, handle)
