"""Sleep and wake tagged memory on every rank of a group, or on none.

A tensor-parallel engine whose ranks sleep independently can end with half its ranks
asleep when one runs out of memory, and the next collective then hangs or reads
released pages.  Here every rank first does its own part (the ordinary
:func:`vmm_core.sleep` / :func:`vmm_core.wake_up`), then the ranks agree: if any rank
failed, the ranks that succeeded undo what this call changed (wake back what it put to
sleep, put back to sleep what it woke, keeping the bytes), and every rank raises the
same exception: the type of the lowest failing rank's error, with a message naming the
failing ranks and the state every rank is left in.

Undoing a wake puts the woken allocators back to sleep with their bytes copied to host
memory, whatever the sleep that preceded it did: the bytes are then exactly those of
before the call, at the price of a host copy on this (failure) path.
"""

from __future__ import annotations

from .. import errors
from ..errors import DistributedError, VMMError
from ..memory import tagged
from .group import Group, RankFailure

__all__ = ["sleep", "wake_up"]


def sleep(group, tags=None, offload=(), **options) -> None:
    """:func:`vmm_core.sleep` on every rank of ``group``, or on none of them.

    Offloaded tags go first and all ranks agree before any tag is discarded: undoing an
    offload restores every byte, undoing a discard could not (only offloading, which
    needs host memory, can run out of it).  If the discard step fails, the offload step
    is undone too.  The ranks first agree on the steps (each is a collective), so ranks
    with different tags refuse together instead of pairing different steps."""
    g = Group(group)
    offload = (offload,) if isinstance(offload, str) else tuple(offload)
    steps, failure = [], None
    try:
        chosen = tagged._resolve(tags)
        steps = [(list(chosen), [t for t in chosen if t in offload])]
        discard = [t for t in chosen if t not in offload]
        if offload and set(offload) <= set(chosen) and discard:
            steps = [(list(offload), list(offload)), (discard, [])]
    except VMMError as exc:
        failure = exc
    plans = g.agree("vmm_core.sleep(group=...): the tags to sleep", steps, failure)
    if any(plan != steps for plan in plans):
        listed = "; ".join(f"rank {r}: {plan}" for r, plan in enumerate(plans))
        raise DistributedError(f"vmm_core.sleep(group=...): the ranks have different tags to "
                               f"sleep ({listed}); nothing was put to sleep. Pass the same "
                               f"tags= on every rank")
    done: list = []  # allocators each finished step put to sleep
    for step_tags, step_offload in steps:
        before = _snapshot(step_tags)
        try:
            _all_or_none(g, "sleep",
                         lambda t=step_tags, o=step_offload: tagged.sleep(t, o, **options),
                         undo=lambda alloc: alloc.wake(),
                         changed=lambda was, alloc: not was and alloc.asleep,
                         tags=step_tags)
        except Exception as exc:
            if not done:
                raise
            stuck = _undo([a for step in done for a in step], lambda alloc: alloc.wake())
            note = ("the offload step before it was undone too (its bytes are back)"
                    if stuck is None else f"undoing the offload step before it failed: "
                                          f"{stuck}")
            try:
                again = type(exc)(f"{exc}; {note}")
            except Exception:
                again = DistributedError(f"{exc}; {note}")
            raise again from exc
        done.append([a for a, was in before.items() if not was and a.asleep])


def wake_up(group, tags=None, keep_host_buffers: bool | None = None, **options) -> None:
    """:func:`vmm_core.wake_up` on every rank of ``group``, or on none of them."""
    _all_or_none(group, "wake_up",
                 lambda: tagged.wake_up(tags, keep_host_buffers=keep_host_buffers, **options),
                 undo=lambda alloc: alloc.sleep(offload=True),
                 changed=lambda before, alloc: before and not alloc.asleep,
                 tags=tags)


def _snapshot(tags) -> dict:
    """allocator -> asleep, for the allocators ``tags`` names (empty if they are unknown:
    the call itself then fails and reports it)."""
    try:
        chosen = tagged._resolve(tags)
    except VMMError:
        return {}
    return {alloc: alloc.asleep for tag in chosen for alloc in tagged.allocators(tag)}


def _all_or_none(group, what: str, act, undo, changed, tags) -> None:
    g = group if isinstance(group, Group) else Group(group)
    with tagged._lock:  # no local sleep/wake may slip in between act and undo
        before = _snapshot(tags)
        failure = None
        try:
            act()
        except Exception as exc:
            failure = exc
        touched = [a for a, was in before.items() if changed(was, a)]
        try:
            outcomes = g.gather(RankFailure(failure) if failure else None,
                                f"vmm_core.{what}(group=...)")
        except DistributedError as exc:
            problems = _undo(touched, undo)
            raise DistributedError(
                f"{exc}. Rank {g.rank} undid its own {what} "
                f"{'and is back where it started' if not problems else 'but ' + problems}"
            ) from exc
        failed = {r: o for r, o in enumerate(outcomes) if o is not None}
        if not failed:
            return
        problems = _undo(touched, undo)
        undone = g.gather(problems, f"undoing vmm_core.{what}(group=...)")
    raise _same_error(what, g.size, failed, undone, cause=failure)


def _undo(touched: list, undo) -> str | None:
    """Undo this call's changes on this rank; returns what could not be undone."""
    bad = []
    for alloc in touched:
        try:
            undo(alloc)
        except Exception as exc:
            bad.append(f"{alloc!r}: {type(exc).__name__}: {exc}")
    return "; ".join(bad) or None


def _same_error(what: str, size: int, failed: dict, undone: list, cause) -> Exception:
    first = failed[min(failed)]
    cls = getattr(errors, first.type_name, None)
    if not (isinstance(cls, type) and issubclass(cls, VMMError)):
        cls = DistributedError
    detail = "; ".join(f"rank {r}: {o!r}" for r, o in sorted(failed.items()))
    stuck = {r: p for r, p in enumerate(undone) if p}
    if stuck:
        state = ("could NOT be undone on rank(s) " + ", ".join(
            f"{r} ({p})" for r, p in stuck.items()) + "; the other ranks are back where "
            "they started. Free memory and call it again on every rank")
    else:
        state = "was undone: every rank is back where it started"
    exc = cls(f"vmm_core.{what}(group=...) across {size} ranks failed on rank(s) "
              f"{sorted(failed)} ({detail}); it {state}")
    exc.__cause__ = cause
    return exc
