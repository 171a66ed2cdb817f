"""The benchmark's spec: built once from the command line, and handed to a child process
as flags that build the same spec again (what three copies of an argv builder did)."""

from __future__ import annotations

import dataclasses

import pytest

from vmm_core.bench.spec import BenchSpec, Child, ModelSpec, RLSpec, SleepSpec
from vmm_core.cli import CLIError, bench_spec, build_parser


def spec_of(*argv: str) -> BenchSpec:
    return bench_spec(build_parser().parse_args(["bench", *argv]))


@pytest.fixture
def bench_extra_installed(monkeypatch):
    """The Llama models need the ``bench`` extra (transformers), which CI does not
    install: these tests check how flags become a spec, not the extras check
    (tests/test_cli.py runs that one for real)."""
    import vmm_core.cli

    monkeypatch.setattr(vmm_core.cli, "require", lambda extra, why: None)


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
])
def test_a_child_builds_the_parents_spec_from_its_flags(argv, config, scenario, model,
                                                       bench_extra_installed):
    parent = spec_of("--backend", "host", *argv)
    extra = ("--steps", str(parent.rl.steps)) if scenario == "rl" else ()
    child_argv = parent.child_argv(config, "host", model=model, scenario=scenario,
                                   extra=extra)
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
