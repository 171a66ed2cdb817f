"""``--executables``: the graph executables policies the engine-runner scenarios compare.

Each policy runs as its own configuration (a child of its own) of every GraphPool
strategy (``vmm``, ``vmm-keep``, ...), so its graph memory, step time and misses sit
beside the same strategy's ``all`` in one run.  The peers' disciplines keep torch's
executables, as their engines do, and run once.  A policy is written::

    all                      the pool owns every executable, made at capture (default)
    framework                torch's own executables (the framework's graphs)
    budget:N                 at most N executables alive per pool, least recently
                             launched destroyed first
    budget:P%                the same, P percent of the pool's graphs (rounded up)
    budget:...+share         and a miss with the budget full updates an executable of
                             the same topology instead (ExecutablePolicy share="when_full")
    budget:...+share-always  every miss updates one (share="always")
    budget:...+ahead         executables prepared ahead of their step on a thread of the
                             pool's own, keys given up by the forecast (ahead=True); the
                             runner gives no hint: the pool bets on the next key itself
    budget:...+ahead+hint    the same, and the runner names each next step's size while
                             the current one runs (GraphPool.expect), as an engine whose
                             scheduler picks the next batch ahead does
    share-always             no budget, every miss updates one
    ...+kernels              any of these but framework, the pool telling graphs that
                             draw random numbers by their kernels instead of watching
                             every captured operator (random_numbers="kernels")

Without ``+ahead`` a budget serves every miss on the launching thread (ahead=False),
least recently replayed keys given up first: the policy before preparation ahead.

The names are what the records, tables and JSON carry (``"executables"``).  What each
means for GraphPool is :func:`pool_executables`; docs/executables.md explains the
policies themselves.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["DEFAULT", "SYNTAX", "parse_policy", "parse_policies", "pool_executables",
           "is_default", "gives_hints", "FRAMEWORK"]

#: every executable resident, owned by the pool: what each other policy is timed against
DEFAULT = "all"
#: torch's own executables (what the peers keep)
FRAMEWORK = "framework"
SYNTAX = ("all | framework | budget:N | budget:P% (each optionally +share or "
          "+share-always, then +ahead or +ahead+hint) | share-always; any but framework "
          "optionally +kernels last")
#: the suffix asking the pool to read kernels for random numbers
KERNELS = "+kernels"

_BUDGET = re.compile(r"budget:(?P<amount>\d+)(?P<percent>%?)(?P<share>\+share(-always)?)?"
                     r"(?P<ahead>\+ahead(\+hint)?)?")


def parse_policy(text: str) -> str:
    """``text`` checked and written the one way records carry it; ValueError naming the
    syntax otherwise."""
    name = text.strip()
    base = name.removesuffix(KERNELS)
    if base != name and base != FRAMEWORK and not base.endswith(KERNELS):
        return parse_policy(base) + KERNELS
    if name in (DEFAULT, FRAMEWORK, "share-always"):
        return name
    m = _BUDGET.fullmatch(name)
    if m is None:
        raise ValueError(f"--executables {text!r}: not a policy; write {SYNTAX}, e.g. "
                         f"all,budget:50%+share")
    amount = int(m["amount"])
    if amount < 1 or (m["percent"] and amount > 100):
        what = "a percentage from 1 to 100" if m["percent"] else "a count >= 1"
        raise ValueError(f"--executables {text!r}: the budget must be {what}")
    return f"budget:{amount}{m['percent']}{m['share'] or ''}{m['ahead'] or ''}"


def parse_policies(text: str) -> tuple[str, ...]:
    """A comma list of policies, each checked, duplicates dropped, order kept."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--executables {text!r}: name at least one policy ({SYNTAX})")
    return tuple(dict.fromkeys(parse_policy(t) for t in items))


def is_default(name: str | None) -> bool:
    """Whether a record's policy is the one the graph memory headline speaks of (a
    record without the key comes from a run before the knob, with torch's executables
    for peers and every executable resident for GraphPool)."""
    return name in (None, DEFAULT, FRAMEWORK)


def gives_hints(name: str | None) -> bool:
    """Whether the runner names each next step's size to the pools (``+ahead+hint``)."""
    return bool(name) and str(name).removesuffix(KERNELS).endswith("+ahead+hint")


def pool_executables(name: str, graphs: int):
    """What ``GraphPool(executables=...)`` takes for policy ``name`` in a pool that will
    hold ``graphs`` graphs (a percentage budget is of those)."""
    from vmm_core import ExecutablePolicy

    name = parse_policy(name)
    if name.endswith(KERNELS):
        policy = pool_executables(name.removesuffix(KERNELS), graphs)
        return dataclasses.replace(policy or ExecutablePolicy(), random_numbers="kernels")
    if name == DEFAULT:
        return None  # the pool owns them where the backend can, else the framework
    if name == FRAMEWORK:
        return False
    if name == "share-always":
        return ExecutablePolicy(share="always")
    m = _BUDGET.fullmatch(name)
    assert m is not None
    amount = int(m["amount"])
    count = max(1, math.ceil(amount * graphs / 100)) if m["percent"] else amount
    share = {None: "off", "+share": "when_full", "+share-always": "always"}[m["share"]]
    return ExecutablePolicy(max_count=count, share=share, ahead=bool(m["ahead"]))
