"""Run a function on N local ranks of a fresh ``torch.distributed`` group, for tests.

Each rank is a process forked from a forkserver that has already imported torch, so a
rank starts in tens of milliseconds instead of re-importing torch.  The group meets
through a FileStore in a temporary directory.  Every rank sends back its return value
or its exception; the whole run has a hard deadline after which the ranks still alive
are killed, and the temporary directory is always removed.  Nothing here initializes
an accelerator in the parent, so ranks may use one (``before_init`` selects it).

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled by
name) and return something picklable.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass

__all__ = ["RankResult", "run_ranks", "check_ranks"]

_PRELOAD = ["torch", "torch.distributed", "vmm_core"]


@dataclass
class RankResult:
    rank: int
    exitcode: int | None = None
    value: object = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    finished: bool = False  # the rank reported (a value or an error) before the deadline

    @property
    def ok(self) -> bool:
        return self.finished and self.error_type is None


def _rank_main(fn, rank, world, store_path, backend, group_timeout, env, before_init, args,
               conn) -> None:
    os.environ.update(env or {})
    try:
        if before_init is not None:
            before_init(rank)
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=group_timeout))
        try:
            value = fn(rank, world, *args)
        except BaseException as exc:
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))
        else:
            conn.send(("ok", value))
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    except BaseException as exc:  # setup failed: still report, never hang the parent
        conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))
    finally:
        conn.close()


def run_ranks(fn, world_size: int, *, args: tuple = (), backend: str = "gloo",
              timeout: float = 60.0, group_timeout: float = 20.0, env: dict | None = None,
              before_init=None) -> list[RankResult]:
    """Run ``fn`` on ``world_size`` ranks; returns one :class:`RankResult` per rank.

    ``timeout`` bounds the whole run: ranks that have not reported by then are killed
    (their result says so).  ``group_timeout`` is the process group's own timeout.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    tmp = tempfile.mkdtemp(prefix="vmm_core_ranks_")
    store = os.path.join(tmp, "store")
    procs, conns = [], []
    results = [RankResult(rank) for rank in range(world_size)]
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, name=f"vmm_core-rank{rank}",
                               args=(fn, rank, world_size, store, backend, group_timeout,
                                     env, before_init, args, child_end), daemon=True)
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                conn = conns[rank]
                try:
                    ready = conn.poll(0.05)
                except (EOFError, OSError):
                    ready = True
                if not ready and procs[rank].is_alive():
                    continue
                pending.discard(rank)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    results[rank].error_type = "RankDied"
                    results[rank].error = "the rank exited without reporting"
                    continue
                results[rank].finished = True
                if message[0] == "ok":
                    results[rank].value = message[1]
                else:
                    _, results[rank].error_type, results[rank].error, \
                        results[rank].traceback = message
        for rank in pending:
            results[rank].error_type = "Timeout"
            results[rank].error = f"no report within {timeout:.0f} s: killed"
    finally:
        grace = time.monotonic() + 5.0
        for proc in procs:
            proc.join(max(0.0, grace - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for rank, proc in enumerate(procs):
            results[rank].exitcode = proc.exitcode
            if proc.exitcode is not None:
                proc.close()
        for conn in conns:
            conn.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def check_ranks(results: list[RankResult]) -> list:
    """The ranks' return values; raises AssertionError with every failure's traceback."""
    bad = [r for r in results if not r.ok]
    if bad:
        lines = [f"rank {r.rank} (exit {r.exitcode}): {r.error_type}: {r.error}\n"
                 f"{r.traceback or ''}" for r in bad]
        raise AssertionError("ranks failed:\n" + "\n".join(lines))
    return [r.value for r in results]
