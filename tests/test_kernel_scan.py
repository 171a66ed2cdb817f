"""The CUDA backend's one pass over a captured graph's kernel nodes
(``backends/cuda/kernel_scan.c``) and the probe's reading of the generator state's
addresses (``backends/cuda/generator_state.py``), over parameter bytes laid out in host
memory as the driver hands them back: the driver's entry points are callbacks here (the
GPU tests, ``tests/test_cuda_executables.py``, run the pass on captured graphs)."""

from __future__ import annotations

import ctypes
import types

import pytest

from vmm_backends.cuda import kernel_scan
from vmm_backends.cuda.generator_state import GeneratorState, KernelNodeParams

SEED, OFFSET = 0x7F444DA00000, 0x7F444DA00200
PAIR = SEED.to_bytes(8, "little") + OFFSET.to_bytes(8, "little")
FUNC, KERN = 0x1234, 0x5678
INVALID_VALUE = 1

GET_PARAMS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(KernelNodeParams))
PARAM_INFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))


class Driver:
    """Kernel nodes and parameter layouts in host memory, behind the driver's
    signatures.  ``nodes``: node id -> ``KernelNodeParams`` or the code
    ``cuGraphKernelNodeGetParams_v2`` returns; ``layouts``: function or kernel handle ->
    ``[(offset, size), ...]`` or the code ``cu*GetParamInfo`` returns."""

    def __init__(self) -> None:
        self.nodes: dict[int, object] = {}
        self.layouts: dict[int, object] = {}
        self.info_calls = 0
        self.keep: list = []

    def get_params(self, node, out):
        entry = self.nodes[node]
        if isinstance(entry, int):
            return entry
        ctypes.memmove(out, ctypes.byref(entry), ctypes.sizeof(KernelNodeParams))
        return 0

    def info(self, handle, index, offset, size):
        self.info_calls += 1
        layout = self.layouts[handle]
        if isinstance(layout, int):
            return layout
        if index >= len(layout):
            return INVALID_VALUE
        offset[0], size[0] = layout[index]
        return 0

    def kernel(self, node: int, blobs, func: int = FUNC, kern: int = 0) -> None:
        """A kernel node whose kernelParams point at ``blobs`` (its layout: their sizes)."""
        buffers = [ctypes.create_string_buffer(b, len(b)) for b in blobs]
        pointers = (ctypes.c_void_p * len(buffers))(*[ctypes.addressof(b) for b in buffers])
        self.keep += [buffers, pointers]
        params = KernelNodeParams()
        params.func, params.kern = func, kern
        params.kernel_params = ctypes.addressof(pointers)
        self.nodes[node] = params
        offsets, at = [], 0
        for b in blobs:
            offsets.append((at, len(b)))
            at += len(b)
        known = self.layouts.setdefault(func or kern, offsets)
        # one layout a function: blobs of other sizes would be read past their ends
        assert isinstance(known, int) or known == offsets, (node, known, offsets)

    def scan(self, count: int | None = None, pair=PAIR, kernel_info=True):
        get, info = GET_PARAMS(self.get_params), PARAM_INFO(self.info)
        scanner = kernel_scan.KernelScan(get, info, info if kernel_info else None)
        ids = sorted(self.nodes)
        nodes = (ctypes.c_void_p * len(ids))(*ids)
        verdicts, funcs, kerns, codes = scanner.scan(nodes, len(ids) if count is None else count,
                                                     pair)
        return ([verdicts[i] for i in range(len(ids))], [funcs[i] for i in range(len(ids))],
                [kerns[i] for i in range(len(ids))], [codes[i] for i in range(len(ids))])


def _philox(flag_at=24, size=32, pair=PAIR) -> bytes:
    blob = bytearray(size)
    blob[0:16] = pair
    blob[flag_at] = 1
    return bytes(blob)


@pytest.mark.parametrize("size, flag_at", [(32, 24), (24, 20)])
def test_a_captured_philox_state_by_value_is_handed(size, flag_at):
    d = Driver()
    d.kernel(1, [bytes(8), _philox(flag_at, size)])
    verdicts, funcs, kerns, codes = d.scan()
    assert (verdicts, funcs, kerns, codes) == ([kernel_scan.HANDED], [FUNC], [None], [0])


def test_a_state_inside_a_larger_struct_is_handed():
    d = Driver()
    d.kernel(1, [bytes(48) + _philox() + bytes(40)])  # attention's params: the state at 48
    assert d.scan()[0] == [kernel_scan.HANDED]


def test_one_address_left_in_unused_slots_is_not_the_state():
    """An offset calculator's unused slots hold host-stack leftovers: the seed's address
    alone there (as a float copy kernel's held it on an H200) is not a handed state, nor
    is the pair without its captured flag, off an 8-byte boundary, or another pair."""
    lone = bytes(64) + SEED.to_bytes(8, "little") + bytes(464)
    no_flag = bytes(8) + PAIR + bytes(16)
    unaligned = bytes(3) + _philox() + bytes(5)
    other = _philox(pair=PAIR[8:] + PAIR[:8])
    for node, blob in enumerate((lone, no_flag, unaligned, other), 1):
        d = Driver()
        d.kernel(node, [blob])
        assert d.scan()[0] == [kernel_scan.PLAIN], blob.hex()


def test_the_flag_past_the_parameter_is_not_read():
    """The pair ends the parameter: the flag's byte would lie past it (in the next
    parameter's bytes, here a 1): not a state."""
    d = Driver()
    d.kernel(1, [bytes(8) + PAIR, b"\x01" * 32])
    assert d.scan()[0] == [kernel_scan.PLAIN]


def test_parameters_in_an_extra_buffer_are_read():
    """A launch may pass its parameters as one buffer in ``extra`` (key 1: the buffer,
    key 2: a pointer to its size, 0: the end), read at the driver's offsets; an offset
    past the buffer's size leaves them unread, which the pool counts as drawing."""
    for layout, verdict in (([(0, 8), (16, 32)], kernel_scan.HANDED),
                            ([(0, 8), (40, 32)], kernel_scan.NO_BYTES)):
        d = Driver()
        buffer = ctypes.create_string_buffer(bytes(16) + _philox(), 48)
        length = ctypes.c_size_t(48)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2,
                                      ctypes.addressof(length), 0)
        d.keep += [buffer, length, extra]
        params = KernelNodeParams()
        params.func, params.extra = FUNC, ctypes.addressof(extra)
        d.nodes[1], d.layouts[FUNC] = params, layout
        assert d.scan()[0] == [verdict]


def _extra_node(d: Driver, buffer_address: int, declared: int, layout) -> None:
    """Node 1 passes its parameters in one ``extra`` buffer at ``buffer_address`` of
    ``declared`` bytes, laid out as ``layout``."""
    length = ctypes.c_size_t(declared)
    extra = (ctypes.c_void_p * 5)(1, buffer_address, 2, ctypes.addressof(length), 0)
    d.keep += [length, extra]
    params = KernelNodeParams()
    params.func, params.extra = FUNC, ctypes.addressof(extra)
    d.nodes[1], d.layouts[FUNC] = params, layout


def test_sizes_that_wrap_around_are_not_read_past_the_extra_buffer():
    """A driver's offset or size near 2**64 makes offset + size wrap below the buffer's
    length: the pass must still see the parameter does not fit (a state lies just
    before and just past the buffer here), not read outside it."""
    wrap = 1 << 64
    before = ctypes.create_string_buffer(_philox() + bytes(32), 64)  # a state at +0
    d = Driver()
    d.keep.append(before)
    _extra_node(d, ctypes.addressof(before) + 8, 48, [(wrap - 8, 32)])
    assert d.scan()[0] == [kernel_scan.NO_BYTES]
    past = ctypes.create_string_buffer(bytes(40) + _philox() + bytes(8), 80)
    d = Driver()
    d.keep.append(past)
    _extra_node(d, ctypes.addressof(past), 16, [(8, wrap - 8)])
    assert d.scan()[0] == [kernel_scan.NO_BYTES]


def test_a_count_past_the_node_array_is_refused():
    d = Driver()
    d.kernel(1, [_philox()])
    scanner = kernel_scan.KernelScan(GET_PARAMS(d.get_params), PARAM_INFO(d.info), None)
    with pytest.raises(ValueError, match="would read past it"):
        scanner.scan((ctypes.c_void_p * 1)(1), 4, PAIR)
    assert scanner.scan(None, 0, PAIR)[0]._length_ == 0


def test_what_cannot_be_read_is_said_and_nothing_wide_is_plain():
    """No parameter of 24 bytes or more: nothing can hold the state, so nothing is read,
    even without kernelParams.  Sizes the driver refuses, or a CUkernel where there is no
    cuKernelGetParamInfo: unread.  A node the driver gives no kernel parameters of: its
    code is kept and it is left to the caller (a child graph, a memcpy, ...)."""
    d = Driver()
    narrow = KernelNodeParams()
    narrow.func = 0x10
    d.nodes[1], d.layouts[0x10] = narrow, [(0, 8), (8, 16)]
    refused = KernelNodeParams()
    refused.func = 0x20
    d.nodes[2], d.layouts[0x20] = refused, 500
    d.nodes[3] = 400  # CUDA_ERROR_INVALID_HANDLE: not a kernel node
    d.kernel(4, [_philox()], func=0, kern=KERN)
    verdicts, funcs, kerns, codes = d.scan()
    assert verdicts == [kernel_scan.PLAIN, kernel_scan.NO_SIZES, kernel_scan.NOT_READ,
                        kernel_scan.HANDED]
    assert funcs == [0x10, 0x20, None, None] and kerns == [None, None, None, KERN]
    assert codes == [0, 0, 400, 0]
    assert d.scan(kernel_info=False)[0][3] == kernel_scan.NO_SIZES


def test_without_a_pair_no_parameter_is_read():
    """Where the generator's state is not known, the pass only names the functions (the
    names alone are then read): no ParamInfo call, every kernel plain."""
    d = Driver()
    d.kernel(1, [_philox()])
    d.kernel(2, [bytes(64)], func=0x99)
    verdicts, funcs, _, _ = d.scan(pair=None)
    assert verdicts == [kernel_scan.PLAIN] * 2 and funcs == [FUNC, 0x99]
    assert d.info_calls == 0


def test_a_driver_that_never_ends_its_parameters_is_bounded():
    d = Driver()
    params = KernelNodeParams()
    params.func = FUNC
    d.nodes[1] = params
    d.info = lambda handle, index, offset, size: 0  # every index "exists", 0 bytes wide
    assert d.scan()[0] == [kernel_scan.NO_SIZES]


def test_bad_arguments_are_refused():
    d = Driver()
    d.kernel(1, [_philox()])
    with pytest.raises(ValueError, match="16 bytes"):
        d.scan(pair=PAIR[:8])
    scanner = kernel_scan.KernelScan(None, None, None)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        scanner.scan((ctypes.c_void_p * 1)(1), 1, PAIR)


def test_a_missing_library_names_the_remedy(monkeypatch):
    monkeypatch.setattr(kernel_scan, "_library", None)
    monkeypatch.setattr(kernel_scan.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="not built; install vmm_core with pip"):
        kernel_scan.load_library()


def test_the_probe_reads_a_node_given_as_a_cukernel_and_not_an_extra_buffer():
    """A node may name its kernel by CUkernel alone: its sizes come from
    cuKernelGetParamInfo.  Parameters passed in ``extra`` are not read by the probe (no
    pair: the pool then watches operators, which is right, only slower)."""
    d = Driver()
    d.kernel(1, [bytes(8), _philox()], func=0, kern=KERN)
    blob = ctypes.create_string_buffer(bytes(8) + _philox(), 40)
    d.keep.append(blob)
    _extra_node(d, ctypes.addressof(blob), 40, [(0, 8), (8, 32)])
    d.kernel(2, [bytes(8), _philox()], func=0, kern=KERN)
    state = GeneratorState(types.SimpleNamespace(), 0, kernel_params=None)
    state.func_info = state.kernel_info = PARAM_INFO(d.info)
    assert state.pair_in(d.nodes[2]) == PAIR
    assert state.pair_in(d.nodes[1]) is None
    state.kernel_info = None  # a driver without cuKernelGetParamInfo
    assert state.pair_in(d.nodes[2]) is None


def test_the_probe_reads_the_pair_from_a_state_by_value():
    """The probe's ``uniform_`` passes the state by value: its two addresses are read
    from the parameter of the state's size whose captured flag is set."""
    d = Driver()
    d.kernel(1, [bytes(8), _philox()])
    # a state of the other size, not captured; a function of its own, so a layout of its own
    d.kernel(2, [bytes(8), _philox(flag_at=20, size=24)[:20] + b"\x00" * 4], func=FUNC + 1)
    state = GeneratorState(types.SimpleNamespace(), 0, kernel_params=None)
    info = PARAM_INFO(d.info)
    state.func_info = info
    assert state.pair_in(d.nodes[1]) == PAIR
    assert state.pair_in(d.nodes[2]) is None
