"""``vmm-core bench``: the flags of the main job, checked before any work starts.

Every value on the command line is checked up front (argparse types, then
:func:`bench_spec`, which builds the one :class:`~vmm_bench.spec.BenchSpec` the benchmark
runs), so a typo costs nothing.  The command registers under vmm_core's
``vmm_core.commands`` entry-point group; :mod:`vmm_core.cli` owns the exit statuses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import stat
import tempfile

from vmm_core.cli import EXIT_OK, EXIT_OUTPUT, EXIT_WRONG, CLIError, Command

from . import exec_policies, scenarios
from .extras import require
from .measure import ORDERS, VLLM_DECODE_SIZES
from .peers import DISCIPLINES
from .rl_strategies import STRATEGIES as RL_STRATEGIES
from .rl_strategies import check_strategies as check_rl_strategies
from .serving import TRACES
from .sleep import ROWS as SLEEP_ROWS
from .spec import (
    DEFAULT_DTYPE,
    DEFAULT_MODES,
    DEVICE_SLEEP_GIB,
    HOST_SLEEP_GIB,
    BenchSpec,
    Child,
    DecodeSpec,
    DistributedSpec,
    EngineSpec,
    ModelSpec,
    Output,
    RLSpec,
    SleepSpec,
)
from .torch_pools import MODES
from .workload import DTYPES, LLAMA_MODELS, MODEL_OPTIONS

__all__ = ["command", "add_arguments", "run", "bench_spec"]

# ---------------------------------------------------------------------- argument types
def _choices(allowed):
    """argparse type of a comma-separated list whose items must be in ``allowed``."""
    def parse(text: str) -> str:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{','.join(bad) or repr(text)}: choose from {','.join(allowed)}")
        return ",".join(items)
    return parse


def _policies(text: str) -> str:
    """argparse type of ``--executables``: every policy checked (:mod:`.exec_policies`)."""
    try:
        return ",".join(exec_policies.parse_policies(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--executables ")) from None


def _sizes(text: str) -> str:
    try:
        sizes = [int(t) for t in text.split(",") if t]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated batch sizes >= 1")
    return ",".join(map(str, sizes))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= 1")
    return value


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds from 0 to 1000")
    return value


def _gib_list(text: str) -> str:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated sizes in GiB, each > 0 "
                                         f"(e.g. 4,16 or 0.5)")
    return ",".join(t.strip() for t in text.split(",") if t.strip())


def _gib_text(values) -> str:
    return ",".join(f"{v:g}" for v in values)


def add_arguments(bench: argparse.ArgumentParser) -> None:
    bench.description = ("Measure graph memory on the best backend of this machine. Without "
                         "a device (CPU only) it runs the allocator scenario on the host "
                         "backend and says which flags it cannot honour there.\n\n"
                         "scenarios:\n" + scenarios.describe())
    bench.add_argument("--backend", default=None, help="backend name (default: detected)")
    bench.add_argument("--model", default=None, metavar="mlp|llama|llama8b|package.module:factory",
                       help="what the graphs capture (default mlp); a factory is called as "
                            "factory(device=, dtype=, max_batch=, seed=) and returns (fn, "
                            "example_inputs), see docs/benchmarks.md")
    bench.add_argument("--orders", default="ascending,descending,random",
                       type=_choices(ORDERS),
                       help="capture orders to compare, comma-separated: "
                            f"{', '.join(ORDERS)} (default: all; random draws from --seed)")
    bench.add_argument("--modes", default=None, type=_choices(MODES),
                       help="strategies of the decode scenario, comma-separated "
                            f"(default {','.join(DEFAULT_MODES)}; the largest size alone "
                            f"always runs)")
    bench.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                       help="decode and engine-runner scenarios (piecewise, families, "
                            "whole, ondemand): measure every configuration in N fresh "
                            "processes, in N rounds of all of them; the report gives each "
                            "the run of median capture time and the range (default 1)")
    bench.add_argument("--sizes", default=None, type=_sizes,
                       help="comma-separated batch sizes (default: vLLM's 51 decode sizes)")
    bench.add_argument("--dtype", default=None, choices=DTYPES,
                       help=f"dtype of the built-in models, passed to a factory (default "
                            f"{DEFAULT_DTYPE})")
    defaults = "; ".join(f"{name}: " + ", ".join(f"{k.replace('_', '-')} {v}"
                                                 for k, v in options.items())
                         for name, options in MODEL_OPTIONS.items())
    model = bench.add_argument_group(f"built-in model options (defaults: {defaults})")
    for name in dict.fromkeys(k for options in MODEL_OPTIONS.values() for k in options):
        model.add_argument("--" + name.replace("_", "-"), type=_positive_int, default=None,
                           metavar="N")
    bench.add_argument("--seed", type=int, default=0,
                       help="seed of the random capture order, the model's weights and the "
                            "inputs checked against eager (default 0)")
    bench.add_argument("--json", default=None, metavar="PATH",
                       help="write all results to this JSON file (checked writable first)")
    bench.add_argument("--plot", default=None, metavar="PATH",
                       help="write a PNG: growth curves and final bars (needs the 'plot' "
                            "extra, matplotlib)")
    bench.add_argument("--quiet", action="store_true",
                       help="no progress bars or per-configuration lines")
    bench.add_argument("--sleep", action="store_true",
                       help="also measure sleep/wake of the graph pool and tagged memory")
    bench.add_argument("--sleep-only", action="store_true",
                       help="measure sleep/wake only (skip the graph memory benchmark)")
    bench.add_argument("--sleep-gib", default=None, type=_gib_list,
                       help="comma-separated sizes to offload in the sleep benchmark, in GiB "
                            f"(default {_gib_text(DEVICE_SLEEP_GIB)} on a device, "
                            f"{_gib_text(HOST_SLEEP_GIB)} on a backend without one)")
    bench.add_argument("--sleep-rows", default=None, type=_choices(SLEEP_ROWS),
                       help="rows of the sleep benchmark, comma-separated: vmm (vmm_core's "
                            "own), grid (the variants its defaults were chosen from), or a "
                            f"peer: {', '.join(SLEEP_ROWS[2:])} (default: all)")
    bench.add_argument("--scenario", default=None,
                       help=f"comma-separated scenarios (default {scenarios.DEFAULT}): "
                            f"{', '.join(scenarios.SCENARIOS)}; see above")
    bench.add_argument("--steps", type=_positive_int, default=None,
                       help=f"sleep/wake steps of --scenario rl (default {RLSpec.steps})")
    bench.add_argument("--strategies", default=None,
                       type=_choices(tuple(dict.fromkeys((*DISCIPLINES, *RL_STRATEGIES)))),
                       help="strategies of the engine-runner scenarios, comma-separated "
                            f"(default {','.join(DISCIPLINES)}), or of --scenario rl "
                            f"({','.join(RL_STRATEGIES)}; default: every one that can run)")
    bench.add_argument("--executables", default=None, type=_policies,
                       metavar="POLICY[,POLICY...]",
                       help="graph executables policies of the GraphPool strategies of the "
                            "engine-runner scenarios, comma-separated, each run as its own "
                            f"configuration: {exec_policies.SYNTAX.replace('%', '%%')} "
                            f"(default "
                            f"{exec_policies.DEFAULT}; the peers keep torch's executables); "
                            "see docs/executables.md")
    bench.add_argument("--trace-steps", type=_positive_int, default=None, metavar="N",
                       help="steps of each serving-shaped replay trace of the engine-runner "
                            f"scenarios (default {EngineSpec.trace_steps})")
    bench.add_argument("--step-gap-ms", type=_milliseconds, default=None, metavar="MS",
                       help="untimed host time between two steps of a serving trace, as "
                            "an engine's scheduling and sampling leave it: the time "
                            "executables are prepared ahead in (default 0: the next step "
                            "starts as the last one ends)")
    bench.add_argument("--trace", default=None, type=_choices(TRACES),
                       help="serving traces the engine-runner scenarios replay, "
                            "comma-separated, in order: uniform (any size alike), zipf (a "
                            "few sizes hot), drift (a random walk over the sizes) (default: "
                            "all three)")
    bench.add_argument("--distributed", action="store_true",
                       help="mapped tensor across ranks: gather vs all_gather (run under "
                            "torchrun --nproc-per-node N; one host rank without torchrun)")
    bench.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process mode
    bench.add_argument("--progress-lines", action="store_true",
                       help=argparse.SUPPRESS)  # child: forward progress to the parent


# ---------------------------------------------------------------------- checks up front
def _check_writable(flag: str, path: str) -> None:
    """Refuse an output path that could not be written, before minutes of measuring.

    Permissions alone do not say it (root may write anywhere, yet not create a file in
    /proc or /sys, and ``/dev/full`` opens but takes no byte), so a byte is written and
    flushed: into a new file beside it, removed again; at the end of an existing file, cut off
    again; into a device that is not a terminal.  A pipe or a terminal is not written
    now: the byte would be part of the output."""
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path}: is a directory; give a file path", EXIT_OUTPUT)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CLIError(f"{flag} {path}: directory {parent} does not exist; create it or "
                       f"choose another path", EXIT_OUTPUT)
    exists = os.path.exists(path)
    if exists and not os.access(path, os.W_OK):
        raise CLIError(f"{flag} {path}: not writable (permission denied); choose "
                       f"another path", EXIT_OUTPUT)
    mode = os.stat(path).st_mode if exists else 0
    if exists and not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
        return  # a pipe or a socket: written in place at the end
    trial = None  # a new path is tried through a file of this process's own beside it:
    # ranks of one torchrun given the same path check it at the same moment
    try:
        if exists:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        else:
            fd, trial = tempfile.mkstemp(dir=parent, prefix=".vmm-core-check-")
    except OSError as exc:
        raise CLIError(f"{flag} {path}: cannot be created ({exc.strerror or exc}); choose "
                       f"another path", EXIT_OUTPUT) from None
    try:
        if stat.S_ISCHR(mode) and os.isatty(fd):
            return
        size = os.fstat(fd).st_size
        os.write(fd, b"\n")  # unbuffered: the kernel takes the byte or says why not
        if exists and stat.S_ISREG(mode):
            os.ftruncate(fd, size)
    except OSError as exc:
        raise CLIError(f"{flag} {path}: cannot be written ({exc.strerror or exc}); choose "
                       f"another path", EXIT_OUTPUT) from None
    finally:
        os.close(fd)
        if trial is not None:
            with contextlib.suppress(OSError):
                os.remove(trial)


GIB = 2**30


def _check_sleep_sizes(backend_name: str | None, gib: tuple[float, ...]) -> None:
    """Refuse ``--sleep-gib`` sizes the sleep benchmark cannot hold before any work (it
    would fail after every other row had run): below the backend's granularity (no page
    to offload), or more than the memory there is.  Every size's bytes are copied to host
    memory, and the host limits are measured on two buffers of the largest size, so the
    host must hold twice the largest; on a device, the device must hold it once (its
    total memory)."""
    import vmm_core
    from vmm_core.offload import host_room

    backend = vmm_core.select_backend(backend_name).backend
    least = backend.capabilities(0).granularity
    small = [g for g in gib if int(g * GIB) < least]
    if small:
        raise CLIError(f"--sleep-gib {_gib_text(small)}: below one page of the {backend.name} "
                       f"backend ({least} bytes, its granularity); the least is "
                       f"{least / GIB!r}")
    largest = max(gib)
    ops = backend.graph_ops(0)
    if ops is not None and ops.device_type != "cpu":
        import torch

        # the device's properties, not mem_get_info: no context is made in this process
        # before the benchmark children make theirs
        properties = getattr(getattr(torch, ops.device_type), "get_device_properties", None)
        total = properties(ops.torch_device).total_memory if properties else None
        if total is not None and largest * GIB > total:
            raise CLIError(f"--sleep-gib {largest:g}: more than the {total / GIB:.1f} GiB of "
                           f"{backend.name} device 0's memory")
    room = host_room()
    if room is not None and 2 * largest * GIB > room[0]:
        raise CLIError(f"--sleep-gib {largest:g}: the sleep benchmark holds twice the largest "
                       f"size in host memory, and this machine has {room[1] / GIB:.1f} GiB "
                       f"available (MemAvailable, less {room[2] / GIB:.1f} GiB left to the "
                       f"rest of the machine): at most {room[0] / 2 / GIB:.2f} here")


def _given(args) -> frozenset[str]:
    """The bench flags typed on the command line (argparse leaves the others None)."""
    names = {"modes", "repeat", "strategies", "sleep_gib", "sleep_rows", "dtype", "scenario",
             "steps", "executables", "trace_steps", "trace", "step_gap_ms"}
    names |= {k for opts in MODEL_OPTIONS.values() for k in opts}
    return frozenset(n for n in names if getattr(args, n, None) is not None)


def _model_options(args) -> dict:
    names = {k for opts in MODEL_OPTIONS.values() for k in opts}
    return {k: getattr(args, k) for k in sorted(names) if getattr(args, k, None) is not None}


def bench_spec(args) -> BenchSpec:
    """Check what argparse cannot (cross-flag rules, output paths, optional packages),
    fill in the defaults and build the run's spec.  Raises :class:`CLIError` (or
    :class:`MissingExtraError`) before any work; ``notes`` has one line per flag the
    chosen scenarios do not use."""
    given = _given(args)
    try:
        names = scenarios.parse(args.scenario or scenarios.DEFAULT)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    for flag in ("json", "plot"):
        if getattr(args, flag, None):
            _check_writable("--" + flag, getattr(args, flag))
    if args.plot:
        require("plot", f"--plot {args.plot}")
    if args.model in LLAMA_MODELS:
        require("bench", f"--model {args.model}")
    sleep = None
    if args.sleep or args.sleep_only:
        gib = tuple(float(t) for t in args.sleep_gib.split(",")) if args.sleep_gib else None
        rows = tuple(args.sleep_rows.split(",")) if args.sleep_rows else None
        sleep = SleepSpec(gib, only=args.sleep_only, rows=rows)
        if gib is not None and args.one is None:
            _check_sleep_sizes(args.backend, gib)
    strategies = tuple(args.strategies.split(",")) if args.strategies else None
    spec = BenchSpec(
        backend=args.backend, scenarios=tuple(names),
        sizes=tuple(int(s) for s in args.sizes.split(",")) if args.sizes
        else tuple(VLLM_DECODE_SIZES),
        orders=tuple(args.orders.split(",")), seed=args.seed,
        model=ModelSpec(args.model, args.dtype or DEFAULT_DTYPE, _model_options(args)),
        decode=DecodeSpec(tuple(args.modes.split(",")) if args.modes else DEFAULT_MODES),
        repeat=args.repeat or 1,
        engine=EngineSpec(
            strategies or tuple(DISCIPLINES),
            tuple(args.executables.split(",")) if args.executables
            else EngineSpec.executables,
            args.trace_steps or EngineSpec.trace_steps,
            tuple(args.trace.split(",")) if args.trace else EngineSpec.traces,
            args.step_gap_ms or EngineSpec.step_gap_ms),
        rl=RLSpec(args.steps or RLSpec.steps, strategies if "rl" in names else None),
        sleep=sleep, distributed=DistributedSpec() if args.distributed else None,
        output=Output(args.json, args.plot, args.quiet),
        child=Child(args.one, args.progress_lines) if args.one else None, given=given)
    if spec.child is not None and len(spec.engine.executables) > 1:
        raise CLIError(f"--one {spec.child.config}: a benchmark child measures one "
                       f"--executables policy, got {','.join(spec.engine.executables)}")
    uses_strategies = any(scenarios.SCENARIOS[n].uses_strategies for n in names)
    if uses_strategies:
        from .piecewise import configurations

        try:
            if "rl" in names:
                check_rl_strategies(spec.rl.strategies)
            else:
                configurations(spec)  # a strategy no chosen scenario can run, say
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    notes = []
    if "strategies" in given and not uses_strategies:
        notes.append(f"--strategies: scenario {spec.scenario} does not use it (the "
                     f"engine-runner scenarios and rl do); ignored")
    runs_engines = any(scenarios.SCENARIOS[n].uses_strategies for n in names if n != "rl")
    for flag in ("executables", "trace_steps", "trace", "step_gap_ms"):
        if flag in given and not runs_engines:
            notes.append(f"--{flag.replace('_', '-')}: scenario {spec.scenario} does not "
                         f"use it (the engine-runner scenarios do: piecewise, families, "
                         f"whole, ondemand); ignored")
    if "executables" in given and runs_engines and not any(
            getattr(DISCIPLINES.get(s), "reuse", None) == "vmm"
            for s in spec.engine.strategies):
        notes.append(f"--executables: none of --strategies {','.join(spec.engine.strategies)}"
                     f" is a GraphPool strategy (vmm, vmm-keep, ...); the peers keep torch's "
                     f"executables; ignored")
    if "modes" in given and names != ["decode"]:
        notes.append(f"--modes: scenario {spec.scenario} compares --strategies instead; "
                     f"ignored")
    once = [n for n in names if not scenarios.SCENARIOS[n].repeats]
    if "repeat" in given and once:
        notes.append(f"--repeat: only the decode and engine-runner scenarios repeat their "
                     f"configurations; this run of {spec.scenario} runs each once")
        spec = dataclasses.replace(spec, repeat=1)
    for flag in ("sleep_gib", "sleep_rows"):
        if flag in given and sleep is None:
            notes.append(f"--{flag.replace('_', '-')}: used only with --sleep or "
                         f"--sleep-only; ignored")
    return dataclasses.replace(spec, notes=tuple(notes))


def run(args) -> int:
    """Check ``args``, print a note per flag the chosen scenarios ignore, run the spec."""
    from .runner import run_bench

    spec = bench_spec(args)
    if spec.child is None:
        for note in spec.notes:
            print(f"note: {note}")
    return EXIT_OK if run_bench(spec).get("ok", True) else EXIT_WRONG


#: what ``vmm-core`` finds under the ``vmm_core.commands`` entry point ``bench``
command = Command(help="graph memory: vmm vs shared vs private pools",
                  add_arguments=add_arguments, run=run)
