"""The GPU validation scripts, checked on any machine before they run on a GPU.

Each script keeps to ten minutes, so a hang ends in a timeout with the logs kept: a
script whose steps' timeouts add up to more would lose the later steps' logs, one that
trusts the caller to keep NVLink multicast off can put a shared host out of service, and
a misspelled bench flag would cost a whole run on the GPU.  These read the scripts and
parse their bench command lines with the real CLI parser.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from vmm_bench.cli import bench_spec
from vmm_core.cli import build_parser

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
#: what each script keeps to, in seconds (its DEADLINE and step timeouts within it)
SCRIPT_LIMIT_S = 600
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
MULTI_GPU = ["device_distributed.sh", "device_rl_sleep.sh"]
#: the scripts whose benchmark command lines are parsed here
BENCH_SCRIPTS = [*MULTI_GPU, "device_tms.sh"]


def _text(name: str) -> str:
    return (SCRIPTS / name).read_text()


def _with_steps(name: str) -> str:
    """The script with the step helper it sources (scripts/deadline_steps.sh) after it."""
    text = _text(name)
    if ". scripts/deadline_steps.sh" in text:
        text += "\n" + _text("deadline_steps.sh")
    return text


def _joined(text: str) -> str:
    """The script with backslash-continued lines joined."""
    return re.sub(r"\\\n\s*", " ", text)


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_device_scripts_are_valid_bash(name):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _defaults(text: str) -> dict[str, str]:
    """``NAME=${NAME:-default}`` lines of a script: name -> default."""
    return dict(re.findall(r'^(\w+)=\$\{\w+:-"?([^"}]*)"?\}', text, re.M))


def test_the_distributed_script_fits_ten_minutes():
    """Its fixed steps (install, facts, info, the round-1 report) each have a timeout,
    and every step after them runs through ``step``, which gives it at most what is left
    of DEADLINE: the whole stays inside ten minutes."""
    text = _with_steps("device_distributed.sh")
    assert int(_defaults(text)["DEADLINE"]) <= SCRIPT_LIMIT_S - 60
    assert 'left=$((DEADLINE - SECONDS))' in text and '[ "$cap" -gt "$left" ] && cap=$left' in text
    commands = [line for line in _joined(text).splitlines()
                if not line.lstrip().startswith("#")]
    runs = [line for line in commands if re.search(r"python3 |\$RUN |bash scripts/", line)
            and not line.startswith("RUN=")]
    for line in runs:  # every command bounded: by its own timeout or through step
        assert re.search(r"\btimeout \d+\b|\bstep [\w-]+ \d+ ", line), line
    fixed = [int(n) for line in runs for n in re.findall(r"\btimeout (\d+)\b", line)]
    assert sum(fixed) <= 240, fixed  # before the steps: DEADLINE still leaves them room


def test_the_torch_memory_saver_script_fits_ten_minutes():
    """Its install, facts and the wheel's install each have a timeout; the suite and the
    two benchmarks run through ``step``, which gives each at most what is left of
    DEADLINE; the tests of the suite that may fail are the ones docs/integrations.md
    names as not served."""
    text = _with_steps("device_tms.sh")
    defaults = _defaults(text)
    assert int(defaults["DEADLINE"]) <= SCRIPT_LIMIT_S - 60
    assert 'left=$((DEADLINE - SECONDS))' in text and '[ "$cap" -gt "$left" ] && cap=$left' in text
    commands = [line for line in _joined(text).splitlines()
                if not line.lstrip().startswith("#")]
    runs = [line for line in commands if re.search(r"python3 |bash scripts/", line)
            and not re.match(r"\s*(echo|say) ", line)]
    for line in runs:
        assert re.search(r"\btimeout \d+\b|\bstep [\w\"$\[\]-]+ \d+ ", line), line
    steps = [int(n) for n in re.findall(r"\bstep \S+ (\d+) ", " ".join(commands))]
    assert len(steps) == 3 and sum(steps) <= int(defaults["DEADLINE"]), steps
    docs = (SCRIPTS.parent / "docs" / "integrations.md").read_text()
    for test in defaults["NOT_SERVED"].split():
        assert f"`{test}`" in docs, test


def test_the_torch_memory_saver_script_takes_its_inputs_from_git_ignored_folders(tmp_path):
    """Without arguments the suite is read from .tms and the wheel from .whl/, folders git
    ignores (nothing of torch_memory_saver is committed here); TMS_CHECKOUT names another
    tree.  With no suite there it stops before the install, saying where it looked."""
    ignored = (SCRIPTS.parent / ".gitignore").read_text().split()
    assert "/.tms/" in ignored and "/.whl/" in ignored
    shutil.copytree(SCRIPTS, tmp_path / "scripts")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env["OUT"] = str(tmp_path / "out")
    for extra, where in (({}, ".tms"), ({"TMS_CHECKOUT": "tms-src"}, "tms-src")):
        proc = subprocess.run(["bash", "scripts/device_tms.sh"], cwd=tmp_path,
                              env={**env, **extra}, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"no test/test_examples.py under '{where}'" in proc.stderr, proc.stderr
        assert not (tmp_path / "out" / "install.log").exists()


def test_the_group_step_leaves_the_install_room_within_ten_minutes():
    text = _joined(_text("device_rl_sleep.sh"))
    group = text[text.index('if [ "$STEP" = group ]'):]
    (limit,) = re.findall(r"\btimeout (\d+)\b", group)
    assert int(limit) <= SCRIPT_LIMIT_S - 120


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


@pytest.mark.parametrize("name", BENCH_SCRIPTS)
def test_the_bench_command_lines_of_the_scripts_parse(name, tmp_path, monkeypatch):
    import vmm_bench.cli

    # a GPU machine running these has the extras (matplotlib, transformers); an install of
    # '.[test]' may not: the flags are checked here, not the installation
    monkeypatch.setattr(vmm_bench.cli, "require", lambda extra, why: None)
    lines = [line for line in _joined(_text(name)).splitlines()
             if "-m vmm_core.cli bench" in line and not line.lstrip().startswith("#")]
    assert lines
    for line in lines:
        command = line.split("-m vmm_core.cli", 1)[1].split("2>&1")[0]
        command = (command.replace('"$OUT', f'"{tmp_path}').replace("${STEPS:-5}", "5")
                   .replace("${SLEEP_GIB:-4}", "4").replace('"$@"', ""))
        for key, value in _defaults(_text(name)).items():  # the script's own defaults
            command = command.replace(f'"${key}"', shlex.quote(value)).replace(f"${key}",
                                                                               value)
        args = build_parser().parse_args(shlex.split(command))
        if importlib.util.find_spec("matplotlib") is None:
            args.plot = None  # a GPU machine running these has it; '.[test]' alone may not
        bench_spec(args)  # output paths writable, cross-flag rules


def _engine_parts() -> dict[str, str]:
    """Each part of device_engine_scenarios.sh and its bench flags, variables filled in
    with the script's defaults."""
    text = _joined(_text("device_engine_scenarios.sh"))
    defaults = dict(re.findall(r'^(\w+)=\$\{\w+:-"?([^"}]*)"?\}', text, re.M))
    parts = {}
    for name, flags in re.findall(r"^\s*(?:[\w-]+\)\s*)?run (\S+) (.+?)(?: ;;)?$", text,
                                  re.M):
        for key, value in defaults.items():
            flags = flags.replace(f'"${key}"', shlex.quote(value))
        parts[name] = flags
    return parts


def test_every_part_of_the_engine_scenarios_script_parses_with_the_cli(tmp_path, monkeypatch):
    import vmm_bench.cli

    monkeypatch.setattr(vmm_bench.cli, "require", lambda extra, why: None)  # no transformers
    parts = _engine_parts()
    text = _text("device_engine_scenarios.sh")
    listed = re.search(r'^PARTS=\$\{PARTS:-"([^"]+)"\}', text, re.M).group(1).split()
    assert set(listed) <= set(parts), listed
    for name, flags in parts.items():
        argv = ["bench", "--backend", "cuda", "--model", "llama8b", "--layers", "32",
                *shlex.split(flags), "--json", str(tmp_path / f"{name}.json")]
        bench_spec(build_parser().parse_args(argv))
    for name, shape in (("executables", "piecewise"), ("executables-families", "families")):
        spec = bench_spec(build_parser().parse_args(
            ["bench", "--model", "llama8b", *shlex.split(parts[name])]))
        assert spec.scenarios == (shape,)  # each shape's tables print when its run ends
        # the budget served inline too: preparing ahead is judged against it in one run
        assert spec.engine.executables == ("all", "budget:25%", "budget:25%+ahead",
                                           "budget:25%+ahead+hint",
                                           "budget:25%+share+ahead+hint")
        assert spec.engine.strategies == ("vllm", "vmm")  # the reference first
        assert spec.engine.trace_steps == 100
        assert spec.engine.traces == ("uniform", "zipf", "drift")


def test_the_executables_part_leaves_the_install_room_within_ten_minutes():
    text = _text("device_engine_scenarios.sh")
    limit = int(re.search(r"^EXEC_TIMEOUT=\$\{EXEC_TIMEOUT:-(\d+)\}", text, re.M).group(1))
    assert limit <= SCRIPT_LIMIT_S - 120
    block = text[text.index("        executables)"):]
    block = block[:block.index(";;")]
    assert "PART_TIMEOUT=$EXEC_TIMEOUT" in block and "PART_TIMEOUT=$part_timeout_saved" in block


def test_the_integrations_step_keeps_to_ten_minutes_with_the_install():
    """The step the engine integrations' targets are measured with: its RL and sleep
    benchmarks bounded, together with the install and the torch_memory_saver wheel's,
    within ten minutes."""
    text = _joined(_text("device_rl_sleep.sh"))
    step = text[text.index('if [ "$STEP" = integrations ]'):text.index('if [ "$STEP" = group ]')]
    timeouts = [int(n) for n in re.findall(r"\btimeout (\d+)\b", step)]
    assert len(timeouts) == 3, timeouts  # the wheel's install, the RL step, the sleep rows
    assert sum(timeouts) <= SCRIPT_LIMIT_S - 30, timeouts  # the tree's install: ~10 s
    words = " ".join(step.split())
    assert "--strategies vmm,vllm,tms-compat,vllm-plugin,tms" in words
    assert "--sleep-rows vmm,vLLM-style,tms-compat,vllm-plugin,torch_memory_saver" in words


def test_every_part_of_the_check_script_fits_ten_minutes():
    """The CUDA suite in parts (the benchmark-child tests did not fit the time the whole
    suite left them): each part under one timeout inside ten minutes, and the parts name
    test files that exist."""
    text = _text("device_check.sh")
    assert int(_defaults(text)["PART_TIMEOUT"]) <= SCRIPT_LIMIT_S - 60
    assert 'left=$((PART_TIMEOUT - SECONDS))' in text
    parts = re.search(r"^case \$PART in ([\w|]+)\)", text, re.M).group(1).split("|")
    assert parts == ["fast", "bench", "rl", "decode"]
    root = SCRIPTS.parent
    for path in re.findall(r"tests/test_\w+\.py", text):
        assert (root / path).exists(), path


def test_the_step_probe_runs_every_way_on_the_host_backend():
    """The probe the executables part runs first (scripts/probe_exec_step.py), on the
    host's emulated executables: six ways of a step, each against the warm one."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(SCRIPTS / "probe_exec_step.py"), "--backend",
                          "host", "--pieces", "3", "--rounds", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("exec step probe: ")]
    labels = [ln.split(": ", 1)[1].rsplit(" us ", 1)[0].rsplit(None, 1)[0] for ln in lines[1:]]
    assert labels == ["warm", "updated, uploaded", "updated, not uploaded", "made, uploaded",
                      "beside updates", "beside Python"]
    assert lines[1].endswith("1.000x warm")


def test_the_budget_step_probe_runs_each_variant_on_the_host_backend(tmp_path):
    """scripts/probe_budget_steps.py on the host backend, two layers, four steps: each
    variant's line against every executable resident, and every step's record."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "DEV": "cpu", "LAYERS": "2", "STEPS": "4", "TRACES": "zipf",
           "VARIANTS": "all,settled,after-off,inline", "OUT": str(tmp_path)}
    out = subprocess.run([sys.executable, str(SCRIPTS / "probe_budget_steps.py")], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    lines = [ln.split()[0] for ln in out.splitlines() if " step " in ln and "x median" in ln]
    assert lines == ["all", "settled", "after-off", "inline"]
    records = json.loads((tmp_path / "budget_steps.json").read_text())
    assert all(len(r["rows"]) == 4 for r in records.values())
    assert records["inline zipf"]["misses"] > 0 and records["all zipf"]["misses"] == 0
