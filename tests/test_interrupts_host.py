"""Ctrl-C across the steps that must not stop halfway (vmm_core.interrupts), with real
SIGINTs, each in a fresh interpreter (Python delivers SIGINT to the main thread, under
its own handler).  The host backend's unmap or a sleep listener sends the signal, so it
lands exactly inside the step."""

from __future__ import annotations

import pytest
from proc_state import THREAD_STARTS_REFUSED, env_with_tests, run_python

HELD = """
    import os, signal, threading
    from vmm_core import interrupts
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    def ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)
"""


#: ``sys.settrace(ctrl_c_at(code, line))``: one Ctrl-C as ``code`` reaches ``line``
#: (every line of a function: ``lines_of(code)``)
AT_A_LINE = """
    import dis, sys
    def lines_of(code):
        return sorted({line for _, line in dis.findlinestarts(code) if line})
    def ctrl_c_at(code, line):
        def tracer(frame, event, arg):
            if frame.f_code is not code:
                return None
            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == line:
                    sys.settrace(None)
                    frame.f_trace = None
                    ctrl_c()
                return local
            return local
        return tracer
"""


#: ``sys.setprofile(ctrl_c_as_it_returns(code))``: one Ctrl-C as a call of ``code`` returns
#: (a Python function; a C function called from ``code`` with ``c_call=True``), the
#: moment Python raises an interrupt that came during the call
AT_A_RETURN = """
    def ctrl_c_as_it_returns(code, c_call=False, when=lambda: True):
        event = "c_return" if c_call else "return"
        def profile(frame, what, arg):
            if what == event and frame.f_code is code and when():
                sys.setprofile(None)
                ctrl_c()
        return profile
"""

#: ``armed[prefix] = True``: one Ctrl-C as the next thread of that name prefix starts,
#: inside Thread.start once the thread runs (the moment an executor's books miss it)
THREAD_STARTS = HELD + """
    armed = {}
    def ctrl_c_as_it_starts(real):
        def start(function, *args, **kwargs):
            started = real(function, *args, **kwargs)
            thread = getattr(function, "__self__", None)
            if isinstance(thread, threading.Thread):
                for prefix in [p for p in armed if thread.name.startswith(p)]:
                    del armed[prefix]
                    ctrl_c()
            return started
        return start
    for name in ("_start_new_thread", "_start_joinable_thread"):
        if hasattr(threading, name):
            setattr(threading, name, ctrl_c_as_it_starts(getattr(threading, name)))
"""


#: after a step: whether Python's SIGINT handler is back, and a Ctrl-C raised
CTRL_C_AFTER = """
    print("handler back", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    try:
        ctrl_c()
        sum(range(10))
        print("not raised")
    except KeyboardInterrupt:
        print("raised")
"""


#: ``sys.setprofile(as_a_step(arms, then))``: ``then()`` just as a step's hold has put its
#: SIGINT handler in (``arms``) or is about to put Python's back (``signal.signal`` is
#: Python's wrapper of ``_signal.signal``, which runs pending handlers before it installs)
AS_A_STEP = HELD + """
    import sys
    def as_a_step(arms, then):
        caller = (interrupts.Held.arm if arms else interrupts.Held._disarm).__code__
        def profile(frame, what, arg):
            if arms and not (what == "c_return" and getattr(arg, "__name__", "") == "signal"):
                return
            if not arms and not (what == "call" and frame.f_code.co_name == "signal"):
                return
            if frame.f_back is not None and frame.f_back.f_code is caller:
                sys.setprofile(None)
                then()
        return profile
"""


@pytest.mark.parametrize("when", ["arms", "ends"])
def test_another_signals_handler_raising_as_a_step_arms_or_ends_leaves_nothing_held(when):
    """``signal.signal`` runs pending handlers before it installs, and installs nothing
    when one raises: a SIGTERM handler's SystemExit just as a step put its own SIGINT
    handler in (its ``__exit__`` then never ran) or put Python's back left the hold in
    place for good, every later Ctrl-C of the process only noted (for the allocation
    callback, written into the C stack of a call long returned)."""
    out = run_python(AS_A_STEP + """
    def on_term(signum, frame):
        raise SystemExit("terminated")
    signal.signal(signal.SIGTERM, on_term)
    arms = {when!r} == "arms"
    profile = as_a_step(arms, lambda: os.kill(os.getpid(), signal.SIGTERM))
    if arms:
        sys.setprofile(profile)
    try:
        with interrupts.held("the test step"):
            sys.setprofile(profile)
            print("ran")
    except SystemExit as exc:
        print("exit", exc)
    sys.setprofile(None)
    """.format(when=when) + CTRL_C_AFTER)
    assert out.returncode == 0, out.stderr[-3000:]
    ran = [] if when == "arms" else ["ran"]
    assert out.stdout.splitlines() == ran + ["exit terminated", "handler back True",
                                             "raised"], (out.stdout, out.stderr[-3000:])


@pytest.mark.parametrize("when", ["arms", "ends"])
def test_a_ctrl_c_held_when_another_handler_cuts_a_steps_arming_or_end_is_raised(when):
    """A Ctrl-C the step held (as its handler went in, or in the block), then an alarm
    whose handler raised TimeoutError as the step armed or put Python's handler back:
    the step raised the TimeoutError alone and the Ctrl-C it had said it held was lost
    (a program that retries on timeouts went on).  Now the interrupt is raised, the
    timeout its context."""
    out = run_python(AS_A_STEP + """
    import ctypes
    def on_alarm(signum, frame):
        raise TimeoutError("alarm")
    signal.signal(signal.SIGALRM, on_alarm)
    trip = ctypes.pythonapi.PyErr_SetInterruptEx
    trip.argtypes = [ctypes.c_int]
    arms = {when!r} == "arms"
    def ctrl_c_and_alarm():
        if arms:
            trip(signal.SIGINT)  # handled in number order: the Ctrl-C first
        trip(signal.SIGALRM)
    profile = as_a_step(arms, ctrl_c_and_alarm)
    if arms:
        sys.setprofile(profile)
    try:
        with interrupts.held("the test step"):
            if not arms:
                ctrl_c()
                sys.setprofile(profile)
    except KeyboardInterrupt as exc:
        print("raised, context", type(exc.__context__).__name__)
    except TimeoutError:
        print("timeout only")
    sys.setprofile(None)
    print("handler back", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """.format(when=when))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised, context TimeoutError", "handler back True"], \
        (out.stdout, out.stderr[-3000:])


def test_a_step_whose_end_is_cut_at_every_try_gives_up_and_the_next_ctrl_c_is_raised():
    """Another handler raising at every try to put Python's handler back kept the step's
    end trying forever (and took the process's SIGTERM with it).  It tries a bounded
    number of times; the next Ctrl-C then puts Python's handler back and is raised."""
    out = run_python(HELD + """
    import types
    real = signal.signal
    tries = []
    def refused(number, handler):  # as if an alarm's handler raised at every install
        if number == signal.SIGINT and handler is signal.default_int_handler:
            tries.append(1)
            raise TimeoutError("alarm")
        return real(number, handler)
    names = {k: getattr(signal, k) for k in dir(signal) if not k.startswith("__")}
    try:
        with interrupts.held("the test step"):
            interrupts.signal = types.SimpleNamespace(**dict(names, signal=refused))
    except TimeoutError:
        print("timeout, bounded", 1 < len(tries) <= 1000)
    interrupts.signal = signal
    """ + CTRL_C_AFTER + """
    print("then", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """, timeout=60, hung="a step's end trying forever")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["timeout, bounded True", "handler back False",
                                       "raised", "then True"], (out.stdout, out.stderr[-3000:])


def test_every_ctrl_c_waits_for_the_step_and_one_is_raised_as_it_ends():
    """No way out halfway: a step cut there is what holding prevents (a second Ctrl-C
    that got out cut a sleep between its release and its books: bytes lost)."""
    out = run_python(HELD + """
    done = []
    try:
        with interrupts.held("the test step"):
            ctrl_c()
            done.append(1)
            ctrl_c()
            done.append(2)
        print("not raised")
    except KeyboardInterrupt:
        print("raised after", done, signal.getsignal(signal.SIGINT) is
              signal.default_int_handler)
    """)
    assert "raised after [1, 2] True" in out.stdout, (out.stdout, out.stderr)
    assert out.stderr.count("vmm_core: Ctrl-C held until the test step is done") == 1, \
        out.stderr


def test_exit_and_a_handler_saved_and_put_back_inside_the_step_are_kept():
    out = run_python(HELD + """
    import sys
    try:
        with interrupts.held("the test step"):
            ctrl_c()
            sys.exit(3)
    except SystemExit as exc:
        print("exit kept", exc.code)
    saved = []
    with interrupts.held("the test step"):
        saved.append(signal.getsignal(signal.SIGINT))
    signal.signal(signal.SIGINT, saved[0])  # a program putting back what it saw
    try:
        ctrl_c()
        print("swallowed")
    except KeyboardInterrupt:
        print("a later Ctrl-C still interrupts")
    # and Python's handler is back, so the next step holds Ctrl-C again
    with interrupts.held("the next step") as later:
        print("next step armed", signal.getsignal(signal.SIGINT) == later._note)
    """)
    assert "exit kept 3" in out.stdout, (out.stdout, out.stderr)
    assert "a later Ctrl-C still interrupts" in out.stdout, (out.stdout, out.stderr)
    assert "next step armed True" in out.stdout, (out.stdout, out.stderr)


def test_a_listener_that_exits_leaves_no_reference_cycle_behind():
    out = run_python(SLEEPING + """
    import gc, sys
    alloc.backend = injector._real
    listener = lambda event, **kw: sys.exit(4)  # noqa: E731 - held weakly
    alloc.add_sleep_listener(listener)
    gc.collect()
    gc.disable()
    try:
        vmm_core.sleep("w", offload="w")
    except SystemExit as exc:
        print("exit", exc.code)
    print("collected", gc.collect())
    """)
    assert "exit 4" in out.stdout and "collected 0" in out.stdout, (out.stdout, out.stderr)


def test_a_step_that_fails_after_a_held_ctrl_c_raises_the_interrupt_with_its_error():
    out = run_python(HELD + """
    try:
        with interrupts.held("the test step"):
            ctrl_c()
            raise ValueError("the step failed")
    except KeyboardInterrupt as exc:
        print("interrupt, context", repr(exc.__context__))
    """)
    assert "interrupt, context ValueError('the step failed')" in out.stdout, \
        (out.stdout, out.stderr)


def test_a_handler_of_the_programs_own_and_other_threads_are_left_alone():
    out = run_python(HELD + """
    import time
    seen = []
    signal.signal(signal.SIGINT, lambda *a: seen.append("the program's handler"))
    with interrupts.held("the test step"):
        ctrl_c()
        time.sleep(0.05)
    print("seen", seen)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    errors = []
    def off_main():
        try:
            with interrupts.held("a thread's step"):
                pass
        except BaseException as exc:
            errors.append(exc)
    t = threading.Thread(target=off_main)
    t.start(); t.join()
    print("thread", errors, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """)
    assert "seen [\"the program's handler\"]" in out.stdout, (out.stdout, out.stderr)
    assert "thread [] True" in out.stdout, (out.stdout, out.stderr)


SLEEPING = HELD + """
    import vmm_core
    from vmm_core.testing import FaultInjector

    class CtrlCAfter(FaultInjector):
        at = None  # "unmap" or "map": a Ctrl-C right after the next such call
        def _after(self, name, result):
            if self.at == name:
                self.at = None
                ctrl_c()
            return result
        def unmap(self, *args, **kwargs):
            return self._after("unmap", self._real.unmap(*args, **kwargs))
        def map(self, *args, **kwargs):
            return self._after("map", self._real.map(*args, **kwargs))

    with vmm_core.region("w", backend="host") as alloc:
        address = alloc.allocate(3 << 20)
    view = vmm_core.get_backend("host").torch_tensor(0, address, 3 << 20)
    view.fill_(7)
    injector = CtrlCAfter(alloc.backend)
    alloc.backend = injector
"""


def test_ctrl_c_inside_a_sleeps_release_of_pages_lets_the_sleep_finish():
    """Before, the interrupt landed between two unmaps: the allocator said awake with
    its pages unmapped and no host copy recorded."""
    out = run_python(SLEEPING + """
    heard = []
    listener = lambda event, **kw: heard.append(event)  # noqa: E731 - held weakly
    alloc.add_sleep_listener(listener)
    injector.at = "unmap"  # the rest still mapped
    try:
        vmm_core.sleep("w", offload="w")
        print("not raised")
    except KeyboardInterrupt:
        print("raised; asleep", alloc.asleep, "heard", heard)
    alloc.backend = injector._real
    vmm_core.wake_up("w")
    print("bytes back", bool((view == 7).all()), "heard", heard)
    """)
    assert "raised; asleep True heard ['sleep']" in out.stdout, (out.stdout, out.stderr)
    assert "bytes back True heard ['sleep', 'wake']" in out.stdout, (out.stdout, out.stderr)


def test_ctrl_c_as_a_wake_gives_its_host_copy_back_lets_the_listeners_hear_it():
    """Before, an interrupt between the pages kept and the listeners told left graph
    pools believing their memory asleep."""
    out = run_python(SLEEPING + """
    from vmm_core.memory import host_copy
    alloc.backend = injector._real
    heard = []
    listener = lambda event, **kw: heard.append(event)  # noqa: E731 - held weakly
    alloc.add_sleep_listener(listener)
    vmm_core.sleep("w", offload="w")
    real_woke = host_copy.AllocatorHostCopy.woke
    def woke(self, *args, **kwargs):
        ctrl_c()
        return real_woke(self, *args, **kwargs)
    host_copy.AllocatorHostCopy.woke = woke
    try:
        vmm_core.wake_up("w", keep_host_buffers=False)
        print("not raised")
    except KeyboardInterrupt:
        print("raised; asleep", alloc.asleep, "heard", heard,
              "host bytes", vmm_core.memory_summary()["w"]["host_bytes"])
    print("bytes back", bool((view == 7).all()))
    """)
    assert "raised; asleep False heard ['sleep', 'wake'] host bytes 0" in out.stdout, \
        (out.stdout, out.stderr)
    assert "bytes back True" in out.stdout


def test_ctrl_c_during_a_wakes_map_lets_the_wake_finish_and_the_tag_wake_again():
    """Before, the interrupt came as the driver's map returned, before the books held
    the mapping: the rollback left it mapped, and every later wake of the tag failed."""
    out = run_python(SLEEPING + """
    vmm_core.sleep("w", offload="w")
    injector.at = "map"
    try:
        vmm_core.wake_up("w")
        print("not raised")
    except KeyboardInterrupt:
        print("raised; asleep", alloc.asleep, "bytes back", bool((view == 7).all()))
    vmm_core.sleep("w", offload="w")
    vmm_core.wake_up("w")
    print("again", bool((view == 7).all()))
    """)
    assert "raised; asleep False bytes back True" in out.stdout, (out.stdout, out.stderr)
    assert "again True" in out.stdout, (out.stdout, out.stderr)


def test_a_held_ctrl_c_leaves_no_reference_cycle_behind():
    """The interrupt raised as a sleep ends holds no frame that holds it: the step's
    objects (the allocator, its host copy) go when the caller lets go, not at the next
    collection."""
    out = run_python(SLEEPING + """
    import gc
    gc.collect()
    gc.disable()
    injector.at = "unmap"  # the rest still mapped
    try:
        vmm_core.sleep("w", offload="w")
    except KeyboardInterrupt:
        pass
    print("collected", gc.collect())
    """)
    assert "collected 0" in out.stdout, (out.stdout, out.stderr)



@pytest.mark.parametrize("thread, what, setup, outcome", [
    ("vmm_core-pin", "the start of the thread that page-locks host copies", "",
     "raised in ['sleep'] asleep [True]"),
    ("vmm_core-offload", "the hand-over of a chunk to the host copy threads", "",
     "raised in ['sleep'] asleep [False]"),
    ("vmm_core-offload", "the start of a host copy thread", "prepare",
     "raised in ['prepare'] asleep []"),
    ("vmm_core-prepare", "the start of the thread that makes host copies ahead",
     "prepare_offload", "raised in ['region'] asleep [False]"),
])
def test_ctrl_c_as_a_host_copy_thread_starts_lets_the_process_exit(thread, what, setup,
                                                                     outcome):
    """Before, an interrupt inside Thread.start of one of offload's worker threads left
    a worker its executor never recorded: nothing told it to stop, and the interpreter's
    exit waited for it forever.  Now the start finishes and the interrupt is raised as
    the step that started it ends (the sleep's copy, interruptible, stops there)."""
    out = run_python(THREAD_STARTS + f"""
    import vmm_core
    from vmm_core import offload

    armed[{thread!r}] = True
    raised, asleep = [], []
    with offload.configured(strategy="staged", chunk_bytes=192 << 10, slots=3, threads=2):
        steps = []
        if {setup == "prepare"!r}:  # the copy threads started ahead, alone
            try:
                offload.prepare(vmm_core.get_backend("host"))
            except KeyboardInterrupt:
                raised.append("prepare")
        def region():
            with vmm_core.region("w", backend="host",
                                 prepare_offload={setup == "prepare_offload"!r}) as alloc:
                address = alloc.allocate(3 << 20)
                steps.append((alloc, address))
                vmm_core.get_backend("host").torch_tensor(0, address, 3 << 20).fill_(7)
        for name, step in (("region", region),
                           ("sleep", lambda: vmm_core.sleep("w", offload="w")),
                           ("wake", lambda: vmm_core.wake_up("w"))):
            try:
                step()
            except KeyboardInterrupt:
                raised.append(name)
                asleep.append(steps[0][0].asleep)
        vmm_core.wake_up("w")
        offload.wait_for_prepared()
        view = vmm_core.get_backend("host").torch_tensor(0, steps[0][1], 3 << 20)
        print("raised in", raised, "asleep", asleep, "bytes back", bool((view == 7).all()))
    """, timeout=30, hung="the exit waited for a thread nothing stops")
    assert f"{outcome} bytes back True" in out.stdout, (out.stdout, out.stderr)
    assert f"Ctrl-C held until {what} is done" in out.stderr, out.stderr
    assert out.returncode == 0, out.stderr



@pytest.mark.parametrize("function, step", [
    ("prepared.prepare_later", """
        with vmm_core.region("w", backend="host", prepare_offload=True) as alloc:
            alloc.allocate(3 << 20)"""),
    ("pinning.pin_later", """
        vmm_core.sleep("w", offload="w")
        vmm_core.wake_up("w", keep_host_buffers=False)"""),
])
def test_ctrl_c_at_any_line_of_handing_a_copy_to_its_thread_leaves_it_on_the_books(
        function, step):
    """Before, one landing between a copy made ahead and its callback left it unsettled,
    and wait_for_prepared() waited for it forever; a registration's books are whole too
    (wait_for_pinning() ends, and nothing is left in flight)."""
    module, name = function.split(".")
    out = run_python(HELD + AT_A_LINE + f"""
    import textwrap
    import vmm_core
    from vmm_core import offload
    from vmm_core.memory.offload import pinning, prepared

    code = {module}.{name}.__code__
    lines = lines_of(code)
    stuck = []
    step = compile(textwrap.dedent({step!r}), "step", "exec")
    with offload.configured(strategy="staged", chunk_bytes=192 << 10, slots=3, threads=2):
        with vmm_core.region("w", backend="host") as alloc:
            alloc.allocate(3 << 20)
        for line in lines:
            sys.settrace(ctrl_c_at(code, line))
            try:  # a code object: exec of a string leaves CPython's flag for an unhandled
                exec(step)  # KeyboardInterrupt set, and the interpreter kills itself at exit
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            if vmm_core.tags_on("host", 0).get("w"):  # asleep: the step stopped between
                vmm_core.wake_up("w", keep_host_buffers=False)
            if not (offload.wait_for_prepared(timeout=10) and not pinning._pinning
                    and not prepared._preparing):
                stuck.append(line)
    print("lines", len(lines), "stuck", stuck)
    """, timeout=120, hung="an exit or a wait for a host copy's thread that never ends")
    assert "stuck []" in out.stdout, (out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr


def test_ctrl_c_as_a_sleeps_copy_starts_its_threads_leaves_no_copy_running_behind():
    """Before, the chunk's copy was queued and its future lost with the interrupt: the
    failed sleep's wait missed it, and it copied an old slot over the next sleep's
    bytes.  Every chunk holds a different byte; one copy thread is made slow."""
    out = run_python(THREAD_STARTS + """
    import ctypes, time
    import vmm_core
    from vmm_core import offload

    slow = [False]
    memmove = ctypes.memmove
    def late_memmove(dst, src, n):
        if slow[0] and threading.current_thread().name.startswith("vmm_core-offload"):
            slow[0] = False
            time.sleep(0.5)  # the first copy of the interrupted sleep runs late
        return memmove(dst, src, n)
    ctypes.memmove = late_memmove

    chunk, n = 192 << 10, 16
    with offload.configured(strategy="staged", chunk_bytes=chunk, slots=3, threads=2,
                            pin_kept=False):
        with vmm_core.region("w", backend="host") as alloc:
            address = alloc.allocate(n * chunk)
        rows = vmm_core.get_backend("host").torch_tensor(0, address, n * chunk).view(n, chunk)
        for i in range(n):
            rows[i].fill_(i + 1)
        vmm_core.sleep("w", offload="w")
        vmm_core.wake_up("w")  # a kept copy now
        offload.release_staging()  # a fresh pool: its threads start in the next sleep
        armed["vmm_core-offload"] = slow[0] = True
        try:
            vmm_core.sleep("w", offload="w")
            print("not raised")
        except KeyboardInterrupt:
            print("raised; asleep", alloc.asleep)
        vmm_core.sleep("w", offload="w")  # the program sleeps again
        time.sleep(1.0)  # a copy left running would have landed by now
        vmm_core.wake_up("w")
        print("bytes back", [int(rows[i][0]) for i in range(n)] == list(range(1, n + 1)))
    """, timeout=60)
    assert "raised; asleep False" in out.stdout, (out.stdout, out.stderr)
    assert "bytes back True" in out.stdout, (out.stdout, out.stderr)


def test_ctrl_c_as_a_direct_copy_starts_its_threads_leaves_no_copy_running_behind():
    """Before, the hold over the hand-over raised before the failure's wait: the sleep
    freed its fresh host copy while copy threads still wrote it (a segfault)."""
    out = run_python(THREAD_STARTS + """
    import ctypes, time
    import vmm_core
    from vmm_core import offload
    from vmm_core.memory.offload import staging

    running, done = [0], [0]
    memmove = ctypes.memmove
    def late_memmove(dst, src, n):
        if not threading.current_thread().name.startswith("vmm_core-offload"):
            return memmove(dst, src, n)
        running[0] += 1
        time.sleep(0.05)  # each of the copy threads' copies runs late
        try:
            return memmove(dst, src, n)
        finally:
            running[0] -= 1
            done[0] += 1
    ctypes.memmove = late_memmove

    chunk, n = 192 << 10, 16
    with offload.configured(strategy="direct", chunk_bytes=chunk, direct_threads=2,
                            threads=2, pin_kept=False, keep_host_buffers=False):
        with vmm_core.region("w", backend="host") as alloc:
            address = alloc.allocate(n * chunk)
        rows = vmm_core.get_backend("host").torch_tensor(0, address, n * chunk).view(n, chunk)
        for i in range(n):
            rows[i].fill_(i + 1)
        offload.release_staging()  # a fresh pool: its threads start in the sleep
        armed["vmm_core-offload"] = True
        try:
            vmm_core.sleep("w", offload="w")
            print("not raised")
        except KeyboardInterrupt:
            print("raised; asleep", alloc.asleep, "running", running[0], "queued",
                  staging._executor._work_queue.qsize())
        copied = done[0]
        time.sleep(0.5)
        print("copies after the raise", done[0] - copied)
        vmm_core.sleep("w", offload="w")
        vmm_core.wake_up("w")
        print("bytes back", [int(rows[i][0]) for i in range(n)] == list(range(1, n + 1)))
    """, timeout=60)
    assert "raised; asleep False running 0 queued 0" in out.stdout, (out.stdout, out.stderr)
    assert "copies after the raise 0" in out.stdout, (out.stdout, out.stderr)
    assert "bytes back True" in out.stdout, (out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr


def test_ctrl_c_while_waiting_for_the_lock_to_pin_a_copy_is_raised_at_once():
    """The hold begins once the locks are had: a sleep on another thread holding the
    lock of tagged memory does not keep Ctrl-C from the caller (before, the caller's
    Ctrl-C waited for that lock, here for good: the other thread lets go only after it)."""
    out = run_python(HELD + """
    import vmm_core
    from vmm_core import offload
    from vmm_core.memory import tag_state
    from vmm_core.memory.host_memory import MappedHostCopy
    from vmm_core.memory.offload import pinning

    host = MappedHostCopy(1 << 20)
    taken, let_go = threading.Event(), threading.Event()
    def holder():
        with tag_state.state_lock():
            taken.set()
            let_go.wait(30)
    threading.Thread(target=holder, daemon=True).start()
    taken.wait()
    threading.Timer(0.2, ctrl_c).start()
    try:
        pinning.pin_later(vmm_core.get_backend("host"), 0, host)
        print("not raised")
    except KeyboardInterrupt:
        print("raised while the lock was held", not let_go.is_set())
    let_go.set()
    """, timeout=20, hung="Ctrl-C held through a lock wait another thread ends")
    assert "raised while the lock was held True" in out.stdout, (out.stdout, out.stderr)


def test_a_pool_shut_down_meanwhile_hands_its_work_to_the_one_that_replaced_it():
    """Not to the caller's thread, which may hold Ctrl-C for the hand-over."""
    out = run_python(HELD + """
    from vmm_core.memory.offload import staging

    pool = staging.copy_threads(2)
    staging.release_staging()  # another thread's, say: this one still holds the pool
    where = pool.submit(lambda: threading.current_thread().name).result()
    print("ran on", where)
    """)
    assert "ran on vmm_core-offload" in out.stdout, (out.stdout, out.stderr)


def test_ctrl_c_at_any_line_of_freeing_a_large_copy_leaves_no_stripe_running_behind():
    """Before, a Ctrl-C while the copy threads emptied its pages unmapped the copy with
    stripes still queued: they emptied whatever was mapped there next; one as it was
    unregistered left it mapped for good (its base already forgotten)."""
    out = run_python(HELD + AT_A_LINE + """
    import time
    import vmm_core
    from vmm_core.memory import host_memory
    from vmm_core.memory.host_memory import MappedHostCopy
    from vmm_core.memory.offload import staging

    lib = host_memory.libc()
    madvise, late = lib.madvise, []
    ended = [True]
    def slow_madvise(*args):
        if threading.current_thread().name.startswith("vmm_core-offload"):
            time.sleep(0.02)  # a stripe of the parallel release, late
            if ended[0]:
                late.append(args)
        return madvise(*args)
    lib.madvise = slow_madvise
    steps = [(code, line) for code in (MappedHostCopy.release.__code__,
                                       MappedHostCopy._unmap.__code__)
             for line in lines_of(code)]
    def mapped(address):
        with open("/proc/self/maps") as maps:
            return any(int(r.split("-")[0], 16) <= address < int(r.split()[0].split("-")[1], 16)
                       for r in maps)

    pool, left_mapped = staging.copy_threads(4), []
    for code, line in steps:
        copy = MappedHostCopy(host_memory.PARALLEL_RELEASE_BYTES)
        copy.register(vmm_core.get_backend("host"), 0)  # its release unregisters it first
        base = copy.base
        ended[0] = False
        sys.settrace(ctrl_c_at(code, line))
        try:
            copy.release(pool, 4)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
            ended[0] = True
        time.sleep(0.1)
        if mapped(base) and copy.base is None:  # forgotten, yet held
            left_mapped.append(line)
    print("lines", len(steps), "stripes after the release", len(late), "left mapped",
          left_mapped)
    """, timeout=120)
    assert "stripes after the release 0 left mapped []" in out.stdout, (out.stdout, out.stderr)


@pytest.mark.parametrize("when", ["before", "after", "as it fails"])
@pytest.mark.parametrize("call", ["a hint", "a block's opening"])
def test_ctrl_c_as_the_preparer_starts_leaves_one_preparer_and_no_block_open(call, when):
    """A Ctrl-C inside Thread.start of the thread that prepares executables ahead: before
    the thread existed, the pool recorded one that never ran (settle() waited forever,
    nothing was prepared again); at a block's opening, the block was left open with its
    key pinned, and every pool of the process put its background work off for good.
    Now the start finishes, the interrupt is raised from the call as it ends, and the
    block it was opening is closed again."""

    out = run_python(HELD + THREAD_STARTS_REFUSED + f"""
    import vmm_core
    from vmm_core import ExecutablePolicy
    from vmm_core.graphs import exec_blocks
    from test_executables_host import Model, _execs, _pool

    thread_starts["vmm-core-executables"] = "ctrl-c {when}"

    pool = _pool(vmm_core.get_backend("host"),
                 ExecutablePolicy(max_count=6, ahead=True, share="when_full"))
    model = Model(pool, sizes=(1, 2, 4, 8), layers=3)
    try:
        if {call!r} == "a hint":
            pool.expect(4)
        else:
            model.step(1)
        print("not raised")
    except KeyboardInterrupt:
        print("raised")
    print("open blocks", exec_blocks.open_blocks.count,
          [s.key for s in pool._executables._pinned])
    for size in (1, 2, 1, 2):
        model.step(size)  # exact all the same
    print("settled", pool.settle(5))
    before = _execs(pool)["prepared_ahead"]
    pool.expect(8)
    print("settled", pool.settle(5), "ahead", _execs(pool)["prepared_ahead"] - before)
    print("preparers", sum(t.name == "vmm-core-executables" for t in threading.enumerate()))
    pool.close()
    """, env=env_with_tests(), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines == ["raised", "open blocks 0 []", "settled True",
                     "settled True ahead 3", "preparers 1"], (lines, out.stderr[-3000:])


def test_ctrl_c_anywhere_in_a_replay_blocks_opening_or_end_leaves_no_block_open():
    """A replay block pins its key and puts every pool's background preparation off
    until it ends.  A Ctrl-C at a line of its opening or end (a step's block, or one
    graph's launch outside a block) used to leave it open for good: its key pinned, the
    pools' preparers deferred forever.  Now no line leaves one open, and preparation goes
    on afterwards."""

    out = run_python(HELD + AT_A_LINE + """
    import vmm_core
    from vmm_core import ExecutablePolicy
    from vmm_core.graphs import exec_ahead, exec_blocks, executables, pool as pool_module
    from vmm_core.graphs.capture_space import replay_blocks
    from vmm_core.graphs.kept_graphs import innermost
    from test_executables_host import Model, _execs, _pool

    import inspect
    GraphPool = pool_module.GraphPool
    codes = [inspect.unwrap(getattr(GraphPool, "_replay_block", GraphPool.replaying)),
             GraphPool.replaying, executables.ExecutableCache.replay]
    codes += [getattr(exec_blocks.replay_block, name, None)
              for name in ("__init__", "__enter__", "__exit__", "close")]
    codes += [getattr(exec_ahead.AheadPreparation, name, None)
              for name in ("pin", "abandon", "unpin", "_end_block", "_resume_all", "_resume")]
    codes += [exec_blocks.OpenBlocks.opened, exec_blocks.OpenBlocks.closed]
    codes = [getattr(c, "__func__", c).__code__ for c in codes if c is not None]

    pool = _pool(vmm_core.get_backend("host"),
                 ExecutablePolicy(max_count=6, ahead=True, share="when_full"))
    model = Model(pool, sizes=(1, 2, 4, 8), layers=3)
    cache = pool._executables
    steps = [(code, line) for code in codes for line in lines_of(code)]
    left, cuts, turn = [], 0, 0
    for code, line in steps:
        for how in ("a step", "one launch"):
            turn += 1
            size = model.sizes[turn % len(model.sizes)]
            sys.settrace(ctrl_c_at(code, line))
            try:
                if how == "a step":
                    model.step(size)
                else:
                    model.graphs[size][0].replay()
            except KeyboardInterrupt:
                cuts += 1
            finally:
                sys.settrace(None)
            if exec_blocks.open_blocks.count or cache._pinned or replay_blocks() \\
                    or innermost.slot is not None \\
                    or any(s.depth for s in cache._slots.values()):
                left.append((code.co_name, line, how))
                break
        if left:
            break
    print("cut", cuts > 100, "left open", left)
    for size in (1, 2, 1, 2):
        model.step(size)  # exact all the same
    print("settled", pool.settle(5))
    before = _execs(pool)["prepared_ahead"]
    pool.expect(next(s.key for s in cache._slots.values() if not s.complete))
    print("settled", pool.settle(5), "ahead", _execs(pool)["prepared_ahead"] > before)
    pool.close()
    """, env=env_with_tests(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["cut True left open []", "settled True",
                                       "settled True ahead True"], (out.stdout,
                                                                    out.stderr[-3000:])


def test_ctrl_c_anywhere_in_routing_a_device_leaves_a_routing_that_stop_ends():
    """Cut between the adapter's routing of a device and its record, the handle was
    lost: the process stayed routed, and stop() could never end that routing.  Every
    routing made is now on the books, so stop() closes each."""
    out = run_python(HELD + AT_A_LINE + """
    import vmm_core
    from vmm_core.memory import whole_process
    from vmm_backends.host import allocator_adapter

    made, closed = [], []
    class Handle:
        def close(self):
            closed.append(self)
    real = allocator_adapter.HostAllocatorAdapter.route_process
    def route_process(self, *args):
        real(self, *args)
        made.append(Handle())
        return made[-1]
    allocator_adapter.HostAllocatorAdapter.route_process = route_process

    code = whole_process.ProcessRouting.route.__code__
    lost, cuts = [], 0
    for line in lines_of(code):
        sys.settrace(ctrl_c_at(code, line))
        try:
            whole_process.route_process("wpc", backend="host", device=0)
        except KeyboardInterrupt:
            cuts += 1
        finally:
            sys.settrace(None)
        routing = whole_process.process_routing()
        if routing is not None:
            routing.stop()
        if len(closed) != len(made):
            lost.append(line)
            closed[:] = made
    print("cut", cuts >= 10 and len(made) >= 10, "lost", lost)
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["cut True lost []"], (out.stdout, out.stderr)


BLOCKS = HELD + AT_A_LINE + AT_A_RETURN + """
    import contextlib, time
    import vmm_core
    from vmm_core import ExecutablePolicy
    from vmm_core.graphs import exec_ahead, exec_blocks, executables
    from vmm_core.graphs.capture_space import replay_blocks
    from vmm_core.graphs.kept_graphs import innermost
    from test_executables_host import Model, _execs, _pool
"""


def test_ctrl_c_as_a_nested_block_opens_leaves_the_outer_block_ended_and_no_fast_path():
    """Cut as the inner block's opening returned, the outer block's end left its own
    entry on the thread's list (under the inner one) and the innermost slot on it: a
    graph of the outer key then launched on the fast path with no block, its memory
    asleep.  Now the outer block's end ends the inner one too."""
    out = run_python(BLOCKS + """
    pool = _pool(vmm_core.get_backend("host"), ExecutablePolicy(max_count=6, ahead=True))
    model = Model(pool, sizes=(1, 2), layers=2)
    enter = contextlib._GeneratorContextManager.__enter__.__code__
    try:
        with pool.replaying(1):
            sys.setprofile(ctrl_c_as_it_returns(enter, c_call=True,
                                                when=lambda: len(replay_blocks()) == 2))
            with pool.replaying(2):
                pass
    except KeyboardInterrupt:
        print("raised")
    sys.setprofile(None)
    print("blocks", [entry[1] for entry in replay_blocks()], "innermost", innermost.slot,
          "open", exec_blocks.open_blocks.count, "pinned", pool._executables._pinned)
    vmm_core.sleep("graph")
    try:
        model.graphs[1][0].replay()
        print("replayed asleep")
    except vmm_core.SleepStateError:
        print("refused asleep")
    vmm_core.wake_up("graph")
    model.step(1)
    model.step(2)
    pool.close()
    """, env=env_with_tests(), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised", "blocks [] innermost None open 0 pinned []",
                                       "refused asleep"], (out.stdout, out.stderr[-3000:])


@pytest.mark.parametrize("at", ["_end_block", "resumed"])
def test_ctrl_c_as_a_blocks_end_returns_still_wakes_the_preparer_it_put_off(at):
    """A preparer that put a hinted key off for an open block is woken as the last block
    ends; cut as the end's books returned, or as the preparer was taken off the waiting
    list, that wake was lost (the key was prepared only when something else woke the
    preparer)."""
    out = run_python(BLOCKS + f"""
    pool = _pool(vmm_core.get_backend("host"), ExecutablePolicy(max_count=3, ahead=True))
    model = Model(pool, sizes=(1, 2), layers=3)
    model.step(2)
    model.step(1)  # key 1's executables resident, key 2's evicted
    pool.settle(5)
    cache = pool._executables
    end = (exec_ahead.AheadPreparation._end_block if {at!r} == "_end_block"
           else exec_blocks.OpenBlocks.resumed).__code__
    try:
        with pool.replaying(1):
            deferrals = exec_blocks.open_blocks.deferrals
            pool.expect(2)
            while exec_blocks.open_blocks.deferrals == deferrals:  # key 2 put off
                time.sleep(0.001)
            sys.setprofile(ctrl_c_as_it_returns(end))
    except KeyboardInterrupt:
        print("raised")
    sys.setprofile(None)
    print("settled", pool.settle(5), "key 2 made", cache._slots[2].complete)
    pool.close()
    """, env=env_with_tests(), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised", "settled True key 2 made True"], \
        (out.stdout, out.stderr[-3000:])


@pytest.mark.parametrize("share", ["off", "when_full"])
@pytest.mark.parametrize("at", ["the claim's return", "the driver calls' return",
                                "the install's start"])
def test_ctrl_c_as_a_launch_makes_its_missed_executable_leaves_the_graph_replayable(at, share):
    """Cut between an inline miss's driver calls and the install, the job stayed
    pending: every later launch of the graph waited for it, then raised (60 s in the
    library, 2 s here), and its executable was never installed nor destroyed."""
    out = run_python(BLOCKS + f"""
    executables.IN_FLIGHT_WAIT = 2.0
    pool = _pool(vmm_core.get_backend("host"),
                 ExecutablePolicy(max_count=3, ahead=False, share={share!r}))
    model = Model(pool, sizes=(1, 2), layers=3)
    model.step(2)
    model.step(1)  # key 2's executables evicted (or taken by key 1's, shared)
    cache = pool._executables
    code = {{"the claim's return": executables.ExecutableCache._claim_inline,
             "the driver calls' return": executables.ExecutableCache._execute,
             "the install's start": executables.ExecutableCache._install}}[{at!r}].__code__
    if {at!r} != "the install's start":
        sys.setprofile(ctrl_c_as_it_returns(code))
    else:
        sys.settrace(ctrl_c_at(code, lines_of(code)[1]))
    try:
        model.step(2)
    except KeyboardInterrupt:
        print("raised")
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    print("pending", list(cache._pending))
    started = time.monotonic()
    for size in (2, 1, 2):
        model.step(size)  # exact all the same
    print("replayed", time.monotonic() - started < 1.5, "resident", _execs(pool)["resident"],
          "in budget", _execs(pool)["resident"] <= 3)
    pool.close()
    """, env=env_with_tests(), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised", "pending []",
                                       "replayed True resident 3 in budget True"], \
        (out.stdout, out.stderr[-3000:])


def test_a_block_cut_off_and_freed_later_inside_another_block_ends_only_itself():
    """A nested block whose end a Ctrl-C cut off ends when its frames are freed, which
    may be inside a block opened since (an interactive session frees them at its next
    error): it must end only itself, not the block open now, nor set the thread's
    innermost block to another."""
    out = run_python(BLOCKS + """
    import gc
    pool = _pool(vmm_core.get_backend("host"), ExecutablePolicy(max_count=12, ahead=True))
    model = Model(pool, sizes=(1, 2, 4), layers=2)
    enter = contextlib._GeneratorContextManager.__enter__.__code__
    cache = pool._executables
    with pool.replaying(1):
        try:
            sys.setprofile(ctrl_c_as_it_returns(enter, c_call=True,
                                                when=lambda: len(replay_blocks()) == 2))
            with pool.replaying(2):
                pass
        except KeyboardInterrupt as exc:
            kept = exc  # the cut block's frames, alive as a session's last error keeps them
        sys.setprofile(None)
        with pool.replaying(4):
            del kept
            gc.collect()
            pool.settle(10)  # the preparer makes 4's executables: both launches fast
            hits = cache._slots[4].hits
            for g in model.graphs[4]:
                g.replay()
            print("inside 4:", [entry[1] for entry in replay_blocks()],
                  "innermost", innermost.slot.key, "pinned", sorted(s.key for s in cache._pinned),
                  "fast", cache._slots[4].hits - hits)
        print("inside 1:", [entry[1] for entry in replay_blocks()], "innermost",
              innermost.slot.key)
    print("after:", replay_blocks(), innermost.slot, exec_blocks.open_blocks.count)
    for size in (1, 2, 4):
        model.step(size)
    pool.close()
    """, env=env_with_tests(), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["inside 4: [1, 4] innermost 4 pinned [1, 4] fast 2",
                                       "inside 1: [1] innermost 1", "after: [] None 0"], \
        (out.stdout, out.stderr[-3000:])


def test_ctrl_c_as_an_eager_wake_makes_an_executable_leaves_every_graph_replayable():
    """The eager wake makes each executable as a launch's miss does; cut between its
    driver calls and its install, the job stayed pending and the graph's every later
    launch waited for it, then raised (2 s here)."""
    out = run_python(BLOCKS + """
    executables.IN_FLIGHT_WAIT = 2.0
    pool = _pool(vmm_core.get_backend("host"), ExecutablePolicy(max_count=6))
    model = Model(pool, sizes=(1, 2), layers=3)
    model.step(1)
    model.step(2)
    vmm_core.sleep("graph")
    sys.setprofile(ctrl_c_as_it_returns(executables.ExecutableCache._execute.__code__))
    try:
        vmm_core.wake_up("graph", eager=True)
    except KeyboardInterrupt:
        print("raised")
    finally:
        sys.setprofile(None)
    print("pending", list(pool._executables._pending))
    started = time.monotonic()
    for size in (1, 2, 1, 2):
        model.step(size)  # exact all the same
    print("replayed", time.monotonic() - started < 1.5, "in budget",
          _execs(pool)["resident"] <= 6)
    pool.close()
    """, env=env_with_tests(), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised", "pending []", "replayed True in budget True"], \
        (out.stdout, out.stderr[-3000:])
