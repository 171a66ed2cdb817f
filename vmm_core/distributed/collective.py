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

import logging
import time

from .. import errors, interrupts
from ..errors import DistributedError, VMMError
from ..memory import tagged
from ..memory.offload.pinning import deferred_pinning
from ..memory.sleep_wake import check_wake_options
from . import communicators as comms
from .group import Group, RankFailure
from .phases import Recorder

__all__ = ["sleep", "wake_up"]

log = logging.getLogger("vmm_core")


def sleep(group, tags=None, offload=(), communicators=False, **options) -> None:
    """:func:`vmm_core.sleep` on every rank of ``group``, or on none of them.

    Offloaded tags go first and all ranks agree before any tag is discarded: undoing an
    offload restores every byte, undoing a discard could not (only offloading, which
    needs host memory, can run out of it).  Before anything moves, every rank checks
    that it *can* sleep every chosen tag (none held awake, none broken) and the ranks
    agree on that and on the steps (each is a collective), so a refusal or ranks with
    different tags refuse together before any byte is lost.  If a discard still fails
    on some rank (a device error), the message names exactly which ranks lost which
    tags; those are woken again with zeroed memory so every rank is awake.

    ``communicators=True`` (or a list of process groups) also releases the device
    memory of the group's communicators once every tag sleeps, until the next group
    wake (:mod:`vmm_core.distributed.communicators`).  The phases' times are kept for
    :func:`vmm_core.distributed.last_timings`."""
    g = Group(group)
    times = Recorder("sleep", g.rank)
    ok = False
    try:
        with interrupts.held("the group sleep (every rank's part and the agreement)"):
            _sleep(g, times, tags, offload, communicators, options)
        ok = True
    finally:
        times.finish(ok)


def _sleep(g: Group, times: Recorder, tags, offload, communicators, options) -> None:
    steps, failure, chosen_comms = [], None, []
    # no hold_awake may start between the check and the discard; kept copies register
    # once the discard step is done too (offload.deferred_pinning)
    with tagged.registry_frozen(), deferred_pinning():  # what it snapshots it undoes
        try:
            offload = tuple(sorted(tagged.offload_tags(offload)))
            chosen = tagged._resolve(tags)
            steps = [(list(chosen), [t for t in chosen if t in offload])]
            discard = [t for t in chosen if t not in offload]
            if offload and set(offload) <= set(chosen) and discard:
                steps = [(list(offload), list(offload)), (discard, [])]
            _check_can_sleep(chosen)
            chosen_comms = comms.check_suspendable(g, communicators)
        except Exception as exc:  # bad arguments too: refused on every rank at once
            failure = exc
        with times.phase("agree"):
            plans = g.agree("vmm_core.sleep(group=...): the tags to sleep",
                            (steps, len(chosen_comms)), failure)
        _refuse_different_plans(g, plans)
        done: list = []  # allocators each finished step put to sleep
        for step_tags, step_offload in steps:
            before = _snapshot(step_tags)
            discards = [t for t in step_tags if t not in step_offload]
            try:
                _all_or_none(g, "sleep",
                             lambda t=step_tags, o=step_offload: tagged.sleep_step(
                                 t, o, **options),
                             undo=(lambda alloc: alloc.wake(zero=True)) if discards
                             else (lambda alloc: alloc.wake()),
                             changed=lambda was, alloc: not was and alloc.asleep,
                             tags=step_tags, discards=discards, times=times)
            except BaseException as exc:  # an interrupt too: the steps before it undone
                if not done:
                    raise
                stuck = _undo([a for step in done for a in step], lambda alloc: alloc.wake())
                note = ("the offload step before it was undone too (its bytes are back)"
                        if stuck is None else f"undoing the offload step before it failed: "
                                              f"{stuck}")
                if not isinstance(exc, Exception):
                    _add_note(exc, note)
                    raise
                raise _with_note(exc, note) from exc  # bound to no local: no cycle
            done.append([a for a, was in before.items() if not was and a.asleep])
        if chosen_comms:
            with times.phase("suspend communicators"):
                comms.suspend(chosen_comms)


def _refuse_different_plans(g: Group, plans: list) -> None:
    """Every rank raises the same error, naming what differs (tags=, offload= or
    communicators=), when the ranks' plans differ.  The order tags are listed in does
    not matter (a set's differs between processes)."""
    canon = [([(sorted(t), sorted(o)) for t, o in steps], n) for steps, n in plans]
    if all(plan == canon[0] for plan in canon):
        return
    named = [sorted({tag for step_tags, _ in steps for tag in step_tags})
             for steps, _ in canon]
    offloaded = [sorted({tag for _, step_offload in steps for tag in step_offload})
                 for steps, _ in canon]
    suspending = [n for _, n in canon]
    differs = []
    if any(n != named[0] for n in named):
        differs.append(("tags", "tags to sleep", named))
    if any(o != offloaded[0] for o in offloaded):
        differs.append(("offload", "tags to offload", offloaded))
    if any(s != suspending[0] for s in suspending):
        differs.append(("communicators", "communicators to suspend", suspending))
    what = " and ".join(label for _, label, _ in differs)
    listed = "; ".join(f"{name}=: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
                       for name, _, vals in differs)
    raise DistributedError(f"vmm_core.sleep(group=...): the ranks have different {what} "
                           f"({listed}); nothing was put to sleep. Pass the same "
                           f"{' and '.join(n + '=' for n, _, _ in differs)} on every rank")


def _with_note(exc: Exception, note: str) -> Exception:
    """``exc``'s type with ``note`` added to its message (DistributedError if that type
    cannot be made from a message)."""
    try:
        return type(exc)(f"{exc}; {note}")
    except Exception:  # noqa: BLE001 - a type that takes other arguments
        return DistributedError(f"{exc}; {note}")


def _check_can_sleep(chosen) -> None:
    """Refuse locally what :meth:`SharedVMMAllocator.sleep` would refuse, before any rank
    discards: memory held awake (``hold_awake``) by this thread, or left inconsistent by
    a failed rollback, and a set of tags that leaves out one of an allocator's."""
    tagged.check_whole(chosen)
    for tag in chosen:
        for alloc in tagged.allocators(tag):
            try:
                alloc.check_can_sleep()
            except VMMError as exc:
                if alloc.closed:  # closed under the call: no longer one of the tags
                    continue
                raise type(exc)(f"memory tagged {tag!r} on this rank: {exc} (before "
                                f"vmm_core.sleep({tag!r}, group=...))") from None


def wake_up(group, tags=None, keep_host_buffers: bool | None = None, eager: bool = False,
            **options) -> None:
    """:func:`vmm_core.wake_up` on every rank of ``group``, or on none of them.

    The ranks first agree on the tags they name (in any order; ``tags=None`` wakes all
    of each rank's own), so ranks naming different tags refuse together instead of
    each waking its own and leaving the group half awake.  ``eager`` is passed to every
    rank's wake (graph executables made again before it returns).  Communicators that
    the group sleep suspended are resumed first: the agreement runs on them."""
    g = Group(group)
    times = Recorder("wake_up", g.rank)
    ok = False
    try:
        with interrupts.held("the group wake (every rank's part and the agreement)"):
            if comms.suspended():
                with times.phase("resume communicators"):
                    comms.resume_all()
            _wake_up(g, times, tags, keep_host_buffers, eager, options)
        ok = True
    finally:
        times.finish(ok)


def _wake_up(g: Group, times: Recorder, tags, keep_host_buffers, eager, options) -> None:
    asked, failure = None, None
    try:
        check_wake_options(keep_host_buffers, eager)
        if tags is not None:  # read once: a generator would be empty for the wake itself
            tags = tagged._resolve(tags)
            asked = sorted(set(tags))
    except Exception as exc:  # bad tags= of any type: refused on every rank at once
        failure = exc
    with times.phase("agree"):
        plans = g.agree("vmm_core.wake_up(group=...): the tags to wake", asked, failure)
    if any(plan != plans[0] for plan in plans):
        listed = "; ".join(f"rank {r}: {'all' if p is None else p}"
                           for r, p in enumerate(plans))
        raise DistributedError(f"vmm_core.wake_up(group=...): the ranks have different "
                               f"tags to wake ({listed}); nothing was woken. Pass the "
                               f"same tags= on every rank")
    _all_or_none(g, "wake_up",
                 lambda: tagged.wake_up(tags, keep_host_buffers=keep_host_buffers,
                                        eager=eager, **options),
                 undo=lambda alloc: alloc.sleep(offload=True),
                 changed=lambda before, alloc: before and not alloc.asleep,
                 tags=tags, times=times)


def _snapshot(tags) -> dict:
    """allocator -> asleep, for the allocators ``tags`` names (empty if they are unknown:
    the call itself then fails and reports it)."""
    try:
        chosen = tagged._resolve(tags)
    except Exception:  # bad tags= of any type: the call itself fails on this rank
        return {}
    return {alloc: alloc.asleep for tag in chosen for alloc in tagged.allocators(tag)}


def _all_or_none(group, what: str, act, undo, changed, tags, discards=(),
                 times: Recorder | None = None) -> None:
    """Run ``act`` on every rank; if any rank failed, undo on the others and raise the
    same error everywhere.  ``discards``: the tags whose sleep loses bytes (no offload);
    where one went to sleep before the failure the error says which rank lost it.
    ``times`` gets the local work (copy, pin wait and the rest) and the confirmation.

    An interrupt raised inside ``act`` (by code it runs: Ctrl-C itself waits for the
    whole call, see :mod:`vmm_core.interrupts`) is this rank's failure like any other:
    every rank hears it and undoes, so no rank is left half asleep or half awake, and it
    is raised here once that is done, with a note saying where the group is left."""
    g = group if isinstance(group, Group) else Group(group)
    times = times or Recorder(what, g.rank)
    interrupt: BaseException | None = None  # failure, when it is an interrupt from act
    # no local sleep/wake may slip in between act and undo, nor a segment the snapshot
    # does not have
    with tagged.registry_frozen():
        before = _snapshot(tags)
        transfers = {a: a.last_transfer for a in before}
        failure: BaseException | None = None
        t0 = time.perf_counter()
        try:
            act()
        except Exception as exc:
            failure = exc
        except BaseException as exc:  # noqa: BLE001 - undone on every rank, then raised
            failure = interrupt = exc
        times.transfers(transfers, before, "unmap+release" if what == "sleep" else "map",
                        time.perf_counter() - t0)
        touched = [a for a, was in before.items() if changed(was, a)]
        lost = sorted({t for t in discards for a in tagged.allocators(t) if a in touched})
        try:
            with times.phase("confirm"):
                outcomes = g.gather(RankFailure(failure) if failure else None,
                                    f"vmm_core.{what}(group=...)")
        except DistributedError as exc:
            problems = _undo(touched, undo)
            loss = f"; its memory tagged {lost} was discarded (bytes lost)" if lost else ""
            state = (f"{exc}. Rank {g.rank} undid its own {what} "
                     f"{'and is back where it started' if not problems else 'but ' + problems}"
                     f"{loss}")
            if interrupt is not None:
                _add_note(interrupt, state)
                failure = None
                try:  # the object itself, its type and fields whole; no frame keeps it
                    raise interrupt.with_traceback(None) from None
                finally:
                    interrupt = None
            raise DistributedError(state) from exc
        failed = {r: o for r, o in enumerate(outcomes) if o is not None}
        if not failed:
            return
        problems = _undo(touched, undo)
        undone = g.gather((problems, lost), f"undoing vmm_core.{what}(group=...)")
    if interrupt is not None:
        _add_note(interrupt, str(_same_error(what, g.size, failed, undone, cause=None)))
        failure = None
        try:  # the object itself, its type and fields whole; no frame keeps it
            raise interrupt.with_traceback(None)
        finally:
            interrupt = None
    raise _same_error(what, g.size, failed, undone, cause=failure)


def _add_note(exc: BaseException, note: str) -> None:
    """Say where the group is left on an interrupt's way out (a note where Python has
    them, 3.11 and later; said in the log where not)."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"vmm_core: {note}")
    else:
        log.error("vmm_core: %s: %s", type(exc).__name__, note)


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
    stuck = {r: p for r, (p, _) in enumerate(undone) if p}
    lost = {r: tags for r, (_, tags) in enumerate(undone) if tags}
    if stuck:
        state = ("could NOT be undone on rank(s) " + ", ".join(
            f"{r} ({p})" for r, p in stuck.items()) + "; the other ranks are back where "
            "they started. Free memory and call it again on every rank")
    elif lost:
        state = ("was undone, but not every byte: " + "; ".join(
            f"rank {r} had discarded {tags} (their bytes are lost; woken again, zeroed)"
            for r, tags in lost.items()) + "; the other tags are back where they "
            "started on every rank")
    else:
        state = "was undone: every rank is back where it started"
    exc = cls(f"vmm_core.{what}(group=...) across {size} ranks failed on rank(s) "
              f"{sorted(failed)} ({detail}); it {state}")
    exc.__cause__ = cause
    return exc
