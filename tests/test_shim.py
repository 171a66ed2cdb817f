"""The C shim (csrc/vmm_shim.c) through ctypes, with the host backend behind it: no torch.

The shim is process-global, so every test that replaces its callback puts the previous one
back (see the ``shim`` fixture).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading

import pytest

import vmm_core
from vmm_core.errors import BackendUnavailableError
from vmm_core.memory import routing
from vmm_core.memory.shim import (
    ABI_VERSION,
    ALLOC_CALLBACK,
    ALLOC_SYMBOL,
    FREE_SYMBOL,
    Shim,
    load_shim,
)


@pytest.fixture
def shim():
    s = load_shim()
    saved = s._callback
    yield s
    # put back exactly what was installed before (the routing callback, or nothing)
    s._callback = saved
    s.lib.vmm_shim_set_alloc_callback(saved if saved is not None else ALLOC_CALLBACK())


@pytest.fixture
def alloc():
    a = vmm_core.SharedVMMAllocator("host", reserve_bytes=1 << 24)
    yield a
    a.close()


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def test_load_shim_is_one_library_with_the_published_symbols(shim):
    assert load_shim() is shim
    assert shim.path.endswith(".so") and "_vmm_shim" in shim.path
    assert shim.lib.vmm_shim_abi_version() == ABI_VERSION
    for symbol in (ALLOC_SYMBOL, FREE_SYMBOL):  # the names the frameworks load by path
        assert ctypes.cast(getattr(shim.lib, symbol), ctypes.c_void_p).value
    assert set(shim.counters()) == {"allocs", "alloc_bytes", "frees", "free_bytes",
                                    "alloc_failures"}


def _build(tmp_path, source: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    src = tmp_path / "fake_shim.c"
    src.write_text(source)
    out = tmp_path / "libfake_shim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return str(out)


def test_abi_mismatch_is_a_clear_error(tmp_path):
    # a shim from another vmm_core release: its other symbols may differ or be missing,
    # so only the version may be relied on
    path = _build(tmp_path, "int vmm_shim_abi_version(void) { return 999; }\n")
    with pytest.raises(BackendUnavailableError) as info:
        Shim(path)
    message = str(info.value)
    assert "ABI 999" in message and f"expects {ABI_VERSION}" in message
    assert "reinstall" in message


def test_a_library_that_is_not_the_shim_is_a_clear_error(tmp_path):
    path = _build(tmp_path, "int unrelated(void) { return 0; }\n")
    with pytest.raises(BackendUnavailableError, match="vmm_shim_abi_version"):
        Shim(path)


def test_alloc_routes_to_the_target_allocator(shim, alloc):
    shim.ensure_routing()
    assert shim.installed
    before = shim.counters()
    with routing.target(0, alloc):
        p = shim.lib.vmm_shim_alloc(10000, 0, None)
        q = shim.lib.vmm_shim_alloc(4096, 0, None)
    assert p and q and p != q
    base = alloc.space_base()
    assert base <= p < base + alloc.reserve_bytes
    assert base <= q < base + alloc.reserve_bytes
    live = alloc.live_allocations()
    assert live[p] >= 10000 and live[q] == 4096
    # the memory is mapped and writable through the returned address
    ctypes.memset(p, 0xAB, 10000)
    assert ctypes.string_at(p + 9999, 1) == b"\xab"
    assert _delta(before, shim.counters()) == {"allocs": 2, "alloc_bytes": 14096}

    # a new virtual space: the next shim allocation lands in it and aliases p
    alloc.switch_to_new_virtual_space()
    with routing.target(0, alloc):
        r = shim.lib.vmm_shim_alloc(10000, 0, None)
    assert alloc.space_base() <= r < alloc.space_base() + alloc.reserve_bytes
    assert r in alloc.live_allocations() and r not in alloc.live_allocations(0)
    assert ctypes.string_at(r, 1) == b"\xab"


def test_routing_is_per_device_and_per_thread(shim, alloc):
    shim.ensure_routing()
    results = {}
    with routing.target(0, alloc):
        assert not shim.lib.vmm_shim_alloc(4096, 1, None), "no target for device 1"
        t = threading.Thread(target=lambda: results.setdefault(
            "other", shim.lib.vmm_shim_alloc(4096, 0, None)))
        t.start()
        t.join(10)
    assert results == {"other": None}, "another thread has no target"
    assert alloc.live_allocations() == {}


def test_alloc_outside_a_target_returns_null_and_explains(shim, alloc):
    shim.ensure_routing()
    assert routing.current_target(0) is None
    before = shim.counters()
    assert shim.lib.vmm_shim_alloc(4096, 0, None) is None  # NULL
    assert _delta(before, shim.counters()) == {"alloc_failures": 1}
    err = routing.last_error()
    assert isinstance(err, RuntimeError)
    assert "outside a vmm_core capture or region" in str(err) and "4096 bytes" in str(err)
    assert alloc.live_allocations() == {}


def test_allocator_error_becomes_null_not_a_crash(shim, alloc):
    shim.ensure_routing()
    before = shim.counters()
    with routing.target(0, alloc):
        assert shim.lib.vmm_shim_alloc(alloc.reserve_bytes + 4096, 0, None) is None
    assert _delta(before, shim.counters()) == {"alloc_failures": 1}
    assert isinstance(routing.last_error(), vmm_core.AllocationError)


def test_an_exception_escaping_the_callback_is_out_of_memory_not_an_address(shim,
                                                                            monkeypatch):
    """ctypes leaves a callback's return value undefined when an exception escapes it (a
    signal's handler raising after the routing's last ``except``): a stale address came
    back and would have been taken as memory.  The address travels through an
    out-parameter that the shim sets to NULL first."""
    escaped = []
    monkeypatch.setattr("sys.unraisablehook", escaped.append)

    class Escaping(BaseException):
        """Not an interrupt, which the callback holds and hands back to C."""

    def raising(size, device, stream):
        address = 0x7000_0000_0000  # a live local, as the allocation had in hand
        raise Escaping(address)

    shim.install(raising)
    before, held = shim.counters(), shim.segments()
    for _ in range(3):
        assert shim.lib.vmm_shim_alloc(4096, 0, None) is None
    assert len(escaped) == 3 and escaped[0].exc_type is Escaping
    assert _delta(before, shim.counters()) == {"alloc_failures": 3}
    assert shim.segments() == held, "nothing was recorded as held by the framework"


def test_free_only_counts_and_never_enters_python(shim, alloc):
    gate = threading.Lock()
    entered = []

    def python_callback(size, device, stream):  # what free must never reach
        entered.append(size)
        with gate:
            return 0

    with routing.target(0, alloc):
        shim.ensure_routing()
        p = shim.lib.vmm_shim_alloc(8192, 0, None)
    assert p
    shim.install(python_callback)
    before = shim.counters()
    done = threading.Event()

    def free_many():
        for _ in range(5):
            shim.lib.vmm_shim_free(p, 8192, 0, None)
        done.set()

    with gate:  # anything in Python that needed the gate would block here
        t = threading.Thread(target=free_many, daemon=True)
        t.start()
        assert done.wait(10), "vmm_shim_free blocked: it entered Python"
    t.join(10)
    assert entered == []
    assert _delta(before, shim.counters()) == {"frees": 5, "free_bytes": 5 * 8192}
    # free does not give memory back: the allocator reclaims per virtual space
    assert alloc.live_allocations()[p] == 8192

    # and it still counts after the callback is gone (interpreter shutdown)
    shim.disable()
    shim.lib.vmm_shim_free(p, 8192, 0, None)
    assert shim.counters()["frees"] == before["frees"] + 6


def test_disable_makes_alloc_null_without_calling_python(shim, alloc):
    calls = []

    def spy(size, device, stream):
        calls.append(size)
        return routing.alloc_callback(size, device, stream)

    shim.install(spy)
    with routing.target(0, alloc):
        assert shim.lib.vmm_shim_alloc(4096, 0, None)
        assert calls == [4096]
        shim.disable()
        before = shim.counters()
        assert shim.lib.vmm_shim_alloc(4096, 0, None) is None
    assert calls == [4096], "the disabled shim must not call the Python callback"
    assert _delta(before, shim.counters()) == {"alloc_failures": 1}
    assert len(alloc.live_allocations()) == 1

    shim.install(routing.alloc_callback)  # re-enabled: routes again
    with routing.target(0, alloc):
        assert shim.lib.vmm_shim_alloc(4096, 0, None)
    assert len(alloc.live_allocations()) == 2


#: the shim routing framework allocations to ``alloc``, a host allocator, inside
#: ``routing.target(0, alloc)``
ROUTED_SHIM = """
    import vmm_core
    from vmm_core.memory import routing
    from vmm_core.memory.shim import load_shim

    shim = load_shim()
    shim.ensure_routing()
    alloc = vmm_core.SharedVMMAllocator("host", reserve_bytes=1 << 24)
"""


def test_ctrl_c_as_the_framework_allocates_in_a_region_comes_back_after_the_call():
    """A Ctrl-C inside the routing callback became out of memory inside the framework's
    allocator.  Now the allocation completes, the framework gets its address, and the
    interrupt is raised once the shim's alloc has returned."""
    from proc_state import run_python

    out = run_python(ROUTED_SHIM + """
    import os, signal
    real = type(alloc).allocate
    def interrupted(self, nbytes):
        os.kill(os.getpid(), signal.SIGINT)  # arrives as the memory is made
        return real(self, nbytes)
    type(alloc).allocate = interrupted
    before = shim.counters()
    try:
        with routing.target(0, alloc):
            shim.lib.vmm_shim_alloc(4096, 0, None)
        print("not raised")
    except KeyboardInterrupt:
        print("raised after the call")
    after = shim.counters()
    print("allocs", after["allocs"] - before["allocs"], "failures",
          after["alloc_failures"] - before["alloc_failures"], "live",
          len(alloc.live_allocations()))
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised after the call", "allocs 1 failures 0 live 1"], \
        (out.stdout, out.stderr[-3000:])


#: ``CtrlCNow`` as an argtype of a C entry point: a Ctrl-C comes as ctypes converts the
#: argument (C code, no bytecode after it): pending as the entry point begins, as when
#: SIGINT arrives while the framework's C++ runs before it calls the allocator;
#: ``SignalNow`` likewise for the signal its argument names (the argument passed is 0)
CTRL_C_IN_C = """
    import ctypes
    class CtrlCNow:
        from_param = ctypes.pythonapi.PyErr_SetInterrupt
    class SignalNow:
        from_param = ctypes.pythonapi.PyErr_SetInterruptEx
    def entry_point(lib, name, argtypes):
        function = type(getattr(lib, name))((name, lib))
        function.argtypes = argtypes
        function.restype = ctypes.c_void_p
        return function
"""

def test_ctrl_c_pending_as_the_framework_calls_the_allocator_hands_out_the_memory():
    """A SIGINT that arrived while the framework's own code ran was raised at the
    callback's first bytecode, before any ``try``: ctypes printed and dropped it, and the
    framework got out of memory.  Now the entry point takes it from Python's pending
    signals first: the memory is made and the interrupt raised after the call."""
    from proc_state import run_python

    out = run_python(CTRL_C_IN_C + ROUTED_SHIM + """
    import sys
    escaped = []
    sys.unraisablehook = escaped.append
    alloc_now = entry_point(shim.lib, "vmm_shim_alloc", [ctypes.c_size_t, ctypes.c_int,
                                                         CtrlCNow])
    before = shim.counters()
    outcomes = []
    for _ in range(3):
        try:
            with routing.target(0, alloc):
                alloc_now(4096, 0, None)
            sum(range(10))
            outcomes.append("not raised")
        except KeyboardInterrupt:
            outcomes.append("raised")
    after = shim.counters()
    print(outcomes, "allocs", after["allocs"] - before["allocs"], "failures",
          after["alloc_failures"] - before["alloc_failures"], "live",
          len(alloc.live_allocations()), "dropped", len(escaped))
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "['raised', 'raised', 'raised'] allocs 3 failures 0 live 3 dropped 0"], \
        (out.stdout, out.stderr[-3000:])


def test_ctrl_c_and_another_signal_pending_at_the_allocator_keep_the_ctrl_c():
    """SIGINT and SIGTERM pending as the framework calls the allocator: the entry point's
    look ran SIGINT's handler and stopped, and SIGTERM's handler raised at the callback's
    first bytecode, where ctypes dropped it; the Ctrl-C, already taken, was lost with it.
    Now every pending handler runs there: the SystemExit is printed (dropped, as ctypes
    would), the memory made, and the Ctrl-C raised after the call."""
    from proc_state import run_python

    out = run_python(CTRL_C_IN_C + ROUTED_SHIM + """
    import signal, sys
    def on_term(signum, frame):
        raise SystemExit("terminated")
    signal.signal(signal.SIGTERM, on_term)
    escaped = []
    sys.unraisablehook = lambda unraisable: escaped.append(type(unraisable.exc_value).__name__)
    both = entry_point(shim.lib, "vmm_shim_alloc", [ctypes.c_size_t, SignalNow, SignalNow])
    try:
        with routing.target(0, alloc):
            both(4096, signal.SIGINT, signal.SIGTERM)  # device and stream: 0
        sum(range(10))
        print("not raised")
    except KeyboardInterrupt:
        print("raised")
    print("dropped", escaped, "live", len(alloc.live_allocations()))
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised", "dropped ['SystemExit'] live 1"], \
        (out.stdout, out.stderr[-3000:])


def test_a_programs_handler_raising_as_the_framework_calls_the_allocator_is_out_of_memory():
    """Under a program's own SIGINT handler nothing changes: what its handler raises when
    a Ctrl-C was pending as the framework called the allocator is printed and dropped
    (ctypes' way, as before) and the allocation is out of memory; the handler runs once."""
    from proc_state import run_python

    out = run_python(CTRL_C_IN_C + ROUTED_SHIM + """
    import signal, sys
    class Stop(Exception):
        pass
    calls = []
    def mine(signum, frame):
        calls.append(signum)
        raise calls[-1] and (Stop() if len(calls) == 1 else KeyboardInterrupt())
    signal.signal(signal.SIGINT, mine)
    escaped = []
    sys.unraisablehook = lambda unraisable: escaped.append(type(unraisable.exc_value).__name__)
    alloc_now = entry_point(shim.lib, "vmm_shim_alloc", [ctypes.c_size_t, ctypes.c_int,
                                                         CtrlCNow])
    got = []
    for _ in range(2):
        with routing.target(0, alloc):
            got.append(alloc_now(4096, 0, None))
        sum(range(10))
    print("got", got, "handler calls", len(calls), "dropped", escaped, "live",
          len(alloc.live_allocations()))
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "got [None, None] handler calls 2 dropped ['Stop', 'KeyboardInterrupt'] live 0"], \
        (out.stdout, out.stderr[-3000:])


def test_ctrl_c_anywhere_in_the_allocation_callback_hands_out_one_allocation_and_comes_back():
    """A Ctrl-C raised in the callback before its hold armed made that allocation out of
    memory (an engine may catch it and go on).  Now, at every line of the callback and
    of its hold's setup, the framework gets one allocation and the interrupt is raised
    after its call.  A signal pending as the callback begins is the test above."""
    from proc_state import env_with_tests, run_python
    from test_interrupts_host import AT_A_LINE, HELD

    out = run_python(HELD + AT_A_LINE + ROUTED_SHIM + """
    import linecache
    import vmm_core.memory.shim as shim_module
    callback = next(c for c in shim_module.c_alloc_callback.__code__.co_consts
                    if getattr(c, "co_name", "") == "write_address")
    sent = []
    send = ctrl_c
    def ctrl_c():
        sent.append(1)
        send()
    codes = [callback, interrupts.held.__code__, interrupts.Held.__init__.__code__,
             interrupts.Held.__enter__.__code__, interrupts.Held.arm.__code__,
             interrupts.pythons_own_ctrl_c.__code__]
    cases = []
    for code in codes:
        for line in lines_of(code):
            if linecache.getline(code.co_filename, line).strip() == "try:":
                continue  # a no-op only a tracer stops at: no signal is raised there
            before, live, got = shim.counters(), len(alloc.live_allocations()), None
            sent.clear()
            sys.settrace(ctrl_c_at(code, line))
            try:
                with routing.target(0, alloc):
                    got = shim.lib.vmm_shim_alloc(4096, 0, None)
                sum(range(10))  # where a signal handed on would be raised
                outcome = "not raised"
            except KeyboardInterrupt:
                outcome = "raised"
            sys.settrace(None)
            if not sent:
                continue  # a line this path does not run
            made = len(alloc.live_allocations()) - live
            failures = shim.counters()["alloc_failures"] - before["alloc_failures"]
            if (outcome, made, failures) != ("raised", 1, 0):
                print("bad", code.co_name, line, outcome, made, failures, got)
            cases.append(code.co_name)
    print("callback lines", cases.count("write_address") >= 4, "cases", len(cases) >= 15)
    """, timeout=120, env=env_with_tests())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["callback lines True cases True"], \
        (out.stdout, out.stderr[-3000:])


def test_a_programs_own_sigint_handler_sees_each_ctrl_c_once_in_an_allocation():
    """The allocation callback hands on only Python's own handler's interrupts: one a
    program's handler raised inside the callback, handed on, called that handler again
    for the same Ctrl-C."""
    from proc_state import run_python

    out = run_python("""
    import os, signal
    import vmm_core
    from vmm_core.memory.shim import load_shim

    calls = []
    def handler(signum, frame):
        calls.append(signum)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, handler)
    shim = load_shim()
    alloc = vmm_core.SharedVMMAllocator("host", reserve_bytes=1 << 24)
    def interrupted(size, device, stream):
        os.kill(os.getpid(), signal.SIGINT)  # the program's handler raises here
        return alloc.allocate(size)
    shim.install(interrupted)
    for _ in range(3):
        try:
            shim.lib.vmm_shim_alloc(4096, 0, None)
            sum(range(10))  # where a signal handed on would be raised
        except KeyboardInterrupt:
            calls.append("raised after the call")
    print("calls", calls)
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["calls [2, 2, 2]"], (out.stdout, out.stderr[-3000:])
