"""The benchmark's spec: built once from the command line, and handed to a child process
as flags that build the same spec again (what three copies of an argv builder did)."""

from __future__ import annotations

import dataclasses

import pytest

from vmm_bench.cli import bench_spec
from vmm_bench.spec import BenchSpec, Child, ModelSpec, RLSpec, SleepSpec
from vmm_core.cli import CLIError, build_parser


def spec_of(*argv: str) -> BenchSpec:
    return bench_spec(build_parser().parse_args(["bench", *argv]))


@pytest.fixture
def bench_extra_installed(monkeypatch):
    """The Llama models need the ``bench`` extra (transformers), which CI does not
    install: these tests check how flags become a spec, not the extras check
    (tests/test_cli.py runs that one for real)."""
    import vmm_bench.cli

    monkeypatch.setattr(vmm_bench.cli, "require", lambda extra, why: None)


def test_the_command_line_becomes_typed_values_with_the_defaults_filled_in(
        bench_extra_installed):
    spec = spec_of("--sizes", "4,1,2", "--orders", "random", "--seed", "7", "--model",
                   "llama8b", "--layers", "2", "--dtype", "float16", "--scenario", "rl",
                   "--steps", "3", "--sleep-gib", "1,2")
    assert spec.sizes == (4, 1, 2) and spec.orders == ("random",) and spec.seed == 7
    assert spec.model == ModelSpec("llama8b", "float16", {"layers": 2})
    assert spec.scenarios == ("rl",) and spec.rl == RLSpec(steps=3)
    assert spec.sleep is None  # --sleep-gib alone measures nothing
    assert spec.notes == ("--sleep-gib: used only with --sleep or --sleep-only; ignored",)
    assert {"sleep_gib", "dtype", "layers", "steps", "scenario"} <= spec.given
    plain = spec_of()
    assert plain.model == ModelSpec() and plain.decode.modes == ("private", "shared", "vmm")
    assert plain.sleep is None and plain.child is None and plain.given == frozenset()
    assert spec_of("--sleep-only").sleep == SleepSpec(None, only=True)
    assert spec_of("--sleep-only").sleep.sizes(on_device=False) == (0.5,)
    assert spec_of("--sleep").sleep.sizes(on_device=True) == (4.0, 16.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1


@pytest.mark.parametrize("argv, config, scenario, model", [
    (["--sizes", "1,2,8", "--seed", "3", "--model", "mlp", "--hidden", "64", "--modes", "vmm"],
     "vmm:random", None, "mlp"),
    (["--scenario", "piecewise,families", "--sizes", "1,2", "--layers", "2", "--strategies",
      "vmm"], "families:vmm:ascending", "families", "llama"),
    (["--scenario", "rl", "--steps", "2", "--dtype", "float32"], "rl:vllm", "rl", "llama"),
    (["--scenario", "rl", "--strategies", "vllm-plugin,vmm"], "rl:vmm", "rl", "llama"),
])
def test_a_child_builds_the_parents_spec_from_its_flags(argv, config, scenario, model,
                                                       bench_extra_installed):
    from vmm_bench import rl

    parent = spec_of("--backend", "host", *argv)
    if scenario == "rl":  # the RL scenario's own builder
        child_argv = rl._child_argv(parent, "host", config.split(":")[1])
    else:
        child_argv = parent.child_argv(config, "host", model=model, scenario=scenario)
    assert child_argv[1:4] == ["-m", "vmm_core.cli", "bench"]
    child = bench_spec(build_parser().parse_args(child_argv[3:]))
    assert child.child == Child(config)
    assert child.backend == "host" and child.sizes == parent.sizes
    assert child.seed == parent.seed and child.rl == parent.rl
    assert child.model == dataclasses.replace(parent.model, name=model)


def test_a_strategy_no_chosen_scenario_can_run_is_refused_up_front():
    with pytest.raises(CLIError, match="captures whole graphs; use it with --scenario "
                                       "whole or ondemand"):
        spec_of("--scenario", "piecewise", "--strategies", "sglang")


def test_rl_strategies_and_sleep_rows_are_chosen_by_name_and_checked_up_front(
        bench_extra_installed):
    spec = spec_of("--scenario", "rl", "--strategies", "vllm-plugin,tms-compat,vllm")
    assert spec.rl == RLSpec(steps=5, strategies=("vllm-plugin", "tms-compat", "vllm"))
    assert spec_of("--scenario", "rl").rl.strategies is None  # every one that can run
    # the engine runners' disciplines are not RL strategies, nor the other way round
    with pytest.raises(CLIError, match=r"unknown strategies \['sglang'\] of --scenario rl; "
                                       "choose from vmm, vllm, tms-compat, vllm-plugin, "
                                       "vllm-graphs, vllm-plugin-graphs, tms, recapture"):
        spec_of("--scenario", "rl", "--strategies", "vmm,sglang")
    with pytest.raises(CLIError, match=r"unknown strategies \['tms-compat'\]; choose from"):
        spec_of("--scenario", "piecewise", "--strategies", "tms-compat")
    assert spec_of("--scenario", "piecewise", "--strategies", "vmm").rl.strategies is None
    rows = spec_of("--sleep-only", "--sleep-rows", "vmm,tms-compat").sleep
    assert rows == SleepSpec(None, only=True, rows=("vmm", "tms-compat"))
    assert rows.measures("tms-compat") and not rows.measures("grid")
    assert SleepSpec().measures("grid")  # no --sleep-rows: every row
    assert spec_of("--sleep-rows", "vmm").notes == (
        "--sleep-rows: used only with --sleep or --sleep-only; ignored",)
    with pytest.raises(CLIError, match="--sleep-rows: bogus: choose from vmm,grid,"):
        build_parser().parse_args(["bench", "--sleep-rows", "vmm,bogus"])


def test_repeat_is_the_decode_and_engine_scenarios_and_noted_elsewhere():
    assert spec_of().repeat == 1
    for scenario in ("decode", "piecewise", "piecewise,families", "whole,ondemand"):
        spec = spec_of("--scenario", scenario, "--repeat", "3")
        assert spec.repeat == 3 and not any("--repeat" in n for n in spec.notes), scenario
    for scenario in ("rl", "record-stream", "piecewise,record-stream"):
        spec = spec_of("--scenario", scenario, "--repeat", "3")
        assert spec.repeat == 1, scenario
        assert any(n.startswith("--repeat: only the decode and engine-runner scenarios")
                   for n in spec.notes), scenario


@pytest.mark.parametrize("scenario, runner_module, runner", [
    ("piecewise", "piecewise", "run_piecewise_bench"),
    ("decode", "graph_memory", "run_device_bench")])
def test_the_scenarios_runner_runs_each_configuration_as_often_as_repeat_says(
        monkeypatch, host, scenario, runner_module, runner):
    import importlib

    module = importlib.import_module(f"vmm_bench.{runner_module}")
    asked = []
    monkeypatch.setattr(module, "run_configurations",
                        lambda configs, **kw: asked.append(kw["repeat"]) or [])
    spec = dataclasses.replace(spec_of("--scenario", scenario, "--repeat", "3"),
                               sizes=(1, 2))
    try:
        getattr(module, runner)(spec, host)
    except Exception:  # noqa: BLE001 - no records to report: only the call is asked about
        pass
    assert asked == [3]
