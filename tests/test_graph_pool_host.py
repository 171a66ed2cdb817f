"""GraphPool on the host backend: capture spaces for an engine's own runner, for real.

On the host a "capture" allocates from the space's allocator the way the C shim does for
a device framework (through ``routing``), so spaces, aliasing, the escape guard, reopening
and sleep are exercised on real memfd pages.
"""

from __future__ import annotations

import ctypes
import gc
import threading

import pytest
import torch
from host_space import framework_alloc, read, write

import vmm_core
from vmm_core.errors import CaptureError, CaptureEscapeError, SleepStateError, VMMError
from vmm_core.memory import address_quarantine, reaper, tagged

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


def test_keys_get_spaces_that_alias_one_set_of_pages(host):
    pool = vmm_core.GraphPool(backend=host)
    firsts = {}
    for key in (8, ("piecewise", 256), 1):
        with pool.space(key) as handle:
            assert handle is not None
            firsts[key] = framework_alloc(2 * MiB)
            pool.keep(firsts[key])
    addresses = list(firsts.values())
    assert len(set(addresses)) == 3, "every key must get its own addresses"
    payload = bytes(range(256)) * 16
    write(firsts[8], payload)
    for address in addresses:  # the same physical bytes through three virtual ranges
        assert read(address, len(payload)) == payload
    stats = pool.stats()
    assert stats["virtual_spaces"] == 3 and stats["physical_bytes"] == 2 * MiB
    assert stats["space_bytes"] == {8: 2 * MiB, ("piecewise", 256): 2 * MiB, 1: 2 * MiB}
    pool.close()


def test_graphs_of_one_space_share_its_framework_pool_sequentially(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(64) as handle:
        piece0_out = framework_alloc(MiB)
        piece1_out = framework_alloc(MiB)  # captured after piece 0, same pool
        pool.keep(piece0_out, piece1_out)
        assert piece1_out == piece0_out + MiB
    with pool.space(2) as other:
        assert other is not handle
    pool.close()


def test_reopening_a_key_continues_in_its_own_space(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space("a"):
        a0 = framework_alloc(MiB)
        pool.keep(a0)
    with pool.space("b"):
        b0 = framework_alloc(3 * MiB)
        pool.keep(b0)
    with pool.space("a", keep=[a0]):  # a lazy engine captures the next piece of "a"
        a1 = framework_alloc(MiB)
        pool.keep(a1)
    alloc = pool.allocator
    a_space = pool.stats()["space_bytes"]
    assert a1 == a0 + MiB, "the reopened space bumps on after its first graph"
    assert alloc.translate(a1, alloc.current_space) == a1
    assert a_space["a"] == 2 * MiB and a_space["b"] == 3 * MiB
    write(a1, b"second piece")
    assert read(alloc.translate(a1, 1), 12) == b"second piece"  # b's space, same page
    assert pool.stats()["entries"] == 3
    pool.close()


def test_kept_tensors_pass_the_guard_and_others_escape(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        out = framework_alloc(MiB)
        pool.keep((out, MiB))
    with pytest.raises(CaptureEscapeError) as err:
        with pool.space(2):
            framework_alloc(MiB)  # an output nobody declared
            framework_alloc(4096)
    msg = str(err.value)
    assert "capture space 2" in msg and "1.00 MiB" in msg and "4096 B" in msg
    assert "keep()" in msg and "warm up" in msg
    with pytest.raises(CaptureError, match="unusable"):
        pool.before_replay(1)
    with pytest.raises(CaptureError, match="unusable"):
        with pool.space(3):
            pass


def test_a_dropped_kept_tensor_does_not_excuse_a_later_block(host):
    """Kept tensors are held weakly: a stale extent must not hide an escape."""
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        address = framework_alloc(MiB)
        view = torch.frombuffer((ctypes.c_char * MiB).from_address(address), dtype=torch.uint8)
        assert view.untyped_storage().data_ptr() == address
        pool.keep(view)
    del view
    gc.collect()
    with pytest.raises(CaptureEscapeError):
        with pool.space(1):
            pass  # the block is still allocated, and nothing alive declares it


def test_failed_capture_is_not_a_guard_error_and_releases_the_lock(host):
    pool = vmm_core.GraphPool(backend=host)
    with pytest.raises(ZeroDivisionError):
        with pool.space(4):
            1 / 0
    with pool.space(4):  # the group lock was released; the space is usable
        pass
    assert pool.poisoned is None


def test_several_pools_on_one_allocator_hold_the_max(host):
    alloc = vmm_core.SharedVMMAllocator(host, tag="graph")
    full = vmm_core.GraphPool(backend=host, allocator=alloc)
    pieces = vmm_core.GraphPool(backend=host, allocator=alloc)
    addresses = []
    for size in (1, 4, 2):
        with full.space(size):
            addresses.append(framework_alloc(size * MiB))
            full.keep(addresses[-1])
        for piece in range(3):
            with pieces.space((size, piece)):
                addresses.append(framework_alloc(size * MiB))
                pieces.keep(addresses[-1])
    assert len(set(addresses)) == len(addresses)
    assert alloc.num_virtual_spaces == 12, "every key of every family has its own space"
    assert alloc.physical_bytes == 4 * MiB, "physical memory is the largest space"
    write(addresses[0], b"family")
    assert read(addresses[-1], 6) == b"family"
    full.close(), pieces.close()
    alloc.close()


def test_pools_on_one_allocator_capture_on_one_stream(host):
    """A warm-up through one family prepares the other's captures: pools on one allocator
    capture on one stream (a second family on a cold stream would put cuBLAS's workspace
    into its first space on a GPU)."""
    alloc = vmm_core.SharedVMMAllocator(host)
    a = vmm_core.GraphPool(backend=host, allocator=alloc)
    b = vmm_core.GraphPool(backend=host, allocator=alloc)
    own = vmm_core.GraphPool(backend=host)
    assert a.capture_stream is b.capture_stream is not None
    assert own.capture_stream is not a.capture_stream
    alloc.close()


def test_an_escape_in_one_family_poisons_the_other(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    a = vmm_core.GraphPool(backend=host, allocator=alloc)
    b = vmm_core.GraphPool(backend=host, allocator=alloc)
    with b.space(1):
        pass
    with pytest.raises(CaptureEscapeError):
        with a.space(1):
            framework_alloc(MiB)
    with pytest.raises(CaptureError, match="unusable"):
        b.before_replay(1)
    alloc.close()


def test_before_replay_refuses_while_asleep_and_maps_lazily_after_wake(host):
    pool = vmm_core.GraphPool(backend=host)
    spaces = {}
    for key in (1, 2, 3):
        with pool.space(key):
            spaces[key] = framework_alloc(MiB)
            pool.keep(spaces[key])
    write(spaces[1], b"zz")
    vmm_core.sleep("graph")
    with pytest.raises(SleepStateError, match=r"wake_up\('graph'\)"):
        pool.before_replay(2)
    with pytest.raises(SleepStateError):
        with pool.space(4):
            pass
    vmm_core.wake_up("graph")
    alloc = pool.allocator
    assert alloc._dormant, "a graph pool's wake maps only the current space"
    pool.before_replay(1)
    assert 0 not in alloc._dormant
    write(spaces[1], b"ok")  # mapped again: writing would fault otherwise
    assert read(spaces[3], 2) == b"ok"
    with pytest.raises(CaptureError, match="no graph was captured"):
        pool.before_replay(99)


def test_replay_refuses_while_memory_it_reads_sleeps(host):
    with vmm_core.region("weights", backend="host") as w:
        weights = w.allocate(MiB)
    write(weights, b"W")
    pool = vmm_core.GraphPool(backend=host)  # default reads: regions alive at capture
    with pool.space(1):
        pass
    explicit = vmm_core.GraphPool(backend=host, tag="other", reads=())
    with explicit.space(1):
        pass
    assert pool.stats()["reads"] == {1: ["weights"]}
    vmm_core.sleep("weights", offload="weights")
    with pytest.raises(SleepStateError, match="memory tagged 'weights'.*wake_up"):
        pool.before_replay(1)
    explicit.before_replay(1)  # told it reads nothing
    vmm_core.wake_up("weights")
    pool.before_replay(1)
    assert read(weights, 1) == b"W"


def test_a_sleep_waits_for_a_replay_in_progress(host, warns_unrouted):
    with warns_unrouted(host, "kv"), vmm_core.region("kv", backend="host"):
        pass
    pool = vmm_core.GraphPool(backend=host, reads=["kv"])
    with pool.space(1):
        pass
    events = []
    inside = threading.Event()

    def sleeper():
        inside.wait(5)
        vmm_core.sleep("kv")
        events.append("slept")

    t = threading.Thread(target=sleeper)
    t.start()
    with pool.replaying(1):
        inside.set()
        t.join(0.2)  # the sleep must be blocked on the held allocator
        events.append("launched")
    t.join(5)
    assert events == ["launched", "slept"]
    with pytest.raises(SleepStateError, match="'kv'"):
        pool.before_replay(1)


def test_launches_on_another_stream_wait_for_the_previous_one(host, monkeypatch):
    pool = vmm_core.GraphPool(backend=host)
    for key in (1, 2):
        with pool.space(key):
            pass
    waits, streams = [], iter(["s1", "s2", "s2"])
    monkeypatch.setattr(pool.ops, "current_stream", lambda: next(streams))
    monkeypatch.setattr(pool.ops, "wait_stream", lambda w, s: waits.append((w, s)))
    pool.before_replay(1)
    pool.before_replay(2)
    pool.before_replay(1)
    assert waits == [("s2", "s1"), ("s2", "s2")]  # same-stream waits are no-ops in ops


def test_bad_arguments_are_explained(host):
    with pytest.raises(ValueError, match="reuse must be one of"):
        vmm_core.GraphPool(backend=host, reuse="magic")
    with pytest.raises(ValueError, match="tag names"):
        vmm_core.GraphPool(backend=host, reads=[""])
    pool = vmm_core.GraphPool(backend=host)
    with pytest.raises(TypeError):
        pool.space(["unhashable"])
    with pytest.raises(CaptureError, match="no space of this pool is open"):
        pool.keep(123)
    with pool.space(1):
        with pytest.raises(TypeError, match="keep\\(\\) takes"):
            pool.keep("not a tensor")
    other = vmm_core.SharedVMMAllocator(host)
    other.close()
    with pytest.raises(VMMError, match="closed"):
        with vmm_core.GraphPool(backend=host, allocator=other).space(1):
            pass


@pytest.mark.parametrize("kwargs, error, match", [
    ({"tag": ""}, ValueError, "tag must be a non-empty string"),
    ({"tag": 5}, ValueError, "tag must be a non-empty string"),
    ({"executables": "lots"}, TypeError, r"executables=\.\.\.\) takes None"),
    ({"reserve_bytes": -1}, vmm_core.AllocationError, "reserve_bytes"),
    ({"reads": 5}, ValueError, "a tag name or a list of tag names"),
    ({"device": "0"}, vmm_core.AllocationError, "device must be a device index"),
    ({"allocator": "mine"}, TypeError, "allocator must be a SharedVMMAllocator"),
])
def test_every_argument_is_refused_before_anything_is_made(host, kwargs, error, match):
    """A pool registers its tag and creates an allocator: a bad value found after that
    would leave them behind."""
    kwargs = {"tag": "checked-first", **kwargs}
    with pytest.raises(error, match=match):
        vmm_core.GraphPool(backend=host, **kwargs)
    assert "checked-first" not in tagged.tags()


def test_a_given_allocator_is_checked_against_the_pool_s_other_arguments(host):
    alloc = vmm_core.SharedVMMAllocator(host, tag="given")
    with pytest.raises(vmm_core.AllocationError, match="pass reserve_bytes to that "
                                                       "SharedVMMAllocator"):
        vmm_core.GraphPool(backend=host, allocator=alloc, reserve_bytes=1 << 20)
    with pytest.raises(VMMError, match="same backend and device"):
        vmm_core.GraphPool(1, backend=host, allocator=alloc)
    with pytest.raises(VMMError, match="one space of its own allocator"):
        vmm_core.GraphPool(backend=host, allocator=alloc, reuse="single")
    alloc.close()
    with pytest.raises(VMMError, match="given a closed allocator"):
        vmm_core.GraphPool(backend=host, allocator=alloc)


@pytest.mark.parametrize("mode, pool", [("shared", "SharedTorchPool"),
                                        ("private", "PrivateTorchPool")])
def test_plain_torch_pool_modes_name_the_benchmark_pool_that_replaced_them(host, mode, pool):
    with pytest.raises(ValueError, match=rf"reuse='{mode}'.*vmm_bench\.torch_pools\.{pool}"
                                         rf".*\('vmm', 'single'\)"):
        vmm_core.GraphPool(backend=host, reuse=mode)
    assert "graph" not in tagged.tags()  # refused before anything was registered


def test_backend_without_graph_pools_falls_back_and_says_so(no_pools_backend):
    with pytest.warns(vmm_core.VMMFallbackWarning, match="one shared pool"):
        pool = vmm_core.GraphPool(backend=no_pools_backend)
    stats = pool.stats()
    assert stats["reuse"] == "shared" and "framework has no MemPool" in stats["fallback"]
    with pool.space(1) as a, pool.space(2) as b:
        assert a is b


def test_a_dropped_pool_gives_its_memory_back(host):
    pool = vmm_core.GraphPool(backend=host, tag="dropped-pool")
    with pool.space(1):
        pool.keep(framework_alloc(MiB))
    alloc = pool.allocator
    del pool
    gc.collect()
    assert reaper.drain()
    assert alloc.closed and alloc.physical_bytes == 0
    assert "dropped-pool" not in tagged.tags()


def test_a_pool_collected_while_a_backend_lock_is_held_does_not_deadlock(host):
    """A dropped pool's finalizer that the collector runs inside the host backend's map (its
    lock held) does not close there, so it cannot deadlock."""
    pool = vmm_core.GraphPool(backend=host, tag="collected")
    alloc = pool.allocator
    cycle = [pool]
    cycle.append(cycle)  # only the cyclic collector frees it
    del pool, cycle

    def collect_inside_a_map():
        with host.plugin._lock:  # as inside vmm_map, where the collector may run
            gc.collect()

    worker = threading.Thread(target=collect_inside_a_map, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "closing inside the collector deadlocked on the backend lock"
    assert reaper.drain()
    assert alloc.closed


def test_handles_merge_when_another_key_replays_not_while_a_key_is_in_use(host):
    """Merging remaps every space: it waits for a switch or the replay of another key
    instead of running after every graph, and it copies, so the space-local tensors of the
    key in use (an attention output written between two pieces) keep their bytes."""
    pool = vmm_core.GraphPool(backend=host)
    with pool.space("a"):
        pool.keep(framework_alloc(MiB))
    with pool.space("b"):
        b = framework_alloc(3 * MiB)  # grows: a second handle
        pool.keep(b)
    alloc = pool.allocator
    assert alloc.num_handles == 2
    write(b, b"written between two pieces of b")
    pool.before_replay("b")
    assert alloc.num_handles == 2, "merged while b's space-local tensors were in use"
    assert read(b, 31) == b"written between two pieces of b"
    pool.before_replay("a")
    assert alloc.num_handles == 1 and alloc.physical_bytes == 3 * MiB
    with pool.space("c"):
        pool.keep(framework_alloc(5 * MiB))
    pool.compact()
    assert alloc.num_handles == 1 and alloc.physical_bytes == 5 * MiB


# ------------------------------------------------------------------ locks and tags awake
def test_holding_tags_awake_then_before_replay_does_not_deadlock_a_replaying_thread(
        host, warns_unrouted):
    with warns_unrouted(host, "weights"), vmm_core.region("weights", backend="host"):
        pass
    pool = vmm_core.GraphPool(backend=host)  # reads "weights" by default
    with warns_unrouted(host):
        for key in (1, 2):
            with pool.space(key):
                pass
    done, barrier = [], threading.Barrier(2, timeout=5)

    def engine():  # the documented pattern: hold the tags, then before_replay
        with tagged.hold_awake(["weights"], backend=host, device=0):
            barrier.wait()
            pool.before_replay(1)
            done.append("engine")

    def other():
        barrier.wait()
        with pool.replaying(2):
            done.append("other")

    threads = [threading.Thread(target=f, daemon=True) for f in (engine, other)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    assert sorted(done) == ["engine", "other"], "deadlocked"


def test_keep_of_a_view_declares_the_whole_block(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        address = framework_alloc(MiB)
        whole = torch.frombuffer((ctypes.c_char * MiB).from_address(address),
                                 dtype=torch.uint8)
        pool.keep(whole[:1024])  # a temporary view: the storage is what stays alive
        pool.keep(whole.detach())
    assert pool.poisoned is None
    del whole


def test_a_second_family_keeps_the_first_familys_allocator_open(host):
    first = vmm_core.GraphPool(backend=host, tag="families")
    second = vmm_core.GraphPool(backend=host, allocator=first.allocator, tag="families")
    with second.space("piece"):
        out = framework_alloc(MiB)
        second.keep(out)
    alloc = first.allocator
    first.close()
    assert not alloc.closed, "closing one family closed the other's pages"
    write(out, b"still mapped")
    second.before_replay("piece")
    del first
    gc.collect()
    assert reaper.drain() and not alloc.closed
    second.close()
    assert alloc.closed and "families" not in tagged.tags()


def test_capturing_a_new_key_keeps_the_bytes_of_kept_tensors(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        pool.keep(framework_alloc(MiB))
    with pool.space(8):
        out8 = framework_alloc(3 * MiB)  # grows: a second handle
        pool.keep(out8)
    write(out8, b"result of batch 8")
    assert pool.allocator.num_handles == 2
    with pool.space(16):  # the switch merges the handles; the bytes come along
        pool.keep(framework_alloc(MiB))
    assert pool.allocator.num_handles == 1
    assert read(out8, 17) == b"result of batch 8"


def test_spaces_of_one_allocator_do_not_nest(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space("a"):
        with pytest.raises(CaptureError, match="do not nest"):
            with pool.space("b"):
                pass
        with pytest.raises(CaptureError, match="do not nest"):
            pool.before_replay("a")
    pool.before_replay("a")


def test_blocks_left_by_a_failed_capture_poison_the_pool_once_the_error_is_handled(host):
    pool = vmm_core.GraphPool(backend=host)
    with pytest.raises(ZeroDivisionError):
        with pool.space(512):
            framework_alloc(MiB)  # a workspace made before the capture failed
            1 / 0
    with pytest.raises(CaptureEscapeError, match="failed capture into the space of 512"):
        with pool.space(256):
            pass
    with pytest.raises(CaptureError, match="unusable"):
        pool.before_replay(512)


def test_the_reaper_works_in_a_forked_child(host):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child():
        pool = vmm_core.GraphPool(backend=host, tag="forked")
        alloc = pool.allocator
        del pool
        gc.collect()
        queue.put((reaper.drain(5), alloc.closed))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and queue.get(timeout=5) == (True, True)


def _exit_script(tmp_path, name: str, text: str, *args: str):
    """Run ``text`` as a script of its own to its interpreter exit; returns the process,
    after checking it exited 0 (an abort at exit is the defect these tests pin)."""
    import subprocess
    import sys

    script = tmp_path / f"{name}.py"
    script.write_text(text)
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _teardown_at_exit(before_cpp_call: str = "", imports: str = "") -> str:
    """A script whose main returns while the reaper runs a teardown that ends inside a
    C++ call with the GIL released (as a CUDA give-back waits in a device synchronize);
    ``before_cpp_call`` runs in the teardown first."""
    body = "".join(f"    {line}\n" for line in before_cpp_call.strip().splitlines())
    return f"""{imports}
import torch
from vmm_core.memory import reaper

a = torch.randn(512, 512)

def teardown():
{body}    for _ in range(200):
        torch.mm(a, a)
    print("teardown finished", flush=True)

reaper.start()
reaper.close_later(teardown)
print("main returns", flush=True)
"""


_EXIT_WHILE_TEARING_DOWN = _teardown_at_exit()


def test_exit_waits_for_a_teardown_inside_a_cpp_call(tmp_path):
    """A pool dropped just before exit gives its memory back on the daemon reaper, inside
    torch.cuda.synchronize, while the interpreter finalizes; were Python to end that thread
    with pthread_exit, the unwind through torch's binding would abort the process
    ("terminate called without an active exception"). Exit lets the queued teardown finish
    first."""
    proc = _exit_script(tmp_path, "exit_during_teardown", _EXIT_WHILE_TEARING_DOWN)
    assert proc.stdout.split() == "main returns teardown finished".split()
    assert "terminate called" not in proc.stderr


_CTRL_C_WHILE_EXIT_WAITS = _teardown_at_exit(
    # Python's own Ctrl-C handler, as at a terminal: a process started from a shell's
    # background job (a CI runner's, say) inherits SIGINT ignored
    imports="import signal\nimport threading\nimport time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)",
    before_cpp_call="""
while not reaper._exiting:  # exit is waiting for this teardown now
    time.sleep(0.01)
signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # Ctrl-C
""")


def test_one_ctrl_c_while_exit_waits_for_a_teardown_does_not_abort(tmp_path):
    """Ctrl-C while exit waits for a teardown inside a C++ call does not leave the wait at
    once, which would abort the process ("terminate called without an active exception", the
    crash the wait is there to avoid). One Ctrl-C keeps waiting and says why; a second one
    leaves."""
    proc = _exit_script(tmp_path, "ctrl_c_while_exit_waits", _CTRL_C_WHILE_EXIT_WAITS)
    assert proc.stdout.split() == "main returns teardown finished".split()
    assert "Press Ctrl-C again to stop waiting" in proc.stderr


_EXIT_INSIDE_AN_OPEN_BLOCK = """
import vmm_core
from vmm_core.memory import reaper

reaper.EXIT_TIMEOUT_S = 20.0  # the wait a held lock would cost (60 s by default)
host = vmm_core.get_backend("host")
kept = vmm_core.GraphPool(backend=host, tag="kept")

def steps():
    with kept.space(1):  # a capture block left open by a suspended generator
        yield

held = steps()
next(held)
dropped = vmm_core.GraphPool(backend=host, tag="dropped")
with dropped.space(1):
    pass
del dropped  # its give-back needs the lock this thread holds
print("main returns", flush=True)
"""


def test_exit_does_not_wait_for_a_lock_the_exiting_thread_holds(tmp_path):
    """A pool dropped just before exit while the main thread still holds the tagged-memory
    lock (an open capture block in a suspended generator): its give-back could only run once
    finalization released the lock, so exit skips it instead of waiting the whole timeout
    (60 s), and the warning names the open block."""
    proc = _exit_script(tmp_path, "exit_inside_an_open_block", _EXIT_INSIDE_AN_OPEN_BLOCK)
    assert proc.stdout.split() == ["main", "returns"]
    assert "still running" not in proc.stderr, proc.stderr[-2000:]
    assert "block left open" in proc.stderr


#: an engine's daemon thread idle, for good, inside a block holding the tagged-memory lock
_DAEMON_HOLDS_THE_LOCK = """
requests, holding = queue.Queue(), threading.Event()

def serve():  # an engine's daemon loop, idle inside a block that holds the lock
    with tagged.state_lock():
        holding.set()
        requests.get()

threading.Thread(target=serve, daemon=True).start()
holding.wait(10)
"""

_EXIT_WHILE_A_DAEMON_HOLDS_THE_LOCK = """
import queue
import threading

import vmm_core
from vmm_core.memory import reaper, tagged

reaper.EXIT_TIMEOUT_S = 20.0  # the wait a held lock would cost (60 s by default)
host = vmm_core.get_backend("host")
dropped = vmm_core.GraphPool(backend=host, tag="dropped")
with dropped.space(1):
    pass
""" + _DAEMON_HOLDS_THE_LOCK + """
# its give-back needs the lock the daemon never lets go
del dropped
print("main returns", flush=True)
"""


def test_exit_does_not_wait_for_a_lock_a_daemon_thread_holds(tmp_path):
    """A daemon thread that holds the tagged-memory lock at exit (idle inside a block) does
    not make exit wait the whole timeout for a dropped pool's give-back: waiting for a lock
    is safe to leave, so exit skips that give-back and says so."""
    proc = _exit_script(tmp_path, "exit_while_a_daemon_holds_the_lock",
                        _EXIT_WHILE_A_DAEMON_HOLDS_THE_LOCK)
    assert proc.stdout.split() == ["main", "returns"]
    assert "still running" not in proc.stderr, proc.stderr[-2000:]
    assert "it is not given back" in proc.stderr


_EXIT_WHILE_A_DAEMON_HOLDS_THE_LOCK_MAPPED = """
import queue
import sys
import threading

import torch.distributed as dist
import vmm_core
from vmm_core.distributed import mapped_memory
from vmm_core.memory import reaper, tagged

reaper.EXIT_TIMEOUT_S = 20.0  # the wait a held lock would cost (60 s by default)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mem = mapped_memory(4, 4096, kind="distributed", backend=vmm_core.get_backend("host"),
                    tag="rows")
""" + _DAEMON_HOLDS_THE_LOCK + """
# its release untags, which needs the lock the daemon never lets go
del mem
print("main returns", flush=True)
"""


def test_exit_does_not_wait_for_the_untag_of_a_dropped_mapped_memory(tmp_path):
    """The same holds for a dropped tagged mapped memory: its release does not wait the
    whole exit timeout for the tagged-memory lock before its untag."""
    proc = _exit_script(tmp_path, "exit_while_a_daemon_holds_the_lock_mapped",
                        _EXIT_WHILE_A_DAEMON_HOLDS_THE_LOCK_MAPPED, str(tmp_path / "store"))
    assert proc.stdout.split() == ["main", "returns"]
    assert "still running" not in proc.stderr, proc.stderr[-2000:]


def test_exit_stops_the_reaper_for_good():
    """After exit has joined the thread, nothing starts a new daemon (which would be the
    same crash) and drain() says that nothing runs any more."""
    state = (reaper._thread, reaper._queue, reaper._exiting)
    try:
        reaper.start()
        reaper._stop_at_exit(timeout=10)
        assert not reaper._thread.is_alive()
        reaper.start()
        assert not reaper._thread.is_alive()
        assert reaper.drain(0.1) is False
    finally:
        reaper._thread, reaper._queue, reaper._exiting = state
        reaper.start()


def test_a_closed_pool_says_so(host):
    pool = vmm_core.GraphPool(backend=host)
    with pool.space(1):
        pass
    pool.close()
    pool.close()
    with pytest.raises(CaptureError, match="was closed"):
        pool.before_replay(1)


def test_a_capture_space_waits_for_a_kept_copy_still_registering(host):
    """A device capture in global mode refuses cudaHostRegister from any thread: a kept
    host copy that registers in the background must be done before a space opens."""
    import threading
    import time

    from vmm_core.testing import FaultInjector

    registered = threading.Event()

    class SlowRegister(FaultInjector):
        def host_register(self, device, address, size):
            time.sleep(0.5)  # page-locking a large copy takes a while
            out = self._real.host_register(device, address, size)
            registered.set()
            return out

    alloc = vmm_core.SharedVMMAllocator(host, tag="w", growth_bytes=MiB)
    tagged.register("w", alloc)
    alloc.backend = SlowRegister(alloc.backend)
    p = alloc.allocate(2 * MiB)
    write(p, b"\x05" * 64)
    vmm_core.sleep("w", offload="w")  # the copy it leaves registers in the background
    pool = vmm_core.GraphPool(backend=host, reads=())
    try:
        with pool.space(1):
            assert registered.is_set(), "a capture opened while a host copy registered"
        vmm_core.wake_up("w")
        assert read(p, 64) == b"\x05" * 64
    finally:
        pool.close()
        alloc.close()


def test_a_dropped_pool_on_a_shared_allocator_gives_its_spaces_back(host):
    """A pool dropped without close() on an allocator it was given gives its spaces (address
    ranges and their mappings) back, as one on its own allocator does, instead of keeping
    them claimed for the life of that allocator."""
    alloc = vmm_core.SharedVMMAllocator(host, tag="families")
    try:
        stays = vmm_core.GraphPool(allocator=alloc, tag="full")
        with stays.space("full-8"):
            stays.keep(framework_alloc(MiB))
        before = alloc.num_virtual_spaces
        dropped = vmm_core.GraphPool(allocator=alloc, tag="pieces")
        for key in (1, 2, 3):
            with dropped.space(key):
                dropped.keep(framework_alloc(MiB))
        assert alloc.num_virtual_spaces > before
        del dropped
        gc.collect()
        assert reaper.drain()
        assert alloc.num_virtual_spaces <= before + 1  # at most the allocator's current one
        assert "pieces" not in tagged.tags() and not alloc.closed
        # the pool that stays still captures and replays on its own spaces
        stays.before_replay("full-8")
        with stays.space("full-16"):
            stays.keep(framework_alloc(MiB))
        stays.close()
    finally:
        alloc.close()


def test_pools_closed_or_dropped_one_after_another_leave_no_space_behind(host):
    """The space that is the allocator's current one when a pool is closed or dropped cannot
    be released then; it is released later, so a family made and closed again and again (a
    model reload, an RL round) leaves no space (a reserved address range with every handle
    mapped into it) behind per round."""
    alloc = vmm_core.SharedVMMAllocator(host, tag="families")
    try:
        stays = vmm_core.GraphPool(allocator=alloc, tag="full")
        with stays.space("full-8"):
            stays.keep(framework_alloc(MiB))
        for round_ in range(6):
            pool = vmm_core.GraphPool(allocator=alloc, tag="pieces")
            for key in (1, 2):
                with pool.space(key):
                    pool.keep(framework_alloc(MiB))
            if round_ % 2:
                pool.close()
            del pool
            gc.collect()
            assert reaper.drain()
            assert alloc.num_virtual_spaces <= 2, f"round {round_}: {alloc.space_indices()}"
        # the one left over goes once another space is current
        with stays.space("full-8"):
            pass
        assert alloc.num_virtual_spaces == 1
        stays.before_replay("full-8")
        stays.close()
    finally:
        alloc.close()


class _FailingRelease:
    """Make the next ``release_range`` of an allocator's backend fail, as an unmap the
    driver refuses does."""

    def __init__(self, alloc) -> None:
        from vmm_core.testing import FaultInjector

        class Failing(FaultInjector):
            def release_range(self, device, address, size):
                if not failed:
                    failed.append(address)
                    raise vmm_core.errors.MappingError("injected: release_range failed")
                return self._real.release_range(device, address, size)

        failed: list = []
        self.failed = failed
        alloc.backend = Failing(alloc.backend)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_failed_give_back_still_gives_the_pool_s_use_of_the_allocator_back(host, how,
                                                                            caplog):
    """An error in the give-back (a device error in the synchronize, an unmap the driver
    refuses) does not skip the rest: the pool's use of the allocator still goes back (its
    tag is no longer registered, so later sleeps of all tags do not take it) and an
    allocator the pool created is closed, when the reaper runs the give-back too."""
    shared = vmm_core.SharedVMMAllocator(host, tag="families")
    try:
        stays = vmm_core.GraphPool(allocator=shared, tag="full")
        with stays.space(0):
            stays.keep(framework_alloc(MiB))
        pieces = vmm_core.GraphPool(allocator=shared, tag="pieces")
        own = vmm_core.GraphPool(backend=host, tag="own")
        for pool in (pieces, own):
            for key in (1, 2):
                with pool.space(key):
                    pool.keep(framework_alloc(MiB))
        owned = own.allocator
        injected = [_FailingRelease(shared), _FailingRelease(owned)]
        if how == "close":
            # a range whose release fails is held back and tried again before the next
            # reservation (vmm_core.memory.address_quarantine), with a warning
            for pool in (pieces, own):
                pool.close()
        del pieces, own, pool
        gc.collect()
        assert reaper.drain()
        assert all(i.failed for i in injected)
        assert "injected: release_range failed" in caplog.text
        held = set(address_quarantine.held_back(0))
        assert {i.failed[0] for i in injected} <= {base for base, _ in held}
        assert "pieces" not in tagged.tags() and "own" not in tagged.tags()
        assert owned.closed, "the allocator the dropped pool created stayed open"
        assert stays._group.users == 1 and not shared.closed
        stays.close()
        assert stays._group.users == 0
    finally:
        shared.close()


def test_a_pool_dropped_after_a_failed_capture_is_collected(host):
    """Blocks a failed capture left alive put the pool on its group's list to re-check; that
    list does not keep the pool alive: dropped, it is collected (its spaces given back, an
    allocator it created closed) whether another pool of the group runs or not."""
    import weakref

    pool = vmm_core.GraphPool(backend=host, tag="failed")
    with pytest.raises(ZeroDivisionError):
        with pool.space(512):
            framework_alloc(MiB)  # a workspace made before the capture failed
            1 / 0
    alloc, ref = pool.allocator, weakref.ref(pool)
    del pool
    gc.collect()
    assert reaper.drain()
    assert ref() is None, "the dropped pool is still alive"
    assert alloc.closed and "failed" not in tagged.tags()


def test_a_pool_made_while_the_reaper_closes_its_allocator_is_refused_at_once(host,
                                                                             monkeypatch):
    """The allocator a dropped pool created is closed by the reaper with the last pool on
    it; a new pool given that allocator counts itself a user before the adapter's setup, so
    a reaper closing it in between refuses the new pool at once instead of leaving it built
    on a closed allocator whose first capture blames "its owner"."""
    first = vmm_core.GraphPool(backend=host, tag="first")
    alloc, adapter_type = first.allocator, type(first.adapter)
    gate = threading.Event()
    reaper.start()
    reaper.close_later(gate.wait, 10)  # the reaper is busy while the pool is dropped
    del first
    gc.collect()
    setup = adapter_type.prepare

    def prepare(self):  # the reaper gets to the queued give-back now
        gate.set()
        assert reaper.drain()
        return setup(self)

    monkeypatch.setattr(adapter_type, "prepare", prepare)
    with pytest.raises(VMMError, match="closed allocator.*create the SharedVMMAllocator"):
        vmm_core.GraphPool(allocator=alloc, tag="second")
    assert alloc.closed and "second" not in tagged._registry
