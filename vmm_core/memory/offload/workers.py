"""The thread pool every offload thread runs in: the copy threads, the thread that
page-locks kept copies, the one that makes host copies ahead.

``ThreadPoolExecutor.submit`` queues the work, then starts a worker.  Where the process
may start no more threads ("can't start new thread") it raises with the work still
queued, and its caller does the work another way (on its own thread, or not at all).
Left in the queue, that work would run a second time, late, on the next worker that
starts: a copy written over bytes a later sleep put there, a registration of memory
freed since.  :class:`Workers` takes it back out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

__all__ = ["Workers"]


class Workers(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose submit, when no worker could start, leaves nothing
    queued behind the RuntimeError it raises (a start that failed otherwise, out of
    memory say, is raised as one, so that every caller's fallback applies)."""

    def _adjust_thread_count(self) -> None:
        try:
            super()._adjust_thread_count()
        except Exception as exc:  # noqa: BLE001 - "can't start new thread", MemoryError
            threads = getattr(self, "_threads", None)
            queue = getattr(self, "_work_queue", None)
            if threads:
                return  # the workers running take it: this submit's future is whole
            if threads is not None and queue is not None:
                # no worker: every item queued is from a submit that raised (its caller
                # did the work another way), this one's included
                while not queue.empty():
                    item = queue.get_nowait()
                    if item is not None:
                        item.future.cancel()
            if isinstance(exc, RuntimeError):
                raise
            raise RuntimeError(f"no worker thread could start: {exc!r}") from exc
