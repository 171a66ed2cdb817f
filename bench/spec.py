"""What one ``vmm-core bench`` run measures, as typed values built once by the CLI.

The CLI checks every flag, fills in the defaults and builds one :class:`BenchSpec`; no
benchmark module sees argparse.  A scenario reads the shared fields (backend, sizes,
orders, seed, the model, where the output goes) and its own part: :class:`DecodeSpec`,
:class:`EngineSpec`, :class:`RLSpec`, :class:`SleepSpec` or :class:`DistributedSpec`.
A benchmark child process is started with the same flags again
(:meth:`BenchSpec.child_argv`), so the child's spec equals the parent's but for
``child``, the one configuration it measures.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Mapping

from .exec_policies import DEFAULT as DEFAULT_POLICY
from .measure import ORDERS, VLLM_DECODE_SIZES
from .peers import DISCIPLINES
from .serving import TRACE_STEPS, TRACES
from .torch_pools import MODES

__all__ = ["BenchSpec", "ModelSpec", "Output", "Child", "DecodeSpec", "EngineSpec", "RLSpec",
           "SleepSpec", "DistributedSpec", "python_cli", "DEFAULT_MODES", "DEFAULT_DTYPE",
           "DEVICE_SLEEP_GIB", "HOST_SLEEP_GIB"]

#: the decode strategies every run compares: the torch baselines and GraphPool
DEFAULT_MODES = MODES
DEFAULT_DTYPE = "bfloat16"
#: sizes the sleep benchmark offloads when --sleep-gib is not given, in GiB
DEVICE_SLEEP_GIB = (4.0, 16.0)
HOST_SLEEP_GIB = (0.5,)  # a CPU machine's memory


def python_cli() -> list[str]:
    """The command that starts a child: this interpreter, vmm_core's CLI module."""
    return [sys.executable, "-m", "vmm_core.cli"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the graphs capture: ``--model``, ``--dtype`` and the built-in models' options."""

    #: ``mlp``, ``llama``, ``llama8b`` or ``package.module:factory``; None: the scenario's
    #: own default (mlp for decode, llama for the engine-runner and RL scenarios)
    name: str | None = None
    dtype: str = DEFAULT_DTYPE
    #: the options given on the command line (--layers, --hidden, ...), unset ones left out
    options: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def named(self, default: str) -> str:
        return self.name or default

    def argv(self, name: str) -> list[str]:
        """The flags that give a child this model, as ``name``."""
        argv = ["--model", name, "--dtype", self.dtype]
        for key, value in self.options.items():
            argv += [_flag(key), str(value)]
        return argv


@dataclasses.dataclass(frozen=True)
class Output:
    """Where the results go, and whether progress is shown."""

    json: str | None = None
    plot: str | None = None
    quiet: bool = False


@dataclasses.dataclass(frozen=True)
class Child:
    """The one configuration a benchmark child process measures (``--one``)."""

    #: ``strategy:order`` (decode), ``scenario:strategy:order`` (engine runners) or
    #: ``rl:strategy``
    config: str
    #: print ``VMMPROGRESS`` lines for the parent's bar instead of drawing one
    forward_progress: bool = False


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """``--scenario decode``: the GraphExecutor reuse modes compared (``--modes``)."""

    modes: tuple[str, ...] = DEFAULT_MODES


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The engine-runner scenarios (piecewise, families, whole, ondemand): the peers'
    disciplines compared (``--strategies``, names of :data:`.peers.DISCIPLINES`), the
    graph executables policies each GraphPool strategy runs under (``--executables``,
    :mod:`.exec_policies`; a child gets the one it measures), the steps of each
    serving trace every configuration replays (``--trace-steps``) and which traces, in
    order (``--trace``, :data:`.serving.TRACES`), and the host time left between two
    steps of a trace (``--step-gap-ms``, untimed: what an engine's scheduling and
    sampling leave a preparer ahead of the next step)."""

    strategies: tuple[str, ...] = tuple(DISCIPLINES)
    executables: tuple[str, ...] = (DEFAULT_POLICY,)
    trace_steps: int = TRACE_STEPS
    traces: tuple[str, ...] = TRACES
    step_gap_ms: float = 0.0

    def argv(self, policy: str) -> tuple[str, ...]:
        """The flags that give a child this spec's engine part, measuring ``policy``."""
        return ("--executables", policy, "--trace-steps", str(self.trace_steps),
                "--trace", ",".join(self.traces), "--step-gap-ms", repr(self.step_gap_ms))


@dataclasses.dataclass(frozen=True)
class RLSpec:
    """``--scenario rl``: sleep/wake steps per strategy (``--steps``) and the strategies
    compared (``--strategies``, names of :data:`.rl_strategies.STRATEGIES`; None: every
    one that can run here)."""

    steps: int = 5
    strategies: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class SleepSpec:
    """``--sleep`` / ``--sleep-only``: offload sizes in GiB (``--sleep-gib``)."""

    #: None: :data:`DEVICE_SLEEP_GIB` on a device, :data:`HOST_SLEEP_GIB` on the host
    gib: tuple[float, ...] | None = None
    #: ``--sleep-only``: no graph memory benchmark before it
    only: bool = False
    #: ``--sleep-rows``: the rows measured (names of :data:`.sleep.ROWS`); None: all
    rows: tuple[str, ...] | None = None

    def sizes(self, on_device: bool) -> tuple[float, ...]:
        if self.gib is not None:
            return self.gib
        return DEVICE_SLEEP_GIB if on_device else HOST_SLEEP_GIB

    def measures(self, row: str) -> bool:
        """Whether the row (or row group) ``row`` is measured."""
        return self.rows is None or row in self.rows


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """``--distributed``: sizes of the mapped-tensor rows; None: the device's or the host
    run's default (``vmm_bench.distributed.DEFAULTS``)."""

    setup_gib: tuple[float, ...] | None = None
    table_gib: float | None = None
    row_bytes: int | None = None
    gather_rows: int | None = None
    iters: int | None = None


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """One ``vmm-core bench`` run, every value checked."""

    backend: str | None = None
    #: the ``--scenario`` names (one runner: :func:`.scenarios.parse`)
    scenarios: tuple[str, ...] = ("decode",)
    sizes: tuple[int, ...] = tuple(VLLM_DECODE_SIZES)
    orders: tuple[str, ...] = ORDERS
    seed: int = 0
    model: ModelSpec = ModelSpec()
    decode: DecodeSpec = DecodeSpec()
    engine: EngineSpec = EngineSpec()
    #: fresh processes per configuration (``--repeat``), in rounds of every configuration
    #: in turn so a drift of the machine reaches all alike; 1 where a scenario of the run
    #: does not repeat (:attr:`.scenarios.Scenario.repeats`)
    repeat: int = 1
    rl: RLSpec = RLSpec()
    sleep: SleepSpec | None = None
    distributed: DistributedSpec | None = None
    output: Output = Output()
    child: Child | None = None
    #: the flags typed on the command line (a default fills the others), for the notes a
    #: backend that cannot honour one prints
    given: frozenset[str] = frozenset()
    #: one line per flag the chosen scenarios do not use, printed before the run
    notes: tuple[str, ...] = ()

    @property
    def scenario(self) -> str:
        """The scenario names as typed: ``piecewise,families``."""
        return ",".join(self.scenarios)

    def child_argv(self, config: str, backend: str, *, model: str,
                   scenario: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
        """The command line of the child that measures ``config``: this run's sizes, seed
        and model (as ``model``, the scenario's default filled in) on ``backend``."""
        argv = python_cli() + ["bench", "--one", config, "--backend", backend]
        if scenario is not None:
            argv += ["--scenario", scenario]
        return (argv + self.model.argv(model) + ["--seed", str(self.seed), "--sizes",
                                                 ",".join(map(str, self.sizes))]
                + list(extra))
