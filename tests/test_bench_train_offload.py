"""``vmm-core bench --scenario train-offload`` where a CPU can check it: each
configuration's process is started as the RL launchers start theirs, and the target
reads the step times of the same run.  The step itself needs a GPU (tests/
test_cuda_tms_process.py runs one; scripts/device_tms.sh the benchmark)."""

from __future__ import annotations

import pytest

from vmm_bench import train_offload
from vmm_bench.cli import bench_spec
from vmm_core.cli import build_parser
from vmm_core.integrations import torch_memory_saver as compat


def test_each_configuration_starts_as_a_launcher_starts_its_training_process(monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")  # the caller's own: not passed on
    monkeypatch.setenv("PYTHONPATH", compat.alias_path())
    plain = train_offload._env("plain")
    assert "LD_PRELOAD" not in plain and not any(k.startswith("TMS_") for k in plain)
    ours = train_offload._env("vmm")
    assert ours["LD_PRELOAD"] == compat.preload_path()
    assert ours["TMS_INIT_ENABLE"] == ours["TMS_INIT_ENABLE_CPU_BACKUP"] == "1"
    assert compat.alias_path() not in ours["PYTHONPATH"], "the library alone brings it"
    theirs = train_offload._env("torch_memory_saver")
    assert isinstance(theirs, str) or "torch_memory_saver_hook_mode_preload" in \
        theirs["LD_PRELOAD"]


def test_the_step_target_reads_the_same_runs_plain_step():
    def record(config, ms):
        return {"config": config, "step_ms_median": ms}

    met = train_offload._targets([record("plain", 100.0), record("vmm", 104.0),
                                  record("torch_memory_saver", 120.0)])
    assert met["vmm step vs plain"] == pytest.approx(
        {"ratio": 1.04, "target": 1.05, "met": True})
    assert met["torch_memory_saver step vs plain"]["met"], "a peer is reported, not judged"
    missed = train_offload._targets([record("plain", 100.0), record("vmm", 106.0)])
    assert not missed["vmm step vs plain"]["met"]
    assert train_offload._targets([record("vmm", 1.0)]) == {}


def test_the_scenario_and_its_child_parse_with_the_cli():
    spec = bench_spec(build_parser().parse_args(
        ["bench", "--scenario", "train-offload", "--layers", "4", "--steps", "10"]))
    argv = spec.child_argv("train-offload:vmm", "cuda", model="train",
                           scenario="train-offload", extra=("--steps", "10"))
    child = bench_spec(build_parser().parse_args(argv[3:]))
    assert child.child.config == "train-offload:vmm" and child.rl.steps == 10
    assert child.model.options == {"layers": 4} and "steps" in child.given
