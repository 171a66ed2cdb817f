"""The raw primitives, hook by hook: detection, aliasing through two ranges, whole-handle
maps, refusals, and byte counts no ``size_t`` would hold."""

from __future__ import annotations

import pytest

from ...capabilities import SHAREABLE_HANDLE_KINDS
from ...errors import BackendError, MappingError, VMMError
from ..tools import read_bytes, write_bytes
from .fixtures import pattern


def test_contract_probe_and_capabilities_speak_the_one_vocabulary(vmm_backend, vmm_device):
    """What every backend declares, in the words core compares (hookspecs' docstring);
    ``Backend.capabilities`` refuses a declaration outside them before this reads it."""
    probe = vmm_backend.probe()
    assert probe.available, probe.reason
    assert probe.device_count >= 1
    assert probe.library is None or (isinstance(probe.library, str) and probe.library)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in probe.versions.items()), \
        f"Probe.versions maps a component to its version string: {probe.versions!r}"
    caps = vmm_backend.capabilities(vmm_device)
    g = caps.granularity
    assert g > 0 and g & (g - 1) == 0, f"granularity {g} is not a power of two"
    assert caps.default_reserve_bytes % g == 0
    assert caps.shareable_handles in SHAREABLE_HANDLE_KINDS
    h = vmm_backend.create_handle(vmm_device, g)  # one granularity is a whole handle
    vmm_backend.release_handle(vmm_device, h)


def test_contract_two_ranges_alias_one_handle(vmm_backend, vmm_device, granularity):
    be, dev, g = vmm_backend, vmm_device, granularity
    caps = be.capabilities(dev)
    a = be.reserve(dev, 4 * g, g)
    b = be.reserve(dev, 4 * g, g)
    h = be.create_handle(dev, 2 * g)
    try:
        assert a % g == 0 and b % g == 0 and abs(a - b) >= 4 * g
        be.map(dev, a, 2 * g, h, 0)
        be.map(dev, b + g, 2 * g, h, 0)
        if caps.needs_set_access:
            be.set_access(dev, a, 2 * g)
            be.set_access(dev, b + g, 2 * g)
        data = pattern(2 * g, 7)
        write_bytes(be, dev, a, data)
        assert read_bytes(be, dev, b + g, 2 * g) == data
        write_bytes(be, dev, b + g + g - 3, b"xyz")
        assert read_bytes(be, dev, a + g - 3, 3) == b"xyz"
    finally:
        be.unmap(dev, a, 2 * g)
        be.unmap(dev, b + g, 2 * g)
        be.release_handle(dev, h)
        be.release_range(dev, a, 4 * g)
        be.release_range(dev, b, 4 * g)


def test_contract_partial_map_follows_capability(vmm_backend, vmm_device, granularity):
    be, dev, g = vmm_backend, vmm_device, granularity
    caps = be.capabilities(dev)
    a = be.reserve(dev, 4 * g, g)
    h = be.create_handle(dev, 2 * g)
    try:
        if caps.partial_map:
            be.map(dev, a, g, h, g)
            if caps.needs_set_access:
                be.set_access(dev, a, g)
            be.unmap(dev, a, g)
        else:
            with pytest.raises(MappingError):
                be.map(dev, a, g, h, 0)  # part of the handle
            with pytest.raises(MappingError):
                be.map(dev, a, g, h, g)  # non-zero offset
    finally:
        be.release_handle(dev, h)
        be.release_range(dev, a, 4 * g)


def test_contract_map_at_unaligned_address_is_refused(vmm_backend, vmm_device, granularity):
    be, dev, g = vmm_backend, vmm_device, granularity
    a = be.reserve(dev, 4 * g, g)
    h = be.create_handle(dev, g)
    try:
        with pytest.raises((MappingError, BackendError)) as err:
            be.map(dev, a + g // 2, g, h, 0)
        assert "map" in str(err.value).lower()
        be.map(dev, a, g, h, 0)  # the failure left everything usable
        be.unmap(dev, a, g)
    finally:
        be.release_handle(dev, h)
        be.release_range(dev, a, 4 * g)


@pytest.mark.parametrize("size", [0, -1])
def test_contract_bad_sizes_are_refused(vmm_backend, vmm_device, size):
    with pytest.raises(VMMError):
        vmm_backend.create_handle(vmm_device, size)
    with pytest.raises(VMMError):
        vmm_backend.reserve(vmm_device, size, 0)


@pytest.mark.parametrize("size", [2**64, 2**70, -1, True, 1.5])
def test_contract_byte_counts_past_size_t_never_reach_the_backend(vmm_backend, vmm_device,
                                                                   size):
    """Sizes reach a driver as ``size_t`` and wrap silently past it (2**64 became 0, and
    MAP_FIXED then mapped over the process's own memory): the Backend refuses them with
    its own message before the hook runs, whatever the backend's own checks."""
    be, dev = vmm_backend, vmm_device
    calls = [lambda: be.reserve(dev, size, 0), lambda: be.reserve(dev, 1 << 21, size),
             lambda: be.create_handle(dev, size), lambda: be.map(dev, 0, size, None, 0),
             lambda: be.map(dev, 0, 1 << 21, None, size), lambda: be.unmap(dev, 0, size),
             lambda: be.set_access(dev, 0, size), lambda: be.release_range(dev, 0, size),
             lambda: be.copy_to_host(dev, 0, 0, size), lambda: be.memset(dev, 0, 0, size),
             lambda: be.copy_device(dev, 0, 0, size)]
    for call in calls:
        with pytest.raises(MappingError, match=r"must be an int, got|outside 0\.\."):
            call()



__all__ = [n for n in list(globals()) if n.startswith("test_contract_")]
