"""The multi-GPU device scripts, checked where they are written instead of on the device.

A device call runs at most 600 s and a run on the two-GPU machine is scarce: a script
whose steps' timeouts add up to more loses the later steps' logs, one that trusts the
caller to keep NVLink multicast off can put the shared host out of service, and a
misspelled bench flag costs a whole call.  These read the scripts and parse their bench
command lines with the real CLI parser.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from vmm_core.cli import bench_spec, build_parser

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CALL_LIMIT_S = 600
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
MULTI_GPU = ["device_distributed.sh", "device_rl_sleep.sh"]


def _text(name: str) -> str:
    return (SCRIPTS / name).read_text()


def _joined(text: str) -> str:
    """The script with backslash-continued lines joined."""
    return re.sub(r"\\\n\s*", " ", text)


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_device_scripts_are_valid_bash(name):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_distributed_script_fits_one_device_call():
    timeouts = [int(n) for n in re.findall(r"\btimeout (\d+)\b", _text("device_distributed.sh"))]
    assert len(timeouts) >= 4, timeouts  # install, facts, info, tests, bench each bounded
    assert sum(timeouts) < CALL_LIMIT_S, timeouts


def test_the_group_step_leaves_the_install_room_in_one_device_call():
    text = _joined(_text("device_rl_sleep.sh"))
    group = text[text.index('if [ "$STEP" = group ]'):]
    (limit,) = re.findall(r"\btimeout (\d+)\b", group)
    assert int(limit) <= CALL_LIMIT_S - 120


@pytest.mark.parametrize("name", MULTI_GPU)
def test_multi_gpu_scripts_set_nvlink_multicast_off(name):
    exported = {}
    for line in re.findall(r"^\s*export (.+)$", _text(name), re.M):
        for word in shlex.split(line):
            key, _, value = word.partition("=")
            exported[key] = value
    assert MULTICAST_OFF.items() <= exported.items(), exported


@pytest.mark.parametrize("name", MULTI_GPU)
def test_multi_gpu_scripts_launch_ranks_through_python_not_a_console_script(name):
    commands = [line for line in _joined(_text(name)).splitlines()
                if not line.lstrip().startswith("#")]
    assert not any(re.search(r"\btorchrun\b", line) for line in commands)
    assert any("python3 -m torch.distributed.run --standalone" in line for line in commands)


@pytest.mark.parametrize("name", MULTI_GPU)
def test_the_bench_command_lines_of_multi_gpu_scripts_parse(name, tmp_path, monkeypatch):
    import vmm_core.cli

    # the device image has the extras (matplotlib, transformers); a CI install of
    # '.[test]' may not: the flags are checked here, not the installation
    monkeypatch.setattr(vmm_core.cli, "require", lambda extra, why: None)
    lines = [line for line in _joined(_text(name)).splitlines()
             if "-m vmm_core.cli bench" in line and not line.lstrip().startswith("#")]
    assert lines
    for line in lines:
        command = line.split("-m vmm_core.cli", 1)[1].split("2>&1")[0]
        command = (command.replace('"$OUT', f'"{tmp_path}').replace("${STEPS:-5}", "5")
                   .replace("${SLEEP_GIB:-4}", "4").replace('"$@"', ""))
        bench_spec(build_parser().parse_args(shlex.split(command)))  # paths, cross-flag rules


def test_the_integrations_step_fits_one_device_call_with_the_install():
    """The step the engine integrations' targets are measured with: its RL and sleep
    benchmarks bounded, together with the install and the torch_memory_saver wheel's,
    inside one call."""
    text = _joined(_text("device_rl_sleep.sh"))
    step = text[text.index('if [ "$STEP" = integrations ]'):text.index('if [ "$STEP" = group ]')]
    timeouts = [int(n) for n in re.findall(r"\btimeout (\d+)\b", step)]
    assert len(timeouts) == 3, timeouts  # the wheel's install, the RL step, the sleep rows
    assert sum(timeouts) <= CALL_LIMIT_S - 30, timeouts  # the tree's install: ~10 s
    words = " ".join(step.split())
    assert "--strategies vmm,vllm,tms-compat,vllm-plugin,tms" in words
    assert "--sleep-rows vmm,vLLM-style,tms-compat,vllm-plugin,torch_memory_saver" in words
