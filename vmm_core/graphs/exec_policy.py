"""How a GraphPool keeps its graphs' executables: :class:`ExecutablePolicy`, what
``GraphPool(executables=...)`` takes (docs/executables.md), checked once when the pool is
made.  The policy itself runs in :mod:`vmm_core.graphs.executables`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = ["ExecutablePolicy", "SHARE_MODES", "RANDOM_NUMBER_READINGS",
           "REFUSALS_BEFORE_GIVING_UP", "policy_of", "check_readable"]

#: ``ExecutablePolicy.share``: never (the default: on CUDA an executable updated to another
#: graph runs it slower than one made from it, launch after launch); only when the budget
#: is full (an update instead of an eviction plus an instantiation); on every miss (fewest
#: executables, an update per launch where graphs of one topology alternate)
SHARE_MODES = ("off", "when_full", "always")
#: ``ExecutablePolicy.random_numbers``: read kernels where the backend sees the
#: generator's state in them, else watch the dispatcher; always watch; always read kernels
RANDOM_NUMBER_READINGS = ("auto", "operators", "kernels")
#: refused updates in a row after which a topology is no longer shared
REFUSALS_BEFORE_GIVING_UP = 3


@dataclass(frozen=True)
class ExecutablePolicy:
    """How a GraphPool keeps its graphs' executables (``GraphPool(executables=...)``).

    :param max_count: at most this many executables alive (None: no limit).
    :param max_bytes: at most this many estimated bytes of executables alive (None: no
        limit).  The estimate is the backend's (CUDA: 100 KiB + 2.5 KiB per node, the fit
        measured on an H100): the driver does not report executables' bytes.
    :param share: ``"off"`` (default): a miss instantiates, evicting whole keys to make
        room.  ``"when_full"``: when an instantiation would need an eviction, update an
        executable of the same topology of another key instead, if there is one;
        ``"always"``: on every miss.  An update is made in a fifth of an instantiation's
        time, but where the backend says an updated executable runs slower (CUDA: a
        Llama-3-8B piecewise step 1.16-1.18x on an H200, docs/executables.md) the pool's
        thread, where it prepares ahead, makes such executables again from their own
        graphs once it has nothing else to do.  Measured on that shape, sharing lost to
        ``"off"`` on every trace but one run's uniform trace.
    :param random_numbers: how the pool tells graphs that draw random numbers (those
        keep the framework's replay, the only one that advances the generator).
        ``"auto"`` (default): ``"kernels"`` where the backend's reading sees the
        generator's captured state in any kernel parameter (CUDA), else ``"operators"``;
        ``stats()["executables"]["policy"]["random_numbers"]`` says which.
        ``"operators"``: a dispatch mode watches every operator of each capture (tagged
        ``nondeterministic_seeded``, with arguments that draw), a Python call per
        captured operator.  ``"kernels"``: the backend reads the captured graph's kernels
        instead (CUDA: a kernel taking a philox state, or whose parameters, structs
        included, hold the default generator's captured state), about one driver call
        per node; a backend that cannot read kernels refuses it (docs/executables.md,
        Random numbers).
    :param ahead: prepare executables on a thread of the pool's own before the steps that
        launch them: the key whose replay block opened (in the step's order), the keys
        the engine names (``GraphPool.expect``), the keys the forecast bets on, and after
        a lazy wake the keys resident at the sleep; keys are given up by the forecast.
        ``False``: every miss is served by the launching thread, least recently replayed
        keys given up first.  ``None`` (default): ahead under a budget.
    :param eager_wake: every wake of the pool's memory makes the executables resident at
        the sleep again before it returns, as ``wake_up(..., eager=True)`` does, whatever
        its caller passed: for an engine that serves right after a wake it does not call
        itself with ``eager`` (torch_memory_saver's ``resume()``, an engine's own sleep
        mode).  The first step after the wake then runs at a warm step's speed instead of
        making its executables inline (the 8B piecewise shape under a budget of a
        quarter, one H200: 1.06-1.08x a warm step against 1.80-2.30x), and the wake takes
        that time instead (98-176 ms there).  ``False`` (default): a wake makes them only
        where its caller asks.

    ``ExecutablePolicy()`` keeps every executable, made at the end of its graph's capture
    as the framework does, but owned by the pool (so that sleep releases them).  Under a
    budget an executable is made by its graph's first replay, or ahead of it.
    """

    max_count: int | None = None
    max_bytes: int | None = None
    share: str = "off"
    ahead: bool | None = None
    random_numbers: str = "auto"
    eager_wake: bool = False

    def __post_init__(self) -> None:
        for name in ("max_count", "max_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) \
                    or value < 1:
                raise ValueError(f"ExecutablePolicy({name}=...) must be None (no limit) or "
                                 f"an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.share not in SHARE_MODES:
            raise ValueError(f"ExecutablePolicy(share=...) must be one of {SHARE_MODES}, "
                             f"got {self.share!r}")
        if self.ahead is not None and not isinstance(self.ahead, bool):
            raise ValueError(f"ExecutablePolicy(ahead=...) must be None (ahead under a "
                             f"budget), True or False, got {self.ahead!r}")
        if not isinstance(self.eager_wake, bool):
            raise ValueError(f"ExecutablePolicy(eager_wake=...) must be True or False, got "
                             f"{self.eager_wake!r}")
        if self.random_numbers not in RANDOM_NUMBER_READINGS:
            raise ValueError(f"ExecutablePolicy(random_numbers=...) must be one of "
                             f"{RANDOM_NUMBER_READINGS}, got {self.random_numbers!r}")

    @property
    def bounded(self) -> bool:
        return self.max_count is not None or self.max_bytes is not None

    @property
    def prepares_ahead(self) -> bool:
        return self.bounded if self.ahead is None else self.ahead

    def as_dict(self) -> dict:
        return {"max_count": self.max_count, "max_bytes": self.max_bytes,
                "share": self.share, "ahead": self.prepares_ahead,
                "random_numbers": self.random_numbers, "eager_wake": self.eager_wake}


def policy_of(value) -> ExecutablePolicy | None:
    """What ``GraphPool(executables=value)`` asks for; None: the framework keeps them."""
    if value is None or isinstance(value, ExecutablePolicy):
        return value
    if value is False:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return ExecutablePolicy(max_count=int(value))
    raise TypeError(f"GraphPool(executables=...) takes None (owned by the pool where the "
                    f"backend can, else the framework's), False (always the framework's), "
                    f"an int (at most that many alive) or a vmm_core.ExecutablePolicy; got "
                    f"{value!r}")


def check_readable(policy: ExecutablePolicy, ops, calls) -> ExecutablePolicy:
    """``policy`` with ``"auto"`` resolved to the way this backend's graphs are told
    (``"kernels"`` where its reading sees the generator's state, else ``"operators"``),
    unless it asks to read kernels of a backend that cannot."""
    import dataclasses

    if policy.random_numbers == "auto":
        sees = calls.reads_random_kernels and calls.sees_generator_state()
        return dataclasses.replace(policy, random_numbers="kernels" if sees else "operators")
    if policy.random_numbers == "kernels" and calls.reads_random_kernels:
        calls.sees_generator_state()  # its one probe now, outside every capture
    if policy.random_numbers == "kernels" and not calls.reads_random_kernels:
        from vmm_core.errors import CaptureError

        why = calls.why_not_reading
        raise CaptureError(
            f"GraphPool(executables=ExecutablePolicy(random_numbers='kernels')): the "
            f"{ops.device_type} graph ops ({type(ops).__name__}) cannot read which kernels "
            f"of a graph draw random numbers{f' ({why})' if why else ''}; use "
            f"random_numbers='operators' or 'auto' (the default, which watches operators "
            f"here)")
    return policy
