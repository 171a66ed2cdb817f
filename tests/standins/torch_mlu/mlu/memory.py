"""MLUPluggableAllocator on the CPU: loads the .so and its symbols exactly like the real one."""

from __future__ import annotations

import ctypes

__all__ = ["MLUPluggableAllocator", "change_current_allocator", "empty_cache"]

current_allocator = None  # what change_current_allocator installed, for tests
empty_cache_calls = 0  # graph capture entry calls empty_cache, as torch_mlu's does


def empty_cache() -> None:
    """Nothing is cached on the CPU; counts the calls so tests see the release path run."""
    global empty_cache_calls
    empty_cache_calls += 1


class _MLUAllocator:
    def __init__(self, allocator):
        self._allocator = allocator

    def allocator(self):
        return self._allocator


def _address(lib, symbol: str) -> int:
    # a missing symbol raises AttributeError naming it, as with the real package
    return ctypes.c_void_p.from_buffer(getattr(lib, symbol)).value or 0


class MLUPluggableAllocator(_MLUAllocator):
    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str):
        lib = ctypes.CDLL(path_to_so_file)
        self.path = path_to_so_file
        self.alloc_fn = _address(lib, alloc_fn_name)
        self.free_fn = _address(lib, free_fn_name)
        if not (self.alloc_fn and self.free_fn):
            raise RuntimeError(f"{path_to_so_file}: null allocator symbol")
        super().__init__(("standin_custom_allocator", self.alloc_fn, self.free_fn))


def change_current_allocator(allocator: _MLUAllocator) -> None:
    global current_allocator
    if current_allocator is not None:
        raise RuntimeError("Can't swap an already initialized allocator")
    current_allocator = allocator.allocator()
