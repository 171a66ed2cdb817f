"""A closed allocator's addresses do not go back while the framework still holds a
segment there (host backend; the framework's report is stood in for: on CUDA it is
torch's own memory snapshot, tests/test_cuda_workspace.py).

Found on the H100: closing every tagged allocator while torch still held one of their
segments, then making new ones, gave the new allocator the old addresses; torch then
held two segments at one address and aborted the process at exit.
"""

from __future__ import annotations

import ctypes

import pytest

import vmm_core
from vmm_backends.host.allocator_adapter import HostAllocatorAdapter
from vmm_core.memory import address_quarantine

PAGE = 4096


@pytest.fixture
def framework_holds(monkeypatch):
    """The segments the framework's allocator reports holding (a list the test edits)."""
    held: list[tuple[int, int]] = []
    monkeypatch.setattr(HostAllocatorAdapter, "held_segments", lambda self: list(held))
    yield held
    held.clear()
    for _ in address_quarantine.held_back():  # let every held-back range go
        address_quarantine.retry(vmm_core.get_backend("host"), 0)


def _reserved(host, base) -> bool:
    return base in host.plugin._ranges


def test_a_range_the_framework_holds_stays_reserved_until_it_lets_go(host, framework_holds):
    old = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    address = old.allocate(4 * PAGE)
    base = old.space_base()
    framework_holds.append((address, 4 * PAGE))  # a segment the framework still caches
    old.close()
    assert address_quarantine.held_back(0) == [(base, old.reserve_bytes)]
    assert _reserved(host, base)  # unmapped, but no later reservation can get it
    new = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    assert not base <= new.space_base() < base + old.reserve_bytes
    assert _reserved(host, base)  # still held: the next reservation tried and kept it
    framework_holds.clear()  # the framework freed its segment
    other = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    assert address_quarantine.held_back(0) == []
    # given back before ``other`` reserved: it may have got those very addresses
    assert not _reserved(host, base) or other.space_base() == base
    ctypes.memset(other.allocate(PAGE), 1, PAGE)
    new.close()
    other.close()


def test_ranges_nobody_holds_go_back_at_once(host, framework_holds):
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    alloc.allocate(PAGE)
    framework_holds.append((alloc.space_base() + 1000 * PAGE, PAGE))  # elsewhere
    bases = [alloc.space_base()]
    alloc.switch_to_new_virtual_space()
    bases.append(alloc.space_base())
    alloc.close()
    assert address_quarantine.held_back(0) == []
    assert not any(_reserved(host, b) for b in bases)


def test_a_released_space_the_framework_holds_is_held_back_too(host, framework_holds):
    alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=64 * PAGE)
    first = alloc.current_space
    address = alloc.allocate(PAGE)
    alloc.switch_to_new_virtual_space()
    framework_holds.append((address, PAGE))
    alloc.release_virtual_space(first)
    assert address_quarantine.held_back(0) == [(address, alloc.reserve_bytes)]
    assert first not in alloc.space_indices()
    framework_holds.clear()
    alloc.switch_to_new_virtual_space()  # the next reservation gives it back
    assert address_quarantine.held_back(0) == []
    alloc.close()
