"""The CUDA backend's reading of kernel parameters for torch's captured generator state
(``backends/cuda/generator_state.py``), over parameter bytes laid out in host memory as
the driver hands them back: no driver is needed to read them, only to fill them (the
GPU tests, ``tests/test_cuda_executables.py``, run it on captured graphs)."""

from __future__ import annotations

import ctypes
import types

import pytest

from vmm_backends.cuda.generator_state import GeneratorState, KernelNodeParams

SEED, OFFSET = 0x7F444DA00000, 0x7F444DA00200
FUNC = 0x1234


def _reading(sizes):
    """A reading that knows the two addresses and the parameter layout of FUNC."""
    state = GeneratorState(types.SimpleNamespace(), 0, kernel_params=None)
    seed, offset = SEED.to_bytes(8, "little"), OFFSET.to_bytes(8, "little")
    state._needles, state._pair = (seed, offset), seed + offset
    state._sizes[FUNC] = sizes
    return state


def _philox(flag_at=24, size=32) -> bytes:
    blob = bytearray(size)
    blob[0:8], blob[8:16] = SEED.to_bytes(8, "little"), OFFSET.to_bytes(8, "little")
    blob[flag_at] = 1
    return bytes(blob)


def _node(blobs, keep):
    """Kernel node parameters whose kernelParams point at ``blobs``."""
    buffers = [ctypes.create_string_buffer(b, len(b)) for b in blobs]
    pointers = (ctypes.c_void_p * len(buffers))(*[ctypes.addressof(b) for b in buffers])
    keep += [buffers, pointers]
    params = KernelNodeParams()
    params.func = FUNC
    params.kernel_params = ctypes.addressof(pointers)
    return params


@pytest.mark.parametrize("size, flag_at", [(32, 24), (24, 20)])
def test_a_captured_philox_state_by_value_is_handed(size, flag_at):
    keep: list = []
    state = _reading(((0, 0, 8), (1, 8, size)))
    assert state.handed(_node([bytes(8), _philox(flag_at, size)], keep))


def test_a_state_inside_a_larger_struct_is_handed():
    keep: list = []
    struct = bytes(48) + _philox() + bytes(40)  # attention's params: the state at byte 48
    state = _reading(((0, 0, len(struct)),))
    assert state.handed(_node([struct], keep))


def test_one_address_left_in_unused_slots_is_not_the_state():
    """An offset calculator's unused slots hold host-stack leftovers: the seed's address
    alone there (as a float copy kernel's held it on an H200) is not a handed state, nor
    is the pair without its captured flag or off an 8-byte boundary."""
    keep: list = []
    lone = bytes(64) + SEED.to_bytes(8, "little") + bytes(464)
    no_flag = bytes(8) + _philox()[:16] + bytes(16)
    unaligned = bytes(3) + _philox() + bytes(5)
    for blob in (lone, no_flag, unaligned):
        state = _reading(((0, 0, len(blob)),))
        assert not state.handed(_node([blob], keep)), blob.hex()


def test_parameters_in_an_extra_buffer_are_read():
    """A launch may pass its parameters as one buffer in ``extra`` (key 1: the buffer,
    key 2: a pointer to its size, 0: the end), read at the driver's offsets."""
    buffer = ctypes.create_string_buffer(bytes(16) + _philox(), 48)
    length = ctypes.c_size_t(48)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2, ctypes.addressof(length), 0)
    params = KernelNodeParams()
    params.func, params.extra = FUNC, ctypes.addressof(extra)
    assert _reading(((1, 16, 32),)).handed(params)
    # an offset past the buffer's size: unread, which the pool counts as drawing
    with pytest.raises(RuntimeError, match="neither kernelParams nor an extra buffer"):
        _reading(((1, 40, 32),)).handed(params)


def test_a_kernel_with_nothing_wide_enough_has_nothing_to_read():
    """No parameter of 24 bytes or more (none at all, say): nothing can hold the state,
    so nothing is read, even without kernelParams (before, such a kernel raised and its
    graph counted as drawing)."""
    params = KernelNodeParams()
    params.func = FUNC
    assert not _reading(()).handed(params)
    with pytest.raises(RuntimeError, match="does not give its parameters' sizes"):
        _reading(None).handed(params)
