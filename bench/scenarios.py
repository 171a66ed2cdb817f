"""The ``vmm-core bench --scenario`` names: one table for ``--help``, validation and dispatch.

A scenario that a new benchmark adds is one entry here: its one-line description, the
function that runs it on a device backend (``"module:function"``, called as
``function(spec, backend) -> dict`` with the run's :class:`~.spec.BenchSpec`, imported
only when it runs), the function a benchmark child runs for one configuration
(``function(spec) -> (record, ok)``), the optional dependency (an extra of
``pyproject.toml``) it needs, and which of ``--strategies``, ``--model`` and ``--sleep``
it uses (the others get a one-line note that they are ignored).  Scenarios that share a
runner may be asked for together (``--scenario piecewise,families``); the runner gets
them all.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

__all__ = ["Scenario", "SCENARIOS", "DEFAULT", "RETIRED", "parse", "runner", "child",
           "describe"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    description: str
    #: ``"module:function"`` run on a device backend as ``function(spec, backend)``
    runner: str
    #: ``"module:function"`` a child process runs as ``function(spec) -> (record, ok)``
    child: str | None = None
    #: the extra of pyproject.toml whose packages it imports (None: none)
    extra: str | None = None
    #: whether --strategies selects what it compares (else --modes does, or nothing)
    uses_strategies: bool = False
    #: whether it builds the model --model names (else it says --model is ignored)
    uses_model: bool = False
    #: whether --sleep / --sleep-only add a sleep/wake measurement to it
    uses_sleep: bool = False
    #: whether --repeat measures each configuration in several fresh processes
    repeats: bool = False


_PIECEWISE = "vmm_bench.piecewise:run_piecewise_bench"
_PIECEWISE_CHILD = "vmm_bench.piecewise:run_child"

SCENARIOS: dict[str, Scenario] = {
    "decode": Scenario("whole graphs per size through GraphExecutor: vmm vs shared vs "
                       "private pools (--model, --modes)",
                       "vmm_bench.graph_memory:run_device_bench",
                       "vmm_bench.graph_memory:run_child", uses_model=True,
                       uses_sleep=True, repeats=True),
    "piecewise": Scenario("an engine's piecewise runner (vLLM-shaped) over GraphPool and the "
                          "peers' disciplines on a transformers Llama stack (--strategies, "
                          "--model llama|llama8b)", _PIECEWISE, _PIECEWISE_CHILD, "bench",
                          True, True, repeats=True),
    "families": Scenario("full and piecewise graph families in one pool, or two GraphPools "
                         "on one allocator (--strategies)", _PIECEWISE, _PIECEWISE_CHILD,
                         "bench", True, True, repeats=True),
    "whole": Scenario("one graph per size in a fixed order (SGLang's runner captures "
                      "descending) (--strategies)", _PIECEWISE, _PIECEWISE_CHILD, "bench",
                      True, True, repeats=True),
    "ondemand": Scenario("whole graphs captured lazily as sizes first arrive, interleaved "
                         "with replays (--strategies)", _PIECEWISE, _PIECEWISE_CHILD, "bench",
                         True, True, repeats=True),
    "record-stream": Scenario("graph_capture_record_stream_reuse on and off: 16 layers whose "
                              "temporaries a side stream reads", _PIECEWISE, _PIECEWISE_CHILD,
                              "bench"),
    "rl": Scenario("the RL colocation step: sleep (weights offloaded, kv and graphs "
                   "discarded), train, wake, new weights, replay; vs vLLM's and the "
                   "engine integrations' ways (--steps, --strategies)",
                   "vmm_bench.rl_group:run_rl_scenario", "vmm_bench.rl:run_child", "bench",
                   uses_strategies=True, uses_model=True),
    "train-offload": Scenario("a training step (forward, backward, AdamW) with the whole "
                              "process in tagged memory (torch_memory_saver's "
                              "TMS_INIT_ENABLE), against the same step without it and "
                              "torch_memory_saver itself; pause/resume of the whole process "
                              "(--layers, --hidden, --heads, --dtype, --steps)",
                              "vmm_bench.train_offload:run_train_offload_bench",
                              "vmm_bench.train_offload:run_child"),
}

DEFAULT = "decode"

#: scenarios that are gone, and what measures the same now
RETIRED = {
    "exec-cache": "graph executables under a budget or shared by update are GraphPool's "
                  "own policies now, measured in the engine-runner scenarios: use "
                  "--scenario piecewise --strategies vmm,vllm --executables "
                  "all,budget:25%,budget:25%+share,share-always",
}


def parse(text: str) -> list[str]:
    """The scenario names of a comma list; ValueError with the choices on a bad one."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    retired = [n for n in names if n in RETIRED]
    if retired:
        raise ValueError(f"--scenario {retired[0]}: {RETIRED[retired[0]]}")
    bad = [n for n in names if n not in SCENARIOS]
    if bad or not names:
        raise ValueError(f"--scenario {','.join(bad) or repr(text)}: unknown; choose from "
                         f"{', '.join(SCENARIOS)}")
    runners = dict.fromkeys(SCENARIOS[n].runner for n in names)
    if len(runners) > 1:
        groups = {r: [n for n in names if SCENARIOS[n].runner == r] for r in runners}
        raise ValueError(f"--scenario {','.join(names)}: these run in different benchmarks; "
                         f"run them in separate calls: "
                         + " and ".join("--scenario " + ",".join(g) for g in groups.values()))
    return names


def _load(path: str) -> Callable:
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


def runner(names) -> Callable:
    """The function that runs ``names`` (validated by :func:`parse`)."""
    return _load(SCENARIOS[names[0]].runner)


def child(names) -> Callable:
    """The function a child process of ``names`` runs for its one configuration."""
    path = SCENARIOS[names[0]].child
    if path is None:
        raise ValueError(f"--scenario {','.join(names)} runs no child processes")
    return _load(path)


def describe() -> str:
    """One line per scenario, for ``--help``."""
    return "\n".join(f"  {name:14s} {s.description}" for name, s in SCENARIOS.items())
