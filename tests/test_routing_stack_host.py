"""The per-thread routing stack: which allocator the shim's allocations go to.

A block (a region, a capture space) abandoned without being left, a generator dropped
half way for instance, is closed later by the garbage collector; closing it must take
its own entry off the stack, not the one of the block opened since."""

from __future__ import annotations

import gc

from vmm_core.memory import routing


class _Allocator:
    def __init__(self, name: str) -> None:
        self.name = name


def test_a_block_closed_late_takes_its_own_entry_off_not_the_newest():
    outer, abandoned, newest = _Allocator("outer"), _Allocator("abandoned"), _Allocator("new")
    with routing.target(7, outer):
        block = routing.target(7, abandoned)
        block.__enter__()
        with routing.target(7, newest):
            del block
            gc.collect()  # the abandoned block is closed now, inside the newest one
            assert routing.current_target(7) is newest
        assert routing.current_target(7) is outer
    assert routing.current_target(7) is None


def test_the_same_allocator_nested_leaves_in_order():
    a = _Allocator("a")
    with routing.target(7, a):
        with routing.target(7, a):
            assert routing.current_target(7) is a
        assert routing.current_target(7) is a
    assert routing.current_target(7) is None
