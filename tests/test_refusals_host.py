"""What memory/, the registry and fork refuse, and what a refusal leaves, on the host
backend: every size checked before a system call, forks while another thread makes an
allocator or discovers backends, refused calls that change nothing, calls of every tag
while another thread closes an unrelated allocator, and a tag registry that forgets
closed allocators.

A crash runs in a child interpreter and a hang in a forked child, each with a timeout, so
either fails its test instead of the run.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from host_space import framework_alloc
from proc_state import mem_available, run_python

import vmm_core
from vmm_core.errors import (
    BackendNotFoundError,
    CaptureError,
    CaptureEscapeError,
    OutOfMemoryError,
    SleepStateError,
    VMMError,
)
from vmm_core.memory import offload, tagged

MiB = 1 << 20
PAGE = 4096
pytestmark = pytest.mark.usefixtures("clean_tags")


# ------------------------------------------------------------------ sizes
def test_offload_prepare_of_more_than_size_t_is_refused_not_a_segfault():
    """prepare(2**64) would wrap to a 2 MiB mapping on its way to mmap, which the copy
    threads would then fill as if it held 2**64 bytes: a segfault. Every byte count goes
    through the bound Backend.call uses, so it is refused with OutOfMemoryError, as
    prepare(2**63) is."""
    proc = run_python("""
        import numpy as np
        from vmm_core.errors import OutOfMemoryError
        from vmm_core.memory import offload
        for what in (2**64, np.uint64(2**64 - 1), 2**63):
            try:
                offload.prepare(what, backend="host")
            except OutOfMemoryError as exc:
                assert "offload.prepare" in str(exc), exc
            else:
                raise SystemExit(f"prepare({what!r}) was accepted")
        assert offload.prepared_bytes() == 0 and offload.staging_bytes() == 0
        print("refused")
    """, timeout=60, env=dict(os.environ, VMM_CORE_BACKEND="host"))
    assert proc.returncode == 0 and "refused" in proc.stdout, \
        f"exit {proc.returncode} (negative: a signal): {proc.stderr[-2000:]}"


def test_a_staging_ring_past_the_bound_is_refused_by_configure():
    with pytest.raises(ValueError, match="staging ring"):
        offload.configure(chunk_bytes=2**62, slots=4)
    assert offload.config().chunk_bytes == 32 << 20, "a refused configure changes nothing"


def test_a_host_copy_larger_than_the_machine_is_refused_before_it_is_mapped(host):
    """Mapped lazily, a copy larger than the machine's memory would be taken page by page by
    the copy threads until the OOM killer came. Nothing is mapped or touched here: the
    refusal comes from /proc/meminfo's MemAvailable, before mmap."""
    asked = mem_available() + (1 << 30)
    with pytest.raises(OutOfMemoryError) as err:
        offload.prepare(asked, backend=host)
    text = str(err.value)
    assert str(asked) in text and "MemAvailable" in text, text
    assert offload.prepared_bytes() == 0


# ------------------------------------------------------------------ fork
def _fork_and_run(work, hung: str, timeout: float = 10.0) -> None:
    """Fork now; the child runs ``work()`` on a thread and exits 0 if it returned in
    ``timeout`` seconds, 3 if it hung, 4 if it raised (printing the error)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            outcome: list = []

            def run():
                try:
                    work()
                    outcome.append(None)
                except BaseException as exc:  # noqa: BLE001 - reported by the exit code
                    outcome.append(exc)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(timeout)
            if not outcome:
                code = 3
            elif outcome[0] is not None:
                os.write(2, f"child: {type(outcome[0]).__name__}: {outcome[0]}\n".encode())
                code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code != 3, f"the forked child hung {hung}"
    assert code == 0, f"the forked child failed (exit {code}) {hung}"


class _ForkStarted:
    """Set when a fork begins: registered before vmm_core's fork hooks run (hooks run in
    reverse order of registration, so this one runs first), armed by one test at a time."""

    event: threading.Event | None = None

    @classmethod
    def arm(cls) -> threading.Event:
        if not getattr(cls, "_registered", False):
            os.register_at_fork(before=cls._before)
            cls._registered = True
        cls.event = threading.Event()
        return cls.event

    @classmethod
    def _before(cls) -> None:
        if cls.event is not None:
            cls.event.set()
            cls.event = None


def test_an_allocator_made_while_a_fork_waits_is_not_forked_with_its_lock_held(host):
    """An allocator another thread makes while the fork hook waits for the tagged-memory
    lock, and goes on using, is covered by the hook too: it is not forked with its lock
    held, and the child's first calls on it return."""
    forking = _ForkStarted.arm()
    made: list = []
    held = threading.Event()

    def holder():  # keeps the fork waiting for the tagged-memory lock a while
        with tagged.state_lock():
            held.set()
            time.sleep(0.5)

    def maker():  # makes an allocator once the fork waits, and uses it across the fork
        assert forking.wait(10)
        time.sleep(0.1)  # the fork hook has listed what was there and now waits
        alloc = vmm_core.SharedVMMAllocator(host, reserve_bytes=1 << 20)
        made.append(alloc)
        with alloc._lock:  # what a direct alloc.sleep(offload=True) holds for its copy
            time.sleep(1.0)

    threads = [threading.Thread(target=holder), threading.Thread(target=maker)]
    threads[0].start()
    assert held.wait(5)
    threads[1].start()

    def child():
        assert made, "the allocator was made during the fork's wait"
        made[0].allocate(PAGE)
        made[0].sleep()
        made[0].wake()

    try:
        _fork_and_run(child, "on an allocator made while the fork waited")
    finally:
        for thread in threads:
            thread.join(10)
        for alloc in made:
            alloc.close()


def test_a_fork_during_the_first_backend_discovery_gives_the_child_every_backend(
        monkeypatch):
    """A child forked while another thread ran the first discovery got the registry half
    filled: "no vmm_core backend named 'host'; registered backends: none" (30 of 30)."""
    import importlib.metadata

    from vmm_core import registry

    real = importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)
    loading = threading.Event()

    class SlowEntryPoint:  # a plugin whose import takes a while (a vendor library)
        def __init__(self, ep):
            self.ep, self.name, self.value = ep, ep.name, ep.value

        def load(self):
            loading.set()
            time.sleep(0.1)
            return self.ep.load()

    saved = registry._default
    registry.reset(registry.BackendRegistry(entry_points=[SlowEntryPoint(ep) for ep in real]))
    try:
        thread = threading.Thread(target=vmm_core.available_backends)
        thread.start()
        assert loading.wait(10)

        def child():
            assert vmm_core.get_backend("host").name == "host"
            assert set(vmm_core.default_registry().names()) == {ep.name for ep in real}

        _fork_and_run(child, "in the backend discovery")
        thread.join(10)
        with pytest.raises(BackendNotFoundError):  # the parent's registry is whole too
            vmm_core.default_registry().get("no-such-backend")
        assert "host" in vmm_core.default_registry().names()
    finally:
        registry.reset(saved)


def test_a_fork_does_not_stall_on_a_capture_block_that_looks_a_backend_up():
    """The allocators' fork hook takes the tagged-memory lock before the registry's: a
    thread holding that lock (a capture block) that then looks a backend up would otherwise
    wait for the registry while the fork waits for it, and the fork would stall for all of
    FORK_WAIT_SECONDS (10 s) before going on without the locks."""
    from vmm_core import registry

    saved = registry._default
    registry.reset(registry.BackendRegistry())  # its first lookup loads the plugins
    held = threading.Event()

    def capture_block():
        with tagged.state_lock():
            held.set()
            time.sleep(0.3)
            vmm_core.get_backend("host")

    thread = threading.Thread(target=capture_block)
    thread.start()
    try:
        assert held.wait(5)
        start = time.monotonic()
        _fork_and_run(lambda: vmm_core.get_backend("host"), "after a capture block")
        assert time.monotonic() - start < 5, "the fork waited for a lock cycle to time out"
    finally:
        thread.join(10)
        registry.reset(saved)


# ------------------------------------------------------------------ refused calls
def test_offload_prepare_of_tags_one_of_them_asleep_prepares_none(host):
    """prepare(["a", "b"]) with "b" asleep raises before it pins anything: no host copy of
    "a" is held."""
    for tag in ("a", "b"):
        with vmm_core.region(tag, backend=host, reserve_bytes=4 * MiB) as alloc:
            alloc.allocate(MiB)
    vmm_core.sleep("b")
    with pytest.raises(SleepStateError) as err:
        offload.prepare(["a", "b"])
    summary = vmm_core.memory_summary()
    assert summary["a"]["host_bytes"] == 0 and summary["b"]["host_bytes"] == 0, summary
    assert "wake_up('b')" in str(err.value) and "nothing was prepared" in str(err.value)
    with pytest.raises(ValueError, match="tag names"):
        offload.prepare(["a", 7])
    offload.prepare(["a"])  # the same call without the sleeping tag works
    assert vmm_core.memory_summary()["a"]["host_bytes"] == MiB


def test_offload_prepare_counts_the_copies_it_replaces_as_room(host, monkeypatch):
    """prepare(tags) replaces a tag's unpinned copy (freed first), so the room it checks
    counts that copy as free, and what fits is not refused. The room here is 3 MiB less the
    copies held."""
    from vmm_core.memory import host_memory

    def room():
        held = sum(c.held_bytes for c in list(host_memory._mapped_copies))
        return 3 * MiB - held, 3 * MiB, 0

    with vmm_core.region("a", backend=host, reserve_bytes=4 * MiB) as alloc:
        alloc.allocate(2 * MiB)
    with offload.configured(pin_kept=False):  # the kept copy stays pageable
        vmm_core.sleep("a", offload=["a"])
        vmm_core.wake_up("a")
        assert alloc.host_bytes == 2 * MiB and alloc.pinned_host_bytes == 0
        monkeypatch.setattr(host_memory, "host_room", room)
        offload.prepare(["a"])  # 2 MiB new, 2 MiB freed first: it fits
    assert alloc.host_bytes == 2 * MiB


def test_sleep_and_wake_of_every_tag_skip_an_allocator_closed_under_them(host):
    """vmm_core.wake_up() and sleep() of every tag while another thread closes an unrelated
    region's allocator (the README's own alloc.close() pattern) skip the closed allocator:
    they neither raise "the SharedVMMAllocator is closed" nor leave "weights" asleep."""
    with vmm_core.region("weights", backend=host, reserve_bytes=MiB) as weights:
        address = weights.allocate(PAGE)
    stop = threading.Event()
    churned = [0]

    def churn():
        while not stop.is_set():
            try:
                with vmm_core.region("scratch", backend=host, reserve_bytes=MiB) as scratch:
                    scratch.allocate(PAGE)
            except SleepStateError:  # a sleep of every tag took "scratch" too: refused
                continue             # until the next wake_up, as any sleeping tag is
            scratch.close()
            churned[0] += 1

    thread = threading.Thread(target=churn)
    thread.start()
    failures, rounds = [], 0
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            rounds += 1
            for verb, call in (("sleep", lambda: vmm_core.sleep(offload=["weights"])),
                               ("wake_up", vmm_core.wake_up)):
                try:
                    call()
                except VMMError as exc:
                    failures.append(f"{verb}: {exc}")
                if weights.asleep != (verb == "sleep"):
                    failures.append(f"after {verb} 'weights' is "
                                    f"{'asleep' if weights.asleep else 'awake'}")
    finally:
        stop.set()
        thread.join(10)
    assert churned[0] > 10 and rounds > 10, (churned, rounds)
    assert not failures, f"{len(failures)} of {rounds} rounds: {failures[:3]}"
    weights.wake()
    assert weights.live_allocations() == {address: PAGE}


def test_a_tag_closed_and_reopened_leaves_nothing_in_the_registry(host):
    """Every close-then-reopen of a tag left the closed allocator in the tag registry
    (about 1.5 KB per cycle; 2000 after 2000 cycles): an RL job reopens tags every step."""
    for _ in range(200):
        with vmm_core.region("kv", backend=host, reserve_bytes=MiB) as alloc:
            alloc.allocate(PAGE)
        alloc.close()
    with vmm_core.region("kv", backend=host, reserve_bytes=MiB) as alloc:
        alloc.allocate(PAGE)
    assert tagged._registry["kv"] == [alloc]
    alloc.close()
    assert "kv" not in vmm_core.memory_summary()
    assert tagged.tags() == [] and "kv" not in tagged._registry


# ------------------------------------------------------------------ messages
def test_sleep_offload_true_is_explained(host):
    with vmm_core.region("weights", backend=host, reserve_bytes=MiB) as alloc:
        alloc.allocate(PAGE)
    for bad in (True, 5, ["weights", 3]):
        with pytest.raises(VMMError, match="offload must be a tag name or a list"):
            vmm_core.sleep(offload=bad)
    assert not alloc.asleep


def test_graph_pool_reads_that_are_not_tags_are_explained(host):
    with pytest.raises(ValueError, match="reads must be a tag name or a list"):
        vmm_core.GraphPool(backend=host, reads=5)


def test_wake_up_keep_host_buffers_is_checked_with_no_tag_to_wake():
    """keep_host_buffers is checked by wake_up itself, not only by an allocator's wake: with
    nothing tagged, "yes" is refused too."""
    assert tagged.tags() == []
    with pytest.raises(ValueError, match="keep_host_buffers"):
        vmm_core.wake_up(keep_host_buffers="yes")


@pytest.mark.parametrize("bad", [-5, (0, -5), (-1, 16)])
def test_keep_refuses_negative_addresses_and_extents(host, bad):
    pool = vmm_core.GraphPool(backend=host)
    with pytest.raises(ValueError, match="keep"):
        with pool.space(1):
            pool.keep(bad)
    # a refused keep() of several keeps none of them: the good block escapes
    with pytest.raises(CaptureEscapeError, match="4096 B"):
        with pool.space(2):
            block = framework_alloc(PAGE)
            with pytest.raises(ValueError, match="keep"):
                pool.keep(block, bad)
    pool.close()


def test_the_wake_log_counts_an_allocator_under_two_tags_once(host, caplog):
    """The wake log counted one 512 MiB allocator under two tags as "1.00 GiB of tagged
    memory in use"."""
    alloc = vmm_core.SharedVMMAllocator(host)
    alloc.extend_mapping(512 * MiB)  # memfd pages are not touched: no real memory
    tagged.register("full", alloc)
    tagged.register("pieces", alloc)
    vmm_core.sleep(["full", "pieces"])
    with caplog.at_level(logging.INFO, logger="vmm_core"):
        vmm_core.wake_up()
    assert "512.00 MiB of tagged memory in use" in caplog.text, caplog.text


def test_a_poisoned_allocator_is_usable_again_once_the_escaped_blocks_are_gone(host):
    """A new pool on a poisoned allocator the user created is refused with an error that
    says how to recover; once the escaped block is freed the pools work again, old and new,
    with no new allocator needed."""
    alloc = vmm_core.SharedVMMAllocator(host)
    first = vmm_core.GraphPool(backend=host, allocator=alloc)
    with pytest.raises(CaptureEscapeError):
        with first.space(1):
            escaped = framework_alloc(MiB)
    second = vmm_core.GraphPool(backend=host, allocator=alloc, tag="second")
    with pytest.raises(CaptureError, match="usable again") as err:
        with second.space(1):
            pass
    assert "free them" in str(err.value)
    alloc.deallocate(escaped)  # what the framework's free of the escaped tensor does
    assert second.poisoned is None
    with second.space(1):
        kept = framework_alloc(MiB)
        second.keep(kept)
    second.before_replay(1)
    with first.space(2):
        pass
    first.close(), second.close()
    alloc.close()


def test_closing_the_pool_of_an_escape_lifts_the_poison_for_a_new_pool(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    first = vmm_core.GraphPool(backend=host, allocator=alloc)
    with pytest.raises(CaptureEscapeError):
        with first.space(1):
            framework_alloc(MiB)  # never freed
    first.close()  # its spaces go back: the block aliases no later space
    second = vmm_core.GraphPool(backend=host, allocator=alloc)
    with second.space(7):
        pass
    second.before_replay(7)
    second.close()
    alloc.close()


def test_a_dropped_pool_of_an_escape_lifts_the_poison_only_once_its_spaces_went_back(host):
    """A dropped pool gives its spaces back on the reaper thread, later; until then the
    escaped block still shares pages with every new space, so the poison holds until the
    give-back has run."""
    import gc

    from vmm_core.memory import reaper

    alloc = vmm_core.SharedVMMAllocator(host)
    first = vmm_core.GraphPool(backend=host, allocator=alloc)
    with pytest.raises(CaptureEscapeError):
        with first.space(1):
            framework_alloc(MiB)
    second = vmm_core.GraphPool(backend=host, allocator=alloc, tag="second")
    with tagged.state_lock():  # the reaper's give-back waits for this lock
        del first
        gc.collect()
        time.sleep(0.1)
        assert second.poisoned, "lifted before the dropped pool's spaces went back"
    assert reaper.drain(10)
    assert second.poisoned is None
    with second.space(1):
        pass
    second.close()
    alloc.close()


def test_an_escape_that_is_still_alive_keeps_every_pool_refusing(host):
    alloc = vmm_core.SharedVMMAllocator(host)
    first = vmm_core.GraphPool(backend=host, allocator=alloc)
    with pytest.raises(CaptureEscapeError):
        with first.space(1):
            framework_alloc(MiB)
    second = vmm_core.GraphPool(backend=host, allocator=alloc, tag="second")
    for pool in (first, second):
        with pytest.raises(CaptureError, match="unusable"):
            with pool.space(3):
                pass
        assert pool.poisoned
    alloc.close()

